"""One adapter per checkpointing method, all behind :class:`~benchmarks.methods.base.Method`.

``REGISTRY`` maps the command-line names to the classes, in report order; ``datastates`` is the
reference every ratio is computed against; ``ref_copy_direct`` is the machine's limit (a copy into
a reused buffer + two O_DIRECT writers), shown as a row beside the methods.
"""

from __future__ import annotations

from .base import Checkpoint, Method, Pending
from .datastates_method import (
    Datastates,
    DatastatesFallback,
    DatastatesGuardedStateDict,
    DatastatesStateDict,
)
from .dcp import DcpAsync, DcpAsyncStager, DcpAsyncStagerBackground, DcpSave, ensure_process_group
from .reference import CopyDirect
from .safetensors_method import Safetensors
from .torch_save import TorchSave
from .torchsnapshot_method import SnapshotAsyncTake, SnapshotTake

REFERENCE = "datastates"

REGISTRY: dict[str, type[Method]] = {
    cls.name: cls
    for cls in (
        Datastates,
        DatastatesStateDict,
        DatastatesGuardedStateDict,
        CopyDirect,
        TorchSave,
        DcpSave,
        DcpAsync,
        DcpAsyncStager,
        DcpAsyncStagerBackground,
        SnapshotTake,
        SnapshotAsyncTake,
        Safetensors,
        DatastatesFallback,
    )
}


#: Run when --methods is not given. ``dcp_async_stager`` (persistent stager, staging on the caller)
#: is left out by default because it holds a second full copy of the state beside
#: ``dcp_async_stager_bg``; ask for it explicitly. So is ``datastates_fallback`` (it differs from
#: ``datastates`` in the restore only: ``--methods datastates,datastates_fallback`` measures the
#: cost of the fallback's check).
DEFAULT_METHODS = [n for n in REGISTRY if n not in ("dcp_async_stager", "datastates_fallback")]


def make_methods(names: list[str], options: dict) -> list[Method]:
    """Instantiate the named methods (unknown names raise ValueError listing the valid ones)."""
    unknown = [n for n in names if n not in REGISTRY]
    if unknown:
        raise ValueError(f"unknown method(s) {unknown}; choose from {', '.join(REGISTRY)}")
    return [REGISTRY[n](options) for n in REGISTRY if n in names]


__all__ = [
    "Checkpoint",
    "CopyDirect",
    "DEFAULT_METHODS",
    "Method",
    "Pending",
    "REFERENCE",
    "REGISTRY",
    "make_methods",
    "ensure_process_group",
]

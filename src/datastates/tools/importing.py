"""Bringing data in: a ``torch.save`` file, a safetensors file or a
``torch.distributed.checkpoint`` folder saved as a datastates checkpoint.

Behind ``datastates import`` and ``datastates.import_checkpoint``. The file is someone else's:
nothing is unpickled beyond what ``torch.load(weights_only=True)`` allows unless the caller says
it is trusted, and a file that is not of the format it claims is a CorruptCheckpointError naming
it (torch reports such files as RuntimeError, UnpicklingError or EOFError).
"""

from __future__ import annotations

import os
import zipfile
from typing import Any

import torch

from ..commit.catalog import CheckpointInfo
from ..errors import (
    CheckpointNotFoundError,
    ConfigError,
    CorruptCheckpointError,
    DatastatesError,
    UnsafeObjectError,
)


def import_checkpoint(
    src: str | os.PathLike,
    dest: str | os.PathLike,
    *,
    source: str = "torch",
    step: int | None = None,
    tag: str | None = None,
    overwrite: bool = False,
    config=None,
    trusted: bool = False,
) -> CheckpointInfo:
    """Save the state held by a file of another format as a datastates checkpoint in ``dest``.

    ``source``: ``"torch"`` (a ``torch.save`` file, loaded with ``weights_only=True`` unless
    ``trusted``; memory-mapped when it is the zip format, read whole when it is the legacy
    one), ``"safetensors"`` (a flat dict of tensors, read with the safetensors package: the
    ``safetensors`` extra; ConfigError saying so without it) or ``"dcp"`` (a
    ``torch.distributed.checkpoint`` folder, converted as DCP's own ``dcp_to_torch_save`` does:
    one ``DatastatesWriter`` wrote is read without unpickling anything but its values, with
    ``weights_only=True``; a stock one, written by ``FileSystemWriter``, keeps its metadata as
    a pickle and is read only when ``trusted``, UnsafeObjectError otherwise). A file that is not
    of the format raises CorruptCheckpointError naming it. The checkpoint is named ``tag`` or
    ``step-<step>`` (step 0 when neither is given) and records the source in its metadata.
    Returns its info once committed.
    """
    from ..checkpointer import Checkpointer
    from ..commit.round import LocalCommunicator

    src = os.path.abspath(os.fspath(src))
    if not os.path.exists(src):
        raise CheckpointNotFoundError(f"import: {src} does not exist")
    state = _read_foreign(src, source, trusted)
    if step is None and tag is None:
        step = 0
    with Checkpointer(dest, config, communicator=LocalCommunicator()) as ckpt:
        handle = ckpt.save(
            state,
            step=step,
            tag=tag,
            overwrite=overwrite,
            metadata={"imported_from": src, "imported_format": source},
        )
        return handle.wait()


def _read_foreign(src: str, source: str, trusted: bool) -> Any:
    if source == "torch":
        return _read_torch(src, trusted)
    if source == "safetensors":
        return _read_safetensors(src)
    if source == "dcp":
        from ..dcp.folders import load_state

        if not os.path.isdir(src):
            raise CheckpointNotFoundError(
                f"import: {src} is not a folder; --from dcp reads a "
                "torch.distributed.checkpoint folder"
            )
        return load_state(src, trusted=trusted)
    raise ConfigError(f"import: expected source 'torch', 'safetensors' or 'dcp', found {source!r}")


def _read_torch(src: str, trusted: bool) -> Any:
    """A ``torch.save`` file: memory-mapped when it is the zip format, read whole when it is
    the legacy format (``_use_new_zipfile_serialization=False``), which cannot be mapped."""
    if not os.path.isfile(src):
        raise ConfigError(f"import: {src} is not a file; --from torch reads a torch.save file")
    mappable = zipfile.is_zipfile(src)
    try:
        return torch.load(src, map_location="cpu", weights_only=not trusted, mmap=mappable)
    except Exception as exc:  # torch reports a bad file as RuntimeError, UnpicklingError, EOF...
        if isinstance(exc, DatastatesError):
            raise
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        if "weights_only" in str(exc) or "Unsupported global" in str(exc):
            raise UnsafeObjectError(
                f"import: {src} holds Python objects that "
                f"weights_only=True refuses ({first}); pass trusted=True "
                "(--trusted) only if you trust where the file came from"
            ) from None
        raise CorruptCheckpointError(
            f"import: {src} is not a readable torch.save file ({type(exc).__name__}: {first})"
        ) from None


def _read_safetensors(src: str) -> Any:
    try:
        from safetensors.torch import load_file
    except ImportError:
        raise ConfigError(
            f"import --from safetensors: expected the safetensors package to read "
            f"{src}, found it not installed: pip install safetensors (or "
            "pip install '.[safetensors]' in a datastates checkout)"
        ) from None
    if not os.path.isfile(src):
        raise ConfigError(f"import: {src} is not a file; --from safetensors reads one file")
    try:
        return load_file(src)
    except Exception as exc:  # SafetensorError, OSError from a bad header or a short file
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
        raise CorruptCheckpointError(
            f"import: {src} is not a readable safetensors file ({type(exc).__name__}: {first})"
        ) from None

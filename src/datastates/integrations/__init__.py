"""Framework integrations, each at the framework's own plug-in point (no monkeypatching).

Every adapter lives in its own module and imports its framework only when that module is
imported, so ``import datastates`` never needs DeepSpeed, Lightning, transformers or DCP:

- :mod:`datastates.integrations.deepspeed` — :class:`DeepSpeedCheckpointEngine`, the class
  DeepSpeed's ``"datastates_ckpt"`` config key instantiates as ``datastates.CheckpointEngine``;
- :mod:`datastates.integrations.lightning` — :class:`DatastatesCheckpointIO`, a Lightning
  ``CheckpointIO`` plug-in, its optional lazy-snapshot callback, and the memory-tier callback
  :class:`DatastatesMemoryCheckpoint`;
- :mod:`datastates.integrations.hf` — :class:`DatastatesTrainer`, a ``transformers.Trainer``
  whose checkpoints are datastates checkpoints;
- :mod:`datastates.integrations.dcp` — :class:`DatastatesWriter` / :class:`DatastatesReader`,
  a ``torch.distributed.checkpoint`` storage layer.

``python -m benchmarks.frameworks`` (in the repository, not the installed package) compares each
framework's default checkpointing with these.

The names below resolve lazily (PEP 562) so that ``from datastates.integrations import
DatastatesCheckpointIO`` imports Lightning, and nothing else does.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "DeepSpeedCheckpointEngine": "deepspeed",
    "enable_lazy_snapshots": "deepspeed",
    "DatastatesCheckpointIO": "lightning",
    "DatastatesSnapshotCallback": "lightning",
    "DatastatesMemoryCheckpoint": "lightning",
    "DatastatesTrainer": "hf",
    "DatastatesWriter": "dcp",
    "DatastatesReader": "dcp",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_EXPORTS))

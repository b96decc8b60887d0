"""datastates: lazy asynchronous checkpointing of PyTorch training state.

Quick start::

    import datastates
    with datastates.Checkpointer("ckpts") as ckpt:
        handle = ckpt.save({"model": model, "optimizer": opt, "rng": datastates.RNGState()}, step=10)
        ...                       # training continues; opt.step() waits only for the capture
        # restore() first waits for in-flight saves, so this restores the step-10 checkpoint
        ckpt.restore({"model": model, "optimizer": opt, "rng": datastates.RNGState()})
"""

from .checkpointer import Checkpointer
from .format.records import CheckpointInfo, SkippedCheckpoint
from .config import CheckpointConfig
from .memory import MemoryTier
from .data import ElasticLoader, ElasticSampler
from .commit.round import LocalCommunicator, StoreCommunicator
from .save.capture import add_step_waiter, mark_lazy, torch_optimizer
from .save.job import SaveHandle, SaveStats
from .providers.tree import TensorShard
from .errors import (
    CheckpointerClosedError,
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    CommitError,
    CommitTimeoutError,
    CommitUnknownError,
    ConfigError,
    CorruptCheckpointError,
    DatastatesError,
    KeeperError,
    KeeperUnresponsiveError,
    LazyWriteError,
    ReshardError,
    RestoreAbortedError,
    SerializationError,
    StateMismatchError,
    BucketNotFoundError,
    StorageAccessError,
    StorageError,
    UnsafeObjectError,
    UnsupportedFormatError,
)
from .providers import (
    Capture,
    ModuleProvider,
    NumpyRandomProvider,
    OptimizerProvider,
    ProviderRegistry,
    RNGState,
    RNGStateProvider,
    StatefulProvider,
    StateProvider,
    eager,
    lazy,
)
from .restore.plan import RestoreReport
from .preemption import Preemption
from .tools.export import export, import_checkpoint
from .tools.describe import inspect

from ._version import __version__  # noqa: E402,F401

__all__ = [
    "Capture",
    "CheckpointConfig",
    "CheckpointerClosedError",
    "CheckpointExistsError",
    "CheckpointInfo",
    "CheckpointNotFoundError",
    "CheckpointWriteError",
    "Checkpointer",
    "CommitError",
    "CommitTimeoutError",
    "CommitUnknownError",
    "ConfigError",
    "ElasticLoader",
    "ElasticSampler",
    "LocalCommunicator",
    "StoreCommunicator",
    "CorruptCheckpointError",
    "DatastatesError",
    "KeeperError",
    "KeeperUnresponsiveError",
    "LazyWriteError",
    "MemoryTier",
    "ModuleProvider",
    "NumpyRandomProvider",
    "OptimizerProvider",
    "Preemption",
    "ProviderRegistry",
    "RNGState",
    "RNGStateProvider",
    "ReshardError",
    "RestoreAbortedError",
    "RestoreReport",
    "SaveHandle",
    "SaveStats",
    "SerializationError",
    "SkippedCheckpoint",
    "StateMismatchError",
    "StateProvider",
    "StorageAccessError",
    "StorageError",
    "BucketNotFoundError",
    "StatefulProvider",
    "TensorShard",
    "UnsafeObjectError",
    "UnsupportedFormatError",
    "add_step_waiter",
    "eager",
    "export",
    "import_checkpoint",
    "inspect",
    "lazy",
    "mark_lazy",
    "torch_optimizer",
    "CheckpointEngine",
]


def __getattr__(name):
    # DeepSpeed does `from datastates import CheckpointEngine`; import its adapter only then.
    if name == "CheckpointEngine":
        from .integrations.deepspeed import CheckpointEngine

        return CheckpointEngine
    raise AttributeError(f"module 'datastates' has no attribute {name!r}")

"""The memory tier: checkpoints in shared memory, owned by a keeper process per node that
outlives the trainer (docs/memory-tier.md)."""

from .options import MemoryTier

__all__ = ["MemoryTier"]

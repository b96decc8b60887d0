"""One frozen configuration object, passed explicitly (nothing is read from the environment here)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .errors import ConfigError
from .memory.options import MemoryTier

_ALIGN = 4096


@dataclass(frozen=True)
class CheckpointConfig:
    """How a :class:`~datastates.Checkpointer` stages, writes, commits and restores.

    Sizes are in bytes. Every field has a default that suits a single GPU or CPU process.
    """

    #: Largest size of the host cache (pinned on CUDA), allocated once at the first save and
    #: reused by every save: that save's state plus one unit, at most this. A larger state
    #: streams through it with backpressure. A Checkpointer that only restores allocates none.
    host_cache_bytes: int = 1 << 30
    #: Largest unit copied into the cache and written with one request; tensors larger than
    #: this are split. Rounded down to a multiple of 4096.
    chunk_bytes: int = 64 << 20
    #: Threads writing cache units to the file (each computes the checksums of its units).
    writer_threads: int = 2
    #: Threads reading on restore.
    reader_threads: int = 4
    #: "auto" uses O_DIRECT where the file system accepts it, else buffered writes;
    #: "direct" requires it; "buffered" never uses it.
    io_mode: str = "auto"
    #: fsync every file and directory before commit (disable only for throwaway benchmarks).
    fsync: bool = True
    #: Uncommitted saves allowed in flight; a further save() waits for the oldest to commit.
    max_pending_saves: int = 2
    #: Retention: keep the newest ``keep_last`` committed checkpoints (None keeps all) ...
    keep_last: int | None = None
    #: ... and additionally every checkpoint whose step is a multiple of ``keep_every`` ...
    keep_every: int | None = None
    #: ... and the ``keep_best`` checkpoints with the best value of the metric ``best_metric``
    #: (``save(..., metrics={...})``; ties: the newer wins). Needs ``best_metric``. It only
    #: protects checkpoints from ``keep_last``: with ``keep_last`` None everything is kept.
    keep_best: int | None = None
    #: The metric ``keep_best`` ranks by; checkpoints saved without it are never among the best.
    best_metric: str | None = None
    #: "min": the lowest values are the best (a loss); "max": the highest (an accuracy).
    best_mode: str = "min"
    #: Verify checksums on restore.
    verify: bool = True
    #: Deadline of a save, measured on every rank from its ``save()`` call: a save not decided
    #: by then fails on every rank with CommitTimeoutError, nothing committed (it must cover
    #: writing the checkpoint). It bounds every wait of the save — ``save()`` held up by a full
    #: host cache, ``wait()``, the next optimizer step, its uploads: a wait ends at the deadline,
    #: or when the one storage request then in flight gives up (on an object store, after the
    #: ``read_timeout``/``max_attempts`` of ``storage_options``). A save whose commit round began
    #: before the deadline finishes it.
    commit_timeout_s: float = 300.0
    #: Multi-rank: compare a CRC-32 of every declared-replicated tensor across ranks at commit
    #: and fail the save if replicas differ (costs one checksum pass over the replicated bytes
    #: on each rank, before the snapshot completes).
    replica_check: bool = True
    #: Temporaries older than this are removed when a Checkpointer opens the directory.
    stale_tmp_age_s: float = 24 * 3600.0
    #: Whether ``save()`` waits for the lazy tensors of its state. It never changes which tensors
    #: are lazy: the capture rule decides that (docs/loop.md, "What is captured lazily"). "auto":
    #: ``save()`` returns before they are copied when this Checkpointer guards an optimizer (one
    #: part of a save, or passed to guard(); its next step waits for the copy), and waits for the
    #: whole snapshot otherwise. "always": ``save()`` never waits for them, guarded or not; the
    #: caller calls ``handle.wait_snapshot()`` before changing a lazy tensor that no guarded
    #: step protects (a tensor marked with ``datastates.lazy``). "never": ``save()`` returns once
    #: the whole snapshot is in the host cache.
    lazy: str = "auto"
    #: Let save() pickle Python objects that restore()'s default safe loading refuses (classes
    #: outside its allowlist, a torch DataLoader). False: save() raises UnsafeObjectError for
    #: them, naming the key, so no checkpoint holds what a default restore cannot read. True:
    #: they are saved, and restore()/load() need trusted=True (or safe_globals=[...]).
    allow_unsafe_objects: bool = False
    #: Keep checkpoints in shared memory, owned by a keeper process that outlives the trainer,
    #: and write every ``persist_every``-th to the directory (docs/memory-tier.md). None: every
    #: save goes to the directory.
    memory_tier: MemoryTier | None = None

    def __post_init__(self) -> None:
        def need(cond: bool, what: str) -> None:
            if not cond:
                raise ConfigError(f"CheckpointConfig: expected {what}")

        need(
            isinstance(self.host_cache_bytes, int) and self.host_cache_bytes >= 2 * _ALIGN,
            f"host_cache_bytes >= {2 * _ALIGN}, found {self.host_cache_bytes!r}",
        )
        need(
            isinstance(self.chunk_bytes, int) and self.chunk_bytes >= _ALIGN,
            f"chunk_bytes >= {_ALIGN}, found {self.chunk_bytes!r}",
        )
        need(
            isinstance(self.writer_threads, int) and self.writer_threads >= 1,
            f"writer_threads >= 1, found {self.writer_threads!r}",
        )
        need(
            isinstance(self.reader_threads, int) and self.reader_threads >= 1,
            f"reader_threads >= 1, found {self.reader_threads!r}",
        )
        need(
            self.io_mode in ("auto", "direct", "buffered"),
            f"io_mode in ('auto', 'direct', 'buffered'), found {self.io_mode!r}",
        )
        need(
            isinstance(self.max_pending_saves, int) and self.max_pending_saves >= 1,
            f"max_pending_saves >= 1, found {self.max_pending_saves!r}",
        )
        need(
            self.keep_last is None or (isinstance(self.keep_last, int) and self.keep_last >= 1),
            f"keep_last None or >= 1, found {self.keep_last!r}",
        )
        need(
            self.keep_every is None or (isinstance(self.keep_every, int) and self.keep_every >= 1),
            f"keep_every None or >= 1, found {self.keep_every!r}",
        )
        self._check_best(need)
        for name in ("commit_timeout_s", "stale_tmp_age_s"):
            value = getattr(self, name)
            need(
                isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
                f"{name} a number > 0 (seconds), found {value!r}",
            )
        need(
            isinstance(self.replica_check, bool),
            f"replica_check True or False, found {self.replica_check!r}",
        )
        need(
            self.lazy in ("auto", "always", "never"),
            f"lazy in ('auto', 'always', 'never'), found {self.lazy!r}",
        )
        need(
            isinstance(self.allow_unsafe_objects, bool),
            f"allow_unsafe_objects True or False, found {self.allow_unsafe_objects!r}",
        )
        need(
            self.memory_tier is None or isinstance(self.memory_tier, MemoryTier),
            f"memory_tier None or a MemoryTier, found {self.memory_tier!r}",
        )

    def _check_best(self, need) -> None:
        """The fields of retention by metric: ``keep_best`` >= 1 needs ``best_metric``."""
        need(
            self.keep_best is None or (type(self.keep_best) is int and self.keep_best >= 1),
            f"keep_best None or an int >= 1, found {self.keep_best!r}",
        )
        need(
            self.best_metric is None or (isinstance(self.best_metric, str) and self.best_metric),
            f"best_metric None or a metric name (a non-empty str), found {self.best_metric!r}",
        )
        need(
            self.keep_best is None or self.best_metric is not None,
            f"best_metric (the metric keep_best ranks by) with keep_best={self.keep_best}, "
            "found None",
        )
        need(
            self.best_mode in ("min", "max"),
            f"best_mode in ('min', 'max'), found {self.best_mode!r}",
        )

    @property
    def unit_bytes(self) -> int:
        """The cache slot size: chunk_bytes aligned down, and at most half the cache."""
        unit = min(self.chunk_bytes, self.host_cache_bytes // 2)
        return max(_ALIGN, unit - unit % _ALIGN)

    def replace(self, **changes) -> "CheckpointConfig":
        """A copy with some fields changed (validated again)."""
        return dataclasses.replace(self, **changes)

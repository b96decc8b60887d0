"""The memory tier's settings (``CheckpointConfig(memory_tier=MemoryTier(...))``)."""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import ConfigError

#: the fields of CheckpointConfig a keeper needs to commit into storage (passed when it starts)
STORAGE_FIELDS = (
    "keep_last",
    "keep_every",
    "keep_best",
    "best_metric",
    "best_mode",
    "fsync",
    "commit_timeout_s",
    "stale_tmp_age_s",
)


@dataclass(frozen=True)
class MemoryTier:
    """Keep checkpoints in memory that outlives the training process (docs/memory-tier.md).

    A save whose step is not due for storage (``persist_every``) commits into a checkpoint root
    in shared memory (``root``, a tmpfs such as ``/dev/shm``) owned by a keeper process of the
    node; a restarted trainer restores from there when it holds the newest step. Storage stays
    the durable tier: the keeper writes the newest memory checkpoint there through the same
    commit protocol when the trainer dies, detaches or the keeper is told to stop.
    """

    #: A tmpfs directory; the memory of a job is ``<root>/datastates-<uid>-<digest>/`` (the
    #: digest is of the storage directory's real path, so a restarted trainer finds it again).
    root: str = "/dev/shm"
    #: Committed memory checkpoints kept besides the one being written: host memory holds at
    #: most ``keep_last + 1`` states of this size. 1 keeps the newest (the previous one stays
    #: until the next is committed); 2 adds an older memory checkpoint to fall back to.
    keep_last: int = 1
    #: ``save(step=s)`` writes to storage when ``s % persist_every == 0`` and to memory
    #: otherwise (``save(..., persist=True/False)`` decides for one save; a tag always goes to
    #: storage). None: every save goes to memory unless ``persist=True``.
    persist_every: int | None = 10
    #: The keeper writes the newest memory checkpoint to storage (if storage holds no checkpoint
    #: of that step or a newer one) when the trainer dies, detaches (``close()``) or the keeper
    #: gets SIGTERM, before it waits for a restarted trainer.
    persist_on_exit: bool = True
    #: With no trainer attached for this long, the keeper removes the memory and exits.
    idle_timeout_s: float = 300.0
    #: No keeper running: rank 0 starts one (``python -m datastates keeper``, in a session of its
    #: own so that the launcher's kill of the workers does not reach it). False: one must have
    #: been started (``datastates keeper DIR``), else KeeperError at construction.
    spawn: bool = True
    #: How long construction waits for the keeper to answer (it may be writing to storage).
    start_timeout_s: float = 120.0
    #: On SIGTERM, how long the keeper waits for attached trainers to detach before it persists
    #: and exits.
    grace_s: float = 30.0
    #: Who writes the saves due for storage: ``"keeper"`` commits them into memory first and the
    #: keeper copies them into storage in its own process (``memory/handoff.py``: the trainer's
    #: threads and host cache are free once the memory commit is done); ``"trainer"`` commits
    #: them straight into storage from the trainer's pipeline. None (the default): the keeper
    #: on one node, the trainers on several (a keeper holds its node's shards only; ``"keeper"``
    #: there is a ConfigError).
    storage_writer: str | None = None
    #: The keeper's log; None: ``<tempdir>/datastates-keeper-<uid>-<digest>.log``.
    log_path: str | None = None

    def __post_init__(self) -> None:
        def need(cond: bool, what: str) -> None:
            if not cond:
                raise ConfigError(f"MemoryTier: expected {what}")

        need(
            isinstance(self.root, str) and self.root != "",
            f"root a directory path, found {self.root!r}",
        )
        need(
            type(self.keep_last) is int and self.keep_last >= 1,
            f"keep_last an int >= 1, found {self.keep_last!r}",
        )
        need(
            self.persist_every is None
            or (type(self.persist_every) is int and self.persist_every >= 1),
            f"persist_every None or an int >= 1, found {self.persist_every!r}",
        )
        for name in ("persist_on_exit", "spawn"):
            need(
                isinstance(getattr(self, name), bool),
                f"{name} True or False, found {getattr(self, name)!r}",
            )
        for name in ("idle_timeout_s", "start_timeout_s", "grace_s"):
            value = getattr(self, name)
            need(
                isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0,
                f"{name} a number > 0 (seconds), found {value!r}",
            )
        need(
            self.storage_writer in (None, "keeper", "trainer"),
            f"storage_writer None, 'keeper' or 'trainer', found {self.storage_writer!r}",
        )
        need(
            self.log_path is None or (isinstance(self.log_path, str) and self.log_path != ""),
            f"log_path None or a file path, found {self.log_path!r}",
        )

    def goes_to_storage(self, step: int | None, persist: bool | None) -> bool:
        """Whether a save of ``step`` (None: a tag) with ``persist`` is written to storage."""
        if persist is not None:
            return persist
        if step is None:
            return True
        return self.persist_every is not None and step % self.persist_every == 0

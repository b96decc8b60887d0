"""The public entry point: a Checkpointer saves and restores training state in one directory,
through one TierCheckpointer for storage and, with ``config.memory_tier``, one for memory."""

from __future__ import annotations

import atexit
import builtins
import itertools
import logging
import os
import threading
import weakref
from typing import Any, Iterable, Mapping

import torch

from .commit.catalog import DamagedCheckpoint
from .config import CheckpointConfig
from .directory import TierCheckpointer, wait_all
from .errors import CheckpointerClosedError, CheckpointNotFoundError, ConfigError
from .format.records import CheckpointInfo
from .memory.tiers import Tiers
from .providers import ProviderRegistry
from .restore.reader import RestoreReport
from .save.arguments import check_target
from .save.job import SaveHandle
from .storage import normalize

log = logging.getLogger("datastates")


class Checkpointer:
    """Saves and restores training state in one directory of checkpoints (docs/loop.md).

    Call ``save``/``restore``/``load`` from the training thread; background threads capture and
    write, and never touch the training process group. Multi-rank: construct it on every rank
    after ``torch.distributed.init_process_group``; every rank then makes the same saves in the
    same order (docs/distributed.md). ``directory`` is a local path or ``s3://bucket/prefix``
    (``storage_options``: endpoint and credentials; docs/storage.md). Nothing is created before
    the first save. ``share=other`` uses ``other``'s host cache, threads, configuration and
    communicator. ``close()`` (or the ``with`` block, or interpreter exit) waits for the saves
    in flight. With ``config.memory_tier`` the checkpoints of most steps are kept in memory:
    ``memory`` and ``storage`` are the two tiers' TierCheckpointers (docs/memory-tier.md).

    Raises NotADirectoryError (a local path that is or lies below a file), BucketNotFoundError
    or StorageAccessError (an object store), CommitTimeoutError (a rank did not construct it
    within ``commit_timeout_s``), KeeperError (the memory tier did not open), ConfigError.
    """

    storage: TierCheckpointer
    comm: Any

    def __init__(
        self,
        directory: str | os.PathLike,
        config: CheckpointConfig | None = None,
        *,
        registry: ProviderRegistry | None = None,
        communicator=None,
        share: "Checkpointer | None" = None,
        storage_options: Mapping[str, Any] | None = None,
    ):
        if share is not None:
            share._check_open()
            if communicator is not None and communicator is not share.comm:
                raise ValueError(
                    "a Checkpointer created with share= uses the shared one's communicator"
                )
        if share is None:
            config = config if config is not None else CheckpointConfig()
        #: The memory tier's parts (node groups, keeper link, hand-off; memory/tiers.py), or
        #: None: ``config.memory_tier`` unset, or a Checkpointer made with ``share=``.
        self.tiers: Tiers | None = None
        #: The memory tier's TierCheckpointer, or None (docs/memory-tier.md).
        self.memory: TierCheckpointer | None = None
        if share is not None or config is None or config.memory_tier is None:
            #: The tier of the directory's checkpoints (storage).
            self.storage = TierCheckpointer(
                directory,
                config,
                registry=registry,
                communicator=communicator,
                share=share.storage if share is not None else None,
                storage_options=storage_options,
            )
        else:
            self.storage, self.memory, self.tiers = _open_tiered(
                directory, config, registry, communicator, storage_options
            )
        storage = self.storage
        self.directory, self.store, self.config = storage.directory, storage.store, storage.config
        self.comm, self.registry = storage.comm, storage.registry
        self.rank, self.world_size = storage.rank, storage.world_size
        self._closed = False
        self._pid = os.getpid()  # a forked child inherits this object, not its threads
        #: Threads that called save(): at exit, the non-daemon ones are waited for first.
        self._savers: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()
        self._open_key = _close_at_exit(self)

    # ------------------------------------------------------------ save
    def save(
        self,
        state: Any,
        step: int | None = None,
        *,
        tag: str | None = None,
        metadata: dict | None = None,
        overwrite: bool = False,
        replicated: bool | Iterable[str] = False,
        optimizers: Iterable[Any] = (),
        metrics: dict | None = None,
        persist: bool | None = None,
        view: str | None = None,
    ) -> SaveHandle:
        """Start a checkpoint of ``state``, named ``tag`` or ``step-<step>``; return its handle.

        Returns once the eager tensors are in the host cache and the Python objects serialized;
        the tensors of guarded optimizers are captured lazily, before their next ``step()``
        (docs/loop.md, "How a save works"). ``replicated``: tensors identical on every rank,
        written once (True, or key prefixes). ``metrics``: numbers kept in the manifest, which
        ``keep_best`` ranks by. ``persist`` (memory tier only): True for storage, False for
        memory, None to let ``MemoryTier.persist_every`` decide (docs/memory-tier.md). ``view``: a
        top-level key of a dict state whose value alone ``torch.load`` gives of each rank's shard
        file (docs/format.md, "The pickle").

        Raises, with nothing written: ConfigError for a step, tag or persist ``save()`` refuses
        (checked first, by the check ``restore``/``load``/``delete`` share) or a ``view`` that is
        not a top-level key of a dict state; TypeError or
        ValueError for metadata or metrics that do not survive JSON; UnsafeObjectError for an
        object a safe restore would refuse (unless ``config.allow_unsafe_objects``);
        SerializationError for a tensor no checkpoint holds; CheckpointExistsError for a name
        committed already (unless ``overwrite``). A failure after this returns, on any rank,
        fails the save on every rank within ``commit_timeout_s``: ``handle.wait()`` raises it
        (CommitError).
        """
        check_target("save", step, tag, persist)  # before routing: one check, every tier
        self._check_open()
        self._savers.add(threading.current_thread())
        where = self.tiers.route(step, tag, persist) if self.tiers is not None else "storage"
        if persist is False and self.tiers is None:
            raise ConfigError(
                "save(persist=False) keeps a checkpoint in the memory tier; this "
                "Checkpointer has none (CheckpointConfig(memory_tier="
                "MemoryTier()))"
            )
        tier = self.storage if where == "storage" or self.memory is None else self.memory
        return tier.save(
            state,
            step,
            tag=tag,
            metadata=metadata,
            overwrite=overwrite,
            replicated=replicated,
            optimizers=optimizers,
            metrics=metrics,
            persist=True if where == "handoff" else None,
            view=view,
        )

    def guard(self, optimizer: Any) -> None:
        """Make ``optimizer.step()`` wait until in-flight snapshots are captured (idempotent).

        Done automatically for the optimizers part of a save. ``optimizer`` is a torch optimizer
        or a wrapper (accelerate, DeepSpeed, Lightning): the hook goes on the torch optimizer
        found through ``.optimizer``, whose ``step`` runs. A guarded optimizer that is not part
        of a later save makes its parameters eager in that save (its step writes them). Installs
        a step pre-hook; no framework code is patched. The hook never raises: a failed save
        surfaces on its handle. Raises TypeError when no torch optimizer is found.
        """
        self.storage.guard(optimizer)

    def wait(self) -> list[CheckpointInfo]:
        """Wait for every in-flight save (of both tiers, with a memory tier; on rank 0 also
        until the keeper has written the saves due for storage there); raise the first failure
        (a keeper's write that failed: KeeperError, once, on rank 0)."""
        try:
            infos = wait_all(sorted(self._in_flight(), key=lambda h: h.started))
        finally:
            for tier in (self.storage, self.memory):
                if tier is not None:
                    tier.forget_finished()
        if self.tiers is not None:
            self.tiers.wait()
        return infos

    # ------------------------------------------------------------ restore
    def restore(
        self,
        state: Any,
        step: int | None = None,
        *,
        tag: str | None = None,
        keys=None,
        strict: bool = True,
        verify: bool | None = None,
        trusted: bool = False,
        safe_globals: Iterable[Any] = (),
        rank_policy: str = "strict",
        cast: bool = False,
        fallback: bool = False,
    ) -> RestoreReport:
        """Restore a committed checkpoint (the latest if no step/tag) into the live ``state``,
        in place, and return a RestoreReport.

        Strict by default: keys, structure, shapes, dtypes and plain values' types must match,
        else StateMismatchError before anything is modified (docs/resume.md, "What a restore
        matches"); ``strict=False`` leaves what does not match alone and lists it in the report.
        ``keys``: key prefixes to restore. ``cast=True``: a floating-point tensor restores into
        a live one of another floating-point dtype (docs/guarantees.md). Python objects load
        safely unless ``trusted=True`` or their classes are in ``safe_globals``. At another
        world size, per-rank state needs ``rank_policy`` "rank0" or "same" (ReshardError
        otherwise; docs/world-size.md). ``fallback=True``: the newest checkpoint every rank
        verifies, damaged ones skipped and moved aside (docs/resume.md). With a memory tier the
        newest step of either tier is read, memory on a tie (``report.tier``). First waits for
        the saves in flight.

        Raises ConfigError (a bad step/tag, ``fallback`` with step/tag, an unknown
        ``rank_policy``), CheckpointNotFoundError, StateMismatchError, ReshardError,
        CorruptCheckpointError (a checksum failed while reading: tensors filled so far took
        their new values, plain values and providers did not; run ``verify`` first to rule it
        out), RestoreAbortedError (another rank failed a fallback restore).
        """
        check_target("restore", step, tag)
        self._check_open()
        report = None
        if self.tiers is not None:
            report = self._from_memory(
                step,
                tag,
                lambda memory: memory.restore(
                    state,
                    step,
                    tag=tag,
                    keys=keys,
                    strict=strict,
                    trusted=trusted,
                    safe_globals=safe_globals,
                    rank_policy=rank_policy,
                    cast=cast,
                    fallback=step is None and tag is None,
                    verify=True,
                ),
            )
            if report is not None:
                report.tier = "memory"
        if report is None:
            report = self.storage.restore(
                state,
                step,
                tag=tag,
                keys=keys,
                strict=strict,
                verify=verify,
                trusted=trusted,
                safe_globals=safe_globals,
                rank_policy=rank_policy,
                cast=cast,
                fallback=fallback,
            )
            if self.tiers is not None:
                report.tier_fallback = self.tiers.unavailable
        if self.tiers is not None and step is None and tag is None:
            self.tiers.after_restore(report.step)
        return report

    def load(
        self,
        step: int | None = None,
        *,
        tag: str | None = None,
        keys=None,
        map_location: Any = None,
        verify: bool | None = None,
        trusted: bool = False,
        safe_globals: Iterable[Any] = (),
        rank_policy: str = "strict",
        dtype: torch.dtype | None = None,
        fallback: bool = False,
    ) -> Any:
        """Load a committed checkpoint into new objects: the structure that was saved, with
        modules and optimizers as their state dicts (what ``torch.load`` of them would give).
        ``dtype`` (a floating-point torch dtype, else ConfigError) converts every floating-point
        tensor to it with ``Tensor.to`` (integer, bool and complex tensors, and NumPy arrays,
        stay as saved). Like ``restore``, first waits for the saves in flight on this pipeline.
        ``fallback=True``: the newest checkpoint every rank reads intact, as for ``restore``
        (the skipped ones are in the WARNINGs only). With ``config.memory_tier``, the tier is
        chosen as for ``restore``. A step or tag that ``save()`` would refuse raises the same
        ConfigError as there (named ``load()``), first."""
        check_target("load", step, tag)
        self._check_open()
        if self.tiers is not None:
            loaded = self._from_memory(
                step,
                tag,
                lambda memory: memory.load(
                    step,
                    tag=tag,
                    keys=keys,
                    map_location=map_location,
                    trusted=trusted,
                    safe_globals=safe_globals,
                    rank_policy=rank_policy,
                    dtype=dtype,
                    fallback=step is None and tag is None,
                    verify=True,
                ),
            )
            if loaded is not None:
                return loaded
        return self.storage.load(
            step,
            tag=tag,
            keys=keys,
            map_location=map_location,
            verify=verify,
            trusted=trusted,
            safe_globals=safe_globals,
            rank_policy=rank_policy,
            dtype=dtype,
            fallback=fallback,
        )

    def _from_memory(self, step, tag, read):
        """``read(memory)`` with the memory tier's Checkpointer if it holds what is asked for
        (every rank agrees: ``Tiers.choosing``); None to read storage: memory does not hold it,
        or no memory checkpoint is intact on every rank (a WARNING). Before storage is read,
        the keeper writes nothing there (``Tiers.quiet_storage``)."""
        latest = step is None and tag is None
        self.storage.drain()
        with self.tiers.choosing(step, tag, self.storage.latest() if latest else None) as chosen:
            if chosen:
                try:
                    return read(self.memory)
                except CheckpointNotFoundError as exc:
                    log.warning(
                        "no memory checkpoint is intact on every rank (%s); restoring "
                        "from storage %s",
                        exc,
                        self.directory,
                    )
        # The latest is agreed (every rank is here); a named one is read by each rank alone.
        self.tiers.quiet_storage(together=latest or not chosen)
        return None

    # ------------------------------------------------------------ listing
    def list(self) -> builtins.list[CheckpointInfo]:
        """Committed checkpoints, oldest first, in commit order (``CheckpointInfo.seq``); empty
        when the directory does not exist yet (nothing was saved there). With a memory tier,
        the directory's (storage's): ``self.memory.list()`` lists the memory tier's."""
        return self.storage.list()

    def latest(self) -> CheckpointInfo | None:
        """The newest committed checkpoint, or None (nothing saved yet).

        The newest is the last commit (with a memory tier: the highest step of either tier,
        memory on a tie), so the resume loop never saves a committed step twice
        (docs/resume.md). Damaged checkpoints are never chosen; each one passed over is named
        in a WARNING."""
        newest = self.storage.latest()
        return self.tiers.newest(newest) if self.tiers is not None else newest

    def damaged(self) -> builtins.list[DamagedCheckpoint]:
        """The damaged checkpoints of the directory, by name: directories whose
        ``manifest.json`` exists but does not read or validate (one listing of the directory;
        empty when it does not exist). They are never restored; ``delete()`` removes one.
        A listing checks every manifest's checksum but validates only the head of all but the
        newest (docs/format.md, "Which checkpoint is the latest"): an older manifest whose
        checksum holds and whose body does not validate (only a faulty or hostile writer makes
        one) is listed, and reading it raises CorruptCheckpointError; ``datastates verify``
        reads every one whole."""
        return self.storage.damaged()

    def delete(self, step: int | None = None, *, tag: str | None = None) -> None:
        """Delete a checkpoint, committed or damaged, named by exactly one of ``step`` and
        ``tag`` (rank 0 does the work).

        Only a directory holding a ``manifest.json`` is removed. Raises ConfigError (neither or
        both, or a name ``save()`` refuses) and CheckpointNotFoundError (nothing there is a
        checkpoint), before anything is removed; with a memory tier whose keeper writes storage,
        CommitTimeoutError if that write does not end within ``commit_timeout_s``
        (docs/memory-tier.md)."""
        self.storage.delete(step, tag=tag)

    # ------------------------------------------------------------ lifecycle
    def close(self, stop_keeper: bool = False) -> None:
        """Wait for in-flight saves, stop the threads, free the host cache (idempotent).

        Failures of saves nobody awaited are re-issued as warnings, never lost. With
        ``config.memory_tier``, rank 0 then detaches from the keeper, which writes the newest
        memory checkpoint to storage if storage lacks its step (``persist_on_exit``) and keeps
        the memory for a trainer that attaches within ``idle_timeout_s``; ``stop_keeper=True``
        (the job is over) makes it write and then remove the memory and end at once."""
        if self._closed:
            return
        self._closed = True
        _OPEN.pop(self._open_key, None)
        try:
            if self.tiers is not None:  # after storage's saves: the tier may commit there too
                self.storage.finish()
                self.tiers.close(stop_keeper)
        finally:
            self.storage.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _in_flight(self) -> builtins.list[SaveHandle]:
        return self.storage.in_flight() + (self.memory.in_flight() if self.memory else [])

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointerClosedError(f"the Checkpointer of {self.directory} is closed")


def _open_tiered(directory, config, registry, communicator, storage_options):
    """The storage and memory TierCheckpointers of a Checkpointer with ``config.memory_tier``,
    and the tier's parts: storage opens first, with the policy the tier gives it, then the tier
    beside it (memory/tiers.py: node groups, keepers, the memory TierCheckpointer)."""
    tiers = Tiers(normalize(directory), config.memory_tier, config)
    storage = TierCheckpointer(
        directory,
        config,
        registry=registry,
        communicator=communicator,
        storage_options=storage_options,
        policy=tiers.storage_policy(),
    )
    try:
        memory = tiers.open(storage)
    except BaseException:
        storage.close()
        raise
    return storage, memory, tiers


#: Checkpointers not closed yet, in the order they were made (see ``_close_at_exit``). Held
#: strongly, as its threads hold its pipeline: one dropped unclosed (a local of a function that
#: returned) with a save in flight still commits it at exit.
_OPEN: dict[int, Checkpointer] = {}
_opened = itertools.count()
_exit_hooks_registered = False


def _close_at_exit(checkpointer: Checkpointer) -> int:
    """Have ``checkpointer`` closed at interpreter exit if it is still open then, as
    ``concurrent.futures`` finishes its work: a script whose loop ends, or raises outside a
    ``with`` block, while a save is in flight commits that save instead of losing it (and its
    threads stop before the interpreter finalizes). Returns the key ``close()`` removes it by.

    Two exit functions run :func:`_close_open_checkpointers`: threading's (before executors stop
    taking work: concurrent.futures stops its own in one registered before this one), and
    ``atexit``'s (later: for a Checkpointer made after the first one ran, by a thread still
    running then; its saves may fail for want of executors, and are then named in a WARNING)."""
    global _exit_hooks_registered
    key = next(_opened)
    _OPEN[key] = checkpointer
    if not _exit_hooks_registered:
        _exit_hooks_registered = True
        atexit.register(_close_open_checkpointers)
        try:
            threading._register_atexit(_close_open_checkpointers)  # type: ignore[attr-defined]
        except RuntimeError:  # made while the interpreter shuts down: atexit's alone
            pass
    return key


def _close_open_checkpointers() -> None:
    """At exit: close every open Checkpointer of this process, newest first, once the non-daemon
    threads that saved into one have ended. Each save's wait is bounded by its
    ``commit_timeout_s`` (the pipeline's deadline thread); a save that did not commit is named in
    a WARNING; nothing is raised."""

    def still_open() -> list[Checkpointer]:  # a forked child has none of their threads
        return [
            ck for ck in reversed(list(_OPEN.values())) if not ck._closed and ck._pid == os.getpid()
        ]

    current = threading.current_thread()
    for ck in still_open():  # a non-daemon thread still saving: the interpreter joins it next
        for thread in list(ck._savers):
            if thread is not current and not thread.daemon and thread.is_alive():
                thread.join()
    for ck in still_open():
        in_flight = [h for h in ck._in_flight() if not h.done()]
        if in_flight:
            log.info(
                "exit: waiting for %d save(s) in flight in %s to commit (at most "
                "commit_timeout_s = %s s each)",
                len(in_flight),
                ck.directory,
                ck.config.commit_timeout_s,
            )
        try:
            ck.close()
        except BaseException as exc:  # at exit: report, never raise
            log.warning("exit: closing the Checkpointer of %s failed: %r", ck.directory, exc)
        for handle in in_flight:
            error = handle.exception()
            if error is not None:
                log.warning(
                    "exit: the save %r in flight in %s did not commit: %r",
                    handle.name,
                    ck.directory,
                    error,
                )

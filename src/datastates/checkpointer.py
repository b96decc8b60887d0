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
    """Saves and restores training state in one directory of checkpoints.

    Thread model: call ``save``/``restore``/``load`` from the training thread. Background threads
    capture and write; they never touch the training process group. Multi-rank: construct it on
    every rank after ``torch.distributed.init_process_group`` (one collective at construction);
    every rank then calls ``save`` with the same step/tag in the same order.

    ``directory`` is a local path or an object-store URL, ``s3://bucket/prefix`` (``pip install
    'datastates[s3]'``; endpoint and credentials from ``storage_options`` — ``endpoint_url``,
    ``aws_access_key_id``, ``aws_secret_access_key``, ``region_name`` — or the standard AWS
    environment variables). On an object store the manifest written last commits a checkpoint
    (docs/storage.md); the bucket and credentials are checked at construction
    (BucketNotFoundError, StorageAccessError).

    The directory is created by the first save (a Checkpointer that only restores or lists
    creates nothing, and allocates no host cache); a local path that is, or lies below, a file
    raises NotADirectoryError at construction (on an object store an object and a prefix of
    one name are independent: an object at the root's key is left alone).

    Resources (host cache, threads) are released by ``close()`` or the ``with`` block, which first
    waits for in-flight saves to commit. ``share=other`` makes this Checkpointer use ``other``'s
    host cache, threads, configuration and communicator (for tools that save into many
    directories); ``other`` owns them. Close them in any order: closing ``other`` waits for every
    queued save of every sharer, then stops the threads; a sharer used after that raises
    ``CheckpointerClosedError``.

    ``restore`` and ``load`` first wait until every save in flight on the shared pipeline is
    committed or failed, so ``save(); restore()`` sees the checkpoint just saved and a restore
    never changes state that an in-flight snapshot is still reading.

    ``config.memory_tier`` (docs/memory-tier.md): the lowest rank of each node attaches to
    that node's keeper process (starting one if none runs; KeeperError if it cannot), and
    ``memory`` is the memory tier's TierCheckpointer (of this node's ranks, when the job runs
    on several nodes).
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
        #: The Checkpointer of the memory tier, or None (docs/memory-tier.md).
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
    ) -> SaveHandle:
        """Start a checkpoint of ``state`` and return its handle.

        ``state`` is any nesting of dicts/lists/tuples, tensors, modules, optimizers, objects
        with ``state_dict()``, :class:`RNGState` and picklable Python objects. The name is ``tag``
        or ``step-<step>``.

        Capture (see ``datastates.save.capture``): the optimizers found in ``state`` and those given in
        ``optimizers`` (when the state holds their state dicts or flat buffers instead of the
        objects; wrappers are unwrapped to the torch optimizer whose ``step`` runs) are part of
        this save and guarded. Tensors on the bytes of their parameters and state are lazy:
        copied in the background, and their next ``step()`` waits for that copy. Every other
        tensor is eager: copied straight into the host cache before this returns (no other copy
        is made; a state larger than the cache streams through it, and this returns once every
        eager tensor is in the cache or written). NumPy arrays of a dtype torch has are stored
        as tensors (load gives them back as arrays). Python objects are serialized before this
        returns; one that restore()'s safe loading would refuse (a class outside its allowlist,
        a torch DataLoader) raises UnsafeObjectError naming its key, with nothing written,
        unless ``config.allow_unsafe_objects``. ``replicated`` declares tensors identical on
        every rank (True for all, or key
        prefixes): they are written once, and (``config.replica_check``) a digest of each is
        compared across ranks at commit.

        A tensor no checkpoint holds (sparse, mkldnn, nested, or a meta tensor with elements)
        raises SerializationError naming its key, with nothing written.

        ``metrics`` (``{"val_loss": 0.31}``): numbers recorded in the manifest (rank 0's) and
        given back as ``CheckpointInfo.metrics``, which ``config.keep_best`` ranks by. A name
        is a str, a value a finite int or float (a bool, NaN or infinity is refused): TypeError
        or ValueError naming the key, with nothing written.

        Multi-rank: every rank must make the same saves (same name and step) in the same order;
        a save that one rank skips, names differently, or fails (even inside this call) fails on
        every rank within ``commit_timeout_s`` with a CommitError, and the next saves proceed.

        ``persist`` (with ``config.memory_tier``): False commits the save into the memory tier,
        True into the directory (storage); None lets ``MemoryTier.persist_every`` decide (a
        tag goes to storage). With ``MemoryTier(storage_writer="keeper")`` (the default) a save
        for storage without a tag is committed into memory, and the keeper then copies it into
        storage (its handle is done with the memory commit; ``wait()`` on rank 0 waits for
        storage too).
        Without a memory tier every save goes to storage, and ``persist=False`` raises
        ConfigError. ``persist`` is None, True or False: another value (0, 1) raises ConfigError.

        ``step``, ``tag`` and ``persist`` are checked first, before a tier is chosen, by the one
        check that ``restore``, ``load`` and ``delete`` share (``save.arguments.check_target``):
        ConfigError ``"save(): <expected>, found <value>"``, with nothing written.
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
        """Restore a committed checkpoint (the latest if no step/tag) into the live ``state``.

        Tensors are filled in place on their own devices, and so are NumPy arrays (a writeable
        live array of the saved shape and dtype; a read-only one is replaced by a new array);
        providers apply the rest (optimizer state, RNG, schedulers); plain values (ints,
        strings, objects) held by the live dicts and lists are replaced by the saved ones. Strict by default: keys, shapes and dtypes must match, and a
        mismatch raises StateMismatchError before anything is modified. Strict means: the same
        keys, lengths of the lists holding tensors or objects, tensor shapes and dtypes, the
        same type for every plain value (a live ``None`` accepts any saved value), and every
        check of the providers involved (for an optimizer: its class, the number of parameter
        groups, the parameters per group, the hyper-parameter names, and the state names of
        every parameter that has state). A dict, list or tuple of plain data only is a value: it
        takes the saved items whatever its live length (docs/resume.md, "What a restore
        matches"). With ``strict=False`` what does not match is left alone and listed in the
        report. ``keys``
        restricts the restore to key prefixes such as ``"model"``. Python objects load safely
        unless ``trusted=True`` (or their classes are in ``safe_globals``).

        ``cast=True`` lets a saved floating-point tensor restore into a live floating-point
        tensor of the same shape but another dtype (float32 into bfloat16 or float16, and back;
        a sharded live tensor too): its bytes are read and checksummed as saved, into a
        temporary of the saved dtype (at most 64 MiB of temporaries at a time, or one tensor
        if larger), then copied with ``live.copy_(saved)`` (torch's rounding), so the live
        tensor changes only once its bytes were verified. Every such key is listed in
        ``report.cast`` (``"model/w (float32 -> bfloat16)"``) as well as in ``restored``.
        Integer, bool and complex tensors are never cast: a dtype differing there stays a
        mismatch, whose entry says so. By default (``cast=False``) any dtype difference is a
        mismatch.

        First waits until every in-flight save of this Checkpointer (and of those sharing its
        pipeline) is committed or failed; their failures stay on their handles. A checksum error
        found while reading raises CorruptCheckpointError after tensors filled in place so far
        (parameters, buffers, optimizer state tensors) took their new values; plain values and
        what providers apply (optimizer hyper-parameters, schedulers, RNG, loaders) change only
        after every read was verified. Run ``verify`` first (``python -m datastates verify DIR``)
        to rule that out without touching live state.

        A split manifest (docs/format.md, "Split manifests") is read as each rank's view of it
        where one saved rank's state decides what a rank restores (at the saved world size, or
        with ``rank_policy`` "rank0" or "same"; "A rank's view"). A listing by several ranks
        checks every part's checksum, so every rank finds a damaged byte and agrees on the
        latest; a part whose checksum holds but whose content does not validate (only a faulty
        or hostile writer makes one) raises CorruptCheckpointError on the ranks that read it
        only. ``fallback=True`` makes the ranks agree on that too.

        At another world size than the save's, state that differs between the saved ranks
        (loader positions, RNG, any per-rank value) raises ReshardError unless ``rank_policy``
        is ``"rank0"`` or ``"same"``; only the requested ``keys`` are considered. An unknown
        ``rank_policy`` raises ConfigError before anything is read.

        ``fallback=True`` (the latest only: with ``step`` or ``tag`` it raises ConfigError)
        restores the newest checkpoint that verifies on every rank: each rank plans its restore
        and re-reads and checks the files it reads (``verify`` pass) before live state is
        touched, the ranks agree through the coordination store, and a checkpoint any rank
        finds damaged is skipped by all of them together and moved aside by rank 0
        (``<dir>/.damaged.<name>.<uid>``, with ``reason.txt``; never listed), with a WARNING
        each; ``report.skipped`` says which and why, ``report.verified_nbytes`` and
        ``report.verify_s`` what the check cost. A mismatch or another error on any rank raises
        on every rank before anything is modified (RestoreAbortedError on the others); no
        checkpoint left raises CheckpointNotFoundError. Damage found once live state is being
        written (the files changed after the check) raises CorruptCheckpointError, never a
        fallback (datastates/restore/resume.py).

        With ``config.memory_tier``: the checkpoint asked for, or the newest (the highest step of
        either tier; memory on a tie), is read from memory when memory holds it, always as with
        ``fallback=True`` there; when no memory checkpoint is intact on every rank, every rank
        restores from storage instead (a WARNING says so). ``report.tier`` says which, and
        ``report.tier_fallback`` why memory was not asked (a keeper that did not answer at
        construction: the Checkpointer then does without the memory tier, a WARNING). On
        several nodes, a restore of the latest then removes each node's memory checkpoints of
        later steps (docs/memory-tier.md, "Several nodes").

        A step or tag that ``save()`` would refuse raises the same ConfigError as there (named
        ``restore()``), before a tier is chosen or anything is read.
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
        """The most recently committed checkpoint (highest commit sequence number, tags and steps
        alike), or None. The ``latest`` file in the directory is only a hint and is not read: a
        crash after a commit but before that file was rewritten still gives the new checkpoint,
        so the resume loop ``start = ckpt.restore(state).step + 1 if ckpt.latest() else 0``
        never saves a committed step twice (docs/format.md, "The resume loop"). None as well
        when the directory does not exist yet.

        Damaged checkpoints are never chosen; each one that may be newer than the one returned
        (:meth:`Catalog.passed_over`) is named in a WARNING on the ``datastates`` logger, with
        why it is damaged and which checkpoint is used instead (``restore()`` and ``load()`` of
        the latest do the same). The next save of a damaged checkpoint's name moves it aside
        and commits, so the resume loop keeps running.

        With ``config.memory_tier``: the newer of storage's and the memory tier's (the higher
        step; memory on a tie), which is what ``restore()`` reads."""
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
        """Delete a checkpoint, committed or damaged (rank 0 only does the work).

        Only a checkpoint is removed: a directory holding a ``manifest.json`` (on an object
        store, a prefix holding one). A name under which there is none, or anything else (a
        file, a symbolic link, a directory without a manifest) raises CheckpointNotFoundError
        and nothing is removed. Exactly one of ``step`` and ``tag`` names it: neither or both
        raise ConfigError, and so does an invalid step or tag (the rules of ``save()``, checked
        as it checks them), before anything is removed.

        With ``config.memory_tier`` whose keeper writes storage: ``self.memory.delete()`` of a
        memory checkpoint the keeper is writing to storage (or that waits for it) first waits
        until that write is done, and ``delete()`` in storage until no write to storage runs
        (both first wait for the saves in flight on this pipeline, so a save just committed has
        been handed on); CommitTimeoutError, nothing removed, if that takes over
        ``commit_timeout_s``."""
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

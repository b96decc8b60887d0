"""The public entry point: a Checkpointer owns the host cache and threads for one directory."""
from __future__ import annotations

import atexit
import contextlib
import dataclasses
import functools
import itertools
import json
import logging
import os
import threading
import time
import warnings
import weakref
from typing import Any, Iterable, Mapping

import torch

from .commit import retention
from .commit.catalog import Catalog, DamagedCheckpoint, log_passed_over, resolve
from .commit.committer import SaveTarget
from .commit.publish import publisher_for
from .commit.retention import RetentionPolicy
from .commit.round import LocalCommunicator, StoreCommunicator
from .config import CheckpointConfig
from .errors import (CheckpointerClosedError, CheckpointNotFoundError, CommitTimeoutError,
                     ConfigError, CorruptCheckpointError)
from .format import codec as fmt
from .format import files
from .format.records import CheckpointInfo, info_of
from .providers import ProviderRegistry
from .providers.tree import Flattened, Items, flatten
from .restore import resume
from .restore.reader import Reader, RestoreReport, check_rank_policy
from .save import capture
from .save.arguments import check_depth, check_dtypes, check_metrics, check_target
from .save.job import Job, SaveHandle
from .save.pipeline import Pipeline
from .save.planning import assign_replicated, plan_layout, units_holding
from .storage import normalize, open_store

log = logging.getLogger("datastates")

#: How many times a restore or load starts again on a checkpoint replaced while it was read.
_REREADS = 3


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
    ``memory`` is the Checkpointer of the memory tier (of this node's ranks, when the job runs
    on several nodes).
    """

    def __init__(self, directory: str | os.PathLike, config: CheckpointConfig | None = None, *,
                 registry: ProviderRegistry | None = None, communicator=None,
                 share: "Checkpointer | None" = None,
                 storage_options: Mapping[str, Any] | None = None, _store=None, _comm=None):
        self.directory = normalize(directory)
        #: Where the checkpoints live: the local file system, or an object store for
        #: ``s3://bucket/prefix`` (endpoint and credentials from ``storage_options`` or the
        #: environment; the bucket and credentials are checked here). ``_store`` (internal):
        #: the memory tier's recycling store; ``_comm`` (internal, with ``share=``): the
        #: communicator of the ranks this Checkpointer's saves commit among (a node group of
        #: the memory tier, memory/nodes.py), the shared one's by default.
        self.store = _store or open_store(self.directory, storage_options)
        if share is not None:
            share._check_open()
            if config is not None and config != share.config:
                raise ConfigError("a Checkpointer created with share= uses the shared one's "
                                  f"config; found a different one: {config}")
            if communicator is not None and communicator is not share.comm:
                raise ValueError("a Checkpointer created with share= uses the shared one's "
                                 "communicator")
            self.config, self.comm, self._pipeline = share.config, share.comm, share._pipeline
            if _comm is not None:  # the memory tier of a node group: its ranks commit together
                self.comm = _comm
        else:
            self.config = config or CheckpointConfig()
            self.comm = communicator or _default_communicator()
        self._owns_pipeline = share is None
        self._owns_comm = share is not None and _comm not in (None, share.comm)
        self.registry = registry or ProviderRegistry.default()
        self.rank, self.world_size = self.comm.rank, self.comm.world_size
        # The directory is created by the first save, not here: a Checkpointer used to restore or
        # list a mistyped path must not leave an empty folder behind.
        #: How checkpoints become visible in this store; owns this run's temporaries in it.
        self._publisher = publisher_for(self.store)
        self._publisher.check_root(self.directory)
        if self.rank == 0:
            self._publisher.clean_stale(self.directory, self.config.stale_tmp_age_s)
        self._opened_together()
        if self._owns_pipeline:
            self._pipeline = Pipeline(self.config, self.comm)
        self._pending: list[SaveHandle] = []
        self._dropped: list[SaveHandle] = []  # finished with a failure nobody looked at
        self._guarded: "weakref.WeakKeyDictionary[torch.optim.Optimizer, Any]" = \
            weakref.WeakKeyDictionary()
        self._closed = False
        self._pid = os.getpid()  # a forked child inherits this object, not its threads
        #: Threads that called save(): at exit, the non-daemon ones are waited for first.
        self._savers: "weakref.WeakSet[threading.Thread]" = weakref.WeakSet()
        self._open_key = _close_at_exit(self)
        #: The committed checkpoints of the directory as last listed: each commit, ``list`` and
        #: ``latest`` list the directory but read only the manifests that changed since.
        self._catalog = Catalog(self.directory, self.store, self.world_size)
        cfg = self.config
        self._retention = RetentionPolicy(cfg.keep_last, cfg.keep_every, cfg.keep_best,
                                          cfg.best_metric, cfg.best_mode)
        #: The memory tier (``config.memory_tier``; docs/memory-tier.md): the Checkpointer of
        #: the checkpoints kept in shared memory, or None. A Checkpointer made with ``share=``
        #: has none of its own.
        self.memory: Checkpointer | None = None
        self._tiers = None
        #: ``fallback=True`` reads straight into the live state and agrees afterwards (the
        #: memory tier's Checkpointer: resume.choose's ``apply``), instead of checking first.
        self._optimistic = False
        #: ``info -> bool``: whether a candidate was checked since its last write, so a
        #: fallback restore reads it without checksums (the memory tier's marks)
        self._prechecked = None
        #: The memory tier of several nodes (memory/nodes.py), ``_group`` the job's ranks of
        #: this node group (None otherwise): a save of a sharded tensor is refused (a node
        #: group's checkpoint would hold some boxes of it only); a fallback restore agrees
        #: through ``_agree`` (the job's communicator: every node holds the step restored),
        #: ranks the candidates by ``_order`` (None: the commit number), takes those that
        #: ``_eligible`` accepts (None: all; the memory tier: none older than storage's newest),
        #: and its lowest rank moves aside only the damage that a rank of ``_group`` found.
        self._group: set[int] | None = None
        self._agree = None
        self._order = None
        self._eligible = None
        #: Rank 0 with a memory tier whose keeper writes to storage (memory/handoff.py): the
        #: memory Checkpointer's ``on_commit`` hands a save due for storage on; the storage
        #: Checkpointer's ``exclusive`` holds its own commits while one is written there.
        self._on_commit = None
        self._exclusive = None
        #: The memory Checkpointer of such a tier, every rank: ``(name, overwrite)`` refuses a
        #: save due for storage under a name storage holds (CheckpointExistsError), as a save
        #: straight to storage is refused. Rank 0: ``delete()`` runs inside ``_delete_guard(name)``
        #: (it never removes what the keeper copies, nor deletes while it commits), and the
        #: commit of a save replacing a checkpoint waits for ``_released(name, deadline)`` (the
        #: keeper's copy of the one it replaces is done).
        self._check_storage_name = None
        self._delete_guard = None
        self._released = None
        if cfg.memory_tier is not None and share is None:
            from .memory.tiers import Tiers
            try:
                self._tiers = Tiers(self, cfg.memory_tier, lambda path, store, comm:
                                    Checkpointer(path, share=self, _store=store, _comm=comm))
            except BaseException:
                self.close()
                raise
            self.memory = self._tiers.memory

    # ------------------------------------------------------------ save
    def save(self, state: Any, step: int | None = None, *, tag: str | None = None,
             metadata: dict | None = None, overwrite: bool = False,
             replicated: bool | Iterable[str] = False,
             optimizers: Iterable[Any] = (), metrics: dict | None = None,
             persist: bool | None = None) -> SaveHandle:
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
        name = check_target("save", step, tag, persist)  # before routing: one check, every tier
        self._savers.add(threading.current_thread())
        where = self._tiers.route(step, tag, persist) if self._tiers is not None else "storage"
        if where != "storage":
            return self.memory.save(state, step, tag=tag, metadata=metadata,
                                    overwrite=overwrite, replicated=replicated,
                                    optimizers=optimizers, metrics=metrics,
                                    persist=True if where == "handoff" else None)
        if persist is False and self._tiers is None:
            raise ConfigError("save(persist=False) keeps a checkpoint in the memory tier; this "
                              "Checkpointer has none (CheckpointConfig(memory_tier="
                              "MemoryTier()))")
        t0 = time.perf_counter()
        self._check_open()
        self._report_dropped_failures()
        self._bound_pending()
        # From here on the save has an identity: a failure still takes part in its commit round,
        # so the other ranks fail this save too (and stay in step for the next one).
        sid = self.comm.save_id(self.directory, name, step)
        deadline = time.monotonic() + self.config.commit_timeout_s
        cfg = self.config
        target = SaveTarget(
            sid=sid, name=name, step=step, root=self.directory, rank=self.rank,
            tmp=self._publisher.tmp_location(self.directory, name, self.comm.run_id, sid.serial),
            store=self.store, overwrite=overwrite, deadline=deadline,
            timeout_s=cfg.commit_timeout_s, fsync=cfg.fsync, replica_check=cfg.replica_check,
            retention=self._retention, catalog=self._catalog, comm=self.comm,
            exclusive=functools.partial(self._released, name)
            if overwrite and self._released is not None else self._exclusive,
            on_commit=functools.partial(self._on_commit, overwrite=overwrite)
            if persist and self._on_commit is not None else None)
        try:
            job = self._plan_job(state, metadata, replicated, optimizers,
                                 dataclasses.replace(target, metrics=check_metrics(metrics)), t0,
                                 persist)
        except BaseException as exc:
            failed = Job(target, flat=Flattened(tree={"t": "value", "v": None}),
                         layout=plan_layout([], [], cfg.unit_bytes), write_tensors=[],
                         objects=[], metadata={}, ready=None, t0=t0)
            failed.error = exc
            self._pipeline.submit_failed(failed)
            raise
        try:
            self._pipeline.submit(job)
        except CheckpointerClosedError as exc:  # the owner closed while this save was planning
            job.abandon(exc)
            raise
        handle = SaveHandle(job)
        self._pending.append(handle)
        items = job.flat.items
        job.stats.lazy_nbytes = sum(items.nbytes[i] for i in job.write_tensors if items.lazy[i])
        if job.reads_lazy() and (self.config.lazy == "never" or
                     (self.config.lazy == "auto" and not self._guarded)):
            job.captured.wait()
        else:
            job.eager_captured.wait()
        job.stats.blocked_s = time.perf_counter() - t0
        return handle

    def _plan_job(self, state, metadata, replicated, optimizers, target: SaveTarget,
                  t0: float, persist: bool | None = None) -> Job:
        """Validate, walk and plan one save on the training thread (the part that may fail)."""
        if metadata is not None and not isinstance(metadata, dict):
            raise TypeError(f"metadata must be a dict, found {type(metadata).__qualname__}")
        check_depth(metadata or {})
        decoded = json.loads(fmt.encode_json(metadata or {}))
        if decoded != (metadata or {}):  # fail now, not in background
            raise TypeError("metadata must survive a JSON round trip unchanged (string keys; "
                            f"lists, not tuples): {metadata!r}")
        metadata = decoded  # exactly what a reader of the manifest will find
        self._publisher.check_name(self.directory, target.name, target.overwrite)
        if persist and self._check_storage_name is not None:
            self._check_storage_name(target.name, target.overwrite)
        flat = flatten(state, self.registry,
                       allow_unsafe=self.config.allow_unsafe_objects)
        items = flat.items
        check_dtypes(items)
        if self._group is not None:
            _check_unsharded(items)
        self._decide_capture(flat, optimizers)
        tensors = items.tensor_indexes()
        _mark_replicated(items, tensors, replicated)
        writes = self._tensors_to_write(items, tensors)
        lazy = items.lazy
        eager = [i for i in writes if not lazy[i]]
        writes = eager + [i for i in writes if lazy[i]]  # eager units first
        objects = list(items.blobs)  # in item order: added as the walk found them
        layout = plan_layout([items.nbytes[i] for i in writes],
                             [items.nbytes[i] for i in objects], self.config.unit_bytes,
                             framed=True)
        self._publisher.hold(self.directory, self.comm.run_id, self.config.fsync)
        ready = self._pipeline.copier.record_ready([items.tensors[i] for i in writes])
        return Job(target, flat=flat, layout=layout, write_tensors=writes, objects=objects,
                   metadata=metadata, ready=ready, t0=t0,
                   eager_units=units_holding(layout, len(eager)), eager_items=len(eager),
                   digest_replicas=self.config.replica_check and self.world_size > 1)

    def guard(self, optimizer: Any) -> None:
        """Make ``optimizer.step()`` wait until in-flight snapshots are captured (idempotent).

        Done automatically for the optimizers part of a save. ``optimizer`` is a torch optimizer
        or a wrapper (accelerate, DeepSpeed, Lightning): the hook goes on the torch optimizer
        found through ``.optimizer``, whose ``step`` runs. A guarded optimizer that is not part
        of a later save makes its parameters eager in that save (its step writes them). Installs
        a step pre-hook; no framework code is patched. The hook never raises: a failed save
        surfaces on its handle. Raises TypeError when no torch optimizer is found.
        """
        opt = capture.torch_optimizer(optimizer)
        if opt is None:
            raise TypeError(f"guard(): {type(optimizer).__qualname__} is not a torch optimizer "
                            "and has no .optimizer attribute leading to one")
        if opt in self._guarded:
            return
        self._guarded[opt] = capture.add_step_waiter(opt, self._before_step)

    def _decide_capture(self, flat, optimizers: Iterable[Any]) -> None:
        """Guard the optimizers part of this save and decide lazy/eager for every tensor."""
        in_save = []
        for found, given in [*((True, o) for o in flat.optimizers),
                             *((False, o) for o in optimizers)]:
            opt = capture.torch_optimizer(given)
            if opt is None:  # an optimizer in the state that cannot be guarded: eager tensors
                if not found:
                    self.guard(given)  # raises the TypeError
                continue
            if all(opt is not o for o in in_save):
                self.guard(opt)
                in_save.append(opt)
        others = [o for o in list(self._guarded.keys()) if all(o is not s for s in in_save)]
        capture.decide(flat.items, capture.LazyRule(in_save, others))

    def _before_step(self, *_args) -> None:
        for handle in list(self._pending):
            job = handle._job
            if not job.captured.is_set():
                t0 = time.perf_counter()
                job.captured.wait()
                job.stats.step_wait_s += time.perf_counter() - t0

    def wait(self) -> list[CheckpointInfo]:
        """Wait for every in-flight save (of both tiers, with a memory tier; on rank 0 also
        until the keeper has written the saves due for storage there); raise the first failure
        (a keeper's write that failed: KeeperError, once, on rank 0)."""
        pending, errors, infos = list(self._pending), [], []
        if self.memory is not None:  # both tiers' saves, in the order they were made
            pending = sorted(pending + self.memory._pending, key=lambda h: h._job.t0)
        for handle in pending:
            try:
                infos.append(handle.wait())
            except BaseException as exc:
                errors.append(exc)
        self._prune()
        if self.memory is not None:
            self.memory._prune()
        if errors:
            raise errors[0]
        if self._tiers is not None:
            self._tiers.wait()
        return infos

    # ------------------------------------------------------------ restore
    def restore(self, state: Any, step: int | None = None, *, tag: str | None = None,
                keys=None, strict: bool = True, verify: bool | None = None,
                trusted: bool = False, safe_globals: Iterable[Any] = (),
                rank_policy: str = "strict", cast: bool = False,
                fallback: bool = False) -> RestoreReport:
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
        report = None
        if self._tiers is not None:
            report = self._from_memory(
                step, tag, lambda: self.memory.restore(
                    state, step, tag=tag, keys=keys, strict=strict, trusted=trusted,
                    safe_globals=safe_globals, rank_policy=rank_policy, cast=cast,
                    fallback=step is None and tag is None, verify=True))
            if report is not None:
                report.tier = "memory"
        if report is None:
            at_step, at_tag = self._storage_target(step, tag, fallback)
            report = self._restore_storage(state, at_step, at_tag, keys, strict, verify,
                                           trusted, safe_globals, rank_policy, cast, fallback)
            if self._tiers is not None:
                report.tier_fallback = self._tiers.unavailable
        if self._tiers is not None and step is None and tag is None:
            self._tiers.after_restore(report.step)
        return report

    def _restore_storage(self, state, step, tag, keys, strict, verify, trusted, safe_globals,
                         rank_policy, cast, fallback) -> RestoreReport:
        passed: list[DamagedCheckpoint] = []
        if fallback:
            return self._with_fallback(
                step, tag, trusted, safe_globals, None, rank_policy, "restore()", passed,
                lambda r: r.plan_restore(state, keys=keys, strict=strict, cast=cast),
                lambda r, plan: r.apply(plan))
        rereads: list[str] = []
        report = self._read(step, tag, verify, trusted, safe_globals, None, rank_policy,
                            "restore()", passed, rereads, lambda reader: reader.restore_into(
                                state, keys=keys, strict=strict, cast=cast))
        report.passed_over = [d.name for d in passed]
        report.rereads = rereads
        return report

    def load(self, step: int | None = None, *, tag: str | None = None, keys=None,
             map_location: Any = None, verify: bool | None = None, trusted: bool = False,
             safe_globals: Iterable[Any] = (), rank_policy: str = "strict",
             dtype: torch.dtype | None = None, fallback: bool = False) -> Any:
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
        if self._tiers is not None:
            loaded = self._from_memory(step, tag, lambda: self.memory.load(
                step, tag=tag, keys=keys, map_location=map_location, trusted=trusted,
                safe_globals=safe_globals, rank_policy=rank_policy, dtype=dtype,
                fallback=step is None and tag is None, verify=True))
            if loaded is not None:
                return loaded
            step, tag = self._storage_target(step, tag, fallback)
        if fallback:
            return self._with_fallback(
                step, tag, trusted, safe_globals, map_location, rank_policy, "load()", None,
                lambda r: r.plan_load(keys=keys, dtype=dtype),
                lambda r, planned: r.finish_load(*planned))
        return self._read(step, tag, verify, trusted, safe_globals, map_location, rank_policy,
                          "load()", None, [], lambda reader: reader.load(keys=keys, dtype=dtype))

    def _from_memory(self, step, tag, read):
        """``read()`` from the memory tier if it holds what is asked for (every rank agrees);
        None to read storage: memory does not hold it, or no memory checkpoint is intact."""
        self._check_open()
        self._pipeline.drain()
        storage = self._storage_latest() if step is None and tag is None else None
        eligible = self._tiers.restore_from_memory(step, tag, storage)
        if eligible is None:
            self._tiers.quiet_storage(together=True)
            return None
        self.memory._eligible = eligible  # for this restore only
        try:
            return read()
        except CheckpointNotFoundError as exc:
            log.warning("no memory checkpoint is intact on every rank (%s); restoring from "
                        "storage %s", exc, self.directory)
            # The latest is agreed (every rank is here); a named one is read by each rank alone.
            self._tiers.quiet_storage(together=step is None and tag is None)
            return None
        finally:
            self.memory._eligible = None

    def _read(self, step, tag, verify, trusted, safe_globals, map_location, rank_policy,
              caller: str, passed: list | None, rereads: list[str], read):
        """``read(reader)`` on the checkpoint asked for. Finding the latest, each damaged
        checkpoint passed over is logged as a WARNING naming ``caller``, and appended to
        ``passed``.

        A read that fails (CorruptCheckpointError, CheckpointNotFoundError) because another
        process replaced or deleted the checkpoint while it was read (an overwrite of a tag
        between reading its manifest and its shard files; retention deleting the latest) is
        started again, the checkpoint found anew, up to ``_REREADS`` times, with a WARNING
        each, and the error appended to ``rereads`` -- in a one-process job only: each rank
        re-reading on its own could leave the ranks with different commits, so with several
        ranks the error is raised. It counts as replaced when its manifest now describes
        another commit (commit number, creation time) or is gone; a manifest unchanged (real
        damage) or unreadable raises the error at once."""
        self._check_open()
        check_rank_policy(rank_policy)
        self._pipeline.drain()
        latest = step is None and tag is None  # found by a scan: the catalog keeps its manifest
        while True:
            info = None
            try:
                info = resolve(self.directory, step, tag, self.store, self._catalog)
                skipped = self._catalog.passed_over(info) if latest else []
                log_passed_over(skipped, info, caller)
                if passed is not None:
                    passed.extend(d for d in skipped if d not in passed)
                with Reader(info.path, manifest=self._catalog.manifest(info) if latest else None,
                            registry=self.registry, rank=self.rank, store=self.store,
                            world_size=self.world_size, threads=self.config.reader_threads,
                            verify=self.config.verify if verify is None else verify,
                            trusted=trusted, safe_globals=safe_globals,
                            map_location=map_location, rank_policy=rank_policy,
                            view=True) as reader:
                    result = read(reader)
                if isinstance(result, RestoreReport):  # found at another path (set_aside)
                    result.name = info.name
                return result
            except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
                name = info.name if info is not None else fmt.check_name(tag) \
                    if tag is not None else fmt.step_name(step) if step is not None else None
                if len(rereads) >= _REREADS or self.world_size > 1 or name is None or \
                        not self._replaced(name, info):
                    raise  # (several ranks re-reading on their own could restore two commits)
                rereads.append(f"{name}: {type(exc).__name__}: {exc}")
                log.warning("%s: the checkpoint %s was replaced or deleted by another process "
                            "while it was read (%s: %s); finding and reading it again",
                            caller, name, type(exc).__name__, exc)

    def _replaced(self, name: str, info: CheckpointInfo | None) -> bool:
        """Whether the checkpoint ``name`` read as ``info`` now describes another commit or is
        gone; with ``info`` None (it was not found), whether it is there now."""
        try:
            now = files.read_info(self.store.join(self.directory, name), self.store)
        except CheckpointNotFoundError:
            return info is not None
        except (CorruptCheckpointError, OSError):
            return False
        return info is None or (now.seq, now.created_unix) != (info.seq, info.created_unix)

    def _with_fallback(self, step, tag, trusted, safe_globals, map_location, rank_policy,
                       caller: str, passed: list | None, plan, finish):
        """``restore``/``load`` with ``fallback=True``: ``plan(reader)`` on each candidate,
        verified, agreed (restore/resume.py), then ``finish(reader, planned)``."""
        self._check_open()
        try:  # a rank refused here still answers the rounds' exchange (resume.refuse)
            if step is not None or tag is not None:
                raise ConfigError(f"{caller}: fallback=True restores the newest intact "
                                  f"checkpoint; it takes no step= or tag= (found step={step!r}, "
                                  f"tag={tag!r})")
            check_rank_policy(rank_policy)
            self._pipeline.drain()
        except Exception as exc:
            resume.refuse(self._agree or self.comm, exc, self.config.commit_timeout_s)
            raise

        def open_reader(info):
            prechecked = self._prechecked is not None and self._prechecked(info)
            if prechecked:
                log.info("%s: %s was checked by the memory keeper after its last write; "
                         "copying it without checksumming again", caller, info.name)
            return Reader(info.path, manifest=self._catalog.manifest(info),
                          registry=self.registry, rank=self.rank, store=self.store,
                          world_size=self.world_size, threads=self.config.reader_threads,
                          verify=not prechecked, trusted=trusted, safe_globals=safe_globals,
                          map_location=map_location, rank_policy=rank_policy, view=True)

        def prepare(reader):
            planned = plan(reader)
            if self._optimistic:
                return planned, 0
            return planned, reader.verify_planned(planned[0] if isinstance(planned, tuple)
                                                  else planned)

        def quarantine(name, reason):
            read = self._catalog.info(name)
            if read is not None and self._replaced(name, read):
                log.warning("%s: the checkpoint %s was replaced or deleted by another process "
                            "while it was read (%s); what is there now is not moved aside",
                            caller, name, reason)
                return None
            try:
                return self._publisher.quarantine(self.directory, name, reason,
                                                  self.config.fsync)
            except OSError as exc:  # also CheckpointNotFoundError: deleted meanwhile
                log.warning("%s: could not move the damaged checkpoint %s aside: %s", caller,
                            name, exc)
                return None

        reader, planned, skipped, nbytes, seconds = resume.choose(
            self._catalog, self._agree or self.comm, open_reader=open_reader, prepare=prepare,
            quarantine=quarantine, timeout_s=self.config.commit_timeout_s, caller=caller,
            apply=finish if self._optimistic else None, order=self._order or self._step_order(),
            eligible=self._eligible, mover=lambda ranks: self.rank == 0 and (
                self._group is None or not self._group.isdisjoint(ranks)))
        with reader:
            used = info_of(reader.dir, reader.manifest)
            damaged = self._catalog.passed_over(used)
            log_passed_over(damaged, used, caller)
            result = planned if self._optimistic else finish(reader, planned)
        if isinstance(result, RestoreReport):
            result.skipped, result.verified_nbytes, result.verify_s = skipped, nbytes, seconds
            result.passed_over = [d.name for d in damaged]
            result.prechecked = not reader.verify
        return result

    # ------------------------------------------------------------ listing
    def list(self) -> list[CheckpointInfo]:
        """Committed checkpoints, oldest first, in commit order (``CheckpointInfo.seq``); empty
        when the directory does not exist yet (nothing was saved there). With a memory tier,
        the directory's (storage's): ``self.memory.list()`` lists the memory tier's."""
        if not self.store.isdir(self.directory):
            return []
        return self._catalog.scan()

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
        newest = self._storage_latest()
        return self._tiers.newest(newest) if self._tiers is not None else newest

    def _storage_latest(self) -> CheckpointInfo | None:
        if not self.store.isdir(self.directory):
            return None
        found = self._catalog.scan()
        step_order = self._step_order()
        newest = max(found, key=step_order, default=None) if step_order else \
            found[-1] if found else None
        log_passed_over(self._catalog.passed_over(newest), newest, "latest()")
        return newest

    def _step_order(self):
        """With a memory tier, storage's newest is its highest step (then the last commit of
        it), as across the tiers: never a tag saved later, so that memory's older step never
        looks newer (memory/tiers.py). None: the commit order."""
        if self._tiers is None:
            return None
        from .memory.tiers import step_then_commit
        return step_then_commit

    def _storage_target(self, step, tag, fallback: bool) -> tuple[int | None, str | None]:
        """What a restore or load of storage reads: ``(step, tag)`` as asked, or, for the latest
        with a memory tier (``fallback`` False), storage's newest by step named, when it is not
        the last commit (``fallback=True`` ranks the candidates the same way)."""
        if self._tiers is None or fallback or step is not None or tag is not None:
            return step, tag
        found = self._catalog.scan() if self.store.isdir(self.directory) else []
        newest = max(found, key=self._step_order(), default=None)
        if newest is None or newest.name == found[-1].name:
            return None, None
        named_by_step = newest.step is not None and newest.name == fmt.step_name(newest.step)
        return (newest.step, None) if named_by_step else (None, newest.name)

    def damaged(self) -> list[DamagedCheckpoint]:
        """The damaged checkpoints of the directory, by name: directories whose
        ``manifest.json`` exists but does not read or validate (one listing of the directory;
        empty when it does not exist). They are never restored; ``delete()`` removes one.
        A listing checks every manifest's checksum but validates only the head of all but the
        newest (docs/format.md, "Which checkpoint is the latest"): an older manifest whose
        checksum holds and whose body does not validate (only a faulty or hostile writer makes
        one) is listed, and reading it raises CorruptCheckpointError; ``datastates verify``
        reads every one whole."""
        if not self.store.isdir(self.directory):
            return []
        self._catalog.scan()
        return self._catalog.damaged()

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
        name = check_target("delete", step, tag)
        if self.rank == 0:
            if self._delete_guard is not None:
                self._pipeline.drain()  # a save just committed is handed on before we look
            with self._delete_guard(name) if self._delete_guard else contextlib.nullcontext():
                retention.delete(self.directory, name, self.config.fsync, self.store)

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
        self._closed = True  # from here on save/restore/load raise CheckpointerClosedError
        _OPEN.pop(self._open_key, None)
        for handle in list(self._pending):
            handle._job.finished.wait()
        if self._tiers is not None:  # after storage's saves: the tier may commit there too
            self._tiers.close(stop_keeper)
        self._report_dropped_failures()
        for remove in list(self._guarded.values()):  # (any thread: see add_step_waiter)
            remove()
        self._guarded.clear()
        if self._owns_pipeline:
            self._pipeline.close()
        if self._owns_pipeline or self._owns_comm:
            self.comm.close()
        self._publisher.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ internals
    def _opened_together(self) -> None:
        """No rank lists the directory before rank 0's cleanup is done: that cleanup may put
        back a checkpoint whose replacement a dead writer cut short between its two renames,
        and a rank listing before it would resume from another checkpoint than rank 0. One
        exchange through the store (nothing on the training group); CommitTimeoutError naming
        the ranks that did not open the directory within ``commit_timeout_s``."""
        try:
            self.comm.exchange("open", {}, self.config.commit_timeout_s)
        except TimeoutError as exc:
            self._publisher.close()
            raise CommitTimeoutError(f"Checkpointer({self.directory!r}) on rank {self.rank}: "
                                     f"every rank must construct it: {exc}") from None


    def _tensors_to_write(self, items: Items, tensors: list[int]) -> list[int]:
        if items.secondary:
            tensors = [i for i in tensors if i not in items.secondary]
        keys, flags = items.keys, items.replicated
        replicated = {keys[i]: items.nbytes[i] for i in tensors if flags[i]}
        if not replicated or self.world_size == 1:
            return tensors
        owner = assign_replicated(replicated, self.world_size)
        return [i for i in tensors if not flags[i] or owner[keys[i]] == self.rank]

    def _bound_pending(self) -> None:
        self._prune()
        while len(self._pending) >= self.config.max_pending_saves:
            self._pending[0]._job.finished.wait()
            self._prune()

    def _prune(self) -> None:
        keep = []
        for h in self._pending:
            if not h.done():
                keep.append(h)
            elif h._unobserved_error() is not None:
                self._dropped.append(h)
        self._pending = keep

    def _report_dropped_failures(self) -> None:
        self._prune()
        while self._dropped:
            handle = self._dropped.pop(0)
            err = handle.exception()
            if err is not None:
                warnings.warn(f"datastates: an earlier checkpoint {handle.name!r} failed: {err!r}",
                              RuntimeWarning, stacklevel=3)

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointerClosedError(f"the Checkpointer of {self.directory} is closed")
        if self._pipeline.closed:
            raise CheckpointerClosedError(f"the Checkpointer whose pipeline the one of "
                                          f"{self.directory} shares was closed")


def _mark_replicated(items: Items, tensors: list[int], replicated) -> None:
    if replicated is False or replicated is None:
        return
    prefixes = None if replicated is True else [p.strip("/") for p in replicated]
    for i in tensors:
        if i in items.boxes:
            continue
        key = items.keys[i]
        if prefixes is None or any(key == p or key.startswith(p + "/") for p in prefixes):
            items.replicated[i] = True


def _check_unsharded(items: Items) -> None:
    """The memory tier of several nodes keeps each node's ranks' tensors: ConfigError for a
    sharded tensor (TensorShard, DTensor), whose other boxes are on other nodes."""
    sharded = [items.keys[i] for i, (shape, _) in items.boxes.items() if shape != items.shapes[i]]
    if sharded:
        raise ConfigError(f"the memory tier on several nodes keeps per-rank and replicated "
                          f"tensors; found {len(sharded)} sharded tensor(s) (TensorShard, "
                          f"DTensor), first {sharded[0]!r}: save them with persist=True, or run "
                          "the memory tier on one node (docs/memory-tier.md, Several nodes)")


def _default_communicator():
    import torch.distributed as dist
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return StoreCommunicator.from_process_group()
    return LocalCommunicator()



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
        return [ck for ck in reversed(list(_OPEN.values()))
                if not ck._closed and ck._pid == os.getpid()]

    current = threading.current_thread()
    for ck in still_open():  # a non-daemon thread still saving: the interpreter joins it next
        for thread in list(ck._savers):
            if thread is not current and not thread.daemon and thread.is_alive():
                thread.join()
    for ck in still_open():
        in_flight = [h for h in ck._pending if not h.done()]
        if in_flight:
            log.info("exit: waiting for %d save(s) in flight in %s to commit (at most "
                     "commit_timeout_s = %s s each)", len(in_flight), ck.directory,
                     ck.config.commit_timeout_s)
        try:
            ck.close()
        except BaseException as exc:  # at exit: report, never raise
            log.warning("exit: closing the Checkpointer of %s failed: %r", ck.directory, exc)
        for handle in in_flight:
            error = handle.exception()
            if error is not None:
                log.warning("exit: the save %r in flight in %s did not commit: %r", handle.name,
                            ck.directory, error)

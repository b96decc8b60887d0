"""The Checkpointer of one tier: the checkpoints of one directory, saved and restored.

A :class:`datastates.Checkpointer` is made of one of these for storage and, with a memory tier,
one for the memory checkpoints (``Checkpointer.memory``), sharing one pipeline. What a tier may
vary is given at construction, as a frozen :class:`TierPolicy`; a TierCheckpointer knows nothing
of which tier it is.
"""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import functools
import json
import logging
import os
import time
import warnings
import weakref
from typing import Any, Callable, ContextManager, Iterable, Mapping

import torch

from .commit import retention
from .commit.catalog import Catalog, DamagedCheckpoint, log_passed_over, resolve
from .commit.committer import SaveTarget
from .commit.publish import publisher_for
from .commit.retention import RetentionPolicy
from .commit.round import LocalCommunicator, StoreCommunicator
from .config import CheckpointConfig
from .errors import (
    CheckpointerClosedError,
    CheckpointNotFoundError,
    CommitTimeoutError,
    ConfigError,
    CorruptCheckpointError,
)
from .format import codec as fmt
from .format import files
from .format.records import CheckpointInfo, info_of
from .providers import ProviderRegistry
from .providers.tree import Flattened, Items, flatten
from .restore import resume
from .restore.reader import Reader, RestoreReport, check_rank_policy
from .save import capture
from .save.arguments import check_depth, check_dtypes, check_metrics, check_target, check_view
from .save.job import Job, SaveHandle
from .save.pipeline import Pipeline
from .save.planning import assign_replicated, plan_layout, units_holding
from .storage import normalize, open_store
from .storage.store import Store

log = logging.getLogger("datastates")

#: How many times a restore or load starts again on a checkpoint replaced while it was read.
_REREADS = 3


@dataclasses.dataclass(frozen=True)
class TierPolicy:
    """What one tier of a Checkpointer varies, fixed at construction (the defaults: a plain
    directory of checkpoints). The memory tier (memory/tiers.py) fills it in for its two tiers.

    Saves: ``retention`` replaces the one ``CheckpointConfig.keep_*`` gives; ``exclusive(deadline)``
    runs before each commit of this tier (rank 0 waits while another writer commits here);
    ``released(name, deadline)`` before the commit of a save replacing ``name``;
    ``on_commit(info, overwrite=)`` after the commit of a save made with ``persist=True`` (handed
    on to storage); ``check_name(name, overwrite)`` refuses, before anything is written, such a
    save under a name its destination holds; ``delete_guard(name)`` is the context a
    ``delete()`` runs in (rank 0).

    Restores with ``fallback=True``: ``optimistic`` reads straight into the live state and
    agrees afterwards; ``prechecked(info)`` says a candidate was checked since its last write (it
    is read without checksums); ``agree`` is the communicator the ranks agree through (default:
    the one saves commit among); ``order(info)`` ranks the candidates (default: commit order;
    also what ``latest()`` takes as newest); ``eligible(info)`` admits them (default: all);
    ``group`` the job's ranks committing together here (a node group: a save of a sharded tensor
    is refused, and only damage found by one of them is moved aside by its lowest rank).
    """

    retention: RetentionPolicy | None = None
    exclusive: Callable[[float], None] | None = None
    released: Callable[[str, float], None] | None = None
    on_commit: Callable[..., None] | None = None
    check_name: Callable[[str, bool], None] | None = None
    delete_guard: Callable[[str], ContextManager[Any]] | None = None
    optimistic: bool = False
    prechecked: Callable[[CheckpointInfo], bool] | None = None
    agree: Any = None
    order: Callable[[CheckpointInfo], int] | None = None
    eligible: Callable[[CheckpointInfo], bool] | None = None
    group: frozenset[int] | None = None


class TierCheckpointer:
    """Saves and restores the checkpoints of one directory (one tier of a
    :class:`datastates.Checkpointer`, which documents the calls; docs/api.md).

    ``store``: the storage to use instead of the one ``directory`` names (the memory tier's
    recycling store). ``share=other`` uses ``other``'s pipeline (host cache, threads),
    configuration and, unless ``communicator`` names the ranks this one commits among (a node
    group of the memory tier), its communicator. ``policy``: what this tier varies.
    """

    config: CheckpointConfig
    comm: Any
    _pipeline: Pipeline

    def __init__(
        self,
        directory: str | os.PathLike,
        config: CheckpointConfig | None = None,
        *,
        registry: ProviderRegistry | None = None,
        communicator=None,
        share: "TierCheckpointer | None" = None,
        storage_options: Mapping[str, Any] | None = None,
        store: Store | None = None,
        policy: TierPolicy | None = None,
    ):
        self.directory = normalize(directory)
        #: Where the checkpoints live: the local file system, or an object store for
        #: ``s3://bucket/prefix`` (endpoint and credentials from ``storage_options`` or the
        #: environment; the bucket and credentials are checked here).
        self.store = store or open_store(self.directory, storage_options)
        self.policy = policy or TierPolicy()
        if share is not None:
            share._check_open()
            if config is not None and config != share.config:
                raise ConfigError(
                    "a Checkpointer created with share= uses the shared one's "
                    f"config; found a different one: {config}"
                )
            self.config, self._pipeline = share.config, share._pipeline
            self.comm = communicator or share.comm
        else:
            self.config = config or CheckpointConfig()
            self.comm = communicator or default_communicator()
        self._owns_pipeline = share is None
        self._owns_comm = share is not None and self.comm is not share.comm
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
        self._guarded: "weakref.WeakKeyDictionary[torch.optim.Optimizer, Any]" = (
            weakref.WeakKeyDictionary()
        )
        self._closed = False
        #: The committed checkpoints of the directory as last listed: each commit, ``list`` and
        #: ``latest`` list the directory but read only the manifests that changed since.
        self._catalog = Catalog(self.directory, self.store, self.world_size)
        cfg = self.config
        #: Which checkpoints each commit keeps (``policy.retention``, else the config's).
        self.retention = self.policy.retention or RetentionPolicy(
            cfg.keep_last, cfg.keep_every, cfg.keep_best, cfg.best_metric, cfg.best_mode
        )

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
        """Start a checkpoint of ``state`` in this tier and return its handle
        (:meth:`datastates.Checkpointer.save`). ``persist=True``: the save is due for storage
        (``policy.check_name`` before, ``policy.on_commit`` after its commit)."""
        name = check_target("save", step, tag, persist)
        assert name is not None  # save() names a checkpoint (check_target)
        check_view(state, view)
        t0 = time.perf_counter()
        self._check_open()
        self._report_dropped_failures()
        self._bound_pending()
        # From here on the save has an identity: a failure still takes part in its commit round,
        # so the other ranks fail this save too (and stay in step for the next one).
        sid = self.comm.save_id(self.directory, name, step)
        deadline = time.monotonic() + self.config.commit_timeout_s
        cfg, policy = self.config, self.policy
        target = SaveTarget(
            sid=sid,
            name=name,
            step=step,
            root=self.directory,
            rank=self.rank,
            tmp=self._publisher.tmp_location(self.directory, name, self.comm.run_id, sid.serial),
            store=self.store,
            overwrite=overwrite,
            deadline=deadline,
            timeout_s=cfg.commit_timeout_s,
            fsync=cfg.fsync,
            replica_check=cfg.replica_check,
            retention=self.retention,
            catalog=self._catalog,
            comm=self.comm,
            exclusive=functools.partial(policy.released, name)
            if overwrite and policy.released is not None
            else policy.exclusive,
            on_commit=functools.partial(policy.on_commit, overwrite=overwrite)
            if persist and policy.on_commit is not None
            else None,
        )
        try:
            job = self._plan_job(
                state,
                metadata,
                replicated,
                optimizers,
                dataclasses.replace(target, metrics=check_metrics(metrics)),
                t0,
                persist,
                view,
            )
        except BaseException as exc:
            failed = Job(
                target,
                flat=Flattened(tree={"t": "value", "v": None}),
                layout=plan_layout([], [], cfg.unit_bytes),
                write_tensors=[],
                objects=[],
                metadata={},
                ready=None,
                t0=t0,
            )
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
        if job.reads_lazy() and (
            self.config.lazy == "never" or (self.config.lazy == "auto" and not self._guarded)
        ):
            job.captured.wait()
        else:
            job.eager_captured.wait()
        job.stats.blocked_s = time.perf_counter() - t0
        return handle

    def _plan_job(
        self,
        state,
        metadata,
        replicated,
        optimizers,
        target: SaveTarget,
        t0: float,
        persist: bool | None = None,
        view: str | None = None,
    ) -> Job:
        """Validate, walk and plan one save on the training thread (the part that may fail)."""
        if metadata is not None and not isinstance(metadata, dict):
            raise TypeError(f"metadata must be a dict, found {type(metadata).__qualname__}")
        check_depth(metadata or {})
        decoded = json.loads(fmt.encode_json(metadata or {}))
        if decoded != (metadata or {}):  # fail now, not in background
            raise TypeError(
                "metadata must survive a JSON round trip unchanged (string keys; "
                f"lists, not tuples): {metadata!r}"
            )
        metadata = decoded  # exactly what a reader of the manifest will find
        self._publisher.check_name(self.directory, target.name, target.overwrite)
        if persist and self.policy.check_name is not None:
            self.policy.check_name(target.name, target.overwrite)
        flat = flatten(state, self.registry, allow_unsafe=self.config.allow_unsafe_objects)
        items = flat.items
        if view is not None and flat.tree["t"] not in ("dict", "odict"):
            raise ConfigError(
                f"save(): view={view!r} expected a top-level key of the state, found a state "
                f"saved as a whole ({type(state).__qualname__} with keys that are not JSON "
                "scalars, or a dict subclass)"
            )
        check_dtypes(items)
        if self.policy.group is not None:
            _check_unsharded(items)
        self._decide_capture(flat, optimizers)
        tensors = items.tensor_indexes()
        _mark_replicated(items, tensors, replicated)
        writes = self._tensors_to_write(items, tensors)
        lazy = items.lazy
        eager = [i for i in writes if not lazy[i]]
        writes = eager + [i for i in writes if lazy[i]]  # eager units first
        objects = list(items.blobs)  # in item order: added as the walk found them
        layout = plan_layout(
            [items.nbytes[i] for i in writes],
            [items.nbytes[i] for i in objects],
            self.config.unit_bytes,
            framed=True,
        )
        self._publisher.hold(self.directory, self.comm.run_id, self.config.fsync)
        ready = self._pipeline.copier.record_ready([items.tensors[i] for i in writes])
        return Job(
            target,
            flat=flat,
            layout=layout,
            write_tensors=writes,
            objects=objects,
            metadata=metadata,
            ready=ready,
            t0=t0,
            eager_units=units_holding(layout, len(eager)),
            eager_items=len(eager),
            digest_replicas=self.config.replica_check and self.world_size > 1,
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
        opt = capture.torch_optimizer(optimizer)
        if opt is None:
            raise TypeError(
                f"guard(): {type(optimizer).__qualname__} is not a torch optimizer "
                "and has no .optimizer attribute leading to one"
            )
        if opt in self._guarded:
            return
        self._guarded[opt] = capture.add_step_waiter(opt, self._before_step)

    def _decide_capture(self, flat, optimizers: Iterable[Any]) -> None:
        """Guard the optimizers part of this save and decide lazy/eager for every tensor."""
        in_save: builtins.list[torch.optim.Optimizer] = []
        for found, given in [
            *((True, o) for o in flat.optimizers),
            *((False, o) for o in optimizers),
        ]:
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
        """Wait for every in-flight save of this tier; raise the first failure."""
        try:
            return wait_all(self._pending)
        finally:
            self._prune()

    def in_flight(self) -> list[SaveHandle]:
        """The handles of this tier's saves since the last wait, oldest first."""
        return list(self._pending)

    def forget_finished(self) -> None:
        """Drop the handles of finished saves from :meth:`in_flight` (a failure nobody saw is
        reported by the next save, or by ``close()``)."""
        self._prune()

    def drain(self) -> None:
        """Return once every save in flight on the shared pipeline is committed or failed."""
        self._check_open()
        self._pipeline.drain()

    def check_name(self, name: str, overwrite: bool) -> None:
        """Refuse (CheckpointExistsError) a save under ``name`` that this directory holds,
        unless ``overwrite``: what ``save()`` checks first."""
        self._publisher.check_name(self.directory, name, overwrite)

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
        """Restore a committed checkpoint of this tier (the latest if no step/tag) into the live
        ``state`` (:meth:`datastates.Checkpointer.restore`)."""
        check_target("restore", step, tag)
        step, tag = self._target(step, tag, fallback)
        passed: list[DamagedCheckpoint] = []
        if fallback:
            return self._with_fallback(
                step,
                tag,
                trusted,
                safe_globals,
                None,
                rank_policy,
                "restore()",
                passed,
                lambda r: r.plan_restore(state, keys=keys, strict=strict, cast=cast),
                lambda r, plan: r.apply(plan),
            )
        rereads: list[str] = []
        report = self._read(
            step,
            tag,
            verify,
            trusted,
            safe_globals,
            None,
            rank_policy,
            "restore()",
            passed,
            rereads,
            lambda reader: reader.restore_into(state, keys=keys, strict=strict, cast=cast),
        )
        report.passed_over = [d.name for d in passed]
        report.rereads = rereads
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
        """Load a committed checkpoint of this tier into new objects
        (:meth:`datastates.Checkpointer.load`)."""
        check_target("load", step, tag)
        step, tag = self._target(step, tag, fallback)
        if fallback:
            return self._with_fallback(
                step,
                tag,
                trusted,
                safe_globals,
                map_location,
                rank_policy,
                "load()",
                None,
                lambda r: r.plan_load(keys=keys, dtype=dtype),
                lambda r, planned: r.finish_load(*planned),
            )
        return self._read(
            step,
            tag,
            verify,
            trusted,
            safe_globals,
            map_location,
            rank_policy,
            "load()",
            None,
            [],
            lambda reader: reader.load(keys=keys, dtype=dtype),
        )

    def _read(
        self,
        step,
        tag,
        verify,
        trusted,
        safe_globals,
        map_location,
        rank_policy,
        caller: str,
        passed: list | None,
        rereads: list[str],
        read,
    ):
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
                with Reader(
                    info.path,
                    manifest=self._catalog.manifest(info) if latest else None,
                    registry=self.registry,
                    rank=self.rank,
                    store=self.store,
                    world_size=self.world_size,
                    threads=self.config.reader_threads,
                    verify=self.config.verify if verify is None else verify,
                    trusted=trusted,
                    safe_globals=safe_globals,
                    map_location=map_location,
                    rank_policy=rank_policy,
                    view=True,
                ) as reader:
                    result = read(reader)
                if isinstance(result, RestoreReport):  # found at another path (set_aside)
                    result.name = info.name
                return result
            except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
                name = (
                    info.name
                    if info is not None
                    else fmt.check_name(tag)
                    if tag is not None
                    else fmt.step_name(step)
                    if step is not None
                    else None
                )
                if (
                    len(rereads) >= _REREADS
                    or self.world_size > 1
                    or name is None
                    or not self._replaced(name, info)
                ):
                    raise  # (several ranks re-reading on their own could restore two commits)
                rereads.append(f"{name}: {type(exc).__name__}: {exc}")
                log.warning(
                    "%s: the checkpoint %s was replaced or deleted by another process "
                    "while it was read (%s: %s); finding and reading it again",
                    caller,
                    name,
                    type(exc).__name__,
                    exc,
                )

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

    def _with_fallback(
        self,
        step,
        tag,
        trusted,
        safe_globals,
        map_location,
        rank_policy,
        caller: str,
        passed: list | None,
        plan,
        finish,
    ):
        """``restore``/``load`` with ``fallback=True``: ``plan(reader)`` on each candidate,
        verified, agreed (restore/resume.py), then ``finish(reader, planned)``."""
        policy = self.policy
        self._check_open()
        try:  # a rank refused here still answers the rounds' exchange (resume.refuse)
            if step is not None or tag is not None:
                raise ConfigError(
                    f"{caller}: fallback=True restores the newest intact "
                    f"checkpoint; it takes no step= or tag= (found step={step!r}, "
                    f"tag={tag!r})"
                )
            check_rank_policy(rank_policy)
            self._pipeline.drain()
        except Exception as exc:
            resume.refuse(self.policy.agree or self.comm, exc, self.config.commit_timeout_s)
            raise

        def open_reader(info):
            prechecked = self.policy.prechecked is not None and self.policy.prechecked(info)
            if prechecked:
                log.info(
                    "%s: %s was checked by the memory keeper after its last write; "
                    "copying it without checksumming again",
                    caller,
                    info.name,
                )
            return Reader(
                info.path,
                manifest=self._catalog.manifest(info),
                registry=self.registry,
                rank=self.rank,
                store=self.store,
                world_size=self.world_size,
                threads=self.config.reader_threads,
                verify=not prechecked,
                trusted=trusted,
                safe_globals=safe_globals,
                map_location=map_location,
                rank_policy=rank_policy,
                view=True,
            )

        def prepare(reader):
            planned = plan(reader)
            if policy.optimistic:
                return planned, 0
            return planned, reader.verify_planned(
                planned[0] if isinstance(planned, tuple) else planned
            )

        def quarantine(name, reason):
            read = self._catalog.info(name)
            if read is not None and self._replaced(name, read):
                log.warning(
                    "%s: the checkpoint %s was replaced or deleted by another process "
                    "while it was read (%s); what is there now is not moved aside",
                    caller,
                    name,
                    reason,
                )
                return None
            try:
                return self._publisher.quarantine(self.directory, name, reason, self.config.fsync)
            except OSError as exc:  # also CheckpointNotFoundError: deleted meanwhile
                log.warning(
                    "%s: could not move the damaged checkpoint %s aside: %s", caller, name, exc
                )
                return None

        reader, planned, skipped, nbytes, seconds = resume.choose(
            self._catalog,
            policy.agree or self.comm,
            open_reader=open_reader,
            prepare=prepare,
            quarantine=quarantine,
            timeout_s=self.config.commit_timeout_s,
            caller=caller,
            apply=finish if policy.optimistic else None,
            order=policy.order,
            eligible=policy.eligible,
            mover=lambda ranks: (
                self.rank == 0 and (policy.group is None or not policy.group.isdisjoint(ranks))
            ),
        )
        with reader:
            used = info_of(reader.dir, reader.manifest)
            damaged = self._catalog.passed_over(used)
            log_passed_over(damaged, used, caller)
            result = planned if policy.optimistic else finish(reader, planned)
        if isinstance(result, RestoreReport):
            result.skipped, result.verified_nbytes, result.verify_s = skipped, nbytes, seconds
            result.passed_over = [d.name for d in damaged]
            result.prechecked = not reader.verify
        return result

    # ------------------------------------------------------------ listing
    def list(self) -> builtins.list[CheckpointInfo]:
        """This tier's committed checkpoints, oldest first (:meth:`datastates.Checkpointer.list`)."""
        if not self.store.isdir(self.directory):
            return []
        return self._catalog.scan()

    def latest(self) -> CheckpointInfo | None:
        """This tier's newest committed checkpoint: the last commit, or the highest by
        ``policy.order`` (:meth:`datastates.Checkpointer.latest`)."""
        if not self.store.isdir(self.directory):
            return None
        found = self._catalog.scan()
        order = self.policy.order
        newest = max(found, key=order, default=None) if order else found[-1] if found else None
        log_passed_over(self._catalog.passed_over(newest), newest, "latest()")
        return newest

    def _target(self, step, tag, fallback: bool) -> tuple[int | None, str | None]:
        """What a restore or load reads: ``(step, tag)`` as asked, or, for the latest (without
        ``fallback``, which ranks the candidates by ``policy.order`` itself) when
        ``policy.order`` makes another checkpoint than the last commit the newest, that one."""
        if self.policy.order is None or fallback or step is not None or tag is not None:
            return step, tag
        found = self._catalog.scan() if self.store.isdir(self.directory) else []
        newest = max(found, key=self.policy.order, default=None)
        if newest is None or newest.name == found[-1].name:
            return None, None
        named_by_step = newest.step is not None and newest.name == fmt.step_name(newest.step)
        return (newest.step, None) if named_by_step else (None, newest.name)

    def damaged(self) -> builtins.list[DamagedCheckpoint]:
        """This tier's damaged checkpoints (:meth:`datastates.Checkpointer.damaged`)."""
        if not self.store.isdir(self.directory):
            return []
        self._catalog.scan()
        return self._catalog.damaged()

    def delete(self, step: int | None = None, *, tag: str | None = None) -> None:
        """Delete a checkpoint of this tier, committed or damaged, on rank 0, inside
        ``policy.delete_guard`` (:meth:`datastates.Checkpointer.delete`)."""
        name = check_target("delete", step, tag)
        assert name is not None  # delete() names a checkpoint (check_target)
        if self.rank == 0:
            guard = self.policy.delete_guard
            if guard is not None:
                self._pipeline.drain()  # a save just committed is handed on before we look
            with guard(name) if guard is not None else contextlib.nullcontext():
                retention.delete(self.directory, name, self.config.fsync, self.store)

    # ------------------------------------------------------------ lifecycle
    def close(self) -> None:
        """Wait for this tier's in-flight saves, stop the threads and free the host cache if it
        owns them (idempotent; :meth:`datastates.Checkpointer.close`)."""
        if self._closed:
            return
        self._closed = True  # from here on save/restore/load raise CheckpointerClosedError
        self.finish()
        self._report_dropped_failures()
        for remove in list(self._guarded.values()):  # (any thread: see add_step_waiter)
            remove()
        self._guarded.clear()
        if self._owns_pipeline:
            self._pipeline.close()
        if self._owns_pipeline or self._owns_comm:
            self.comm.close()
        self._publisher.close()

    def finish(self) -> None:
        """Return once every save of this tier in flight has committed or failed (their failures
        stay on their handles)."""
        for handle in list(self._pending):
            handle.wait_finished()

    def __enter__(self) -> "TierCheckpointer":
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
            raise CommitTimeoutError(
                f"Checkpointer({self.directory!r}) on rank {self.rank}: "
                f"every rank must construct it: {exc}"
            ) from None

    def _tensors_to_write(self, items: Items, tensors: builtins.list[int]) -> builtins.list[int]:
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
                warnings.warn(
                    f"datastates: an earlier checkpoint {handle.name!r} failed: {err!r}",
                    RuntimeWarning,
                    stacklevel=3,
                )

    def _check_open(self) -> None:
        if self._closed:
            raise CheckpointerClosedError(f"the Checkpointer of {self.directory} is closed")
        if self._pipeline.closed:
            raise CheckpointerClosedError(
                f"the Checkpointer whose pipeline the one of {self.directory} shares was closed"
            )


def wait_all(handles: Iterable[SaveHandle]) -> builtins.list[CheckpointInfo]:
    """Wait for each save in ``handles``, in that order; raise the first failure once all have
    finished, else return their infos."""
    errors, infos = [], []
    for handle in handles:
        try:
            infos.append(handle.wait())
        except BaseException as exc:
            errors.append(exc)
    if errors:
        raise errors[0]
    return infos


def _mark_replicated(items: Items, tensors: builtins.list[int], replicated) -> None:
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
        raise ConfigError(
            f"the memory tier on several nodes keeps per-rank and replicated "
            f"tensors; found {len(sharded)} sharded tensor(s) (TensorShard, "
            f"DTensor), first {sharded[0]!r}: save them with persist=True, or run "
            "the memory tier on one node (docs/memory-tier.md, Several nodes)"
        )


def default_communicator():
    """The communicator of the default process group's ranks, or of this process alone."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        return StoreCommunicator.from_process_group()
    return LocalCommunicator()

"""One save's commit on one rank, the work of the pipeline's commit thread once the rank's shard
file is written (docs/format.md, "Commit protocol").

The rank's report goes into the round (``round.py``); rank 0 reviews the reports (``review.py``)
and, if they form one checkpoint of this save, numbers and publishes it (``publish.py``); the
verdict, the same on every rank, is then applied: every rank records the checkpoint in its
catalog (so ``latest()`` agrees on every rank whatever its listing shows), rank 0 points
``latest`` at it and applies the retention policy (``retention.py``). Nothing here raises: the
outcome carries the checkpoint or the error the save's handle raises.
"""

from __future__ import annotations

import dataclasses
import logging
import time
import warnings
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import CommitError, CommitTimeoutError, CommitUnknownError, StorageError, write_error
from ..format import codec as fmt
from ..format.records import CheckpointInfo, Manifest, RankReport, Verdict, info_of
from ..storage.store import Store
from .catalog import Catalog, committed_save
from .publish import publisher_for
from .retention import RetentionPolicy
from .review import review
from .round import FenceLost, SaveId

log = logging.getLogger("datastates")


@dataclass(frozen=True)
class SaveTarget:
    """Where and as what one save commits. Built by ``Checkpointer.save`` on the training thread;
    read by the pipeline's threads, never changed."""

    sid: SaveId
    name: str
    step: int | None
    root: str  #: the checkpoint directory, as this rank spells it
    tmp: str  #: the save's temporary location (the same on every rank)
    rank: int
    store: Store
    overwrite: bool
    deadline: float  #: time.monotonic() by which the save must be decided
    timeout_s: float  #: the commit timeout the deadline was computed from
    fsync: bool
    replica_check: bool
    retention: RetentionPolicy
    #: The writer's catalog of ``root`` (commit numbering reads only what changed since).
    catalog: Catalog | None = None
    #: The communicator of the ranks this save commits among (None: the pipeline's).
    comm: Any = None
    #: The save's metrics, checked by ``save()`` (rank 0's go into the manifest).
    metrics: dict = dataclasses.field(default_factory=dict)
    #: Rank 0, before it publishes: ``exclusive(deadline)`` returns once no other writer
    #: commits into ``root`` (the memory keeper copying into storage); raises CommitError if
    #: that does not happen by ``deadline``.
    exclusive: Callable[[float], None] | None = None
    #: Rank 0, after the commit, retention and ``latest``: ``on_commit(info)`` (the memory
    #: tier hands the checkpoint on to be written to storage).
    on_commit: Callable[[CheckpointInfo], None] | None = None

    @property
    def path(self) -> str:
        return self.store.join(self.root, self.name)


@dataclass(frozen=True)
class Published:
    """What rank 0's publish committed: the checkpoint, and the committed checkpoints of the root
    right after the commit, oldest first (what retention counts)."""

    info: CheckpointInfo
    committed: list[CheckpointInfo]


@dataclass(frozen=True)
class Outcome:
    """How one save ended on this rank: committed (``info``) or failed (``error``, what the
    handle raises)."""

    info: CheckpointInfo | None = None
    error: BaseException | None = None


def commit_save(
    comm, target: SaveTarget, report: RankReport, metadata: dict, own_error: BaseException | None
) -> Outcome:
    """Run the commit round of this save and apply its verdict (see the module docstring).

    ``report``: this rank's report (its failure, when ``own_error`` is set); ``metadata``: the
    checkpoint's metadata (rank 0's goes into the manifest). Never raises."""
    state = _Round(target, metadata, comm.members[target.rank])
    try:
        verdict = comm.agree(
            target.sid,
            report,
            target.deadline,
            target.timeout_s,
            check=state.check,
            commit=state.publish,
            fallback=state.on_disk,
        )
    except BaseException as exc:  # never hang or crash the commit thread
        verdict = Verdict.abort(
            "store",
            f"checkpoint {target.name!r}: coordination with the other ranks failed ({exc})",
            {target.rank: repr(exc)},
        )
    try:  # a group of some ranks (the memory tier of several nodes): did every group commit?
        elsewhere = comm.settle(target.sid, verdict.ok, target.timeout_s)
    except Exception as exc:  # noqa: BLE001 - then it is not known to be committed everywhere
        elsewhere = repr(exc)
    if verdict.ok:
        try:
            info = state.info or _named_here(target, verdict.info)
        except CommitError as exc:  # a committed verdict naming no checkpoint
            return Outcome(error=exc)
        if elsewhere is not None:
            log.warning(
                "datastates: %r is committed by the ranks %s, but not known to be "
                "committed by every group of the job (%s): it evicts no older "
                "checkpoint",
                target.name,
                comm.members,
                elsewhere,
            )
        after_commit(target, info, state.published, retain=elsewhere is None)
        return Outcome(info=info)
    own_error = own_error or state.failure
    error = own_error
    if comm.world_size > 1 or own_error is None:
        kind = {"timeout": CommitTimeoutError, "unknown": CommitUnknownError}.get(
            verdict.kind, CommitError
        )
        causes = {
            comm.members[r] if 0 <= r < len(comm.members) else r: cause
            for r, cause in verdict.causes.items()
        }  # the job's ranks
        error = kind(f"{verdict.message}: {_by_cause(causes)}", causes)
        error.__cause__ = own_error
    if target.rank != 0:  # rank 0 removes the whole temporary location (the pipeline's tidy)
        publisher_for(target.store).discard(
            target.tmp, target.rank, keep_file=verdict.kind in ("store", "unknown")
        )
    return Outcome(error=error)


class _Round:
    """The callbacks of one round on this rank, and what they learn for the outcome."""

    def __init__(self, target: SaveTarget, metadata: dict, job_rank: int):
        self.target, self.metadata, self.job_rank = target, metadata, job_rank
        self.manifest: Manifest | None = None
        self.published: Published | None = None
        self.info: CheckpointInfo | None = None
        #: Rank 0: why its publish failed (what a single rank's handle raises as it is).
        self.failure: BaseException | None = None

    def check(self, reports: dict[int, RankReport]) -> Verdict | None:
        """Rank 0: the abort verdict for these reports, or None if they form a checkpoint (its
        manifest is then kept for :meth:`publish`). A rank whose save expired makes it a
        timeout, as when that rank had not reported at all."""
        t = self.target
        expired = sorted(r for r, rep in reports.items() if rep.expired)
        if expired:
            return Verdict.abort(
                "timeout",
                f"checkpoint {t.name!r} was not committed: rank(s) "
                f"{expired} had not written it within the commit timeout",
                {r: str(reports[r].error) for r in expired},
            )
        elsewhere = _elsewhere(t, reports)
        if elsewhere:
            return Verdict.abort(
                "mismatch",
                f"checkpoint {t.name!r} was not committed: same "
                f"name, different directory: rank 0 saves to {t.root}, "
                + ", ".join(f"rank {r} to {d}" for r, d in elsewhere.items()),
                {r: f"saves {t.name!r} to {d}, rank 0 to {t.root}" for r, d in elsewhere.items()},
            )
        verdict, self.manifest = review(
            reports,
            name=t.name,
            step=t.step,
            metadata=self.metadata,
            save_id=t.sid.nonce,
            tmp=t.tmp,
            replica_check=t.replica_check,
            store=t.store,
            metrics=t.metrics,
        )
        return verdict

    def publish(self, reports: dict[int, RankReport], fence: Callable[[], None]) -> Verdict:
        """Rank 0, after claiming the decision: number and publish the reviewed manifest, calling
        ``fence()`` right before the checkpoint becomes visible; the commit verdict. Raises what
        the publish raised (the round makes it an abort), FenceLost as it is."""
        t = self.target
        if self.manifest is None:
            raise RuntimeError(
                f"committing {t.name!r}: publish() was called before review() made the manifest"
            )
        try:
            if t.exclusive is not None:
                t.exclusive(t.deadline)
            self.published = publish_numbered(t, self.manifest, fence)
        except FenceLost:
            raise
        except BaseException as exc:
            self.failure = write_error(t.rank, f"committing {t.name!r}", exc)
            raise
        self.info = self.published.info
        return Verdict.committed(self.info)

    def on_disk(self, why: str, until: float) -> Verdict:
        """The verdict when only the disk can tell (``why``): committed once the manifest of
        ``root/name`` records this save, looked for until ``until`` (``time.monotonic()``;
        at least once); else unknown (kind ``unknown``: the checkpoint may still appear)."""
        t = self.target
        delay = 0.01
        while True:
            info = committed_save(t.root, t.name, t.sid.nonce, t.store)
            if info is not None:
                self.info = info
                return Verdict.committed(info)
            left = until - time.monotonic()
            if left <= 0:
                break
            time.sleep(min(delay, left))  # waiting for a file, with a deadline
            delay = min(delay * 2, 0.25)
        return Verdict.abort(
            "unknown",
            f"checkpoint {t.name!r}: whether it was committed is "
            f"unknown on rank {self.job_rank}: {why}, and no manifest of this save "
            f"appeared at {t.path} by the commit deadline (it may still "
            "appear; a restore reads what is on disk)",
            {t.rank: why},
        )


def publish_numbered(
    target: SaveTarget, manifest: Manifest, fence: Callable[[], None] | None = None
) -> Published:
    """Make the save's temporary location the committed checkpoint ``root/name`` atomically
    (:meth:`Publisher.publish`), the manifest numbered one more than the highest commit number of
    the root (a copy of ``manifest`` is written: the reviewed record is never changed).

    Rank 0 only. The catalog (the writer's, kept between commits: numbering reads only the
    manifests that changed since the previous commit) records the new checkpoint.

    CommitError, nothing committed, when the number cannot be decided: a manifest of the root
    could not be read (an I/O error, a store that does not answer: the checkpoint it belongs to
    may hold the highest number, which the commit would then reuse).

    When ``root/name`` exists: a committed checkpoint is replaced only with ``overwrite``
    (CheckpointExistsError otherwise, also when another writer committed it meanwhile); a
    damaged one (its ``manifest.json`` does not decode or validate) is replaced whatever
    ``overwrite`` says, its bytes kept -- moved aside to ``.damaged.<name>.<uid>`` on a local
    disk, left to the cleanup of stale data on an object store -- with a WARNING; a local
    directory that is no checkpoint is never replaced (CheckpointExistsError)."""
    t = target
    catalog = t.catalog if t.catalog is not None else Catalog(t.root, t.store)
    numbered = dataclasses.replace(manifest, seq=_next_seq(catalog, t.name))
    final, stamp, written = publisher_for(t.store).publish(
        t.root, t.tmp, t.name, numbered, t.overwrite, t.fsync, fence=fence
    )
    info = info_of(final, written)
    return Published(info, catalog.record(info, stamp, written))


def _next_seq(catalog: Catalog, name: str) -> int:
    """One more than the highest commit number of the catalog's root; CommitError if some
    manifest could not be read (see :func:`publish_numbered`)."""
    try:
        committed = catalog.scan()
    except StorageError as exc:
        raise CommitError(
            f"checkpoint {name!r} was not committed: its commit number cannot be decided ({exc})",
            {0: str(exc)},
        ) from exc
    return max((i.seq for i in committed), default=0) + 1


def _named_here(target: SaveTarget, info: CheckpointInfo | None) -> CheckpointInfo:
    """The committed checkpoint as this rank names it (rank 0's path may be spelt otherwise)."""
    if info is None:
        raise CommitError(
            f"checkpoint {target.name!r}: the verdict says committed but names no checkpoint",
            {target.rank: "a verdict without its checkpoint"},
        )
    return dataclasses.replace(info, name=target.name, path=target.path, step=target.step)


def after_commit(
    target: SaveTarget, info: CheckpointInfo, published: Published | None, retain: bool = True
) -> None:
    """Every rank records the checkpoint in its catalog; rank 0 then moves ``latest`` and applies
    retention (unless ``retain`` is False: a group's commit that not every group of the job
    made evicts nothing). The checkpoint is committed whatever happens here: a failure to move ``latest``
    (readers fall back to the newest manifest) or to apply retention is a warning naming what
    failed, not a failed save."""
    t = target
    if t.rank != 0:
        if t.catalog is not None:  # latest() agrees on every rank, whatever it lists
            t.catalog.record(info, None)
        return
    try:
        publisher_for(t.store).write_latest(t.root, t.name, t.fsync)
    except Exception as exc:
        warnings.warn(
            f"datastates: {t.name!r} is committed, but updating "
            f"{t.store.join(t.root, fmt.LATEST)} failed: {exc}",
            RuntimeWarning,
            stacklevel=2,
        )
    try:
        if retain:
            t.retention.apply(
                t.root,
                protect=t.name,
                fsync=t.fsync,
                store=t.store,
                committed=published.committed if published else None,
                damaged=t.catalog.damaged() if t.catalog is not None else None,
            )
    except Exception as exc:
        warnings.warn(
            f"datastates: {t.name!r} is committed, but applying retention in "
            f"{t.root} failed: {exc}",
            RuntimeWarning,
            stacklevel=2,
        )
    if t.on_commit is not None:
        try:
            t.on_commit(info)
        except Exception as exc:
            warnings.warn(
                f"datastates: {t.name!r} is committed, but handing it on failed: {exc!r}",
                RuntimeWarning,
                stacklevel=2,
            )


def _elsewhere(target: SaveTarget, reports: dict[int, RankReport]) -> dict[int, str]:
    """Rank 0: the ranks that saved this name into another directory (rank → the directory
    it named). A rank naming the directory differently (a link, another mount point) whose
    shard file is in rank 0's temporary directory shares it; one whose file is not there
    wrote elsewhere."""
    out = {}
    for r, report in sorted(reports.items()):
        if r == 0 or report.failed or report.root == target.root:
            continue
        path = target.store.join(target.tmp, fmt.shard_file_name(r))
        try:
            target.store.open_read(path).close()
        except (OSError, ValueError):
            out[r] = report.root
    return out


def _by_cause(causes) -> str:
    """ "rank 1: cause; ranks [0, 2]: other cause" (ranks sharing a cause are named once)."""
    groups: dict[str, list[int]] = {}
    for r, cause in sorted(causes.items()):
        groups.setdefault(cause, []).append(r)
    return "; ".join(
        f"rank {rs[0]}: {c}" if len(rs) == 1 else f"ranks {rs}: {c}" for c, rs in groups.items()
    )

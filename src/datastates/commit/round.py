"""Coordination between ranks for the commit, off the training process group.

Background threads never call collectives on the training group: they exchange small JSON
messages through a c10d ``Store`` (the TCPStore that ``torch.distributed`` already runs, or an
in-process ``HashStore`` for one process) with explicit deadlines, so a dead rank produces an error
naming it instead of a hang.

One save is one *round*, named by its :class:`SaveId` (run id, name, step, attempt → nonce), which
every rank derives on its own at ``save()``: no collective is needed to agree on it, and a rank
that skips a save or calls another step simply writes under another nonce. The attempt counts
saves of the same name *and step* only, so a rank that skipped one save is back in step at its
next save of another step, even of the same name (a tag saved again, ``tag="best"``); only a
retry of the very step it skipped stays apart. The directory is not part
of it: ranks may spell one shared directory differently (a link, another mount point), and
whether they write into one directory is checked by rank 0's review instead. Keys of a round::

    <nonce>/r<k>       rank k's report (its file, entries, or its error)        written by rank k
    <nonce>/n          reports posted: +1 each, +2**32 for a failed one          every rank
    <nonce>/decision   the verdict: pending, publishing, commit/abort (below)    compare-and-set
    <nonce>/beat       rank 0's heartbeat while it publishes (a counter)          rank 0
    <nonce>/done       how many ranks have taken the verdict (last one deletes the round's keys)
    announce/r<k>      the last save rank k reported (to explain a mismatch)
    orphans/n, orphans/<i>  rounds some rank never finished; rank 0 deletes their keys later

The decision key is the arbiter, and what a rank reports is what it says. Its states::

    absent --rank 0's claim--> PENDING --rank 0's fence--> PUBLISHING --rank 0--> commit | abort
       |                          |
       +--a rank's deadline-->  abort  <--a rank that gave up on a silent rank 0 (the fence)
                                          (and rank 0 when its review or publish failed)

Every arrow is a compare-and-set from the state at its tail, so of the writers racing from one
state exactly one wins, and the others read the winner. Rank 0 claims PENDING (on an absent key)
before it writes the manifest, then wins PUBLISHING (from PENDING) right before the single step
that makes the checkpoint visible (``fence`` in :meth:`agree`: the rename, or the PUT of the
manifest), and only after the step writes the final verdict (commit, or abort if the step
failed). A rank whose deadline passes before any claim claims an abort; once PENDING, the others
wait however long the publish takes while rank 0 beats ``<nonce>/beat`` (its deadline no longer
applies), and after a silence of ``max(timeout_s, silent_s)`` (a stopped or dead rank 0) replace
PENDING by an abort. Why every rank gets the verdict the disk shows, in every interleaving:

- Nothing becomes visible without PUBLISHING, and PUBLISHING is won only from PENDING: once a
  rank's abort is in the key, rank 0 (resumed after SIGSTOP, a VM pause) loses the fence, makes
  nothing visible and reports that abort (``tests/dist/test_verdicts.py``).
- After PUBLISHING the others can no longer abort: they wait for rank 0's final verdict. Should
  rank 0 fall silent between the fence and that verdict, only the disk can tell: a rank takes
  the commit if the manifest records this save, else raises CommitUnknownError (the rename may
  still come; a restore reads what is on disk) -- never a verdict it cannot know.
- If the store becomes unreachable (its host exited: rank 0 with ``init_method="env://"``, whose
  process may exit right after ``wait()``; or the agent's host died), a rank other than 0 waits
  until the deadline for the manifest of this save to appear (the manifest records the nonce):
  committed if it does, CommitUnknownError if not. Rank 0 without the store loses the fence, so
  it commits nothing it cannot record.

Every other agreement of the ranks goes through the same store with two primitives and one
gather, all in this module: :func:`claim` (the first compare-and-set of an absent key wins and
holds: a decision key, preemption's stop step), :func:`peek` (one request that never blocks)
and :meth:`StoreCommunicator.exchange` (an all-gather of small JSON values under a topic: the
constructor's agreement that rank 0's cleanup is done, a fallback restore's rounds, the memory
tier's agreements). The n-th exchange of a topic has the keys::

    x/<topic>/<n>/r<k>       rank k's value (boxed in a list)    written, then deleted, by rank k
    x/<topic>/<n>/n          values posted: +1 each, +2**32 once an abort wins  every rank (add)
    x/<topic>/<n>/decision   every value in rank order (runs of equal ones     claimed (below)
                             as one), or an abort naming the ranks missing
    x/<topic>/<n>/done       ranks that took the values; the last deletes n, decision, done

Rank 0 gathers: it polls the counter (one request per poll, which also shows an abort), reads
each value once when all are counted, and claims the decision key with all of them; every
other rank posts its value, counts itself in, and polls the one decision key. Each rank then
deletes its own value. So an exchange costs rank 0 ranks + 5 requests and every other rank 4,
plus their polls and 3 for the last rank to finish (docs/scale.md, "Restart"); an all-gather
in which every rank read every rank's key cost each rank about ranks + 4. Equal values of
ranks in a row are published once, so the key each rank reads does not grow with the ranks
when they send the same value. A rank whose deadline passes claims the decision itself: an
abort naming the ranks whose values are missing, or, when they are all there (rank 0 slow),
the values; the first claim holds for all. An aborted exchange leaves its counter and decision
behind, so that a rank that skipped it sees, in the count it posts, that it ended without it.

A group of some ranks (:meth:`subgroup`: the memory tier of several nodes) runs the same round
among its ranks, names them by their job rank in its messages, and then calls :meth:`settle`:
an exchange of the job tells every rank whether every group committed the save; a group's commit
that not every group made stays committed on that group but evicts nothing (``committer.py``).
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable

from ..errors import CorruptCheckpointError
from ..format.records import PENDING, PUBLISHING, RankReport, Verdict
from ..format.validate import decode_rank_report, parse_rank_report, parse_verdict

log = logging.getLogger("datastates")

#: What a failed report adds to the reports counter ``<nonce>/n`` (a good one adds 1): the
#: counter says how many reported and how many failed in one read.
_FAILED = 1 << 32
#: What no rank ever writes: ``compare_set(key, _ABSENT, _ABSENT)`` reads a key without
#: blocking (:func:`peek`).
_ABSENT = "\x00absent"


def claim(store, key: str, value: str) -> bytes:
    """Set ``key`` to ``value`` if it is absent (compare-and-set), in one request: the first
    claim of a key wins and holds. Returns the value in force: ``value`` (encoded) when this
    call won, the winner's otherwise. Thread-safe, any rank; ``store`` is a c10d ``Store`` or
    one of this module's."""
    return store.compare_set(key, "", value)


def peek(store, key: str) -> bytes | None:
    """The value of ``key``, or None if it is absent, in one request that never blocks
    (``Store.get`` waits for a missing key, and another rank may delete a key between a
    ``check`` and a ``get``): a compare-and-set of a value no rank writes."""
    raw = store.compare_set(key, _ABSENT, _ABSENT)
    return None if raw == _ABSENT.encode() else raw


def new_run_id() -> str:
    """A unique id for one Checkpointer's run that also names its owner (pid and host), so a
    temporary directory left by a dead process is recognised from its name alone."""
    return f"{uuid.uuid4().hex[:8]}@{os.getpid()}@{socket.gethostname()}"


@dataclass(frozen=True)
class SaveId:
    """The identity of one save, derived independently and identically on every rank.

    ``attempt`` counts this rank's earlier saves of the same name and step during this run, in
    any directory (saving a name again with ``overwrite=True`` is a new save); ``ordinal`` counts all
    of this rank's saves (only used to explain mismatches). ``nonce`` names the round's keys and
    is recorded in the committed manifest as ``save_id``."""

    run_id: str
    name: str
    step: int | None
    attempt: int
    nonce: str
    ordinal: int

    @property
    def serial(self) -> int:
        """A number of this save, the same on every rank and distinct for every save of the
        run (its nonce's first 48 bits): it names the save's temporary location."""
        return int(self.nonce[:12], 16)

    def describe(self) -> dict:
        return {
            "name": self.name,
            "step": self.step,
            "nonce": self.nonce,
            "attempt": self.attempt,
            "ordinal": self.ordinal,
        }


def timeout_verdict(
    sid: SaveId,
    missing: list[int],
    timeout: float,
    announced: dict[int, dict | None],
    members: list[int] | None = None,
) -> Verdict:
    """The abort verdict for reports that did not arrive, naming each missing rank (its job rank:
    ``members[r]`` in a group of some ranks; the causes stay keyed by the round's ranks)."""
    causes = {}
    named = missing if members is None else [members[r] for r in missing]
    for r in missing:
        seen = announced.get(r)
        cause = f"no report for {sid.name!r} within {timeout:g} s of save()"
        if seen and seen.get("nonce") != sid.nonce:
            step = "" if seen.get("step") is None else f" step {seen.get('step')}"
            cause += (
                f" (its latest save is {seen.get('name')!r}{step}, its save #{seen.get('ordinal')})"
            )
        elif not seen:
            cause += " (it has reported no save yet)"
        causes[r] = cause
    return Verdict.abort(
        "timeout",
        f"checkpoint {sid.name!r} was not committed: rank(s) "
        f"{named} did not report in time (dead, hung, or making another save)",
        causes,
    )


class FenceLost(Exception):
    """Raised by the ``fence`` that :meth:`StoreCommunicator.agree` hands to rank 0's
    ``commit``: the other ranks gave up on this save (or the store failed) before it was made
    visible; ``verdict`` is the verdict in force. Nothing may be made visible after it."""

    def __init__(self, verdict: Verdict):
        super().__init__(verdict.message)
        self.verdict = verdict


class StoreCommunicator:
    """N ranks sharing a c10d ``Store``; see the module docstring for the protocol.

    Thread model: :meth:`save_id` is called by the training thread, :meth:`agree` by the commit
    thread (one round at a time per process, in ``save()`` order)."""

    #: A waiting rank polls the store every ``poll_s``, backing off to ``max_poll_s`` (so a
    #: long write by rank 0 does not flood the store with requests from every rank).
    poll_s, max_poll_s = 0.002, 0.05
    #: ... and at most ``max_poll_s`` or ``poll_per_rank_s`` × ranks, whichever is longer: the
    #: polls of all waiting ranks then reach the store (one thread serving every request, about
    #: 15 µs each measured here) at most 1 / poll_per_rank_s = 20,000 times a second, at any
    #: world size (docs/scale.md).
    poll_per_rank_s = 50e-6
    #: Rank 0 beats every ``beat_s`` while it publishes; the others take a heartbeat silent for
    #: ``max(timeout_s, silent_s)`` as rank 0's death.
    beat_s, silent_s = 1.0, 10.0

    def __init__(self, store, rank: int, world_size: int, run_id: str):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.run_id = run_id
        self._attempts: dict[tuple[str, int | None], int] = {}
        self._ordinal = 0
        self._lock = threading.Lock()
        self._swept = 0  # rank 0: orphan slots already cleaned
        self._exchanges: dict[str, int] = {}  # calls of exchange() per topic
        self._max_poll = max(self.max_poll_s, self.poll_per_rank_s * world_size)
        #: The job's rank of each rank of this communicator (a group of some ranks, subgroup()).
        self.members: list[int] = list(range(world_size))
        #: The job's communicator, for a group of some ranks (subgroup()); None: this is it.
        self.job: "StoreCommunicator | None" = None

    @classmethod
    def from_process_group(cls, group=None) -> "StoreCommunicator":
        """Built on the training thread (one collective to agree on a run id) from the default
        process group's store."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        rank, world = dist.get_rank(group), dist.get_world_size(group)
        box = [new_run_id() if rank == 0 else None]
        dist.broadcast_object_list(
            box, src=dist.get_global_rank(group, 0) if group else 0, group=group
        )
        run_id = str(box[0])
        store = dist.PrefixStore(f"datastates/{run_id}/", c10d._get_default_store())
        return cls(store, rank, world, run_id)

    def subgroup(self, name: str, ranks: list[int]) -> "StoreCommunicator":
        """The communicator of ``ranks`` (this rank among them), under keys of their own in
        this store (``name`` tells the groups apart): local rank ``i`` is ``ranks[i]``. The run
        id is this one's, so the save ids of a group are the job's (the memory tier of several
        nodes: memory/nodes.py)."""
        group = StoreCommunicator(
            PrefixedStore(f"group/{name}/", self.store),
            ranks.index(self.rank),
            len(ranks),
            self.run_id,
        )
        group.members = [self.members[r] for r in ranks]
        group.job = self
        return group

    def settle(self, sid: SaveId, ok: bool, timeout_s: float) -> str | None:
        """A group's round (:meth:`subgroup`), once it has its verdict: every rank of the job
        says whether its group committed ``sid`` (an :meth:`exchange` of the job's
        communicator); None when every group did (and for the job's own communicator), else
        which job ranks' groups did not, or did not answer within ``timeout_s``. Every rank of
        the job calls it once per round of its group, in save order."""
        if self.job is None:
            return None
        try:
            answers = self.job.exchange("group-commit", {"nonce": sid.nonce, "ok": ok}, timeout_s)
        except TimeoutError as exc:
            return str(exc)
        failed = sorted(
            r
            for r, a in answers.items()
            if not (isinstance(a, dict) and a.get("ok") is True and a.get("nonce") == sid.nonce)
        )
        return f"the groups of job rank(s) {failed} did not commit it" if failed else None

    # ------------------------------------------------------------ identity
    def save_id(self, directory: str, name: str, step: int | None) -> SaveId:
        """The identity of this rank's next save of ``name`` (counts it). ``directory`` is
        where it goes, and deliberately not part of the identity: each rank names it in its own
        spelling (the review checks that the files meet in one directory)."""
        with self._lock:
            attempt = self._attempts.get((name, step), 0)
            self._attempts[(name, step)] = attempt + 1
            ordinal, self._ordinal = self._ordinal, self._ordinal + 1
        digest = hashlib.sha256(f"{self.run_id}\0{name}\0{step}\0{attempt}".encode())
        return SaveId(self.run_id, name, step, attempt, digest.hexdigest()[:24], ordinal)

    @staticmethod
    def round_keys(nonce: str, world_size: int) -> list[str]:
        """Every key a round may create (for cleanup and for tests)."""
        return [f"{nonce}/r{r}" for r in range(world_size)] + [
            f"{nonce}/{key}" for key in ("n", "decision", "beat", "done")
        ]

    # ------------------------------------------------------------ one round
    def agree(
        self,
        sid: SaveId,
        report: RankReport,
        deadline: float,
        timeout_s: float,
        *,
        check: Callable[[dict[int, RankReport]], Verdict | None],
        commit: Callable[[dict[int, RankReport]], Verdict],
        fallback: Callable[[str, float], Verdict],
    ) -> Verdict:
        """Run the round of ``sid`` and return its verdict, the same on every rank.

        ``deadline`` is ``time.monotonic()`` at ``save()`` plus ``timeout_s``. Rank 0 calls
        ``check(reports)`` (an abort verdict, or None to commit) and ``commit(reports, fence)``
        (publishes, returns the commit verdict, may raise) only after claiming the decision key;
        ``commit`` calls ``fence()`` right before the step that makes the checkpoint visible, and
        ``fence`` raises :class:`FenceLost` (carrying the verdict in force) if the other ranks
        gave up meanwhile. ``reports`` holds rank 0's own report as built and the others' as
        parsed from the store (a report that does not validate aborts the round as ``invalid``,
        naming its rank). Other ranks call ``fallback(why, until)`` when only the disk can tell
        (the store is unreachable, or rank 0 fell silent after winning the fence): committed if
        a manifest of this save appears by ``until`` (``time.monotonic()``), else the verdict is
        unknown (kind ``unknown``).
        """
        own = report
        try:
            if self.world_size > 1:  # alone, the report stays in memory (no JSON round trip)
                self._set_report(sid, report)
                self.store.add(f"{sid.nonce}/n", _FAILED if report.failed else 1)
            self._set_json(f"announce/r{self.rank}", sid.describe())
        except Exception as exc:  # the store is gone: nothing to clean
            return self._lost(sid, exc, fallback, deadline)
        decision: Verdict | None
        if self.rank == 0:
            decision = self._coordinate(sid, deadline, timeout_s, check, commit, own)
        else:
            try:
                decision = self._await(sid, deadline, timeout_s)
            except Exception as exc:
                return self._lost(sid, exc, fallback, deadline)
            if decision is None:  # rank 0 won the fence, then fell silent: the disk tells
                decision = fallback(
                    f"rank {self.members[0]} began making the checkpoint "
                    "visible, then fell silent (stopped or dead)",
                    time.monotonic(),
                )
        self._finish(sid, decision)
        return decision

    def _coordinate(self, sid, deadline, timeout_s, check, commit, own: RankReport) -> Verdict:
        """Rank 0: wait for the reports, read and check them, claim the decision and publish."""
        try:
            if self.world_size > 1:
                self._wait_for_reports(sid, deadline)
        except Exception as exc:
            return self._lost(sid, exc, None, deadline)
        try:
            raw, missing = self._reports_present(sid) if self.world_size > 1 else ({}, [])
            announced = {r: self._get_json(f"announce/r{r}") for r in missing}
        except Exception as exc:
            return self._lost(sid, exc, None, deadline)
        reports: dict[int, RankReport] = {}
        decision: Verdict | None
        if missing:
            decision = timeout_verdict(sid, missing, timeout_s, announced, self.members)
        else:
            try:
                decision, reports = self._check(sid, own, raw, check)
            except Exception as exc:  # a bug in a check: abort, never crash
                decision = Verdict.abort(
                    "invalid",
                    f"checkpoint {sid.name!r}: the reports could not be checked ({exc!r})",
                    {0: repr(exc)},
                )
        del raw  # decoded: what the check kept is in ``reports``
        if decision is None and time.monotonic() > deadline:
            decision = Verdict.abort(
                "timeout",
                f"checkpoint {sid.name!r} was not committed within the commit timeout",
                {0: f"deadline passed before rank {self.members[0]} could commit"},
            )
        try:
            claimed = self._claim(sid, decision if decision is not None else PENDING)
        except Exception as exc:
            return self._lost(sid, exc, None, deadline)
        if claimed != PENDING:
            return claimed  # ours, or an abort claimed first by a rank whose deadline passed
        beating = self._heartbeat(sid)
        fenced = False

        def fence() -> None:  # idempotent: a publish may call it before each try
            nonlocal fenced
            if fenced:
                return
            try:
                won = self._replace(sid, PENDING, PUBLISHING)
            except Exception as exc:  # the store is gone: nothing may become visible now
                raise FenceLost(
                    Verdict.abort(
                        "store",
                        f"checkpoint {sid.name!r} was not committed: the coordination "
                        f"store failed before rank {self.members[0]} could make it visible ({exc})",
                        {0: repr(exc)},
                    )
                ) from exc
            if won != PUBLISHING:
                raise FenceLost(won)  # the others gave up on this rank: their abort stands
            fenced = True

        try:
            final = commit(reports, fence)
        except FenceLost as lost:
            return lost.verdict  # nothing was made visible; the key holds this verdict
        except BaseException as exc:
            final = Verdict.abort(
                "commit",
                f"committing {sid.name!r} failed on rank {self.members[0]}: {exc}",
                {0: repr(exc)},
            )
        finally:
            beating()
        try:
            if fenced:  # after the fence only this rank writes the key
                self._set_json(f"{sid.nonce}/decision", final.to_json())
            else:  # failed before the fence: an abort, unless the others gave up first
                final = self._replace(sid, PENDING, final)
        except Exception:
            pass  # the others read the verdict from the disk (the manifest records the nonce)
        return final

    def _check(
        self, sid, own: RankReport, raw: dict[int, tuple[Any, bool]], check
    ) -> tuple[Verdict | None, dict[int, RankReport]]:
        """Rank 0: parse the other ranks' reports (bytes from other processes, decoded by
        ``decode_rank_report``), each naming the rank whose key it was read from, and ask
        ``check``; (its verdict, the parsed reports)."""
        reports = {self.rank: own}
        for r, (obj, checked) in sorted(raw.items()):
            if r == self.rank:
                continue
            try:
                reports[r] = parse_rank_report(
                    obj, f"the report of rank {r} for {sid.name!r}", checked=checked
                )
            except CorruptCheckpointError as exc:
                return Verdict.abort(
                    "invalid",
                    f"checkpoint {sid.name!r} was not committed: "
                    f"rank {r}'s report does not validate",
                    {r: str(exc)},
                ), {}
            if reports[r].rank != r:
                return Verdict.abort(
                    "invalid",
                    f"checkpoint {sid.name!r} was not committed: "
                    f"the report of rank {r} says rank {reports[r].rank}",
                    {r: f"reported as rank {reports[r].rank}"},
                ), {}
        return check(reports), reports

    def _wait_for_reports(self, sid: SaveId, deadline: float) -> None:
        """Return once every rank has reported, a report failed, the decision was claimed or
        the deadline passed. Each poll costs two requests whatever the world size (the reports
        counter ``<nonce>/n`` and the decision key); the reports are then read once
        (``_reports_present``): O(ranks) requests per round, not per poll."""
        delay = self.poll_s
        while True:
            count = self.store.add(f"{sid.nonce}/n", 0)
            if (
                count // _FAILED
                or count % _FAILED >= self.world_size
                or self.store.check([f"{sid.nonce}/decision"])
                or time.monotonic() >= deadline
            ):
                return
            time.sleep(delay)  # polling store keys, not synchronizing on time
            delay = min(delay * 1.5, self._max_poll)

    def _reports_present(self, sid: SaveId) -> tuple[dict[int, tuple[Any, bool]], list[int]]:
        """The reports present now, one key at a time (a failed one ends the reading: it
        decides the round), each as ``decode_rank_report`` gives it, and the ranks whose report
        is missing. (Not ``multi_get``: a rank that gave up deletes its report, and a ``get`` of
        a missing key blocks.)"""
        reports: dict[int, tuple[Any, bool]] = {}
        for r in range(self.world_size):
            raw = self.peek(f"{sid.nonce}/r{r}")
            if raw is not None:
                reports[r] = report = decode_rank_report(raw)
                if isinstance(report[0], dict) and "error" in report[0]:
                    return reports, []
        return reports, [r for r in range(self.world_size) if r not in reports]

    def _heartbeat(self, sid: SaveId) -> Callable[[], None]:
        """Rank 0, from its claim of the decision: beat ``<nonce>/beat`` every ``beat_s`` in a
        thread, so that the other ranks keep waiting for a publish that outlasts the deadline.
        Returns the call that stops the beating (it returns once no beat can follow)."""
        if self.world_size == 1:
            return lambda: None
        stop = threading.Event()

        def beat():
            while not stop.wait(self.beat_s):
                try:
                    self.store.add(f"{sid.nonce}/beat", 1)
                except Exception:
                    return  # the store is gone: the others read the verdict from the disk

        thread = threading.Thread(target=beat, name="datastates-heartbeat", daemon=True)
        thread.start()

        def halt():
            stop.set()
            thread.join()

        return halt

    def _await(self, sid: SaveId, deadline: float, timeout_s: float) -> Verdict | None:
        """Non-zero rank: wait for the verdict; claim an abort when the deadline passes before
        rank 0 claimed the decision. After its claim, wait for the final verdict while rank 0's
        heartbeat goes on. Once it fell silent: replace a PENDING claim with an abort (the fence:
        rank 0 then publishes nothing); after PUBLISHING, None (only the disk can tell)."""
        key = f"{sid.nonce}/decision"
        beat, heard_at = None, None
        silence = max(timeout_s, self.silent_s)
        delay = self.poll_s
        while True:
            decision = self._get_verdict(key)
            if decision is not None:
                if not decision.pending:
                    return decision
                now, last = time.monotonic(), self._get_json(f"{sid.nonce}/beat")
                if heard_at is None or last != beat:
                    beat, heard_at = last, now
                elif now - heard_at > silence:
                    if decision.publishing:
                        return None
                    first, me = self.members[0], self.members[self.rank]
                    decision = self._replace(
                        sid,
                        PENDING,
                        Verdict.abort(
                            "timeout",
                            f"checkpoint {sid.name!r} was not committed: rank {first} "
                            f"claimed the commit, then fell silent for {silence:g} s (stopped or "
                            f"dead); rank {me} gave up on it",
                            {0: f"no heartbeat for {silence:g} s while committing"},
                        ),
                    )
                    if not decision.pending:
                        return decision
                    heard_at = now  # rank 0 won the fence meanwhile: it is alive, wait again
            elif time.monotonic() >= deadline:
                missing = [
                    r for r in range(self.world_size) if not self.store.check([f"{sid.nonce}/r{r}"])
                ]
                if missing:
                    announced = {r: self._get_json(f"announce/r{r}") for r in missing}
                    mine = timeout_verdict(sid, missing, timeout_s, announced, self.members)
                else:
                    mine = Verdict.abort(
                        "timeout",
                        f"checkpoint {sid.name!r} was not committed: "
                        f"rank {self.members[0]} published no verdict in time",
                        {0: "no verdict within the commit timeout (stalled or dead)"},
                    )
                decision = self._claim(sid, mine)
                if not decision.pending:
                    return decision
                continue  # rank 0 claimed it first: wait for its verdict, as above
            time.sleep(delay)
            delay = min(delay * 1.5, self._max_poll)

    def _claim(self, sid: SaveId, decision: Verdict) -> Verdict:
        """Compare-and-set the decision key if absent; return the decision in force."""
        value = json.dumps(decision.to_json(), sort_keys=True)
        raw = self.claim(f"{sid.nonce}/decision", value)
        return self._verdict(raw, f"{sid.nonce}/decision")

    def _replace(self, sid: SaveId, expected: Verdict, decision: Verdict) -> Verdict:
        """Compare-and-set the decision key from ``expected`` to ``decision``; return the
        decision in force (``decision`` if it replaced ``expected``)."""
        raw = self.store.compare_set(
            f"{sid.nonce}/decision",
            json.dumps(expected.to_json(), sort_keys=True),
            json.dumps(decision.to_json(), sort_keys=True),
        )
        return self._verdict(raw, f"{sid.nonce}/decision")

    def _finish(self, sid: SaveId, decision: Verdict) -> None:
        """Delete what this rank wrote; the last rank to take the verdict deletes the round.
        A round that some rank never finished is registered for rank 0 to delete later."""
        try:
            self.store.delete_key(f"{sid.nonce}/r{self.rank}")
            if self.store.add(f"{sid.nonce}/done", 1) >= self.world_size:
                for key in self.round_keys(sid.nonce, self.world_size):
                    self.store.delete_key(key)
            elif not decision.ok:
                slot = self.store.add("orphans/n", 1)
                self._set_json(f"orphans/{slot}", sid.nonce)
            if self.rank == 0 and decision.ok:
                self._sweep()
        except Exception:
            pass  # the verdict stands; a lost store has no keys left to delete

    def _sweep(self) -> None:
        """Rank 0, after a commit: delete the keys of rounds registered as orphans (aborted
        rounds that some rank never finished). Every rank reported the committed round, so no
        rank is still inside an earlier one; a rank that joins an orphan later finds no verdict
        and aborts it at its deadline. A rank registers a round only after deleting its own
        report, so a swept round can never commit."""
        last = self._get_json("orphans/n") or 0  # a counter kept by Store.add, as digits
        while self._swept < last:
            nonce = self._get_json(f"orphans/{self._swept + 1}")
            if nonce is None:
                break  # registered but not written yet: next time
            self._swept += 1
            for key in self.round_keys(nonce, self.world_size) + [f"orphans/{self._swept}"]:
                self.store.delete_key(key)

    def _lost(self, sid: SaveId, exc: BaseException, fallback, deadline: float) -> Verdict:
        """The verdict of a rank that lost the store. Rank 0, before the fence: nothing was
        committed. Another rank cannot know: it waits for the manifest until the deadline."""
        if self.rank == 0:
            return Verdict.abort(
                "store",
                f"checkpoint {sid.name!r}: the coordination store "
                f"failed ({exc}); nothing was committed",
                {0: repr(exc)},
            )
        return fallback(
            f"the coordination store is unreachable ({type(exc).__name__}: {exc})", deadline
        )

    # ------------------------------------------------------------ other agreements
    def claim(self, key: str, value: str) -> bytes:
        """:func:`claim` in this communicator's store."""
        return claim(self.store, key, value)

    def peek(self, key: str) -> bytes | None:
        """:func:`peek` in this communicator's store."""
        return peek(self.store, key)

    def exchange(self, topic: str, value: Any, timeout_s: float) -> dict[int, Any]:
        """Every rank's ``value`` (small JSON) for the next exchange of ``topic``, as
        ``{rank: value}``: an all-gather through the store, off the training group, for the
        agreements other than a commit (the constructor's, a restore choosing its checkpoint,
        the memory tier's). Every rank calls it for the same topics in the same order (the
        n-th call of a topic meets the n-th call of every other rank); the calls block the
        calling thread, whichever it is.

        Rank 0 gathers and publishes (module docstring, "Exchanges"): each rank posts its
        value and counts itself in; rank 0 reads the values once all are counted and claims
        the exchange's decision key with all of them; the others read that one key. Store
        requests per exchange: O(ranks) at rank 0, O(1) at every other rank (polls aside:
        one request each, backing off as the round's).

        All ranks get the same answer: the values (read-only: ranks that sent equal values
        may share one object), or TimeoutError on every rank. A rank whose
        ``timeout_s`` passes first claims an abort naming the ranks whose values are missing,
        and the first claim holds for everyone (a rank that timed out after rank 0 claimed the
        values takes the values). A rank that skipped a call the others made, or came after
        they gave up on it, finds that exchange aborted with itself named missing: it goes on
        to the next one (a WARNING), so the calls after it meet again. A store that fails (its
        host, rank 0 in the default launch, exited: torch raises a network or store error) is
        TimeoutError too, saying so, as no agreement can be reached through it."""
        if self.world_size == 1:
            return {0: value}
        try:
            return self._exchange(topic, value, time.monotonic() + timeout_s, timeout_s)
        except TimeoutError:
            raise
        except (RuntimeError, OSError) as exc:
            raise TimeoutError(
                f"the coordination store is unreachable ({type(exc).__name__}: "
                f"{exc}): its host (rank 0 in the default launch) exited or "
                "cannot be reached"
            ) from exc

    def _exchange(
        self, topic: str, value: Any, deadline: float, timeout_s: float
    ) -> dict[int, Any]:
        while True:
            with self._lock:
                count = self._exchanges.get(topic, 0)
                self._exchanges[topic] = count + 1
            prefix = f"x/{topic}/{count}"
            self._set_json(f"{prefix}/r{self.rank}", [value])  # boxed: a None value is a value
            posted = self.store.add(f"{prefix}/n", 1)
            if posted >= _FAILED:  # an abort was claimed: maybe without this rank
                outcome = self._outcome(prefix)
            elif self.rank == 0:
                outcome = self._gather(prefix, value, deadline)
            else:
                outcome = self._await_outcome(prefix, deadline)
            if not (
                outcome["go"] is False
                and self.rank in outcome["missing"]
                and time.monotonic() < deadline
            ):
                break
            # That exchange ended without this rank: it skipped it (or came after the others
            # gave up on it), so they have gone on to the next one: meet them there.
            self.store.delete_key(f"{prefix}/r{self.rank}")
            log.warning(
                "the exchange %r #%d had ended without rank %d (it skipped that call, "
                "or came after the others gave up on it); rank %d meets the other ranks "
                "at #%d",
                topic,
                count,
                self.rank,
                self.rank,
                count + 1,
            )
        self.store.delete_key(f"{prefix}/r{self.rank}")  # in the decision, or not needed
        if outcome["go"] is not True:  # the counter and the decision stay for late ranks
            raise TimeoutError(
                f"rank(s) {outcome['missing']} did not answer the exchange "
                f"{topic!r} #{count} within {timeout_s:g} s (seen by rank "
                f"{outcome['rank']})"
            )
        if self.store.add(f"{prefix}/done", 1) >= self.world_size:
            for key in ("n", "decision", "done"):
                self.store.delete_key(f"{prefix}/{key}")
        values = [value for value, ranks in outcome["runs"] for _ in range(ranks)]
        if len(values) != self.world_size:
            raise TimeoutError(
                f"the exchange {topic!r} #{count} decided {len(values)} values "
                f"for {self.world_size} ranks"
            )
        return dict(enumerate(values))

    def _gather(self, prefix: str, own: Any, deadline: float) -> dict:
        """Rank 0: wait until every rank counted itself in (one request per poll, which also
        sees an abort claimed meanwhile), then read each other rank's value once and claim the
        decision with all of them (:meth:`_conclude`). The outcome in force."""
        delay = self.poll_s
        while True:
            posted = self.store.add(f"{prefix}/n", 0)
            if posted >= _FAILED:
                return self._outcome(prefix)
            late = time.monotonic() >= deadline
            if posted >= self.world_size or late:
                boxes = [[own]] + self._values(prefix, range(1, self.world_size))
                if late or all(box is not None for box in boxes):
                    return self._conclude(prefix, boxes)
                # Counted in, then gone: another rank claimed the decision meanwhile (at its
                # deadline: the values, then deleted its own, or an abort not marked yet)
                raw = self.peek(f"{prefix}/decision")
                if raw is not None:
                    return json.loads(raw)
            time.sleep(delay)  # polling store keys, not synchronizing on time
            delay = min(delay * 1.5, self._max_poll)

    def _await_outcome(self, prefix: str, deadline: float) -> dict:
        """A rank other than 0: poll the decision key (one request per poll) until it is
        claimed; at the deadline, read every value and claim the decision itself
        (:meth:`_conclude`: the values if all are there, rank 0 being slow, else an abort
        naming the ranks missing; a request per rank, on this path only)."""
        delay = self.poll_s
        while True:
            raw = self.peek(f"{prefix}/decision")
            if raw is not None:
                return json.loads(raw)
            if time.monotonic() >= deadline:
                return self._conclude(prefix, self._values(prefix, range(self.world_size)))
            time.sleep(delay)  # polling store keys, not synchronizing on time
            delay = min(delay * 1.5, self._max_poll)

    def _values(self, prefix: str, ranks: range) -> list[Any]:
        """The boxed values of ``ranks`` posted now, None for each one missing."""
        out = []
        for r in ranks:
            raw = self.peek(f"{prefix}/r{r}")
            out.append(None if raw is None else json.loads(raw))
        return out

    def _conclude(self, prefix: str, boxes: list[Any]) -> dict:
        """Claim the decision: every value when ``boxes`` (every rank's, None if missing) are
        all there, else an abort naming the ranks missing. The outcome in force. The values are
        written as runs (a value and how many ranks in a row sent it): an exchange whose ranks
        send equal values, the usual case, publishes one value, not one per rank."""
        missing = [r for r, box in enumerate(boxes) if box is None]
        if missing:
            return self._decide(prefix, {"go": False, "rank": self.rank, "missing": missing})
        runs: list[list[Any]] = []  # [value, how many ranks in a row sent it]
        last = None
        for box in boxes:
            text = json.dumps(box[0], sort_keys=True)
            if text == last:
                runs[-1][1] += 1
            else:
                runs.append([box[0], 1])
                last = text
        return self._decide(prefix, {"go": True, "rank": self.rank, "runs": runs})

    def _decide(self, prefix: str, outcome: dict) -> dict:
        """Claim the exchange's decision key with ``outcome``; an abort that wins also marks
        the counter (``+_FAILED``), so that rank 0 and every late rank see it in the request
        they make anyway. The outcome in force."""
        mine = json.dumps(outcome, sort_keys=True)
        raw = self.claim(f"{prefix}/decision", mine)
        if outcome["go"] is False and raw == mine.encode():
            self.store.add(f"{prefix}/n", _FAILED)
        return json.loads(raw)

    def _outcome(self, prefix: str) -> dict:
        """The decision claimed (an abort marked in the counter: it is there)."""
        raw = self.peek(f"{prefix}/decision")
        if raw is None:  # deleted: only after every rank took the values, so not of this rank
            raise TimeoutError(f"the exchange {prefix!r} has no decision")
        return json.loads(raw)

    # ------------------------------------------------------------ helpers
    def _set_json(self, key: str, value: Any) -> None:
        self.store.set(key, json.dumps(value, sort_keys=True))

    def _set_report(self, sid: SaveId, report: RankReport) -> None:
        """This rank's report, its fields in the order of ``to_json`` (its file before its
        entries: rank 0 checks each entry as it is decoded, ``decode_rank_report``)."""
        self.store.set(f"{sid.nonce}/r{self.rank}", json.dumps(report.to_json()))

    def _get_json(self, key: str) -> Any:
        """The value of ``key`` parsed, or None if absent (:func:`peek`: never blocks)."""
        raw = self.peek(key)
        return None if raw is None else json.loads(raw)

    def _get_verdict(self, key: str) -> Verdict | None:
        raw = self.peek(key)
        return None if raw is None else self._verdict(raw, key)

    @staticmethod
    def _verdict(raw: bytes, key: str) -> Verdict:
        """A verdict another rank wrote (validated: it came from another process)."""
        try:
            return parse_verdict(json.loads(raw), f"the verdict {key!r} in the store")
        except ValueError as exc:  # also CorruptCheckpointError: a verdict this rank cannot read
            return Verdict.abort(
                "store",
                f"the verdict {key!r} in the coordination store does "
                "not validate; nothing is known to be committed",
                {0: str(exc)},
            )

    def close(self) -> None:
        """Delete this rank's announcement (best effort: the store may be gone)."""
        try:
            self.store.delete_key(f"announce/r{self.rank}")
        except Exception:
            pass


class MemoryStore:
    """The subset of the c10d ``Store`` API the protocol uses, in memory and thread-safe: the
    store of one process (no ``torch.distributed`` needed), and of tests where threads play
    ranks. Values are bytes, as from a c10d store."""

    def __init__(self):
        self._data: dict[str, bytes] = {}
        self._lock = threading.Lock()

    def set(self, key: str, value) -> None:
        with self._lock:
            self._data[key] = value.encode() if isinstance(value, str) else bytes(value)

    def get(self, key: str) -> bytes:
        with self._lock:
            return self._data[key]

    def check(self, keys: list[str]) -> bool:
        with self._lock:
            return all(k in self._data for k in keys)

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        """c10d semantics: set ``desired`` if the value is ``expected`` (or the key is absent
        and ``expected`` is empty); return the value in force (``expected`` if absent)."""
        with self._lock:
            current = self._data.get(key)
            if (current is None and expected == "") or current == expected.encode():
                self._data[key] = desired.encode()
                return self._data[key]
            return current if current is not None else expected.encode()

    def add(self, key: str, amount: int) -> int:
        with self._lock:
            value = int(self._data.get(key, b"0")) + amount
            self._data[key] = str(value).encode()
            return value

    def delete_key(self, key: str) -> bool:
        with self._lock:
            return self._data.pop(key, None) is not None

    def list_keys(self) -> list[str]:
        with self._lock:
            return list(self._data)


class PrefixedStore:
    """The keys of ``store`` that start with ``prefix``, as a store of their own (the methods the
    protocol uses; a c10d store or a :class:`MemoryStore` underneath)."""

    def __init__(self, prefix: str, store):
        self._prefix, self._store = prefix, store

    def set(self, key: str, value) -> None:
        self._store.set(self._prefix + key, value)

    def get(self, key: str) -> bytes:
        return self._store.get(self._prefix + key)

    def check(self, keys: list[str]) -> bool:
        return self._store.check([self._prefix + k for k in keys])

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        return self._store.compare_set(self._prefix + key, expected, desired)

    def add(self, key: str, amount: int) -> int:
        return self._store.add(self._prefix + key, amount)

    def delete_key(self, key: str) -> bool:
        return self._store.delete_key(self._prefix + key)


class LocalCommunicator(StoreCommunicator):
    """One process: the coordinator is itself, the store a :class:`MemoryStore`."""

    def __init__(self, run_id: str | None = None):
        super().__init__(MemoryStore(), 0, 1, run_id or new_run_id())

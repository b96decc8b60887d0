"""The Checkpointer's side of the memory tier: open it, send each save to its tier, choose the
tier a restore reads from (docs/memory-tier.md).

A Checkpointer configured with ``memory_tier`` holds a second Checkpointer, ``memory``, on the
memory root (``<memdir>/ckpt``) that shares its pipeline (host cache, threads, communicator), so
a memory save is the same lazy capture and the same commit protocol as a save to storage, only
into shared memory. The ranks that share a host and a memory directory form a node group
(nodes.py): on one node the memory checkpoints are the job's, on several each group commits its
own among its ranks, and a restore agrees on a step every group holds.
"""
from __future__ import annotations

import logging
import os
import socket
import time
import warnings
from typing import TYPE_CHECKING

from ..commit.retention import RetentionPolicy
from ..errors import CommitTimeoutError, ConfigError, KeeperError, KeeperUnresponsiveError
from ..format.records import CheckpointInfo
from ..storage import is_url
from ..storage.posix import remove_tree
from . import marks, nodes, place
from .handoff import Handoff
from .link import KeeperLink
from .options import MemoryTier
from .persist import persist_newest
from .recycle import SPARE, RecyclingStore

if TYPE_CHECKING:
    from ..checkpointer import Checkpointer

log = logging.getLogger("datastates")


def order(info: CheckpointInfo | None) -> int:
    """What "newer" means across the tiers: the step (a tag counts as older than any step)."""
    return -2 if info is None else -1 if info.step is None else info.step


_SEQ_BITS = 48


def step_then_commit(info: CheckpointInfo) -> int:
    """What "newer" means inside storage when it is compared with memory: the step (``order``),
    then the commit order among checkpoints of one step. One int, as a fallback restore's ranks
    exchange it (restore/resume.py)."""
    return (order(info) + 2) << _SEQ_BITS | min(info.seq, (1 << _SEQ_BITS) - 1)


def storage_newest(found: list[CheckpointInfo]) -> CheckpointInfo | None:
    """Storage's candidate against memory: its highest step, not its last commit (a tag saved
    after step 4, or a tag of an older step, must not let memory's step 3 look newer)."""
    return max(found, key=step_then_commit, default=None)


class Tiers:
    """The memory tier of one Checkpointer (``outer``): its memory Checkpointer, and on rank 0
    the keeper link."""

    def __init__(self, outer: "Checkpointer", tier: MemoryTier, open_memory):
        """``open_memory(directory, store, comm)``: a Checkpointer of ``directory`` sharing
        ``outer``'s pipeline, over ``store``, committing among the ranks of ``comm``."""
        if is_url(outer.directory):
            raise ConfigError("the memory tier writes its checkpoints to a local directory; "
                              f"found the storage {outer.directory!r}")
        self.tier, self.outer = tier, outer
        self.memdir = place.memory_dir(tier.root, outer.directory)
        self.link: KeeperLink | None = None
        timeout = tier.start_timeout_s + outer.config.commit_timeout_s
        # The node groups (nodes.py): the ranks that share a host and a memory directory.
        answers = self._exchange("memory-tier", {"host": socket.gethostname(),
                                                 "memdir": self.memdir}, timeout)
        groups = nodes.groups(answers)
        #: this rank's node group (global ranks, lowest first) and how many groups the job has
        self.group = next(g for g in groups if outer.rank in g)
        self.nodes = len(groups)
        self.writer = tier.storage_writer or ("keeper" if self.nodes == 1 else "trainer")
        if self.writer == "keeper" and self.nodes > 1:
            raise ConfigError(f"MemoryTier(storage_writer='keeper') needs every rank on one node "
                              f"(a keeper holds its node's shards only); found the ranks on "
                              f"{self.nodes} nodes {groups}: leave storage_writer None or set "
                              "'trainer'")
        error = stalled = None
        if outer.rank == self.group[0]:  # the group's keeper, and its record of ranks
            try:
                self.link = KeeperLink.open(outer.directory, tier, outer.config)
                ckpt = os.path.join(self.memdir, place.CKPT)
                nodes.adopt(self.memdir, ckpt,
                            nodes.NodeRanks(outer.world_size, tuple(self.group)))
                # Every node lists its memory at a restore, an empty one too (a rank whose
                # listing raised would leave the others' agreement).
                os.makedirs(ckpt, 0o700, exist_ok=True)
            except KeeperUnresponsiveError as exc:  # alive but stopped or hung: storage only
                stalled = str(exc)
            except Exception as exc:  # noqa: BLE001 - every rank learns of it, then it is raised
                error = exc
        answers = self._exchange("memory-keeper", {"error": None if error is None else
                                                   f"{type(error).__name__}: {error}",
                                                   "stalled": stalled}, timeout)
        if error is not None:
            self._drop()
            raise error
        failed = {r: a["error"] for r, a in answers.items() if a["error"]}
        if failed:
            self._drop()
            raise KeeperError(f"rank {outer.rank}: the memory tier did not open on rank(s) "
                              f"{sorted(failed)}: " + "; ".join(
                                  f"rank {r}: {e}" for r, e in sorted(failed.items())))
        stalled_on = {r: a["stalled"] for r, a in answers.items() if a.get("stalled")}
        #: Why this Checkpointer does without the memory tier (None: it uses it): a keeper
        #: that lives but does not answer (stopped, hung). Every save then goes to storage and
        #: every restore reads storage, with this in ``RestoreReport.tier_fallback``; the
        #: memory is left to that keeper, untouched.
        self.unavailable: str | None = None
        if stalled_on:
            self._drop()
            self.unavailable = ("the memory tier is not used: " + "; ".join(
                f"rank {r}: {e}" for r, e in sorted(stalled_on.items())) +
                "; every save goes to storage and restores read storage")
            log.warning("datastates: %s (a stopped or hung keeper: continue it, or end it and "
                        "restart, to use the memory tier again)", self.unavailable)
            self.memory = None
            self.handoff = None
            return
        comm = outer.comm if self.nodes == 1 else outer.comm.subgroup(
            str(groups.index(self.group)), self.group)
        try:
            self.memory = open_memory(os.path.join(self.memdir, place.CKPT),
                                      RecyclingStore(os.path.join(self.memdir, SPARE)), comm)
        except BaseException:
            self._drop()
            raise
        if self.nodes > 1:  # memory/nodes.py
            self.memory._group = set(self.group)
            self.memory._agree = outer.comm
            self.memory._order = order
        #: Rank 0 with ``storage_writer="keeper"``: the saves due for storage, handed on from
        #: memory to the keeper (handoff.py).
        self.handoff: Handoff | None = None
        if self.writer == "keeper":
            self.memory._check_storage_name = lambda name, overwrite: \
                outer._publisher.check_name(outer.directory, name, overwrite)
        if outer.rank == 0 and self.writer == "keeper":
            self.handoff = handoff = Handoff(self)
            self.memory._on_commit = handoff.submit
            outer._exclusive = handoff.idle  # rank 0's own commits into storage wait
            deadline = lambda: time.monotonic() + outer.config.commit_timeout_s  # noqa: E731
            self.memory._delete_guard = lambda name: handoff.paused(name, deadline())
            self.memory._released = handoff.released
            outer._delete_guard = lambda name: handoff.paused(None, deadline())
        # A tier of its own: the newest keep_last plus the one being written (and those being
        # written to storage).
        self.memory._retention = RetentionPolicy(
            tier.keep_last, None, None, None, "min",
            held=self.handoff.held if self.handoff is not None else None)
        # One pass over memory: read into the live state, checksums verified as it goes, then
        # agree; damage on any rank sends every rank to the next checkpoint, which overwrites.
        self.memory._optimistic = True
        # A checkpoint the keeper checked after its last write is copied without checksums.
        self.memory._prechecked = lambda info: marks.holds(self.memdir, info)

    def _exchange(self, topic: str, value, timeout: float) -> dict:
        """``outer.comm.exchange``; KeeperError (the link dropped) if the ranks do not all
        answer: they did not all open the memory tier."""
        try:
            return self.outer.comm.exchange(topic, value, timeout)
        except TimeoutError as exc:
            self._drop()
            raise KeeperError(f"rank {self.outer.rank}: the ranks did not all open the memory "
                              f"tier: {exc}") from None

    def route(self, step: int | None, tag: str | None, persist: bool | None) -> str:
        """Where a save goes: ``"memory"``, ``"storage"``, or ``"handoff"`` (due for storage,
        written to memory and from there by the keeper). The same on every rank: it depends on
        the arguments, the config and ``unavailable`` (agreed at construction) only."""
        if self.unavailable is not None:
            return "storage"
        if not self.tier.goes_to_storage(step if tag is None else None, persist):
            return "memory"
        return "handoff" if tag is None and self.writer == "keeper" else "storage"

    def wait(self) -> None:
        """Rank 0: wait until the saves handed on are in storage (at most ``commit_timeout_s``:
        CommitTimeoutError); raise the first write that failed (KeeperError)."""
        if self.handoff is None:
            return
        self.handoff.idle(time.monotonic() + self.outer.config.commit_timeout_s)
        errors = self.handoff.take_errors()
        if errors:
            raise errors[0]

    def quiet_storage(self, together: bool) -> None:
        """Before a restore or load reads storage: return once the keeper writes nothing there,
        so the commit's retention cannot remove what is read. Rank 0 waits for the handoff;
        ``together`` (every rank reads storage at this point: the choice was agreed) the other
        ranks wait for rank 0, else they go on. CommitTimeoutError (on every rank, together) if
        a write takes over ``commit_timeout_s``."""
        if self.writer != "keeper" or self.unavailable is not None:  # the same on every rank
            return
        timeout = self.outer.config.commit_timeout_s
        error = None
        if self.handoff is not None:
            try:
                self.handoff.idle(time.monotonic() + timeout)
            except CommitTimeoutError as exc:
                error = str(exc)
        if together:
            try:
                error = self.outer.comm.exchange("storage-quiet", {"error": error},
                                                 2 * timeout)[0]["error"]
            except TimeoutError as exc:
                error = str(exc)
        if error is not None:
            raise CommitTimeoutError(f"rank {self.outer.rank}: not reading storage: {error}",
                                     {0: "busy"})

    def newest(self, storage: CheckpointInfo | None) -> CheckpointInfo | None:
        """The newer of ``storage`` (storage's newest) and the memory's newest; memory on a tie."""
        if self.unavailable is not None:
            return storage
        memory = self.memory.latest()
        return memory if memory is not None and order(memory) >= order(storage) else storage

    def restore_from_memory(self, step: int | None, tag: str | None,
                            storage: CheckpointInfo | None):
        """None when this restore reads storage, else which memory checkpoints it may read
        (``info -> bool``): it reads memory when memory holds the checkpoint asked for, or, for
        the latest, a step at least as new as storage's newest. Rank 0 decides for every rank
        (through the store), and its storage's newest is the oldest memory checkpoint a restore
        of the latest may fall back to (storage holds a newer step than any older one)."""
        if self.unavailable is not None:  # the same on every rank (agreed at construction)
            return None
        if step is None and tag is None:
            memory = self.memory.latest()
            mine = memory is not None and order(memory) >= order(storage)
        else:
            mine = any(i.name == _name(step, tag) for i in self.memory.list())
        answers = self.outer.comm.exchange("restore-tier", [bool(mine), order(storage)],
                                           self.outer.config.commit_timeout_s)
        chosen, floor = answers[0]
        return (lambda info: order(info) >= floor) if chosen else None

    def after_restore(self, step: int | None) -> None:
        """Several nodes, after a restore of the latest settled on ``step`` (either tier): each
        node removes its memory checkpoints of later steps, with a WARNING. A node whose peers
        lack them cannot restore them, and the steps trained again after the restore would
        collide with them on this node only (CheckpointExistsError on its ranks alone)."""
        if self.nodes == 1 or step is None or self.unavailable is not None:
            return
        if self.outer.rank == self.group[0]:  # memory.delete() works on the node's lowest rank
            for info in self.memory.list():
                if info.step is not None and info.step > step:
                    log.warning("datastates: the memory checkpoint %s of this node is removed: "
                                "the job restored step %d (the other nodes do not all hold %s)",
                                info.name, step, info.name)
                    self.memory.delete(step=info.step)
        # No rank of the node saves before they are gone (its save would find the name taken).
        timeout = self.outer.config.commit_timeout_s
        try:
            self.memory.comm.exchange("memory-trimmed", {}, timeout)
        except TimeoutError as exc:
            raise CommitTimeoutError(f"rank {self.outer.rank}: restored step {step}, but the "
                                     f"ranks of this node did not all return: {exc}",
                                     {}) from None

    def close(self, stop: bool) -> None:
        """After the memory Checkpointer closed: detach from the keeper (each node group's
        lowest rank). A keeper that is gone cannot write the memory to storage any more: that
        rank does it here (one node, ``persist_on_exit``), then removes the memory directory if
        no keeper took it over."""
        if self.unavailable is not None:  # the memory is the stalled keeper's, untouched
            return
        self.memory.close()
        self.memory.store.close()  # the shard files' mappings
        if self.handoff is not None:  # before detaching: the keeper is writing for this trainer
            try:
                self.handoff.idle(time.monotonic() + self.outer.config.commit_timeout_s)
                self.handoff.close()
            except CommitTimeoutError as exc:
                log.error("datastates: closing: %s; detaching anyway (the keeper finishes that "
                          "write, then writes the newest memory checkpoint to storage)", exc)
                self.handoff.abandon()
            for error in self.handoff.take_errors():
                warnings.warn(f"datastates: {error}", RuntimeWarning, stacklevel=3)
        if self.link is None:
            return
        lost = self.link.lost
        self.link.close(stop=stop)
        if self.handoff is not None:
            self.handoff.close()  # abandoned: its request ended with the link
        if lost and not place.keeper_running(self.memdir):
            if self.nodes > 1:  # one node's part: the trainers wrote storage (nodes.py)
                log.warning("datastates: the memory keeper of this node is gone; its memory "
                            "checkpoints (this node's ranks only) are removed, storage holds "
                            "the saves written there")
            elif self.tier.persist_on_exit:
                try:
                    persist_newest(os.path.join(self.memdir, place.CKPT), self.outer.directory,
                                   self.outer.config,
                                   checked=lambda info: marks.holds(self.memdir, info))
                except Exception as exc:  # noqa: BLE001 - reported; storage is as it was
                    log.error("datastates: writing the newest memory checkpoint to %s failed: "
                              "%r", self.outer.directory, exc)
                    return  # the memory is kept: a later keeper may persist it
            remove_tree(self.memdir)

    def _drop(self) -> None:
        if self.link is not None:
            self.link.close()


def _name(step: int | None, tag: str | None) -> str:
    from ..format import codec as fmt
    return tag if tag is not None else fmt.step_name(step)

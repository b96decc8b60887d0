"""The Checkpointer's side of the memory tier: open it, send each save to its tier, choose the
tier a restore reads from (docs/memory-tier.md).

A Checkpointer configured with ``memory_tier`` is made of two TierCheckpointers (directory.py):
``storage`` on its directory, and ``memory`` on the memory root (``<memdir>/ckpt``), which shares
storage's pipeline (host cache, threads, communicator), so a memory save is the same lazy capture
and the same commit protocol as a save to storage, only into shared memory. This module opens
the tier (node groups, keepers, the hand-off) and gives each TierCheckpointer its
:class:`TierPolicy`: what differs between the two is only there. The ranks that share a host and a memory directory form a node group
(nodes.py): on one node the memory checkpoints are the job's, on several each group commits its
own among its ranks, and a restore agrees on a step every group holds.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
import warnings
from typing import Iterator

from ..commit.retention import RetentionPolicy
from ..config import CheckpointConfig
from ..directory import TierCheckpointer, TierPolicy
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
    """The memory tier of one Checkpointer: its node group, on the group's lowest rank the
    keeper link, on rank 0 the hand-off to storage, and the policies of its two tiers."""

    def __init__(self, directory: str, tier: MemoryTier, config: CheckpointConfig):
        """The tier of the storage ``directory``, not open yet (:meth:`open`): ConfigError for a
        storage the memory tier cannot serve."""
        if is_url(directory):
            raise ConfigError(
                "the memory tier writes its checkpoints to a local directory; "
                f"found the storage {directory!r}"
            )
        self.tier, self.directory, self.config = tier, directory, config
        self.memdir = place.memory_dir(tier.root, directory)
        self.link: KeeperLink | None = None
        #: The memory tier's TierCheckpointer (:meth:`open`; None before, or when not used).
        self.memory: TierCheckpointer | None = None
        #: Rank 0 with ``storage_writer="keeper"``: the saves due for storage, handed on from
        #: memory to the keeper (handoff.py).
        self.handoff: Handoff | None = None
        #: Why this Checkpointer does without the memory tier (None: it uses it): a keeper
        #: that lives but does not answer (stopped, hung). Every save then goes to storage and
        #: every restore reads storage, with this in ``RestoreReport.tier_fallback``; the
        #: memory is left to that keeper, untouched.
        self.unavailable: str | None = None
        self._floor: int | None = None  # a restore of the latest: the oldest step it may read

    def storage_policy(self) -> TierPolicy:
        """Storage's: its newest is its highest step (then the last commit of it), as across
        the tiers, never a tag saved later, so that memory's older step never looks newer; on
        rank 0 with a keeper writing storage, its own commits and deletes wait while the keeper
        writes there (:meth:`_storage_quiet`)."""
        return TierPolicy(
            order=step_then_commit, exclusive=self._storage_quiet, delete_guard=self._storage_delete
        )

    def _storage_quiet(self, deadline: float) -> None:
        if self.handoff is not None:
            self.handoff.idle(deadline)

    def _storage_delete(self, name: str):
        if self.handoff is None:
            return contextlib.nullcontext()
        return self.handoff.paused(None, self._deadline())

    def open(self, storage: TierCheckpointer) -> TierCheckpointer | None:
        """Open the tier beside ``storage`` (built with :meth:`storage_policy`): agree on the
        node groups with every rank (through storage's communicator), open this node's keeper
        (KeeperError if it does not open on every rank), and return the memory tier's
        TierCheckpointer, sharing storage's pipeline (None when a stalled keeper leaves the
        tier unused: ``unavailable``)."""
        tier, directory, config = self.tier, self.directory, self.config
        self.comm = comm = storage.comm
        self.rank = comm.rank
        try:
            return self._open(storage, tier, directory, config, comm)
        except BaseException:
            self.detach()
            raise

    def _open(self, storage, tier, directory, config, comm) -> TierCheckpointer | None:
        timeout = tier.start_timeout_s + config.commit_timeout_s
        # The node groups (nodes.py): the ranks that share a host and a memory directory.
        answers = self._exchange(
            "memory-tier", {"host": socket.gethostname(), "memdir": self.memdir}, timeout
        )
        groups = nodes.groups(answers)
        #: this rank's node group (global ranks, lowest first) and how many groups the job has
        self.group = next(g for g in groups if self.rank in g)
        self.nodes = len(groups)
        self._group_index = groups.index(self.group)
        self.writer = tier.storage_writer or ("keeper" if self.nodes == 1 else "trainer")
        if self.writer == "keeper" and self.nodes > 1:
            raise ConfigError(
                f"MemoryTier(storage_writer='keeper') needs every rank on one node "
                f"(a keeper holds its node's shards only); found the ranks on "
                f"{self.nodes} nodes {groups}: leave storage_writer None or set "
                "'trainer'"
            )
        error = stalled = None
        if self.rank == self.group[0]:  # the group's keeper, and its record of ranks
            try:
                self.link = KeeperLink.open(directory, tier, config)
                ckpt = os.path.join(self.memdir, place.CKPT)
                nodes.adopt(self.memdir, ckpt, nodes.NodeRanks(comm.world_size, tuple(self.group)))
                # Every node lists its memory at a restore, an empty one too (a rank whose
                # listing raised would leave the others' agreement).
                os.makedirs(ckpt, 0o700, exist_ok=True)
            except KeeperUnresponsiveError as exc:  # alive but stopped or hung: storage only
                stalled = str(exc)
            except Exception as exc:  # noqa: BLE001 - every rank learns of it, then it is raised
                error = exc
        answers = self._exchange(
            "memory-keeper",
            {
                "error": None if error is None else f"{type(error).__name__}: {error}",
                "stalled": stalled,
            },
            timeout,
        )
        if error is not None:
            self.detach()
            raise error
        failed = {r: a["error"] for r, a in answers.items() if a["error"]}
        if failed:
            self.detach()
            raise KeeperError(
                f"rank {self.rank}: the memory tier did not open on rank(s) "
                f"{sorted(failed)}: "
                + "; ".join(f"rank {r}: {e}" for r, e in sorted(failed.items()))
            )
        stalled_on = {r: a["stalled"] for r, a in answers.items() if a.get("stalled")}
        if stalled_on:
            self.detach()
            self.unavailable = (
                "the memory tier is not used: "
                + "; ".join(f"rank {r}: {e}" for r, e in sorted(stalled_on.items()))
                + "; every save goes to storage and restores read storage"
            )
            log.warning(
                "datastates: %s (a stopped or hung keeper: continue it, or end it and "
                "restart, to use the memory tier again)",
                self.unavailable,
            )
            return None
        self.store = RecyclingStore(os.path.join(self.memdir, SPARE))
        if self.rank == 0 and self.writer == "keeper":
            self.handoff = Handoff(
                self.link, self.memdir, directory, config, tier.keep_last, self.store
            )
        return self._open_memory(storage)

    def _open_memory(self, storage: TierCheckpointer) -> TierCheckpointer:
        """The memory tier's TierCheckpointer, sharing ``storage``'s pipeline."""
        handoff = self.handoff
        several = self.nodes > 1
        policy = TierPolicy(
            # A tier of its own: the newest keep_last plus the one being written (and those
            # being written to storage).
            retention=handoff.retention
            if handoff is not None
            else RetentionPolicy(self.tier.keep_last, None, None, None, "min"),
            # One pass over memory: read into the live state, checksums verified as it goes,
            # then agree; damage on any rank sends every rank to the next checkpoint.
            optimistic=True,
            # A checkpoint the keeper checked after its last write is copied without checksums.
            prechecked=lambda info: marks.holds(self.memdir, info),
            eligible=self._eligible,
            # Newer is the higher step, as across the tiers (then the last commit of a step).
            order=step_then_commit,
            # Several nodes (nodes.py): each group commits among its ranks and the job agrees.
            group=frozenset(self.group) if several else None,
            agree=self.comm if several else None,
            check_name=storage.check_name if self.writer == "keeper" else None,
            on_commit=handoff.submit if handoff is not None else None,
            released=handoff.released if handoff is not None else None,
            delete_guard=(lambda name: handoff.paused(name, self._deadline()))
            if handoff is not None
            else None,
        )
        comm = self.comm if not several else self.comm.subgroup(str(self._group_index), self.group)
        self.memory = TierCheckpointer(
            os.path.join(self.memdir, place.CKPT),
            share=storage,
            registry=storage.registry,
            store=self.store,
            communicator=comm,
            policy=policy,
        )
        return self.memory

    @property
    def _opened(self) -> TierCheckpointer:
        """The memory tier's TierCheckpointer, which every caller past ``unavailable`` has."""
        assert self.memory is not None, "the memory tier is not open"
        return self.memory

    def _deadline(self) -> float:
        return time.monotonic() + self.config.commit_timeout_s

    def _eligible(self, info: CheckpointInfo) -> bool:
        """Whether a restore of the latest may read the memory checkpoint ``info``."""
        return self._floor is None or order(info) >= self._floor

    def _exchange(self, topic: str, value, timeout: float) -> dict:
        """``comm.exchange``; KeeperError (the link dropped) if the ranks do not all answer:
        they did not all open the memory tier."""
        try:
            return self.comm.exchange(topic, value, timeout)
        except TimeoutError as exc:
            self.detach()
            raise KeeperError(
                f"rank {self.rank}: the ranks did not all open the memory tier: {exc}"
            ) from None

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
        self.handoff.idle(time.monotonic() + self.config.commit_timeout_s)
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
        timeout = self.config.commit_timeout_s
        error = None
        if self.handoff is not None:
            try:
                self.handoff.idle(time.monotonic() + timeout)
            except CommitTimeoutError as exc:
                error = str(exc)
        if together:
            try:
                error = self.comm.exchange("storage-quiet", {"error": error}, 2 * timeout)[0][
                    "error"
                ]
            except TimeoutError as exc:
                error = str(exc)
        if error is not None:
            raise CommitTimeoutError(f"rank {self.rank}: not reading storage: {error}", {0: "busy"})

    def newest(self, storage: CheckpointInfo | None) -> CheckpointInfo | None:
        """The newer of ``storage`` (storage's newest) and the memory's newest; memory on a tie."""
        if self.unavailable is not None:
            return storage
        memory = self._opened.latest()
        return memory if memory is not None and order(memory) >= order(storage) else storage

    @contextlib.contextmanager
    def choosing(
        self, step: int | None, tag: str | None, storage: CheckpointInfo | None
    ) -> Iterator[bool]:
        """Whether a restore or load reads memory, for the body of the ``with`` (the read): when
        memory holds the checkpoint asked for, or, for the latest, a step at least as new as
        ``storage`` (storage's newest). Rank 0 decides for every rank (through the store), and
        its storage's newest is the oldest memory checkpoint a restore of the latest may fall
        back to in the body (storage holds a newer step than any older one)."""
        if self.memory is None:  # the same on every rank (agreed at construction)
            yield False
            return
        if step is None and tag is None:
            memory = self._opened.latest()
            mine = memory is not None and order(memory) >= order(storage)
        else:
            mine = any(i.name == _name(step, tag) for i in self._opened.list())
        answers = self.comm.exchange(
            "restore-tier", [bool(mine), order(storage)], self.config.commit_timeout_s
        )
        chosen, floor = answers[0]
        self._floor = floor if chosen else None
        try:
            yield bool(chosen)
        finally:
            self._floor = None

    def after_restore(self, step: int | None) -> None:
        """Several nodes, after a restore of the latest settled on ``step`` (either tier): each
        node removes its memory checkpoints of later steps, with a WARNING. A node whose peers
        lack them cannot restore them, and the steps trained again after the restore would
        collide with them on this node only (CheckpointExistsError on its ranks alone)."""
        if self.nodes == 1 or step is None or self.unavailable is not None:
            return
        if self.rank == self.group[0]:  # memory.delete() works on the node's lowest rank
            for info in self._opened.list():
                if info.step is not None and info.step > step:
                    log.warning(
                        "datastates: the memory checkpoint %s of this node is removed: "
                        "the job restored step %d (the other nodes do not all hold %s)",
                        info.name,
                        step,
                        info.name,
                    )
                    self._opened.delete(step=info.step)
        # No rank of the node saves before they are gone (its save would find the name taken).
        timeout = self.config.commit_timeout_s
        try:
            self._opened.comm.exchange("memory-trimmed", {}, timeout)
        except TimeoutError as exc:
            raise CommitTimeoutError(
                f"rank {self.rank}: restored step {step}, but the "
                f"ranks of this node did not all return: {exc}",
                {},
            ) from None

    def close(self, stop: bool) -> None:
        """After the memory Checkpointer closed: detach from the keeper (each node group's
        lowest rank). A keeper that is gone cannot write the memory to storage any more: that
        rank does it here (one node, ``persist_on_exit``), then removes the memory directory if
        no keeper took it over."""
        if self.unavailable is not None:  # the memory is the stalled keeper's, untouched
            return
        self._opened.close()
        self.store.close()  # the shard files' mappings
        if self.handoff is not None:  # before detaching: the keeper is writing for this trainer
            try:
                self.handoff.idle(time.monotonic() + self.config.commit_timeout_s)
                self.handoff.close()
            except CommitTimeoutError as exc:
                log.error(
                    "datastates: closing: %s; detaching anyway (the keeper finishes that "
                    "write, then writes the newest memory checkpoint to storage)",
                    exc,
                )
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
                log.warning(
                    "datastates: the memory keeper of this node is gone; its memory "
                    "checkpoints (this node's ranks only) are removed, storage holds "
                    "the saves written there"
                )
            elif self.tier.persist_on_exit:
                try:
                    persist_newest(
                        os.path.join(self.memdir, place.CKPT),
                        self.directory,
                        self.config,
                        checked=lambda info: marks.holds(self.memdir, info),
                    )
                except Exception as exc:  # noqa: BLE001 - reported; storage is as it was
                    log.error(
                        "datastates: writing the newest memory checkpoint to %s failed: %r",
                        self.directory,
                        exc,
                    )
                    return  # the memory is kept: a later keeper may persist it
            remove_tree(self.memdir)

    def detach(self) -> None:
        """Stop the hand-off and close the keeper link (an opening that failed)."""
        if self.handoff is not None:
            self.handoff.close()
        if self.link is not None:
            self.link.close()


def _name(step: int | None, tag: str | None) -> str:
    from ..format import codec as fmt

    if tag is not None:
        return tag
    assert step is not None  # a named checkpoint: a step or a tag
    return fmt.step_name(step)

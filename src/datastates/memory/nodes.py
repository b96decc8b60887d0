"""The memory tier of a job on several nodes (docs/memory-tier.md, "Several nodes").

Each node's shared memory is its own: the ranks that see one memory directory (the same host and
the same ``<root>/datastates-<uid>-<digest>/``) form a **node group**, with its own keeper
(started by the group's lowest rank). The group's memory checkpoints are checkpoints of that
group's ranks only, committed among them (a communicator of their own, under a prefix of the
job's store): local rank ``i`` of the group writes shard ``i``. A restore from memory needs every
group to hold the step; the ranks agree on it through the job's store, as a restore from
storage does, and each rank reads its group's checkpoint.

A group's checkpoint is a part of the job, never the job: ``node.json`` in the memory directory
records which ranks of which world size the memory holds (:class:`NodeRanks`). Nothing writes a
part to storage (the keeper's ``persist_on_exit`` and the trainer's copy at ``close()`` refuse
it: the trainers write storage themselves, ``storage_writer="trainer"``), and a job restarted
with its ranks spread over the nodes otherwise finds the old parts useless and removes them
(:func:`adopt`), rather than restore one rank's state into another.
"""

from __future__ import annotations

import json
import logging
import os
import stat

from ..format.small_records import NodeRanks, parse_node_ranks
from ..storage.posix import remove_tree

log = logging.getLogger("datastates")

NODE_FILE = "node.json"
_MAX_BYTES = 1 << 22  # a rank list of a million ranks fits


def groups(answers: dict[int, dict]) -> list[list[int]]:
    """The node groups of the ranks' ``{"host", "memdir"}`` answers: ranks that share both, each
    group sorted, the groups ordered by their lowest rank (the same on every rank)."""
    by_place: dict[tuple[str, str], list[int]] = {}
    for rank in sorted(answers):
        a = answers[rank]
        by_place.setdefault((a["host"], a["memdir"]), []).append(rank)
    return sorted(by_place.values())


__all__ = ["NODE_FILE", "NodeRanks", "adopt", "groups", "part_only", "read"]


def read(memdir: str) -> NodeRanks | None:
    """The ranks recorded in ``memdir`` (None: no record). A record that is not a regular file
    of this shape is treated as a record of other ranks: ValueError for :func:`adopt` (the
    parser's CorruptCheckpointError, a ValueError, naming the field, for a file that is one)."""
    path = os.path.join(memdir, NODE_FILE)
    try:
        fd = os.open(
            path,
            os.O_RDONLY
            | getattr(os, "O_NOFOLLOW", 0)
            | getattr(os, "O_CLOEXEC", 0)
            | os.O_NONBLOCK,
        )
    except FileNotFoundError:
        return None
    except OSError as exc:
        raise ValueError(f"{path}: {exc}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_BYTES:
            raise ValueError(f"{path}: expected a regular file of at most {_MAX_BYTES} bytes")
        raw = os.read(fd, _MAX_BYTES + 1)
    finally:
        os.close(fd)
    return parse_node_ranks(raw, f"{path} (a record of ranks)")


def part_only(memdir: str) -> str | None:
    """Why the checkpoints of ``memdir`` are not the whole job's (some ranks only), or None when
    they are. A record that does not read counts as a part: nothing is written to storage from
    it."""
    try:
        found = read(memdir)
    except ValueError as exc:
        return f"its record of ranks does not read ({exc})"
    if found is None or found.whole:
        return None
    return f"it holds {found.describe()} only, one node's part of the job"


def adopt(memdir: str, ckpt_root: str, now: NodeRanks) -> None:
    """Before this job's ranks ``now`` use ``memdir``: remove the memory checkpoints of
    ``ckpt_root`` unless they hold the same ranks (one node: any world size, a restore reshards),
    with a WARNING; then record ``now``. Run by the group's lowest rank, before the group opens
    its memory Checkpointer."""
    try:
        before = read(memdir)
        why = (
            None
            if _compatible(before, now)
            else f"they hold {before.describe() if before else 'the ranks of a whole job'}"
        )
    except ValueError as exc:
        before, why = None, str(exc)
    if why is not None and os.path.isdir(ckpt_root) and os.listdir(ckpt_root):
        log.warning(
            "datastates: the memory checkpoints in %s are removed: %s, and this node "
            "runs %s now (a restore reads storage)",
            ckpt_root,
            why,
            now.describe(),
        )
        remove_tree(ckpt_root)
    if before != now:
        _write(memdir, now)


def _compatible(before: NodeRanks | None, now: NodeRanks) -> bool:
    if now.whole:  # one node: checkpoints of the whole job reshard to any world size
        return before is None or before.whole
    return before == now


def _write(memdir: str, now: NodeRanks) -> None:
    path = os.path.join(memdir, NODE_FILE)
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "w") as f:
            json.dump(now.to_json(), f)
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise

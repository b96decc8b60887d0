"""The memory tier at two ranks (real gloo processes, a real keeper): one rank's memory shard of
the newest step damaged → both ranks restore the same older step from memory; the older one
damaged too → both restore from storage. Every rank's shard goes into one memory directory
(docs/memory-tier.md). Then four ranks on two "nodes" (a memory root each): each node keeps its
ranks' shards, and the ranks agree on a step every node holds."""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist

import datastates
from datastates.format import codec as fmt
from datastates.memory import nodes, place
from datastates.tools.keeper import ask

from launcher import run_ranks


@pytest.fixture
def shm_root():
    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    root = tempfile.mkdtemp(prefix="ds-test-", dir=base)
    yield root
    for entry in os.listdir(root):
        try:
            ask(os.path.join(root, entry), "stop", timeout=60)
        except datastates.KeeperError:
            pass
    shutil.rmtree(root, ignore_errors=True)


def _state(rank: int, step: int) -> dict:
    return {"w": torch.full((3000,), float(100 * step + rank)), "pos": {"step": step}}


def _config(shm_root: str, log: str, writer: str = "trainer"):
    tier = datastates.MemoryTier(root=shm_root, keep_last=2, persist_every=None,
                                 persist_on_exit=False, log_path=log, storage_writer=writer)
    return datastates.CheckpointConfig(memory_tier=tier, commit_timeout_s=60)


def _save(rank, world, root, shm_root, log):
    with datastates.Checkpointer(root, _config(shm_root, log)) as ck:
        ck.save(_state(rank, 1), step=1, persist=True)
        for step in (2, 3):
            ck.save(_state(rank, step), step=step)
        ck.wait()
        return {"storage": [i.step for i in ck.list()],
                "memory": [i.step for i in ck.memory.list()]}


def _restore(rank, world, root, shm_root, log):
    with datastates.Checkpointer(root, _config(shm_root, log)) as ck:
        live = {"w": torch.zeros(3000), "pos": {"step": -1}}
        report = ck.restore(live)
        return {"step": report.step, "tier": report.tier,
                "exact": torch.equal(live["w"], _state(rank, report.step)["w"])
                and live["pos"] == {"step": report.step},
                "skipped": [s.name for s in report.skipped]}


def _damage(shm_root: str, root: str, step: int, rank: int) -> None:
    memdir = place.memory_dir(shm_root, root)
    _flip(os.path.join(memdir, place.CKPT, fmt.step_name(step), fmt.shard_file_name(rank)))


def _flip(path: str) -> None:
    """Invert one byte of a shard file's first tensor."""
    with open(path, "r+b") as f:
        f.seek(4096 + 11)
        byte = f.read(1)
        f.seek(4096 + 11)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_damaged_memory_shard_sends_both_ranks_to_the_same_older_step(shm_root, tmp_path):
    root, log = str(tmp_path / "ckpt"), str(tmp_path / "keeper.log")
    out = run_ranks(2, _save, root, shm_root, log)
    assert out[0] == out[1] == {"storage": [1], "memory": [2, 3]}
    _damage(shm_root, root, 3, rank=1)
    out = run_ranks(2, _restore, root, shm_root, log)
    for rank in (0, 1):
        assert out[rank] == {"step": 2, "tier": "memory", "exact": True,
                             "skipped": [fmt.step_name(3)]}, (rank, out[rank])
    _damage(shm_root, root, 2, rank=0)
    out = run_ranks(2, _restore, root, shm_root, log)
    for rank in (0, 1):
        assert out[rank] == {"step": 1, "tier": "storage", "exact": True, "skipped": []}, \
            (rank, out[rank])


# ---------------------------------------------------------------- several nodes
# Two node groups of two ranks each: a rank's node is given by the memory root it sees (another
# tmpfs directory per "node"), as two machines would each have their own /dev/shm.

def _node_root(shm_root: str, node: int) -> str:
    path = os.path.join(shm_root, f"node{node}")
    os.makedirs(path, exist_ok=True)
    return path


def _nodes_config(shm_root, tmp, rank, node_of, **kw):
    node = node_of(rank)
    tier = datastates.MemoryTier(root=_node_root(shm_root, node), keep_last=2, persist_every=None,
                                 log_path=os.path.join(tmp, f"keeper{node}.log"), **kw)
    return datastates.CheckpointConfig(memory_tier=tier, commit_timeout_s=60)


def _by_pairs(rank: int) -> int:
    return rank // 2


def _crossed(rank: int) -> int:
    return rank % 2


def _node_state(rank: int, step: int) -> dict:
    """A tensor of each rank's own, and one the same on every rank (saved as replicated: one
    rank of each node writes it)."""
    return {"w": torch.full((3000,), float(100 * step + rank)),
            "shared": torch.arange(64, dtype=torch.float64) + 1000 * step,
            "pos": {"step": step}}


def _nodes_save(rank, world, root, shm_root, tmp, node_of):
    with datastates.Checkpointer(root, _nodes_config(shm_root, tmp, rank, node_of)) as ck:
        ck.save(_node_state(rank, 1), step=1, persist=True)  # the trainers write storage
        for step in (2, 3):
            ck.save(_node_state(rank, step), step=step, replicated=["shared"])
        ck.wait()
        memdir = ck.tiers.memdir
        return {"storage": [i.step for i in ck.list()],
                "memory": [i.step for i in ck.memory.list()],
                "shards": sorted(os.listdir(os.path.join(memdir, place.CKPT, fmt.step_name(3)))),
                "group": ck.tiers.group, "world": ck.memory.world_size}


def _nodes_restore(rank, world, root, shm_root, tmp, node_of):
    with datastates.Checkpointer(root, _nodes_config(shm_root, tmp, rank, node_of)) as ck:
        live = {"w": torch.zeros(3000), "shared": torch.zeros(64, dtype=torch.float64),
                "pos": {"step": -1}}
        report = ck.restore(live)
        want = _node_state(rank, report.step)
        return {"step": report.step, "tier": report.tier,
                "exact": all(torch.equal(live[k], want[k]) for k in ("w", "shared"))
                and live["pos"] == want["pos"],
                "skipped": [s.name for s in report.skipped],
                "memory": [i.step for i in ck.memory.list()]}


def _shard_of(shm_root, root, node, step, local):
    memdir = place.memory_dir(_node_root(shm_root, node), root)
    return os.path.join(memdir, place.CKPT, fmt.step_name(step), fmt.shard_file_name(local))


def test_two_nodes_keep_their_own_ranks_in_memory_and_agree_on_the_step_restored(
        shm_root, tmp_path):
    """Each node's memory holds its two ranks' shards (a replicated tensor once) and
    storage gets only the trainers' own saves: the keepers never write one node's part there,
    even with ``persist_on_exit``. A restore reads the newest step every node holds intact;
    damage on one node, or a memory one node lost, moves every rank to the same older step (of
    storage, when no memory step is left on every node), and each node drops the later steps."""
    root, tmp = str(tmp_path / "ckpt"), str(tmp_path)
    out = run_ranks(4, _nodes_save, root, shm_root, tmp, _by_pairs)
    for rank in range(4):
        assert out[rank] == {"storage": [1], "memory": [2, 3],
                             "shards": [fmt.MANIFEST, fmt.shard_file_name(0),
                                        fmt.shard_file_name(1)],
                             "group": [0, 1] if rank < 2 else [2, 3], "world": 2}, out[rank]
    for node in (0, 1):
        memdir = place.memory_dir(_node_root(shm_root, node), root)
        assert nodes.read(memdir) == nodes.NodeRanks(4, (2 * node, 2 * node + 1))
        for name in os.listdir(os.path.join(memdir, place.CKPT)):
            assert not name.startswith(fmt.step_name(1)), name  # storage's save stayed there
    out = run_ranks(4, _nodes_restore, root, shm_root, tmp, _by_pairs)
    for rank in range(4):
        assert out[rank] == {"step": 3, "tier": "memory", "exact": True, "skipped": [],
                             "memory": [2, 3]}, (rank, out[rank])
    _flip(_shard_of(shm_root, root, node=1, step=3, local=1))  # rank 3's shard of step 3
    out = run_ranks(4, _nodes_restore, root, shm_root, tmp, _by_pairs)
    for rank in range(4):
        assert out[rank]["step"] == 2 and out[rank]["tier"] == "memory", (rank, out[rank])
        assert out[rank]["exact"] and out[rank]["skipped"] == [fmt.step_name(3)], out[rank]
    # Node 1 moved its damaged copy aside; node 0 removed its intact one, a step no longer
    # restorable (and trained again from step 2): neither lists it now.
    assert all(out[r]["memory"] == [2] for r in range(4)), out
    aside = {node: [n for n in os.listdir(os.path.dirname(os.path.dirname(
        _shard_of(shm_root, root, node, 2, 0)))) if n.startswith(".damaged.")] for node in (0, 1)}
    assert aside[0] == [] and len(aside[1]) == 1, aside
    # Node 1 loses its whole memory (a replaced machine): rank 0's node still holds step 2,
    # which the nodes then agree no one can restore.
    shutil.rmtree(os.path.dirname(os.path.dirname(_shard_of(shm_root, root, 1, 2, 0))))
    out = run_ranks(4, _nodes_restore, root, shm_root, tmp, _by_pairs)
    for rank in range(4):
        assert out[rank]["step"] == 1 and out[rank]["tier"] == "storage", (rank, out[rank])
        assert out[rank]["exact"] and out[rank]["memory"] == [], out[rank]
    with datastates.Checkpointer(root) as plain:
        assert [i.step for i in plain.list()] == [1]  # no keeper wrote a node's part
        assert plain.latest().world_size == 4
    for node in (0, 1):
        with open(os.path.join(tmp, f"keeper{node}.log")) as f:
            assert "one node's part of the job" in f.read()


def test_a_restart_with_the_ranks_on_other_nodes_drops_the_old_parts(shm_root, tmp_path,
                                                                     caplog):
    """Ranks 0 and 1 shared a node before the restart, ranks 0 and 2 after: the memory of each
    node holds other ranks' shards than it runs now, so it is removed (a WARNING), and the
    restore reads storage instead of restoring one rank's state into another."""
    root, tmp = str(tmp_path / "ckpt"), str(tmp_path)
    run_ranks(4, _nodes_save, root, shm_root, tmp, _by_pairs)
    out = run_ranks(4, _nodes_restore, root, shm_root, tmp, _crossed)
    for rank in range(4):
        assert out[rank] == {"step": 1, "tier": "storage", "exact": True, "skipped": [],
                             "memory": []}, (rank, out[rank])
    for node in (0, 1):
        memdir = place.memory_dir(_node_root(shm_root, node), root)
        assert nodes.read(memdir) == nodes.NodeRanks(4, (node, node + 2))


def _keeper_on_nodes(rank, world, root, shm_root, tmp):
    try:
        datastates.Checkpointer(root, _nodes_config(shm_root, tmp, rank, _by_pairs,
                                                    storage_writer="keeper"))
        outcome = "constructed"
    except datastates.ConfigError as exc:
        outcome = str(exc)
    dist.barrier()  # rank 0 hosts the store: it stays until every rank has its answer
    return outcome


def _sharded_on_nodes(rank, world, root, shm_root, tmp):
    row = torch.arange(8, dtype=torch.float64) + 10 * rank
    state = {"rows": datastates.TensorShard(row.reshape(1, 8), (4, 8), (rank, 0))}
    with datastates.Checkpointer(root, _nodes_config(shm_root, tmp, rank, _by_pairs)) as ck:
        try:
            ck.save(state, step=1).wait()
            refused = None
        except datastates.ConfigError as exc:
            refused = str(exc)
        ck.save(state, step=2, persist=True).wait()  # storage takes the whole tensor
        return {"refused": refused, "storage": [i.step for i in ck.list()],
                "memory": [i.step for i in ck.memory.list()]}


def test_a_sharded_tensor_is_refused_by_the_memory_of_several_nodes(shm_root, tmp_path):
    """A node's memory would hold some rows of the global tensor only: save() refuses it on
    every rank (ConfigError, nothing written), and the same state saved to storage commits."""
    root = str(tmp_path / "ckpt")
    out = run_ranks(4, _sharded_on_nodes, root, shm_root, str(tmp_path))
    for rank in range(4):
        assert "found 1 sharded tensor(s)" in out[rank]["refused"], out[rank]
        assert out[rank]["storage"] == [2] and out[rank]["memory"] == [], out[rank]


def test_a_keeper_writing_storage_needs_one_node(shm_root, tmp_path):
    root = str(tmp_path / "ckpt")
    out = run_ranks(4, _keeper_on_nodes, root, shm_root, str(tmp_path))
    for rank in range(4):
        assert "storage_writer='keeper') needs every rank on one node" in out[rank], out
        assert "[[0, 1], [2, 3]]" in out[rank], out
    assert not os.path.exists(root)


def _handoff(rank, world, root, shm_root, log):
    tier = datastates.MemoryTier(root=shm_root, persist_every=2, log_path=log,
                                 persist_on_exit=False)
    config = datastates.CheckpointConfig(memory_tier=tier, commit_timeout_s=60)
    with datastates.Checkpointer(root, config) as ck:
        for step in range(1, 6):
            ck.save(_state(rank, step), step=step)
            if step == 3:  # the trainer's own commit into storage, beside the keeper's
                ck.save(_state(rank, 30), tag="best")
        ck.wait()  # rank 0: until the keeper's copies are committed; rank 1: the memory's
    # Every rank opens the next Checkpointer together, after rank 0 closed the first.
    with datastates.Checkpointer(root) as plain:  # no memory tier: what storage holds
        seen = [(i.name, i.seq) for i in plain.list()]
        live = {"w": torch.zeros(3000), "pos": {"step": -1}}
        report = plain.restore(live, step=4)
        exact = torch.equal(live["w"], _state(rank, 4)["w"]) and live["pos"] == {"step": 4}
    return {"storage": seen, "restored": report.step, "exact": exact}


def test_saves_due_for_storage_are_written_by_the_keeper_for_both_ranks(shm_root, tmp_path):
    """Steps 2 and 4 go to memory, and the keeper copies both ranks' shards into storage; the
    tag saved in between is committed by rank 0 while no keeper write runs (one commit number
    each, in the order of the saves)."""
    root, log = str(tmp_path / "ckpt"), str(tmp_path / "keeper.log")
    out = run_ranks(2, _handoff, root, shm_root, log)
    expected = [(fmt.step_name(2), 1), ("best", 2), (fmt.step_name(4), 3)]
    for rank in (0, 1):
        assert out[rank] == {"storage": expected, "restored": 4, "exact": True}, out[rank]
    with open(log) as f:
        text = f.read()
    assert f"committed {fmt.step_name(2)}" in text and f"committed {fmt.step_name(4)}" in text


def _restore_one_rank_gone_after(rank, world, root, shm_root, tmp):
    """Rank 1 leaves right after the ranks agreed on the step (its node's trim never hears
    from it), as a rank that dies there would; the others restore as usual."""
    from datastates.memory.tiers import Tiers
    if rank == 1:
        Tiers.after_restore = lambda self, step: None
    config = _nodes_config(shm_root, tmp, rank, _by_pairs)
    config = datastates.CheckpointConfig(memory_tier=config.memory_tier, commit_timeout_s=15)
    with datastates.Checkpointer(root, config) as ck:
        live = {"w": torch.zeros(3000), "shared": torch.zeros(64, dtype=torch.float64),
                "pos": {"step": -1}}
        try:
            report = ck.restore(live)
        except datastates.CommitTimeoutError as exc:
            outcome = f"CommitTimeoutError: {exc}"
        else:
            outcome = report.step
        want = _node_state(rank, 3)
        return {"outcome": outcome, "exact": torch.equal(live["w"], want["w"]),
                "memory": [i.step for i in ck.memory.list()]}


def test_a_rank_that_leaves_the_trim_after_a_restore_is_a_commit_timeout_on_its_node(
        shm_root, tmp_path):
    """The trim of later memory steps after a restore waits for every rank of the node: a rank
    that never comes back is a CommitTimeoutError on the others of its node (the live state
    is already restored), and no wait at all on the other node."""
    root, tmp = str(tmp_path / "ckpt"), str(tmp_path)
    run_ranks(4, _nodes_save, root, shm_root, tmp, _by_pairs)
    out = run_ranks(4, _restore_one_rank_gone_after, root, shm_root, tmp)
    assert out[0]["outcome"].startswith("CommitTimeoutError: rank 0: restored step 3, but the "
                                        "ranks of this node did not all return"), out[0]
    for rank in (1, 2, 3):
        assert out[rank]["outcome"] == 3, (rank, out[rank])
    assert all(out[r]["exact"] and out[r]["memory"] == [2, 3] for r in range(4)), out

"""The memory tier at two ranks (real gloo processes, a real keeper): one rank's memory shard of
the newest step damaged → both ranks restore the same older step from memory; the older one
damaged too → both restore from storage. Every rank's shard goes into one memory directory
(docs/memory-tier.md)."""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest
import torch
import torch.distributed as dist

import datastates
from datastates.format import codec as fmt
from datastates.memory import place
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
    path = os.path.join(memdir, place.CKPT, fmt.step_name(step), fmt.shard_file_name(rank))
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


def _other_host(rank, world, root, shm_root, log):
    import socket
    if rank == 1:  # this rank reports another host name: its memory would be another machine's
        socket.gethostname = lambda: "another-node"
    try:
        datastates.Checkpointer(root, _config(shm_root, log))
        outcome = "constructed"
    except datastates.ConfigError as exc:
        outcome = str(exc)
    dist.barrier()  # rank 0 hosts the store: it stays until every rank has its answer
    return outcome


def test_ranks_on_several_hosts_are_refused(shm_root, tmp_path):
    root, log = str(tmp_path / "ckpt"), str(tmp_path / "keeper.log")
    out = run_ranks(2, _other_host, root, shm_root, log)
    for rank in (0, 1):
        assert "every rank on one node" in out[rank] and "another-node" in out[rank], out
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

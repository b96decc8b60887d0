"""Multi-rank checkpointing on real processes (gloo): replication, sharding, resharding, failures."""
from __future__ import annotations

import os
import signal

import pytest
import torch
from torch import nn

import datastates
from datastates import CheckpointConfig, Checkpointer

from launcher import run_ranks

SMALL = CheckpointConfig(host_cache_bytes=256 << 10, chunk_bytes=64 << 10, commit_timeout_s=60)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.ReLU(), nn.Linear(128, 32))


def _step(model, opt, seed):
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(8, 64, generator=g)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def _snapshot(model, opt):
    return {"model": {k: v.clone() for k, v in model.state_dict().items()},
            "opt": {i: {k: v.clone() for k, v in s.items()} for i, s in opt.state_dict()["state"].items()}}


def _equal(a, b):
    return all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"]) and all(
        torch.equal(a["opt"][i][k], b["opt"][i][k]) for i in a["opt"] for k in a["opt"][i])


# ------------------------------------------------------------------ data parallel, replicated

def _dp_worker(rank, world, root):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _step(model, opt, seed=1)  # same data on every rank: replicas stay identical
    torch.manual_seed(100 + rank)  # per-rank RNG differs
    per_rank = torch.full((4,), float(rank))
    state = {"model": model, "opt": opt, "rng": datastates.RNGState(), "mine": per_rank}
    with Checkpointer(root, SMALL) as ckpt:
        reference = _snapshot(model, opt)
        rng_ref = torch.get_rng_state()
        handle = ckpt.save(state, step=1, replicated=["model", "opt"])
        _step(model, opt, seed=2)  # the step right after save must not leak into the snapshot
        _step(model, opt, seed=3)
        info = handle.wait()
        torch.manual_seed(7)
        per_rank.zero_()
        ckpt.restore(state)
        restored = _snapshot(model, opt)
    return {"same": _equal(reference, restored), "rng": torch.equal(torch.get_rng_state(), rng_ref),
            "mine": per_rank.tolist(), "bytes": info.nbytes, "world": info.world_size}


@pytest.mark.parametrize("world", [2, 4])
def test_data_parallel_round_trip_and_dedup(tmp_path, world):
    out = run_ranks(world, _dp_worker, str(tmp_path))
    one_copy = sum(p.numel() for p in _model().parameters()) * 4 * 3  # params + 2 AdamW moments
    for rank, r in out.items():
        assert r["same"] and r["rng"], rank
        assert r["mine"] == [float(rank)] * 4  # per-rank state comes back to its own rank
        assert r["world"] == world
    # replicated state is stored once, not `world` times
    assert one_copy <= out[0]["bytes"] < 1.25 * one_copy + world * 64 * 1024
    manifest = datastates.format.read_manifest(str(tmp_path / "step-0000000001"))
    writers = {s.file for e in manifest.entries if getattr(e, "replicated", False)
               for s in e.shards}
    assert len(writers) == world  # the replicated writing is spread over every rank
    mine = [e for e in manifest.entries if e.key == "mine"]
    assert sorted(e.rank for e in mine) == list(range(world))  # same key, kept per rank


# ------------------------------------------------------------------ DTensor sharding + resharding

ROWS, COLS = 10, 6


def _full(name):
    g = torch.Generator().manual_seed(hash(name) % 1000)
    return torch.randn(ROWS, COLS, generator=g)


def _dtensor_state(world):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor
    mesh = init_device_mesh("cpu", (world,))
    row = nn.Parameter(distribute_tensor(_full("row"), mesh, [Shard(0)]))
    col = nn.Parameter(distribute_tensor(_full("col"), mesh, [Shard(1)]))
    return {"row": row, "col": col}


def _dtensor_save(rank, world, root):
    params = _dtensor_state(world)
    opt = torch.optim.SGD(params.values(), lr=0.1, momentum=0.9)
    for p in params.values():
        p.grad = torch.ones_like(p)
    opt.step()
    full = {k: v.full_tensor().clone() for k, v in params.items()}
    momentum = {k: opt.state[v]["momentum_buffer"].full_tensor().clone() for k, v in params.items()}
    with Checkpointer(root, SMALL) as ckpt:
        handle = ckpt.save({"params": params, "opt": opt}, step=1)
        opt.step()  # waits for the capture, then mutates
        handle.wait()
        for p in params.values():
            with torch.no_grad():
                p.zero_()
        ckpt.restore({"params": params, "opt": opt})
        back = {k: v.full_tensor() for k, v in params.items()}
        mom_back = {k: opt.state[v]["momentum_buffer"].full_tensor() for k, v in params.items()}
    return {"params": all(torch.equal(full[k], back[k]) for k in full),
            "momentum": all(torch.equal(momentum[k], mom_back[k]) for k in momentum),
            "full": full}


def _dtensor_load(rank, world, root, expected):
    params = _dtensor_state(world)
    for p in params.values():
        with torch.no_grad():
            p.zero_()
    with Checkpointer(root, SMALL) as ckpt:
        ckpt.restore({"params": params}, keys=["params"])
    return all(torch.equal(params[k].full_tensor(), expected[k]) for k in expected)


def test_dtensor_round_trip_and_resharding(tmp_path):
    root = str(tmp_path)
    saved = run_ranks(4, _dtensor_save, root)
    assert all(r["params"] and r["momentum"] for r in saved.values())
    expected = saved[0]["full"]
    assert run_ranks(2, _dtensor_load, root, expected) == {0: True, 1: True}
    assert run_ranks(3, _dtensor_load, root, expected) == {0: True, 1: True, 2: True}
    # one process, no process group: the full tensors, for inspection or export
    with Checkpointer(root) as ckpt:
        full = ckpt.load(keys=["params"])["params"]
    assert all(torch.equal(full[k], expected[k]) for k in expected)


def test_uneven_resharding_2_to_3(tmp_path):
    root = str(tmp_path)
    saved = run_ranks(2, _dtensor_save, root)
    assert run_ranks(3, _dtensor_load, root, saved[0]["full"]) == {0: True, 1: True, 2: True}


def _per_rank_other_world(rank, world, root):
    with Checkpointer(root, SMALL) as ckpt:
        try:
            ckpt.load()
        except datastates.ReshardError as exc:
            err = str(exc)
        else:
            err = None
        same = ckpt.load(rank_policy="rank0")["mine"].tolist()
    return err, same


def test_per_rank_state_at_other_world_size_needs_a_policy(tmp_path):
    run_ranks(2, _dp_worker, str(tmp_path))
    out = run_ranks(3, _per_rank_other_world, str(tmp_path))
    for err, mine in out.values():
        assert err is not None and "mine" in err and "rank_policy" in err
        assert mine == [0.0] * 4


# ------------------------------------------------------------------ failures

def _failing_worker(rank, world, root, mode):
    from datastates import storage
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    config = SMALL.replace(commit_timeout_s=8)
    with Checkpointer(root, config) as ckpt:
        ckpt.save({"model": model, "opt": opt}, step=1, replicated=True).wait()
        good = {k: v.clone() for k, v in model.state_dict().items()}
        if rank == 1:
            real = storage.pwrite_all

            def broken(fd, data, offset):
                if mode == "kill":
                    os.kill(os.getpid(), signal.SIGKILL)
                raise OSError(28, "No space left on device (injected)")
            storage.pwrite_all = broken
        _step(model, opt, seed=5)
        handle = ckpt.save({"model": model, "opt": opt}, step=2, replicated=True)
        _step(model, opt, seed=6)  # training goes on; the guard never raises
        try:
            handle.wait()
            error = None
        except datastates.CommitError as exc:
            error = (type(exc).__name__, str(exc), sorted(exc.causes))
        if rank == 1:
            storage.pwrite_all = real
        names = [i.name for i in ckpt.list()]
        back = ckpt.load(step=1)["model"]
    return {"error": error, "names": names,
            "previous_intact": all(torch.equal(good[k], back[k]) for k in good)}


def test_one_rank_write_failure_fails_everywhere(tmp_path):
    out = run_ranks(2, _failing_worker, str(tmp_path), "error")
    for rank, r in out.items():
        assert r["error"] is not None, rank
        kind, message, causes = r["error"]
        assert kind == "CommitError" and causes == [1] and "No space left" in message
        assert r["names"] == ["step-0000000001"] and r["previous_intact"]
    assert out[0]["error"] == out[1]["error"]  # the same error on every rank
    assert not [p for p in os.listdir(tmp_path) if p.startswith(".tmp")]


def test_killed_rank_times_out_survivors(tmp_path):
    out = run_ranks(2, _failing_worker, str(tmp_path), "kill", allow_dead=(1,))
    kind, message, causes = out[0]["error"]
    assert kind == "CommitTimeoutError" and causes == [1] and "r1" in message
    assert out[0]["names"] == ["step-0000000001"] and out[0]["previous_intact"]

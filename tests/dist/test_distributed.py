"""Multi-rank checkpointing on real processes (gloo): replication, sharding, resharding.

Failures of the commit protocol are in test_commit_protocol.py."""
from __future__ import annotations

import os

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
    state = {"model": model, "opt": opt, "rng": datastates.RNGState(), "mine": per_rank,
             "loader": {"pos": 10 * rank, "epoch": 3}}  # Python values: per-rank and global
    with Checkpointer(root, SMALL) as ckpt:
        reference = _snapshot(model, opt)
        rng_ref = torch.get_rng_state()
        handle = ckpt.save(state, step=1, replicated=["model", "opt"])
        _step(model, opt, seed=2)  # the step right after save must not leak into the snapshot
        _step(model, opt, seed=3)
        info = handle.wait()
        torch.manual_seed(7)
        per_rank.zero_()
        state["loader"]["pos"] = -1
        ckpt.restore(state)
        restored = _snapshot(model, opt)
    return {"same": _equal(reference, restored), "rng": torch.equal(torch.get_rng_state(), rng_ref),
            "mine": per_rank.tolist(), "bytes": info.nbytes, "world": info.world_size,
            "pos": state["loader"]["pos"], "saved_model": reference["model"]}


def _check_data_parallel(out, world, root):
    one_copy = sum(p.numel() for p in _model().parameters()) * 4 * 3  # params + 2 AdamW moments
    for rank, r in out.items():
        assert r["same"] and r["rng"], rank
        assert r["mine"] == [float(rank)] * 4  # per-rank state comes back to its own rank
        assert r["pos"] == 10 * rank
        assert r["world"] == world
    # replicated state is stored once, not `world` times
    assert one_copy <= out[0]["bytes"] < 1.25 * one_copy + world * 64 * 1024
    manifest = datastates.format.read_manifest(os.path.join(root, "step-0000000001"))
    writers = {s.file for e in manifest.entries.values() if getattr(e, "replicated", False)
               for s in e.shards}
    assert len(writers) == world  # the replicated writing is spread over every rank
    mine = [e for e in manifest.entries.values() if e.key == "mine"]
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


def _dtensor_load(rank, world, cases):
    """Restore each (root, expected full tensors) case into freshly sharded DTensors."""
    out = []
    for root, expected in cases:
        params = _dtensor_state(world)
        for p in params.values():
            with torch.no_grad():
                p.zero_()
        with Checkpointer(root, SMALL) as ckpt:
            ckpt.restore({"params": params}, keys=["params"])
        out.append(all(torch.equal(params[k].full_tensor(), expected[k]) for k in expected))
    return out


def test_dtensor_round_trip_and_resharding(tmp_path):
    """Saved by 4 ranks (and by 2), restored by 2 and by 3 ranks (uneven), and by one process."""
    four, two = str(tmp_path / "four"), str(tmp_path / "two")
    saved = run_ranks(4, _dtensor_save, four)
    assert all(r["params"] and r["momentum"] for r in saved.values())
    expected = saved[0]["full"]
    saved_two = run_ranks(2, _dtensor_save, two)
    assert all(r["params"] and r["momentum"] for r in saved_two.values())
    assert run_ranks(2, _dtensor_load, [(four, expected)]) == {0: [True], 1: [True]}
    cases = [(four, expected), (two, saved_two[0]["full"])]  # 4 -> 3 and 2 -> 3 (uneven)
    assert run_ranks(3, _dtensor_load, cases) == {r: [True, True] for r in range(3)}
    # one process, no process group: the full tensors, for inspection or export
    with Checkpointer(four) as ckpt:
        full = ckpt.load(keys=["params"])["params"]
    assert all(torch.equal(full[k], expected[k]) for k in expected)


def _per_rank_other_world(rank, world, root, saved_model):
    out = {}
    with Checkpointer(root, SMALL) as ckpt:
        for policy in ("strict", "bogus"):
            try:
                ckpt.load(rank_policy=policy)
            except (datastates.ReshardError, datastates.ConfigError) as exc:
                out[policy] = (type(exc).__name__, str(exc))
        model = _model()
        with torch.no_grad():
            for p in model.parameters():
                p.zero_()
        ckpt.restore({"model": model}, keys=["model"])  # global state only: no policy needed
        out["model"] = all(torch.equal(v, saved_model[k]) for k, v in model.state_dict().items())
        out["global_values"] = ckpt.load(keys=["loader/epoch"])["loader"]["epoch"]
        out["rank0"] = ckpt.load(rank_policy="rank0")["loader"]["pos"]
        out["same"] = ckpt.load(rank_policy="same", keys=["loader"])["loader"]["pos"]
    return out


def test_data_parallel_round_trip_then_per_rank_state_4_to_2(tmp_path):
    """4 data-parallel ranks save replicas once and restore bit-exact; then per-rank Python
    values, tensors and RNG saved by 4 ranks meet 2 ranks: ReshardError unless a policy says."""
    saved = run_ranks(4, _dp_worker, str(tmp_path))
    _check_data_parallel(saved, 4, str(tmp_path))
    out = run_ranks(2, _per_rank_other_world, str(tmp_path), saved[0]["saved_model"])
    for rank, r in out.items():
        kind, message = r["strict"]
        assert kind == "ReshardError" and "rank_policy" in message
        for key in ("loader/pos", "mine", "rng/torch"):
            assert key in message, (key, message)
        assert "loader/epoch" not in message and "model" not in message  # same on every rank
        assert r["bogus"][0] == "ConfigError" and "'bogus'" in r["bogus"][1]
        assert r["model"] and r["global_values"] == 3
        assert r["rank0"] == 0 and r["same"] == 10 * rank



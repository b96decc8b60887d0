"""Fallback resume agreed by every rank (real gloo processes): one rank's shard of the newest
checkpoint damaged → every rank restores the same older step bit-exactly; a mismatch on one rank
→ every rank raises before anything is modified."""
from __future__ import annotations

import glob
import os

import pytest
import torch
import torch.distributed as dist

import datastates
from datastates import CheckpointConfig, Checkpointer
from datastates.format import codec as fmt

from launcher import run_ranks

CONFIG = CheckpointConfig(commit_timeout_s=60)


def _state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    shared = torch.randn(2000, generator=g)  # identical on every rank: saved once
    mine = torch.full((500,), float(100 * step + rank))
    return {"model": {"w": shared}, "mine": mine, "pos": {"step": step, "rank": rank}}


def _blank(rank: int) -> dict:
    return {"model": {"w": torch.zeros(2000)}, "mine": torch.zeros(500),
            "pos": {"step": -1, "rank": -1}}


def _same(a: dict, b: dict) -> bool:
    return (torch.equal(a["model"]["w"], b["model"]["w"]) and torch.equal(a["mine"], b["mine"])
            and a["pos"] == b["pos"])


def _damage_one_rank(rank, world, root, victim, mismatch_rank):
    with Checkpointer(root, CONFIG) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(_state(rank, step), step=step, replicated=["model"]).wait()
        dist.barrier()
        if rank == 0 and victim is not None:  # one rank's own shard of the newest checkpoint
            path = os.path.join(root, fmt.step_name(3), fmt.shard_file_name(victim))
            with open(path, "r+b") as f:
                f.seek(4096 + 11)
                byte = f.read(1)
                f.seek(4096 + 11)
                f.write(bytes([byte[0] ^ 0xFF]))
        dist.barrier()
        live = _blank(rank)
        if rank == mismatch_rank:
            live["mine"] = torch.zeros(3)
        try:
            report = ckpt.restore(live, fallback=True)
        except (datastates.StateMismatchError, datastates.RestoreAbortedError) as exc:
            return {"error": type(exc).__name__, "untouched": _same(live, _blank(rank)) or
                    rank == mismatch_rank and live["pos"]["step"] == -1}
        return {"step": report.step, "exact": _same(live, _state(rank, report.step)),
                "skipped": [(s.name, s.quarantined is not None) for s in report.skipped],
                "reason": [s.reason for s in report.skipped],
                "listed": [i.step for i in ckpt.list()]}


@pytest.mark.parametrize("world,victim", [(2, 1), (4, 3)])
def test_one_rank_damaged_every_rank_restores_the_same_older_step(tmp_path, world, victim):
    root = str(tmp_path / "ckpts")
    out = run_ranks(world, _damage_one_rank, root, victim, None)
    for rank in range(world):
        assert out[rank]["step"] == 2 and out[rank]["exact"], (rank, out[rank])
        # every rank reports the same skip; only rank 0 moved it
        assert [name for name, _ in out[rank]["skipped"]] == [fmt.step_name(3)]
        assert out[rank]["skipped"][0][1] == (rank == 0)
        assert out[rank]["reason"][0].startswith(f"rank {victim}:")
        assert out[rank]["listed"] == [1, 2]
    assert len(glob.glob(os.path.join(root, f".damaged.{fmt.step_name(3)}.*"))) == 1


def test_a_mismatch_on_one_rank_stops_every_rank_before_anything_changes(tmp_path):
    root = str(tmp_path / "ckpts")
    out = run_ranks(2, _damage_one_rank, root, None, 1)
    assert out[1] == {"error": "StateMismatchError", "untouched": True}
    assert out[0] == {"error": "RestoreAbortedError", "untouched": True}
    assert not glob.glob(os.path.join(root, ".damaged.*"))


def test_a_rank_opens_only_the_files_its_restore_reads(tmp_path):
    """Per-rank work independent of the world size: at the same world size a rank opens its own
    shard file, plus the file of the rank that wrote a replicated tensor it restores; the other
    ranks' files are never opened (here they are even deleted)."""
    from datastates.restore.reader import Reader
    root = str(tmp_path / "ckpts")
    run_ranks(4, _damage_one_rank, root, None, None)
    path = os.path.join(root, fmt.step_name(3))
    registry = datastates.ProviderRegistry.default()
    for rank in range(4):
        with Reader(path, registry=registry, rank=rank, world_size=4) as reader:
            reader.plan_restore(_blank(rank), keys=["mine", "pos"])
            assert sorted(reader.files._opened) == [rank]
            owner, = {s.file for e in reader.entries if e.key == "model/w" for s in e.shards}
    for rank in range(4):
        if rank != 1 and rank != owner:
            os.remove(os.path.join(path, fmt.shard_file_name(rank)))
    with Reader(path, registry=registry, rank=1, world_size=4) as reader:
        live = _blank(1)
        reader.restore_into(live)
        assert _same(live, _state(1, 3)) and sorted(reader.files._opened) == sorted({1, owner})


def _ddp_like(rank, world, root):
    """A replicated model and optimizer, a per-rank RNG state and value: what DDP saves."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(12)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    torch.manual_seed(rank)
    state = {"model": model, "opt": opt, "rng": datastates.RNGState(), "rank": rank}
    with Checkpointer(root, CONFIG) as ckpt:
        ckpt.save(state, step=1, replicated=["model", "opt"]).wait()
        live = {"model": torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(12)]),
                "rank": -1, "rng": datastates.RNGState()}
        live["opt"] = torch.optim.AdamW(live["model"].parameters())
        ckpt.restore(live)
        same = all(torch.equal(a, b) for a, b in zip(live["model"].state_dict().values(),
                                                    model.state_dict().values()))
    return {"same": same and live["rank"] == rank,
            "manifest": os.path.getsize(os.path.join(root, fmt.step_name(1), fmt.MANIFEST))}


def test_the_manifest_grows_with_what_differs_between_ranks_not_with_ranks(tmp_path):
    """Every rank's subtrees equal to rank 0's (the replicated model and optimizer) are written
    once: at 4 ranks the manifest is far from 4 trees' worth, and every rank restores its own."""
    one = run_ranks(1, _ddp_like, str(tmp_path / "one"))[0]
    four = run_ranks(4, _ddp_like, str(tmp_path / "four"))
    assert all(r["same"] for r in four.values()) and one["same"]
    # one rank's tree is most of a one-rank manifest; three more ranks add their RNG and value
    assert four[0]["manifest"] < 1.5 * one["manifest"], (one, four[0])

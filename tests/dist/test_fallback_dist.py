"""Fallback resume agreed by every rank (real gloo processes): one rank's shard of the newest
checkpoint damaged → every rank restores the same older step bit-exactly; a mismatch on one rank
→ every rank raises before anything is modified.

One launch per world size (2 and 4 ranks, ``launched``) runs every check of this file at that
size, each in a directory of its own: the mismatch on the intact checkpoints first, then the
damage and the fallback; at 4 ranks also the DDP-like save of the manifest check. The 4-rank
checkpoints also serve the check of the files a rank opens."""
from __future__ import annotations

import glob
import os
import shutil

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


def _mismatch_then_damage(rank, world, root, victim, mismatch_rank):
    """Save steps 1-3; restore with a mismatch on ``mismatch_rank``; then damage ``victim``'s
    shard of step 3 and restore with fallback. Returns {"mismatch": ..., "fallback": ...}."""
    with Checkpointer(root, CONFIG) as ckpt:
        for step in (1, 2, 3):
            ckpt.save(_state(rank, step), step=step, replicated=["model"]).wait()
        dist.barrier()
        mismatch = _restore_mismatched(ckpt, rank, mismatch_rank)
        dist.barrier()  # every rank is done with the mismatch: what it left is all there is
        mismatch["listed"] = [i.step for i in ckpt.list()]
        mismatch["damaged"] = glob.glob(os.path.join(root, ".damaged.*"))
        dist.barrier()
        if rank == 0:  # one rank's own shard of the newest checkpoint
            path = os.path.join(root, fmt.step_name(3), fmt.shard_file_name(victim))
            with open(path, "r+b") as f:
                f.seek(4096 + 11)
                byte = f.read(1)
                f.seek(4096 + 11)
                f.write(bytes([byte[0] ^ 0xFF]))
        dist.barrier()
        live = _blank(rank)
        report = ckpt.restore(live, fallback=True)
        fallback = {"step": report.step, "exact": _same(live, _state(rank, report.step)),
                    "skipped": [(s.name, s.quarantined is not None) for s in report.skipped],
                    "reason": [s.reason for s in report.skipped],
                    "listed": [i.step for i in ckpt.list()]}
    return {"mismatch": mismatch, "fallback": fallback}


def _restore_mismatched(ckpt, rank, mismatch_rank) -> dict:
    live = _blank(rank)
    if rank == mismatch_rank:
        live["mine"] = torch.zeros(3)
    try:
        ckpt.restore(live, fallback=True)
    except (datastates.StateMismatchError, datastates.RestoreAbortedError) as exc:
        return {"error": type(exc).__name__, "untouched": _same(live, _blank(rank)) or
                rank == mismatch_rank and live["pos"]["step"] == -1}
    return {"error": None, "untouched": _same(live, _blank(rank))}


#: The launches: world size -> (the victim of the damage, the rank with the mismatch, whether
#: the launch also runs the DDP-like save).
LAUNCHES = {2: (1, 1, False), 4: (3, 2, True)}


def _launch(rank, world, base, victim, mismatch_rank, ddp):
    out = _mismatch_then_damage(rank, world, os.path.join(base, "ckpts"), victim, mismatch_rank)
    if ddp:
        out["ddp"] = _ddp_like(rank, world, os.path.join(base, "ddp"), os.path.join(base, "one"))
    return out


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    """``launched(world)``: (the damaged checkpoints' root, {rank: result}) of the one launch at
    that world size."""
    done = {}

    def get(world):
        if world not in done:
            base = str(tmp_path_factory.mktemp(f"w{world}"))
            done[world] = (os.path.join(base, "ckpts"),
                           run_ranks(world, _launch, base, *LAUNCHES[world]))
        return done[world]
    return get


@pytest.mark.parametrize("world", sorted(LAUNCHES))
def test_one_rank_damaged_every_rank_restores_the_same_older_step(launched, world):
    root, results = launched(world)
    victim = LAUNCHES[world][0]
    out = {rank: r["fallback"] for rank, r in results.items()}
    for rank in range(world):
        assert out[rank]["step"] == 2 and out[rank]["exact"], (rank, out[rank])
        # every rank reports the same skip; only rank 0 moved it
        assert [name for name, _ in out[rank]["skipped"]] == [fmt.step_name(3)]
        assert out[rank]["skipped"][0][1] == (rank == 0)
        assert out[rank]["reason"][0].startswith(f"rank {victim}:")
        assert out[rank]["listed"] == [1, 2]
    assert len(glob.glob(os.path.join(root, f".damaged.{fmt.step_name(3)}.*"))) == 1


@pytest.mark.parametrize("world", sorted(LAUNCHES))
def test_a_mismatch_on_one_rank_stops_every_rank_before_anything_changes(launched, world):
    _, results = launched(world)
    bad = LAUNCHES[world][1]
    out = {rank: r["mismatch"] for rank, r in results.items()}
    for rank in range(world):
        error = "StateMismatchError" if rank == bad else "RestoreAbortedError"
        assert out[rank] == {"error": error, "untouched": True, "listed": [1, 2, 3],
                             "damaged": []}, (rank, out[rank])


def test_a_rank_opens_only_the_files_its_restore_reads(launched, tmp_path):
    """Per-rank work independent of the world size: at the same world size a rank opens its own
    shard file, plus the file of the rank that wrote a replicated tensor it restores; the other
    ranks' files are never opened (here they are even deleted, in a copy of step 2 of the
    4-rank launch: intact, newest of its directory after the fallback)."""
    from datastates.restore.reader import Reader
    root, _ = launched(4)
    path = str(tmp_path / fmt.step_name(2))
    shutil.copytree(os.path.join(root, fmt.step_name(2)), path)
    registry = datastates.ProviderRegistry.default()
    for rank in range(4):
        with Reader(path, registry=registry, rank=rank, world_size=4) as reader:
            reader.plan_restore(_blank(rank), keys=["mine", "pos"])
            assert sorted(reader.files._opened) == [rank]
            owner, = {s.file for e in reader.entries.values() if e.key == "model/w" for s in e.shards}
    for rank in range(4):
        if rank != 1 and rank != owner:
            os.remove(os.path.join(path, fmt.shard_file_name(rank)))
    with Reader(path, registry=registry, rank=1, world_size=4) as reader:
        live = _blank(1)
        reader.restore_into(live)
        assert _same(live, _state(1, 2)) and sorted(reader.files._opened) == sorted({1, owner})


def _ddp_like(rank, world, root, alone):
    """A replicated model and optimizer, a per-rank RNG state and value: what DDP saves. Rank 0
    also saves and restores its state in ``alone`` as a job of one rank (a Checkpointer of its
    own, on a LocalCommunicator), for the size of a one-rank manifest without another launch."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(12)])
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(2, 8)).sum().backward()
    opt.step()
    torch.manual_seed(rank)
    state = {"model": model, "opt": opt, "rng": datastates.RNGState(), "rank": rank}
    out = _save_and_restore(state, root, rank, Checkpointer(root, CONFIG))
    if rank == 0:
        one = Checkpointer(alone, CONFIG, communicator=datastates.LocalCommunicator())
        out["alone"] = _save_and_restore(state, alone, rank, one)
    return out


def _save_and_restore(state, root, rank, ckpt) -> dict:
    with ckpt:
        ckpt.save(state, step=1, replicated=["model", "opt"]).wait()
        live = {"model": torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(12)]),
                "rank": -1, "rng": datastates.RNGState()}
        live["opt"] = torch.optim.AdamW(live["model"].parameters())
        ckpt.restore(live)
        same = all(torch.equal(a, b) for a, b in zip(live["model"].state_dict().values(),
                                                    state["model"].state_dict().values()))
    return {"same": same and live["rank"] == rank,
            "manifest": os.path.getsize(os.path.join(root, fmt.step_name(1), fmt.MANIFEST))}


def test_the_manifest_grows_with_what_differs_between_ranks_not_with_ranks(launched):
    """Every rank's subtrees equal to rank 0's (the replicated model and optimizer) are written
    once: at 4 ranks the manifest is far from 4 trees' worth, and every rank restores its own."""
    four = {rank: dict(r["ddp"]) for rank, r in launched(4)[1].items()}
    one = four[0].pop("alone")
    assert all(r["same"] for r in four.values()) and one["same"]
    # one rank's tree is most of a one-rank manifest; three more ranks add their RNG and value
    assert four[0]["manifest"] < 1.5 * one["manifest"], (one, four[0])


def _refused_then_agreed(rank, world, root):
    """Rank 1's fallback restore is refused before the rounds (a bad argument), twice; after
    each, every rank's next fallback restore meets the others' and restores."""
    out = {}
    with Checkpointer(root, CheckpointConfig(commit_timeout_s=60)) as ckpt:
        ckpt.save(_state(rank, 1), step=1, replicated=["model"]).wait()
        for case, bad in (("policy", {"rank_policy": "bogus"}), ("step", {"step": 1})):
            live = _blank(rank)
            try:
                ckpt.restore(live, fallback=True, **(bad if rank == 1 else {}))
                out[case] = ("restored",)
            except datastates.DatastatesError as exc:
                out[case] = (type(exc).__name__, str(exc))
            out[case + "_unchanged"] = _same(live, _blank(rank))
            dist.barrier()
            live = _blank(rank)
            out[case + "_next"] = (ckpt.restore(live, fallback=True).step,
                                   _same(live, _state(rank, 1)))
            dist.barrier()
    return out


def test_a_rank_refused_before_the_rounds_fails_every_rank_and_the_next_restore_agrees(
        tmp_path):
    out = run_ranks(2, _refused_then_agreed, str(tmp_path / "ck"), timeout=240)
    for case in ("policy", "step"):
        assert out[1][case][0] == "ConfigError", out[1][case]
        assert out[0][case][0] == "RestoreAbortedError", out[0][case]
        assert "rank(s) [1] refused" in out[0][case][1] and "ConfigError" in out[0][case][1]
        assert out[0][case + "_unchanged"] and out[1][case + "_unchanged"]
        assert out[0][case + "_next"] == out[1][case + "_next"] == (1, True)


def _skipped_then_agreed(rank, world, root):
    """Rank 1 skips one fallback restore the others make (they give up on it); then every
    rank's fallback restores meet again."""
    out = {"logs": []}
    import logging

    class Keep(logging.Handler):
        def emit(self, record):
            out["logs"].append(record.getMessage())
    logging.getLogger("datastates").addHandler(Keep(logging.WARNING))
    with Checkpointer(root, CheckpointConfig(commit_timeout_s=5)) as ckpt:
        ckpt.save(_state(rank, 1), step=1, replicated=["model"]).wait()
        if rank != 1:
            try:
                ckpt.restore(_blank(rank), fallback=True)
                out["alone"] = "restored"
            except datastates.RestoreAbortedError as exc:
                out["alone"] = str(exc)
        dist.barrier()
        for n in range(2):
            live = _blank(rank)
            out[f"next{n}"] = (ckpt.restore(live, fallback=True).step,
                               _same(live, _state(rank, 1)))
            dist.barrier()
    return out


def test_a_rank_that_skipped_a_fallback_restore_meets_the_others_at_the_next(tmp_path):
    out = run_ranks(2, _skipped_then_agreed, str(tmp_path / "ck"), timeout=240)
    assert "rank(s) [1] did not answer the exchange 'restore-fallback' #0" in out[0]["alone"]
    for r in (0, 1):
        assert out[r]["next0"] == out[r]["next1"] == (1, True), out[r]
    assert any("the exchange 'restore-fallback' #0 had ended without rank 1" in m
               for m in out[1]["logs"]), out[1]["logs"]

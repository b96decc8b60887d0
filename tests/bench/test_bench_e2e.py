"""The pairing logic of benchmarks/bench_e2e.py: which no-checkpoint loops each checkpointing loop
is compared with, and the summary built from them (fake loop results; no timing is asserted)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import bench_e2e  # noqa: E402


def test_each_loop_is_compared_with_the_baselines_around_it(monkeypatch):
    calls = []
    wall = {
        "none": iter([10.0, 20.0, 30.0]),
        "a": iter([15.0]),
        "b": iter([50.0]),
        "c": iter([60.0]),
    }

    def fake(mode, steps, workdir, src):
        calls.append((mode, src))
        t = next(wall[mode])
        return {"total_s": t, "cpu_s": 2 * t}

    monkeypatch.setattr(bench_e2e, "loop_in_subprocess", fake)
    loops = [("a", "a", "new"), ("b", "b", "new"), ("c", "c", "old")]
    result = bench_e2e.run(loops, steps=1, reps=1, workdir="unused")
    # none, a, b, none, c, none: every loop sits between two no-checkpoint loops
    assert [m for m, _ in calls] == ["none", "a", "b", "none", "c", "none"]
    assert calls[4] == ("c", "old")
    summary = result["summary"]
    assert summary["a"]["ratios"] == [pytest.approx(15.0 / 15.0)]  # mean of 10 and 20
    assert summary["b"]["ratios"] == [pytest.approx(50.0 / 15.0)]
    assert summary["c"]["ratios"] == [pytest.approx(60.0 / 25.0)]  # mean of 20 and 30
    assert summary["c"]["cpu_ratio"] == pytest.approx(120.0 / 50.0)
    assert summary["none"]["range_s"] == [10.0, 30.0]


def test_unknown_mode_is_refused():
    with pytest.raises(ValueError, match="unknown mode"):
        bench_e2e.make_saver("ds_module_k7x", "unused")
    with pytest.raises(ValueError, match="unknown mode"):
        bench_e2e.make_saver("ds_module_k7x+gcfreeze", "unused")
    with pytest.raises(SystemExit):
        bench_e2e.main(["--modes", "limit+gcfreez"])


def test_gcfreeze_suffix_keeps_the_saver_of_its_mode(tmp_path):
    saver = bench_e2e.make_saver("ds_sd_all+gcfreeze", str(tmp_path / "ck"))
    try:
        assert isinstance(saver, bench_e2e.DatastatesSaver)
    finally:
        saver.close()


def test_limit_saver_writes_each_state_and_keeps_three(tmp_path):
    """The 'limit' row really writes the tensors (O_DIRECT, padded to its chunk), keeps the
    newest three, and a save waits for the buffer it reuses."""
    import torch

    model = torch.nn.Linear(4, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    s = {
        "model": model,
        "opt": opt,
        "sched": torch.optim.lr_scheduler.StepLR(opt, 1),
        "loader": type("L", (), {"state_dict": lambda self: {"pos": 0}})(),
    }
    saver = bench_e2e.LimitSaver(str(tmp_path / "limit"))
    try:
        for step in range(1, 6):
            with torch.no_grad():
                model.weight.fill_(step)
            saver.save(s, step)
        saver.finish()
    except OSError as exc:  # a file system without O_DIRECT (tmpfs)
        pytest.skip(f"O_DIRECT refused here: {exc}")
    finally:
        saver.close()
    names = sorted(p.name for p in (tmp_path / "limit").iterdir())
    assert names == ["step-3.bin", "step-4.bin", "step-5.bin"]
    data = (tmp_path / "limit" / "step-5.bin").read_bytes()
    assert len(data) == bench_e2e.LimitSaver.CHUNK
    weight = torch.frombuffer(bytearray(data[:48]), dtype=torch.float32)
    assert torch.equal(weight, torch.full((12,), 5.0))


def test_gc_pauses_counts_the_collections_inside_it_only():
    import gc

    gc.collect()
    with bench_e2e.GcPauses() as pauses:
        gc.collect(0)
        gc.collect(2)
    gc.collect(2)  # after the block: not counted
    assert pauses.full == 1
    assert pauses.seconds > 0.0
    assert pauses._callback not in gc.callbacks


def test_gc_pauses_counts_objects_promoted_to_the_oldest_generation():
    import gc

    gc.collect()
    with bench_e2e.GcPauses() as pauses:
        kept = [[i] for i in range(1000)]  # alive across the collections below
        gc.collect(0)  # into generation 1
        gc.collect(1)  # into generation 2: promoted
    assert len(kept) == 1000
    assert pauses.young >= 2 and pauses.full == 0  # (allocating may add a young one)
    assert pauses.promoted >= 1000


def test_summary_and_table_carry_the_gc_columns(capsys):
    rounds = [
        {
            "none": [{"total_s": 10.0, "cpu_s": 20.0, "gc_ms": 0.0, "full_gcs": 0}],
            "a": {
                "total_s": 12.0,
                "cpu_s": 24.0,
                "base_total_s": 10.0,
                "base_cpu_s": 20.0,
                "gc_ms": 150.0,
                "full_gcs": 1,
                "young_gcs": 12,
                "promoted_per_step": 4700.4,
            },
        }
    ]
    summary = bench_e2e.summarize(rounds, ["a"])
    assert summary["a"]["gc_ms"] == 150.0 and summary["a"]["full_gcs"] == 1
    bench_e2e.print_table({"steps": 1, "reps": 1, "summary": summary})
    assert "| 150 (1) | 12 | 4700 |" in capsys.readouterr().out

"""Smoke test of benchmarks/bench_tensors.py: one repetition of every method at 2000 tensors, end
to end (the script forked from the session's zygote, tests/zygote.py; it starts one subprocess
per measurement itself): every method saves, commits and restores bit-exact, the JSON has every
metric (a second count would run the same code again, in four more processes). And the rotation
and medians of ``run`` on fake measurements. Never timings."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest

import zygote

# slow: a quick run of the benchmark still measures every method
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import bench_tensors  # noqa: E402


def test_quick_run_measures_every_method(tmp_path):
    out = tmp_path / "tensors.json"
    proc = zygote.run(
        [
            sys.executable,
            str(REPO / "benchmarks" / "bench_tensors.py"),
            "--counts",
            "2000",
            "--reps",
            "1",
            "--dir",
            str(tmp_path),
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    counts = ["2000"]
    assert sorted(result["summary"]) == sorted(bench_tensors.METHODS)
    for method, by_count in result["summary"].items():
        assert sorted(by_count) == sorted(counts), method
        for row in by_count.values():
            for metric in bench_tensors.METRICS:
                assert math.isfinite(row[metric]) and row[metric] > 0, (method, metric)
            assert row["save_s"] <= row["commit_s"], method
    assert "| datastates | 2,000 |" in proc.stdout
    assert [p.name for p in tmp_path.iterdir()] == ["tensors.json"]  # checkpoints removed


def test_run_rotates_methods_and_takes_medians():
    calls = []
    values = iter(range(1, 100))

    def fake(method, count, numel, workdir, src):
        calls.append((method, count, src))
        v = float(next(values))
        return {"save_s": v, "commit_s": 2 * v, "restore_s": 3 * v}

    runs = [("a", "datastates", "new"), ("b", "torch_save", "new"), ("a@old", "datastates", "old")]
    result = bench_tensors.run(runs, [10, 20], numel=2, reps=3, workdir="unused", one=fake)
    assert [c[0] for c in calls[:3]] == ["datastates", "torch_save", "datastates"]
    assert calls[2][2] == "old" and calls[6][0] == "torch_save"  # rep 2 starts with b
    a10 = result["raw"]["a"]["10"]
    assert len(a10) == 3
    row = result["summary"]["a"]["10"]
    assert row["save_s"] == sorted(r["save_s"] for r in a10)[1]
    assert row["commit_us_per_tensor"] == pytest.approx(row["commit_s"] / 10 * 1e6)


def test_unknown_method_is_refused():
    with pytest.raises(SystemExit):
        bench_tensors.main(["--methods", "datastates,pickle"])
    with pytest.raises(ValueError, match="unknown method"):
        bench_tensors.measure("pickle", 1, 2, "unused")

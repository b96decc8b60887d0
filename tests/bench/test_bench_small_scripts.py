"""Smoke tests of the small benchmark scripts: each runs end to end on a tiny input in a process
of its own (forked from the session's zygote, tests/zygote.py) and writes its JSON; only the
shape of the output is checked, never timings."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import zygote

# slow: each test runs a benchmark script end to end in processes of its own
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _run(script: str, *args: str) -> None:
    # forked from the session's zygote (tests/zygote.py): torch is already imported
    done = zygote.run(
        [sys.executable, str(REPO / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=REPO,
    )
    assert done.returncode == 0, done.stdout + done.stderr


def test_bench_warm_writes_every_row(tmp_path):
    out = tmp_path / "warm.json"
    _run(
        "bench_warm.py", "--gib", "0.02", "--reps", "1", "--dir", str(tmp_path), "--json", str(out)
    )
    rows = json.loads(out.read_text())["rows"]
    assert set(rows) == {
        "memcpy",
        "read + CRC",
        "read + CRC, 2 threads",
        "read into tensors + CRC, 2 threads",
        "datastates verify",
        "datastates restore",
    }
    assert all(math.isfinite(r["gb_s"]) and r["gb_s"] > 0 for r in rows.values())


def test_bench_scan_times_every_phase(tmp_path):
    out = tmp_path / "scan.json"
    _run("bench_scan.py", "--quick", "--dir", str(tmp_path), "--json", str(out))
    result = json.loads(out.read_text())
    assert set(result["median_s"]) == {
        f"datastates {p}" for p in ("scan", "restore", "read_crc", "parse_all")
    }
    assert all(math.isfinite(s) and s > 0 for s in result["median_s"].values())
    assert result["manifest_bytes"] > 0 and not list(tmp_path.glob("bench-scan-*"))


def test_commit_scale_measures_each_world_size(tmp_path):
    _run(
        "commit_scale.py",
        "--worlds",
        "1,2",
        "--saves",
        "2",
        "--out",
        str(tmp_path / "cs"),
        "--dir",
        str(tmp_path),
    )
    rows = json.loads((tmp_path / "cs" / "results.json").read_text())["rows"]
    assert [r["world"] for r in rows] == [1, 2]
    assert rows[1]["rank0_requests"] > 0 and rows[1]["other_requests"] > 0
    assert rows[1]["manifest_bytes"] > rows[0]["manifest_bytes"] > 0


def test_scripts_import_from_any_directory(tmp_path):
    """Run as scripts from elsewhere (how the README and scripts/gpu_check.sh call them), the
    benchmarks find ``datastates`` and ``benchmarks.*`` themselves."""
    import torch

    for script, args, says in (
        ("bench_e2e.py", ["--help"], "usage"),
        (
            "gpu_bench.py",
            ["--out", str(tmp_path / "g.json")],
            "no CUDA" if not torch.cuda.is_available() else None,
        ),
    ):
        if says is None:  # a GPU machine runs the benchmark itself in gpu_check.sh
            continue
        # a plain interpreter, not the zygote: what it imports is what the script finds
        done = subprocess.run(
            [sys.executable, str(REPO / "benchmarks" / script), *args],
            capture_output=True,
            text=True,
            timeout=300,
            cwd=tmp_path,
            env={"PATH": "/usr/bin:/bin"},
        )
        assert done.returncode == 0 and says in done.stdout, (script, done.stderr[-2000:])


def test_bench_memory_writes_every_row(tmp_path, shm_root):
    out = tmp_path / "memory.json"
    _run(
        "bench_memory.py",
        "--gib",
        "0.02",
        "--reps",
        "1",
        "--snapshots",
        "55",
        "--dir",
        str(tmp_path),
        "--shm",
        shm_root,
        "--json",
        str(out),
    )
    result = json.loads(out.read_text())
    assert set(result["restore"]) == {
        "memcpy",
        "read",
        "read_crc",
        "restore_memory",
        "restore_memory_restart",
        "restore_disk_warm",
        "restore_disk_cold",
    }
    assert all(math.isfinite(r["gbps"]) and r["gbps"] > 0 for r in result["restore"].values())
    snap = result["snapshots"]
    assert snap["at_end"]["fds"] == snap["at_50"]["fds"]

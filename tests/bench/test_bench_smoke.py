"""Smoke test of the benchmark suite: ``benchmarks/run.py --preset smoke`` end to end, in a
process of its own (forked from the session's zygote, tests/zygote.py: torch already imported;
every phase and every method once, on a one-layer GPT: one round, a 2-step end-to-end loop
checkpointing every 1 and every 2 steps).

Checks the outputs' shape only (files exist, JSON schema, every method has numeric fields, PNGs are
well-formed); never timings. The PNG check is skipped only when matplotlib is not installed.
"""

from __future__ import annotations

import importlib.util
import json
import math
import struct
import sys
from pathlib import Path

import pytest

import zygote

# slow: the benchmark's smoke run, every method end to end
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
RUN = REPO / "benchmarks" / "run.py"
CHARTS = ["stall.png", "committed_throughput.png", "e2e_slowdown.png", "load_throughput.png"]
#: The smoke preset's end-to-end loop: its steps and checkpoint intervals.
E2E_STEPS, E2E_KS = 2, [1, 2]
SAVE_FIELDS = [
    "blocked_s",
    "snapshot_s",
    "commit_s",
    "checkpoint_gbps",
    "committed_gbps",
    "frac_write_limit",
    "peak_extra_rss",
]


def _is_number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _check_summary(s, where: str) -> None:
    assert isinstance(s, dict), f"{where}: expected a summary dict, found {s!r}"
    for k in ("median", "min", "max"):
        assert _is_number(s[k]), f"{where}.{k} is not a finite number: {s[k]!r}"
    assert s["min"] <= s["median"] <= s["max"], where


def _png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n", f"{path.name}: not a PNG signature"
    assert data[12:16] == b"IHDR", f"{path.name}: first chunk is not IHDR"
    assert data[-12:-8] == b"\x00\x00\x00\x00" and data[-8:-4] == b"IEND", f"{path.name}: no IEND"
    return struct.unpack(">II", data[16:24])


@pytest.fixture(scope="module")
def smoke_run(tmp_path_factory):
    base = tmp_path_factory.mktemp("bench")
    work, out = base / "disk", base / "results"
    work.mkdir()
    proc = zygote.run(
        [sys.executable, str(RUN), "--preset", "smoke", "--dir", str(work), "--out", str(out)],
        cwd=base,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, f"run.py failed ({proc.returncode}):\n{proc.stderr[-4000:]}"
    return work, out, proc


def test_outputs_exist_and_workdir_is_clean(smoke_run):
    work, out, _ = smoke_run
    assert (out / "report.md").stat().st_size > 0
    assert (out / "results.json").stat().st_size > 0
    assert list(work.iterdir()) == [], "the run left files in --dir"


def test_results_schema(smoke_run):
    _, out, _ = smoke_run
    res = json.loads((out / "results.json").read_text())
    assert res["schema"] == "datastates-bench/1"
    assert res["interrupted"] is False
    for name in ("write", "read_cold", "copy"):
        _check_summary(res["limits"]["summary"][name], f"limits.{name}")
    ran = [n for n, m in res["methods"].items() if m["available"]]
    for n, m in res["methods"].items():
        assert m["available"] or m["reason"], f"{n} did not run and gives no reason"
    assert "datastates" in ran, res["methods"]["datastates"]
    full = res["phases"]["gpt/full"]
    assert not full["raw"]["errors"], full["raw"]["errors"]
    for n in ran:
        if "full" not in res["methods"][n]["scopes"]:
            continue
        for phase in ("gpt/full", "fragmented/full"):
            entry = res["phases"][phase]["save"][n]
            for f in SAVE_FIELDS:
                _check_summary(entry[f], f"{phase}.save.{n}.{f}")
            assert entry["files"] >= 1 and entry["disk_bytes"] > 0
    for n, entry in res["phases"]["gpt/model"]["save"].items():
        _check_summary(entry["commit_s"], f"gpt/model.save.{n}.commit_s")
    loads = full["load"]
    assert "datastates" in loads and len(loads) >= 2
    for n, entry in loads.items():
        assert entry["verified"] is True, f"{n}: loaded state does not match the saved one"
        _check_summary(entry["cold_gbps"], f"load.{n}.cold_gbps")
        _check_summary(entry["warm_gbps"], f"load.{n}.warm_gbps")
    ref = full["save"]["datastates"]["vs_reference"]["commit_s"]
    assert ref["median"] == pytest.approx(1.0)


def test_e2e_schema(smoke_run):
    _, out, _ = smoke_run
    res = json.loads((out / "results.json").read_text())
    assert res["meta"]["preset"] == "smoke" and res["meta"]["reps"] == 1
    config = res["e2e"]["raw"]["config"]
    assert (config["steps"], config["ks"], config["rounds"]) == (E2E_STEPS, E2E_KS, 1)
    e2e = res["e2e"]["summary"]
    _check_summary(e2e["baseline_s"], "e2e.baseline_s")
    for n, m in res["methods"].items():
        if not m["available"] or "full" not in m["scopes"]:
            continue
        assert set(e2e["methods"][n]) == {str(k) for k in E2E_KS}, n
        for k, entry in e2e["methods"][n].items():
            _check_summary(entry["total_s"], f"e2e.{n}@{k}.total_s")
            _check_summary(entry["slowdown"], f"e2e.{n}@{k}.slowdown")
            assert entry["n_ckpt"] == E2E_STEPS // int(k)


def test_report_mentions_every_section(smoke_run):
    _, out, _ = smoke_run
    md = (out / "report.md").read_text()
    for heading in (
        "## Physical limits",
        "## Save — `gpt/full`",
        "## Save — `fragmented/full`",
        "### Load into the live state",
        "## End-to-end training",
        "## Charts",
    ):
        assert heading in md


@pytest.mark.skipif(
    importlib.util.find_spec("matplotlib") is None,
    reason="matplotlib not installed: the run skips charts",
)
def test_charts_are_png(smoke_run):
    _, out, _ = smoke_run
    res = json.loads((out / "results.json").read_text())
    assert res["charts"]["skipped"] is None
    for name in CHARTS:
        assert name in res["charts"]["files"]
        w, h = _png_size(out / name)
        assert 200 < w < 5000 and 200 < h < 5000, (name, w, h)
        assert f"]({name})" in (out / "report.md").read_text()

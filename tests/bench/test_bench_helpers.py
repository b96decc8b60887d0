"""Unit tests of the benchmark suite's pure parts: statistics, pairing, memory plan, analysis,
states, the Pending timing contract, and the run without matplotlib."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

import zygote

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import analysis, charts, common, report, states  # noqa: E402
from benchmarks.memory import MemoryPlan  # noqa: E402
from benchmarks.methods.base import Checkpoint, Pending  # noqa: E402
from benchmarks.run import PRESETS, build_parser, parse_bytes  # noqa: E402


def test_summarize_ignores_missing_and_non_finite():
    s = common.summarize([3.0, None, 1.0, float("nan"), 2.0])
    assert (s["median"], s["min"], s["max"], s["n"]) == (2.0, 1.0, 3.0, 3)
    assert common.summarize([None]) is None


def test_paired_ratios_only_within_a_round():
    rounds = [
        {"a": {"t": 2.0}, "ref": {"t": 1.0}},
        {"a": {"t": 9.0}},  # no reference in this round: skipped
        {"a": {"t": 3.0}, "ref": {"t": 3.0}},
    ]
    assert common.paired_ratios(rounds, "t", "a", "ref") == [2.0, 1.0]


def test_rotated_puts_every_item_first_once():
    items = ["a", "b", "c"]
    firsts = [common.rotated(items, r)[0] for r in range(3)]
    assert sorted(firsts) == items
    assert sorted(common.rotated(items, 5)) == items


def test_memory_plan_and_scaling():
    plan = MemoryPlan(
        state_bytes=10 * common.GiB,
        held_factor=2.0,
        transient_factor=1.0,
        overhead_bytes=common.GiB,
    )
    assert plan.need_bytes == 41 * common.GiB
    fit = plan.max_state_bytes(available=20 * common.GiB, safety=1.0)
    assert fit == pytest.approx(19 * common.GiB / 4, rel=1e-9)
    cfg = states.gpt_config("small")
    smaller = states.scale_layers(cfg, states.estimate_state_bytes(cfg) // 2)
    assert smaller is not None and smaller.n_layer < cfg.n_layer
    assert states.estimate_state_bytes(smaller) <= states.estimate_state_bytes(cfg) // 2
    assert states.scale_layers(cfg, 1) is None


def test_parse_bytes():
    assert parse_bytes("4GiB") == 4 << 30
    assert parse_bytes("512MiB") == 512 << 20
    assert parse_bytes("1.5GB") == 1_500_000_000
    assert parse_bytes("1000") == 1000


def test_gpt2_medium_preset_is_about_3_6_gb():
    assert 3.4e9 < states.estimate_state_bytes(states.gpt_config("gpt2-medium")) < 3.8e9


def test_quick_is_its_own_preset_and_smoke_is_the_quick_shape_on_one_layer():
    assert build_parser().parse_args(["--quick"]).preset == "quick"
    quick, smoke = PRESETS["quick"], PRESETS["smoke"]
    assert (quick.reps, quick.e2e_steps, quick.e2e_ks, quick.shape) == (2, 10, "1,5,10", None)
    assert smoke.reps == 1 and smoke.e2e_rounds == 1
    cfg = states.gpt_config(smoke.shape, smoke.n_layer)
    assert cfg.n_layer == 1 and cfg.n_embd == states.gpt_config("quick").n_embd


def test_fragmented_state_has_same_bytes_in_many_tensors():
    cfg = states.gpt_config("quick")
    gpt = states.build_gpt_state(cfg)
    frag = states.build_fragmented_state(cfg, target_pieces=500)
    n_gpt = sum(p.numel() for p in gpt.model.parameters())
    n_frag = sum(p.numel() for p in frag.model.parameters())
    assert n_gpt == n_frag
    assert frag.ntensors > 4 * 400 and frag.ntensors > 5 * gpt.ntensors


@pytest.mark.slow
def test_fingerprint_detects_perturbation_and_copy_into_live_restores():
    st = states.build_gpt_state(states.gpt_config("quick"))
    sd = {k: v for k, v in states.plain_state_dict(st).items()}
    saved = {
        "model": {k: v.clone() for k, v in sd["model"].items()},
        "optimizer": {
            "state": {
                i: {k: v.clone() for k, v in s.items()} for i, s in sd["optimizer"]["state"].items()
            },
            "param_groups": sd["optimizer"]["param_groups"],
        },
    }
    fp = states.fingerprint(st)
    states.perturb(st)
    assert states.fingerprint(st) != fp
    states.copy_into_live(st, saved)
    assert states.fingerprint(st) == fp


def test_pending_timing_contract():
    calls = []
    p = Pending(
        common.now(),
        Checkpoint(1),
        snapshot_fn=lambda: calls.append("snap"),
        commit_fn=lambda: calls.append("commit"),
    )
    assert p.snapshot_s is None and not p.committed
    c = p.wait()
    assert p.wait() == c and calls == ["commit"]  # idempotent
    assert p.snapshot_s == c  # committed implies captured
    sync = Pending(common.now(), Checkpoint(2))
    assert sync.snapshot_s == sync.commit_s == sync.blocked_s


def _phase():
    rounds = [
        {
            "datastates": {
                "blocked_s": 0.01,
                "snapshot_s": 0.5,
                "commit_s": 1.0,
                "transient_rss": 10,
                "files": 1,
                "disk_bytes": 100,
            },
            "torch_save": {
                "blocked_s": 2.0,
                "snapshot_s": 2.0,
                "commit_s": 2.0,
                "transient_rss": 0,
                "files": 1,
                "disk_bytes": 100,
            },
        },
        {
            "datastates": {
                "blocked_s": 0.02,
                "snapshot_s": 0.5,
                "commit_s": 2.0,
                "transient_rss": 20,
                "files": 1,
                "disk_bytes": 100,
            },
            "torch_save": {
                "blocked_s": 3.0,
                "snapshot_s": 3.0,
                "commit_s": 3.0,
                "transient_rss": 0,
                "files": 1,
                "disk_bytes": 100,
            },
        },
    ]
    return {
        "state": {"nbytes": 2_000_000_000},
        "methods": ["datastates", "torch_save"],
        "setup": {"datastates": {"held_rss": 1000}},
        "rounds": rounds,
        "load_rounds": [
            {
                "torch_save": {
                    "cold_s": 1.0,
                    "warm_s": 0.5,
                    "verified": True,
                    "cold_rss_extra": 0,
                    "warm_rss_extra": 0,
                }
            }
        ],
    }


def test_analyze_save_ratios_and_fractions():
    limits = {
        "write": common.summarize([2.0]),
        "copy": common.summarize([10.0]),
        "read_cold": common.summarize([4.0]),
        "read_warm": common.summarize([20.0]),
    }
    res = analysis.analyze_save(_phase(), limits, "datastates")
    ts = res["torch_save"]
    assert ts["vs_reference"]["commit_s"]["values"] == [2.0, 1.5]
    assert ts["committed_gbps"]["values"] == [1.0, pytest.approx(2 / 3)]
    assert ts["frac_write_limit"]["values"] == [0.5, pytest.approx(1 / 3)]
    assert res["datastates"]["peak_extra_rss"]["values"] == [1010, 1020]
    load = analysis.analyze_load(_phase(), limits, "datastates")
    assert load["torch_save"]["cold_gbps"]["median"] == 2.0
    assert load["torch_save"]["frac_cold_read"]["median"] == 0.5
    assert load["torch_save"]["vs_reference"]["cold_s"] is None  # reference did not load


def test_write_fraction_uses_the_probe_of_the_same_round():
    limits = {"write": common.summarize([2.0]), "copy": common.summarize([10.0])}
    phase = {**_phase(), "round_write_gbps": [1.0, 4.0]}
    ts = analysis.analyze_save(phase, limits, "datastates")["torch_save"]
    assert ts["frac_write_limit"]["values"] == [1.0, pytest.approx(1 / 6)]
    phase["round_write_gbps"] = [1.0, None]  # a failed probe falls back to the limit
    ts = analysis.analyze_save(phase, limits, "datastates")["torch_save"]
    assert ts["frac_write_limit"]["values"] == [1.0, pytest.approx(1 / 3)]


def test_analyze_e2e_pairs_with_the_adjacent_baseline():
    loop = {
        "n_ckpt": 2,
        "save_call_s": [0.1],
        "update_after_ckpt_s": [0.2],
        "update_other_s": [0.1],
    }
    e2e = {
        "methods": ["datastates", "torch_save"],
        "rounds": [
            {
                "baseline:datastates": {"total_s": 10.0},
                "datastates@5": {**loop, "total_s": 11.0},
                "baseline:torch_save": {"total_s": 10.0},
                "torch_save@5": {**loop, "total_s": 15.0},
            },
            {
                "baseline:datastates": {"total_s": 20.0},
                "datastates@5": {**loop, "total_s": 22.0},
                "baseline:torch_save": {"total_s": 20.0},
                "torch_save@5": {**loop, "total_s": 33.0},
            },
        ],
    }
    res = analysis.analyze_e2e(e2e, "datastates")
    ts = res["methods"]["torch_save"]["5"]
    assert ts["slowdown"]["values"] == [1.5, 1.65]
    assert ts["stall_per_ckpt_s"]["values"] == [2.5, 6.5]
    assert ts["vs_reference"]["values"] == [pytest.approx(15 / 11), 1.5]
    assert ts["slowdown_min"] == 1.5
    assert ts["direct_stall_s"] == pytest.approx(0.2)
    assert list(res["methods"]) == ["datastates", "torch_save"]
    assert res["baseline_s"]["n"] == 4


def test_charts_unavailable_without_matplotlib(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(charts.ChartsUnavailable):
        charts.draw_all({}, Path("."))


@pytest.mark.slow
def test_run_without_matplotlib_still_writes_md_and_json(tmp_path):
    """A minimal real run with matplotlib made unimportable."""
    script = (
        "import sys, runpy\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'matplotlib' or name.startswith('matplotlib.'):\n"
        "            raise ImportError('blocked for the test')\n"
        "sys.meta_path.insert(0, Block())\n"
        f"sys.argv = ['run.py', '--preset', 'smoke', '--methods', 'torch_save', '--skip-e2e', "
        f"'--skip-fragmented', '--skip-model-only', '--dir', {str(tmp_path)!r}, "
        f"'--out', {str(tmp_path / 'out')!r}]\n"
        f"runpy.run_path({str(REPO / 'benchmarks' / 'run.py')!r}, run_name='__main__')\n"
    )
    # forked from the session's zygote, which has imported torch but never matplotlib
    proc = zygote.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "out"
    res = json.loads((out / "results.json").read_text())
    assert res["charts"]["files"] == [] and "matplotlib" in res["charts"]["skipped"]
    assert "Charts skipped" in (out / "report.md").read_text()
    assert not list(out.glob("*.png"))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_report_renders_with_missing_sections():
    results = {
        "meta": {
            "started": "now",
            "command": "x",
            "preset": "quick",
            "reps": 1,
            "dir": "/",
            "cpus": 2,
            "mem_total": 1,
            "mem_available_start": 1,
            "torch": torch.__version__,
            "python": "3",
            "datastates": "0",
        },
        "reference": "datastates",
        "methods": {},
        "limits": {"summary": {}},
        "phases": {},
        "e2e": None,
        "charts": {"files": [], "skipped": "no matplotlib"},
    }
    md = report.render_markdown(results)
    assert "Charts skipped: no matplotlib" in md

"""Smoke test of the scale model (benchmarks/scale_model.py, its settings and tables) and of the
capture of its rank-0 inputs (benchmarks/scale_inputs.py): the arithmetic of each term on explicit inputs, the CLI
end to end on the committed measurements, and real rank reports merged by the probe. No timing
is asserted; the probe's review runs once on four tiny reports."""

from __future__ import annotations

import dataclasses
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import scale_model as sm  # noqa: E402
from benchmarks import scale_settings as ss  # noqa: E402

COSTS = dataclasses.replace(
    sm.MEASURED,
    save_per_tensor_s=1e-4,
    rank0_fixed_s=1e-3,
    rank0_per_entry_s=1e-4,
    report_bytes_fixed=1000.0,
    report_bytes_per_entry=200.0,
    manifest_bytes_fixed=1000.0,
    manifest_bytes_per_entry=100.0,
    store_rtt_s=50e-6,
    store_server_s=10e-6,
    store_value_gbps=1.0,
)
REQUESTS = (10.0, 1.5)


def test_the_papers_setting_has_the_arithmetic_of_docs_scale():
    s = ss.SETTINGS[0]
    assert (s.ranks, s.nodes, s.tp * s.pp) == (256, 64, 64)
    assert s.total_bytes == pytest.approx(70e9 * 14)
    assert s.written_per_rank == pytest.approx(70e9 * 14 / 256)
    assert s.replicas_held_per_rank == pytest.approx(70e9 * 2 / 64)  # its bf16 weight shard


def test_persist_is_its_tightest_bound():
    s = ss.SETTINGS[0]
    p = sm.persist_terms(s, COSTS)
    assert p["persist_s"] == max(p["persist_bounds"].values())
    # 256 files round-robin over 160 OSTs: 2 on the busiest one, at 650/160 GB/s
    assert p["persist_bounds"]["OSTs, stripe count 1"] == pytest.approx(
        2 * s.written_per_rank / (650e9 / 160)
    )
    assert p["write_bound"] == "OSTs, stripe count 1"


def test_a_lazy_snapshot_that_fits_fwd_bwd_stalls_for_the_call_and_the_digest_copies():
    s = ss.SETTINGS[0]
    snap = sm.snapshot_terms(s, COSTS, persist_s=1.0, cache_bytes=None)
    assert snap["overlaps_iteration"] and snap["step_wait_s"] == 0.0
    digest_copies = s.replicas_held_per_rank / 12.5e9  # pageable, on the compute stream
    assert snap["stall_s"] == pytest.approx(s.tensors_per_rank * 1e-4 + digest_copies)
    assert snap["d2h_s"] == pytest.approx(s.written_per_rank / 25e9)
    unchecked = dataclasses.replace(s, replica_check=False)
    off = sm.snapshot_terms(unchecked, COSTS, persist_s=1.0, cache_bytes=None)
    assert off["digest_s"] == 0.0 and off["stall_s"] == pytest.approx(s.tensors_per_rank * 1e-4)
    short = dataclasses.replace(s, fwd_bwd_s=0.01)
    late = sm.snapshot_terms(short, COSTS, persist_s=1.0, cache_bytes=None)
    assert late["step_wait_s"] == pytest.approx(
        late["in_host_memory_s"] - late["save_call_s"] - 0.01
    )


def test_a_cache_smaller_than_the_state_streams_at_the_write_rate():
    s = ss.SETTINGS[0]
    full = sm.snapshot_terms(s, COSTS, persist_s=10.0, cache_bytes=None)
    small = sm.snapshot_terms(s, COSTS, persist_s=10.0, cache_bytes=s.written_per_rank / 4)
    assert small["d2h_s"] == pytest.approx(s.written_per_rank / 4 / 25e9 + 10.0 * 0.75)
    assert small["d2h_s"] > full["d2h_s"]


def test_the_store_saturates_when_polls_outnumber_its_service_rate():
    one, load_one = sm.store_response_s(1, COSTS, ss.POLARIS)
    assert one == pytest.approx(10e-6 + 40e-6 + ss.POLARIS.net_rtt_s)
    assert load_one < 0.01
    # the waiting ranks poll at most every 50 us x ranks: at 10 us per request the server is
    # at most a fifth busy with them, at any world size
    _, below = sm.store_response_s(2000, COSTS, ss.POLARIS)
    big, above = sm.store_response_s(20000, COSTS, ss.POLARIS)
    assert below < 0.25 and above == pytest.approx(0.2, abs=0.01)
    assert big < 1e-3


def test_poll_interval_follows_the_rounds_backoff():
    assert sm.poll_interval(0.0) == sm.POLL_S
    assert sm.poll_interval(0.0025) == pytest.approx(sm.POLL_S * 1.5)
    assert sm.poll_interval(10.0) == sm.MAX_POLL_S
    assert sm.poll_interval(100.0, 8192) == pytest.approx(8192 * 50e-6)


def test_commit_terms_count_reports_entries_and_files():
    s = dataclasses.replace(ss.SETTINGS[0], dp=16)  # 1,024 ranks
    c = sm.commit_terms(s, COSTS, REQUESTS)
    assert c["review_s"] == pytest.approx(1024 * (1e-3 + 1e-4 * 200))
    assert c["manifest_bytes"] == pytest.approx(1024 * (1000 + 100 * 200))
    assert c["check_files_s"] == pytest.approx(1024 * ss.POLARIS.fs_stat_s)
    assert c["commit_s"] == pytest.approx(
        c["gather_s"] + c["review_s"] + c["check_files_s"] + c["publish_s"] + c["notice_s"]
    )
    alone = sm.commit_terms(dataclasses.replace(s, tp=1, pp=1, dp=1), COSTS, REQUESTS)
    assert alone["gather_s"] == alone["notice_s"] == 0.0


def test_evaluation_flags_what_breaks():
    big = sm.evaluate(ss.SETTINGS[-1], COSTS, REQUESTS, [1, 10], None)
    big["dominant"] = sm.dominant(big)
    flags = sm.breaks(big, ss.POLARIS.host_mem_bytes)
    assert big["ranks"] == 8192
    # 8,191 pollers at most every 0.41 s, 10 us each: the store is not saturated any more
    assert not any("TCPStore" in f for f in flags) and big["store_load"] < 0.25
    # rank 0's serial review of 8,192 reports (172 s here) is what is left: a checkpoint every
    # iteration waits for the commit before last; every 10 iterations it does not
    assert not big["times_out"] and big["overhead"][1] > 1 and big["overhead"][10] < 0.01
    assert flags == ["a checkpoint every iteration waits for the commit before last"]
    small = sm.evaluate(ss.SETTINGS[0], COSTS, REQUESTS, [1, 10], None)
    assert sm.breaks(small, ss.POLARIS.host_mem_bytes) == []
    assert 0 < small["overhead"][10] < small["overhead"][1] < 0.01
    assert small["checkpoint_gbps"] == pytest.approx(small["total_gb"] / small["stall_s"])


def test_tensor_costs_can_come_from_another_json(tmp_path):
    path = tmp_path / "tensors.json"
    path.write_text(
        json.dumps({"per_tensor_s": {"save": 1e-5, "commit": 2e-5, "restore": 3e-5}, "other": 1})
    )
    costs, sources = sm.load_costs(None, str(path))
    assert (costs.save_per_tensor_s, costs.commit_per_tensor_s, costs.restore_per_tensor_s) == (
        1e-5,
        2e-5,
        3e-5,
    )
    assert costs.rank0_per_entry_s == sm.MEASURED.rank0_per_entry_s
    assert str(path) in sources[-1]


def test_request_fit_reproduces_a_line(tmp_path):
    rows = [{"world": w, "rank0_requests": 9.0 + 1.25 * w, "latency_s": 0.01} for w in (1, 2, 8)]
    rows[0]["rank0_requests"] = 11.0  # one rank: not part of the fit
    path = tmp_path / "cs.json"
    path.write_text(json.dumps({"rows": rows}))
    (fixed, slope), _ = sm.load_commit_scale(str(path))
    assert (fixed, slope) == (pytest.approx(9.0), pytest.approx(1.25))


def test_cli_validates_and_evaluates_the_committed_measurements(tmp_path):
    for extra, name in (
        ([], "model.json"),
        (["--validate"], "validation.json"),
        (["--sweep", "--every", "2"], "sweep.json"),
    ):
        proc = subprocess.run(
            [
                sys.executable,
                str(REPO / "benchmarks" / "scale_model.py"),
                "--out",
                str(tmp_path),
                *extra,
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        rows = json.loads((tmp_path / name).read_text())["rows"]
        assert rows and all(math.isfinite(r["commit_s"]) and r["commit_s"] > 0 for r in rows)
    measured = json.loads((REPO / "results" / "commit-scale" / "results.json").read_text())
    validation = json.loads((tmp_path / "validation.json").read_text())["rows"]
    assert [r["world"] for r in validation] == [r["world"] for r in measured["rows"]]
    evaluation = json.loads((tmp_path / "model.json").read_text())["rows"]
    assert [r["ranks"] for r in evaluation] == [s.ranks for s in ss.SETTINGS]
    swept = json.loads((tmp_path / "sweep.json").read_text())["rows"]
    assert [r["ranks"] for r in swept] == [s.ranks for s in ss.sweep()]
    assert all(list(r["overhead"]) == ["2"] for r in swept)  # JSON keys


def test_probe_reports_merge_into_one_manifest(tmp_path):
    from benchmarks import scale_inputs

    raw = scale_inputs.capture_reports(4, 2, 4, str(tmp_path))
    assert [json.loads(r)["rank"] for r in raw] == [0, 1, 2, 3]
    wide = scale_inputs.widen(raw, 8, 4)  # ranks 4-7: the same shards as pipeline stage 1
    reports = [json.loads(r) for r in wide]
    assert [r["rank"] for r in reports] == list(range(8))
    assert reports[5]["file"]["name"] == "rank-00005.dsf"
    assert {e["key"] for e in reports[5]["entries"] if e["key"].startswith("stage/")} == {
        "stage/1/p0",
        "stage/1/p1",
    }
    run = scale_inputs._review_run(wide, 1)  # raises if the 8 reports do not tile
    assert run["world"] == 8 and run["manifest_bytes"] > 0
    assert run["report_bytes"] == sum(len(r) for r in wide)
    assert list(tmp_path.iterdir()) == []  # every probe checkpoint was removed

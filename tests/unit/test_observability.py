"""What a user sees around saves: one log line per committed save, a warning when a failure
happens that nobody is waiting for, and no folder created by a Checkpointer that only reads."""
from __future__ import annotations

import logging
import threading

import pytest
import torch

import datastates

CFG = datastates.CheckpointConfig(host_cache_bytes=1 << 20, chunk_bytes=16 << 10)


def _state(seed: int) -> dict:
    torch.manual_seed(seed)
    return {"w": torch.randn(20_000), "epoch": seed}


def _failing_writers(monkeypatch):
    real = datastates.format.crc32

    def crc32(data, value=0):
        if threading.current_thread().name.startswith("datastates-writer"):
            raise RuntimeError("injected checksum failure")
        return real(data, value)
    monkeypatch.setattr(datastates.format, "crc32", crc32)


def test_one_info_line_per_committed_save(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="datastates")
    with datastates.Checkpointer(tmp_path, CFG) as ck:
        handle = ck.save(_state(1), step=1)
        handle.wait()
        ck.save(_state(2), step=2).wait()
    lines = [r for r in caplog.records if r.name == "datastates" and r.levelno == logging.INFO]
    assert len(lines) == 2
    text = lines[0].getMessage()
    assert "committed step-0000000001" in text and "GB/s" in text and "blocked" in text
    assert f" {handle.stats.nbytes} bytes" in text


def test_a_failure_nobody_waits_for_is_logged_when_it_happens(tmp_path, caplog, monkeypatch):
    with datastates.Checkpointer(tmp_path, CFG) as ck:
        _failing_writers(monkeypatch)
        handle = ck.save(_state(1), step=1)
        handle._job.finished.wait(120)  # nobody is in wait(): the failure is logged by itself
        monkeypatch.undo()
        warned = [r for r in caplog.records if r.name == "datastates" and
                  r.levelno == logging.WARNING]
        assert len(warned) == 1 and "step-0000000001" in warned[0].getMessage()
        assert "injected checksum failure" in warned[0].getMessage()
        with pytest.raises(RuntimeError, match="injected checksum failure"):
            handle.wait()


def test_a_failure_raised_to_a_waiter_is_not_logged_again(tmp_path, caplog, monkeypatch):
    with datastates.Checkpointer(tmp_path, CFG) as ck:
        _failing_writers(monkeypatch)
        handle = ck.save(_state(1), step=1)
        with pytest.raises(RuntimeError, match="injected checksum failure"):
            handle.wait(120)
        monkeypatch.undo()
    assert not [r for r in caplog.records if r.name == "datastates" and
                r.levelno >= logging.WARNING]


def test_a_reading_checkpointer_creates_no_folder(tmp_path):
    typo = tmp_path / "chekpoints"
    with datastates.Checkpointer(typo, CFG) as ck:
        assert ck.list() == [] and ck.latest() is None
        with pytest.raises(datastates.CheckpointNotFoundError, match="does not exist"):
            ck.restore(_state(0))
        with pytest.raises(datastates.CheckpointNotFoundError):
            ck.load()
    assert not typo.exists()
    with datastates.Checkpointer(typo, CFG) as ck:  # the first save creates it
        state = _state(3)
        ck.save(state, step=3).wait()
        assert [i.step for i in ck.list()] == [3] and ck.latest().step == 3
        assert torch.equal(ck.load()["w"], state["w"])

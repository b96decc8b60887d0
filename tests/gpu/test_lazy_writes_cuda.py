"""Lazy CUDA tensors written in place before their side-stream copy completed: the save fails
(LazyWriteError), while the guarded step, which waits for the copy, never fails one. Skipped
without CUDA; tests/unit/test_lazy_writes.py has the CPU cases and says how the capture is kept
pending (two cache slots, shard-file writes held by the test)."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from datastates import CheckpointConfig, Checkpointer
from datastates.errors import LazyWriteError
from datastates.storage.posix import ShardWriter

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SMALL = CheckpointConfig(host_cache_bytes=32 << 10, chunk_bytes=16 << 10)
PENDING = "model/7.weight"  # laid out well after the two units the cache holds


@pytest.fixture
def stall(monkeypatch):
    """``(entered, release)``: shard-file writes wait until ``release`` is set; ``entered`` is
    set once one waits (the capture then stops at its third unit)."""
    entered, release, write = threading.Event(), threading.Event(), ShardWriter.write

    def stalled(self, data, offset, padded=None):
        entered.set()
        assert release.wait(60), "the test never released the writes"
        return write(self, data, offset, padded)

    monkeypatch.setattr(ShardWriter, "write", stalled)
    yield entered, release
    release.set()


def _make():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)]).cuda()
    return model, torch.optim.Adam(model.parameters(), lr=0.1)


def _forward_backward(model):
    model(torch.randn(4, 64, device="cuda")).square().mean().backward()


def test_write_before_the_side_stream_copy_fails_the_save(tmp_path, stall):
    entered, release = stall
    model, opt = _make()
    _forward_backward(model)
    opt.step()
    opt.zero_grad()
    with Checkpointer(tmp_path, SMALL) as ckpt:
        handle = ckpt.save({"model": model, "opt": opt}, step=1)
        assert entered.wait(60)
        with torch.no_grad():
            model[7].weight.copy_(torch.ones(64, 64, device="cuda"))
        release.set()
        with pytest.raises(LazyWriteError) as caught:
            handle.wait(60)
        assert caught.value.keys == (PENDING,)
        assert ckpt.latest() is None


def test_guarded_step_on_cuda_commits_the_values_at_save(tmp_path, stall):
    """The step begins while the copy is pending (its pre-hook waits): no false failure, and
    the checkpoint holds the values at save(), bit for bit."""
    entered, release = stall
    model, opt = _make()
    _forward_backward(model)
    opt.step()
    opt.zero_grad()
    pending = []
    handles = []
    opt.register_step_pre_hook(
        lambda *_: (pending.append(not handles[-1].snapshot_done()), release.set())
    )
    with Checkpointer(tmp_path, SMALL) as ckpt:
        reference = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        handles.append(ckpt.save({"model": model, "opt": opt}, step=1))
        _forward_backward(model)
        opt.step()
        handles[-1].wait(60)
        loaded = ckpt.load(1)
    assert pending == [True]
    for key, value in reference.items():
        assert torch.equal(loaded["model"][key].cpu(), value), key

"""CUDA paths: pinned host cache, side-stream copies ordered after the compute stream, in-place
restore on the device. Skipped without CUDA; run by scripts/gpu_check.sh on a GPU machine."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import datastates
from datastates import CheckpointConfig, Checkpointer

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 4096), nn.BatchNorm1d(4096), nn.Linear(4096, 1024)).cuda()


def _step(model, opt):
    model(torch.randn(64, 1024, device="cuda")).square().mean().backward()
    opt.step()
    opt.zero_grad()


def test_host_cache_is_pinned(tmp_path):
    with Checkpointer(
        tmp_path, CheckpointConfig(host_cache_bytes=8 << 20, chunk_bytes=1 << 20)
    ) as ckpt:
        ckpt.save({"x": torch.ones(10, device="cuda")}, step=1).wait()
        cache = ckpt.storage._pipeline.cache
        assert cache.pinned and cache.tensor(0).is_pinned()


@pytest.mark.parametrize("cache", [1 << 30, 4 << 20], ids=["big-cache", "small-cache"])
def test_lazy_snapshot_on_cuda_is_exact(tmp_path, cache):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step(model, opt)
    config = CheckpointConfig(host_cache_bytes=cache, chunk_bytes=min(cache // 2, 64 << 20))
    with Checkpointer(tmp_path, config) as ckpt:
        reference = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        opt_ref = {
            i: {k: v.cpu().clone() for k, v in s.items()}
            for i, s in opt.state_dict()["state"].items()
        }
        handle = ckpt.save({"model": model, "opt": opt}, step=1)
        _step(model, opt)  # forward mutates BN stats, the step mutates params and moments
        _step(model, opt)
        handle.wait()
        loaded = ckpt.load()
    for k, v in reference.items():
        assert torch.equal(loaded["model"][k], v), k
    for i, s in opt_ref.items():
        for k, v in s.items():
            assert torch.equal(loaded["opt"]["state"][i][k].cpu(), v), (i, k)


def test_copy_stream_waits_for_pending_kernels(tmp_path):
    """A kernel still running on the compute stream when save() is called must finish before the
    copy reads the tensor: the captured values are the post-kernel ones."""
    x = torch.zeros(4096, 4096, device="cuda")
    a = torch.randn(4096, 4096, device="cuda")
    with Checkpointer(tmp_path, CheckpointConfig(lazy="always")) as ckpt:
        for _ in range(20):  # queue a lot of work on the compute stream
            x.add_(a @ a * 0)
        x.fill_(3.0)
        handle = ckpt.save({"x": datastates.lazy(x)}, step=1)
        handle.wait_snapshot()
        handle.wait()
        assert torch.equal(ckpt.load()["x"], torch.full((4096, 4096), 3.0))


def test_restore_in_place_on_device_and_map_location(tmp_path):
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step(model, opt)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save({"model": model, "opt": opt}, step=1).wait()
        fresh = _model()
        with torch.no_grad():
            for p in fresh.parameters():
                p.zero_()
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=0.1)
        ckpt.restore({"model": fresh, "opt": fresh_opt})
        assert all(p.is_cuda for p in fresh.parameters())
        for (k, v), (_, w) in zip(model.state_dict().items(), fresh.state_dict().items()):
            assert torch.equal(v, w), k
        loaded = ckpt.load(map_location="cuda")
        assert all(t.is_cuda for t in loaded["model"].values())


def test_eager_cuda_tensor_is_in_the_cache_when_save_returns(tmp_path):
    """No optimizer in the save: the tensor is eager, copied (after the pending kernels) before
    save() returns, so an in-place change right after save() is not in the checkpoint."""
    x = torch.zeros(4096, 4096, device="cuda")
    a = torch.randn(4096, 4096, device="cuda")
    config = CheckpointConfig(host_cache_bytes=16 << 20, chunk_bytes=4 << 20)  # x: 64 MiB
    with Checkpointer(tmp_path, config) as ckpt:
        for _ in range(10):
            x.add_(a @ a * 0)
        x.fill_(3.0)
        handle = ckpt.save({"x": x}, step=1)
        assert handle.stats.lazy_nbytes == 0
        x.fill_(4.0)
        handle.wait()
        assert torch.equal(ckpt.load()["x"], torch.full((4096, 4096), 3.0))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
@pytest.mark.parametrize("cache", [1 << 30, 8 << 20], ids=["big-cache", "small-cache"])
def test_copies_from_two_devices_each_follow_their_device(tmp_path, cache):
    """device_map="auto" style: state on cuda:0 and cuda:1. Each device's copies wait for that
    device's pending kernels and are fenced on that device before a writer reads the slot."""
    xs, mats = [], []
    for index in (0, 1):
        with torch.cuda.device(index):
            xs.append(torch.zeros(2048, 2048, device=f"cuda:{index}"))
            mats.append(torch.randn(2048, 2048, device=f"cuda:{index}"))
    config = CheckpointConfig(
        host_cache_bytes=cache, chunk_bytes=min(cache // 2, 64 << 20), lazy="always"
    )
    with Checkpointer(tmp_path, config) as ckpt:
        for index, (x, m) in enumerate(zip(xs, mats)):
            with torch.cuda.device(index):
                for _ in range(20):  # queue work on each device's compute stream
                    x.add_(m @ m * 0)
                x.fill_(float(index + 1))
        handle = ckpt.save(
            {"x0": datastates.lazy(xs[0]), "x1": datastates.lazy(xs[1]), "e1": xs[1][:16].clone()},
            step=1,
        )
        handle.wait_snapshot()
        for index, x in enumerate(xs):
            with torch.cuda.device(index):
                x.fill_(-1.0)
        handle.wait()
        loaded = ckpt.load()
    assert torch.equal(loaded["x0"], torch.full((2048, 2048), 1.0))
    assert torch.equal(loaded["x1"], torch.full((2048, 2048), 2.0))
    assert torch.equal(loaded["e1"], torch.full((16, 2048), 2.0))
    streams = ckpt.storage._pipeline.copier._streams
    assert sorted(d.index for d in streams) == [0, 1]
    assert all(s.device == d for d, s in streams.items())


def test_memory_tier_captures_cuda_in_place_into_a_pinned_mapping_and_restores_on_device(tmp_path):
    """The memory tier's saves are the same lazy capture: CUDA tensors copied on the side stream
    straight into the memory shard file's mapping, registered with CUDA (no host cache); the
    next save reuses the registered mapping; a restore reads them back onto the device in place,
    bit-exact, while the keeper process never touches CUDA; closing unregisters and unmaps."""
    import os
    import tempfile

    base = "/dev/shm" if os.path.isdir("/dev/shm") else None
    shm = tempfile.mkdtemp(prefix="ds-gpu-", dir=base)
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    _step(model, opt)
    tier = datastates.MemoryTier(root=shm, persist_every=None, log_path=str(tmp_path / "k.log"))
    config = CheckpointConfig(host_cache_bytes=64 << 20, chunk_bytes=4 << 20, memory_tier=tier)
    ckpt = Checkpointer(tmp_path / "ckpt", config)
    try:
        handles = []
        for step in (1, 2, 3):  # the third save reuses the first one's file and mapping
            reference = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
            handles.append(ckpt.save({"model": model, "opt": opt}, step=step))
            _step(model, opt)  # waits for the capture, then changes every parameter
        ckpt.wait()
        mappings = ckpt.memory.store.mappings
        assert [h._job.in_place for h in handles] == [True, True, True]
        assert not mappings.pin_failed and all(m.pinned for m in mappings._kept.values())
        assert ckpt.storage._pipeline.cache.nslots == 0  # the host cache was never needed
        report = ckpt.restore({"model": model, "opt": opt})
        assert report.tier == "memory" and report.step == 3
        for k, v in model.state_dict().items():
            assert v.is_cuda and torch.equal(v.cpu(), reference[k]), k
    finally:
        ckpt.close(stop_keeper=True)
    assert len(ckpt.memory.store.mappings) == 0

"""The lazy snapshot: values are those at save() time, whatever the loop does afterwards."""

from __future__ import annotations

import sys
import textwrap

import pytest
import torch
from torch import nn

from datastates import CheckpointConfig, Checkpointer

import zygote
from helpers import assert_same, clone_state, make_training, train_step
from testkit import SMALL


class ConvNet(nn.Module):
    """BatchNorm buffers change during forward: they must be captured eagerly."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3)
        self.bn = nn.BatchNorm2d(8)
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        return self.head(self.bn(self.conv(x)).mean(dim=(2, 3)))


@pytest.mark.parametrize(
    "cache", [1 << 30, 48 << 10], ids=["big-cache", "cache-smaller-than-state"]
)
def test_step_right_after_save_does_not_leak_into_snapshot(tmp_path, cache):
    torch.manual_seed(0)
    model = ConvNet()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    x = torch.randn(16, 3, 10, 10)

    def step():
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step()
    config = CheckpointConfig(host_cache_bytes=cache, chunk_bytes=min(cache // 2, 64 << 20))
    with Checkpointer(tmp_path, config) as ckpt:
        reference = clone_state({"model": model.state_dict(), "opt": opt.state_dict()})
        handle = ckpt.save({"model": model, "opt": opt}, step=1)
        # forward mutates BatchNorm running stats; the step mutates params and AdamW state
        step()
        step()
        handle.wait()
        assert not torch.equal(model.bn.running_mean, reference["model"]["bn.running_mean"])
        restored = ckpt.load()
    assert_same(reference["model"], dict(restored["model"]))
    assert_same(reference["opt"], restored["opt"])


def test_save_returns_before_capture_when_guarded(tmp_path):
    """With an optimizer in the state, the copy runs in the background: save() only plans."""
    model, opt, sched, loader = make_training()
    train_step(model, opt, sched, loader)
    big = nn.Linear(1024, 1024)  # 4 MiB of lazily captured parameters
    opt_big = torch.optim.SGD(big.parameters(), lr=0.1)
    config = CheckpointConfig(host_cache_bytes=64 << 10, chunk_bytes=32 << 10)
    with Checkpointer(tmp_path, config) as ckpt:
        reference = clone_state(big.state_dict())
        handle = ckpt.save({"model": big, "opt": opt_big}, step=1)
        # the cache holds 2 units of 32 KiB: the snapshot cannot be complete yet
        assert not handle.done()
        big(torch.randn(2, 1024)).sum().backward()
        opt_big.step()  # the guard makes this wait for the capture
        assert handle.snapshot_done()
        handle.wait()
        assert_same(reference, dict(ckpt.load()["model"]))


def test_unguarded_lazy_state_is_captured_before_save_returns(tmp_path):
    model = nn.Linear(256, 256)
    with Checkpointer(tmp_path, SMALL) as ckpt:
        reference = clone_state(model.state_dict())
        handle = ckpt.save({"model": model}, step=1)
        assert handle.snapshot_done()
        with torch.no_grad():
            model.weight.add_(1.0)
        handle.wait()
        assert_same(reference, dict(ckpt.load()["model"]))


RESUME_SCRIPT = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, {unit_dir!r})
    import datastates
    from helpers import make_training, train_step
    mode, root, k, n = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    model, opt, sched, loader = make_training()
    state = {{"model": model, "opt": opt, "sched": sched, "loader": loader,
              "rng": datastates.RNGState()}}
    torch.manual_seed(42)
    with datastates.Checkpointer(root) as ckpt:
        start = 0
        if mode == "resume":
            start = ckpt.restore(state).step
        for step in range(start, n):
            if mode == "first" and step == k:
                ckpt.save(state, step=k)
            if mode == "first" and step == k + 2:
                break  # the process "dies" two steps after the checkpoint
            model.train()
            torch.nn.functional.dropout(torch.ones(4), 0.5)  # consumes RNG
            train_step(model, opt, sched, loader)
    import os
    os.makedirs(root, exist_ok=True)  # a run that never saved has no checkpoint directory
    torch.save(model.state_dict(), root + "/final-" + mode + ".pt")
""")


def test_resume_in_fresh_process_is_bit_identical(tmp_path):
    import os

    script = tmp_path / "train.py"
    script.write_text(RESUME_SCRIPT.format(unit_dir=os.path.dirname(__file__)))
    root = str(tmp_path / "ckpt")
    # each run a process of its own, forked from the session's zygote (torch already imported)
    run = lambda mode: zygote.run(
        [sys.executable, str(script), mode, root, "3", "6"],
        check=True,
        capture_output=True,
        timeout=300,
    )
    run("uninterrupted")
    run("first")
    run("resume")
    straight = torch.load(root + "/final-uninterrupted.pt")
    resumed = torch.load(root + "/final-resume.pt")
    assert_same(dict(straight), dict(resumed))

"""Lazy tensors written in place before their background copy: the save fails, it never commits
values from after save().

A lazy tensor (on the bytes of a guarded optimizer's parameters or state) is copied after
``save()`` returned; only the guarded ``step()`` waits for that copy. Anything else writing it in
place meanwhile (``load_state_dict``, ``copy_``/``add_`` under ``no_grad``, a SAM-style
``first_step``) moves its version counter, and the save fails with LazyWriteError naming it.

The capture is kept pending without sleeping: a host cache of two slots, and shard-file writes
that wait for the test (``stall``), so the capture stops at its third unit and every tensor laid
out after it is not copied yet.
"""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import datastates
from datastates import CheckpointConfig, Checkpointer, CommitError
from datastates.errors import LazyWriteError
from datastates.storage.posix import ShardWriter

from helpers import assert_same, clone_state
from thread_ranks import in_thread_ranks
from testkit import TWO_UNITS

# TWO_UNITS, two cache slots of 16 KiB: the model's 130 KiB of parameters take nine units, so
# with the writes stalled the capture cannot get past the second one.

#: Laid out after the first two units (layer 7 of the model): never copied while writes stall.
PENDING = "model/7.weight"


class Stall:
    """Shard-file writes wait, while armed, until :meth:`release`."""

    def __init__(self):
        self.armed = False
        self.entered = threading.Event()  # a write is waiting: the capture is stopped
        self.released = threading.Event()
        self.waiting = threading.Semaphore(0)  # one release per write that waits

    def arm(self) -> None:
        self.entered.clear()
        self.released.clear()
        self.waiting = threading.Semaphore(0)
        self.armed = True

    def wait_slots_full(self, writes: int = 2) -> None:
        """Wait until ``writes`` writes wait: both cache slots are written, so the capture has
        copied (and checked) the first two units and copies nothing more."""
        for _ in range(writes):
            assert self.waiting.acquire(timeout=60), "the writes of both slots did not begin"

    def release(self) -> None:
        self.armed = False
        self.released.set()

    def wait_entered(self) -> None:
        assert self.entered.wait(60), "no shard-file write began"


@pytest.fixture
def stall(monkeypatch):
    gate, write = Stall(), ShardWriter.write

    def stalled(self, data, offset, padded=None):
        if gate.armed:
            gate.entered.set()
            gate.waiting.release()
            assert gate.released.wait(60), "the test never released the writes"
        return write(self, data, offset, padded)

    monkeypatch.setattr(ShardWriter, "write", stalled)
    yield gate
    gate.release()


def make(opt_class=torch.optim.Adam, **options):
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(64, 64) for _ in range(8)])
    return model, opt_class(model.parameters(), lr=0.1, **options)


def train(model, opt):
    model(torch.randn(4, 64)).square().mean().backward()
    opt.step()
    opt.zero_grad()


def reference(model, opt) -> dict:
    return clone_state({"model": model.state_dict(), "opt": opt.state_dict()})


def assert_saved(ckpt, step: int, expected: dict) -> None:
    loaded = ckpt.load(step)
    assert_same(expected["model"], dict(loaded["model"]))
    assert_same(expected["opt"], loaded["opt"])


def assert_failed_and_next_save_works(ckpt, handle, model, opt, written: list[str]) -> None:
    """``handle``'s save (step 2) failed with LazyWriteError naming ``written``; step 1 is still
    the latest and only checkpoint, and step 3 commits the state at its save()."""
    with pytest.raises(LazyWriteError) as caught:
        handle.wait()
    error = caught.value
    assert set(written) <= set(error.keys)
    message = str(error)
    keys = error.keys
    shown = keys if len(keys) <= 8 else (*keys[:8], f"and {len(keys) - 8} more")
    for text in (
        *shown,
        "'step-0000000002' was not committed",
        "datastates.eager(",
        "wait_snapshot()",
    ):
        assert text in message
    assert [info.step for info in ckpt.list()] == [1] and ckpt.latest().step == 1
    expected = reference(model, opt)
    ckpt.save({"model": model, "opt": opt}, step=3).wait()
    assert_saved(ckpt, 3, expected)


def test_load_state_dict_before_the_copy_fails_the_save(tmp_path, stall):
    model, opt = make()
    train(model, opt)
    other = {k: torch.zeros_like(v) for k, v in model.state_dict().items()}
    with Checkpointer(tmp_path, TWO_UNITS) as ckpt:
        ckpt.save({"model": model, "opt": opt}, step=1).wait()
        stall.arm()
        handle = ckpt.save({"model": model, "opt": opt}, step=2)
        stall.wait_slots_full()  # the first two units' checks are done: all six are named
        model.load_state_dict(other)  # writes every parameter in place
        stall.release()
        assert_failed_and_next_save_works(
            ckpt, handle, model, opt, [f"model/{i}.weight" for i in range(2, 8)]
        )


def test_copy_under_no_grad_fails_the_save_naming_that_tensor(tmp_path, stall):
    model, opt = make()
    train(model, opt)
    with Checkpointer(tmp_path, TWO_UNITS) as ckpt:
        ckpt.save({"model": model, "opt": opt}, step=1).wait()
        stall.arm()
        handle = ckpt.save({"model": model, "opt": opt}, step=2)
        stall.wait_entered()
        with torch.no_grad():
            model[7].weight.copy_(torch.ones(64, 64))
        stall.release()
        with pytest.raises(LazyWriteError) as caught:
            handle.wait(60)
        assert caught.value.keys == (PENDING,)
        assert_failed_and_next_save_works(ckpt, handle, model, opt, [PENDING])


class SAM(torch.optim.Optimizer):
    """Sharpness-aware minimisation as it is commonly written: ``first_step`` moves the
    parameters in place and never calls ``step()``, the method the guard hooks."""

    def __init__(self, params, rho=0.05, **options):
        super().__init__(params, dict(rho=rho, **options))
        self.base = torch.optim.SGD(self.param_groups, **options)
        self.param_groups = self.base.param_groups

    @torch.no_grad()
    def first_step(self):
        for group in self.param_groups:
            for p in group["params"]:
                e = p.grad * group["rho"] / (p.grad.norm() + 1e-12)
                p.add_(e)
                self.state[p]["e_w"] = e

    @torch.no_grad()
    def second_step(self):
        for group in self.param_groups:
            for p in group["params"]:
                p.sub_(self.state[p]["e_w"])
        self.base.step()


def test_sam_first_step_before_the_copy_fails_the_save(tmp_path, stall):
    model, opt = make(SAM)
    x = torch.randn(4, 64)

    def first_half():
        model(x).square().mean().backward()
        opt.first_step()
        opt.zero_grad()

    first_half()
    model(x).square().mean().backward()
    opt.second_step()
    opt.zero_grad()
    with Checkpointer(tmp_path, TWO_UNITS) as ckpt:
        ckpt.save({"model": model, "opt": opt}, step=1).wait()
        stall.arm()
        handle = ckpt.save({"model": model, "opt": opt}, step=2)
        stall.wait_entered()
        first_half()  # the next iteration begins: the parameters move, no step() runs
        stall.release()
        assert_failed_and_next_save_works(
            ckpt, handle, model, opt, [f"model/{i}.weight" for i in range(2, 8)]
        )


@pytest.mark.parametrize("stalled", [True, False], ids=["step-waits-for-capture", "free-running"])
def test_the_guarded_step_never_fails_a_save(tmp_path, stall, stalled):
    """save, forward, backward, step, every iteration: every checkpoint commits the state at its
    save(). Stalled: the step begins while the capture is still pending (checked), the first
    thing that may change the parameters, and its pre-hook waits for the capture."""
    model, opt = make()
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    pending_at_step, handles = [], []

    def before_step(*_):  # registered before the Checkpointer's hook, so it runs first
        if handles:
            pending_at_step.append(not handles[-1].snapshot_done())
            stall.release()

    opt.register_step_pre_hook(before_step)
    train(model, opt)
    expected = {}
    with Checkpointer(tmp_path, TWO_UNITS) as ckpt:
        for step in range(1, 7):
            expected[step] = reference(model, opt)
            if stalled:
                stall.arm()
            handles.append(ckpt.save({"model": model, "opt": opt, "sched": sched}, step=step))
            model(torch.randn(4, 64)).square().mean().backward()
            opt.step()
            opt.zero_grad()
            sched.step()
        for handle in handles:
            handle.wait()
        for step, state in expected.items():
            assert_saved(ckpt, step, state)
    if stalled:
        assert pending_at_step == [True] * 6


def test_writes_after_the_snapshot_keep_the_values_at_save(tmp_path):
    model, opt = make()
    train(model, opt)
    with Checkpointer(tmp_path, TWO_UNITS) as ckpt:
        expected = reference(model, opt)
        handle = ckpt.save({"model": model, "opt": opt}, step=1)
        handle.wait_snapshot()
        model.load_state_dict({k: torch.zeros_like(v) for k, v in model.state_dict().items()})
        with torch.no_grad():
            model[7].weight.add_(1.0)
        handle.wait()
        assert_saved(ckpt, 1, expected)


def test_eager_tensors_written_after_save_keep_the_values_at_save(tmp_path, stall):
    """Marked eager, a module is copied inside save(): writing it while the lazy part (another
    module and its optimizer) is still pending changes nothing in the checkpoint."""
    model, opt = make()
    train(model, opt)
    torch.manual_seed(1)
    clipped = nn.Linear(16, 16)
    clipped_opt = torch.optim.SGD(clipped.parameters(), lr=0.1)
    with Checkpointer(tmp_path, TWO_UNITS) as ckpt:
        expected = {**reference(model, opt), "clipped": clone_state(clipped.state_dict())}
        stall.arm()
        handle = ckpt.save(
            {"clipped": datastates.eager(clipped), "model": model, "opt": opt},
            optimizers=[clipped_opt],
            step=1,
        )
        stall.wait_entered()
        assert not handle.snapshot_done()
        with torch.no_grad():
            clipped.weight.clamp_(-0.01, 0.01)
        clipped.load_state_dict({k: torch.ones_like(v) for k, v in clipped.state_dict().items()})
        stall.release()
        handle.wait()
        assert_saved(ckpt, 1, expected)
        assert_same(expected["clipped"], dict(ckpt.load(1)["clipped"]))


def test_a_lazy_inference_tensor_is_saved(tmp_path):
    """An inference tensor keeps no version counter: nothing is recorded, the save commits."""
    with torch.inference_mode():
        frozen = torch.arange(8.0)
    with Checkpointer(tmp_path, CheckpointConfig(lazy="always")) as ckpt:
        handle = ckpt.save({"frozen": datastates.lazy(frozen)}, step=1)
        handle.wait_snapshot()
        handle.wait()
        assert torch.equal(ckpt.load(1)["frozen"], torch.arange(8.0))


def test_a_write_on_one_rank_fails_the_save_on_every_rank(tmp_path, stall):
    """Rank 1's LazyWriteError reaches rank 0 through its report: both raise CommitError."""
    stall.arm()

    def action(ckpt, rank):
        model, opt = make()
        train(model, opt)
        handle = ckpt.save({"model": model, "opt": opt}, step=1)
        if rank == 1:
            stall.wait_entered()
            with torch.no_grad():
                model[7].weight.add_(1.0)
            stall.release()
        try:
            handle.wait(60)
        except CommitError as exc:
            return exc

    out = in_thread_ranks(str(tmp_path), 2, action, config=TWO_UNITS)
    for rank in (0, 1):
        error = out[rank]
        assert isinstance(error, CommitError), error
        assert set(error.causes) == {1} and PENDING in error.causes[1]
        assert "LazyWriteError" in error.causes[1]
    assert isinstance(out[1].__cause__, LazyWriteError) and out[1].__cause__.keys == (PENDING,)
    assert not (tmp_path / "step-0000000001").exists()


def test_a_checkpointer_closed_while_a_step_waits_for_another_leaves_the_step_alone(
    tmp_path, stall
):
    """Two Checkpointers guard one optimizer (the DeepSpeed engine's path layer keeps one per
    checkpoint directory and closes the old ones from a thread of its own). One is closed while
    ``step()``, on another thread, waits in its hooks for the other's snapshot: the step runs
    on (removing a torch hook there made it raise "OrderedDict mutated during iteration")."""
    model, opt = make()
    train(model, opt)
    entered = threading.Event()
    opt.register_step_pre_hook(lambda *_: entered.set())  # runs before the guards' hook
    with Checkpointer(tmp_path / "a", TWO_UNITS) as waited:
        waited.save({"model": model, "opt": opt}, step=1).wait()  # its guard comes first
        old = Checkpointer(tmp_path / "b", TWO_UNITS)
        old.save({"model": model, "opt": opt}, step=1).wait()
        expected = reference(model, opt)
        stall.arm()
        handle = waited.save({"model": model, "opt": opt}, step=2)
        stall.wait_entered()
        failures = []

        def step():
            try:
                train(model, opt)
            except BaseException as exc:  # noqa: BLE001 - what the step raised is the result
                failures.append(exc)

        stepping = threading.Thread(target=step)
        stepping.start()
        assert entered.wait(60)  # the step is inside its hooks: the guard's waits for the copy
        old.close()
        stall.release()
        stepping.join(60)
        assert not stepping.is_alive() and failures == []
        handle.wait(60)
        assert_saved(waited, 2, expected)

"""The capture rule: lazy only on the bytes of an optimizer that is part of the save.

Every end-to-end case mutates the live state right after ``save()`` returned and asserts that the
checkpoint holds the value at ``save()`` time. The host cache is far smaller than the state, so a
tensor wrongly captured lazily would still be waiting for a slot when it is mutated.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import datastates
from datastates import Checkpointer, ProviderRegistry
from datastates.save import capture
from datastates.providers.tree import flatten

from helpers import assert_same, clone_state
from testkit import SMALL


def _big():
    """A module of 4 MiB of parameters with its optimizer: keeps the capture busy."""
    big = nn.Module()
    big.w = nn.Parameter(torch.zeros(1 << 20))
    return big, torch.optim.SGD(big.parameters(), lr=0.1)


def _decisions(state, optimizers=(), others=()) -> dict[str, bool]:
    """key -> lazy, as the rule decides it for ``state``."""
    flat = flatten(state, ProviderRegistry.default())
    in_save = [capture.torch_optimizer(o) for o in [*flat.optimizers, *optimizers]]
    capture.decide(
        flat.items,
        capture.LazyRule(
            [o for o in in_save if o is not None], [capture.torch_optimizer(o) for o in others]
        ),
    )
    items = flat.items
    return {items.keys[i]: items.lazy[i] for i in items.tensor_indexes()}


def _step(model, opt):
    model(torch.randn(2, model.in_features)).square().sum().backward()
    opt.step()
    opt.zero_grad()


# ------------------------------------------------------------------ the cases, end to end
def test_ema_module_next_to_a_guarded_optimizer_is_eager(tmp_path):
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    big, _ = _big()
    ema = nn.Linear(4, 4)
    with torch.no_grad():
        ema.weight.fill_(1.0)
    with Checkpointer(tmp_path, SMALL) as ck:
        h = ck.save({"opt": opt, "model": model, "big": big, "ema": ema}, step=1)
        with torch.no_grad():
            ema.weight.fill_(42.0)  # EMA update right after save()
        h.wait()
        assert torch.equal(ck.load(step=1)["ema"]["weight"], torch.ones(4, 4))
        # only the parameters of the saved optimizer were lazy
        assert h.stats.lazy_nbytes == sum(p.numel() * 4 for p in model.parameters())


def test_module_saved_alone_after_an_earlier_guard_is_eager(tmp_path):
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    big, big_opt = _big()
    with Checkpointer(tmp_path, SMALL) as ck:
        ck.save({"model": model, "opt": opt}, step=1).wait()  # guards opt
        reference = clone_state(big.state_dict())
        h = ck.save({"big": big}, step=2)
        with torch.no_grad():
            big.w.add_(1.0)
        h.wait()
        assert h.stats.lazy_nbytes == 0
        assert_same(reference, dict(ck.load(step=2)["big"]))


def test_embedding_with_max_norm_not_owned_by_the_optimizer_is_eager(tmp_path):
    torch.manual_seed(0)
    emb = nn.Embedding(64, 256, max_norm=1.0)
    with torch.no_grad():
        emb.weight.mul_(10.0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    big, _ = _big()
    with Checkpointer(tmp_path, SMALL) as ck:
        reference = emb.weight.detach().clone()
        h = ck.save({"model": model, "opt": opt, "big": big, "emb": emb}, step=1)
        emb(torch.arange(64))  # forward renormalizes the rows in place
        assert not torch.equal(emb.weight, reference)
        h.wait()
        assert torch.equal(ck.load()["emb"]["weight"], reference)


def test_tensor_lr_filled_in_place_by_a_scheduler_is_eager(tmp_path):
    model = nn.Linear(4, 4)
    opt = torch.optim.Adam(model.parameters(), lr=torch.tensor(0.01))
    big, _ = _big()
    _step(model, opt)
    with Checkpointer(tmp_path, SMALL) as ck:
        h = ck.save({"big": big, "opt": opt}, step=1)
        opt.param_groups[0]["lr"].fill_(0.5)  # a scheduler's in-place update
        h.wait()
        lr = ck.load()["opt"]["param_groups"][0]["lr"]
        assert torch.equal(lr, torch.tensor(0.01))


def test_second_optimizer_over_the_same_parameters_not_in_the_save(tmp_path):
    model = nn.Linear(512, 512)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD(model.parameters(), lr=1.0)
    with Checkpointer(tmp_path, SMALL) as ck:
        ck.guard(other)  # every optimizer stepping these parameters must be known
        reference = clone_state(model.state_dict())
        h = ck.save({"model": model, "opt": opt}, step=1)
        assert h.stats.lazy_nbytes == 0  # the other optimizer writes them: not safe
        _step(model, other)
        h.wait()
        assert_same(reference, dict(ck.load()["model"]))
    assert _decisions({"model": model, "opt": opt}, others=[other]) == {
        "model/weight": False,
        "model/bias": False,
    }


def test_weight_clipping_of_a_module_no_saved_optimizer_updates(tmp_path):
    critic = nn.Linear(512, 512)
    with torch.no_grad():
        critic.weight.fill_(3.0)
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Checkpointer(tmp_path, SMALL) as ck:
        h = ck.save({"model": model, "opt": opt, "critic": critic}, step=1)
        with torch.no_grad():
            for p in critic.parameters():
                p.clamp_(-0.01, 0.01)
        h.wait()
        assert torch.equal(ck.load()["critic"]["weight"], torch.full((512, 512), 3.0))


def test_buffers_of_a_guarded_model_are_eager(tmp_path):
    model = nn.Sequential(nn.Linear(64, 64), nn.BatchNorm1d(64))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Checkpointer(tmp_path, SMALL) as ck:
        reference = clone_state(model.state_dict())
        h = ck.save({"model": model, "opt": opt}, step=1)
        model(torch.randn(8, 64))  # forward changes the running statistics
        h.wait()
        assert_same(reference, dict(ck.load()["model"]))
    lazy = _decisions({"model": model, "opt": opt})
    assert lazy["model/0.weight"] and lazy["model/1.weight"]
    assert not lazy["model/1.running_mean"] and not lazy["model/1.num_batches_tracked"]


# ------------------------------------------------------------------ lazy, whichever way reached
def test_state_dicts_of_a_guarded_model_are_lazy_and_exact(tmp_path):
    """A plain state dict (what frameworks pass) with the optimizer named in save()."""
    model = nn.Linear(512, 512)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    _step(model, opt)
    state = {"model": model.state_dict(), "opt": opt.state_dict()}
    with Checkpointer(tmp_path, SMALL) as ck:
        reference = clone_state(state)
        h = ck.save(state, step=1, optimizers=[opt])
        tensors = sum(t.numel() * t.element_size() for t in model.parameters())
        tensors += sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values())
        assert h.stats.lazy_nbytes == tensors  # no copy inside save()
        _step(model, opt)  # waits for the capture
        h.wait()
        assert_same(reference, ck.load())


def test_state_dict_without_its_optimizer_is_eager(tmp_path):
    model = nn.Linear(512, 512)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Checkpointer(tmp_path, SMALL) as ck:
        ck.guard(opt)  # guarded, but not part of this save
        reference = clone_state(model.state_dict())
        h = ck.save({"model": model.state_dict()}, step=1)
        assert h.stats.lazy_nbytes == 0
        with torch.no_grad():
            model.weight.add_(1.0)
        h.wait()
        assert_same(reference, ck.load()["model"])


def test_flat_buffer_views_are_decided_by_bytes():
    """FSDP/ZeRO style: parameters are views of one flat buffer; the optimizer may hold the
    whole buffer, or only a range of it."""
    flat = nn.Parameter(torch.zeros(100))
    views = {"a": flat.detach()[:40].view(4, 10), "b": flat.detach()[40:100]}
    whole = torch.optim.SGD([flat], lr=0.1)
    assert _decisions({"m": views, "opt": whole}) == {"m/a": True, "m/b": True}
    only_a = torch.optim.SGD([nn.Parameter(flat.detach()[:40])], lr=0.1)  # the first 40 only
    assert _decisions({"m": views}, optimizers=[only_a]) == {"m/a": True, "m/b": False}
    straddle = flat.detach()[30:50]
    assert _decisions({"x": straddle}, optimizers=[only_a]) == {"x": False}


def test_wrapper_optimizers_are_unwrapped_and_guarded(tmp_path):
    class Wrapper(torch.optim.Optimizer):  # like accelerate's: no Optimizer.__init__
        def __init__(self, optimizer):
            self.optimizer = optimizer

        @property
        def param_groups(self):
            return self.optimizer.param_groups

        @property
        def state(self):
            return self.optimizer.state

        def state_dict(self):
            return self.optimizer.state_dict()

        def load_state_dict(self, sd):
            self.optimizer.load_state_dict(sd)

        def step(self, closure=None):
            return self.optimizer.step(closure)

    model = nn.Linear(512, 512)
    inner = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = Wrapper(Wrapper(inner))
    assert capture.torch_optimizer(wrapped) is inner
    assert datastates.torch_optimizer(wrapped) is inner and datastates.torch_optimizer(7) is None
    with Checkpointer(tmp_path, SMALL) as ck:
        reference = clone_state(model.state_dict())
        h = ck.save({"model": model, "opt": wrapped}, step=1)
        assert h.stats.lazy_nbytes == sum(p.numel() * 4 for p in model.parameters())
        model(torch.randn(2, 512)).sum().backward()
        wrapped.step()  # the hook on the inner optimizer waits for the capture
        h.wait()
        assert_same(reference, dict(ck.load()["model"]))
        with pytest.raises(TypeError, match="not a torch optimizer"):
            ck.guard(object())


def test_mark_lazy_marks_exactly_the_tensors_inside_the_given_bytes():
    flat = torch.zeros(8)
    inside, outside = flat[2:6], torch.zeros(3)
    state = {"a": inside, "b": [outside, (flat[7:],)], "c": 3}
    marked = datastates.mark_lazy(state, [flat[:6]])
    assert isinstance(marked["a"], datastates.Capture) and marked["a"].value is inside
    assert marked["b"][0] is outside and marked["b"][1][0] is state["b"][1][0]  # left to the rule
    assert marked["c"] == 3 and type(marked["b"][1]) is tuple
    assert state["a"] is inside  # the given state is not changed


ACCELERATE = """
import sys, torch
from torch import nn
import accelerate, datastates
acc = accelerate.Accelerator(cpu=True)
model = nn.Linear(512, 512)
opt = acc.prepare(torch.optim.SGD(model.parameters(), lr=0.1))
assert datastates.torch_optimizer(opt) is opt.optimizer
ref = {k: v.clone() for k, v in model.state_dict().items()}
with datastates.Checkpointer(sys.argv[1], datastates.CheckpointConfig(
        host_cache_bytes=64 << 10, chunk_bytes=16 << 10)) as ck:
    h = ck.save({"model": model.state_dict(), "opt": opt}, step=1)
    assert h.stats.lazy_nbytes == (512 * 512 + 512) * 4, h.stats.lazy_nbytes
    model(torch.randn(2, 512)).sum().backward()
    opt.step()
    h.wait()
    loaded = ck.load()["model"]
    assert all(torch.equal(loaded[k], v) for k, v in ref.items())
"""


def test_accelerate_optimizer_is_unwrapped(tmp_path):
    """accelerate's AcceleratedOptimizer (own process: accelerate's state is process-wide)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("accelerate")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    subprocess.run(
        [sys.executable, "-c", ACCELERATE, str(tmp_path)], check=True, env=env, timeout=300
    )


def test_explicit_markers_override_the_rule(tmp_path):
    model = nn.Linear(4, 4)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loose = torch.zeros(8)
    lazy = _decisions(
        {"model": datastates.eager(model), "opt": opt, "loose": datastates.lazy(loose)}
    )
    assert lazy == {"model/weight": False, "model/bias": False, "loose": True}
    # one view under two keys: eager wins
    assert _decisions({"a": model.weight, "b": datastates.eager(model.weight), "opt": opt}) == {
        "a": False
    }


# ------------------------------------------------------------------ eager straight into the cache
def test_eager_tensor_larger_than_the_cache_streams(tmp_path):
    t = torch.arange(1 << 20, dtype=torch.float32)  # 4 MiB through a 64 KiB cache
    reference = t.clone()
    with Checkpointer(tmp_path, SMALL) as ck:
        h = ck.save({"t": t, "x": {"n": 3}}, step=1)
        t.add_(1)  # save() returned: every byte is in the cache or written
        h.wait()
        loaded = ck.load()
    assert torch.equal(loaded["t"], reference) and loaded["x"] == {"n": 3}


def test_eager_save_behind_a_lazy_save_in_flight(tmp_path):
    big, big_opt = _big()
    ema = nn.Linear(256, 256)
    with Checkpointer(tmp_path, SMALL) as ck:
        big_ref, ema_ref = clone_state(big.state_dict()), clone_state(ema.state_dict())
        first = ck.save({"big": big, "opt": big_opt}, step=1)  # lazy, still in flight
        second = ck.save({"ema": ema}, step=2)  # eager: waits for its own bytes only
        with torch.no_grad():
            ema.weight.fill_(42.0)
        big.w.grad = torch.ones_like(big.w)
        big_opt.step()  # waits for the first snapshot
        second.wait()
        first.wait()
        assert_same(ema_ref, dict(ck.load(step=2)["ema"]))
        assert_same(big_ref, dict(ck.load(step=1)["big"]))


def test_eager_copy_makes_no_clone(tmp_path, monkeypatch):
    """Eager tensors are not cloned in save(): the only copy is into the host cache."""
    calls = []
    original = torch.Tensor.clone
    monkeypatch.setattr(
        torch.Tensor, "clone", lambda self, *a, **k: calls.append(1) or original(self, *a, **k)
    )
    t = torch.ones(4096)
    with Checkpointer(tmp_path, SMALL) as ck:
        h = ck.save({"t": t}, step=1)
        assert calls == []
        t.zero_()
        h.wait()
        monkeypatch.undo()
        assert torch.equal(ck.load()["t"], torch.ones(4096))


# ------------------------------------------------------------------ byte ranges
def test_byte_ranges_cover_and_touch():
    base = torch.zeros(100)
    ranges = capture.ByteRanges([base[10:20], base[20:30], base[50:60]])
    assert ranges.covers(base[10:30]) and ranges.covers(base[12:13])
    assert not ranges.covers(base[25:55]) and ranges.touches(base[25:55])
    assert not ranges.touches(base[30:50]) and not ranges.touches(torch.zeros(10))
    assert ranges.covers(base[10:30].view(4, 5).t())  # strided view of covered bytes
    assert not ranges.covers(torch.empty(0)) and not ranges.touches(base[40:40])
    assert capture.byte_range(torch.empty(3, device="meta")) is None

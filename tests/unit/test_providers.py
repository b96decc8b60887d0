"""Built-in and user providers pass the shipped conformance suite; registries are explicit."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import datastates
from datastates import ProviderRegistry, StateProvider
from datastates.testing import ProviderConformance


class Counter:
    """A user class with no state_dict: it needs its own provider."""

    def __init__(self, seed):
        self.count = seed
        self.history = torch.full((4,), float(seed))


class CounterProvider(StateProvider):
    name = "tests.Counter"

    def can_handle(self, obj):
        return isinstance(obj, Counter)

    def state(self, obj):
        return {"count": obj.count, "history": obj.history}

    def load(self, obj, state):
        obj.count = state["count"]
        obj.history.copy_(state["history"])


class TestCounterProvider(ProviderConformance):
    def make_provider(self):
        return CounterProvider()

    def make_object(self, seed):
        return Counter(seed)

    def mutate(self, obj):
        obj.count += 1
        obj.history.add_(1)
        return True

    def assert_same_state(self, a, b):
        assert a.count == b.count and torch.equal(a.history, b.history)


class TestModuleProvider(ProviderConformance):
    def make_provider(self):
        return datastates.ModuleProvider()

    def make_object(self, seed):
        torch.manual_seed(seed)
        return nn.Sequential(nn.Linear(4, 3), nn.BatchNorm1d(3))

    def mutate(self, obj):
        with torch.no_grad():
            obj[0].weight.add_(1)
        obj(torch.randn(5, 4))
        return True

    def assert_same_state(self, a, b):
        for (ka, va), (kb, vb) in zip(a.state_dict().items(), b.state_dict().items()):
            assert ka == kb and torch.equal(va, vb)


class TestOptimizerProvider(ProviderConformance):
    def make_provider(self):
        return datastates.OptimizerProvider()

    def _model(self, seed):
        torch.manual_seed(seed)
        return nn.Linear(4, 3)

    def make_object(self, seed):
        model = self._model(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2 * (seed + 1))
        self._step(model, opt)
        return opt

    def make_mismatched_object(self):
        model = self._model(0)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
        self._step(model, opt)
        return opt

    @staticmethod
    def _step(model, opt):
        model(torch.randn(2, 4, generator=torch.Generator().manual_seed(0))).sum().backward()
        opt.step()
        opt.zero_grad()

    def mutate(self, obj):
        for group in obj.param_groups:
            group["lr"] *= 2
        for state in obj.state.values():
            state["exp_avg"].add_(1)
        return True

    def assert_same_state(self, a, b):
        sa, sb = a.state_dict(), b.state_dict()
        assert type(a) is type(b) and sa["param_groups"] == sb["param_groups"]
        assert list(sa["state"]) == list(sb["state"])
        for i in sa["state"]:
            assert list(sa["state"][i]) == list(sb["state"][i])
            for k, v in sa["state"][i].items():
                assert torch.equal(v, sb["state"][i][k]), (i, k)


def test_registry_is_explicit_and_user_providers_win():
    first, second = ProviderRegistry.default(), ProviderRegistry.default()
    first.register(CounterProvider())
    assert first.find(Counter(1)).name == "tests.Counter"
    assert second.find(Counter(1)) is None  # no global side effect
    with pytest.raises(ValueError):
        first.register(CounterProvider())


def test_unregistered_provider_on_load_is_a_clear_error(tmp_path):
    registry = ProviderRegistry.default().register(CounterProvider())
    with datastates.Checkpointer(tmp_path, registry=registry) as ckpt:
        ckpt.save({"c": Counter(3)}, step=1).wait()
    with datastates.Checkpointer(tmp_path) as ckpt:
        with pytest.raises(datastates.CorruptCheckpointError, match="tests.Counter"):
            ckpt.load()


def test_capture_markers_override_policy(tmp_path):
    t = torch.zeros(1000)
    with datastates.Checkpointer(tmp_path) as ckpt:
        h = ckpt.save({"t": datastates.eager(t)}, step=1)
        t.add_(1)  # eager: captured inside save(), so this change is not in the checkpoint
        h.wait()
        assert torch.equal(ckpt.load()["t"], torch.zeros(1000))


def test_a_provider_whose_capture_is_none_saves_its_tensors_eagerly(tmp_path):
    """``capture = None`` (outside "auto"/"lazy"/"eager"): its tensors are still saved, captured
    eagerly, and restored bit-exact."""

    class NoPolicy(CounterProvider):
        name = "tests.NoPolicy"
        capture = None

    registry = ProviderRegistry.default().register(NoPolicy())
    counter = Counter(5)
    with datastates.Checkpointer(tmp_path, registry=registry) as ckpt:
        h = ckpt.save({"c": counter, "t": torch.arange(3.0)}, step=1)
        counter.history.add_(1)  # eager: already captured when save() returned
        h.wait()
        live = {"c": Counter(0), "t": torch.zeros(3)}
        ckpt.restore(live)
    assert live["c"].count == 5 and torch.equal(live["c"].history, torch.full((4,), 5.0))
    assert torch.equal(live["t"], torch.arange(3.0))

"""A shipped conformance suite for state providers.

A new provider proves itself with a few lines::

    from datastates.testing import ProviderConformance

    class TestMyProvider(ProviderConformance):
        def make_provider(self):  return MyProvider()
        def make_object(self, seed): return MyThing(seed)      # distinct state per seed
        def assert_same_state(self, a, b): assert a.value == b.value

The suite saves through a real Checkpointer into pytest's ``tmp_path`` and checks: the provider
handles its objects and is found through a registry; an in-place restore into an object built
from another seed gives back the saved state; the snapshot is the state at save() time even when
the object changes right after; a fresh load returns ``rebuild()`` of the saved state.
"""
from __future__ import annotations

from typing import Any

from .checkpointer import Checkpointer
from .config import CheckpointConfig
from .providers import ProviderRegistry, StateProvider


class ProviderConformance:
    """Mixin for pytest test classes. Override the three ``make_``/``assert_`` methods; override
    ``mutate`` if changing the object in place is possible (default: no mutation check)."""

    def make_provider(self) -> StateProvider:
        raise NotImplementedError

    def make_object(self, seed: int) -> Any:
        raise NotImplementedError

    def assert_same_state(self, a: Any, b: Any) -> None:
        raise NotImplementedError

    def mutate(self, obj: Any) -> bool:
        """Change ``obj`` in place; return False if the object cannot be mutated."""
        return False

    def _registry(self) -> ProviderRegistry:
        provider = self.make_provider()
        others = [p for p in ProviderRegistry.default() if p.name != provider.name]
        return ProviderRegistry([provider, *others])

    def _checkpointer(self, tmp_path) -> Checkpointer:
        registry = self._registry()
        return Checkpointer(tmp_path / "ckpt", CheckpointConfig(host_cache_bytes=1 << 20,
                                                                chunk_bytes=1 << 16),
                            registry=registry)

    def test_name_and_can_handle(self):
        provider = self.make_provider()
        assert isinstance(provider, StateProvider)
        assert provider.name, "a provider needs a stable, non-empty name"
        assert provider.capture in ("auto", "lazy", "eager")
        assert provider.can_handle(self.make_object(0))
        assert not provider.can_handle(object())

    def test_found_through_registry(self):
        found = self._registry().find(self.make_object(0))
        assert found is not None and found.name == self.make_provider().name

    def test_round_trip_in_place(self, tmp_path):
        saved, target = self.make_object(1), self.make_object(2)
        with self._checkpointer(tmp_path) as ckpt:
            ckpt.save({"obj": saved}, step=1).wait()
            ckpt.restore({"obj": target})
        self.assert_same_state(saved, target)

    def test_snapshot_is_taken_at_save_time(self, tmp_path):
        obj, reference = self.make_object(3), self.make_object(3)
        with self._checkpointer(tmp_path) as ckpt:
            handle = ckpt.save({"obj": obj}, step=1)
            handle.wait_snapshot()
            self.mutate(obj)
            handle.wait()
            target = self.make_object(4)
            ckpt.restore({"obj": target})
        self.assert_same_state(reference, target)

    def test_fresh_load_is_rebuild_of_state(self, tmp_path):
        provider, obj = self.make_provider(), self.make_object(5)
        with self._checkpointer(tmp_path) as ckpt:
            ckpt.save({"obj": obj}, step=1).wait()
            loaded = ckpt.load()["obj"]
        target = self.make_object(6)
        provider.load(target, loaded)
        self.assert_same_state(obj, target)

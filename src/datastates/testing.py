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
the object changes right after; a fresh load returns ``rebuild()`` of the saved state; ``check``
accepts the state of another object of the same kind; ``validate`` and ``validate_values`` accept
the provider's own state; if ``make_mismatched_object`` gives an object the provider must refuse,
a strict restore into it raises ``StateMismatchError`` naming its key and changes nothing, neither
that object nor anything else in the restored state; and if ``make_forged_state`` gives a state
the provider must refuse as damaged, a checkpoint holding it under the provider's name makes
``restore()`` and ``load()`` raise ``CorruptCheckpointError`` naming its key, with nothing changed.
"""
from __future__ import annotations

from typing import Any

import torch

from .checkpointer import Checkpointer
from .config import CheckpointConfig
from .errors import CorruptCheckpointError, StateMismatchError
from .providers import ProviderRegistry, StateProvider


class _Forged:
    """Stands in the saved state for the object whose state is forged."""


class _Impostor(StateProvider):
    """Saves a given state under another provider's name: how a forged checkpoint is made with
    the library's own writer (its checksums are then all valid)."""

    def __init__(self, name: str, state: Any):
        self.name, self._state = name, state

    def can_handle(self, obj: Any) -> bool:
        return isinstance(obj, _Forged)

    def state(self, obj: Any) -> Any:
        return self._state

    def load(self, obj: Any, state: Any) -> None:
        raise AssertionError("an impostor only saves")


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

    def make_mismatched_object(self) -> Any:
        """An object this provider handles but whose ``check`` must refuse the state of
        ``make_object(seed)`` (another class, another structure). Built the same way on every
        call. None (the default) skips the mismatch test."""
        return None

    def make_forged_state(self) -> Any:
        """A state shaped like what ``state()`` returns, but one ``validate`` or
        ``validate_values`` must refuse (a field out of range, a wrong shape): what a damaged
        or forged checkpoint holds. None (the default) skips the forged-state test."""
        return None

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

    def test_check_accepts_an_object_of_the_same_kind(self):
        provider = self.make_provider()
        provider.check(self.make_object(8), provider.state(self.make_object(7)), "obj")

    def test_validate_accepts_its_own_state(self):
        provider = self.make_provider()
        provider.validate(provider.state(self.make_object(11)), "obj")
        provider.validate_values(provider.state(self.make_object(12)), "obj")

    def test_forged_state_is_refused_before_anything_changes(self, tmp_path):
        import pytest
        forged = self.make_forged_state()
        if forged is None:
            pytest.skip("make_forged_state() not given")
        impostor = _Impostor(self.make_provider().name, forged)
        config = CheckpointConfig(host_cache_bytes=1 << 20, chunk_bytes=1 << 16)
        with Checkpointer(tmp_path / "ckpt", config, registry=ProviderRegistry([impostor])) as w:
            w.save({"tensor": torch.arange(16.0), "value": 1, "obj": _Forged()}, step=1).wait()
        target, reference = self.make_object(10), self.make_object(10)
        other = torch.zeros(16)
        live = {"tensor": other, "value": 0, "obj": target}
        with self._checkpointer(tmp_path) as ckpt:
            for strict in (True, False):
                with pytest.raises(CorruptCheckpointError, match="obj"):
                    ckpt.restore(live, strict=strict)
            with pytest.raises(CorruptCheckpointError, match="obj"):
                ckpt.load()
        assert torch.equal(other, torch.zeros(16)) and live["value"] == 0
        self.assert_same_state(reference, target)

    def test_strict_restore_into_a_mismatch_changes_nothing(self, tmp_path):
        import pytest
        if self.make_mismatched_object() is None:
            pytest.skip("make_mismatched_object() not given")
        target, reference = self.make_mismatched_object(), self.make_mismatched_object()
        other = torch.zeros(16)
        live = {"tensor": other, "value": 0, "obj": target}
        with self._checkpointer(tmp_path) as ckpt:
            ckpt.save({"tensor": torch.arange(16.0), "value": 1, "obj": self.make_object(9)},
                      step=1).wait()
            with pytest.raises(StateMismatchError, match="obj"):
                ckpt.restore(live)
        assert torch.equal(other, torch.zeros(16)) and live["value"] == 0
        self.assert_same_state(reference, target)

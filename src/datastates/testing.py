"""Shipped conformance suites: for state providers (:class:`ProviderConformance`) and for
checkpoint stores with their publisher (:class:`StoreConformance`); and the resume self-test of
a user's own training loop, :func:`check_resume` (docs/resume-check.md; it lives in
``datastates.tools.resumecheck``).

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
from .tools.resumecheck import ResumeReport, Run, check_resume


__all__ = ["ProviderConformance", "ResumeReport", "Run", "StoreConformance", "check_resume"]


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
        return Checkpointer(
            tmp_path / "ckpt",
            CheckpointConfig(host_cache_bytes=1 << 20, chunk_bytes=1 << 16),
            registry=registry,
        )

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
            ckpt.save(
                {"tensor": torch.arange(16.0), "value": 1, "obj": self.make_object(9)}, step=1
            ).wait()
            with pytest.raises(StateMismatchError, match="obj"):
                ckpt.restore(live)
        assert torch.equal(other, torch.zeros(16)) and live["value"] == 0
        self.assert_same_state(reference, target)


class StoreConformance:
    """Mixin for pytest test classes: what every checkpoint store and its publisher
    (``datastates.commit.publish``) must do. Override :meth:`make_root`; a store proves itself with::

        class TestMyStore(StoreConformance):
            def make_root(self, tmp_path):
                return "myfs://bucket/run", {"endpoint_url": ...}

    The suite checks, through the store and its publisher and through a real Checkpointer:
    whole-file writes read back bit-exact and report the stamp the listing reports;
    ``write_new`` refuses an existing file and leaves it unchanged; a save restores bit-exact;
    the temporary location of a save is never listed, and is removed by the stale cleanup once
    older than its age limit, kept before; a committed name is refused without ``overwrite``
    (the old checkpoint intact) and replaced with it (no trace of the old data left); a
    deletion removes a checkpoint and refuses, removing nothing, anything that is no
    checkpoint; a damaged checkpoint is replaced by a new save of its name; a split
    manifest's parts go with their checkpoint (saved, overwritten, damaged, deleted).
    """

    def make_root(self, tmp_path) -> tuple[str, dict | None]:
        """A checkpoint root no one else uses (it need not exist yet) and the
        ``storage_options`` to open it with (None for a local path)."""
        raise NotImplementedError

    def _open(self, tmp_path):
        from .commit.publish import publisher_for
        from .storage import normalize, open_store

        root, options = self.make_root(tmp_path)
        root = normalize(root)
        store = open_store(root, options)
        return root, options, store, publisher_for(store)

    def _checkpointer(self, root: str, options, **fields) -> Checkpointer:
        config = CheckpointConfig(host_cache_bytes=1 << 20, chunk_bytes=1 << 16, **fields)
        return Checkpointer(root, config, storage_options=options)

    def test_whole_files_round_trip_with_their_stamp(self, tmp_path):
        root, _, store, publisher = self._open(tmp_path)
        store.makedirs(store.join(root, "a"), True)
        data = bytes(range(256)) * 5
        stamp = store.write_atomic(store.join(root, "a", "f.bin"), data, True)
        assert store.read_bytes(store.join(root, "a", "f.bin")) == data
        assert store.isfile(store.join(root, "a", "f.bin"))
        stamps = store.file_stamps(root, "f.bin")
        assert list(stamps) == ["a"] and stamps["a"] in (stamp, None)
        assert store.listdir(store.join(root, "a")) == ["f.bin"]
        store.remove(store.join(root, "a", "f.bin"))
        assert not store.isfile(store.join(root, "a", "f.bin"))
        store.remove(store.join(root, "a", "f.bin"))  # a missing file is not an error

    def test_write_new_refuses_an_existing_file(self, tmp_path):
        import pytest

        root, _, store, _ = self._open(tmp_path)
        store.makedirs(root, True)
        path = store.join(root, "once.bin")
        store.write_new(path, b"first", True)
        with pytest.raises(FileExistsError):
            store.write_new(path, b"second", True)
        assert store.read_bytes(path) == b"first"

    def test_save_restores_bit_exact(self, tmp_path):
        root, options, _, _ = self._open(tmp_path)
        saved = {
            "w": torch.randn(64, 33, generator=torch.Generator().manual_seed(1)),
            "i": torch.arange(100, dtype=torch.int64),
            "value": 7,
        }
        with self._checkpointer(root, options) as ckpt:
            info = ckpt.save(saved, step=3).wait()
            live = {"w": torch.zeros(64, 33), "i": torch.zeros(100, dtype=torch.int64), "value": 0}
            ckpt.restore(live)
            assert [(i.name, i.seq) for i in ckpt.list()] == [(info.name, 1)]
        assert torch.equal(live["w"].view(torch.int32), saved["w"].view(torch.int32))
        assert torch.equal(live["i"], saved["i"]) and live["value"] == 7

    def test_a_temporary_location_is_never_listed_and_ages_out(self, tmp_path):
        from .commit.catalog import Catalog

        root, _, store, publisher = self._open(tmp_path)
        tmp = publisher.tmp_location(root, "step-0000000001", "a-run-that-died", 0)
        store.makedirs(root, True)
        store.makedirs(tmp, False)
        store.write_atomic(store.join(tmp, "rank-00000.dsf"), b"partial", True)
        assert Catalog(root, store).scan() == []
        assert publisher.clean_stale(root, 3600.0) == []  # young, owner unknown: kept
        assert store.read_bytes(store.join(tmp, "rank-00000.dsf")) == b"partial"
        assert publisher.clean_stale(root, 1e-9) != []
        assert not store.isfile(store.join(tmp, "rank-00000.dsf"))
        assert Catalog(root, store).scan() == []

    def test_a_committed_name_is_replaced_only_with_overwrite(self, tmp_path):
        import pytest
        from .errors import CheckpointExistsError

        root, options, store, _ = self._open(tmp_path)
        with self._checkpointer(root, options) as ckpt:
            ckpt.save({"x": torch.full((8,), 1.0)}, tag="best").wait()
            handle = None
            with pytest.raises(CheckpointExistsError):
                handle = ckpt.save({"x": torch.full((8,), 2.0)}, tag="best")
                handle.wait()
            assert torch.equal(ckpt.load(tag="best")["x"], torch.full((8,), 1.0))
            ckpt.save({"x": torch.full((8,), 3.0)}, tag="best", overwrite=True).wait()
            assert torch.equal(ckpt.load(tag="best")["x"], torch.full((8,), 3.0))
            assert [i.name for i in ckpt.list()] == ["best"]
        best = store.join(root, "best")
        shards = [n for n in _files_under(store, best) if n.endswith(".dsf")]
        assert len(shards) == 1, f"the replaced checkpoint left data behind: {shards}"

    def test_delete_removes_checkpoints_only(self, tmp_path):
        import pytest
        from .errors import CheckpointNotFoundError

        root, options, store, publisher = self._open(tmp_path)
        with self._checkpointer(root, options) as ckpt:
            ckpt.save({"x": torch.ones(4)}, step=1).wait()
            ckpt.save({"x": torch.ones(4)}, step=2).wait()
        store.makedirs(store.join(root, "notes"), True)
        store.write_atomic(store.join(root, "notes", "readme.txt"), b"keep me", True)
        with pytest.raises(CheckpointNotFoundError):
            publisher.delete(root, "notes", True)
        with pytest.raises(CheckpointNotFoundError):
            publisher.delete(root, "step-0000000009", True)
        publisher.delete(root, "step-0000000001", True)
        assert store.read_bytes(store.join(root, "notes", "readme.txt")) == b"keep me"
        assert _files_under(store, store.join(root, "step-0000000001")) == []
        with self._checkpointer(root, options) as ckpt:
            assert [i.name for i in ckpt.list()] == ["step-0000000002"]

    def test_a_damaged_checkpoint_is_replaced_by_a_new_save(self, tmp_path):
        from .format import codec as fmt

        root, options, store, _ = self._open(tmp_path)
        with self._checkpointer(root, options) as ckpt:
            ckpt.save({"x": torch.ones(4)}, step=1).wait()
        manifest = store.join(root, "step-0000000001", fmt.MANIFEST)
        store.write_atomic(manifest, b"{not json", True)
        with self._checkpointer(root, options) as ckpt:
            assert ckpt.list() == [] and [d.name for d in ckpt.damaged()] == ["step-0000000001"]
            ckpt.save({"x": torch.full((4,), 5.0)}, step=1).wait()
            assert torch.equal(ckpt.load(step=1)["x"], torch.full((4,), 5.0))
            assert [i.name for i in ckpt.list()] == ["step-0000000001"]

    def test_a_split_manifest_travels_with_its_checkpoint(self, tmp_path):
        """A manifest split into a head and parts (docs/format.md, "Split manifests", forced
        here by a split threshold of one byte) restores bit-exact, is replaced whole by an
        overwrite, is damaged without its part (and then replaced by a new save of its name),
        and is deleted with every file of it."""
        from .format import codec as fmt

        root, options, store, publisher = self._open(tmp_path)
        ckpt = store.join(root, "step-0000000001")
        saved = fmt.SPLIT_BYTES
        fmt.SPLIT_BYTES = 1
        try:
            with self._checkpointer(root, options) as ckpt_1:
                ckpt_1.save({"x": torch.arange(10.0)}, step=1).wait()
                ckpt_1.save({"x": torch.arange(10.0) + 1}, step=1, overwrite=True).wait()
                live = {"x": torch.zeros(10)}
                ckpt_1.restore(live)
            assert torch.equal(live["x"], torch.arange(10.0) + 1)
            parts = [f for f in _files_under(store, ckpt) if f.endswith(fmt.part_name(0))]
            assert len(parts) == 1, _files_under(store, ckpt)  # the old one left with its data
            store.remove(store.join(ckpt, parts[0]))
            with self._checkpointer(root, options) as ckpt_2:
                assert ckpt_2.list() == [] and [d.name for d in ckpt_2.damaged()] == [
                    "step-0000000001"
                ]
                ckpt_2.save({"x": torch.arange(10.0) + 2}, step=1).wait()
                assert torch.equal(ckpt_2.load(step=1)["x"], torch.arange(10.0) + 2)
        finally:
            fmt.SPLIT_BYTES = saved
        left_before = _files_under(store, ckpt)
        publisher.delete(root, "step-0000000001", True)
        left = _files_under(store, ckpt)
        # nothing of the deleted save is left; an object store may keep the damaged save's
        # data (written in the same second as the new manifest), the stale cleanup's by age
        assert fmt.MANIFEST not in left and set(left) <= set(left_before)
        assert not [f for f in left if f.endswith(fmt.part_name(0)) or "/" not in f]


def _files_under(store, path: str) -> list[str]:
    """Every file below ``path``, as paths relative to it (empty if there is none)."""
    out: list[str] = []
    try:
        names = store.listdir(path)
    except FileNotFoundError:
        return out
    for name in names:
        child = store.join(path, name)
        if store.isfile(child):
            out.append(name)
        elif store.isdir(child):  # an empty prefix (some servers list one) is neither
            out += [f"{name}/{sub}" for sub in _files_under(store, child)]
    return out

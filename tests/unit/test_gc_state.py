"""The garbage collector's switch belongs to the program: no library call changes it.

``gc.enable()`` / ``gc.disable()`` are process-wide: a library that flipped them would run the
training thread without cycle collection, or enable it behind a program that keeps it off
(Megatron's ``--manual-gc``). These tests drive a save, its commit, a restore and a load of many
tensors with the collector as the program set it, and look at it from inside every collection
(``gc.callbacks``), whichever thread triggered it.
"""

from __future__ import annotations

import gc
import threading
import time

import pytest
import torch

from datastates import Checkpointer
from datastates import format as fmt
from datastates.commit.round import MemoryStore, StoreCommunicator
from datastates.format import files
from datastates.format.records import FileRef, RankReport, SaveRef, Verdict

N = 5000


def _state() -> dict:
    g = torch.Generator().manual_seed(0)
    state = {f"layer{i // 50}.t{i}": torch.randn(3, generator=g) for i in range(N)}
    state["extra"] = {"step": 7, "names": ["a", "b"], "nested": [torch.arange(4.0)]}
    return state


def _zeros_like(state: dict) -> dict:
    live = {k: torch.zeros_like(v) for k, v in state.items() if torch.is_tensor(v)}
    live["extra"] = {"step": 0, "names": [], "nested": [torch.zeros(4)]}
    return live


def _same(got: dict, state: dict) -> None:
    assert got.keys() == state.keys()
    for k, v in state.items():
        if torch.is_tensor(v):
            assert torch.equal(got[k], v), k
    assert got["extra"]["step"] == 7 and got["extra"]["names"] == ["a", "b"]
    assert torch.equal(got["extra"]["nested"][0], torch.arange(4.0))


class _Collections:
    """A ``gc.callbacks`` hook: (thread id, ``gc.isenabled()``) at the start of every collection."""

    def __init__(self):
        self.seen: list[tuple[int, bool]] = []

    def __call__(self, phase, info):
        if phase == "start":
            self.seen.append((threading.get_ident(), gc.isenabled()))

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


@pytest.fixture
def program_gc():
    """The test sets the collector as a program would; it is enabled again after the test."""
    yield
    gc.enable()


def _save_commit_restore_load(root) -> tuple[dict, dict, list[bool]]:
    """Save, commit, restore in place and load ``_state()``; ``gc.isenabled()`` after each."""
    state, after = _state(), []
    with Checkpointer(root) as ck:
        handle = ck.save(state, step=1)
        after.append(gc.isenabled())
        handle.wait()
        after.append(gc.isenabled())
    live = _zeros_like(state)
    with Checkpointer(root) as ck:
        ck.restore(live)
        after.append(gc.isenabled())
        loaded = ck.load()
        after.append(gc.isenabled())
    return state, (live, loaded), after


def test_a_disabled_collector_stays_disabled_and_never_runs(tmp_path, program_gc):
    """With the collector disabled by the program, a save, its commit, a restore and a load of
    many tensors leave it disabled at every step, and no collection runs on any thread (the
    library neither enables it for a while nor collects by itself)."""
    gc.disable()
    with _Collections() as collections:
        state, (live, loaded), after = _save_commit_restore_load(tmp_path)
    assert after == [False, False, False, False]
    assert not gc.isenabled()
    assert collections.seen == []
    _same(live, state)
    _same(loaded, state)


def test_an_enabled_collector_stays_enabled_on_every_thread(tmp_path, program_gc):
    """With the collector enabled, every collection during a save, its commit, a restore and a
    load sees it enabled, the library's own threads' included: the collector is never paused."""
    gc.enable()
    main = threading.get_ident()
    with _Collections() as collections:
        state, (live, loaded), after = _save_commit_restore_load(tmp_path)
    assert after == [True, True, True, True]
    assert collections.seen and all(enabled for _, enabled in collections.seen)
    assert any(thread != main for thread, _ in collections.seen)  # the commit thread collects
    _same(live, state)
    _same(loaded, state)


@pytest.mark.parametrize("enabled", [True, False])
def test_rank_zeros_review_and_publish_run_with_the_programs_collector(enabled, program_gc):
    """Rank 0's check of the reports and its publish (the manifest's encoding) run with the
    collector as the program has it."""
    (gc.enable if enabled else gc.disable)()
    world = 3
    store = MemoryStore()
    comms = [StoreCommunicator(store, r, world, "run") for r in range(world)]
    sid = comms[0].save_id("/d", "step-1", 1)
    seen, out = [], {}

    def rank(r):
        report = RankReport(
            rank=r,
            save=SaveRef(sid.name, sid.step, sid.nonce),
            root="/d",
            file=FileRef(name=fmt.shard_file_name(r), rank=r, nbytes=4096, index_crc32=0),
            tree={"t": "dict", "items": []},
        )
        out[r] = comms[r].agree(
            sid,
            report,
            time.monotonic() + 10,
            10,
            check=lambda reports: seen.append(("check", gc.isenabled())),
            commit=lambda reports, fence: (
                seen.append(("commit", gc.isenabled())) or Verdict.committed(None)
            ),
            fallback=lambda why, until: Verdict.abort("store", why, {}),
        )

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert seen == [("check", enabled), ("commit", enabled)]
    assert out == {r: Verdict.committed(None) for r in range(world)}
    assert gc.isenabled() is enabled


@pytest.mark.parametrize("enabled", [True, False])
def test_a_manifest_is_encoded_and_parsed_with_the_programs_collector(
    tmp_path, enabled, program_gc
):
    with Checkpointer(tmp_path) as ck:
        ck.save(_state(), step=1).wait()
    [path] = tmp_path.glob("*/manifest.json")
    (gc.enable if enabled else gc.disable)()
    manifest = files.parse_manifest_bytes(path.read_bytes(), str(path))
    assert gc.isenabled() is enabled
    encoded = files.encode_manifest_record(manifest)
    assert gc.isenabled() is enabled
    assert encoded.written == manifest and len(manifest.entries) == N + 1

"""The memory tier with real processes and real signals: a keeper process that outlives the
trainer (docs/memory-tier.md).

- saves go to their tier (``persist_every``, ``persist=``), ``latest()``/``restore()``/``load()``
  take the newest of both tiers, bit-exact;
- a trainer SIGKILLed at every kill point of a memory save (half way through a unit captured in
  place into the shard file, a write, a torn write, the commit thread's writes, the fsyncs, the renames, ``latest``): a restarted trainer restores a
  sealed step from memory, bit-exact, never a torn one, and the dead save's temporaries go;
- a trainer SIGKILLed after its saves: the keeper writes the newest memory checkpoint to storage;
- the keeper SIGKILLed: training goes on with a WARNING, ``close()`` persists and removes the
  memory itself; the keeper SIGTERMed: it persists, removes the memory and ends;
- a memory directory someone else prepared (a link, open to others, a file) is refused;
- hundreds of memory snapshots: no growth of descriptors, checkpoints or temporaries.
- a memory root too small for a save: the save fails with ENOSPC, the trainer lives on.
- the keeper stalled (SIGSTOP) while it copies a save into storage: its checkpoint stays in
  memory, ``wait()`` and ``close()`` give up at ``commit_timeout_s``, the keeper writes it once.
"""

from __future__ import annotations

import glob
import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

import datastates
from datastates.memory import place
from datastates.tools.keeper import ask

from _crash_child import make_state
from _faults_helpers import HERE, assert_bit_exact, zeros_like_state

CHILD = os.path.join(HERE, "_memory_child.py")


def _gone(memdir: str, timeout: float = 60.0) -> bool:
    """Wait for the keeper of ``memdir`` to end and its memory to go (it ends on its own)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not os.path.exists(memdir) and not _serving(memdir):
            return True
        if (
            not _serving(memdir)
            and not place.keeper_running(memdir)
            and os.path.lexists(os.path.join(memdir, place.LOCK))
        ):
            return False  # no keeper, its lock and memory still there: left behind
        time.sleep(0.05)
    return False


def _serving(memdir: str) -> bool:
    try:
        ask(memdir, "status", timeout=10)
        return True
    except datastates.KeeperError:
        return False


def _tier(shm_root, tmp_path, **kw):
    kw.setdefault("log_path", str(tmp_path / "keeper.log"))
    return datastates.MemoryTier(root=shm_root, **kw)


def _config(tier, **kw):
    return datastates.CheckpointConfig(
        memory_tier=tier, host_cache_bytes=1 << 20, chunk_bytes=256 << 10, **kw
    )


def _names(infos):
    return [i.name for i in infos]


def _child(storage, shm_root, log, mode, n=0, steps=0, env=None):
    return subprocess.Popen(
        [sys.executable, CHILD, str(storage), shm_root, str(log), mode, str(n), str(steps)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=HERE,
        env=dict(os.environ, **(env or {})),
    )


def _wait_idle(memdir: str, timeout: float = 60.0) -> None:
    """Until the keeper counts no trainer attached (it has handled a dead trainer: written the
    memory to storage if it does that)."""
    deadline = time.monotonic() + timeout
    while ask(memdir, "status")["attached"]:
        assert time.monotonic() < deadline, "the keeper still counts a trainer attached"
        time.sleep(0.05)


# ---------------------------------------------------------------- settings
def test_options_are_checked():
    for bad in (
        dict(keep_last=0),
        dict(persist_every=0),
        dict(persist_every=2.0),
        dict(idle_timeout_s=0),
        dict(spawn="yes"),
        dict(root=""),
        dict(log_path=""),
    ):
        with pytest.raises(datastates.ConfigError, match="MemoryTier"):
            datastates.MemoryTier(**bad)
    with pytest.raises(datastates.ConfigError, match="memory_tier"):
        datastates.CheckpointConfig(memory_tier={"root": "/dev/shm"})
    tier = datastates.MemoryTier(persist_every=5)
    assert [tier.goes_to_storage(s, None) for s in (1, 5, 9, 10)] == [False, True, False, True]
    assert tier.goes_to_storage(None, None) and not tier.goes_to_storage(5, False)
    assert tier.goes_to_storage(3, True)
    assert not datastates.MemoryTier(persist_every=None).goes_to_storage(10, None)


def test_probing_for_a_keeper_creates_nothing(tmp_path):
    """keeper_running() on a directory without a lock file (a keeper between removing its lock
    and its directory): False, and the directory stays empty, so the keeper's rmdir succeeds."""
    memdir = tmp_path / "datastates-0-x"
    memdir.mkdir()
    assert not place.keeper_running(str(memdir)) and os.listdir(memdir) == []
    os.rmdir(memdir)
    assert not place.keeper_running(str(memdir))


def test_persist_false_needs_a_memory_tier(tmp_path):
    with datastates.Checkpointer(tmp_path / "c") as ck:
        with pytest.raises(datastates.ConfigError, match="memory tier"):
            ck.save({"x": torch.ones(3)}, step=1, persist=False)
    assert not (tmp_path / "c").exists()


def test_named_checkpoints_of_frameworks_refuse_a_memory_tier(tmp_path):
    from datastates.integrations._paths import PathCheckpoints

    config = datastates.CheckpointConfig(memory_tier=datastates.MemoryTier(root=str(tmp_path)))
    with pytest.raises(datastates.ConfigError, match="memory_tier"):
        PathCheckpoints(config)
    assert os.listdir(tmp_path) == []


# ---------------------------------------------------------------- tiers
def test_saves_go_to_their_tier_and_the_newest_is_restored(shm_root, tmp_path):
    storage = tmp_path / "ckpt"
    tier = _tier(shm_root, tmp_path, persist_every=3)
    ck = datastates.Checkpointer(storage, _config(tier))
    memdir = place.memory_dir(shm_root, str(storage))
    for step in range(1, 8):
        ck.save(make_state(step, big=False), step=step)
    ck.wait()
    assert [i.step for i in ck.list()] == [3, 6]
    assert [i.step for i in ck.memory.list()] == [7]  # keep_last=1
    newest = ck.latest()
    assert newest.step == 7 and newest.path.startswith(memdir)
    live = zeros_like_state(make_state(0, big=False))
    report = ck.restore(live)
    assert (report.step, report.tier) == (7, "memory")
    assert_bit_exact(live, make_state(7, big=False))
    report = ck.restore(live, step=6)
    assert (report.step, report.tier) == (6, "storage")
    assert_bit_exact(live, make_state(6, big=False))
    assert_bit_exact(ck.load(), make_state(7, big=False))
    ck.save(make_state(8, big=False), step=8, persist=True).wait()
    ck.save(make_state(9, big=False), step=9, persist=False).wait()
    ck.save(make_state(4, big=False), step=4, tag="best").wait()  # a name: always storage
    assert [i.name for i in ck.list()] == [
        "step-0000000003",
        "step-0000000006",
        "step-0000000008",
        "best",
    ]
    ck.close(stop_keeper=True)  # the keeper writes step 9 to storage, removes the memory, ends
    assert _gone(memdir)
    with datastates.Checkpointer(storage) as plain:
        assert [i.step for i in plain.list()] == [3, 6, 8, 4, 9]
        assert_bit_exact(plain.load(step=9), make_state(9, big=False))
        assert_bit_exact(plain.load(step=8), make_state(8, big=False))


def test_a_memory_tag_saved_later_does_not_hide_a_newer_memory_step(shm_root, tmp_path):
    """Inside the memory tier, as across the tiers, the newest is the highest step: a tag kept in
    memory after step 4 (keep_last=2) is older than step 4 for latest(), restore() and load(),
    and storage's step 3 is not read."""
    storage = tmp_path / "ckpt"
    tier = _tier(shm_root, tmp_path, persist_every=3, keep_last=2)
    with datastates.Checkpointer(storage, _config(tier)) as ck:
        for step in (3, 4):
            ck.save(make_state(step, big=False), step=step)
        ck.save(make_state(1, big=False), tag="warmup", persist=False)
        ck.wait()
        assert _names(ck.memory.list()) == ["step-0000000004", "warmup"]
        assert ck.memory.latest().step == 4 and ck.latest().step == 4
        live = zeros_like_state(make_state(0, big=False))
        report = ck.restore(live)
        assert (report.step, report.tier) == (4, "memory")
        assert_bit_exact(live, make_state(4, big=False))
        assert_bit_exact(ck.load(), make_state(4, big=False))
        ck.close(stop_keeper=True)


class _Counter:
    """A class without state_dict(): only a provider of its own saves it."""

    def __init__(self, seed):
        self.count = seed
        self.history = torch.full((4,), float(seed))


class _CounterProvider(datastates.StateProvider):
    name = "tests.memory.Counter"

    def can_handle(self, obj):
        return isinstance(obj, _Counter)

    def state(self, obj):
        return {"count": obj.count, "history": obj.history}

    def load(self, obj, state):
        obj.count = state["count"]
        obj.history.copy_(state["history"])


def test_the_memory_tier_uses_the_checkpointer_s_registry(shm_root, tmp_path):
    """A provider registered with the Checkpointer serves memory saves and restores as it serves
    storage's."""
    registry = datastates.ProviderRegistry.default().register(_CounterProvider())
    tier = _tier(shm_root, tmp_path, persist_every=2)
    with datastates.Checkpointer(tmp_path / "ckpt", _config(tier), registry=registry) as ck:
        for step in (1, 2, 3):
            ck.save({"c": _Counter(step)}, step=step)
        ck.wait()  # step 2 written to storage by the keeper too
        assert ck.memory.latest().step == 3 and [i.step for i in ck.list()] == [2]
        live = _Counter(0)
        assert ck.restore({"c": live}).tier == "memory"
        assert live.count == 3 and torch.equal(live.history, torch.full((4,), 3.0))
        ck.close(stop_keeper=True)


def test_a_damaged_newest_memory_step_falls_back_to_storage_s_newer_step(
    shm_root, tmp_path, caplog
):
    """Memory holds steps 9 and 11, storage step 10 (the trainer's own save). Step 11 damaged in
    memory: the restore goes to storage's step 10, never back to memory's older step 9."""
    storage = tmp_path / "ckpt"
    tier = _tier(
        shm_root,
        tmp_path,
        persist_every=None,
        keep_last=2,
        storage_writer="trainer",
        persist_on_exit=False,
    )
    with datastates.Checkpointer(storage, _config(tier)) as ck:
        for step, persist in ((9, None), (10, True), (11, None)):
            ck.save(make_state(step, big=False), step=step, persist=persist)
        ck.wait()
        assert [i.step for i in ck.memory.list()] == [9, 11]
        shard = os.path.join(
            place.memory_dir(shm_root, str(storage)),
            place.CKPT,
            "step-0000000011",
            "rank-00000.dsf",
        )
        with open(shard, "r+b") as f:
            f.seek(4096 + 3)
            byte = f.read(1)
            f.seek(4096 + 3)
            f.write(bytes([byte[0] ^ 0x55]))
        live = zeros_like_state(make_state(0, big=False))
        with caplog.at_level(logging.WARNING, logger="datastates"):
            report = ck.restore(live)
        assert (report.step, report.tier) == (10, "storage"), report
        assert_bit_exact(live, make_state(10, big=False))
        assert "step-0000000011 is damaged" in caplog.text


@pytest.mark.parametrize("planted", ["symlink", "open", "file"])
def test_a_memory_directory_someone_prepared_is_refused(shm_root, tmp_path, planted):
    storage = tmp_path / "ckpt"
    memdir = place.memory_dir(shm_root, str(storage))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    if planted == "symlink":
        os.symlink(elsewhere, memdir)
    elif planted == "open":
        os.mkdir(memdir)
        os.chmod(memdir, 0o755)
    else:
        open(memdir, "w").close()
    with pytest.raises(datastates.KeeperError, match="refusing"):
        datastates.Checkpointer(storage, _config(_tier(shm_root, tmp_path)))
    assert os.listdir(elsewhere) == []
    assert not storage.exists()
    if planted == "open":
        assert os.listdir(memdir) == []
    os.unlink(memdir) if planted != "open" else os.rmdir(memdir)


# ---------------------------------------------------------------- a trainer killed
KILL_POINTS = [
    ("fill", 1),
    ("fill", 9),
    ("pwrite", 1),
    ("torn", 1),
    ("commitwrite", 2),
    ("commitwrite", 4),
    ("fsync", 2),
    ("rename-before", 1),
    ("rename-after", 1),
    ("rename-after", 2),
    ("set-latest", 1),
]


@pytest.mark.parametrize("mode,n", KILL_POINTS, ids=[f"{m}-{n}" for m, n in KILL_POINTS])
def test_a_trainer_killed_in_a_memory_save_restores_a_sealed_step(shm_root, tmp_path, mode, n):
    storage, log = tmp_path / "ckpt", tmp_path / "keeper.log"
    proc = _child(storage, shm_root, log, mode, n)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL, (proc.returncode, out, err[-3000:])
    markers = out.decode().split()
    assert "COMMITTED" in markers and "2" not in markers[markers.index("COMMITTED") + 2 :], out
    memdir = place.memory_dir(shm_root, str(storage))
    assert _serving(memdir), "the keeper died with the trainer"
    tier = _tier(shm_root, tmp_path, persist_every=None, persist_on_exit=False)
    with datastates.Checkpointer(storage, _config(tier)) as ck:
        # the dead save's temporaries went when this Checkpointer opened the memory
        assert [
            e
            for e in os.listdir(os.path.join(memdir, place.CKPT))
            if e.startswith(".") and not e.startswith(".owner.")
        ] == []
        live = zeros_like_state(make_state(0, big=False))
        report = ck.restore(live)
        assert report.tier == "memory" and report.step in (1, 2)
        assert_bit_exact(live, make_state(report.step, big=False))
        if mode == "set-latest":  # killed after the rename: step 2 was sealed
            assert report.step == 2
        assert not storage.exists()  # nothing was written to storage


def _dead_trainer(shm_root, tmp_path):
    """A trainer that commits steps 1 and 2 into memory and is SIGKILLed, its keeper writing to
    storage on its death; returns (storage, keeper log, memory dir, pid) once the keeper has
    handled the death."""
    storage, log = tmp_path / "ckpt", tmp_path / "keeper.log"
    proc = _child(storage, shm_root, log, "die", env={"DS_PERSIST_ON_EXIT": "1"})
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL and b"COMMITTED 2" in out, err[-3000:]
    memdir = place.memory_dir(shm_root, str(storage))
    _wait_idle(memdir)
    return storage, log, memdir, proc.pid


def test_a_dead_trainer_s_memory_is_written_to_storage(shm_root, tmp_path):
    storage, log, memdir, pid = _dead_trainer(shm_root, tmp_path)
    with datastates.Checkpointer(storage) as plain:  # storage alone: the keeper's commit
        assert [i.step for i in plain.list()] == [2]
        assert_bit_exact(plain.load(), make_state(2, big=False))
    assert "trainer %d ended without detaching" % pid in log.read_text()
    tier = _tier(shm_root, tmp_path, persist_every=None)
    with datastates.Checkpointer(storage, _config(tier)) as ck:  # a tie: memory is read
        live = zeros_like_state(make_state(0, big=False))
        report = ck.restore(live)
        assert (report.tier, ck.latest().path.startswith(memdir)) == ("memory", True)
        assert report.prechecked  # the keeper checked it when the trainer died
        assert_bit_exact(live, make_state(2, big=False))


def test_a_memory_checkpoint_written_after_the_keeper_checked_it_is_checked_again(
    shm_root, tmp_path
):
    """The keeper checks and marks the dead trainer's newest memory checkpoint; a byte of it
    is then damaged (its mtime set back): the restart's restore checksums it, finds the damage,
    and restores the same step from storage, bit-exact."""
    storage, log, memdir, pid = _dead_trainer(shm_root, tmp_path)
    newest = os.path.join(memdir, place.CKPT, "step-0000000002")
    assert os.path.isfile(os.path.join(memdir, "verified", "step-0000000002"))
    shard = sorted(glob.glob(os.path.join(newest, "*.dsf")))[0]
    st = os.stat(shard)
    with open(shard, "r+b") as f:
        f.seek(st.st_size // 3)
        byte = f.read(1)
        f.seek(st.st_size // 3)
        f.write(bytes([byte[0] ^ 0x10]))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    tier = _tier(shm_root, tmp_path, persist_every=None)
    with datastates.Checkpointer(storage, _config(tier)) as ck:
        live = zeros_like_state(make_state(0, big=False))
        report = ck.restore(live)
        assert (report.tier, report.step, report.prechecked) == ("storage", 2, False)
        assert_bit_exact(live, make_state(2, big=False))


def test_the_memory_is_kept_while_storage_lacks_its_newest_step(shm_root, tmp_path):
    """The keeper's write to storage fails (the storage path is a file): it logs the error, and
    ending it removes nothing: the memory checkpoint is still there, restorable."""
    storage = tmp_path / "ckpt"
    memdir = place.memory_dir(shm_root, str(storage))
    ck = datastates.Checkpointer(storage, _config(_tier(shm_root, tmp_path, persist_every=None)))
    ck.save(make_state(1, big=False), step=1).wait()
    storage.write_bytes(b"not a directory")  # nothing went to storage: the path is free
    ck.close()  # the keeper's write fails; it waits for a trainer
    ask(memdir, "stop")
    deadline = time.monotonic() + 60
    while place.keeper_running(memdir):
        assert time.monotonic() < deadline, "the keeper did not end"
        time.sleep(0.05)
    log = (tmp_path / "keeper.log").read_text()
    assert "writing the newest memory checkpoint" in log and "is kept" in log
    kept = os.path.join(memdir, place.CKPT, "step-0000000001")
    with datastates.Checkpointer(os.path.join(memdir, place.CKPT)) as plain:
        assert [i.path for i in plain.list()] == [kept]
        assert_bit_exact(plain.load(), make_state(1, big=False))
    shutil.rmtree(memdir)  # the fixture checks that nothing else was left


# ---------------------------------------------------------------- the keeper writes storage
def _held_link(ck):
    """Hold the keeper link's lock: the handoff thread's next request waits for its release
    (a real lock of the real link; nothing is replaced)."""
    return ck.tiers.link.hold(timeout=30)


def _until(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def _save_taken(ck, step: int) -> None:
    """Save ``step`` (due for storage) and return once the handoff thread is writing it."""
    ck.save(make_state(step, big=False), step=step).wait()
    handoff, name = ck.tiers.handoff, f"step-{step:010d}"
    _until(
        lambda: handoff.held() == {name} and handoff.waiting() is None,
        f"the handoff thread did not take step {step}",
    )


def test_a_checkpoint_being_written_to_storage_stays_in_memory_and_a_waiting_one_is_replaced(
    shm_root, tmp_path, caplog
):
    """persist_every=2, keep_last=1. Step 2 is handed on and its write held back: memory keeps
    it (its shard file is not recycled) through the saves after it; step 4 waits and is
    replaced by step 6 with a WARNING. Released: storage gets steps 2 and 6, bit-exact, written
    by the keeper; memory is back to keep_last."""
    storage = tmp_path / "ckpt"
    ck = datastates.Checkpointer(storage, _config(_tier(shm_root, tmp_path, persist_every=2)))
    handoff = ck.tiers.handoff
    ck.save(make_state(1, big=False), step=1).wait()
    link = _held_link(ck)
    try:
        _save_taken(ck, 2)
        with caplog.at_level(logging.WARNING, logger="datastates"):
            for step in range(3, 7):
                ck.save(make_state(step, big=False), step=step).wait()
        assert [i.step for i in ck.memory.list()] == [2, 4, 6]  # 2 and 4 held, 6 the newest
        assert ck.list() == []
        assert "step-0000000004 was still waiting" in caplog.text
        assert list(handoff.replaced) == ["step-0000000004"]
    finally:
        link.release()
    ck.wait()
    assert [i.step for i in ck.list()] == [2, 6]
    assert [i.step for i in ck.memory.list()] == [6]
    assert list(handoff.written) == ["step-0000000002", "step-0000000006"]
    ck.close(stop_keeper=True)
    log = (tmp_path / "keeper.log").read_text()
    assert "committed step-0000000002" in log and "committed step-0000000006" in log
    with datastates.Checkpointer(storage) as plain:
        assert_bit_exact(plain.load(step=2), make_state(2, big=False))
        assert_bit_exact(plain.load(step=6), make_state(6, big=False))


def test_a_trainer_killed_while_the_keeper_copies_loses_no_step_and_doubles_none(
    shm_root, tmp_path
):
    """SIGKILL right after step 4's memory commit, steps 2 and 4 handed on (the keeper may be
    copying either): the keeper finishes what it was asked, then writes the newest if storage
    lacks it. Storage holds steps 2 and 4 once each, in order, bit-exact."""
    storage, log = tmp_path / "ckpt", tmp_path / "keeper.log"
    proc = _child(
        storage,
        shm_root,
        log,
        "die-handing-on",
        env={"DS_PERSIST_ON_EXIT": "1", "DS_PERSIST_EVERY": "2"},
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL and b"COMMITTED 4" in out, err[-3000:]
    _wait_idle(place.memory_dir(shm_root, str(storage)))
    with datastates.Checkpointer(storage) as plain:
        infos = plain.list()
        assert [i.step for i in infos] == [2, 4] and [i.seq for i in infos] == [1, 2]
        assert_bit_exact(plain.load(step=2), make_state(2, big=False))
        assert_bit_exact(plain.load(step=4), make_state(4, big=False))


def test_a_tagged_save_to_storage_waits_for_the_keeper_s_write(shm_root, tmp_path):
    """While the keeper's write of step 2 is held back, a save with a tag (rank 0's own commit
    into storage) does not commit; released, the keeper commits first, then the tag."""
    storage = tmp_path / "ckpt"
    ck = datastates.Checkpointer(storage, _config(_tier(shm_root, tmp_path, persist_every=2)))
    link = _held_link(ck)
    try:
        ck.save(make_state(2, big=False), step=2).wait()
        handle = ck.save(make_state(7, big=False), tag="best")
        _until(lambda: handle._job.deciding, "the tag's commit did not start")
        assert not handle.done() and ck.list() == []
    finally:
        link.release()
    assert handle.wait().name == "best"
    assert [(i.name, i.seq) for i in ck.list()] == [("step-0000000002", 1), ("best", 2)]
    ck.close(stop_keeper=True)


def test_a_save_due_for_storage_is_written_beside_a_tag_of_the_same_step(shm_root, tmp_path):
    """A tag saved at step 2, then step 2 itself (persist_every=2, handed on to the keeper):
    storage gets both, in that order, as when the trainer writes storage itself. A checkpoint
    handed on by name is refused only when storage holds that name, not because storage holds
    its step (or a newer one) under another name."""
    storage = tmp_path / "ckpt"
    ck = datastates.Checkpointer(storage, _config(_tier(shm_root, tmp_path, persist_every=2)))
    ck.save(make_state(7, big=False), step=2, tag="best").wait()
    ck.save(make_state(2, big=False), step=2)
    ck.wait()
    assert [(i.name, i.step, i.seq) for i in ck.list()] == [
        ("best", 2, 1),
        ("step-0000000002", 2, 2),
    ]
    assert list(ck.tiers.handoff.written) == ["step-0000000002"]
    ck.close(stop_keeper=True)
    with datastates.Checkpointer(storage) as plain:
        assert_bit_exact(plain.load(step=2), make_state(2, big=False))
        assert_bit_exact(plain.load(tag="best"), make_state(7, big=False))


def test_a_save_due_for_storage_under_a_name_storage_holds_is_refused_or_replaced(
    shm_root, tmp_path, caplog
):
    """Storage already holds step 2: a save of step 2 due for storage is refused by save() on
    its name (CheckpointExistsError, nothing written to memory), as a save straight to storage
    would be; with overwrite=True the keeper replaces it. When storage gets the name only after
    save() (another writer, while the handoff is held back), the keeper's write is refused: an
    ERROR, KeeperError from wait(), the other writer's checkpoint left as it was. Never
    skipped without a word."""
    storage = tmp_path / "ckpt"
    with datastates.Checkpointer(storage) as other:
        other.save(make_state(7, big=False), step=2).wait()
    ck = datastates.Checkpointer(storage, _config(_tier(shm_root, tmp_path, persist_every=2)))
    with pytest.raises(datastates.CheckpointExistsError, match="step-0000000002"):
        ck.save(make_state(2, big=False), step=2)
    assert ck.memory.list() == []
    ck.save(make_state(2, big=False), step=2, overwrite=True)
    ck.wait()
    assert list(ck.tiers.handoff.written) == ["step-0000000002"]
    link = _held_link(ck)
    try:
        handle = ck.save(make_state(4, big=False), step=4)
        handle.wait()
        with datastates.Checkpointer(storage) as other:  # commits while the handoff waits
            other.save(make_state(9, big=False), step=4).wait()
    finally:
        link.release()
    with caplog.at_level(logging.ERROR, logger="datastates"):
        with pytest.raises(datastates.KeeperError, match="already holds.*step-0000000004"):
            ck.wait()
    assert "step-0000000004 to storage" in caplog.text and "stays in memory only" in caplog.text
    assert [i.step for i in ck.memory.list()] == [4]
    ck.close(stop_keeper=True)
    with datastates.Checkpointer(storage) as plain:
        assert [i.step for i in plain.list()] == [2, 4]
        assert_bit_exact(plain.load(step=2), make_state(2, big=False))
        assert_bit_exact(plain.load(step=4), make_state(9, big=False))


def test_delete_and_a_restore_from_storage_wait_for_the_keeper_s_write(shm_root, tmp_path):
    """While the keeper's write of step 2 is held back: deleting step 2 from memory, deleting
    a checkpoint of storage and restoring one from storage each wait for that write (none
    of them returns before storage holds step 2), then run; a wait that outlasts its deadline
    raises CommitTimeoutError and removes nothing."""
    storage = tmp_path / "ckpt"
    ck = datastates.Checkpointer(
        storage, _config(_tier(shm_root, tmp_path, persist_every=2), commit_timeout_s=120)
    )
    handoff = ck.tiers.handoff
    ck.save(make_state(5, big=False), tag="old").wait()
    ck.save(make_state(6, big=False), tag="older").wait()
    live = zeros_like_state(make_state(5, big=False))
    link = _held_link(ck)
    try:
        _save_taken(ck, 2)
        with pytest.raises(datastates.CommitTimeoutError, match="step-0000000002"):
            with handoff.paused("step-0000000002", time.monotonic() + 0.2):
                pass
        assert [i.step for i in ck.memory.list()] == [2]
        seen: dict[str, object] = {}

        def run(what, call):
            try:
                call()
                seen[what] = list(handoff.written)  # what storage held when the call returned
            except Exception as exc:  # noqa: BLE001 - asserted on below
                seen[what] = exc

        threads = [
            threading.Thread(target=run, args=args)
            for args in (
                ("memory delete", lambda: ck.memory.delete(step=2)),
                ("storage delete", lambda: ck.delete(tag="older")),
                ("restore", lambda: ck.restore(live, tag="old")),
            )
        ]
        for t in threads:
            t.start()
        _until(lambda: len(handoff._cond._waiters) == 3, "the three calls did not wait")
        assert seen == {} and [i.step for i in ck.memory.list()] == [2]
        assert [i.name for i in ck.list()] == ["old", "older"]
    finally:
        link.release()
    for t in threads:
        t.join(120)
    assert seen == {
        what: ["step-0000000002"] for what in ("memory delete", "storage delete", "restore")
    }
    assert ck.memory.list() == []
    assert [i.name for i in ck.list()] == ["old", "step-0000000002"]
    assert_bit_exact(live, make_state(5, big=False))
    ck.close(stop_keeper=True)


def test_deleting_a_save_just_made_waits_for_its_commit_and_its_copy(shm_root, tmp_path):
    """``memory.delete()`` right after a save due for storage, not waited for: the delete waits
    until the save is committed and handed on, then until the keeper's copy is done, and only
    then removes it from memory; storage holds it bit-exact and no write failed."""
    storage = tmp_path / "ckpt"
    ck = datastates.Checkpointer(storage, _config(_tier(shm_root, tmp_path, persist_every=2)))
    ck.save(make_state(2, big=False), step=2)
    ck.memory.delete(step=2)
    assert ck.memory.list() == []
    ck.wait()  # no KeeperError: the copy was not disturbed
    assert [i.step for i in ck.list()] == [2]
    ck.close(stop_keeper=True)
    with datastates.Checkpointer(storage) as plain:
        assert_bit_exact(plain.load(step=2), make_state(2, big=False))


def test_replacing_a_memory_checkpoint_the_keeper_copies_waits_for_the_copy(shm_root, tmp_path):
    """Step 2 is handed on and its copy held back; a memory save replacing step 2
    (overwrite=True) does not commit until the copy is done, so the shard files the keeper
    reads are not recycled under it: storage gets the first step 2, memory the second, both
    bit-exact."""
    storage = tmp_path / "ckpt"
    ck = datastates.Checkpointer(storage, _config(_tier(shm_root, tmp_path, persist_every=2)))
    link = _held_link(ck)
    try:
        _save_taken(ck, 2)
        handle = ck.save(make_state(9, big=False), step=2, persist=False, overwrite=True)
        _until(lambda: handle._job.deciding, "the replacing save's commit did not start")
        assert not handle.done()
    finally:
        link.release()
    assert handle.wait().name == "step-0000000002"
    ck.wait()
    assert [i.step for i in ck.list()] == [2] and [i.step for i in ck.memory.list()] == [2]
    assert_bit_exact(ck.memory.load(step=2), make_state(9, big=False))
    ck.close(stop_keeper=True)
    with datastates.Checkpointer(storage) as plain:
        assert_bit_exact(plain.load(step=2), make_state(2, big=False))


def test_a_failed_write_to_storage_is_raised_by_wait_and_the_memory_kept(
    shm_root, tmp_path, caplog
):
    """Storage gets a directory named like step 2 that is no checkpoint after save() checked the
    name (while the handoff is held back): the keeper's commit is refused; wait() raises
    KeeperError naming it (once), memory still holds step 2, and training saves on."""
    storage = tmp_path / "ckpt"
    ck = datastates.Checkpointer(storage, _config(_tier(shm_root, tmp_path, persist_every=2)))
    link = _held_link(ck)
    try:
        ck.save(make_state(2, big=False), step=2).wait()
        (storage / "step-0000000002").mkdir(parents=True)
        (storage / "step-0000000002" / "notes.txt").write_text("not a checkpoint")
    finally:
        link.release()
    with caplog.at_level(logging.ERROR, logger="datastates"):
        with pytest.raises(datastates.KeeperError, match="step-0000000002"):
            ck.wait()
    assert "stays in memory only" in caplog.text
    assert ck.wait() == []  # reported once
    assert [i.step for i in ck.memory.list()] == [2]
    assert (storage / "step-0000000002" / "notes.txt").read_text() == "not a checkpoint"
    ck.save(make_state(4, big=False), step=4)
    ck.wait()
    assert [i.step for i in ck.list()] == [4]
    ck.close(stop_keeper=True)


def test_a_stalled_keeper_s_copy_keeps_its_checkpoint_in_memory_until_it_is_written(
    shm_root, tmp_path
):
    """The keeper is stopped (SIGSTOP) when step 2 is handed on, commit_timeout_s=5: wait()
    gives up with CommitTimeoutError (storage does not have step 2 yet; nothing failed), and
    memory keeps step 2 through the next save, so its shard file is not recycled under the
    keeper's copy. Continued (SIGCONT), the keeper writes step 2: wait() returns, storage holds
    it bit-exact, and memory is back to keep_last."""
    storage = tmp_path / "ckpt"
    ck = datastates.Checkpointer(
        storage, _config(_tier(shm_root, tmp_path, persist_every=2), commit_timeout_s=5)
    )
    keeper = ck.tiers.link.keeper_pid
    ck.save(make_state(1, big=False), step=1).wait()
    os.kill(keeper, signal.SIGSTOP)
    try:
        ck.save(make_state(2, big=False), step=2).wait()
        with pytest.raises(datastates.CommitTimeoutError, match="step-0000000002"):
            ck.wait()
        ck.save(make_state(3, big=False), step=3).wait()
        assert [i.step for i in ck.memory.list()] == [2, 3]  # 2 held while the keeper copies
        assert ck.list() == []
    finally:
        os.kill(keeper, signal.SIGCONT)
    ck.wait()  # until the keeper has written step 2
    assert [i.step for i in ck.list()] == [2]
    assert [i.step for i in ck.memory.list()] == [3]
    assert list(ck.tiers.handoff.written) == ["step-0000000002"]
    ck.close(stop_keeper=True)
    with datastates.Checkpointer(storage) as plain:
        assert_bit_exact(plain.load(step=2), make_state(2, big=False))


def test_closing_beside_a_stalled_keeper_leaves_the_copy_to_the_keeper(shm_root, tmp_path, caplog):
    """The keeper is stopped while step 2 is handed on: close() gives up at commit_timeout_s
    with an ERROR and detaches; rank 0 does not write step 2 to storage itself beside the
    keeper. Continued, the keeper writes step 2 to storage, once."""
    storage = tmp_path / "ckpt"
    memdir = place.memory_dir(shm_root, str(storage))
    ck = datastates.Checkpointer(
        storage, _config(_tier(shm_root, tmp_path, persist_every=2), commit_timeout_s=5)
    )
    keeper = ck.tiers.link.keeper_pid
    os.kill(keeper, signal.SIGSTOP)
    try:
        ck.save(make_state(2, big=False), step=2).wait()
        with caplog.at_level(logging.INFO, logger="datastates"):
            ck.close()
        assert not ck.tiers.handoff.running
        ck.tiers.handoff.idle(time.monotonic())  # nothing is left running here
        assert "still writing step-0000000002" in caplog.text
        assert "writes step-0000000002 to storage itself" not in caplog.text
        assert not storage.exists() or not os.listdir(storage)
    finally:
        os.kill(keeper, signal.SIGCONT)
    _wait_idle(memdir)
    with datastates.Checkpointer(storage) as plain:
        infos = plain.list()
        assert [(i.step, i.seq) for i in infos] == [(2, 1)]
        assert_bit_exact(plain.load(step=2), make_state(2, big=False))
    assert "committed step-0000000002" in (tmp_path / "keeper.log").read_text()


# ---------------------------------------------------------------- the keeper killed / stopped
def test_a_killed_keeper_leaves_training_going(shm_root, tmp_path, caplog):
    storage = tmp_path / "ckpt"
    tier = _tier(shm_root, tmp_path, persist_every=4)
    ck = datastates.Checkpointer(storage, _config(tier))
    memdir = place.memory_dir(shm_root, str(storage))
    for step in (1, 2):
        ck.save(make_state(step, big=False), step=step)
    ck.wait()
    link = ck.tiers.link
    with caplog.at_level(logging.WARNING, logger="datastates"):
        os.kill(link.keeper_pid, signal.SIGKILL)
        assert link.wait_lost(timeout=30)
    assert link.lost and "memory keeper" in caplog.text and "is gone" in caplog.text
    with caplog.at_level(logging.WARNING, logger="datastates"):
        for step in range(3, 7):  # memory and storage saves go on
            ck.save(make_state(step, big=False), step=step)
        ck.wait()
    assert "rank 0 writes step-0000000004 to storage itself" in caplog.text
    assert [i.step for i in ck.list()] == [4] and ck.latest().step == 6
    ck.close()  # no keeper: rank 0 writes step 6 to storage itself and removes the memory
    assert not os.path.exists(memdir)
    with datastates.Checkpointer(storage) as plain:
        assert [i.step for i in plain.list()] == [4, 6]
        assert_bit_exact(plain.load(), make_state(6, big=False))


def test_sigterm_makes_the_keeper_persist_and_end(shm_root, tmp_path):
    storage = tmp_path / "ckpt"
    tier = _tier(shm_root, tmp_path, persist_every=None, grace_s=60)
    ck = datastates.Checkpointer(storage, _config(tier))
    memdir = place.memory_dir(shm_root, str(storage))
    for step in (1, 2, 3):
        ck.save(make_state(step, big=False), step=step)
    ck.wait()
    with pytest.raises(datastates.KeeperError, match="attached"):  # the trainer's job
        ask(memdir, "persist")
    os.kill(ck.tiers.link.keeper_pid, signal.SIGTERM)
    with pytest.raises(datastates.KeeperError, match="ending"):  # no new trainer is taken
        datastates.Checkpointer(storage, _config(tier))
    ck.close()  # the last trainer detaches: the keeper persists step 3 and ends
    assert _gone(memdir)
    with datastates.Checkpointer(storage) as plain:
        assert [i.step for i in plain.list()] == [3]
        assert_bit_exact(plain.load(), make_state(3, big=False))


def test_shard_files_are_recycled_and_hold_nothing_of_the_old_one(shm_root, tmp_path):
    """A removed memory checkpoint's shard file becomes the next save's (no page allocation);
    a larger old file under a smaller state with objects: every byte the new save does not
    write is zero, so the reused file verifies as a new one would, and restores exactly."""
    from datastates.memory.recycle import SPARE
    from datastates.restore.reader import Reader

    storage = tmp_path / "ckpt"
    tier = _tier(shm_root, tmp_path, persist_every=None)
    memdir = place.memory_dir(shm_root, str(storage))
    big = {"w": torch.full((3 << 20,), 7.0)}
    small = {"a": torch.arange(1000.0), "obj": {"k": [1, 2, 3]}, "b": torch.ones(5, 3)}
    with datastates.Checkpointer(storage, _config(tier)) as ck:
        ck.save(big, step=1).wait()
        first = os.stat(os.path.join(ck.memory.list()[0].path, "rank-00000.dsf")).st_ino
        ck.save(small, step=2).wait()  # step 1 removed: its file is the spare
        assert os.stat(os.path.join(memdir, SPARE, "rank-00000.dsf")).st_ino == first
        ck.save(small, step=3).wait()  # takes step 1's file; step 2's becomes the spare
        newest = ck.memory.list()[-1]
        path = os.path.join(newest.path, "rank-00000.dsf")
        assert os.stat(path).st_ino == first and os.path.getsize(path) < 3 << 20
        with Reader(newest.path, registry=datastates.ProviderRegistry.default()) as reader:
            assert reader.verify_all() == os.path.getsize(path)  # zero gaps, every checksum
        live = {"a": torch.zeros(1000), "obj": None, "b": torch.zeros(5, 3)}
        ck.restore(live)
        assert_bit_exact(live, small)


def _in_a_small_tmpfs(mount: str, size: str, command: list[str]) -> list[str]:
    """``command`` in a mount namespace of its own in which ``mount`` is a tmpfs of ``size``
    (the mount goes with the namespace's last process: the trainer and the keeper it starts)."""
    return [
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        'mount -t tmpfs -o size="$1",mode=700 tmpfs "$2" && shift 2 && exec "$@"',
        "sh",
        size,
        mount,
        *command,
    ]


def test_a_full_memory_root_fails_the_save_and_the_trainer_lives_on(shm_root, tmp_path):
    """The memory root is a tmpfs of 8 MiB: step 1 (4 MiB) fits, step 2 (24 MiB) does not. A
    save to disk that fills it fails with ENOSPC; so must a save captured in place into the
    mapped shard file, where a page the tmpfs cannot give is a SIGBUS in the copy, which would
    kill the trainer. The trainer lives on: step 2 fails with CheckpointWriteError (ENOSPC),
    memory holds step 1 alone, bit-exact, and the keeper ends with its memory."""
    mount = os.path.join(shm_root, "small")
    os.mkdir(mount)
    if (
        shutil.which("unshare") is None
        or subprocess.run(_in_a_small_tmpfs(mount, "1m", ["true"]), capture_output=True).returncode
        != 0
    ):
        pytest.skip(
            "no mount namespace with a tmpfs of its own here (needs unshare and CAP_SYS_ADMIN)"
        )
    storage, log = tmp_path / "ckpt", tmp_path / "keeper.log"
    memdir = place.memory_dir(mount, str(storage))
    command = [sys.executable, CHILD, str(storage), mount, str(log), "full", "0", "0"]
    try:
        proc = subprocess.run(
            _in_a_small_tmpfs(mount, "8m", command), capture_output=True, cwd=HERE, timeout=120
        )
    finally:
        if _serving(memdir):  # the trainer died: its keeper (in that namespace) still serves
            ask(memdir, "stop")
        assert _gone(memdir)
    assert proc.returncode == 0, (proc.returncode, proc.stderr[-3000:])
    assert b"FAILED CheckpointWriteError 28" in proc.stdout and b"RESTORED 1" in proc.stdout, (
        proc.stdout
    )
    assert not os.listdir(mount)  # everything was inside the tmpfs, gone with it


def test_a_reused_shard_file_keeps_no_old_byte(tmp_path):
    from datastates.storage.posix import ReusedShardWriter

    path = tmp_path / "rank-00000.dsf"
    path.write_bytes(b"\xff" * 50_000)
    writer = ReusedShardWriter(str(path), "buffered")
    writer.write(memoryview(b"\x01" * 100), 4096)
    writer.write(memoryview(b"\x02" * 10), 20_000)
    writer.write(memoryview(b"\x03" * 8), 0)
    writer.finish(False, 30_000)
    writer.close()
    data = path.read_bytes()
    assert len(data) == 30_000
    assert data == (
        b"\x03" * 8
        + bytes(4088)
        + b"\x01" * 100
        + bytes(20_000 - 4196)
        + b"\x02" * 10
        + bytes(30_000 - 20_010)
    )


def test_a_mapped_shard_file_keeps_no_old_byte_even_with_a_view_left(tmp_path):
    """An old file of 0xff under a new layout: the units' region is written through the mapping,
    a blob and the header through write(); every other byte is zero after finish(), also when a
    view of the mapping is still alive then (the mapping goes with it)."""
    from datastates.save.planning import plan_layout
    from datastates.memory.recycle import MappedShardWriter, Mappings

    path = tmp_path / "rank-00000.dsf"
    path.write_bytes(b"\xff" * 60_000)
    layout = plan_layout([100, 9000], [10], 8192)
    mappings = Mappings()
    writer = MappedShardWriter(str(path), layout, reused=True, mappings=mappings)
    kept = None
    for unit in layout.units:
        view = writer.unit_view(unit.file_offset, -(-unit.nbytes // 4096) * 4096)
        view.zero_()
        for item, _, at, nbytes in unit.pieces:
            view[at : at + nbytes] = 1 + item
        kept = view
    writer.write(memoryview(b"\x09" * 10), layout.blob_offsets[0])
    writer.write(memoryview(b"\x03" * 8), 0)
    size = layout.blob_offsets[0] + 10 + 5
    writer.finish(False, size)
    writer.close()
    expected = bytearray(size)
    expected[:8] = b"\x03" * 8
    for unit in layout.units:
        for item, _, start, nbytes in unit.pieces:
            at = unit.file_offset + start
            expected[at : at + nbytes] = bytes([1 + item]) * nbytes
    expected[layout.blob_offsets[0] : layout.blob_offsets[0] + 10] = b"\x09" * 10
    assert path.read_bytes() == bytes(expected)
    assert len(mappings) == 1  # kept for the next save of this file
    mappings.close()
    assert len(mappings) == 0
    assert int(kept[0]) in (0, 1, 2)  # still mapped while a view lives
    del kept


def test_memory_saves_are_captured_in_place_without_a_host_cache(shm_root, tmp_path):
    """Memory saves of a CPU state (contiguous, transposed, stepped, fp16, a subclass of a view)
    copy straight into the shard files: the host cache is never allocated; they restore
    bit-exact. A save to storage then allocates it and goes through it."""
    storage = tmp_path / "ckpt"
    base = torch.arange(24000, dtype=torch.float32).reshape(40, 600)
    state = {
        "c": base.clone(),
        "t": base.t(),
        "s": base[:, ::7],
        "h": base.half()[3:, 5:],
        "i": torch.arange(70000, dtype=torch.int64),
        "obj": {"k": 3},
    }
    tier = _tier(shm_root, tmp_path, persist_every=None)
    with datastates.Checkpointer(storage, _config(tier)) as ck:
        handles = [ck.save(state, step=s) for s in (1, 2, 3)]
        ck.wait()
        assert [h._job.in_place for h in handles] == [True, True, True]
        assert ck.storage._pipeline.cache.nslots == 0  # never sized: nothing went through it
        live = {
            k: (torch.zeros_like(v) if isinstance(v, torch.Tensor) else None)
            for k, v in state.items()
        }
        report = ck.restore(live)
        assert (report.tier, report.step) == ("memory", 3)
        assert_bit_exact(live, state)
        tagged = ck.save(state, tag="best", persist=True)
        tagged.wait()
        assert not tagged._job.in_place and ck.storage._pipeline.cache.nslots > 0
    with datastates.Checkpointer(storage) as plain:
        assert_bit_exact(plain.load(tag="best"), state)


def test_the_keeper_command(shm_root, tmp_path, capsys):
    """``datastates keeper DIR --status / --persist / --stop`` on the keeper a trainer started;
    without one, exit 1 and one line naming the directory."""
    import json
    from datastates.tools import cli

    storage = tmp_path / "ckpt"
    memdir = place.memory_dir(shm_root, str(storage))
    tier = _tier(shm_root, tmp_path, persist_every=None)
    ck = datastates.Checkpointer(storage, _config(tier))
    ck.save(make_state(1, big=False), step=1).wait()
    capsys.readouterr()
    args = [str(storage), "--root", shm_root]
    assert cli.main(["keeper", *args, "--status"]) == 0
    status = json.loads(capsys.readouterr().out)
    assert status["pid"] == ck.tiers.link.keeper_pid and status["attached"] == 1
    ck.close()  # detached: the keeper wrote step 1 to storage and waits for a trainer
    assert cli.main(["keeper", *args, "--persist"]) == 0  # nothing newer to write
    assert json.loads(capsys.readouterr().out)["persisted"] is None
    assert cli.main(["keeper", *args, "--stop"]) == 0
    assert _gone(memdir)
    assert cli.main(["keeper", *args, "--status"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: no keeper serves") and memdir in err
    with datastates.Checkpointer(storage) as plain:
        assert [i.step for i in plain.list()] == [1]


# ---------------------------------------------------------------- no growth
def test_hundreds_of_memory_snapshots_do_not_grow(shm_root, tmp_path):
    storage = tmp_path / "ckpt"
    tier = _tier(shm_root, tmp_path, persist_every=None, keep_last=2)
    state = {"w": torch.zeros(64 << 10), "step": 0}
    with datastates.Checkpointer(storage, _config(tier)) as ck:
        memroot = os.path.join(place.memory_dir(shm_root, str(storage)), place.CKPT)
        counts = []
        for step in range(1, 301):
            state["w"].fill_(step)
            state["step"] = step
            ck.save(state, step=step)
            if step in (50, 300):
                ck.wait()
                with open("/proc/self/maps") as f:  # the shard files captured in place
                    mapped = sum(1 for line in f if os.path.dirname(memroot) in line)
                counts.append(
                    (len(os.listdir("/proc/self/fd")), sorted(os.listdir(memroot)), mapped)
                )
        assert counts[0][0] == counts[1][0], counts  # no descriptor left open per save
        # no mapping left per save: the shard files' mappings are kept for the next save of
        # the same file (the two committed and the one written), and go with the Checkpointer
        assert counts[0][2] == counts[1][2] <= 3, counts
        entries = [e for e in counts[1][1] if not e.startswith(".owner.")]
        assert entries == ["latest", "step-0000000299", "step-0000000300"], entries
        live = {"w": torch.zeros(64 << 10), "step": -1}
        assert ck.restore(live).step == 300 and live["step"] == 300
        assert torch.equal(live["w"], torch.full((64 << 10,), 300.0))
    with open("/proc/self/maps") as f:  # closed: no mapping of the memory is left
        assert not [line for line in f if os.path.dirname(memroot) in line]


# ---------------------------------------------------------------- another user
NOBODY = 65534
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="acting as a second user needs root")


def _as_nobody(work) -> tuple[int, int]:
    """Fork a child that becomes uid/gid ``NOBODY`` and runs ``work(ready_fd)``; it exits 0 if
    ``work`` returns True. Returns (pid, the read end that ``work`` writes a byte to)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no pytest, no threads of its own; only sockets
        code = 1
        try:
            os.close(r)
            os.setgid(NOBODY)
            os.setuid(NOBODY)
            code = 0 if work(w) else 1
        finally:
            os._exit(code)
    os.close(w)
    return pid, r


@needs_root
def test_a_keeper_socket_held_by_another_user_is_refused(shm_root, tmp_path):
    """Another user listens on the keeper's abstract address first (the abstract namespace has
    no permissions): the trainer refuses to attach (KeeperError naming the uid), and writes
    nothing into the memory directory."""
    import socket

    storage = tmp_path / "ckpt"
    memdir = place.memory_dir(shm_root, str(storage))

    def impostor(ready: int) -> bool:
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(place.socket_address(memdir))
        server.listen(4)
        os.write(ready, b"x")
        while True:  # held until the parent kills it
            server.accept()

    pid, ready = _as_nobody(impostor)
    try:
        assert os.read(ready, 1) == b"x"
        with pytest.raises(datastates.KeeperError, match=f"held by uid {NOBODY}"):
            datastates.Checkpointer(storage, _config(_tier(shm_root, tmp_path)))
    finally:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
    assert not place.keeper_running(memdir) and os.listdir(memdir) in ([], [place.LOCK])
    shutil.rmtree(memdir)


@needs_root
def test_the_keeper_refuses_a_connection_of_another_user(shm_root, tmp_path):
    """Another user connects to a running keeper and asks to attach: the keeper closes the
    connection without an answer and logs the uid; the trainer attached to it is unaffected."""
    import socket

    storage, log = tmp_path / "ckpt", tmp_path / "keeper.log"
    memdir = place.memory_dir(shm_root, str(storage))
    tier = _tier(shm_root, tmp_path, persist_every=None, persist_on_exit=False)
    with datastates.Checkpointer(storage, _config(tier)) as ck:
        ck.save({"w": torch.arange(10.0)}, step=1).wait()

        def intruder(ready: int) -> bool:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.connect(place.socket_address(memdir))
            sock.settimeout(60)
            try:
                sock.sendall(b'{"op": "status"}\n{"op": "attach", "pid": 1}\n')
                return sock.recv(1 << 16) == b""  # closed, never answered
            except (ConnectionResetError, BrokenPipeError):  # closed with the request unread
                return True

        pid, ready = _as_nobody(intruder)
        _, status = os.waitpid(pid, 0)
        os.close(ready)
        assert os.waitstatus_to_exitcode(status) == 0, "the keeper answered another user"
        assert ask(memdir, "status")["attached"] == 1
        live = {"w": torch.zeros(10)}
        assert ck.restore(live).tier == "memory" and torch.equal(live["w"], torch.arange(10.0))
        ck.close(stop_keeper=True)
    assert f"refused a connection of uid {NOBODY}" in log.read_text()

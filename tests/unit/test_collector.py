"""The garbage collector's pause (datastates.collector): where the library pauses it, and that the
collector is always left as the program had it."""
from __future__ import annotations

import gc
import os
import sys
import tempfile
import threading
import time

import pytest
import torch

from datastates import Checkpointer, collector
from datastates import format as fmt
from datastates.commit.round import MemoryStore, StoreCommunicator
from datastates.errors import CorruptCheckpointError
from datastates.format import files, validate
from datastates.format.records import FileRef, RankReport, SaveRef, Verdict


@pytest.fixture(autouse=True)
def collector_enabled():
    """Every test starts with the collector enabled and leaves it so, whatever it asserts."""
    gc.enable()
    yield
    gc.enable()


def test_a_pause_disables_the_collector_and_enables_it_after():
    with collector.paused():
        assert not gc.isenabled()
    assert gc.isenabled()


def test_a_pause_leaves_a_disabled_collector_disabled():
    gc.disable()
    with collector.paused():
        assert not gc.isenabled()
    assert not gc.isenabled()


def test_a_pause_ends_when_its_block_raises():
    with pytest.raises(KeyError):
        with collector.paused():
            raise KeyError("x")
    assert gc.isenabled()


def test_nested_pauses_end_with_the_outermost():
    with collector.paused():
        with collector.paused():
            pass
        assert not gc.isenabled()
    assert gc.isenabled()


def test_overlapping_pauses_in_two_threads_end_with_the_last():
    """Thread A pauses, B pauses, A ends (still paused: B holds it), B ends (enabled)."""
    a_in, b_in, a_out = threading.Event(), threading.Event(), threading.Event()
    seen = {}

    def a():
        with collector.paused():
            a_in.set()
            b_in.wait(10)
        a_out.set()

    def b():
        a_in.wait(10)
        with collector.paused():
            b_in.set()
            a_out.wait(10)
            seen["after A ended"] = gc.isenabled()

    threads = [threading.Thread(target=a), threading.Thread(target=b)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert seen == {"after A ended": False} and gc.isenabled()


def _in_forked_child(check) -> bool:
    """``check()`` (a bool) in a child forked from this thread now."""
    pid = os.fork()
    if pid == 0:  # the child: report through the exit status only
        try:
            code = 0 if check() else 1
        except BaseException:
            code = 2
        os._exit(code)
    deadline = time.monotonic() + 60
    while True:  # a child that hangs fails the test instead of hanging it
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung")
        time.sleep(0.01)  # polling a child's exit, not synchronizing on time
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) in (0, 1), status
    return os.WEXITSTATUS(status) == 0


def _child_pauses_and_resumes() -> bool:
    if not gc.isenabled():
        return False
    with collector.paused():
        if gc.isenabled():
            return False
    return gc.isenabled()


def test_a_child_forked_while_another_thread_pauses_runs_with_the_collector():
    """A forked child has none of the parent's other threads: their pauses never end there, so
    the child must not inherit them (a DataLoader worker forked during rank 0's review would
    otherwise run without a collector for its whole life)."""
    inside, leave = threading.Event(), threading.Event()

    def hold():
        with collector.paused():
            inside.set()
            leave.wait(30)
    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert inside.wait(30) and not gc.isenabled()
        assert _in_forked_child(_child_pauses_and_resumes)
    finally:
        leave.set()
        holder.join(30)
    assert gc.isenabled()


def test_a_child_forked_inside_a_pause_resumes_when_that_pause_ends():
    """The forking thread's own pause goes on in the child, and its end there resumes the
    collector as in the parent."""
    with collector.paused():
        pid = os.fork()
        inside = gc.isenabled()
    if pid == 0:  # the child: report through the exit status only
        os._exit(0 if not inside and gc.isenabled() and _child_pauses_and_resumes() else 1)
    _, status = os.waitpid(pid, 0)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0 and gc.isenabled()


def _full_collections(block) -> list[str]:
    """The names of the threads that made a full collection while ``block()`` ran."""
    seen = []

    def callback(phase, info):
        if phase == "start" and info["generation"] == 2:
            seen.append(threading.current_thread().name)
    gc.callbacks.append(callback)
    try:
        block()
    finally:
        gc.callbacks.remove(callback)
    return seen


def _pause_leaving(n: int, kept: list) -> None:
    with collector.paused():
        kept.extend([i] for i in range(n))


def test_a_pause_that_leaves_many_objects_ends_with_a_full_collection_on_its_own_thread():
    kept: list = []
    many = collector.FULL_AFTER_OBJECTS + sys.getallocatedblocks() // 16
    seen = _full_collections(lambda: _pause_leaving(many, kept))
    assert seen == [threading.current_thread().name] and gc.isenabled()


def test_a_pause_that_leaves_few_objects_makes_no_collection():
    kept: list = []
    assert _full_collections(lambda: _pause_leaving(100, kept)) == []


def test_a_pause_in_a_disabled_collector_never_collects():
    kept: list = []
    gc.disable()
    many = collector.FULL_AFTER_OBJECTS + sys.getallocatedblocks() // 16
    assert _full_collections(lambda: _pause_leaving(many, kept)) == []
    assert not gc.isenabled()


# ---------------------------------------------------------------- where the library pauses it

def test_rank_zeros_check_runs_paused_and_its_publish_does_not():
    """The publish may wait (the memory tier's keeper, the storage): it runs with the collector
    (the manifest's encoding inside it pauses on its own)."""
    world = 3
    store = MemoryStore()
    comms = [StoreCommunicator(store, r, world, "run") for r in range(world)]
    sid = comms[0].save_id("/d", "step-1", 1)
    seen = []
    out = {}

    def rank(r):
        report = RankReport(rank=r, save=SaveRef(sid.name, sid.step, sid.nonce), root="/d",
                            file=FileRef(name=fmt.shard_file_name(r), rank=r, nbytes=4096, index_crc32=0),
                            tree={"t": "dict", "items": []})
        out[r] = comms[r].agree(
            sid, report, time.monotonic() + 10, 10,
            check=lambda reports: seen.append(("check", gc.isenabled())),
            commit=lambda reports: seen.append(("commit", gc.isenabled()))
            or Verdict.committed(None),
            fallback=lambda why: Verdict.abort("store", why, {}))

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert seen == [("check", False), ("commit", True)]
    assert out == {r: Verdict.committed(None) for r in range(world)} and gc.isenabled()


@pytest.mark.parametrize("enabled", [True, False])
def test_a_save_and_its_restore_leave_the_collector_as_they_found_it(tmp_path, enabled):
    state = {"w": torch.arange(6.0), "step": 3}
    if not enabled:
        gc.disable()
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(state, step=1).wait()
        assert gc.isenabled() is enabled
        restored = {"w": torch.zeros(6), "step": 0}
        ckpt.restore(restored, step=1)
    assert gc.isenabled() is enabled
    assert torch.equal(restored["w"], state["w"]) and restored["step"] == 3


def test_the_manifest_is_parsed_paused_and_a_damaged_one_still_resumes_it(tmp_path,
                                                                         monkeypatch):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save({"w": torch.ones(3)}, step=1).wait()
    [path] = tmp_path.glob("*/manifest.json")
    raw = path.read_bytes()
    seen = []
    parse = validate.parse_manifest
    monkeypatch.setattr(validate, "parse_manifest",
                        lambda *a, **k: seen.append(gc.isenabled()) or parse(*a, **k))
    manifest = files.parse_manifest_bytes(raw, str(path))
    assert seen == [False] and gc.isenabled() and manifest.step == 1
    with pytest.raises(CorruptCheckpointError):
        files.parse_manifest_bytes(raw[:-3] + b"xx}", str(path))
    assert gc.isenabled()


def test_a_child_forked_without_a_pause_keeps_the_programs_collector_state():
    with collector.paused():
        pass
    gc.disable()  # the program's choice after an earlier pause

    def child() -> bool:
        return not gc.isenabled()
    assert _in_forked_child(child)


def test_the_manifests_encoding_runs_paused(monkeypatch):
    seen = []
    check = validate.check_written_manifest
    monkeypatch.setattr(validate, "check_written_manifest",
                        lambda *a, **k: seen.append(gc.isenabled()) or check(*a, **k))
    with Checkpointer(tempfile.mkdtemp()) as ckpt:
        ckpt.save({"w": torch.ones(3)}, step=1).wait()
    assert seen == [False] and gc.isenabled()


# ---------------------------------------------------------------- the rule for the full collection

def test_the_full_collection_is_due_from_both_bounds(monkeypatch):
    monkeypatch.setattr(collector.sys, "getallocatedblocks", lambda: 32 * 50_000)
    assert not collector._due(collector.FULL_AFTER_OBJECTS - 1)
    assert not collector._due(49_999)  # enough objects, too small a share of the process
    assert collector._due(50_000)
    monkeypatch.setattr(collector.sys, "getallocatedblocks", lambda: 1_000)
    assert not collector._due(collector.FULL_AFTER_OBJECTS - 1)  # a large share, too few
    assert collector._due(collector.FULL_AFTER_OBJECTS)


def test_only_the_objects_made_during_the_pause_count():
    """Young objects from before the pause are not its work: no full collection for them."""
    threshold = gc.get_threshold()
    kept: list = []
    gc.set_threshold(10**9)  # nothing collects the young generation meanwhile
    try:
        kept.extend([i] for i in range(collector.FULL_AFTER_OBJECTS + sys.getallocatedblocks()))
        assert _full_collections(lambda: _pause_leaving(10, kept)) == []
    finally:
        gc.set_threshold(*threshold)


# ---------------------------------------------------------------- interruptions and signals

class _Interrupting:
    """The gc module, except that a KeyboardInterrupt arrives right after the first call of
    ``name`` returns (as a signal is delivered between two bytecodes)."""

    def __init__(self, name: str):
        self.name, self.raised = name, False

    def __getattr__(self, attr):
        real = getattr(gc, attr)
        if attr != self.name or self.raised:
            return real

        def interrupt(*args):
            real(*args)
            self.raised = True
            raise KeyboardInterrupt
        return interrupt


@pytest.mark.parametrize("name", ["isenabled", "get_count", "disable", "enable"])
def test_an_interrupt_inside_the_bookkeeping_leaves_no_pause_behind(monkeypatch, name):
    interrupting = _Interrupting(name)
    monkeypatch.setattr(collector, "gc", interrupting)
    with pytest.raises(KeyboardInterrupt):
        with collector.paused():
            pass
    assert interrupting.raised
    monkeypatch.setattr(collector, "gc", gc)
    assert collector._holders == {} and not collector._owned and gc.isenabled()
    with collector.paused():  # and the next pause works as ever
        assert not gc.isenabled()
    assert gc.isenabled()


@pytest.mark.parametrize("enabled", [True, False])
def test_an_interrupt_as_the_exit_begins_resuming_leaves_no_pause_behind(monkeypatch, enabled):
    """The exit is run again: the collector ends as the program had it, nothing owned."""
    resume, calls = collector._resume, []

    def interrupted():
        calls.append(1)
        if len(calls) == 1:
            raise KeyboardInterrupt
        resume()
    monkeypatch.setattr(collector, "_resume", interrupted)
    if not enabled:
        gc.disable()
    with pytest.raises(KeyboardInterrupt):
        with collector.paused():
            pass
    assert len(calls) == 2 and collector._holders == {} and not collector._owned
    assert gc.isenabled() is enabled


def test_a_pause_begun_inside_the_bookkeeping_of_another_does_not_deadlock(monkeypatch):
    """What a signal handler that pauses does when its thread is inside ``paused()``: the lock
    is reentrant, and both pauses end with the collector as the program had it."""
    nested = []

    class Reentering:
        def __getattr__(self, attr):
            real = getattr(gc, attr)
            if attr != "disable" or nested:
                return real

            def disable():
                nested.append(True)
                with collector.paused():
                    nested.append(gc.isenabled())
                real()
            return disable
    monkeypatch.setattr(collector, "gc", Reentering())
    done = []
    worker = threading.Thread(target=lambda: done.append(_pause_leaving(1, [])), daemon=True)
    worker.start()
    worker.join(30)
    assert done == [None] and nested == [True, False]
    monkeypatch.setattr(collector, "gc", gc)
    assert collector._holders == {} and gc.isenabled()


# ---------------------------------------------------------------- fork

def test_a_child_forked_while_a_pause_holds_a_disabled_collector_keeps_it_disabled():
    inside, leave = threading.Event(), threading.Event()

    def hold():
        with collector.paused():
            inside.set()
            leave.wait(30)
    gc.disable()  # the program's choice
    holder = threading.Thread(target=hold)
    holder.start()
    try:
        assert inside.wait(30)
        assert _in_forked_child(lambda: not gc.isenabled())
    finally:
        leave.set()
        holder.join(30)
    assert not gc.isenabled()


def test_a_child_can_pause_from_any_of_its_threads():
    """The child does not inherit the parent's lock in the state the fork found it."""
    def child() -> bool:
        out = []
        t = threading.Thread(target=lambda: out.append(_child_pauses_and_resumes()))
        t.start()
        t.join(10)
        return out == [True]
    assert _in_forked_child(child)


def test_children_forked_while_another_thread_pauses_and_resumes_never_inherit_a_pause():
    stop = threading.Event()

    def churn():
        while not stop.is_set():
            with collector.paused():
                pass
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    churner = threading.Thread(target=churn)
    churner.start()
    try:
        results = [_in_forked_child(_child_pauses_and_resumes) for _ in range(200)]
    finally:
        stop.set()
        churner.join(30)
        sys.setswitchinterval(interval)
    assert results == [True] * 200 and gc.isenabled()


def test_a_restores_and_a_loads_planning_run_paused(tmp_path, monkeypatch):
    from datastates.restore import matching
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save({"w": torch.arange(4.0), "n": 7}, step=1).wait()
    seen = []
    match = matching._Plan.match

    def recording(self, live, node, path, provider):
        if path == ():
            seen.append(gc.isenabled())
        return match(self, live, node, path, provider)
    monkeypatch.setattr(matching._Plan, "match", recording)
    live = {"w": torch.zeros(4), "n": 0}
    with Checkpointer(tmp_path) as ckpt:
        ckpt.restore(live)
        loaded = ckpt.load()
    assert seen == [False, False] and gc.isenabled()
    assert torch.equal(live["w"], torch.arange(4.0)) and live["n"] == 7
    assert torch.equal(loaded["w"], torch.arange(4.0)) and loaded["n"] == 7

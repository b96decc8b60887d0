"""The memory tier across restarts, with real processes and real signals
(docs/memory-tier.md, "When something dies"):

- storage holding a newer step than memory (a tag committed after it): ``latest()``,
  ``restore()`` and ``load()`` take storage's step, never memory's older one;
- a second trainer of the job while the first still runs is refused, naming the first's pid;
  the first's saves go on, none lost;
- a stopped keeper (SIGSTOP): a restart reads storage, with a WARNING and in the report;
- the trainer and the keeper both SIGKILLed: ``datastates keeper DIR --stop`` removes what the
  keeper left, and says what.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
import sys

import pytest

import datastates
from datastates.memory import place
from datastates.tools.keeper import ask

from _crash_child import make_state
from _faults_helpers import HERE, assert_bit_exact, zeros_like_state
from test_memory_tier import _config, _tier

TRAINER = os.path.join(HERE, "_memory_trainer_child.py")
MEMORY_CHILD = os.path.join(HERE, "_memory_child.py")


# ---------------------------------------------------------------- which tier is newer
def test_storage_s_newer_step_wins_over_memory_whatever_was_committed_after_it(shm_root, tmp_path):
    """Memory holds step 3; storage step 4, then a tag without a step and a tag of step 2
    (committed after step 4). A restart's latest(), restore() (with and without fallback) and
    load() take storage's step 4, and the resumed run's save of step 5 goes on; before, memory's
    step 3 was restored and the save of step 4 raised CheckpointExistsError."""
    storage = tmp_path / "ckpt"
    tier = _tier(
        shm_root, tmp_path, persist_every=4, storage_writer="trainer", persist_on_exit=False
    )
    with datastates.Checkpointer(storage, _config(tier)) as ck:
        for step in (1, 2, 3, 4):
            ck.save(make_state(step, big=False), step=step)
        ck.save(make_state(40, big=False), tag="final")
        ck.save(make_state(2, big=False), step=2, tag="best")
        ck.wait()
        assert [i.name for i in ck.list()] == ["step-0000000004", "final", "best"]
        assert [i.step for i in ck.memory.list()] == [3]
    with datastates.Checkpointer(storage, _config(tier)) as ck:  # the restart
        newest = ck.latest()
        assert (newest.name, newest.path) == ("step-0000000004", str(storage / "step-0000000004"))
        for fallback in (False, True):
            live = zeros_like_state(make_state(0, big=False))
            report = ck.restore(live, fallback=fallback)
            assert (report.step, report.tier) == (4, "storage"), report
            assert_bit_exact(live, make_state(4, big=False))
        assert_bit_exact(ck.load(), make_state(4, big=False))
        assert_bit_exact(ck.load(fallback=True), make_state(4, big=False))
        ck.save(make_state(5, big=False), step=report.step + 1).wait()
        assert ck.latest().step == 5 and ck.latest().path.startswith(shm_root)


# ---------------------------------------------------------------- one trainer per job's memory
def test_a_second_trainer_of_the_job_is_refused_while_the_first_runs(shm_root, tmp_path):
    """A trainer (another process) holds steps 1 and 2 in memory and still runs. A second
    trainer of the job is refused with KeeperError naming the first's pid, and nothing of the
    memory changes: the first saves step 3, and memory holds steps 2 and 3, intact. Once the
    first has ended, a restart is accepted and restores its step 3 from memory, bit-exact."""
    storage = tmp_path / "ckpt"
    first = subprocess.Popen(
        [sys.executable, TRAINER, str(storage), shm_root, str(tmp_path / "keeper.log")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=HERE,
    )
    try:
        assert first.stdout.readline() == b"COMMITTED 2\n", first.stderr.read()[-3000:]
        tier = _tier(shm_root, tmp_path, persist_every=None, persist_on_exit=False, keep_last=2)
        with pytest.raises(datastates.KeeperError, match=f"trainer pid {first.pid} is attached"):
            datastates.Checkpointer(storage, _config(tier))
        out, err = first.communicate(b"go\n", timeout=120)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == 0 and out == b"COMMITTED 3\nINTACT 3\n", err[-3000:]
    with datastates.Checkpointer(storage, _config(tier)) as ck:
        live = zeros_like_state(make_state(0, big=False))
        report = ck.restore(live)
        assert (report.step, report.tier) == (3, "memory")
        assert_bit_exact(live, make_state(3, big=False))


# ---------------------------------------------------------------- a stopped keeper
def test_a_stopped_keeper_makes_the_restart_read_and_write_storage(shm_root, tmp_path, caplog):
    """The keeper is stopped (SIGSTOP) while no trainer is attached; memory holds step 2,
    storage step 1. The restart does not fail: construction gives up on the keeper after
    start_timeout_s with a WARNING, latest() and restore() read storage's step 1 (bit-exact,
    the reason in report.tier_fallback), and saves go to storage. The memory is left as it
    was; continued, the keeper still serves it."""
    storage = tmp_path / "ckpt"
    memdir = place.memory_dir(shm_root, str(storage))
    tier = _tier(shm_root, tmp_path, persist_every=None, persist_on_exit=False)
    with datastates.Checkpointer(storage, _config(tier)) as ck:
        ck.save(make_state(1, big=False), step=1, persist=True)
        ck.save(make_state(2, big=False), step=2)
        ck.wait()
    keeper = ask(memdir, "status")["pid"]
    held = sorted(os.listdir(os.path.join(memdir, place.CKPT)))
    assert "step-0000000002" in held
    os.kill(keeper, signal.SIGSTOP)
    try:
        stalled = dataclasses.replace(tier, start_timeout_s=2)
        with caplog.at_level(logging.WARNING, logger="datastates"):
            ck = datastates.Checkpointer(storage, _config(stalled))
        assert "the memory tier is not used" in caplog.text and memdir in caplog.text
        with ck:
            assert ck.latest().name == "step-0000000001"
            live = zeros_like_state(make_state(0, big=False))
            report = ck.restore(live)
            assert (report.step, report.tier) == (1, "storage")
            assert "did not answer" in report.tier_fallback
            assert_bit_exact(live, make_state(1, big=False))
            ck.save(make_state(2, big=False), step=2).wait()  # memory is not written
        assert [i.step for i in datastates.Checkpointer(storage).list()] == [1, 2]
        assert sorted(os.listdir(os.path.join(memdir, place.CKPT))) == held
    finally:
        os.kill(keeper, signal.SIGCONT)
    assert ask(memdir, "status")["pid"] == keeper


# ---------------------------------------------------------------- what a killed keeper left
def test_stop_without_a_keeper_removes_what_a_killed_keeper_left(shm_root, tmp_path, capsys):
    """The trainer (steps 1 and 2 in memory, nothing in storage) and then its keeper are
    SIGKILLed. ``datastates keeper DIR --stop`` finds no keeper: it writes step 2 to storage,
    removes the memory the keeper left and prints what it removed. A file the keeper did not
    write keeps the directory (named in a WARNING), and another job's memory beside it is left
    alone."""
    import json
    from datastates.tools import cli

    storage = tmp_path / "ckpt"
    proc = subprocess.Popen(
        [
            sys.executable,
            MEMORY_CHILD,
            str(storage),
            shm_root,
            str(tmp_path / "keeper.log"),
            "die",
            "0",
            "0",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=HERE,
    )
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == -signal.SIGKILL and b"COMMITTED 2" in out, err[-3000:]
    memdir = place.memory_dir(shm_root, str(storage))
    while ask(memdir, "status")["attached"]:  # until the keeper has handled the death
        os.sched_yield()
    keeper = ask(memdir, "status")["pid"]
    os.kill(keeper, signal.SIGKILL)
    while place.keeper_running(memdir):  # the kernel releases its lock as it reaps it
        os.sched_yield()
    other = place.memory_dir(shm_root, str(tmp_path / "other"))  # another job's memory
    os.mkdir(other, 0o700)
    (tmp_path / "foreign").mkdir()
    args = ["keeper", str(storage), "--root", shm_root, "--stop"]
    left = os.path.join(memdir, "notes.txt")
    with open(left, "w") as f:
        f.write("not the keeper's")
    capsys.readouterr()
    assert cli.main(args) == 0
    reply = json.loads(capsys.readouterr().out)
    assert reply["persisted"] == "step-0000000002"
    assert sorted(reply["removed"]) == sorted(
        os.path.join(memdir, n) for n in ("ckpt", "keeper.lock", "node.json", "spare", "verified")
    ), reply
    assert os.listdir(memdir) == ["notes.txt"] and os.path.isdir(other)
    os.unlink(left)
    assert cli.main(args) == 0  # nothing the keeper wrote is left: the directory goes
    assert json.loads(capsys.readouterr().out)["removed"] == [memdir]
    assert not os.path.exists(memdir) and os.path.isdir(other)
    os.rmdir(other)
    with datastates.Checkpointer(storage) as plain:
        assert [i.step for i in plain.list()] == [2]
        assert_bit_exact(plain.load(), make_state(2, big=False))

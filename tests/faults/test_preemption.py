"""Preemption (datastates.Preemption, docs/preemption.md): a real signal sent to a training
process (``_preempt_child.py``) in the middle of a step or while a save is in flight ends it with
the signal's status, after the newest step that save() was called for is committed; that step
restores bit-exactly. At 1 and 2 ranks, with the final save, the previous handler, and the grace
period. The child is paced through its stdin and reports on its stdout, so every signal lands at
a known point; nothing waits on time.

The last tests run the handler in this process (signals raised on the main thread), for what
needs no subprocess: the agreement of one rank, a repeated signal, the arguments' checks.
"""

from __future__ import annotations

import importlib.util
import os
import re
import signal
import subprocess
import sys
import threading

import pytest

import datastates

from _faults_helpers import HERE, WAIT_S, free_port
import zygote

CHILD = os.path.join(HERE, "_preempt_child.py")
_spec = importlib.util.spec_from_file_location("_datastates_preempt_child", CHILD)
preempt_child = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(preempt_child)


class Child:
    """One training process: its stdout lines, its stdin gate, the pipe holding a commit."""

    def __init__(self, root, *args: str, env: dict | None = None, hold: int | None = None):
        self.hold_r, self.hold_w = os.pipe() if hold is not None else (None, None)
        extra = ["--hold", str(hold), "--hold-fd", str(self.hold_r)] if hold is not None else []
        self.stderr = open(os.path.join(os.fspath(root) + f".stderr.{id(self)}"), "w+")
        # forked from the session's zygote (tests/zygote.py): torch is already imported
        self.proc = zygote.Process(
            [sys.executable, CHILD, os.fspath(root), *args, *extra],
            cwd=HERE,
            text=True,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
            env={**os.environ, **(env or {})},
            pass_fds=(self.hold_r,) if hold is not None else (),
        )
        self.lines: list[list[str]] = []

    def read(self) -> list[str] | None:
        """The next line's words, or None at the end of its output."""
        line = self.proc.stdout.readline()
        if not line:
            return None
        self.lines.append(line.split())
        return self.lines[-1]

    def read_until(self, word: str) -> list[str] | None:
        while (words := self.read()) is not None and words[0] != word:
            pass
        return words

    def go(self) -> None:
        """Let the child go on past its ``step`` line."""
        try:
            self.proc.stdin.write("go\n")
            self.proc.stdin.flush()
        except BrokenPipeError:  # it ended: its return code and output say why
            pass

    def kill(self, signum: int) -> None:
        os.kill(self.proc.pid, signum)

    def release(self) -> None:
        os.write(self.hold_w, b"x")

    def finish(self) -> int:
        """Read the rest of the output, wait for the end; the return code."""
        while self.read() is not None:
            pass
        rc = self.proc.wait(timeout=WAIT_S)
        for fd in (self.hold_r, self.hold_w):
            if fd is not None:
                os.close(fd)
        return rc

    def log(self) -> str:
        self.stderr.seek(0)
        return f"stdout: {self.lines}\nstderr: {self.stderr.read()[-4000:]}"

    def saved(self) -> dict[int, str]:
        """{step: sha256} of every save() called."""
        return {int(w[1]): w[2] for w in self.lines if w[0] == "saved"}

    def said(self, word: str) -> list[int]:
        return [int(w[1]) for w in self.lines if w[0] == word]


def drive(child: Child, at: dict) -> int:
    """Answer the child until it ends. ``at[(word, step)](child)`` runs when that line comes;
    after a ``step`` line the child is let go on unless its action returned False."""
    while (words := child.read()) is not None:
        action = at.get((words[0], int(words[1]))) if len(words) > 1 else None
        go_on = action(child) if action is not None else None
        if words[0] == "step" and go_on is not False:
            child.go()
    return child.finish()


def send(signum: int, go_on: bool = True):
    def action(child: Child):
        child.kill(signum)
        return go_on

    return action


def restored_digest(root, step: int) -> str:
    """The sha256 of a fresh model and optimizer restored from ``step``."""
    model, opt = preempt_child.build()
    with datastates.Checkpointer(root) as ckpt:
        ckpt.restore({"model": model, "optim": opt}, step=step, rank_policy="rank0")
    return preempt_child.digest(model, opt)


def assert_newest_committed(root, child: Child) -> int:
    """The newest step save() was called for is the latest committed one, and restores to the
    state the child saved, bit for bit; returns it."""
    newest = max(child.saved())
    latest = datastates.Checkpointer(root).latest()
    assert latest is not None and latest.step == newest, (latest, child.log())
    assert restored_digest(root, newest) == child.saved()[newest]
    return newest


# ---------------------------------------------------------------- one rank
def test_signal_mid_step_ends_with_its_status_after_the_newest_save(tmp_path):
    child = Child(tmp_path / "ckpt")  # saves steps 0, 2, 4...
    rc = drive(child, {("step", 3): send(signal.SIGTERM)})
    assert rc == -signal.SIGTERM, child.log()
    assert child.said("stop") == [3] and child.said("step")[-1] == 3
    assert assert_newest_committed(tmp_path / "ckpt", child) == 2


def test_the_final_save_of_the_current_step_commits(tmp_path):
    child = Child(tmp_path / "ckpt", "--final")
    rc = drive(child, {("step", 3): send(signal.SIGUSR1)})
    assert rc == -signal.SIGUSR1, child.log()
    assert sorted(child.saved()) == [0, 2, 3]
    assert assert_newest_committed(tmp_path / "ckpt", child) == 3


def test_signal_while_a_save_is_in_flight(tmp_path):
    """In the middle of step 3, once the commit of step 2 waits on its pipe, the signal comes;
    only then is the commit let go on: exit() waits for it."""
    child = Child(tmp_path / "ckpt", hold=2)

    def signal_then_release(c: Child):
        if c.said("held") == []:  # the commit thread may have said it before "step 3"
            assert c.read_until("held") == ["held", "2"], c.log()
        c.kill(signal.SIGTERM)
        c.release()

    rc = drive(child, {("step", 3): signal_then_release})
    assert rc == -signal.SIGTERM, child.log()
    assert child.said("stop") == [3]
    assert assert_newest_committed(tmp_path / "ckpt", child) == 2


def test_the_previous_python_handler_is_called(tmp_path):
    """The child's own SIGTERM handler (installed first) is called by exit(): it raises
    SystemExit(3), after the final save committed."""
    child = Child(tmp_path / "ckpt", "--final", "--previous")
    rc = drive(child, {("step", 3): send(signal.SIGTERM)})
    assert rc == 3, child.log()
    assert child.said("previous") == [signal.SIGTERM]
    assert assert_newest_committed(tmp_path / "ckpt", child) == 3


def test_past_the_grace_period_the_signal_is_passed_on_without_a_safe_point(tmp_path):
    """The loop never reaches its safe point (it waits on stdin for good): once the grace period
    is over, the process ends with the signal's status; what was committed before stays."""
    child = Child(tmp_path / "ckpt", "--sync", "--grace", "0.2")
    rc = drive(child, {("step", 3): send(signal.SIGTERM, go_on=False)})
    assert rc == -signal.SIGTERM, child.log()
    assert child.said("stop") == []
    assert assert_newest_committed(tmp_path / "ckpt", child) == 2
    assert "grace period of 0.2 s" in child.log()


def test_a_second_preemption_on_the_same_checkpointer_starts_clean(tmp_path):
    """The first Preemption gets a real SIGTERM at step 3, commits and passes it on to the
    child's own handler, which returns; a second Preemption on the same Checkpointer, SIGTERM's
    default action restored, then sees no stop for four steps, and its close() raises nothing:
    the process ends with 0."""
    child = Child(tmp_path / "ckpt", "--twice", "--steps", "4")
    rc = drive(child, {("step", 3): send(signal.SIGTERM)})
    assert rc == 0, child.log()
    assert child.said("stop") == [3] and child.said("passed") == [signal.SIGTERM]
    assert child.said("step") == list(range(8)) and child.lines[-1] == ["closed"], child.log()
    assert assert_newest_committed(tmp_path / "ckpt", child) == 6


# ---------------------------------------------------------------- two ranks
def run_two_ranks(
    root, signals: dict[tuple[int, int], int], *args: str, hold: int | None = None
) -> tuple[list[Child], list[int]]:
    """Two gloo ranks (rank 0 hosts the TCPStore), paced step by step together;
    ``signals[(rank, step)]`` is sent to that rank in the middle of that step. With ``hold``,
    each rank's commit of that step waits until its signal was sent."""
    port = str(free_port())
    children = [
        Child(
            root,
            "--final",
            *args,
            hold=hold,
            env={
                "RANK": str(r),
                "WORLD_SIZE": "2",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": port,
            },
        )
        for r in range(2)
    ]
    while True:
        at = [c.read_until("step") for c in children]
        if at[0] is None or at[1] is None:
            break
        assert at[0] == at[1], (at, children[0].log(), children[1].log())
        for rank, child in enumerate(children):
            signum = signals.get((rank, int(at[rank][1])))
            if signum is not None and hold is not None and child.said("held") == []:
                assert child.read_until("held") == ["held", str(hold)], child.log()
            if signum is not None:
                child.kill(signum)
            if signum is not None and hold is not None:
                child.release()
        for child in children:
            child.go()
    return children, [c.finish() for c in children]


def test_two_ranks_signalled_at_different_steps_stop_at_the_same_one(tmp_path):
    """The save of step 3 is in flight on both ranks (its commit held) when rank 1 is signalled,
    in step 4, and rank 0, in step 5: both stop at step 5 (rank 1's step + 1), and the final
    save of step 5 commits, after that of step 3."""
    children, rcs = run_two_ranks(
        tmp_path / "ckpt", {(1, 4): signal.SIGTERM, (0, 5): signal.SIGTERM}, "--every", "3", hold=3
    )
    assert rcs == [-signal.SIGTERM] * 2, [c.log() for c in children]
    assert [c.said("stop") for c in children] == [[5], [5]]
    assert children[0].saved() == children[1].saved()  # the ranks hold the same state
    assert sorted(children[0].saved()) == [0, 3, 5]
    assert assert_newest_committed(tmp_path / "ckpt", children[0]) == 5
    assert [i.step for i in datastates.Checkpointer(tmp_path / "ckpt").list()] == [0, 3, 5]


def test_a_rank_never_signalled_stops_with_the_others_and_passes_their_signal_on(tmp_path):
    children, rcs = run_two_ranks(tmp_path / "ckpt", {(1, 3): signal.SIGUSR1}, "--every", "100")
    assert rcs == [-signal.SIGUSR1] * 2, [c.log() for c in children]
    assert [c.said("stop") for c in children] == [[4], [4]]
    assert assert_newest_committed(tmp_path / "ckpt", children[0]) == 4


def test_two_ranks_start_clean_with_a_second_preemption(tmp_path):
    """Rank 1 is signalled in step 3, both ranks stop at step 4 and pass SIGTERM on to their own
    handler, which returns; a second Preemption on each rank's Checkpointer sees no stop (the
    first one's plan is not its own) and both processes end with 0."""
    children, rcs = run_two_ranks(
        tmp_path / "ckpt", {(1, 3): signal.SIGTERM}, "--twice", "--every", "100", "--steps", "5"
    )
    assert rcs == [0, 0], [c.log() for c in children]
    assert [c.said("stop") for c in children] == [[4], [4]]
    assert [c.said("passed") for c in children] == [[signal.SIGTERM]] * 2
    assert [c.said("step")[-1] for c in children] == [9, 9]
    assert [c.lines[-1] for c in children] == [["closed"]] * 2
    assert assert_newest_committed(tmp_path / "ckpt", children[0]) == 4


# ---------------------------------------------------------------- in this process
@pytest.fixture
def recorded():
    """A Python SIGUSR1 handler recording its calls, installed before the Preemption."""
    calls: list[int] = []
    before = signal.signal(signal.SIGUSR1, lambda signum, frame: calls.append(signum))
    yield calls
    signal.signal(signal.SIGUSR1, before)


def test_one_rank_stops_at_the_step_of_the_signal_and_passes_it_on_once(tmp_path, recorded):
    with datastates.Checkpointer(tmp_path / "ckpt") as ckpt:
        stop = datastates.Preemption(ckpt, signals=[signal.SIGUSR1])
        assert not stop.requested(4) and stop.signum is None and stop.time_left() is None
        signal.raise_signal(signal.SIGUSR1)
        signal.raise_signal(signal.SIGUSR1)  # before the deadline: changes nothing
        assert recorded == [] and stop.signum == signal.SIGUSR1
        assert stop.requested(5) and stop.stop_step == 5 and stop.requested(6)
        assert 0.0 < stop.time_left() <= stop.grace_s
        stop.exit()
        assert recorded == [signal.SIGUSR1]  # the previous handler, once, and back in place
        stop.exit()
        stop.close()
        assert recorded == [signal.SIGUSR1]
    signal.raise_signal(signal.SIGUSR1)
    assert recorded == [signal.SIGUSR1] * 2


def test_close_without_a_signal_puts_the_previous_handler_back(tmp_path, recorded):
    previous = signal.getsignal(signal.SIGUSR1)
    with datastates.Checkpointer(tmp_path / "ckpt") as ckpt:
        with datastates.Preemption(ckpt, signals=[signal.SIGUSR1]):
            assert signal.getsignal(signal.SIGUSR1) is not previous
        assert signal.getsignal(signal.SIGUSR1) is previous and recorded == []
        assert "datastates-preemption" not in [t.name for t in threading.enumerate()]


def test_a_signal_is_not_dropped_by_close(tmp_path, recorded):
    with datastates.Checkpointer(tmp_path / "ckpt") as ckpt:
        with datastates.Preemption(ckpt, signals=[signal.SIGUSR1]):
            signal.raise_signal(signal.SIGUSR1)
        assert recorded == [signal.SIGUSR1]


def test_a_plan_set_by_another_rank_is_validated_and_its_signal_passed_on(tmp_path, recorded):
    usr1 = int(signal.SIGUSR1)
    with datastates.Checkpointer(tmp_path / "ckpt") as ckpt:
        with datastates.Preemption(ckpt, signals=[signal.SIGUSR1]) as stop:
            assert stop.plan_key == "preemption/1/stop"  # the first one on this store
            ckpt.comm.store.set(stop.plan_key, f'{{"step": -1, "signum": {usr1}, "rank": 1}}')
            with pytest.raises(datastates.DatastatesError, match="'preemption/1/stop'.*step"):
                stop.requested(0)
            ckpt.comm.store.set(stop.plan_key, f'{{"step": 7, "signum": {usr1}, "rank": 1}}')
            assert not stop.requested(6) and stop.requested(7) and stop.signum == usr1
            assert stop.time_left() is None  # no signal reached this rank: no deadline here
        assert recorded == [usr1]  # close() passed the plan's signal on


def test_a_preemption_leaves_no_plan_in_the_store(tmp_path, recorded):
    """Its keys go at exit(); the next one on the same Checkpointer has keys of its own."""
    usr1 = int(signal.SIGUSR1)
    with datastates.Checkpointer(tmp_path / "ckpt") as ckpt:
        with datastates.Preemption(ckpt, signals=[signal.SIGUSR1]) as stop:
            signal.raise_signal(signal.SIGUSR1)
            assert stop.requested(2) and stop.plan_key == "preemption/1/stop"
            stop.exit()
        assert recorded == [usr1]
        assert [k for k in ckpt.comm.store.list_keys() if k.startswith("preemption/")] == [
            "preemption/made/r0"
        ]
        with datastates.Preemption(ckpt, signals=[signal.SIGUSR1]) as again:
            assert not again.requested(3) and again.signum is None and again.stop_step is None
            assert again.plan_key == "preemption/2/stop"
        assert recorded == [usr1]


def test_a_second_open_preemption_of_the_process_is_refused(tmp_path, recorded):
    """Signals are the process's: a second open Preemption would pass a signal on to the first,
    which would take it as its own and keep training. Refused until the first is closed."""
    with (
        datastates.Checkpointer(tmp_path / "a") as ckpt,
        datastates.Checkpointer(tmp_path / "b") as other,
    ):
        first = datastates.Preemption(ckpt, signals=[signal.SIGUSR1])
        for target in (ckpt, other):
            with pytest.raises(
                datastates.ConfigError,
                match=re.escape(
                    "Preemption(): expected no other open Preemption handling SIGUSR1 in this "
                    f"process, found one on {ckpt.directory}; close() it first"
                ),
            ):
                datastates.Preemption(target, signals=[signal.SIGTERM, signal.SIGUSR1])
        first.close()
        with datastates.Preemption(other, signals=[signal.SIGUSR1]) as second:
            signal.raise_signal(signal.SIGUSR1)
            assert second.requested(0) and second.signum == signal.SIGUSR1
            second.exit()
        assert recorded == [int(signal.SIGUSR1)]


@pytest.mark.parametrize(
    "kwargs, found",
    [
        ({"signals": [signal.SIGKILL]}, "found <Signals.SIGKILL"),
        ({"signals": []}, "none"),
        ({"signals": ["SIGTERM"]}, "'SIGTERM'"),
        ({"grace_s": 0}, "0"),
        ({"grace_s": float("nan")}, "nan"),
        ({"grace_s": True}, "True"),
    ],
)
def test_invalid_arguments_raise_config_error(tmp_path, kwargs, found):
    with datastates.Checkpointer(tmp_path / "ckpt") as ckpt:
        with pytest.raises(datastates.ConfigError, match=found):
            datastates.Preemption(ckpt, **kwargs)


def test_only_the_main_thread_may_install_it(tmp_path):
    errors = []
    with datastates.Checkpointer(tmp_path / "ckpt") as ckpt:
        thread = threading.Thread(target=lambda: errors.append(_try(ckpt)))
        thread.start()
        thread.join()
    assert isinstance(errors[0], datastates.ConfigError) and "main thread" in str(errors[0])


def _try(ckpt):
    try:
        datastates.Preemption(ckpt)
    except Exception as exc:
        return exc
    return None

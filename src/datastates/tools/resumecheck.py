"""Does a training loop resume bit-identically? :func:`check_resume` answers it on the user's own loop.

A checkpoint that restores without error can still resume a different run: the loop restarts at
the saved step instead of the next one, a loader or a random generator is not in the checkpointed
state, a Dataset draws random numbers inside loader workers that no checkpoint sees. Each of these
shows only as a run that silently diverges. So the loop is run twice in fresh processes: once
uninterrupted (the reference), once SIGKILLed at chosen steps and started again, resuming through
its own resume code. After every step the loop calls ``run.step_done(step, state)``, which writes a
fingerprint of the state (a digest per tensor, per random generator, per ``state_dict()`` entry,
per Python value) to a file; the two runs are then compared step by step, and the first step and
key that differ are reported with what the difference usually means.

The loop is a module-level function ``train_fn(run)``; :class:`Run` is what it gets. This module
runs the processes; the comparison (``resumereport.compare``) is a pure function of the recorded
fingerprints (``fingerprint``). docs/resume-check.md
says what is compared, what the check finds, and its limits (one process, no distributed loops).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Iterable

from ..commit import catalog
from ..errors import CheckpointNotFoundError, ConfigError
from .fingerprint import fingerprint
from .resumereport import Difference, Kill, ProcessRun, Record, ResumeReport, compare

__all__ = [
    "Difference",
    "Kill",
    "ProcessRun",
    "Record",
    "ResumeReport",
    "Run",
    "check_resume",
    "compare",
]

#: The command that runs the loop in a child process: ``python -c _CHILD <spec as JSON>``.
_CHILD = "from datastates.tools.resumecheck import _child; _child()"
_LOG_LINES = 20


class Run:
    """What ``train_fn`` receives, in every process check_resume starts.

    ``directory`` is the checkpoint directory of this run (the same directory across the restarts
    of the interrupted run; use it as the Checkpointer's directory itself), ``steps`` the number
    of steps to train (steps 0 to ``steps - 1``). Made by check_resume, one per process."""

    def __init__(self, directory: str, steps: int, log: str, kill_at: int | None = None):
        self.directory, self.steps = directory, steps
        self._log, self._kill_at = log, kill_at

    def step_done(self, step: int, state: Any, inputs: Any = None) -> None:
        """Call once after every step, from the training thread, after that step's ``save()``.

        Records the fingerprint of ``state`` after ``step``: pass everything the training depends
        on (model, optimizer, scheduler, loader or sampler, generators, Python values), also what
        the checkpoint leaves out, so that a part missing from the checkpoint shows under its own
        key. ``inputs`` is what this step read (the batch): compared before the weights, so a
        difference in the data is named before its effect. At a kill step the process then kills
        itself with SIGKILL (a real kill: no ``finally``, no ``atexit``, no close of the
        Checkpointer); a save still in flight at that point is interrupted where it is. Raises ConfigError for a step that is no
        int in [0, steps)."""
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < self.steps:
            raise ConfigError(
                f"run.step_done: expected a step in [0, {self.steps}), found {step!r}"
            )
        line = json.dumps({"step": step, "keys": fingerprint(state, inputs)}) + "\n"
        _append(self._log, line.encode())
        if step == self._kill_at:
            sys.stdout.flush()
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)


def _append(path: str, data: bytes) -> None:
    """Append to a file through the kernel at once: what is written survives a SIGKILL."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
    finally:
        os.close(fd)


def check_resume(
    train_fn: Callable | str,
    steps: int,
    kill_at: int | Iterable[int],
    *,
    workdir: str | None = None,
    timeout_s: float = 600.0,
    concurrent: bool = True,
) -> ResumeReport:
    """Run ``train_fn(run)`` uninterrupted and interrupted, and report whether the resumed run
    is bit-identical, step by step.

    ``train_fn``: a module-level function (or ``"module:function"``), called in fresh processes
    of this interpreter. ``steps``: the steps each run trains. ``kill_at``: the steps (increasing,
    in [0, steps)) whose ``run.step_done`` kills the interrupted run; after each kill the loop is
    started again in the same checkpoint directory. ``workdir``: keep the runs' checkpoints,
    fingerprints and output there (a new or empty folder; default: a temporary folder, removed).
    ``timeout_s``: the limit of each process, from its start. ``concurrent``: run the reference at the same time
    as the interrupted run (False for a loop that needs the whole machine or GPU).

    Blocks until every process ended; kills what a process leaves behind (loader workers).
    Raises ConfigError for bad arguments (a ``"module:function"`` that does not import or
    name a function included: it is imported here first); a loop that fails is reported, not
    raised."""
    kills = _kill_steps(kill_at, steps)
    target, root = _target(train_fn)
    folder, temporary = _workdir(workdir)
    env = _child_env(root)
    reference = None
    try:
        reference = _Process(folder, "reference", target, steps, None, env)
        done = None if concurrent else reference.finish(timeout_s)
        runs = _interrupted(folder, target, steps, kills, env, timeout_s)
        return compare(done if done is not None else reference.finish(timeout_s), runs, steps)
    finally:
        if reference is not None and reference.proc.poll() is None:  # interrupted meanwhile
            reference.abort()
            reference.proc.wait()
        if temporary:
            shutil.rmtree(folder, ignore_errors=True)


def _interrupted(
    folder: str, target: str, steps: int, kills: list, env: dict, timeout_s: float
) -> list:
    runs = []
    for n in range(len(kills) + 1):
        kill = kills[n] if n < len(kills) else None
        runs.append(
            _Process(folder, f"run-{n}", target, steps, kill, env, directory="interrupted").finish(
                timeout_s
            )
        )
        if not runs[-1].killed:
            break
    return runs


class _Process:
    """One child process running the loop; ``finish`` waits for it and reads its records."""

    def __init__(
        self,
        folder: str,
        name: str,
        target: str,
        steps: int,
        kill_at: int | None,
        env: dict,
        directory: str | None = None,
    ):
        self.kill_at, self.started = kill_at, time.monotonic()
        self.directory = os.path.join(folder, directory or name, "checkpoints")
        self.log, self.out = (os.path.join(folder, f"{name}.{ext}") for ext in ("jsonl", "out"))
        os.makedirs(self.directory, exist_ok=True)
        spec = {
            "target": target,
            "directory": self.directory,
            "steps": steps,
            "kill_at": kill_at,
            "log": self.log,
        }
        with open(self.out, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _CHILD, json.dumps(spec)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                stdin=subprocess.DEVNULL,
                start_new_session=True,
            )

    def finish(self, timeout_s: float) -> ProcessRun:
        """Wait for the process, at most until ``timeout_s`` after its start."""
        expired = threading.Event()
        left = max(0.0, self.started + timeout_s - time.monotonic())

        def expire() -> None:
            expired.set()
            self.abort()

        timer = threading.Timer(left, expire)
        timer.start()
        try:
            # Wait without reaping: while the leader is a zombie its group id stays its own, so
            # the group kill below reaches only what it left behind (loader workers).
            os.waitid(os.P_PID, self.proc.pid, os.WEXITED | os.WNOWAIT)
        except BaseException:
            self.abort()
            self.proc.wait()
            raise
        finally:
            timer.cancel()
        self.abort()
        code = self.proc.wait()
        return ProcessRun(
            records=_read_records(self.log),
            kill_at=self.kill_at,
            returncode=None if expired.is_set() else code,
            checkpoint=_newest_step(self.directory),
            log=_tail(self.out),
        )

    def abort(self) -> None:
        """SIGKILL the process and everything in its group."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def _read_records(path: str) -> tuple:
    if not os.path.exists(path):
        return ()
    out = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if line.endswith("\n"):  # a line cut by the kill is no record
                data = json.loads(line)
                out.append(Record(data["step"], {k: tuple(v) for k, v in data["keys"].items()}))
    return tuple(out)


def _newest_step(directory: str) -> int | None:
    try:
        info = catalog.latest(directory)
    except CheckpointNotFoundError:
        return None
    return None if info is None else info.step


def _tail(path: str) -> str:
    with open(path, encoding="utf-8", errors="replace") as f:
        return "".join(f.readlines()[-_LOG_LINES:]).rstrip()


def _target(train_fn: Callable | str) -> tuple:
    """``module:qualname`` of the loop, and the folder its module is imported from (None: the
    child finds it as the caller would, from the current directory and PYTHONPATH)."""
    if isinstance(train_fn, str):
        module, _, name = train_fn.partition(":")
        if not module or not name:
            raise ConfigError(f"check_resume: expected 'module:function', found {train_fn!r}")
        _resolve(module, name)
        return train_fn, None
    where = getattr(train_fn, "__module__", None)
    name = getattr(train_fn, "__qualname__", "")
    if not callable(train_fn) or where is None or "<" in name:
        raise ConfigError(f"check_resume: expected a module-level function, found {train_fn!r}")
    if where == "__main__":
        raise ConfigError(
            f"check_resume: {name} is defined in __main__ (a script run "
            "directly), which a new process cannot import: move it to a module"
        )
    return f"{where}:{name}", _import_root(where)


def _resolve(module: str, name: str) -> Callable:
    """The function ``module:name``, imported as the child will: from the current directory,
    then ``sys.path``. ConfigError saying what failed, before any process starts."""
    import importlib

    here = os.getcwd()
    added = here not in sys.path and "" not in sys.path
    if added:
        sys.path.append(here)
    try:
        fn: Any = importlib.import_module(module)
    except Exception as exc:  # not found, or its own import raised (a SyntaxError too)
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        raise ConfigError(
            f"check_resume: expected an importable module {module!r} (from {here} "
            f"or PYTHONPATH), found that importing it raises "
            f"{type(exc).__name__}: {first}"
        ) from None
    finally:
        if added:
            sys.path.remove(here)
    for part in name.split("."):
        fn = getattr(fn, part, None)
    if not callable(fn):
        raise ConfigError(
            f"check_resume: expected a function {name!r} in module {module!r} "
            f"({getattr(sys.modules[module], '__file__', None)}), found "
            f"{'none' if fn is None else type(fn).__name__}"
        )
    return fn


def _import_root(module: str) -> str | None:
    path = getattr(sys.modules.get(module), "__file__", None)
    if path is None:
        return None
    root = os.path.dirname(os.path.abspath(path))
    levels = module.count(".") + (os.path.basename(path) == "__init__.py")
    for _ in range(levels):
        root = os.path.dirname(root)
    return root


def _kill_steps(kill_at: int | Iterable[int], steps: int) -> list:
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
        raise ConfigError(f"check_resume: expected steps >= 1, found {steps!r}")
    kills = [kill_at] if isinstance(kill_at, int) else list(kill_at)
    if (
        not kills
        or any(isinstance(k, bool) or not isinstance(k, int) for k in kills)
        or kills != sorted(set(kills))
        or not 0 <= kills[0] <= kills[-1] < steps
    ):
        raise ConfigError(
            f"check_resume: expected kill_at as increasing steps in [0, {steps}), found {kill_at!r}"
        )
    return kills


def _workdir(workdir: str | None) -> tuple:
    if workdir is None:
        return tempfile.mkdtemp(prefix="datastates-resume-check-"), True
    if os.path.exists(workdir) and (not os.path.isdir(workdir) or os.listdir(workdir)):
        raise ConfigError(
            f"check_resume: expected a new or empty workdir, found {workdir!r}, "
            "a file or a folder holding files (an old run would be resumed)"
        )
    os.makedirs(workdir, exist_ok=True)
    return os.path.abspath(workdir), False


def _child_env(root: str | None) -> dict:
    """The caller's environment, with a fixed hash seed (unless it sets one: the order of a set
    of strings must not differ between the runs) and the loop's module on the path."""
    env = dict(os.environ)
    env.setdefault("PYTHONHASHSEED", "0")
    if root is not None:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    return env


def _child() -> None:
    """The child's side: seed the global generators of torch, Python and NumPy with 0 (each
    process would start from a seed of its own), then import the loop and run it."""
    import importlib
    import random

    import torch

    torch.manual_seed(0)
    random.seed(0)
    try:
        import numpy

        numpy.random.seed(0)
    except ImportError:
        pass
    spec = json.loads(sys.argv[1])
    module, _, name = spec["target"].partition(":")
    fn: Any = importlib.import_module(module)
    for part in name.split("."):
        fn = getattr(fn, part)
    fn(Run(spec["directory"], spec["steps"], spec["log"], spec["kill_at"]))

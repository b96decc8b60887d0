"""Python processes for the tests, forked from one that has already imported torch.

A test child that starts with ``python script.py`` spends seconds importing torch (and, at its
first optimizer step or optimizer, ``torch._dynamo``) before it does anything under test. The
tests that start a child per case (the kill points of tests/faults, the command line, the
benchmark scripts, the documentation's examples) start them through :func:`run` and
:class:`Process` instead, which take the arguments of ``subprocess.run`` and ``subprocess.Popen``
that these tests use. A *zygote*, started once per test session, has imported numpy, torch,
``torch._dynamo`` and datastates and nothing else (no thread of its own started, no tensor
computed), and forks one child per command. The child then does what the interpreter does for
``python ARGS``: sets ``sys.argv``, ``sys.path[0]``, the working directory and the environment
given, runs the script (a path, ``-c CODE`` or ``-m MODULE``) in a fresh ``__main__``, and exits
through the interpreter's own shutdown (non-daemon threads joined, ``atexit`` handlers run, the
exit status from ``SystemExit``, or 1 and the traceback for an uncaught exception).

Each child is a process of its own, with its own pid, memory and file descriptors (0-2 and the
``pass_fds``); a SIGKILL kills it as it kills any process, and its exit status (``-SIGKILL``) is
what the test sees. What a child shares with its siblings and differs in from a fresh process:
the modules imported before the fork are already there (whatever ``sys.path`` the script sets),
imported under the zygote's environment -- so a command whose environment differs in a variable
that counts at start-up (STARTUP_PREFIXES: ``PYTHONPATH``, ``OMP_NUM_THREADS``...) gets a zygote
started with that environment; the hash seed of ``str`` and ``bytes`` is the zygote's; the objects
of the imports are frozen out of the garbage collector (``gc.freeze``, so that no child copies
their pages); numpy's global random state is reseeded in every child, as a fresh process seeds
it (``random`` reseeds itself at fork). A command with interpreter options (``python -X ...``,
``-u``) or another interpreter runs as a plain subprocess, as does one that would need more than
MAX_ZYGOTES zygotes.

Zygotes exit when the session ends (their socket closes). Protocol, over a ``SOCK_SEQPACKET``
socket pair: a request is a JSON object (``argv``, ``cwd``, ``env``, ``pass_fds``,
``new_session``) with the child's stdin, stdout, stderr and ``pass_fds`` passed as file
descriptors; the zygote answers ``{"pid": N}`` once it forked, and ``{"exit": N, "returncode":
R}`` when it reaped that child (R as ``subprocess`` reports it).
"""

from __future__ import annotations

import atexit
import builtins
import fcntl
import gc
import io
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import types

#: What the zygote imports before it forks.
PRELOAD = ("numpy", "torch", "torch._dynamo", "datastates")
#: How long the zygote may take to import PRELOAD (a bound, not a measurement).
START_TIMEOUT_S = 300.0
_MAX_MESSAGE = 1 << 20
_MAX_FDS = 16
#: Environment variables that count when the interpreter starts or the preloaded modules are
#: imported (thread pools, paths, interpreter options): a command whose environment differs from
#: a zygote's in one of them gets a zygote started with its environment.
STARTUP_PREFIXES = (
    "PYTHON",
    "OMP_",
    "GOMP_",
    "KMP_",
    "MKL_",
    "OPENBLAS_",
    "NUMEXPR_",
    "TORCH",
    "CUDA",
    "LD_",
)
#: At most this many zygotes per session; a command needing another runs as a plain subprocess.
MAX_ZYGOTES = 4


# ---------------------------------------------------------------- the zygote process


def _serve(sock: socket.socket) -> tuple[dict, list[int]]:
    """The zygote's loop: fork a child per request, report each child's exit. Returns (in the
    child only) the request and its three file descriptors; the zygote itself exits at EOF."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # wakes the select through wake_w
    sock.send(json.dumps({"ready": os.getpid()}).encode())
    while True:
        ready, _, _ = select.select([sock, wake_r], [], [])
        if wake_r in ready:
            while True:
                try:
                    os.read(wake_r, 512)
                except BlockingIOError:
                    break
            _reap(sock)
        if sock not in ready:
            continue
        data, fds, _, _ = socket.recv_fds(sock, _MAX_MESSAGE, _MAX_FDS)
        if not data:  # the test session closed its end
            sys.exit(0)
        request = json.loads(data)
        pid = os.fork()
        if pid == 0:
            signal.set_wakeup_fd(-1)
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            for fd in (wake_r, wake_w):
                os.close(fd)
            sock.close()
            return request, fds
        for fd in fds:
            os.close(fd)
        sock.send(json.dumps({"pid": pid}).encode())


def _reap(sock: socket.socket) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        code = os.waitstatus_to_exitcode(status)
        sock.send(json.dumps({"exit": pid, "returncode": code}).encode())


def _become(request: dict, fds: list[int]) -> None:
    """In the forked child: take the request's stdio, directory and environment, then run its
    command as ``python ARGV`` would. Exceptions and SystemExit propagate to the interpreter."""
    if request["new_session"]:
        os.setsid()
    targets = [0, 1, 2, *request["pass_fds"]]
    floor = max(targets) + 1  # first out of the way of every target, then onto the targets
    moved = [fcntl.fcntl(fd, fcntl.F_DUPFD, floor) for fd in fds]
    for fd in fds:
        os.close(fd)
    for target, fd in zip(targets, moved):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    if "numpy" in sys.modules:  # a fresh process seeds it from the OS
        sys.modules["numpy"].random.seed()
    argv = request["argv"]
    main = types.ModuleType("__main__")
    main.__dict__.update(__builtins__=builtins, __cached__=None)
    sys.modules["__main__"] = main  # a fresh __main__, alive until the interpreter's shutdown
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path[0] = ""
        exec(compile(argv[1], "<string>", "exec"), main.__dict__)
    elif argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]  # runpy puts the module's path in sys.argv[0]
        sys.path[0] = os.getcwd()
        runpy._run_module_as_main(argv[1], alter_argv=True)  # what ``python -m`` calls
    else:
        sys.argv = list(argv)
        sys.path[0] = os.path.dirname(os.path.realpath(argv[0]))
        main.__file__ = os.path.abspath(argv[0])
        with open(argv[0], "rb") as f:
            code = compile(f.read(), argv[0], "exec")
        exec(code, main.__dict__)


def _zygote_main() -> None:
    sock = socket.socket(fileno=int(sys.argv[1]))
    for name in PRELOAD:
        __import__(name)
    gc.collect()
    gc.freeze()  # the children's collections (and exits) then leave these pages unshared alone
    request, fds = _serve(sock)
    _become(request, fds)  # only the forked child gets here


# ---------------------------------------------------------------- the test session's side


class Zygote:
    """The test session's handle on one zygote: ``spawn`` a command, ``wait`` for its exit.
    ``env``: the environment the zygote starts with (its STARTUP_PREFIXES variables are those of
    every command it serves)."""

    def __init__(self, env: dict):
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._log = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), str(theirs.fileno())],
            pass_fds=[theirs.fileno()],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=self._log,
            cwd=os.path.dirname(os.path.abspath(__file__)),
            env=env,
        )
        theirs.close()
        self._sock = ours
        self._spawn_lock = threading.Lock()
        self._cond = threading.Condition()
        self._started: list[int] = []
        self._exits: dict[int, int] = {}
        self._closed = False
        ready, _, _ = select.select([ours], [], [], START_TIMEOUT_S)
        hello = ours.recv(_MAX_MESSAGE) if ready else b""
        if not hello:
            raise RuntimeError(f"the zygote did not start: {self._log_tail()}")
        threading.Thread(target=self._read, name="zygote-reader", daemon=True).start()

    def _log_tail(self) -> str:
        self._log.seek(0)
        return self._log.read()[-4000:].decode(errors="replace")

    def _read(self) -> None:
        while True:
            try:
                data = self._sock.recv(_MAX_MESSAGE)
            except OSError:
                data = b""
            with self._cond:
                if not data:
                    self._closed = True
                    self._cond.notify_all()
                    return
                message = json.loads(data)
                if "pid" in message:  # comes before any exit of that child: a reused pid's
                    self._exits.pop(message["pid"], None)  # old exit is forgotten first
                    self._started.append(message["pid"])
                else:
                    self._exits[message["exit"]] = message["returncode"]
                self._cond.notify_all()

    def spawn(
        self,
        argv: list[str],
        cwd: str,
        env: dict,
        fds: list[int],
        pass_fds: tuple[int, ...] = (),
        new_session: bool = False,
    ) -> int:
        """Fork a child running ``python *argv`` with ``fds`` as its stdin, stdout and stderr,
        then the descriptors ``pass_fds`` under their own numbers; returns its pid."""
        request = {
            "argv": list(argv),
            "cwd": cwd,
            "env": dict(env),
            "pass_fds": list(pass_fds),
            "new_session": new_session,
        }
        with self._spawn_lock:
            socket.send_fds(self._sock, [json.dumps(request).encode()], [*fds, *pass_fds])
            with self._cond:
                if (
                    not self._cond.wait_for(lambda: self._started or self._closed, START_TIMEOUT_S)
                    or not self._started
                ):
                    raise RuntimeError(f"the zygote did not fork: {self._log_tail()}")
                return self._started.pop(0)

    def wait(self, pid: int, timeout: float | None) -> int | None:
        """The child's returncode, or None if it still runs after ``timeout`` seconds."""
        with self._cond:
            self._cond.wait_for(lambda: pid in self._exits or self._closed, timeout)
            if pid not in self._exits and self._closed:
                raise RuntimeError(f"the zygote ended: {self._log_tail()}")
            return self._exits.pop(pid, None)

    def close(self) -> None:
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self._log.close()


_ZYGOTES: dict[tuple, Zygote] = {}
_ZYGOTES_LOCK = threading.Lock()


def _startup_key(env: dict) -> tuple:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(STARTUP_PREFIXES)))


def zygote(env: dict | None = None) -> Zygote | None:
    """The session's zygote for ``env`` (default: this process's environment), started at the
    first call; None once MAX_ZYGOTES run and none matches."""
    env = dict(os.environ if env is None else env)
    key = _startup_key(env)
    with _ZYGOTES_LOCK:
        if key not in _ZYGOTES:
            if len(_ZYGOTES) >= MAX_ZYGOTES:
                return None
            _ZYGOTES[key] = Zygote(env)
            atexit.register(_ZYGOTES[key].close)
        return _ZYGOTES[key]


def _python_command(args: list[str]) -> bool:
    """Whether ``args`` is ``python SCRIPT|-c CODE|-m MODULE ...`` with this interpreter and no
    interpreter option."""
    if len(args) < 2 or args[0] != sys.executable:
        return False
    if args[1] in ("-c", "-m"):
        return len(args) >= 3
    return not args[1].startswith("-")


class Process:
    """``subprocess.Popen(args, stdin=, stdout=, stderr=, text=, bufsize=, cwd=, env=,
    pass_fds=, start_new_session=)`` for a Python command, forked from a zygote (or started as
    a subprocess where no zygote can serve it: see the module docstring). ``stdin``, ``stdout``,
    ``stderr``: None (this process's own), ``subprocess.PIPE``, ``subprocess.DEVNULL``,
    ``subprocess.STDOUT`` (stderr only) or an open file. Offers ``pid``, ``returncode``,
    ``poll``, ``wait``, ``kill``, ``send_signal``, ``communicate`` and the pipes."""

    def __init__(
        self,
        args,
        *,
        stdin=None,
        stdout=None,
        stderr=None,
        text=False,
        bufsize=-1,
        cwd=None,
        env=None,
        pass_fds=(),
        start_new_session=False,
    ):
        args = [os.fspath(a) for a in args]
        env = dict(os.environ if env is None else env)
        self.args = args
        self.returncode: int | None = None
        self._text = text
        self._zygote = zygote(env) if _python_command(args) else None
        if self._zygote is None:
            self._popen = subprocess.Popen(
                args,
                stdin=stdin,
                stdout=stdout,
                stderr=stderr,
                text=text,
                bufsize=bufsize,
                cwd=cwd,
                env=env,
                pass_fds=pass_fds,
                start_new_session=start_new_session,
            )
            self.pid = self._popen.pid
            self.stdin, self.stdout, self.stderr = (
                self._popen.stdin,
                self._popen.stdout,
                self._popen.stderr,
            )
            return
        self._popen = None
        theirs, ours, close_after = [], [], []
        for i, spec in enumerate((stdin, stdout, stderr)):
            if spec == subprocess.PIPE:
                r, w = os.pipe()
                child_end, own_end = (r, w) if i == 0 else (w, r)
                theirs.append(child_end)
                close_after.append(child_end)
                ours.append(own_end)
            elif spec == subprocess.STDOUT and i == 2:
                theirs.append(theirs[1])
                ours.append(None)
            elif spec == subprocess.DEVNULL:
                fd = os.open(os.devnull, os.O_RDWR)
                theirs.append(fd)
                close_after.append(fd)
                ours.append(None)
            elif spec is None:
                theirs.append(i)
                ours.append(None)
            else:
                theirs.append(spec.fileno() if hasattr(spec, "fileno") else int(spec))
                ours.append(None)
        try:
            self.pid = self._zygote.spawn(
                args[1:],
                os.fspath(cwd or os.getcwd()),
                env,
                theirs,
                pass_fds=tuple(pass_fds),
                new_session=start_new_session,
            )
        finally:
            for fd in close_after:
                os.close(fd)
        self.stdin = self._wrap(ours[0], "wb", bufsize)
        self.stdout = self._wrap(ours[1], "rb", bufsize)
        self.stderr = self._wrap(ours[2], "rb", bufsize)

    def _wrap(self, fd, mode, bufsize):
        if fd is None:
            return None
        f = open(fd, mode, buffering=bufsize)
        if self._text:
            f = io.TextIOWrapper(f, write_through=mode == "wb", line_buffering=bufsize == 1)
        return f

    def poll(self) -> int | None:
        return self.wait(timeout=0, _raise=False)

    def wait(self, timeout: float | None = None, _raise: bool = True) -> int | None:
        if self.returncode is not None:
            return self.returncode
        if self._popen is not None:
            try:
                self.returncode = self._popen.wait(timeout)
            except subprocess.TimeoutExpired:
                if _raise:
                    raise
            return self.returncode
        self.returncode = self._zygote.wait(self.pid, timeout)
        if self.returncode is None and _raise:
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def communicate(self, input=None, timeout: float | None = None):
        """Like ``Popen.communicate``: write ``input``, read stdout and stderr to their ends,
        wait; on a timeout raises TimeoutExpired (the process keeps running)."""
        if self._popen is not None:
            out, err = self._popen.communicate(input, timeout)
            self.returncode = self._popen.returncode
            return out, err
        deadline = None if timeout is None else time.monotonic() + timeout
        results: dict = {}

        def drain(name, f):
            results[name] = f.read()
            f.close()

        readers = [
            threading.Thread(target=drain, args=(name, f), daemon=True)
            for name, f in (("stdout", self.stdout), ("stderr", self.stderr))
            if f
        ]
        for t in readers:
            t.start()
        if self.stdin is not None:
            if input:
                try:
                    self.stdin.write(input)
                except BrokenPipeError:
                    pass
            self.stdin.close()
        for t in readers:
            t.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise subprocess.TimeoutExpired(self.args, timeout)
        self.wait(None if deadline is None else max(0.0, deadline - time.monotonic()))
        return results.get("stdout"), results.get("stderr")


def run(
    args,
    *,
    capture_output=False,
    text=False,
    timeout=None,
    cwd=None,
    env=None,
    check=False,
    stdin=None,
    stdout=None,
    stderr=None,
) -> subprocess.CompletedProcess:
    """``subprocess.run`` for a Python command, forked from a zygote (see :class:`Process`).
    On a timeout the child is killed and TimeoutExpired raised, as ``subprocess.run`` does."""
    if capture_output:
        stdout = stderr = subprocess.PIPE
    proc = Process(args, stdin=stdin, stdout=stdout, stderr=stderr, text=text, cwd=cwd, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    done = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    if check:
        done.check_returncode()
    return done


if __name__ == "__main__":
    _zygote_main()

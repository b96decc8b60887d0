"""The zygote (tests/zygote.py) runs a command as ``python ARGS`` would: the same ``sys.argv``,
``sys.path[0]``, ``__main__``, working directory, environment, output and exit status as a plain
subprocess, for a script, ``-c`` and ``-m``; its pipes and passed descriptors work; a SIGKILL
and a timeout end the child as they end any process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap

import pytest

import zygote

# slow: every test forks interpreters from the zygote
pytestmark = pytest.mark.slow

SCRIPT = textwrap.dedent("""
    import atexit, os, sys, threading
    print("argv", sys.argv[1:], "path0", sys.path[0], "name", __name__, flush=True)
    print("file", globals().get("__file__"), "cwd", os.getcwd(), "env", os.environ.get("ZT"))
    print("main", sys.modules["__main__"].__dict__ is globals())
    atexit.register(lambda: print("atexit", flush=True))
    ready = threading.Event()
    def worker():  # a non-daemon thread: joined before the atexit handlers run
        ready.wait()
        print("thread", flush=True)
    threading.Thread(target=worker).start()
    ready.set()
    mode = sys.argv[1]
    if mode == "exit":
        sys.exit(3)
    if mode == "raise":
        raise LookupError("from the script")
    if mode == "kill":
        os.kill(os.getpid(), 9)
""")


def both(args, **kwargs):
    """The command through the zygote and as a plain subprocess."""
    forked = zygote.run(args, capture_output=True, text=True, timeout=120, **kwargs)
    plain = subprocess.run(args, capture_output=True, text=True, timeout=120, **kwargs)
    return forked, plain


@pytest.mark.parametrize(
    "mode, returncode", [("end", 0), ("exit", 3), ("raise", 1), ("kill", -signal.SIGKILL)]
)
def test_a_script_runs_as_in_a_subprocess(tmp_path, mode, returncode):
    script = tmp_path / "script.py"
    script.write_text(SCRIPT)
    work = tmp_path / "work"
    work.mkdir()
    forked, plain = both(
        [sys.executable, str(script), mode], cwd=work, env={**os.environ, "ZT": "given"}
    )
    assert forked.returncode == plain.returncode == returncode
    assert forked.stdout == plain.stdout
    assert f"path0 {tmp_path}" in forked.stdout and f"cwd {work} env given" in forked.stdout
    if mode != "kill":
        assert forked.stdout.endswith("thread\natexit\n")
    if mode == "raise":
        assert (
            forked.stderr.splitlines()[-1]
            == plain.stderr.splitlines()[-1]
            == "LookupError: from the script"
        )


def test_dash_c_and_dash_m_set_argv_and_path_as_the_interpreter_does(tmp_path):
    (tmp_path / "zt_module.py").write_text(SCRIPT)
    for args in (["-c", SCRIPT, "end", "x"], ["-m", "zt_module", "end", "x"]):
        forked, plain = both([sys.executable, *args], cwd=tmp_path)
        assert forked.returncode == plain.returncode == 0, forked.stderr
        assert forked.stdout == plain.stdout


def test_pipes_and_passed_descriptors(tmp_path):
    r, w = os.pipe()
    code = (
        "import os, sys\n"
        "for line in sys.stdin:\n"
        "    print('echo', line.strip(), flush=True)\n"
        f"os.write({w}, b'through the passed descriptor')\n"
    )
    child = zygote.Process(
        [sys.executable, "-c", code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        pass_fds=(w,),
    )
    child.stdin.write("one\n")
    child.stdin.flush()
    assert child.stdout.readline() == "echo one\n"
    out, _ = child.communicate("two\n", timeout=120)
    assert out == "echo two\n" and child.returncode == 0
    os.close(w)
    assert os.read(r, 100) == b"through the passed descriptor"
    os.close(r)


def test_a_timeout_kills_the_child():
    code = "import sys; sys.stdin.read()"  # blocks: its stdin is never written
    stdin_r, stdin_w = os.pipe()
    out_r, out_w = os.pipe()
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            zygote.run([sys.executable, "-c", code], stdin=stdin_r, stdout=out_w, timeout=0.5)
        os.close(out_w)
        assert os.read(out_r, 1) == b""  # the child's end of the pipe is closed: it is gone
        child = zygote.Process([sys.executable, "-c", code], stdin=stdin_r)
        with pytest.raises(subprocess.TimeoutExpired):
            child.wait(timeout=0.2)
        assert child.poll() is None
        child.kill()
        assert child.wait(timeout=120) == -signal.SIGKILL
    finally:
        for fd in (stdin_r, stdin_w, out_r):
            os.close(fd)


def test_children_differ_in_pid_and_random_state():
    code = "import os, random, numpy; print(os.getpid(), random.random(), numpy.random.random())"
    a, b = (
        zygote.run(
            [sys.executable, "-c", code], capture_output=True, text=True, timeout=120
        ).stdout.split()
        for _ in range(2)
    )
    assert all(x != y for x, y in zip(a, b)), (a, b)


def test_an_environment_that_counts_at_start_up_gets_its_own_zygote():
    env = dict(os.environ)
    same = {**env, "HOME": "/elsewhere"}
    assert zygote._startup_key(same) == zygote._startup_key(env)
    for name in ("PYTHONPATH", "OMP_NUM_THREADS", "PYTHONHASHSEED"):
        assert zygote._startup_key({**env, name: "1"}) != zygote._startup_key(env), name
    assert zygote.zygote(same) is zygote.zygote(env)
    assert not zygote._python_command([sys.executable, "-X", "importtime", "x.py"])
    assert not zygote._python_command(["python2", "x.py"])

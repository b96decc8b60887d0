"""A script that ends with a save in flight never loses it in silence.

Each test runs a real script in a fresh interpreter that saves and then ends without ``close()``
or ``wait()``: its loop ends, or it raises outside a ``with`` block. The interpreter's exit waits
for the save (bounded by ``commit_timeout_s``) and commits it; a save that cannot commit is named in
a WARNING; the process exits with the script's own status, never an abort.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import datastates

from _faults_helpers import WAIT_S, free_port

# slow: each test runs a script in a process of its own to its exit
pytestmark = pytest.mark.slow

_SCRIPT = textwrap.dedent("""
    import sys
    import torch
    import datastates

    root, ending = sys.argv[1], sys.argv[2]


    def train():  # the Checkpointer is a local: dropped, unclosed, when this returns
        ck = datastates.Checkpointer(root, datastates.CheckpointConfig(host_cache_bytes=8 << 20,
                                                                       commit_timeout_s=60.0))
        for step in range(3):
            # 32 MiB per save through an 8 MiB cache: the last save is still in flight at the end
            ck.save({"w": torch.full((8 << 20,), float(step)), "step": step}, step=step)


    if ending == "thread":  # a non-daemon thread trains on after the main thread's end
        import threading
        started = threading.Event()
        threading.Thread(target=lambda: (started.wait(), train())).start()
        print("script ended", flush=True)
        started.set()
        sys.exit(0)
    train()
    if ending == "raises":
        raise RuntimeError("the loop failed")
    if ending == "forks":  # a child forked with the save in flight ends: it owns no save
        import os
        child = os.fork()
        if child == 0:
            sys.exit(5)
        print("child exit status", os.waitstatus_to_exitcode(os.waitpid(child, 0)[1]), flush=True)
    print("script ended", flush=True)
""")


def _run(tmp_path, ending: str) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    return subprocess.run(
        [sys.executable, str(script), str(tmp_path / "ckpt"), ending],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )


def _assert_committed(root, steps) -> None:
    ck = datastates.Checkpointer(root)
    try:
        assert [info.step for info in ck.list()] == list(steps)
        for step in steps:
            got = ck.load(step=step)
            assert got["step"] == step
            assert torch.equal(got["w"], torch.full((8 << 20,), float(step)))
    finally:
        ck.close()


def test_a_script_whose_loop_ends_commits_the_save_in_flight(tmp_path):
    result = _run(tmp_path, "ends")
    assert result.returncode == 0, result.stderr
    assert "script ended" in result.stdout
    assert "terminate called" not in result.stderr
    _assert_committed(tmp_path / "ckpt", [0, 1, 2])


def test_a_thread_training_after_the_main_thread_ended_commits_every_save(tmp_path):
    """The exit waits for a non-daemon thread that saved (the interpreter would join it next)
    before it closes the Checkpointer that thread made after the main thread's end."""
    result = _run(tmp_path, "thread")
    assert result.returncode == 0, result.stderr
    assert "terminate called" not in result.stderr and "did not commit" not in result.stderr
    _assert_committed(tmp_path / "ckpt", [0, 1, 2])


def test_a_script_that_raises_outside_with_commits_the_save_in_flight(tmp_path):
    result = _run(tmp_path, "raises")
    assert result.returncode == 1, result.stderr
    assert result.stderr.rstrip().endswith("RuntimeError: the loop failed")
    _assert_committed(tmp_path / "ckpt", [0, 1, 2])


def test_a_forked_child_ending_leaves_the_parents_save_to_the_parent(tmp_path):
    """The child inherits the open Checkpointer but not its threads: it exits at once with its
    own status (no wait for a save it cannot finish), and the parent commits the save."""
    result = _run(tmp_path, "forks")
    assert result.returncode == 0, result.stderr
    assert "child exit status 5" in result.stdout
    assert "did not commit" not in result.stderr
    _assert_committed(tmp_path / "ckpt", [0, 1, 2])


_TWO_RANKS = textwrap.dedent("""
    import sys
    import torch
    import torch.distributed as dist
    import datastates

    root, rank, port = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    ck = datastates.Checkpointer(root, datastates.CheckpointConfig(commit_timeout_s=3.0))
    if rank == 0:  # rank 1 ends without saving: this save cannot commit
        ck.save({"w": torch.ones(1000)}, step=7)
    print(f"rank {rank} ended", flush=True)
""")


def test_a_save_that_cannot_commit_at_exit_is_named_in_a_warning(tmp_path):
    """Rank 1 ends without saving: rank 0's exit waits for its save no longer than
    ``commit_timeout_s``, then names it in a WARNING, and exits with the script's status."""
    script = tmp_path / "two.py"
    script.write_text(_TWO_RANKS)
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, str(script), str(tmp_path / "ckpt"), str(rank), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    outs = [proc.communicate(timeout=WAIT_S) for proc in procs]
    for rank, (proc, (out, err)) in enumerate(zip(procs, outs)):
        assert proc.returncode == 0, err
        assert f"rank {rank} ended" in out
        assert "terminate called" not in err
    err0 = outs[0][1]
    assert "exit: the save 'step-0000000007' in flight in" in err0, err0
    assert "did not commit: CommitTimeoutError" in err0, err0
    assert not (tmp_path / "ckpt" / "step-0000000007").exists()

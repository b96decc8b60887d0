"""The cleanup of stale temporaries never disturbs a live writer in another process, a reader
never needs to write, and of two processes committing one name the loser is told so.

Every process here is real (forked from the session's zygote, tests/zygote.py, or a plain
subprocess for the read-only mount), the read-only root a real read-only bind mount in
a private mount namespace (``unshare -m``; skipped where mounts are not permitted).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import stat
import subprocess
import sys

import pytest
import torch

import datastates
from datastates.format import codec as fmt

from _faults_helpers import WAIT_S, assert_bit_exact, crash_child, hidden_entries, run_child
import zygote

# slow: writers and readers in processes of their own
pytestmark = pytest.mark.slow

SMALL = dict(host_cache_bytes=1 << 20, chunk_bytes=1 << 16)

#: Saves in a loop -- an overwrite of one tag, then a new step, keep_last=2 (so every save also
#: renames an old checkpoint aside, moves ``latest`` and deletes through ``.trash.``) -- until its
#: stdin is closed; prints FAILED at the first save that fails.
WRITER = r"""
import select, sys, torch, datastates
config = datastates.CheckpointConfig(host_cache_bytes=1 << 20, chunk_bytes=1 << 16, keep_last=2)
with datastates.Checkpointer(sys.argv[1], config) as ck:
    i = 0
    print("READY", flush=True)
    while not select.select([sys.stdin], [], [], 0)[0]:
        i += 1
        try:
            ck.save({"x": torch.full((4096,), float(i))}, tag="live", overwrite=True).wait()
            ck.save({"x": torch.full((4096,), float(i))}, step=i).wait()
        except Exception as exc:
            print(f"FAILED {i} {type(exc).__name__}: {exc}".replace("\n", " "), flush=True)
            sys.exit(1)
    print(f"DONE {i}", flush=True)
"""

#: Commits each name read from stdin as a tag, without overwrite; prints the outcome.
RACER = r"""
import sys, torch, datastates
me = int(sys.argv[2])
config = datastates.CheckpointConfig(host_cache_bytes=1 << 20, chunk_bytes=1 << 16)
with datastates.Checkpointer(sys.argv[1], config) as ck:
    print("READY", flush=True)
    for line in sys.stdin:
        try:
            ck.save({"x": torch.full((1024,), float(me)), "who": me}, tag=line.strip()).wait()
            print("COMMITTED", flush=True)
        except datastates.CheckpointExistsError:
            print("EXISTS", flush=True)
        except Exception as exc:
            print(f"ERROR {type(exc).__name__}: {exc}".replace("\n", " "), flush=True)
"""

#: Saves the tag ``live`` with overwrite=True for each round number read from stdin; prints the
#: outcome. Its commit, once it has looked at the name (free or not), prints ROOM and waits for a
#: line GO, so that the parent lets two of them rename only once both have looked. ``renames``:
#: as on a file system that cannot exchange two directories (NFS, FUSE).
OVERWRITER = r"""
import sys, torch, datastates
from datastates.commit.publish import RenamePublisher
from datastates.storage import posix
me = int(sys.argv[2])
if sys.argv[3] == "renames":
    posix._renameat2 = None  # as a C library without renameat2: the two renames are used
looked = RenamePublisher._make_room
gate = []

def make_room(self, *args):
    replace = looked(self, *args)
    if gate:  # the first look of this save only
        gate.clear()
        print("ROOM", flush=True)
        assert sys.stdin.readline() == "GO\n"
    return replace

RenamePublisher._make_room = make_room
config = datastates.CheckpointConfig(host_cache_bytes=1 << 20, chunk_bytes=1 << 16)
with datastates.Checkpointer(sys.argv[1], config) as ck:
    print("READY", flush=True)
    for line in sys.stdin:
        k = int(line)
        gate.append(k)
        try:
            ck.save({"x": torch.full((1024,), float(10 * k + me)), "who": me, "round": k},
                    tag="live", overwrite=True).wait()
            print("COMMITTED", flush=True)
        except Exception as exc:
            print(f"ERROR {type(exc).__name__}: {exc}".replace("\n", " "), flush=True)
"""

#: Opens a root, lists it and loads the latest checkpoint into a file outside the root.
READER = r"""
import sys, torch, datastates
with datastates.Checkpointer(sys.argv[1]) as ck:
    names = [i.name for i in ck.list()]
    torch.save({"latest": ck.latest().name, "names": names, "state": ck.load()}, sys.argv[2])
print("READ", flush=True)
"""


def _start(code: str, *args) -> zygote.Process:
    """``python -c CODE ARGS`` forked from the session's zygote, once it printed READY."""
    child = zygote.Process(
        [sys.executable, "-c", code, *map(str, args)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdout.readline() == "READY\n", "the child did not start"
    return child


def _finish(child: zygote.Process) -> tuple[int, str]:
    child.stdin.close()
    out = child.stdout.read()
    return child.wait(WAIT_S), out


def test_opening_the_root_never_disturbs_a_live_writer(tmp_path):
    """Another process opens the root 60 times while the writer overwrites, retains and moves
    ``latest`` non-stop, with a stale age so small that every temporary counts as old: no open
    fails (no vanished ``latest.tmp.*``, no ENOTEMPTY), no save of the writer fails (nothing of
    a live owner is removed or renamed back), and once the writer is gone the root holds its
    last checkpoints, bit-exact, and no temporary."""
    root = tmp_path / "root"
    writer = _start(WRITER, root)
    opener = datastates.CheckpointConfig(stale_tmp_age_s=1e-6, **SMALL)
    try:
        for _ in range(60):
            with datastates.Checkpointer(root, opener) as ck:
                assert all(i.seq > 0 for i in ck.list())
    finally:
        rc, out = _finish(writer)
    assert rc == 0 and out.startswith("DONE"), out
    last = int(out.split()[1])
    with datastates.Checkpointer(root, opener) as ck:
        assert [i.name for i in ck.list()][-2:] == ["live", fmt.step_name(last)]
        assert torch.equal(ck.load(tag="live")["x"], torch.full((4096,), float(last)))
        assert torch.equal(ck.load(step=last)["x"], torch.full((4096,), float(last)))
    assert hidden_entries(root) == []
    assert [n for n in os.listdir(root) if n.startswith(".")] == []  # dead leases retired too


def test_the_loser_of_a_race_to_commit_one_name_gets_checkpoint_exists_error(tmp_path):
    """Two processes commit the same new name at the same time, 20 times: each time exactly one
    commits, the other gets CheckpointExistsError (never a write error from the rename), and
    the name holds the winner's state."""
    root = tmp_path / "root"
    racers = [_start(RACER, root, 0), _start(RACER, root, 1)]
    outcomes = []
    try:
        for k in range(20):
            for racer in racers:
                racer.stdin.write(f"race-{k:02d}\n")
                racer.stdin.flush()
            outcomes.append([racer.stdout.readline().strip() for racer in racers])
    finally:
        for racer in racers:
            _finish(racer)
    with datastates.Checkpointer(root) as ck:
        for k, outcome in enumerate(outcomes):
            assert sorted(outcome) == ["COMMITTED", "EXISTS"], f"race {k}: {outcome}"
            winner = outcome.index("COMMITTED")
            loaded = ck.load(tag=f"race-{k:02d}")
            assert loaded["who"] == winner
            assert torch.equal(loaded["x"], torch.full((1024,), float(winner)))
    assert hidden_entries(root) == []


@pytest.mark.parametrize("rename", ["exchange", "renames"])
def test_two_processes_overwriting_one_new_name_both_commit(tmp_path, rename):
    """Two processes save the tag ``live`` with overwrite=True at the same time, 10 rounds, the
    tag deleted before each, both renaming only once both found the name free: neither ever
    fails (the one whose rename finds the name taken replaces what is there), and ``live`` then
    holds one of the two saves of that round, whole -- with the directories exchanged in one
    step, and with two renames."""
    root = tmp_path / "root"
    racers = [_start(OVERWRITER, root, me, rename) for me in (0, 1)]
    outcomes = []
    try:
        with datastates.Checkpointer(root, datastates.CheckpointConfig(**SMALL)) as ck:
            for k in range(10):
                if k:
                    ck.delete(tag="live")
                for line in (f"{k}\n", "GO\n"):
                    for racer in racers:
                        racer.stdin.write(line)
                        racer.stdin.flush()
                    if line != "GO\n":
                        assert [racer.stdout.readline() for racer in racers] == ["ROOM\n"] * 2
                outcomes.append([racer.stdout.readline().strip() for racer in racers])
                loaded = ck.load(tag="live")
                assert loaded["round"] == k and loaded["who"] in (0, 1), loaded
                assert torch.equal(loaded["x"], torch.full((1024,), 10.0 * k + loaded["who"]))
    finally:
        for racer in racers:
            _finish(racer)
    assert outcomes == [["COMMITTED", "COMMITTED"]] * 10, outcomes
    assert hidden_entries(root) == []


# ---------------------------------------------------------------- a read-only copy


def _read_only(root, *command) -> subprocess.CompletedProcess:
    """Run ``command`` in a private mount namespace where ``root`` is mounted read-only."""
    script = 'mount --bind "$0" "$0" && mount -o remount,bind,ro "$0" "$0" && exec "$@"'
    return subprocess.run(
        ["unshare", "-m", "sh", "-c", script, os.fspath(root), *command],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
    )


def _read_only_mounts_work(tmp_path) -> bool:
    if shutil.which("unshare") is None:
        return False
    probe = tmp_path / "probe"
    probe.mkdir()
    done = _read_only(
        probe, "sh", "-c", 'touch "$0/x" 2>/dev/null && exit 1 || exit 0', os.fspath(probe)
    )
    return done.returncode == 0 and not (probe / "x").exists()


def _tree(root) -> dict:
    """Every entry under ``root``: its kind, and for a file its size, time and bytes."""
    out = {}
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            path = os.path.join(folder, name)
            st = os.lstat(path)
            digest = None
            if stat.S_ISREG(st.st_mode):
                with open(path, "rb") as f:
                    digest = hashlib.sha256(f.read()).hexdigest()
            out[os.path.relpath(path, root)] = (
                stat.S_IFMT(st.st_mode),
                st.st_size,
                st.st_mtime_ns,
                digest,
            )
    return out


@pytest.mark.parametrize(
    "mode,n,leftover",
    [
        ("replace-latest", 1, "latest.tmp."),  # step 2 committed, latest not yet replaced
        # step 1 replaced (the two exchanged), the old one at the temporary's name, not yet removed
        ("overwrite-rename-after", 1, ".tmp."),
    ],
)
def test_a_read_only_copy_with_a_crashed_writers_leftovers_opens(tmp_path, mode, n, leftover):
    """A writer was killed in a commit and left a temporary; the root is then mounted
    read-only. A reader opens it, lists it and loads the latest checkpoint bit-exact, and the
    tree is byte-identical afterwards: it never needed to write (the cleanup it could not do is
    logged, not raised). The next writable open removes the leftovers and the dead leases."""
    if not _read_only_mounts_work(tmp_path):
        pytest.skip("read-only bind mounts are not permitted here (unshare -m, mount --bind)")
    root = tmp_path / "root"
    root.mkdir()
    proc = run_child(root, mode, n)
    assert proc.returncode < 0, proc.stdout + proc.stderr  # killed at the injected point
    assert any(name.startswith(leftover) for name in os.listdir(root)), os.listdir(root)
    before = _tree(root)
    out = tmp_path / "loaded.pt"
    read = _read_only(root, sys.executable, "-c", READER, os.fspath(root), os.fspath(out))
    assert read.returncode == 0 and "READ" in read.stdout, read.stderr
    assert _tree(root) == before
    loaded = torch.load(out, weights_only=False)
    expected = fmt.step_name(1 if mode.startswith("overwrite") else 2)
    assert loaded["latest"] == expected
    assert_bit_exact(loaded["state"], crash_child.make_state(2))
    with datastates.Checkpointer(root, crash_child.config(None)) as ck:
        assert ck.latest().name == expected
    assert [name for name in os.listdir(root) if name.startswith(".")] == []
    assert not any(name.startswith("latest.tmp") for name in os.listdir(root))


def test_a_replaced_checkpoint_left_half_removed_is_never_put_back(tmp_path, monkeypatch):
    """An overwrite whose removal of the replaced copy fails halfway, then a deletion of that
    name: the cleanup finishes the removal and never brings the old copy back."""
    from datastates.commit import publish, retention

    real = publish.posix.remove_tree
    calls = []

    def failing_once(path):
        calls.append(os.path.basename(path))
        if len(calls) == 1:  # remove the manifest, then fail as an NFS .nfsXXXX file would
            os.remove(os.path.join(path, fmt.MANIFEST))
            raise OSError(16, "Device or resource busy", path)
        return real(path)

    config = datastates.CheckpointConfig(stale_tmp_age_s=1e-6, **SMALL)
    with datastates.Checkpointer(tmp_path, config) as ck:
        ck.save({"x": torch.ones(8)}, step=1).wait(WAIT_S)
        monkeypatch.setattr(publish.posix, "remove_tree", failing_once)
        with pytest.warns(RuntimeWarning):
            ck.save({"x": torch.full((8,), 2.0)}, step=1, overwrite=True).wait(WAIT_S)
        monkeypatch.undo()
        ck.delete(step=1)
    assert calls and calls[0].startswith(".trash.")
    retention.clean_stale(str(tmp_path), 1e-6)
    assert not os.path.exists(tmp_path / fmt.step_name(1))
    assert [n for n in os.listdir(tmp_path) if n.startswith((".old.", ".trash."))] == []
    with datastates.Checkpointer(tmp_path, config) as ck:
        ck.save({"x": torch.full((8,), 3.0)}, step=1).wait(WAIT_S)  # the name is free
        assert torch.equal(ck.load(step=1)["x"], torch.full((8,), 3.0))

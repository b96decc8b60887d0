"""Crash safety: a process SIGKILLed anywhere in a save leaves only committed, bit-exact
checkpoints.

Each test runs ``_crash_child.py`` (a process forked from the session's zygote, tests/zygote.py:
torch already imported): it commits step 1, then dies while saving step 2 (6 MiB of tensors
streamed through a 256 KiB host cache: 97 data writes of 64 KiB units, with backpressure; a unit
costs its write whatever its size, so the state is no bigger than the kill points need). Most kill
points are injected in the child (it SIGKILLs itself at an exact event: the n-th write, a torn
write, an fsync, a rename of the commit protocol, the update of ``latest``); some are real SIGKILLs
sent by this process at a point the child reports or the file system shows. Correctness never
depends on timing: whatever the moment, the directory must hold step 1, and step 2 either complete
or invisible.
"""

from __future__ import annotations

import os
import random
import select
import signal
import subprocess
import threading
import time

import pytest

import datastates
from datastates.commit import catalog

from _faults_helpers import (
    WAIT_S,
    tmp_of,
    assert_bit_exact,
    child_command,
    crash_child,
    hidden_entries,
    latest_temporaries,
    run_child,
    tensors_of,
    visible_entries,
    zeros_like_state,
)
import zygote

# slow: each test kills a child process at an injected point
pytestmark = pytest.mark.slow

STEP1 = "step-0000000001"
STEP2 = "step-0000000002"


@pytest.fixture(scope="module")
def states():
    return {1: crash_child.make_state(1), 2: crash_child.make_state(2)}


def check_after_crash(root, states, *, keep_last=None, overwrite=False) -> set[str]:
    """What every crash must leave behind; returns the names committed after recovery."""
    root = os.fspath(root)
    # 1. Before anyone cleans up: nothing partial is visible, only committed checkpoints list.
    listed = catalog.list_checkpoints(root)
    names = {i.name for i in listed}
    assert names <= {STEP1, STEP2}
    if not overwrite:
        assert set(visible_entries(root)) == names, "a partial checkpoint is visible"
        if keep_last is None:
            assert STEP1 in names, "the committed step 1 was lost"
        else:
            assert names, "every checkpoint was lost"
        found = catalog.latest(root)
        assert found is not None and found.name in names

    # 2. A new Checkpointer cleans the temporaries of the dead process.
    with datastates.Checkpointer(root, crash_child.config(keep_last)) as ck:
        assert hidden_entries(root) == [], f"stale temporaries left: {hidden_entries(root)}"
        listed = ck.list()
        names = {i.name for i in listed}
        assert set(visible_entries(root)) == names
        if overwrite:
            assert names == {STEP1}
        # 3. Every listed checkpoint is bit-exact (step 2 complete, or absent).
        for info in listed:
            loaded = ck.load(tag=info.name)
            if overwrite:  # the old or the new content, never a mix
                expected = states[loaded["step"]]
            else:
                expected = states[info.step]
            assert_bit_exact(loaded, expected, info.name)
        # 4. latest() names a committed checkpoint that restores bit-exactly in place.
        latest = ck.latest()
        assert latest is not None and latest.name in names
        live = zeros_like_state(states[1])
        report = ck.restore(live)
        assert report.name == latest.name
        want = states[ck.load(tag=latest.name, keys="step")["step"]]
        for key, tensor in tensors_of(want).items():
            assert_bit_exact(tensors_of(live)[key], tensor, key)
        # 5. The directory is usable: step 2 can be saved (again) and is then the latest.
        if STEP2 not in names:
            ck.save(states[2], step=2).wait(WAIT_S)
            assert_bit_exact(ck.load(step=2), states[2], STEP2)
            assert ck.latest().name == STEP2
        ck.save({"after": states[1]["ints"]}, step=3).wait(WAIT_S)
        assert ck.latest().name == "step-0000000003"
    assert hidden_entries(root) == []
    return names


# (mode, n, keep_last, what the kill interrupts)
INJECTED = [
    ("claim", 1, None, "the .tmp directory made, its shard file not yet opened"),
    ("pwrite", 1, None, "before the first data write of step 2"),
    ("pwrite", 48, None, "in the middle of the tensor data"),
    ("torn", 92, None, "a torn write near the end of the data"),
    ("commitwrite", 1, None, "before the object blob"),
    ("commitwrite", 3, None, "before the shard header (the index is written)"),
    ("fsync", 1, None, "before the shard file's fsync"),
    ("commitwrite", 4, None, "before manifest.json.tmp is written"),
    ("fsync", 2, None, "the shard file complete, before the second fsync of the commit"),
    ("fsync", 3, None, "after manifest.json.tmp is written, before its fsync"),
    ("rename-before", 1, None, "manifest.json in place, before the directory rename"),
    ("rename-after", 1, None, "right after the directory rename"),
    ("set-latest", 1, None, "after the rename, before latest is written"),
    ("replace-latest", 1, None, "latest.tmp written, before it replaces latest"),
    ("rename-before", 2, 1, "retention: before step 1 is renamed to .trash"),
    ("rename-after", 2, 1, "retention: step 1 renamed to .trash, not yet deleted"),
    # both checkpoints with a split manifest: a part written before manifest.json
    ("split-commitwrite", 4, None, "before the manifest's part is written"),
    ("split-fsync", 3, None, "the part written, before its fsync"),
    ("split-commitwrite", 5, None, "the part in place, before manifest.json.tmp is written"),
    ("split-fsync", 5, None, "manifest.json.tmp written beside the part, before its fsync"),
    ("split-fsync", 6, None, "the head and its part in place, before the next fsync"),
    ("split-rename-before", 1, None, "the head and its part in place, before the directory rename"),
    ("split-rename-after", 1, None, "right after the directory rename of a split manifest"),
]


def _param(mode, n, keep_last, what):
    name = what.split(" (")[0].replace(" ", "_").replace("'", "")
    return pytest.param(mode, n, keep_last, id=f"{mode}-{n}-{name}")


@pytest.mark.parametrize("mode,n,keep_last", [_param(*p) for p in INJECTED])
def test_kill_at_injected_point(tmp_path, states, mode, n, keep_last):
    proc = run_child(tmp_path, mode, n, keep_last)
    assert "COMMITTED 1" in proc.stdout, proc.stderr
    assert proc.returncode == -signal.SIGKILL, (
        f"the kill point was never reached (rc {proc.returncode}): {proc.stdout}{proc.stderr}"
    )
    assert "COMMITTED 2" not in proc.stdout
    if mode in ("set-latest", "replace-latest"):
        # Step 2 is committed; the ``latest`` file still names step 1, but it is only a hint:
        # the newest committed checkpoint is the latest.
        with open(os.path.join(tmp_path, "latest")) as f:
            assert f.read() == STEP1
        assert catalog.latest(tmp_path).name == STEP2
    names = check_after_crash(tmp_path, states, keep_last=keep_last)
    after_rename = (
        mode.removeprefix("split-") in ("rename-after", "set-latest", "replace-latest") or keep_last
    )
    assert (STEP2 in names) == bool(after_rename)


def test_stale_latest_temporary_is_cleaned(tmp_path, states):
    proc = run_child(tmp_path, "replace-latest", 1)
    assert proc.returncode == -signal.SIGKILL
    assert latest_temporaries(tmp_path), "the kill point leaves a latest temporary"
    with datastates.Checkpointer(tmp_path, crash_child.config(None)):
        assert latest_temporaries(tmp_path) == []


@pytest.mark.parametrize(
    "mode,n",
    [
        # the old one and the new one about to be exchanged
        pytest.param("rename-before", 1),
        # exchanged: the new one in place, the old one where the new one was written
        pytest.param("rename-after", 1),
        # the old one about to be renamed to .trash
        pytest.param("rename-before", 2),
        # the old one renamed to .trash, not yet deleted
        ("rename-after", 2),
    ],
)
def test_kill_while_overwriting(tmp_path, states, mode, n):
    """Replacing step 1 with ``overwrite=True`` (the two directories exchanged in one step):
    after a crash the next Checkpointer shows step 1 with either the old or the new content,
    complete, never both missing nor a mix."""
    proc = run_child(tmp_path, f"overwrite-{mode}", n)
    assert proc.returncode == -signal.SIGKILL, proc.stdout + proc.stderr
    check_after_crash(tmp_path, states, overwrite=True)


class Child:
    """The crash child run in the background, with its stdout markers read with a deadline."""

    def __init__(self, root, mode="external", n=0):
        self.proc = zygote.Process(child_command(root, mode, n), stdout=subprocess.PIPE, bufsize=0)
        self._buf = b""

    def expect(self, marker: str) -> None:
        deadline = time.monotonic() + WAIT_S
        while True:
            lines = self._buf.split(b"\n")
            for i, line in enumerate(lines[:-1]):
                if line.decode() == marker:
                    self._buf = b"\n".join(lines[i + 1 :])
                    return
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {marker!r} from the child within {WAIT_S} s")
            ready, _, _ = select.select([self.proc.stdout], [], [], left)
            chunk = os.read(self.proc.stdout.fileno(), 4096) if ready else b""
            if ready and not chunk:
                raise AssertionError(
                    f"child ended (rc {self.proc.wait(WAIT_S)}) before printing {marker!r}"
                )
            self._buf += chunk

    def kill(self) -> None:
        """SIGKILL it if it still runs; reap it."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(WAIT_S)
        self.proc.stdout.close()


@pytest.mark.parametrize("n", [75])
def test_external_sigkill_at_paused_write(tmp_path, states, n):
    """A real SIGKILL from outside while a writer thread is inside its n-th write."""
    child = Child(tmp_path, "gate", n)
    try:
        child.expect("PAUSED")
    finally:
        child.kill()
    assert child.proc.returncode == -signal.SIGKILL
    names = check_after_crash(tmp_path, states)
    assert names == {STEP1}


@pytest.mark.parametrize("trigger", ["saving", "shard-4MiB", "random"])
def test_external_sigkill_free_running(tmp_path, states, trigger):
    """A real SIGKILL at a moment picked from the outside: when save() returned, when the shard
    file has grown past 4 MiB (of 6), or after a random delay. The save may even have committed by
    then; either way the directory must be consistent."""
    child = Child(tmp_path)
    try:
        child.expect("COMMITTED 1")
        if trigger in ("saving", "random"):
            child.expect("SAVING")
        if trigger == "random":
            # The delay only varies where the kill lands; nothing asserted depends on it.
            try:
                child.proc.wait(timeout=random.uniform(0.0, 0.1))
            except subprocess.TimeoutExpired:
                pass
        elif trigger != "saving":
            threshold = 4 << 20
            poll = threading.Event()  # a polling interval, not a synchronization
            while child.proc.poll() is None and not _shard_bigger_than(tmp_path, threshold):
                poll.wait(0.002)
    finally:
        child.kill()  # if it already finished, step 2 is committed: still a valid case
    check_after_crash(tmp_path, states)


def _shard_bigger_than(root, nbytes: int) -> bool:
    for name in hidden_entries(root):
        if not tmp_of(name, STEP2):
            continue
        try:
            return os.path.getsize(os.path.join(root, name, "rank-00000.dsf")) > nbytes
        except OSError:
            return False
    return os.path.isdir(os.path.join(root, STEP2))  # already committed: kill now anyway

"""Kill and resume: a training job running the documented resume loop (``_resume_child.py``) is
SIGKILLed at file events of its saves — every write of the commit thread, every fsync, the renames
of the commit and of retention, the update of ``latest``, data writes, a torn write — and simply
started again, with no manual action, until it finishes. Its final state must be bit-identical to
that of a run that was never interrupted.

Each chain below kills one job again and again in the same directory (each kill point counts the
events of that process only), so later kills land in later saves, after earlier recoveries.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

import datastates
from datastates.commit import catalog

from _faults_helpers import HERE, WAIT_S, assert_bit_exact, hidden_entries
import zygote

# slow: jobs killed and resumed in child processes
pytestmark = pytest.mark.slow

CHILD = os.path.join(HERE, "_resume_child.py")
STEPS = 6
LAST = f"step-{STEPS - 1:010d}"

# Each kill lands in the first or second save of its run, so the chains make progress through
# all six saves. Per save: 5 commit-thread writes (object blob, index, header, manifest.json.tmp,
# latest.tmp), 6-7 fsyncs (shard file, manifest.json.tmp, the .tmp directory, the root after the
# rename, latest.tmp, the root...), 1 commit rename and, from the third save on, 1 retention rename.
CHAINS = {
    "commit-protocol": [
        ("commitwrite", 2),
        ("fsync", 2),
        ("rename-after", 1),
        ("commitwrite", 5),
        ("set-latest", 1),
        ("replace-latest", 1),
        ("fsync", 4),
    ],
    "data-and-retention": [
        ("pwrite", 1),
        ("torn", 2),
        ("claim", 2),
        ("commitwrite", 9),
        ("rename-before", 2),
        ("fsync", 9),
        ("commitwrite", 3),
    ],
}


def run_job(root, mode: str = "none", n: int = 0) -> subprocess.CompletedProcess:
    """One run of the job, in a process of its own (forked from the session's zygote: torch is
    already imported, so a run costs its saves, not the interpreter's start)."""
    return zygote.run(
        [sys.executable, CHILD, os.fspath(root), mode, str(n), str(STEPS)],
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        cwd=HERE,
    )


def final_digest(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 0, f"the job failed (rc {proc.returncode}):\n{proc.stderr}"
    lines = [line for line in proc.stdout.splitlines() if line.startswith("FINAL ")]
    assert len(lines) == 1, proc.stdout
    return lines[0].split()[1]


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run: its final digest and its directory."""
    root = tmp_path_factory.mktemp("uninterrupted")
    return final_digest(run_job(root)), root


@pytest.mark.parametrize("chain", list(CHAINS))
def test_killed_job_resumes_to_the_same_final_state(tmp_path, reference, chain):
    digest, ref_root = reference
    newest = -1
    for mode, n in CHAINS[chain]:
        proc = run_job(tmp_path, mode, n)
        assert proc.returncode == -signal.SIGKILL, (
            f"{mode}/{n}: the kill point was not reached (rc {proc.returncode}):\n{proc.stderr}"
        )
        # Nothing partial is visible, and latest() never goes back.
        found = catalog.latest(tmp_path) if os.path.isdir(tmp_path) else None
        step = found.step if found is not None else -1
        assert step >= newest, f"{mode}/{n}: latest went back from step {newest} to {step}"
        newest = step
        if found is not None:
            names = {i.name for i in catalog.list_checkpoints(tmp_path)}
            assert found.name in names  # (retention may lag too: it runs after ``latest``)
        if mode == "set-latest":  # committed, but the ``latest`` file still lags behind
            hint = os.path.join(tmp_path, "latest")
            assert not os.path.exists(hint) or open(hint).read() != found.name
    assert final_digest(run_job(tmp_path)) == digest
    assert newest < STEPS - 1, "no kill landed before the last save: the chain tests nothing"
    # The directory is as after the uninterrupted run: the last two steps, nothing hidden.
    assert [i.name for i in catalog.list_checkpoints(tmp_path)] == [f"step-{STEPS - 2:010d}", LAST]
    assert hidden_entries(tmp_path) == []
    with datastates.Checkpointer(tmp_path) as resumed, datastates.Checkpointer(ref_root) as ref:
        assert resumed.latest().name == LAST
        assert_bit_exact(
            resumed.load(step=STEPS - 1, trusted=True), ref.load(step=STEPS - 1, trusted=True), LAST
        )

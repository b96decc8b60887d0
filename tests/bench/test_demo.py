"""The README's first command: ``python -m benchmarks.demo`` trains, checkpoints, restores and
continues bit-identically (run small here; the exit code says whether the resume was exact)."""

from __future__ import annotations

import os
import sys

import pytest

import zygote

from benchmarks import demo

# slow: the demo trains, checkpoints, restores and resumes in a process of its own
pytestmark = pytest.mark.slow

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_demo_runs_from_the_repository_root_and_resumes_bit_identically(tmp_path):
    # ``python -m benchmarks.demo``, forked from the session's zygote (torch already imported)
    done = zygote.run(
        [
            sys.executable,
            "-m",
            "benchmarks.demo",
            "--steps",
            "7",
            "--every",
            "2",
            "--layers",
            "1",
            "--width",
            "48",
            "--vocab",
            "128",
            "--batch",
            "2",
            "--dir",
            str(tmp_path / "ckpt"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "resumed from step 6 to 7: parameters bit-identical" in done.stdout
    assert "median training stall per checkpoint" in done.stdout
    # progress: one line per checkpoint, printed as training goes (before the table)
    progress = [line for line in done.stdout.splitlines() if ": save() returned in " in line]
    assert [line.split()[1] for line in progress] == ["2/7", "4/7", "6/7"], done.stdout
    assert done.stdout.index(progress[-1]) < done.stdout.index("trained 7 steps")
    # every column of the table is explained on a line of its own
    for name, _ in demo.COLUMNS:
        assert any(
            line.strip().startswith(name + " ")
            for line in done.stdout.splitlines()
            if not line.startswith("checkpoint ")
        ), name
    # keep_last=2: the two newest checkpoints are what the demo leaves behind
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir() if not p.name.startswith(".")) == [
        "latest",
        "step-0000000004",
        "step-0000000006",
    ]

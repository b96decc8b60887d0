"""Every test file is collected by the README's test command; the fast lane runs every unit test.

pytest skips some folder names by default (``dist``, ``build``...): a test file that the README's
command never collects proves nothing, and CI (``.ci/run``) runs exactly that command. This test
takes the command from the README, runs it with ``--collect-only`` and compares the files it
collected with every ``tests/**/test_*.py`` on disk.

The fast lane (CONTRIBUTING.md) leaves out the tests marked ``slow``; a unit test must never be
one of them, so the lane's collection must hold every test that ``tests/unit`` holds.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

# slow: each test collects the whole suite in a pytest of its own (every framework imported)
pytestmark = pytest.mark.slow


def readme_test_command() -> list[str]:
    """The command of the README's "run the tests" line, as arguments."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    match = re.search(r"^# 2\. run the tests\n(.+)$", text, re.MULTILINE)
    assert match, "README.md: expected a '# 2. run the tests' line followed by the command"
    return shlex.split(match.group(1))


#: The fast lane, as CONTRIBUTING.md writes it.
FAST_LANE = 'python -m pytest -m "not slow" -n 2 tests -q'


def collect(command: list[str]) -> set[str]:
    """The node ids ``command`` (``python -m pytest ...``) collects."""
    assert command[:3] == ["python", "-m", "pytest"], command
    if "-n" in command:  # pytest-xdist's workers: the collection is the same without them
        at = command.index("-n")
        command = command[:at] + command[at + 2 :]
    quiet = [] if "-q" in command else ["-q"]  # one -q lists node ids; -qq only counts per file
    result = subprocess.run(
        [sys.executable, *command[1:], *quiet, "--collect-only", "-p", "no:cacheprovider"],
        cwd=REPO,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"},
    )
    assert result.returncode in (0, 5), result.stdout[-3000:] + result.stderr[-3000:]
    return {line for line in result.stdout.splitlines() if "::" in line}


def test_the_readme_command_collects_every_test_file():
    command = readme_test_command()
    collected = {node.split("::", 1)[0] for node in collect(command)}
    on_disk = {str(path.relative_to(REPO)) for path in (REPO / "tests").rglob("test_*.py")}
    assert on_disk - collected == set(), "test files the README's command does not collect"
    assert any(name.startswith("tests/dist/") for name in collected)


def test_the_fast_lane_runs_every_unit_test_and_leaves_the_slow_ones_out():
    assert FAST_LANE in (REPO / "CONTRIBUTING.md").read_text(encoding="utf-8")
    fast = collect(shlex.split(FAST_LANE))
    unit = collect(["python", "-m", "pytest", "tests/unit", "-q"])
    assert unit, "nothing collected under tests/unit"
    assert unit - fast == set(), "unit tests the fast lane leaves out (never mark one slow)"
    on_disk = {str(path.relative_to(REPO)) for path in (REPO / "tests/unit").rglob("test_*.py")}
    assert on_disk - {node.split("::", 1)[0] for node in fast} == set()
    # the marker is in use: the multi-process tests are not in the lane
    assert not any(node.startswith("tests/dist/") for node in fast)

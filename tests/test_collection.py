"""Every test file is collected by the README's test command.

pytest skips some folder names by default (``dist``, ``build``...): a test file that the README's
command never collects proves nothing, and CI (``.ci/run``) runs exactly that command. This test
takes the command from the README, runs it with ``--collect-only`` and compares the files it
collected with every ``tests/**/test_*.py`` on disk.
"""
from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def readme_test_command() -> list[str]:
    """The command of the README's "run the tests" line, as arguments."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    match = re.search(r"^# 2\. run the tests\n(.+)$", text, re.MULTILINE)
    assert match, "README.md: expected a '# 2. run the tests' line followed by the command"
    return shlex.split(match.group(1))


def test_the_readme_command_collects_every_test_file():
    command = readme_test_command()
    assert command[:3] == ["python", "-m", "pytest"], command
    quiet = [] if "-q" in command else ["-q"]  # one -q lists node ids; -qq only counts per file
    result = subprocess.run([sys.executable, *command[1:], *quiet, "--collect-only",
                             "-p", "no:cacheprovider"], cwd=REPO, capture_output=True,
                            text=True, env={**os.environ, "PYTHONDONTWRITEBYTECODE": "1"})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    collected = {line.split("::", 1)[0] for line in result.stdout.splitlines() if "::" in line}
    on_disk = {str(path.relative_to(REPO)) for path in (REPO / "tests").rglob("test_*.py")}
    assert on_disk - collected == set(), "test files the README's command does not collect"
    assert any(name.startswith("tests/dist/") for name in collected)

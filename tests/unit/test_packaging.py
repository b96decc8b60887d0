"""Packaging promises: a version flag, type information shipped, a license that matches metadata."""
from __future__ import annotations

import pathlib
import subprocess
import sys
import pytest

tomllib = pytest.importorskip("tomllib")

import datastates
from datastates.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_version_flag_prints_the_package_version(capsys):
    try:
        main(["--version"])
    except SystemExit as exc:
        assert exc.code == 0
    assert capsys.readouterr().out.strip() == f"datastates {datastates.__version__}"


def test_module_entry_point_reports_version():
    out = subprocess.run([sys.executable, "-m", "datastates", "--version"], capture_output=True,
                         text=True, check=True, timeout=120).stdout
    assert out.strip() == f"datastates {datastates.__version__}"


def test_py_typed_marker_is_shipped_with_the_package():
    assert (pathlib.Path(datastates.__file__).parent / "py.typed").is_file()


def test_license_file_matches_the_spdx_expression():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text().splitlines()[0]
    assert project["version"] == datastates.__version__

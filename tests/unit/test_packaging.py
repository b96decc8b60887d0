"""Packaging promises: a version flag, type information shipped, a license that matches metadata."""

from __future__ import annotations

import pathlib
import subprocess
import sys
import pytest

tomllib = pytest.importorskip("tomllib")

import datastates
from datastates.tools.cli import main

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_version_flag_prints_the_package_version(capsys):
    try:
        main(["--version"])
    except SystemExit as exc:
        assert exc.code == 0
    assert capsys.readouterr().out.strip() == f"datastates {datastates.__version__}"


def test_module_entry_point_reports_version():
    out = subprocess.run(
        [sys.executable, "-m", "datastates", "--version"],
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert out.strip() == f"datastates {datastates.__version__}"


def test_py_typed_marker_is_shipped_with_the_package():
    assert (pathlib.Path(datastates.__file__).parent / "py.typed").is_file()


def test_license_file_matches_the_spdx_expression():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    assert project["license"] == "Apache-2.0"
    assert project["license-files"] == ["LICENSE"]
    assert "Apache License" in (ROOT / "LICENSE").read_text().splitlines()[0]
    assert project["version"] == datastates.__version__


def test_numpy_and_tqdm_are_declared_dependencies():
    # tqdm: the command line's progress bars, drawn whenever stderr is a terminal
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert {d.split(">")[0].split("=")[0].strip() for d in deps} == {"torch", "numpy", "tqdm"}


def test_the_docs_install_what_the_safetensors_import_needs():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert [d.split(">")[0] for d in extras["safetensors"]] == ["safetensors"]
    cli = (ROOT / "docs" / "cli.md").read_text()
    line = next(l for l in cli.splitlines() if "--from safetensors" in l)
    assert "pip install '.[safetensors]'" in line, line
    readme = (ROOT / "README.md").read_text()
    extras_line = next(l for l in readme.splitlines() if l.startswith("Extras:"))
    assert "`.[safetensors]`" in readme[readme.index(extras_line) :].split("\n\n")[0]


def test_docs_install_from_the_repository_not_from_an_index_it_is_not_on():
    # datastates is not published: `pip install datastates...` or 'datastates[x]' would fail
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        text = path.read_text()
        assert "pip install datastates" not in text, path
        assert "pip install 'datastates[" not in text.replace("'datastates[s3] @ git+", ""), path


def _run_suite(tmp_path, env_value):
    """A throwaway test file that skips for a missing package, run under this repository's
    conftest (copied next to it) with DATASTATES_REQUIRE_EXTRAS set to ``env_value``."""
    (tmp_path / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tmp_path / "s3").mkdir()
    (tmp_path / "s3" / "server.py").write_text((ROOT / "tests" / "s3" / "server.py").read_text())
    (tmp_path / "test_x.py").write_text(
        "import pytest\n"
        "def test_missing():\n    pytest.importorskip('no_such_package_datastates')\n"
        "def test_hardware():\n    pytest.skip('needs CUDA')\n"
        "def test_ok():\n    assert True\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "DATASTATES_REQUIRE_EXTRAS"}
    if env_value is not None:
        env["DATASTATES_REQUIRE_EXTRAS"] = env_value
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_a_skip_for_a_missing_package_fails_the_run_when_extras_are_required(tmp_path):
    proc = _run_suite(tmp_path, "1")
    assert proc.returncode == 1, proc.stdout
    assert "REQUIRED BUT SKIPPED" in proc.stdout and "test_missing" in proc.stdout
    assert "test_hardware: " not in proc.stdout  # a hardware skip stays a skip


def test_skips_stay_skips_when_extras_are_not_required(tmp_path):
    proc = _run_suite(tmp_path, None)
    assert proc.returncode == 0, proc.stdout
    assert "2 skipped" in proc.stdout and "REQUIRED BUT SKIPPED" not in proc.stdout

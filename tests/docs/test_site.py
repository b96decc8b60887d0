"""The documentation site: ``mkdocs build --strict`` passes (no broken link or anchor, no page
left out of the navigation, every docstring reference resolved), every public name is on a page
of the API reference, and the version of the package is the one the changelog and the site show.

The build runs when mkdocs and mkdocstrings are installed (the ``docs`` extra; ``.ci/run``
installs it, and there a skip fails the run)."""

from __future__ import annotations

import glob
import importlib.util
import os
import re
import subprocess
import sys

import pytest

import datastates

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REFERENCE = os.path.join(ROOT, "docs", "reference")


def _reference_targets() -> set[str]:
    names = set()
    for path in glob.glob(os.path.join(REFERENCE, "*.md")):
        with open(path, encoding="utf-8") as f:
            names.update(re.findall(r"^::: ([\w.]+)$", f.read(), re.M))
    return names


def test_every_public_name_is_in_the_api_reference():
    targets = _reference_targets()
    documented = {t.split(".", 1)[1] for t in targets if t.count(".") == 1}
    # CheckpointEngine is datastates.integrations.deepspeed's, documented with its module
    missing = set(datastates.__all__) - documented - {"CheckpointEngine"}
    assert not missing, (
        f"names of datastates.__all__ on no page of docs/reference: {sorted(missing)}"
    )
    assert "datastates.integrations.deepspeed" in targets
    modules = {f"datastates.integrations.{m}" for m in ("deepspeed", "lightning", "hf", "dcp")}
    assert modules | {"datastates.testing"} <= targets


def test_every_public_name_has_a_docstring():
    undocumented = [
        n
        for n in datastates.__all__
        if n != "CheckpointEngine" and not (getattr(datastates, n).__doc__ or "").strip()
    ]
    assert not undocumented, undocumented


def test_the_changelog_has_a_section_for_this_version():
    with open(os.path.join(ROOT, "CHANGELOG.md"), encoding="utf-8") as f:
        sections = re.findall(r"^## (.+)$", f.read(), re.M)
    assert sections[0] == "Unreleased", sections
    assert datastates.__version__ in sections, (datastates.__version__, sections)


@pytest.mark.skipif(
    importlib.util.find_spec("mkdocs") is None
    or importlib.util.find_spec("mkdocstrings_handlers") is None,
    reason="mkdocs or mkdocstrings-python not installed (the docs extra)",
)
def test_the_site_builds_strict_and_shows_the_version(tmp_path):
    site = tmp_path / "site"
    env = dict(
        os.environ,
        NO_MKDOCS_2_WARNING="1",
        PYTHONPATH=os.path.join(ROOT, "src") + os.pathsep + os.environ.get("PYTHONPATH", ""),
    )
    proc = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-d", str(site)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    index = (site / "index.html").read_text(encoding="utf-8")
    assert f"datastates {datastates.__version__}" in index
    reference = (site / "reference" / "checkpointer" / "index.html").read_text(encoding="utf-8")
    assert "datastates.Checkpointer" in reference and "restore" in reference


def _cited_tests():
    """``test_file.py::test_name`` cited by README.md and the pages, with where."""
    pages = [os.path.join(ROOT, "README.md")] + glob.glob(
        os.path.join(ROOT, "docs", "**", "*.md"), recursive=True
    )
    for page in pages:
        with open(page, encoding="utf-8") as f:
            text = f.read()
        for m in re.finditer(r"\b(test_\w+\.py)::(test_\w+)", text):
            yield os.path.relpath(page, ROOT), m.group(1), m.group(2)


def test_every_test_the_docs_cite_exists():
    files = {}
    for path in glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True):
        files.setdefault(os.path.basename(path), []).append(path)
    cited = list(_cited_tests())
    assert len(cited) > 20
    missing = []
    for page, name, test in cited:
        sources = []
        for path in files.get(name, []):
            with open(path, encoding="utf-8") as f:
                sources.append(f.read())
        if not any(re.search(rf"^\s*(async )?def {test}\(", s, re.M) for s in sources):
            missing.append(f"{page}: {name}::{test}")
    assert not missing, "tests cited by the documentation that do not exist:\n" + "\n".join(missing)


#: Test files of other projects that the pages name (Lightning's own, run by
#: scripts/run_upstream_tests.py).
UPSTREAM = {"test_async_checkpoint.py", "test_checkpoint_io_plugin.py"}


def test_every_test_file_the_docs_cite_exists():
    names = {
        os.path.basename(p)
        for p in glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True)
    }
    pages = [os.path.join(ROOT, "README.md")] + glob.glob(
        os.path.join(ROOT, "docs", "**", "*.md"), recursive=True
    )
    missing = set()
    for page in pages:
        with open(page, encoding="utf-8") as f:
            cited = set(re.findall(r"\b(test_\w+\.py)\b", f.read()))
        missing |= {f"{os.path.relpath(page, ROOT)}: {n}" for n in cited - names - UPSTREAM}
    assert not missing, sorted(missing)

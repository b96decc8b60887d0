"""``shm_root`` for the memory-tier tests of the integrations: a fresh directory on the real
shared memory (``/dev/shm`` when there is one); at the end every keeper serving a job under it
is stopped, and its memory must then be gone (as tests/faults/test_memory_tier.py does)."""
from __future__ import annotations

import glob
import os
import shutil
import tempfile
import time

import pytest


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
        if not _gone(memdir):
            leftovers.append(memdir)
    shutil.rmtree(root, ignore_errors=True)
    assert not leftovers, f"memory left behind: {leftovers}"


def _gone(memdir: str, timeout: float = 60.0) -> bool:
    """Wait until the keeper of ``memdir`` has ended and removed its memory (in its own
    process, after answering the stop)."""
    from datastates.memory import place
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not os.path.exists(memdir) and not place.keeper_running(memdir):
            return True
        if os.path.exists(memdir) and not place.keeper_running(memdir):
            return False  # no keeper, memory still there: left behind
        time.sleep(0.05)
    return False

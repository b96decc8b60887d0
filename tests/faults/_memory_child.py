"""Child process of the memory-tier tests (run as a script, never collected by pytest).

    python _memory_child.py STORAGE SHM_ROOT KEEPER_LOG MODE N [STEPS]

A trainer with a memory tier (``persist_every=None``: every save goes to memory). The keeper it
starts persists on exit only with ``DS_PERSIST_ON_EXIT=1``: otherwise what a restore finds is
what this process sealed in memory.

- ``MODE`` one of ``_crash_child``'s kill points: commits step 1 (``COMMITTED 1``), installs the
  kill point MODE/N, saves step 2 into memory (``SAVING``), waits for it (``COMMITTED 2``).
- ``MODE`` ``die``: commits steps 1 and 2 into memory, then sends itself SIGKILL (never closes).
- ``MODE`` ``die-handing-on``: commits steps 1-4 into memory (with ``DS_PERSIST_EVERY=2`` steps 2
  and 4 are handed on to the keeper for storage), then sends itself SIGKILL at once.
- ``MODE`` ``full``: commits step 1, then saves ``make_state(2, big=True)``, which the memory
  root (a tmpfs too small for it) cannot hold: prints ``FAILED <error type> <errno>``, then
  ``RESTORED 1`` once memory holds step 1 alone and loads it back bit-exact, and closes, stopping the keeper.
- ``MODE`` ``loop``: saves steps 1..STEPS, printing ``SAVING s`` before each ``save()`` and
  ``SEALED s`` once it is committed, until the parent kills it at some instant.

The state of step s is ``_crash_child.make_state(s, big=False)``.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

from _crash_child import _install, make_state, marker


def open_checkpointer(storage: str, shm_root: str, log_path: str):
    import datastates

    persist = os.environ.get("DS_PERSIST_ON_EXIT") == "1"
    every = int(os.environ.get("DS_PERSIST_EVERY", "0")) or None
    tier = datastates.MemoryTier(
        root=shm_root,
        persist_every=every,
        persist_on_exit=persist,
        log_path=log_path,
        idle_timeout_s=120,
    )
    cfg = datastates.CheckpointConfig(
        host_cache_bytes=256 << 10, chunk_bytes=64 << 10, writer_threads=2, memory_tier=tier
    )
    return datastates.Checkpointer(storage, cfg)


def main() -> None:
    storage, shm_root, log_path, mode, n = sys.argv[1:6]
    ck = open_checkpointer(storage, shm_root, log_path)
    if mode == "loop":
        steps = int(sys.argv[6])
        for step in range(1, steps + 1):
            marker(f"SAVING {step}")
            handle = ck.save(make_state(step, big=False), step=step)
            threading.Thread(target=_sealed, args=(handle, step), daemon=True).start()
        ck.close()
        marker("DONE")
        return
    ck.save(make_state(1, big=False), step=1).wait()
    marker("COMMITTED 1")
    if mode == "die":
        ck.save(make_state(2, big=False), step=2).wait()
        marker("COMMITTED 2")
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "die-handing-on":  # DS_PERSIST_EVERY=2: steps 2 and 4 are handed on
        for step in (2, 3, 4):
            ck.save(make_state(step, big=False), step=step).wait()
            while step == 2 and ck.tiers.handoff.waiting() is not None:
                time.sleep(0.001)  # step 2 taken for writing: step 4 cannot replace it
        marker("COMMITTED 4")  # the keeper may still be copying step 4 (or 2) into storage
        os.kill(os.getpid(), signal.SIGKILL)
    if mode == "full":
        _full(ck)
        return
    _install(mode, int(n))
    handle = ck.save(make_state(2, big=False), step=2)
    marker("SAVING")
    handle.wait()
    marker("COMMITTED 2")
    ck.close()


def _full(ck) -> None:
    import datastates
    from _faults_helpers import assert_bit_exact

    try:
        ck.save(make_state(2, big=True), step=2).wait()
        marker("COMMITTED 2")
    except datastates.DatastatesError as exc:
        cause = exc
        while cause is not None and getattr(cause, "errno", None) is None:
            cause = cause.__cause__
        marker(f"FAILED {type(exc).__name__} {getattr(cause, 'errno', None)}")
    assert [i.step for i in ck.memory.list()] == [1] and ck.latest().step == 1
    assert_bit_exact(ck.load(), make_state(1, big=False))
    marker("RESTORED 1")
    ck.close(stop_keeper=True)


def _sealed(handle, step: int) -> None:
    handle.wait()
    marker(f"SEALED {step}")


if __name__ == "__main__":
    main()

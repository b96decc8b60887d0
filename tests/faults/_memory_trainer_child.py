"""Child process of tests/faults/test_memory_restarts.py (run as a script, never collected).

    python _memory_trainer_child.py STORAGE SHM_ROOT KEEPER_LOG

A trainer with a memory tier (every save to memory, ``keep_last=2``, nothing written to storage
by the keeper). It commits steps 1 and 2 (``COMMITTED 2``), waits for a line on stdin (while the
parent tries to start a second trainer of the job), commits step 3 (``COMMITTED 3``), checks
that memory holds steps 2 and 3 and that step 3 loads back bit-exact (``INTACT 3``), then
detaches (``close()``) and ends.
"""

from __future__ import annotations

import sys

from _crash_child import make_state, marker


def main() -> None:
    import datastates
    from _faults_helpers import assert_bit_exact

    storage, shm_root, log_path = sys.argv[1:4]
    tier = datastates.MemoryTier(
        root=shm_root,
        persist_every=None,
        persist_on_exit=False,
        keep_last=2,
        log_path=log_path,
        idle_timeout_s=120,
    )
    config = datastates.CheckpointConfig(
        memory_tier=tier, host_cache_bytes=1 << 20, chunk_bytes=256 << 10
    )
    ck = datastates.Checkpointer(storage, config)
    for step in (1, 2):
        ck.save(make_state(step, big=False), step=step).wait()
    marker("COMMITTED 2")
    sys.stdin.readline()
    ck.save(make_state(3, big=False), step=3).wait()
    marker("COMMITTED 3")
    assert [i.step for i in ck.memory.list()] == [2, 3]
    assert_bit_exact(ck.load(), make_state(3, big=False))
    marker("INTACT 3")
    ck.close()


if __name__ == "__main__":
    main()

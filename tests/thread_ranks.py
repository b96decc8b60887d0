"""A job of several ranks as threads of this process: one ``Checkpointer`` per rank, all over
one in-memory coordination store (``StoreCommunicator`` over ``MemoryStore``). For tests of what
several ranks read and write where real processes add nothing (tests/dist has those)."""

from __future__ import annotations

import threading
from typing import Any, Callable

import datastates
from datastates.commit.round import MemoryStore, StoreCommunicator, new_run_id


def in_thread_ranks(
    root: str, world: int, action: Callable[[Any, int], Any], timeout_s: float = 120, **options
) -> dict:
    """Rank -> what ``action(checkpointer, rank)`` returned, or the exception it (or opening or
    closing the rank's ``Checkpointer(root, **options)``) raised, for each of ``world`` ranks
    run at once. Fails the test if a rank is still running after ``timeout_s``."""
    store, run, out = MemoryStore(), new_run_id(), {}

    def rank(r: int) -> None:
        try:
            with datastates.Checkpointer(
                root, communicator=StoreCommunicator(store, r, world, run), **options
            ) as ck:
                out[r] = action(ck, r)
        except BaseException as exc:  # noqa: BLE001 - the result
            out[r] = exc

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    assert not any(t.is_alive() for t in threads), "a rank is still running"
    return out

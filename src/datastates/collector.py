"""Pausing Python's cyclic garbage collector while the library builds a large batch of records.

Rank 0's review of a commit round and every reader's parse of a manifest create millions of
small, long-lived objects at scale (about 15 per tensor per rank). While they are built, the
collector's full collections walk all of them again and again: at 1,024 ranks of 200 tensors a
quarter of rank 0's review was spent in the collector (docs/scale.md). Reference counting frees
everything these stages drop; the only thing a pause defers is the collection of reference cycles
made meanwhile by any thread, which the collector reclaims once it resumes.

The collector's switch is process-wide, so pauses are counted: the first to begin records whether
the collector was enabled and disables it, the last to end enables it again only if it was
enabled before the first began. A program that keeps the collector disabled keeps it disabled.
(What this cannot see: another thread calling ``gc.enable()`` or ``gc.disable()`` while a pause
is held; the pause's end then wins.)
"""
from __future__ import annotations

import gc
import threading
from contextlib import contextmanager
from typing import Iterator

_lock = threading.Lock()
_held = 0
_was_enabled = False


@contextmanager
def paused() -> Iterator[None]:
    """Run the block with the cyclic garbage collector disabled (any thread; pauses nest and
    overlap across threads), then restore the state it had before the first pause began, also
    when the block raises."""
    global _held, _was_enabled
    with _lock:
        if _held == 0:
            _was_enabled = gc.isenabled()
            gc.disable()
        _held += 1
    try:
        yield
    finally:
        with _lock:
            _held -= 1
            if _held == 0 and _was_enabled:
                gc.enable()

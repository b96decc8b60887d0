"""Pausing Python's cyclic garbage collector while the library builds a large batch of records.

Rank 0's review of a commit round and every reader's parse of a manifest create millions of
small, long-lived objects at scale (about 15 per tensor per rank). While they are built, the
collector's full collections walk all of them again and again: at 1,024 ranks of 200 tensors a
quarter of rank 0's review was spent in the collector (docs/scale.md). Reference counting frees
everything these stages drop; the only thing a pause defers is the collection of reference cycles
made meanwhile by any thread, which the collector reclaims once it resumes.

A pause defers work, it must not move it onto the training thread: left running, the collector
would have made its full collections on the thread that built the records (rank 0's commit
thread), but after a pause the objects it left are all young, and the first collections after it
(on whichever thread allocates next, often the training thread inside its next ``save()``)
promote them and make the full collection that was due. So the last pause to end makes that full
collection itself, on its own thread, when the work left enough new objects that the collector
would have made at least one during it: at least ``FULL_AFTER_OBJECTS`` tracked objects more than
when the first pause began, and at least 1/``FULL_AFTER_SHARE`` of the process's small
allocations (``sys.getallocatedblocks()``, about three per tracked object in a PyTorch process).
The collector makes a full collection once the objects promoted since the last one exceed a
quarter of the oldest generation, and the records' transient sources (reports, decoded JSON) lived
about as long as they did, two to four times their number; the share is that estimate. Smaller
work resumes the collector and leaves it to its own schedule, as if there had been no pause.

The collector's switch is process-wide, so pauses are counted: the first to begin records whether
the collector was enabled and disables it, the last to end enables it again only if it was
enabled before the first began. A program that keeps the collector disabled keeps it disabled,
and no pause collects in it. (What this cannot see: another thread calling ``gc.enable()`` or
``gc.disable()`` while a pause is held; the pause's end then wins.) A child forked while pauses
are held (a ``DataLoader`` worker, forked during rank 0's review) keeps only the forking thread's
own: the other threads do not exist in the child, their pauses would never end there, and the
child would otherwise run without a collector for its whole life.
"""
from __future__ import annotations

import gc
import os
import sys
import threading
from contextlib import contextmanager
from typing import Iterator

#: The fewest new tracked objects after which a pause ends with a full collection.
FULL_AFTER_OBJECTS = 10_000
#: ... and the share of the process's small allocations they must be at least 1/this of.
FULL_AFTER_SHARE = 32

_lock = threading.Lock()
#: how many pauses each thread holds (its ``threading.get_ident()``); none held: empty
_holders: dict[int, int] = {}
_was_enabled = False
_young_at_start = 0


@contextmanager
def paused() -> Iterator[None]:
    """Run the block with the cyclic garbage collector disabled (any thread; pauses nest and
    overlap across threads), then restore the state it had before the first pause began, also
    when the block raises; the last pause to end makes the full collection that large work made
    due (see the module's docstring)."""
    global _was_enabled, _young_at_start
    me = threading.get_ident()
    with _lock:
        if not _holders:
            _was_enabled = gc.isenabled()
            gc.disable()
            _young_at_start = gc.get_count()[0]
        _holders[me] = _holders.get(me, 0) + 1
    try:
        yield
    finally:
        with _lock:
            _holders[me] -= 1
            if not _holders[me]:
                del _holders[me]
            resume = not _holders and _was_enabled
            if resume:
                gc.enable()
        if resume and _due(gc.get_count()[0] - _young_at_start):
            gc.collect()


def _due(made: int) -> bool:
    """Whether a pause that left ``made`` more tracked objects than when it began ends with a
    full collection."""
    return made >= FULL_AFTER_OBJECTS and made * FULL_AFTER_SHARE >= sys.getallocatedblocks()


def _after_fork_in_child() -> None:
    """In a forked child only the forking thread exists: keep its pauses, drop the others' (a
    lock another thread held at the fork is replaced), and resume the collector if none is
    left and it was enabled before the first pause."""
    global _lock, _holders
    _lock = threading.Lock()
    if not _holders:
        return  # no pause was held: the collector is as the program left it
    me = threading.get_ident()
    _holders = {me: _holders[me]} if me in _holders else {}
    if not _holders and _was_enabled:
        gc.enable()


os.register_at_fork(after_in_child=_after_fork_in_child)

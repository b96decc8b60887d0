"""Pausing Python's cyclic garbage collector while the library builds a large batch of records.

Rank 0's review of a commit round and every reader's parse of a manifest create millions of
small, long-lived objects at scale (about 15 per tensor per rank). While they are built, the
collector's full collections walk all of them again and again: at 1,024 ranks of 200 tensors a
quarter of rank 0's review was spent in the collector (docs/scale.md). Reference counting frees
everything these stages drop; the only thing a pause defers is the collection of reference cycles
made meanwhile by any thread, which the collector reclaims once it resumes. Pauses cover record
work, not waits: the commit round pauses while it reads and reviews the reports, the manifest's
encoding, every parse and a restore's planning pause themselves, and nothing waits on another
rank or on the memory tier inside one (the I/O inside: one store read per report, the review's
stat of every shard file, and a restore's reads of the saved Python objects).

A pause defers work, it must not move it onto the training thread: left running, the collector
would have made its full collections on the thread that built the records (rank 0's commit
thread), but after a pause the objects it left are all young, and the first collections after it
(on whichever thread allocates next, often the training thread inside its next ``save()``)
promote them and make the full collection that was due. So the last pause to end makes that full
collection itself, on its own thread (normally the one that did the work; another thread's pause
that happens to end last makes it instead), before the collector is enabled again, when the work
left enough new objects that the collector
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
and no pause collects in it. What this cannot see: a program that calls ``gc.disable()`` while a
pause is held (on another thread) finds the collector enabled again when the pause ends.

Robust against what can interrupt the bookkeeping: each pause is a token, removed
idempotently on exit (an exit an exception cut short is run again) and on a failed entry, and
the collector is resumed from the set of tokens held, so one exception at any point of the entry
or exit (a ``KeyboardInterrupt`` delivered between two bytecodes) leaves no pause behind (a
second one microseconds later, inside the repeated exit, can); a signal handler that pauses while its thread is inside
the bookkeeping re-enters the (reentrant) lock and cannot end the pause it interrupted. A child forked while pauses are held (a ``DataLoader``
worker, forked during rank 0's review) keeps only the forking thread's own: the other threads do
not exist in the child, their pauses would never end there.
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

_lock = threading.RLock()
#: the pauses held: a token per pause, mapped to the thread that holds it
_holders: dict[object, int] = {}
#: whether the collector is disabled by pauses (set before disabling, cleared after enabling)
_owned = False
#: the program's collector state when the first pause of the current run of pauses began
_was_enabled = False
_young_at_start = 0


@contextmanager
def paused() -> Iterator[None]:
    """Run the block with the cyclic garbage collector disabled (any thread; pauses nest and
    overlap across threads), then restore the state it had before the first pause began, also
    when the block raises; the last pause to end makes the full collection that large work made
    due (see the module's docstring)."""
    token = object()
    try:
        _enter(token)
        yield
    finally:
        try:
            _leave(token)
        except BaseException:  # an interrupt cut the exit short: finish it (idempotent)
            _leave(token)
            raise


def _enter(token: object) -> None:
    global _owned, _was_enabled, _young_at_start
    with _lock:  # an exception anywhere here is undone by the caller's ``_leave(token)``
        if not _holders and not _owned:  # the first pause: record the program's state
            _was_enabled = gc.isenabled()
            _young_at_start = gc.get_count()[0]
        _holders[token] = threading.get_ident()  # before disabling: a pause begun inside (a
        _owned = True                            # signal handler) then cannot resume it
        gc.disable()


def _leave(token: object) -> None:
    """End the pause ``token`` (nothing if it was never registered, or already ended). The last
    pause to end makes the full collection its work made due while the collector is still
    disabled, so that no other thread's young collection takes that work first."""
    with _lock:
        try:
            _holders.pop(token, None)
            if not _holders and _owned and _was_enabled and \
                    _due(gc.get_count()[0] - _young_at_start):
                gc.collect()
        finally:
            _resume()


def _resume() -> None:
    """Under the lock: once no pause is held (a finalizer run by the collection may have begun
    one), give the collector back as the program had it."""
    global _owned
    if _holders or not _owned:
        return
    if _was_enabled:
        gc.enable()
    _owned = False


def _due(made: int) -> bool:
    """Whether a pause that left ``made`` more tracked objects than when it began ends with a
    full collection."""
    return made >= FULL_AFTER_OBJECTS and made * FULL_AFTER_SHARE >= sys.getallocatedblocks()


def _after_fork_in_child() -> None:
    """In a forked child only the forking thread exists: keep its pauses, drop the others' and
    resume the collector if none is left. Whatever bytecode another thread's entry or exit had
    reached at the fork, this gives the state its completion would have (a token is registered
    before the collector is disabled, and ``_owned`` outlives the tokens until it is enabled);
    the lock, which that thread may have held, is replaced."""
    global _lock, _holders
    _lock = threading.RLock()
    me = threading.get_ident()
    _holders = {t: ident for t, ident in _holders.items() if ident == me}
    _resume()


os.register_at_fork(after_in_child=_after_fork_in_child)

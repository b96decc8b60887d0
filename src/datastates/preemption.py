"""Preemption: the signal a scheduler sends before it kills a job becomes a clean stop.

SLURM (``scancel``, the end of the time limit, ``--signal=USR1@<s>``), Kubernetes (pod eviction)
and spot instances announce the end of a process with SIGTERM or SIGUSR1 and kill it for good a
grace period later. :class:`Preemption` turns that signal into a stop at the training loop's next
safe point: the saves in flight are committed, the loop may take one last save there, and the
process then ends the way the signal would have ended it without this object (docs/preemption.md).

Decisions, each proved by tests/faults/test_preemption.py:

- The signal handler does no work. Python runs it on the main thread between two bytecodes of
  whatever that thread was doing, maybe inside ``save()`` or ``opt.step()``, with their locks
  held and the state half updated. It records the first signal and its deadline, and wakes the
  watcher thread through a pipe (``os.write``: no lock). It takes no lock, touches no
  Checkpointer, starts no thread and logs nothing.
- ``requested(step)``, called by the loop at its safe point (after ``opt.step()``), is where
  the ranks agree on a stop step, through the Checkpointer's coordination store
  (``ckpt.comm.store``), never through a collective on the training group.
- ``exit()`` waits for every save of the Checkpointer, then passes the signal on: the handlers
  found at construction are put back and the signal is raised again (``signal.raise_signal``).
  The default action ends the process with the signal's status; a Python handler is called; an
  ignored signal does nothing and ``exit()`` returns. Nothing here calls ``sys.exit`` or
  ``os._exit``.
- The grace period runs from the signal. The watcher thread (started at construction, so the
  handler starts none) waits for it; if ``exit()`` has not passed the signal on by then, it sends
  the signal again to the main thread (``signal.pthread_kill``), whose handler then passes it on
  at once, wherever the loop is: the saves still in flight are not committed, the earlier ones
  are. That interrupts a blocked wait (a lock, a read, ``exit()``'s own wait), not a C call that
  retries on EINTR (a collective waiting for a rank that stopped): the scheduler's kill ends that.
- A further signal before the deadline changes nothing (the first one's deadline and number
  stand); one after it is passed on at once.
- Each Preemption agrees in keys of its own: the n-th one made on a rank's coordination store
  (a counter per rank in the store, no collective) uses ``preemption/<n>/``, so a later one on
  the same Checkpointer starts with no stop. ``exit()``/``close()`` count the ranks done with
  it, and the last one deletes its keys.

Store keys, under the Checkpointer's run's prefix::

    preemption/made/r<k>   how many Preemptions rank k made on this store     rank k (add)
    preemption/<n>/stop    the agreed StopPlan of the n-th one                 every rank (claim)
    preemption/<n>/done    ranks done with the n-th one; the last deletes both every rank (add)
"""

from __future__ import annotations

import json
import logging
import math
import os
import select
import signal
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable

from .commit.round import claim, peek
from .errors import ConfigError
from .format.small_records import parse_stop_plan
from .save.arguments import check_step

if TYPE_CHECKING:
    from .checkpointer import Checkpointer

log = logging.getLogger("datastates")

#: The signals handled by default: what schedulers send before they kill a job.
DEFAULT_SIGNALS = tuple(
    getattr(signal, name) for name in ("SIGTERM", "SIGUSR1") if hasattr(signal, name)
)
#: Default grace period, in seconds: under the 30 s that SLURM (``KillWait``) and Kubernetes
#: (``terminationGracePeriodSeconds``) leave by default between the signal and the kill.
DEFAULT_GRACE_S = 25.0
#: The store keys of the n-th Preemption of a rank (the store is the Checkpointer's run's, a
#: prefix per run): its agreed stop, the ranks done with it, and each rank's counter of them.
PLAN_KEY, DONE_KEY = "preemption/{n}/stop", "preemption/{n}/done"
MADE_KEY = "preemption/made/r{rank}"
_WAKE, _STAND_DOWN = b"s", b"x"  # what the watcher reads from its pipe


@dataclass(frozen=True)
class StopPlan:
    """The stop every rank agreed on: from ``step`` on, ``requested()`` is True; ``signum`` is
    the signal each rank passes on (the first one a rank received); ``rank`` set the plan."""

    step: int
    signum: int
    rank: int

    def to_json(self) -> str:
        return json.dumps(
            {"step": self.step, "signum": self.signum, "rank": self.rank}, sort_keys=True
        )

    @classmethod
    def parse(cls, raw: bytes, where: str) -> "StopPlan":
        """The plan written by a rank (bytes from another process): every field checked
        (``format.small_records.parse_stop_plan``; CorruptCheckpointError naming the field)."""
        return cls(*parse_stop_plan(raw, where))


class Preemption:
    """Stops a training loop cleanly on SIGTERM/SIGUSR1 (opt-in; one at a time per
    Checkpointer, and a later one starts with no stop: the module docstring).

    ::

        stop = datastates.Preemption(ckpt)          # after the Checkpointer, on the main thread
        for step in range(start, total_steps):
            train_one_step()                        # forward, backward, opt.step()
            if step % 100 == 0:
                ckpt.save(state, step=step)
            if stop.requested(step):                # the safe point
                if step % 100 != 0:
                    ckpt.save(state, step=step)     # optional: the last save
                stop.exit()                         # waits for the saves, passes the signal on

    Construction installs the handler for ``signals`` (main thread only: ConfigError otherwise,
    and for a signal that cannot be caught) and starts the ``datastates-preemption`` thread.
    ``grace_s`` (a positive number of seconds, or None for no limit) bounds the time from the
    signal to the end of the process: see the module docstring. ``close()`` (or the ``with``
    block) puts the previous handlers back.

    Thread model: ``requested``, ``exit`` and ``close`` are called by the main thread, which
    also trains (Python delivers signals there only).

    Several ranks: the first rank that finds a signal at its safe point ``s`` claims the stop
    step ``s + 1`` in the store (``commit.round.claim``: the first claim wins); every rank
    peeks at the store at each ``requested()`` until it learns the plan, and answers True from
    that step on, signalled or not, so every rank takes its last save at the same step and
    passes on the plan's signal. This assumes the ranks are within one step of each other at
    their safe points, which holds when every step holds a collective of the training group
    (the gradient all-reduce): no rank can pass the safe point of ``s + 1`` before every rank
    passed that of ``s``. Alone, the stop step is the step at which the signal is found.
    """

    def __init__(
        self,
        checkpointer: "Checkpointer",
        signals: Iterable[int] = DEFAULT_SIGNALS,
        grace_s: float | None = DEFAULT_GRACE_S,
    ):
        _check_main_thread("Preemption()")
        self._signals = _check_signals(signals)
        _check_no_other(self._signals)
        #: Seconds from the signal to the end of the process (None: no limit).
        self.grace_s = _check_grace(grace_s)
        self._ckpt = checkpointer
        self._keys = _instance_keys(checkpointer)  # (plan, done), or None: no store reached
        self._signum: int | None = None  # the first signal this rank received
        self._deadline: float | None = None
        self._plan: StopPlan | None = None
        self._overdue = False  # set by the watcher once the grace period is over
        self._restored = False  # the previous handlers are back
        self._closed = False
        # One-element lists popped as an atomic test-and-set: a handler can interrupt the main
        # thread between two bytecodes, never inside list.pop().
        self._first, self._pass_token = [None], [None]
        self._main = threading.get_ident()  # the main thread's (checked above)
        self._read_fd, self._write_fd = os.pipe()
        os.set_blocking(self._write_fd, False)
        self._watcher = threading.Thread(
            target=self._watch, name="datastates-preemption", daemon=True
        )
        self._watcher.start()
        self._previous: dict[int, Any] = {}
        try:
            for signum in self._signals:
                self._previous[signum] = signal.signal(signum, self._on_signal)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ the loop's calls
    @property
    def signum(self) -> int | None:
        """The signal this rank will pass on: the first one it received, else the agreed plan's
        (once ``requested()`` learned it), else None."""
        if self._signum is not None:
            return self._signum
        return self._plan.signum if self._plan is not None else None

    @property
    def plan_key(self) -> str | None:
        """This Preemption's key of the agreed stop in ``ckpt.comm.store`` (None if the store
        could not be reached at construction: a signal then stops this rank alone)."""
        return self._keys[0] if self._keys is not None else None

    @property
    def stop_step(self) -> int | None:
        """The step from which ``requested()`` is True on every rank, once this rank knows it."""
        return self._plan.step if self._plan is not None else None

    def requested(self, step: int) -> bool:
        """Whether the loop stops at ``step`` (call it at the safe point of every step, with the
        same step numbers on every rank). Until a stop is known this reads one store key per call
        (with several ranks: a round trip to the store); afterwards it reads nothing."""
        if step is None:
            raise ConfigError("requested() needs the step of the safe point, found None")
        check_step(step)
        if self._plan is None:
            self._plan = self._agree(step)
            if self._plan is not None and step > self._plan.step:
                log.warning(
                    "datastates: rank %d learned of the stop at step %d, after the agreed "
                    "step %d (set by rank %d): the ranks are more than one step apart, so "
                    "their last saves differ",
                    self._ckpt.rank,
                    step,
                    self._plan.step,
                    self._plan.rank,
                )
        return self._plan is not None and step >= self._plan.step

    def time_left(self) -> float | None:
        """Seconds left of the grace period (0.0 once over); None before a signal reached this
        rank, or without a limit. A loop may skip its last save when too little is left."""
        if self._deadline is None:
            return None
        return max(0.0, self._deadline - time.monotonic())

    def exit(self) -> None:
        """Wait for every save of the Checkpointer, then pass the signal on (see the class).

        A failed save is logged (ERROR on the ``datastates`` logger), not raised: the process
        ends all the same. Returns only if the signal does not end the process (a Python handler
        that returns, an ignored signal) or if there is none to pass on; this object is then
        closed. Main thread only."""
        _check_main_thread("exit()")
        try:
            self._ckpt.wait()
        except Exception as exc:  # the process ends anyway: say what was lost
            log.error(
                "datastates: a save failed before the process ends on rank %d: %r",
                self._ckpt.rank,
                exc,
            )
        self._done()
        try:
            self._pass_on()  # a Python handler may raise here (SystemExit, KeyboardInterrupt)
        finally:
            self._release()

    def close(self) -> None:
        """Put the previous handlers back and stop the watcher thread (idempotent). A signal
        already received is not dropped: close() then does what ``exit()`` does."""
        _check_main_thread("close()")
        if self.signum is None:
            self._restore_handlers()
        if self.signum is not None:  # received before close(), or while it restored
            self.exit()
        else:
            self._done()
            self._release()

    def __enter__(self) -> "Preemption":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ agreement
    def _agree(self, step: int) -> StopPlan | None:
        """The plan in the store, or (after a signal) this rank's proposal, the first one set
        winning. A store that fails leaves a signalled rank to stop alone, at this step."""
        signum, store, key = self._signum, self._ckpt.comm.store, self.plan_key
        try:
            if key is None:
                raise ConnectionError("unreachable when the Preemption was made")
            if signum is None:
                raw = peek(store, key)
                if raw is None:
                    return None
            else:
                lead = 0 if self._ckpt.world_size == 1 else 1  # alone: stop at this step
                raw = claim(store, key, StopPlan(step + lead, signum, self._ckpt.rank).to_json())
        except Exception as exc:
            if signum is None:
                return None
            log.warning(
                "datastates: rank %d could not reach the coordination store (%r): it "
                "stops alone at step %d",
                self._ckpt.rank,
                exc,
                step,
            )
            return StopPlan(step, signum, self._ckpt.rank)
        return StopPlan.parse(raw, f"the stop plan {key!r} in the coordination store")

    def _done(self) -> None:
        """This rank is done with the plan (once): the last rank deletes this Preemption's keys.
        Best effort: the store may be gone (rank 0, which hosts it, may have ended)."""
        keys, self._keys = self._keys, None
        if keys is None:
            return
        store = self._ckpt.comm.store
        try:
            if store.add(keys[1], 1) >= self._ckpt.world_size:
                for key in keys:
                    store.delete_key(key)
        except Exception:  # noqa: BLE001 - nothing to clean in a store that is gone
            pass

    # ------------------------------------------------------------ the signal
    def _on_signal(self, signum: int, frame) -> None:
        """The handler (main thread, between two bytecodes of anything): no lock, no I/O but
        one byte into the watcher's pipe."""
        if self._closed:
            return
        try:
            self._first.pop()
        except IndexError:  # a further signal: passed on only once the grace period is over
            if self._overdue or (self._deadline is not None and time.monotonic() >= self._deadline):
                self._pass_on()
            return
        if self.grace_s is not None:
            self._deadline = time.monotonic() + self.grace_s
        self._signum = signum
        self._wake(_WAKE)

    def _pass_on(self) -> None:
        """Put the previous handlers back and raise the signal again, once (exit() or the
        handler, whichever comes first)."""
        try:
            self._pass_token.pop()
        except IndexError:
            return
        self._restore_handlers()
        signum = self.signum
        if signum is not None:
            signal.raise_signal(signum)

    def _restore_handlers(self) -> None:
        """The handler found at construction goes back wherever this one is still installed (a
        handler installed later stays). One installed outside Python (``getsignal`` gives None)
        cannot be put back: the default action is."""
        self._restored = True
        previous, self._previous = self._previous, {}
        for signum, handler in previous.items():
            if signal.getsignal(signum) == self._on_signal:
                signal.signal(signum, handler if handler is not None else signal.SIG_DFL)

    def _watch(self) -> None:
        """The ``datastates-preemption`` thread: log the signal, then wait for exit() or close()
        until the deadline; past it, send the signal to the main thread again. The signals are
        blocked here, so the kernel gives them to a thread that can run the handler soon."""
        signal.pthread_sigmask(signal.SIG_BLOCK, self._signals)
        if os.read(self._read_fd, 1) != _WAKE or (signum := self._signum) is None:
            return  # closed before any signal
        name = _name(signum)
        limit = "no time limit" if self._deadline is None else f"within {self.grace_s:g} s"
        log.warning(
            "datastates: %s received on rank %d: the loop stops at its next safe point "
            "(Preemption.requested), %s",
            name,
            self._ckpt.rank,
            limit,
        )
        left = None if self._deadline is None else max(0.0, self._deadline - time.monotonic())
        ready, _, _ = select.select([self._read_fd], [], [], left)
        if ready or self._restored:
            return  # exit() or close() took over
        self._overdue = True
        log.warning(
            "datastates: the grace period of %g s after %s is over on rank %d and "
            "exit() has not passed the signal on: passing it on now (saves still in "
            "flight are not committed)",
            self.grace_s,
            name,
            self._ckpt.rank,
        )
        try:
            signal.pthread_kill(self._main, signum)
        except OSError:  # the main thread has ended: so does the process
            pass

    def _wake(self, message: bytes) -> None:
        try:
            os.write(self._write_fd, message)
        except OSError:  # a full pipe already holds a message the watcher will read
            pass

    def _release(self) -> None:
        """Stop the watcher and close its pipe (idempotent). The handlers are back by now, and
        ``_closed`` is set before the pipe closes, so no handler writes into a closed pipe."""
        if self._closed:
            return
        self._closed = True
        self._wake(_STAND_DOWN)
        self._watcher.join()
        os.close(self._read_fd)
        os.close(self._write_fd)


def _instance_keys(checkpointer: "Checkpointer") -> tuple[str, str] | None:
    """The plan and done keys of a new Preemption: the n-th one this rank makes on the store is
    the n-th one of every rank (each rank makes them in the same order, as it makes saves)."""
    store, rank = checkpointer.comm.store, checkpointer.rank
    try:
        n = store.add(MADE_KEY.format(rank=rank), 1)
    except Exception as exc:  # noqa: BLE001 - a signal then stops this rank alone
        log.warning(
            "datastates: rank %d could not reach the coordination store (%r): a signal "
            "stops it alone, at the step where it is found",
            rank,
            exc,
        )
        return None
    return PLAN_KEY.format(n=n), DONE_KEY.format(n=n)


def _name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:  # a real-time signal has no name
        return f"signal {signum}"


def _check_main_thread(what: str) -> None:
    if threading.current_thread() is not threading.main_thread():
        raise ConfigError(
            f"{what} must be called on the main thread, where Python runs signal "
            f"handlers; found thread {threading.current_thread().name!r}"
        )


def _check_signals(signals: Iterable[int]) -> tuple[int, ...]:
    found = tuple(signals)
    uncatchable = {getattr(signal, n) for n in ("SIGKILL", "SIGSTOP") if hasattr(signal, n)}
    for signum in found:
        if (
            isinstance(signum, bool)
            or not isinstance(signum, int)
            or signum not in signal.valid_signals()
            or signum in uncatchable
        ):
            raise ConfigError(
                f"signals must be signal numbers that can be caught (SIGKILL and "
                f"SIGSTOP cannot), found {signum!r} in {found!r}"
            )
    if not found:
        raise ConfigError("signals must name at least one signal, found none")
    return tuple(dict.fromkeys(int(s) for s in found))


def _check_grace(grace_s) -> float | None:
    if grace_s is None:
        return None
    if (
        isinstance(grace_s, bool)
        or not isinstance(grace_s, (int, float))
        or not math.isfinite(grace_s)
        or grace_s <= 0
    ):
        raise ConfigError(
            f"grace_s must be a positive number of seconds or None, found {grace_s!r}"
        )
    return float(grace_s)


def _check_no_other(signals: Iterable[int]) -> None:
    """ConfigError when an open Preemption of this process handles one of ``signals``: signals
    are the process's, and a second one would pass a signal on to the first, which would take
    it as its own and keep the process running (one Preemption at a time; close() the first)."""
    for signum in signals:
        handler = signal.getsignal(signum)
        other = getattr(handler, "__self__", None)
        if isinstance(other, Preemption) and not other._restored:
            raise ConfigError(
                f"Preemption(): expected no other open Preemption handling "
                f"{signal.Signals(signum).name} in this process, found one on "
                f"{other._ckpt.directory}; close() it first"
            )

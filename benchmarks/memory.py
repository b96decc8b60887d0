"""Host-memory measurement (an RSS sampling thread) and the memory budget check.

The budget check exists because a benchmark that swaps or gets OOM-killed measures nothing: before a
state is built, the run compares what the selected methods may need at peak with what the machine has
available *now*, and scales the state down (or refuses with a clear message).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import threading
from dataclasses import dataclass

import psutil

from .common import GiB, fmt_bytes


class RssSampler:
    """Samples this process's resident set size every ``interval_s`` on a daemon thread.

    Use as a context manager around the code to observe; ``peak`` is the largest RSS seen (including
    the value at entry and at exit, so very short sections are still covered). The thread only calls
    psutil, which releases the GIL for the /proc read, so it disturbs the measured code very little.
    """

    def __init__(self, interval_s: float = 0.005):
        self.interval_s = interval_s
        self._proc = psutil.Process()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.start_rss = 0
        self.peak = 0

    def rss(self) -> int:
        return self._proc.memory_info().rss

    def __enter__(self) -> "RssSampler":
        self.start_rss = self.peak = self.rss()
        self._stop.clear()
        self._thread = threading.Thread(target=self._run, name="bench-rss", daemon=True)
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            r = self.rss()
            if r > self.peak:
                self.peak = r

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.peak = max(self.peak, self.rss())

    @property
    def extra(self) -> int:
        """Peak RSS above the RSS at entry."""
        return max(0, self.peak - self.start_rss)


def _load_libc():
    try:
        name = ctypes.util.find_library("c")
        libc = ctypes.CDLL(name) if name else None
        return libc if libc is not None and hasattr(libc, "malloc_trim") else None
    except OSError:
        return None


_LIBC = _load_libc()


def settle() -> None:
    """Collect garbage and return free heap memory to the OS (glibc ``malloc_trim``).

    Called before every measurement, so that memory freed by the previous method neither hides
    the next method's allocations (a reused heap does not raise RSS) nor warms them up.
    """
    gc.collect()
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def available_bytes() -> int:
    return int(psutil.virtual_memory().available)


@dataclass(frozen=True)
class MemoryPlan:
    """What a phase needs, as multiples of the state size, plus a fixed overhead."""

    state_bytes: int
    held_factor: float  # sum over methods of the memory they keep between saves
    transient_factor: float  # the largest transient peak of any one method during a save
    overhead_bytes: int = 1 * GiB

    @property
    def need_bytes(self) -> int:
        s = self.state_bytes
        return int(s * (1.0 + self.held_factor + self.transient_factor) + self.overhead_bytes)

    def max_state_bytes(self, available: int, safety: float = 0.85) -> int:
        """The largest state that fits in ``safety`` × ``available`` with the same factors."""
        room = available * safety - self.overhead_bytes
        return max(0, int(room / (1.0 + self.held_factor + self.transient_factor)))

    def describe(self) -> str:
        return (
            f"state {fmt_bytes(self.state_bytes)} x (1 + held {self.held_factor:.2f} + peak "
            f"{self.transient_factor:.2f}) + {fmt_bytes(self.overhead_bytes)} = "
            f"{fmt_bytes(self.need_bytes)}"
        )


class InsufficientMemory(RuntimeError):
    """Raised when even the smallest allowed state does not fit in the available memory."""

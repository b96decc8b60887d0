"""The interface every checkpointing method implements for the benchmark.

Call order, all on the benchmark's (training) thread::

    m = SomeMethod(options)            # cheap; no resources yet
    m.unavailable()                    # None, or why the method cannot run here (package missing)
    m.setup(root, state)               # once per state: thread pools, host caches, stagers
    p = m.save(state, step)            # returns when the *caller* is unblocked
    p.before_update()                  # before the training loop mutates the state (optimizer step)
    p.wait_snapshot()                  # the state is captured (no longer needs the live tensors)
    p.wait()                           # durable and committed on disk
    m.load_into(state, p.checkpoint)   # restore that checkpoint into the live objects, in place
    m.discard(p.checkpoint)            # delete its files
    m.close()                          # release everything setup() made

Timings are taken by :class:`Pending` from the same clock for every method, from the entry of
``save()``; methods only say *what* to wait on. ``Pending`` is idempotent: waiting twice is free.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..common import now, remove_paths
from ..states import TrainState


@dataclass
class Checkpoint:
    """Where one saved checkpoint lives. ``paths`` may be filled in after the commit."""

    step: int
    paths: list[Path] = field(default_factory=list)


class Pending:
    """One save as the benchmark sees it: when the caller got control back, when the state was
    captured, when it was durable.

    ``snapshot_fn`` blocks until the state is captured (``None``: captured when ``save`` returned);
    ``commit_fn`` blocks until durable and committed (``None``: durable when ``save`` returned);
    ``guard_fn`` is what a training loop must call before it mutates the state (``None``: nothing,
    because the method copied synchronously or installs its own optimizer hook).
    """

    def __init__(
        self,
        t0: float,
        checkpoint: Checkpoint,
        *,
        snapshot_fn: Callable[[], object] | None = None,
        commit_fn: Callable[[], object] | None = None,
        guard_fn: Callable[[], object] | None = None,
        stats_fn: Callable[[], dict] | None = None,
    ):
        self.t0 = t0
        self.blocked_s = now() - t0
        self.checkpoint = checkpoint
        self._snapshot_fn = snapshot_fn
        self._commit_fn = commit_fn
        self._guard_fn = guard_fn
        self._stats_fn = stats_fn
        self.snapshot_s: float | None = None if snapshot_fn else self.blocked_s
        self.commit_s: float | None = None if commit_fn else self.blocked_s

    @property
    def committed(self) -> bool:
        return self.commit_s is not None

    def before_update(self) -> None:
        if self._guard_fn is not None:
            self._guard_fn()
            self._guard_fn = None

    def wait_snapshot(self) -> float:
        if self.snapshot_s is None:
            self._snapshot_fn()
            self.snapshot_s = now() - self.t0
        return self.snapshot_s

    def wait(self) -> float:
        if self.commit_s is None:
            self._commit_fn()
            self.commit_s = now() - self.t0
            if self.snapshot_s is None:  # committed implies captured
                self.snapshot_s = self.commit_s
        return self.commit_s

    def library_stats(self) -> dict | None:
        """The method's own timings, if it reports any (datastates' ``SaveStats``)."""
        return self._stats_fn() if self._stats_fn else None


class Method(ABC):
    """One checkpointing method. Subclasses set the class attributes and the four operations."""

    name: str = ""  # short id used on the command line and in the JSON
    label: str = ""  # human-readable name for the report
    kind: str = "sync"  # sync | async | lazy (for the report)
    scopes: tuple[str, ...] = ("full",)  # "full" training state and/or "model" only
    supports_load: bool = True
    # End-to-end loop: how many saves may be in flight (None = the method manages backpressure).
    max_in_flight: int | None = 1
    # Memory model for the budget check, as multiples of the state size.
    held_factor: float = 0.0  # kept between saves (persistent staging buffers)
    transient_factor: float = 0.1  # extra during one save

    def __init__(self, options: dict | None = None):
        self.options = dict(options or {})
        self.root: Path | None = None

    def unavailable(self) -> str | None:
        """``None`` if the method can run here, else the reason (shown in the report)."""
        return None

    def setup(self, root: Path, state: TrainState) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    @abstractmethod
    def save(self, state: TrainState, step: int) -> Pending:
        """Start (or do) a save; return when the caller may continue."""

    def load_into(self, state: TrainState, ckpt: Checkpoint) -> None:
        raise NotImplementedError(f"{self.name} does not load")

    def discard(self, ckpt: Checkpoint) -> None:
        remove_paths(ckpt.paths)

    def close(self) -> None:
        """Release what ``setup`` created; safe to call more than once."""

    def memory_factors(self, state_bytes: int) -> tuple[float, float]:
        """(held, transient) multiples of ``state_bytes`` for the memory budget check."""
        return self.held_factor, self.transient_factor

    def describe(self) -> dict:
        return {
            "name": self.name,
            "label": self.label,
            "kind": self.kind,
            "scopes": list(self.scopes),
            "supports_load": self.supports_load,
        }

"""Which tensors of a save may be captured lazily: the storage rule.

A lazy tensor is copied into the host cache in the background after ``save()`` returned, so it
must not change before a point the library guards. The only such point the library can prove is
the ``step()`` of a guarded optimizer. Hence the rule, decided per tensor by the bytes it
occupies (not by its type, its key or the object that reached it):

- a tensor is lazy when its bytes lie inside the parameters or the state tensors of an optimizer
  that is part of this save (found in the saved state, or passed with ``save(optimizers=...)``;
  either way it is guarded) — whether it is reached as a module parameter, through a
  ``state_dict()``, an optimizer state dict or a view of a flat buffer;
- unless those bytes also belong to an optimizer this Checkpointer guards that is *not* part of
  this save (its step is another writer of the same bytes);
- a tensor the caller marked with :func:`datastates.lazy` is lazy, one marked with
  :func:`datastates.eager` is eager;
- everything else is eager: buffers, EMA copies, modules no optimizer of the save updates,
  hyper-parameter tensors (a tensor ``lr``), tensors reached only through an earlier save's guard.

The rule assumes that every optimizer stepping those parameters is part of the save or was passed
to ``guard()`` (an optimizer nobody told the library about cannot be seen), and that nothing else
writes them in place between ``save()`` and the next step (weight clipping or
``nn.Embedding(max_norm=...)`` on optimized parameters need ``datastates.eager(...)``). A
breach is caught through torch's version counter: :func:`decide` records each lazy tensor's
counter, and once its copy is complete :func:`check_unwritten` fails the save
(``LazyWriteError``) if the counter moved.
Wrapper optimizers (accelerate, DeepSpeed, Lightning) are unwrapped through ``.optimizer`` to the
torch optimizer whose ``step()`` runs: its step pre-hook is the guard.
"""

from __future__ import annotations

import bisect
import sys
import threading
import weakref
from collections import OrderedDict
from typing import Any, Callable, Iterable

import torch

from ..errors import LazyWriteError
from ..providers.base import AUTO, LAZY, lazy

_UNWRAP_DEPTH = 8


def torch_optimizer(opt: Any) -> torch.optim.Optimizer | None:
    """The innermost torch optimizer of ``opt`` (itself, or a wrapper's ``.optimizer`` chain):
    the one whose ``step()`` writes the parameters and can carry a step pre-hook. None if there
    is none (a wrapper around something else, or an Optimizer subclass that never ran
    ``Optimizer.__init__`` and has no ``.optimizer``)."""
    for _ in range(_UNWRAP_DEPTH):
        inner = getattr(opt, "optimizer", None)
        if inner is None or inner is opt:
            break
        opt = inner
    if isinstance(opt, torch.optim.Optimizer) and "_optimizer_step_pre_hooks" in vars(opt):
        return opt
    return None


def optimizer_tensors(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The parameters and state tensors of a torch optimizer (never its hyper-parameters)."""
    out = [p for group in opt.param_groups for p in group["params"]]
    for state in opt.state.values():
        out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    module = sys.modules.get("torch.distributed.tensor")
    if module is not None and isinstance(t, module.DTensor):
        return t.to_local()
    return t


def byte_range(t: torch.Tensor) -> tuple[tuple, int, int] | None:
    """(storage key, first byte, end byte) of the memory ``t`` reads; None for a tensor with no
    bytes or no real address (empty, meta). The storage key is (device, address of the
    storage's first byte)."""
    if type(t) is not torch.Tensor:
        t = _local(t)
    if t.is_meta or t.numel() == 0:
        return None
    start = t.data_ptr()
    if start == 0:
        return None
    size = t.element_size()
    if t.is_contiguous():  # dimensions of size 1 add nothing to the span, whatever their stride
        span = t.numel()
    else:
        span = 1 + sum((n - 1) * stride for n, stride in zip(t.shape, t.stride()))
    # the storage's first byte, without materialising a storage object per call
    return (t.device, start - t.storage_offset() * size), start, start + span * size


class ByteRanges:
    """A union of byte ranges, per storage: "is this tensor inside / touching it?"."""

    def __init__(self, tensors: Iterable[torch.Tensor] = ()):
        spans: dict[tuple, list[tuple[int, int]]] = {}
        for t in tensors:
            found = byte_range(t)
            if found is not None:
                spans.setdefault(found[0], []).append(found[1:])
        self._starts: dict[tuple, list[int]] = {}
        self._ends: dict[tuple, list[int]] = {}
        for key, ranges in spans.items():
            starts, ends = self._starts.setdefault(key, []), self._ends.setdefault(key, [])
            for start, end in sorted(ranges):
                if ends and start <= ends[-1]:
                    ends[-1] = max(ends[-1], end)
                else:
                    starts.append(start)
                    ends.append(end)

    def __bool__(self) -> bool:
        return bool(self._starts)

    def covers(self, t: torch.Tensor, found: "tuple | None" = None) -> bool:
        """Every byte ``t`` reads lies inside the union (``found``: its ``byte_range``, if
        already known)."""
        found = found if found is not None else byte_range(t)
        if found is None or found[0] not in self._starts:
            return False
        key, start, end = found
        i = bisect.bisect_right(self._starts[key], start) - 1
        return i >= 0 and self._ends[key][i] >= end

    def touches(self, t: torch.Tensor, found: "tuple | None" = None) -> bool:
        """Some byte ``t`` reads lies inside the union (``found`` as for ``covers``)."""
        found = found if found is not None else byte_range(t)
        if found is None or found[0] not in self._starts:
            return False
        key, start, end = found
        i = bisect.bisect_left(self._ends[key], start + 1)  # first range ending after start
        return i < len(self._starts[key]) and self._starts[key][i] < end


class LazyRule:
    """The rule for one save: ``in_save`` are the torch optimizers part of the save, ``others``
    the ones guarded but not part of it."""

    def __init__(
        self,
        in_save: Iterable[torch.optim.Optimizer] = (),
        others: Iterable[torch.optim.Optimizer] = (),
    ):
        self._safe = ByteRanges(t for opt in in_save for t in optimizer_tensors(opt))
        self._unsafe = ByteRanges(t for opt in others for t in optimizer_tensors(opt))

    def __bool__(self) -> bool:
        """Whether the rule lets any tensor be lazy (False: no optimizer is part of the save)."""
        return bool(self._safe)

    def allows(self, t: torch.Tensor) -> bool:
        """Whether ``t`` (policy ``auto``) may be captured lazily."""
        if not self._safe:
            return False
        found = byte_range(t)
        return (
            found is not None
            and self._safe.covers(t, found)
            and not (self._unsafe and self._unsafe.touches(t, found))
        )


def decide(items, rule: LazyRule) -> None:
    """Set ``items.lazy`` of every tensor item (``providers.tree.Items``) from its policy
    (``lazy``/``eager`` as marked, ``auto`` by ``rule``), and record the version counter of each
    lazy one in ``items.versions``: training thread, inside ``save()``, the moment the values of
    the snapshot are defined (nothing writes the lazy tensors before ``save()`` returns)."""
    ruled = bool(rule)  # without an optimizer in the save, only a marked tensor is lazy
    lazy, tensors, versions = items.lazy, items.tensors, items.versions
    for i, policy in enumerate(items.policies):
        if policy is not None:  # None: an object, or a provider's tensor left eager
            lazy[i] = chosen = policy == LAZY or (
                ruled and policy == AUTO and rule.allows(tensors[i])
            )
            if chosen:
                try:
                    versions[i] = tensors[i]._version
                except RuntimeError:  # an inference tensor keeps no version counter
                    pass


def check_unwritten(items, indexes: Iterable[int], name: str, rank: int) -> None:
    """Raise LazyWriteError if the version counter of a lazy tensor among the items ``indexes``
    moved since :func:`decide` recorded it; the error names every lazy tensor of the save whose
    counter moved by then.

    Capture thread, once the copy of those tensors is known complete: after the fence (on CUDA,
    the side streams' events synchronized), and over every lazy tensor once more right before
    the snapshot is declared complete, so the guarded step, which waits for that, never
    counts. The rule is conservative: any in-place
    write dispatched before this check fails the save, even one whose kernel ran after the copy;
    one dispatched after it cannot have reached the copy, which was already complete. What the
    counter does not see is not found: writes through ``.data``, through a NumPy array sharing
    the memory, by a thread still inside the write (the counter moves once the op returns)."""
    versions, tensors = items.versions, items.tensors
    if any(i in versions and tensors[i]._version != versions[i] for i in indexes):
        # name every lazy tensor written so far, not only those of this copy
        written = [i for i, version in versions.items() if tensors[i]._version != version]
        raise _written_error([items.keys[i] for i in sorted(written)], name, rank)


_SHOWN_KEYS = 8


def _written_error(keys: list[str], name: str, rank: int) -> LazyWriteError:
    shown = ", ".join(repr(k) for k in keys[:_SHOWN_KEYS])
    if len(keys) > _SHOWN_KEYS:
        shown += f" and {len(keys) - _SHOWN_KEYS} more"
    return LazyWriteError(
        f"checkpoint {name!r} was not committed: on rank {rank}, {len(keys)} tensor(s) captured "
        "lazily were written in place after save(), while the snapshot was still being copied "
        f"in the background: {shown} (their version counter changed, so the checkpoint could "
        "hold values from after save()). Only the next step() of a guarded optimizer may change "
        "them before the snapshot is complete; this was something else (load_state_dict(), "
        "copy_() or add_() under torch.no_grad(), an optimizer method other than step() such "
        "as SAM's first_step(), weight clipping, nn.Embedding(max_norm=...) in forward). Save "
        "them eagerly with datastates.eager(...), "
        "or call handle.wait_snapshot() before writing them. The latest checkpoint is still the "
        "previous one; the next save is not affected",
        keys,
    )


class _StepGuard:
    """The one step pre-hook datastates installs on an optimizer: it calls the waiters
    registered now (each Checkpointer's, the DeepSpeed engine's). Waiters come and go on any
    thread -- a Checkpointer may be closed by a thread of its own while the training thread is
    inside ``step()`` -- so they are a tuple replaced under a lock, and the torch hook itself is
    never removed: removing one while ``step()`` runs its hooks on another thread makes that
    ``step()`` raise ("OrderedDict mutated during iteration")."""

    __slots__ = ("waiters", "__weakref__")

    def __init__(self):
        self.waiters: tuple = ()

    def __call__(self, *args) -> None:
        for waiter in self.waiters:  # the tuple of this moment: removals do not disturb it
            waiter(*args)


_guards: "weakref.WeakKeyDictionary[torch.optim.Optimizer, _StepGuard]" = (
    weakref.WeakKeyDictionary()
)
_guards_lock = threading.Lock()


def add_step_waiter(opt: torch.optim.Optimizer, waiter) -> Callable[[], None]:
    """Call ``waiter(optimizer, args, kwargs)`` before every ``opt.step()`` from now on, through
    the optimizer's one datastates hook (:class:`_StepGuard`, installed at the first waiter);
    returns the call that removes it, safe on any thread at any time."""
    with _guards_lock:
        guard = _guards.get(opt)
        if guard is None:
            guard = _guards[opt] = _StepGuard()
            opt.register_step_pre_hook(guard)
        guard.waiters += (waiter,)

    def remove() -> None:
        with _guards_lock:
            guard.waiters = tuple(w for w in guard.waiters if w is not waiter)

    return remove


def mark_lazy(state: Any, tensors: Iterable[torch.Tensor]) -> Any:
    """``state`` (plain dicts/lists/tuples) with every tensor lying inside the bytes of
    ``tensors`` wrapped in :func:`datastates.lazy`; other tensors are left to the rule. For
    callers that know another guarded writer of those bytes (a framework's optimizer wrapper that
    writes low-precision parameter copies inside its step, after the guarded inner step)."""
    ranges = ByteRanges(tensors)

    def walk(obj):
        if isinstance(obj, torch.Tensor):
            return lazy(obj) if ranges.covers(obj) else obj
        if type(obj) in (dict, OrderedDict):
            return type(obj)((k, walk(v)) for k, v in obj.items())
        if type(obj) in (list, tuple):
            return type(obj)(walk(v) for v in obj)
        return obj

    return walk(state)

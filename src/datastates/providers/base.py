"""The state provider contract: what a provider answers, and eager or lazy capture per value.

A provider knows one kind of object and turns it into a *state*: nested dicts/lists/tuples of
tensors and plain values (usually its ``state_dict()``). The save walks that state, captures its
tensors (lazily or eagerly: see ``datastates.save.capture`` for the rule) and serializes the rest. On restore the provider
gets the loaded state back and applies it to the live object.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

import torch

LAZY = "lazy"
EAGER = "eager"
#: Decided per tensor by the storage rule of ``datastates.save.capture`` (lazy only on the bytes of
#: an optimizer that is part of the save).
AUTO = "auto"


class StateProvider(ABC):
    """Turns one kind of object into a capturable state and back.

    Contract:
    - ``can_handle`` and ``state`` run on the training thread inside ``save()``: keep them cheap,
      return references to the live tensors (no copies); the save pipeline copies them.
    - ``capture`` is ``auto`` by default: the storage rule decides each tensor (lazy only if its
      bytes belong to an optimizer that is part of the save). A provider may say ``eager``
      (always copied inside ``save()``), or ``lazy`` — a promise that its tensors do not change
      until the guarded optimizer step or an explicit ``wait_snapshot()``.
    - ``validate`` runs on the caller's thread inside ``restore()`` and ``load()`` in the planning
      pass, before one byte is read: it raises ``CorruptCheckpointError`` if the saved state is
      not one this provider could apply to any object (a forged or damaged checkpoint);
      ``validate_values`` does the same for what needs tensor values, right after this
      provider's own tensors were read and before any other read (see its contract).
    - ``check`` runs on the caller's thread inside ``restore()`` in the planning pass, before one
      byte of live state changes: it raises ``StateMismatchError`` if the saved state cannot be
      applied to the live object. ``load`` must then not fail for a reason ``validate``,
      ``validate_values`` or ``check`` could see.
    - ``load`` runs on the caller's thread inside ``restore()`` after every tensor of the state was
      read; tensors that matched live tensors were already filled in place.
    - ``name`` is recorded in the manifest and looked up on load: keep it stable.
    """

    #: Stable identifier recorded in the manifest.
    name: str = ""
    #: Default capture of this provider's tensors: "auto", "lazy" or "eager".
    capture: str = AUTO
    #: Whether a restore may create tensors for keys the live object does not hold yet
    #: (an optimizer before its first step); False makes such keys an error on a strict restore.
    allow_new_keys: bool = True

    @abstractmethod
    def can_handle(self, obj: Any) -> bool:
        """Whether this provider captures ``obj``."""

    @abstractmethod
    def state(self, obj: Any) -> Any:
        """The object's state: nested containers of tensors and plain values."""

    @abstractmethod
    def load(self, obj: Any, state: Any) -> None:
        """Apply a loaded ``state`` to the live ``obj``."""

    def check(self, obj: Any, state: Any, path: str) -> None:
        """Raise ``StateMismatchError`` naming ``path`` if ``state`` (as saved) cannot be applied
        to the live ``obj``. Called before anything is read: the structure, keys, plain values,
        tensor shapes and dtypes of ``state`` are final, tensor *values* are not yet read. On a
        strict restore the error fails the restore with nothing modified; with ``strict=False``
        this object is left alone and reported as mismatched. Default: accept."""

    def validate(self, state: Any, path: str) -> None:
        """Raise ``CorruptCheckpointError`` naming ``path`` if ``state`` (as saved) is not a state
        this provider writes, whatever the live object: wrong structure, a plain value out of its
        range, a tensor of the wrong shape or dtype. Called in the planning pass of ``restore()``
        (before ``check``, on a restore in place) and of ``load()``, before anything is read or
        changed; the structure, plain values, tensor shapes and dtypes of ``state`` are final,
        tensor *values* are not read yet. Unlike ``check``, a refusal fails the restore even with
        ``strict=False``: the checkpoint is damaged, not different. Default: accept."""

    def validate_values(self, state: Any, path: str) -> None:
        """Like ``validate``, for what only the tensor values can show (an RNG state tensor
        whose bytes a generator refuses). Only a provider that overrides it pays for it: its
        tensors are then read, and checked against their checksums, before every other read of
        the restore, and this runs on them before anything else is read, set or applied; the
        tensors of its ``state`` are the only live memory changed before a refusal. Default:
        accept."""

    def rebuild(self, state: Any) -> Any:
        """What ``Checkpointer.load()`` returns for this object when no live object is given."""
        return state

    def capture_of(self, tensor: torch.Tensor) -> str:
        """Capture policy of one of this provider's tensors (default: the provider's ``capture``)."""
        return self.capture


class Capture:
    """Marker that overrides the capture policy of a subtree (see :func:`lazy` and :func:`eager`)."""

    __slots__ = ("value", "policy")

    def __init__(self, value: Any, policy: str):
        if policy not in (LAZY, EAGER, AUTO):
            raise ValueError(f"capture policy must be 'lazy', 'eager' or 'auto', found {policy!r}")
        self.value = value
        self.policy = policy


def lazy(value: Any) -> Capture:
    """Capture the tensors of ``value`` lazily, whatever the storage rule says: the caller promises
    they stay unchanged until the step of a guarded optimizer or ``wait_snapshot()``."""
    return Capture(value, LAZY)


def eager(value: Any) -> Capture:
    """Capture the tensors of ``value`` inside ``save()``, even on an optimizer's bytes (for
    state changed in place outside the optimizer step, e.g. weight clipping)."""
    return Capture(value, EAGER)

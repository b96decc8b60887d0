"""Built-in providers: modules, optimizers, RNG state, and any object with state_dict()."""
from __future__ import annotations

import random
from typing import Any

import torch
from torch import nn

from .base import StateProvider


class ModuleProvider(StateProvider):
    """``nn.Module``: its parameters and buffers, captured by the storage rule (parameters of an
    optimizer in the same save lazily; buffers, which forward changes, and parameters no optimizer
    of the save updates, eagerly). Restore fills parameters and buffers in place."""

    name = "torch.nn.Module"
    allow_new_keys = False

    def can_handle(self, obj: Any) -> bool:
        return isinstance(obj, nn.Module)

    def state(self, obj: nn.Module) -> Any:
        return obj.state_dict(keep_vars=True)

    def load(self, obj: nn.Module, state: Any) -> None:
        live = obj.state_dict(keep_vars=True)
        # Tensors restored in place are the live tensors themselves: only hand the rest over.
        rest = {k: v for k, v in state.items() if live.get(k) is not v}
        if rest:
            obj.load_state_dict(rest, strict=False)


class OptimizerProvider(StateProvider):
    """``torch.optim.Optimizer``: its state dict. Saving an optimizer makes it part of the save:
    it is guarded, and its parameters and state tensors are captured lazily (they change only in
    its ``step()``); hyper-parameter tensors (a tensor ``lr``) are captured eagerly."""

    name = "torch.optim.Optimizer"

    def can_handle(self, obj: Any) -> bool:
        return isinstance(obj, torch.optim.Optimizer)

    def state(self, obj: torch.optim.Optimizer) -> Any:
        return obj.state_dict()

    def load(self, obj: torch.optim.Optimizer, state: Any) -> None:
        obj.load_state_dict(state)


class RNGState:
    """Place this in a saved state to capture the process's random number generators there:
    torch (CPU and every initialized CUDA device), Python ``random`` and NumPy's global generator.
    Restoring it sets them back."""

    def __repr__(self) -> str:
        return "RNGState()"


class RNGStateProvider(StateProvider):
    name = "datastates.RNGState"

    def can_handle(self, obj: Any) -> bool:
        return isinstance(obj, RNGState)

    def state(self, obj: RNGState) -> Any:
        state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        np = _numpy()
        if np is not None:
            kind, keys, pos, has_gauss, cached = np.random.get_state()
            state["numpy"] = {"kind": kind, "keys": torch.from_numpy(keys.astype("int64")),
                              "pos": int(pos), "has_gauss": int(has_gauss),
                              "cached_gaussian": float(cached)}
        return state

    def load(self, obj: RNGState, state: Any) -> None:
        torch.set_rng_state(state["torch"].cpu())
        version, internal, gauss = state["python"]
        random.setstate((version, tuple(internal), gauss))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
        np = _numpy()
        if "numpy" in state and np is not None:
            s = state["numpy"]
            np.random.set_state((s["kind"], s["keys"].numpy().astype("uint32"), s["pos"],
                                 s["has_gauss"], s["cached_gaussian"]))


class StatefulProvider(StateProvider):
    """Anything with ``state_dict()`` and ``load_state_dict()``: LR schedulers, stateful data
    loaders and samplers, GradScaler, user classes. Captured by the storage rule: eagerly,
    unless a tensor lies on the bytes of an optimizer that is part of the save."""

    name = "datastates.Stateful"

    def can_handle(self, obj: Any) -> bool:
        return (not isinstance(obj, type) and callable(getattr(obj, "state_dict", None))
                and callable(getattr(obj, "load_state_dict", None)))

    def state(self, obj: Any) -> Any:
        return obj.state_dict()

    def load(self, obj: Any, state: Any) -> None:
        obj.load_state_dict(state)


def _numpy():
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def builtin_providers() -> list[StateProvider]:
    return [ModuleProvider(), OptimizerProvider(), RNGStateProvider(), StatefulProvider()]

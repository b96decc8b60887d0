"""Built-in providers: modules, optimizers, RNG state, numpy generators (``nprandom``), and any
object with state_dict()."""

from __future__ import annotations

import random
from typing import Any

import torch
from torch import nn

from ..errors import CorruptCheckpointError, StateMismatchError
from . import rngcheck
from .base import StateProvider
from .nprandom import NumpyRandomProvider

#: Key under which the optimizer's class is saved next to its state_dict() (removed again by
#: ``load`` and ``rebuild``, so what ``Checkpointer.load`` returns is the plain state_dict()).
OPTIMIZER_CLASS_KEY = "datastates.optimizer_class"


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
    its ``step()``); hyper-parameter tensors (a tensor ``lr``) are captured eagerly.

    The optimizer's class is saved with its state; ``check`` refuses a state of another class, a
    different number of parameter groups or of parameters in a group, other hyper-parameter
    names, or other state names for a parameter that has state in the live optimizer."""

    name = "torch.optim.Optimizer"

    def can_handle(self, obj: Any) -> bool:
        return isinstance(obj, torch.optim.Optimizer)

    def state(self, obj: torch.optim.Optimizer) -> Any:
        return {**obj.state_dict(), OPTIMIZER_CLASS_KEY: _class_name(obj)}

    def check(self, obj: torch.optim.Optimizer, state: Any, path: str) -> None:
        if (
            not isinstance(state, dict)
            or not isinstance(state.get("param_groups"), list)
            or not isinstance(state.get("state"), dict)
        ):
            raise StateMismatchError(
                f"{path!r}: the checkpoint holds no optimizer state_dict "
                "(expected a dict with 'state' and 'param_groups')"
            )
        saved_class, live_class = state.get(OPTIMIZER_CLASS_KEY), _class_name(obj)
        if saved_class is not None and saved_class != live_class:
            raise StateMismatchError(
                f"{path!r}: the checkpoint holds a {saved_class} state, the "
                f"live optimizer is a {live_class}"
            )
        _check_param_groups(path, state["param_groups"], obj.param_groups)
        _check_param_state(path, state["state"], obj.state_dict()["state"])

    def load(self, obj: torch.optim.Optimizer, state: Any) -> None:
        obj.load_state_dict(self.rebuild(state))

    def rebuild(self, state: Any) -> Any:
        if isinstance(state, dict) and OPTIMIZER_CLASS_KEY in state:
            state = {k: v for k, v in state.items() if k != OPTIMIZER_CLASS_KEY}
        return state


def _class_name(obj: Any) -> str:
    return f"{type(obj).__module__}.{type(obj).__qualname__}"


def _check_param_groups(path: str, saved: list, live: list) -> None:
    if len(saved) != len(live):
        raise StateMismatchError(
            f"{path!r}: the checkpoint has {len(saved)} parameter group(s), "
            f"the live optimizer {len(live)}"
        )
    for i, (s, g) in enumerate(zip(saved, live)):
        if not isinstance(s, dict) or not isinstance(s.get("params"), list):
            raise StateMismatchError(
                f"{path}/param_groups/{i}: not a parameter group in the checkpoint"
            )
        if len(s["params"]) != len(g["params"]):
            raise StateMismatchError(
                f"{path}/param_groups/{i}: the checkpoint has "
                f"{len(s['params'])} parameters in this group, the live "
                f"optimizer {len(g['params'])}"
            )
        saved_keys, live_keys = set(s) - {"params"}, set(g) - {"params"}
        if saved_keys != live_keys:
            raise StateMismatchError(
                f"{path}/param_groups/{i}: hyper-parameters differ; only in the checkpoint: "
                f"{sorted(saved_keys - live_keys)}, only in the live optimizer: "
                f"{sorted(live_keys - saved_keys)}"
            )


def _check_param_state(path: str, saved: dict, live: dict) -> None:
    for index, live_state in live.items():
        if (
            index in saved
            and isinstance(live_state, dict)
            and isinstance(saved[index], dict)
            and set(saved[index]) != set(live_state)
        ):
            raise StateMismatchError(
                f"{path}/state/{index}: the checkpoint holds "
                f"{sorted(saved[index])}, the live optimizer "
                f"{sorted(live_state)}"
            )


class RNGState:
    """Place this in a saved state to capture the process's random number generators there:
    torch (CPU and every initialized CUDA device), Python ``random`` and NumPy's global generator.
    Restoring it sets them back."""

    def __repr__(self) -> str:
        return "RNGState()"


class RNGStateProvider(StateProvider):
    """``RNGState``: saved as ``{"torch", "python"[, "cuda"][, "numpy"]}``. Before anything is
    applied, ``validate`` checks the shape and ranges of every part (a Python state is also set
    on a scratch ``random.Random``) and ``validate_values`` the bytes of the torch states (set on
    a scratch ``torch.Generator``), so ``load`` sets the generators without failing halfway."""

    name = "datastates.RNGState"

    def can_handle(self, obj: Any) -> bool:
        return isinstance(obj, RNGState)

    def state(self, obj: RNGState) -> Any:
        # Python's 625 words as one int64 tensor: as JSON values they would be 625 nodes of
        # every rank's tree in the manifest (19 KiB per rank)
        version, words, gauss = random.getstate()
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "python": (version, torch.tensor(words, dtype=torch.int64), gauss),
        }
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        np = _numpy()
        if np is not None:
            kind, keys, pos, has_gauss, cached = np.random.get_state()
            state["numpy"] = {
                "kind": kind,
                "keys": torch.from_numpy(keys.astype("int64")),
                "pos": int(pos),
                "has_gauss": int(has_gauss),
                "cached_gaussian": float(cached),
            }
        return state

    def validate(self, state: Any, path: str) -> None:
        if (
            not isinstance(state, dict)
            or not {"torch", "python"} <= set(state)
            or not set(state) <= {"torch", "python", "cuda", "numpy"}
        ):
            shown = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
            raise CorruptCheckpointError(
                f"{path!r}: expected an RNG state with 'torch' and "
                f"'python' (and optionally 'cuda', 'numpy'), found "
                f"{shown}"
            )
        rngcheck.check_tensor(
            state["torch"], f"{path}/torch", torch.uint8, (torch.get_rng_state().numel(),)
        )
        rngcheck.check_python_state(state["python"], f"{path}/python")
        if "cuda" in state:
            if not isinstance(state["cuda"], (list, tuple)):
                raise CorruptCheckpointError(
                    f"{path}/cuda: expected a list of CUDA generator "
                    f"states, found {type(state['cuda']).__name__}"
                )
            for i, s in enumerate(state["cuda"]):
                rngcheck.check_tensor(s, f"{path}/cuda/{i}", torch.uint8, rngcheck.CUDA_STATE_BYTES)
        if "numpy" in state:
            rngcheck.check_legacy_numpy(state["numpy"], f"{path}/numpy")

    def validate_values(self, state: Any, path: str) -> None:
        rngcheck.check_torch_state_values(state["torch"], f"{path}/torch")
        rngcheck.check_python_state_values(state["python"], f"{path}/python")
        for i, s in enumerate(state.get("cuda", ())):
            rngcheck.check_cuda_state_values(s, f"{path}/cuda/{i}")
        if "numpy" in state:
            rngcheck.check_legacy_numpy_values(state["numpy"], f"{path}/numpy")

    def rebuild(self, state: Any) -> Any:
        """The saved state, its Python part as ``random.getstate()`` gives it (a tuple)."""
        return {**state, "python": rngcheck.python_state(state["python"])}

    def load(self, obj: RNGState, state: Any) -> None:
        torch.set_rng_state(state["torch"].cpu())
        random.setstate(rngcheck.python_state(state["python"]))
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all([s.cpu() for s in state["cuda"]])
        np = _numpy()
        if "numpy" in state and np is not None:
            s = state["numpy"]
            np.random.set_state(
                (
                    s["kind"],
                    s["keys"].numpy().astype("uint32"),
                    s["pos"],
                    s["has_gauss"],
                    s["cached_gaussian"],
                )
            )


class StatefulProvider(StateProvider):
    """Anything with ``state_dict()`` and ``load_state_dict()``: LR schedulers, stateful data
    loaders and samplers, GradScaler, user classes. Captured by the storage rule: eagerly,
    unless a tensor lies on the bytes of an optimizer that is part of the save."""

    name = "datastates.Stateful"

    def can_handle(self, obj: Any) -> bool:
        return (
            not isinstance(obj, type)
            and callable(getattr(obj, "state_dict", None))
            and callable(getattr(obj, "load_state_dict", None))
        )

    def state(self, obj: Any) -> Any:
        return obj.state_dict()

    def load(self, obj: Any, state: Any) -> None:
        obj.load_state_dict(state)

    def check(self, obj: Any, state: Any, path: str) -> None:
        """An object may refuse a saved state before anything is modified: if it has
        ``check_state_dict(state)``, that is called here (the tensors of ``state`` are not
        read yet: shapes and dtypes only); a ValueError or TypeError it raises becomes
        StateMismatchError naming ``path``."""
        hook = getattr(obj, "check_state_dict", None)
        if not callable(hook):
            return
        try:
            hook(state)
        except (ValueError, TypeError) as exc:
            raise StateMismatchError(
                f"{path}: {type(obj).__name__}.check_state_dict refused the saved state: {exc}"
            ) from None


def _numpy():
    try:
        import numpy
    except ImportError:
        return None
    return numpy


def builtin_providers() -> list[StateProvider]:
    return [
        ModuleProvider(),
        OptimizerProvider(),
        RNGStateProvider(),
        NumpyRandomProvider(),
        StatefulProvider(),
    ]

"""Python objects as byte blobs: serialized at save time, loaded safely by default.

Objects are serialized with ``torch.save`` and loaded with ``torch.load(weights_only=True)``, the
allowlist unpickler PyTorch users already know: plain containers, numbers, strings, tensors and
``torch.Size`` load; any other class must be allowed explicitly (``safe_globals``) or the whole file
trusted (``trusted=True``). Nothing from a checkpoint runs code unless the caller opts in.

Save refuses what that loader would refuse (:func:`check_loadable`), so a checkpoint never holds
an object its default restore cannot read, unless the configuration allows unsafe objects.
"""
from __future__ import annotations

import io
import pickle
import sys
from typing import Any, Iterable

import torch

from .errors import SerializationError, UnsafeObjectError


def dumps(obj: Any, key: str) -> bytes:
    """Serialize ``obj`` now; raise SerializationError naming ``key`` if it cannot be."""
    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
    except (pickle.PicklingError, TypeError, AttributeError, RuntimeError, ValueError) as exc:
        raise SerializationError(
            f"cannot serialize the object at {key!r} ({type(obj).__qualname__}): {exc}. Make it "
            "picklable, register a state provider for its class, or leave it out of the state"
        ) from exc
    return buf.getvalue()


def loads(data: bytes | memoryview, key: str, *, trusted: bool = False,
          safe_globals: Iterable[Any] = ()) -> Any:
    """Load a blob written by :func:`dumps`.

    With ``trusted=False`` only allowlisted types load; ``safe_globals`` extends the allowlist for
    this call (classes or functions, as for ``torch.serialization.safe_globals``).
    """
    buf = io.BytesIO(bytes(data))
    if trusted:
        return torch.load(buf, weights_only=False, map_location="cpu")
    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            return torch.load(buf, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()
        raise UnsafeObjectError(
            f"refusing to load the object at {key!r}: its type is not allowed by safe loading "
            f"({first[0] if first else exc}). If you trust this checkpoint pass trusted=True, or "
            "allow the specific classes with safe_globals=[...]"
        ) from exc


def check_loadable(obj: Any, data: bytes, key: str) -> None:
    """Raise UnsafeObjectError naming ``key`` unless the blob ``data`` (``dumps(obj)``) loads with
    the default safe loading of :func:`loads` (no ``safe_globals``), as ``restore()`` would.

    Runs the allowlist unpickler on the blob, which builds only allowlisted types and calls no
    other code; it costs one load of each object at save time."""
    try:
        loads(data, key)
    except UnsafeObjectError as exc:
        raise UnsafeObjectError(
            f"refusing to save the object at {key!r} ({_class_name(obj)}): restore() with safe "
            f"loading would refuse it ({_first_line(exc.__cause__)}). {save_hint(obj)}"
        ) from None


def refuse_unsaveable(obj: Any, key: str) -> None:
    """Raise UnsafeObjectError naming ``key`` for objects refused before they are even pickled:
    a torch ``DataLoader`` (pickling it would pickle its whole dataset, and a plain loader has no
    position that a restore could give back)."""
    data = sys.modules.get("torch.utils.data")
    if data is not None and isinstance(obj, data.DataLoader):
        raise UnsafeObjectError(
            f"refusing to save the object at {key!r} ({_class_name(obj)}): a plain DataLoader "
            f"is not saved (restore() with safe loading would refuse it). {save_hint(obj)}")


def save_hint(obj: Any) -> str:
    """What to do instead of saving ``obj`` as a pickled object."""
    allow = ("or set CheckpointConfig(allow_unsafe_objects=True) to save it pickled anyway "
             "(restore() and load() then need trusted=True or safe_globals=[...])")
    data = sys.modules.get("torch.utils.data")
    if data is not None and isinstance(obj, data.DataLoader):
        return ("Save a stateful loader instead: an object with state_dict() and "
                "load_state_dict(), such as torchdata's StatefulDataLoader, is captured by "
                "datastates.StatefulProvider (or save loader.state_dict() yourself); " + allow)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(obj, np.ndarray):
        return ("NumPy arrays are stored natively only as np.ndarray (not a subclass) of "
                "bool, int8-64, uint8-64, float16/32/64 or complex64/128 in native byte order; "
                f"this one is a {type(obj).__qualname__} of {obj.dtype.str}: convert it, " + allow)
    return ("Save plain values (dicts, lists, numbers, strings, tensors, numpy arrays) instead, "
            "register a datastates.StateProvider for its class, " + allow)


def _class_name(obj: Any) -> str:
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"


def _first_line(exc: BaseException | None) -> str:
    """The line of the unpickler's message that names the refused global, else its first."""
    lines = [line.strip() for line in str(exc).strip().splitlines()] if exc is not None else []
    named = [line for line in lines if line.startswith("WeightsUnpickler error")]
    return (named or lines or ["not allowlisted"])[0].split(". Please use")[0]

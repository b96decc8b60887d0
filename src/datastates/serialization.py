"""Python objects as byte blobs: serialized at save time, loaded safely by default.

Objects are serialized with ``torch.save`` and loaded with ``torch.load(weights_only=True)``, the
allowlist unpickler PyTorch users already know: plain containers, numbers, strings, tensors and
``torch.Size`` load; any other class must be allowed explicitly (``safe_globals``) or the whole file
trusted (``trusted=True``). Nothing from a checkpoint runs code unless the caller opts in.
"""
from __future__ import annotations

import io
import pickle
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

"""Checks of saved random generator states, run before any generator is set.

``random.setstate``, ``torch.set_rng_state`` and NumPy's state setters are the last step of a
restore; a damaged or forged state they refuse would fail it there, after other state was applied,
with an untyped error. Worse, NumPy's setters accept positions past the end of their key arrays,
which the next draw would read beyond. These functions prove a saved state valid first: its shape
and value ranges checked field by field, then, where the generator has rules of its own, the
state applied to a scratch generator that nothing else uses. Each raises
``CorruptCheckpointError`` naming the key and the field.
"""

from __future__ import annotations

import random
from typing import Any

import torch

from ..errors import CorruptCheckpointError

#: Words of the Mersenne Twister state, and its position (which may equal the word count).
MT_WORDS = 624
_U32 = 1 << 32
_U64 = 1 << 64
_U128 = 1 << 128
#: Bytes of a CUDA generator state: the seed, and the Philox offset (torch also accepts the seed
#: alone).
CUDA_STATE_BYTES = (16, 8)


def _bad(path: str, expected: str, found: Any) -> CorruptCheckpointError:
    shown = repr(found)
    shown = shown if len(shown) <= 80 else shown[:77] + "..."
    return CorruptCheckpointError(f"{path!r}: expected {expected}, found {shown}")


def check_int(value: Any, path: str, low: int, high: int) -> int:
    """``value`` if it is an int (not a bool) with ``low <= value < high``."""
    if type(value) is not int or not low <= value < high:
        raise _bad(path, f"an integer in [{low}, {high})", value)
    return value


def check_float(value: Any, path: str) -> float:
    if type(value) is not float:
        raise _bad(path, "a float", value)
    return value


def check_tensor(value: Any, path: str, dtype: torch.dtype, sizes: tuple[int, ...]) -> None:
    """``value`` is a 1-D tensor of ``dtype`` whose length is one of ``sizes``."""
    if (
        not isinstance(value, torch.Tensor)
        or value.dtype != dtype
        or value.dim() != 1
        or value.numel() not in sizes
    ):
        found = (
            f"{value.dtype}{list(value.shape)}"
            if isinstance(value, torch.Tensor)
            else type(value).__qualname__
        )
        raise CorruptCheckpointError(
            f"{path!r}: expected a 1-D {dtype} tensor of "
            f"{' or '.join(map(str, sizes))} elements, found {found}"
        )


def check_python_state(state: Any, path: str) -> None:
    """A ``random.getstate()``: (version, 625 ints: 624 32-bit words and a position in
    [0, 624], gauss: None or a float), accepted by ``setstate`` of a scratch ``random.Random``.
    The 625 ints are a 1-D int64 tensor (as ``RNGStateProvider`` saves them) or, in checkpoints
    written before that, a tuple of ints; a tensor's values are checked by
    :func:`check_python_state_values` once read."""
    if not isinstance(state, (tuple, list)) or len(state) != 3:
        raise _bad(path, "(version, internal state, gauss)", state)
    version, internal, gauss = state
    check_int(version, f"{path}/0", 2, 4)
    if gauss is not None:
        check_float(gauss, f"{path}/2")
    if isinstance(internal, torch.Tensor):
        check_tensor(internal, f"{path}/1", torch.int64, (MT_WORDS + 1,))
        return
    if not isinstance(internal, (tuple, list)) or len(internal) != MT_WORDS + 1:
        raise _bad(f"{path}/1", f"{MT_WORDS + 1} integers", internal)
    check_python_state_values(state, path)


def python_state(state: Any) -> tuple:
    """The ``random.setstate`` argument of a saved Python state (either form)."""
    version, internal, gauss = state
    words = internal.tolist() if isinstance(internal, torch.Tensor) else internal
    return version, tuple(words), gauss


def check_python_state_values(state: Any, path: str) -> None:
    """The 625 words of a Python state in range, and the state accepted by a scratch
    ``random.Random``."""
    version, internal, gauss = python_state(state)
    for i, word in enumerate(internal[:MT_WORDS]):
        check_int(word, f"{path}/1/{i}", 0, _U32)
    check_int(internal[MT_WORDS], f"{path}/1/{MT_WORDS}", 0, MT_WORDS + 1)
    try:
        random.Random().setstate((version, internal, gauss))
    except (TypeError, ValueError, OverflowError) as exc:
        raise CorruptCheckpointError(
            f"{path!r}: random.setstate refuses the saved Python random state ({exc})"
        ) from None


def check_torch_state_values(state: torch.Tensor, path: str) -> None:
    """The bytes of a CPU generator state are accepted by a scratch ``torch.Generator``."""
    try:
        torch.Generator().set_state(state.detach().cpu())
    except RuntimeError as exc:
        raise CorruptCheckpointError(
            f"{path!r}: torch refuses the saved CPU generator state ({exc})"
        ) from None


def check_cuda_state_values(state: torch.Tensor, path: str) -> None:
    """A CUDA generator state's Philox offset is a multiple of 4, as ``set_rng_state`` needs
    (checked on the bytes: no CUDA device is touched)."""
    if state.numel() == CUDA_STATE_BYTES[0]:
        offset = int(state.detach().cpu()[8:16].clone().view(torch.int64).item())
        if offset % 4:
            raise CorruptCheckpointError(
                f"{path!r}: the saved Philox offset {offset} is not a multiple of 4"
            )


def check_legacy_numpy(state: Any, path: str) -> None:
    """The ``numpy`` part of an ``RNGState``: {"kind": "MT19937", "keys": int64[624] tensor,
    "pos": [0, 624], "has_gauss": 0 or 1, "cached_gaussian": float}."""
    if not isinstance(state, dict) or set(state) != {
        "kind",
        "keys",
        "pos",
        "has_gauss",
        "cached_gaussian",
    }:
        raise _bad(path, "a dict of kind, keys, pos, has_gauss, cached_gaussian", state)
    if state["kind"] != "MT19937":
        raise _bad(f"{path}/kind", "'MT19937'", state["kind"])
    check_tensor(state["keys"], f"{path}/keys", torch.int64, (MT_WORDS,))
    check_int(state["pos"], f"{path}/pos", 0, MT_WORDS + 1)
    check_int(state["has_gauss"], f"{path}/has_gauss", 0, 2)
    check_float(state["cached_gaussian"], f"{path}/cached_gaussian")


def check_legacy_numpy_values(state: dict, path: str) -> None:
    """The saved key words fit 32 bits (they were saved from a uint32 array)."""
    keys = state["keys"]
    if keys.numel() and (int(keys.min()) < 0 or int(keys.max()) >= _U32):
        raise CorruptCheckpointError(
            f"{path}/keys: expected 32-bit words, found values in "
            f"[{int(keys.min())}, {int(keys.max())}]"
        )


def check_bit_generator(name: str, state: Any, path: str) -> None:
    """A NumPy bit generator's ``state`` dict (one of NumPy's own bit generators) has the
    fields, array shapes and value ranges its setter needs, the ranges it does not check itself
    included (MT19937's ``pos``, Philox's ``buffer_pos``)."""
    if not isinstance(state, dict) or not isinstance(state.get("state"), dict):
        raise _bad(path, "a bit generator state dict with a 'state' dict", state)
    inner = state["state"]
    if name == "MT19937":
        _check_array(inner.get("key"), f"{path}/state/key", "uint32", (MT_WORDS,))
        check_int(inner.get("pos"), f"{path}/state/pos", 0, MT_WORDS + 1)
        return
    check_int(state.get("has_uint32"), f"{path}/has_uint32", 0, 2)
    check_int(state.get("uinteger"), f"{path}/uinteger", 0, _U32)
    if name in ("PCG64", "PCG64DXSM"):
        check_int(inner.get("state"), f"{path}/state/state", 0, _U128)
        check_int(inner.get("inc"), f"{path}/state/inc", 0, _U128)
    elif name == "Philox":
        _check_array(inner.get("counter"), f"{path}/state/counter", "uint64", (4,))
        _check_array(inner.get("key"), f"{path}/state/key", "uint64", (2,))
        _check_array(state.get("buffer"), f"{path}/buffer", "uint64", (4,))
        check_int(state.get("buffer_pos"), f"{path}/buffer_pos", 0, 5)
    elif name == "SFC64":
        _check_array(inner.get("state"), f"{path}/state/state", "uint64", (4,))


def _check_array(value: Any, path: str, dtype: str, shape: tuple[int, ...]) -> None:
    if (
        getattr(value, "dtype", None) is None
        or getattr(value.dtype, "name", None) != dtype
        or tuple(value.shape) != shape
        or type(value).__module__ != "numpy"
    ):
        found = (
            f"{value.dtype}{list(value.shape)}"
            if hasattr(value, "shape")
            else type(value).__qualname__
        )
        raise CorruptCheckpointError(
            f"{path!r}: expected a numpy {dtype} array of shape {list(shape)}, found {found}"
        )


def apply_to_scratch(make: Any, apply: Any, path: str, what: str) -> None:
    """Apply a saved state to a scratch object (``apply(make())``), turning what the setter
    refuses into CorruptCheckpointError."""
    try:
        apply(make())
    except (TypeError, ValueError, KeyError, OverflowError, IndexError) as exc:
        raise CorruptCheckpointError(
            f"{path!r}: {what} refuses the saved state ({type(exc).__name__}: {exc})"
        ) from None

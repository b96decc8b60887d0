"""Fingerprints of a training state: what the resume check (``resumecheck``) records after each
step and compares between an uninterrupted and a resumed run.

A fingerprint maps every key of the state to ``(kind, digest, shown)``: a digest of the exact
bytes (a tensor's dtype, shape and data; a generator's state; a Python value's ``repr``), and a
short text for the report (dtype and shape, or the value itself). Two runs are bit-identical at a
step when every digest is equal. The kind orders the keys of one step from cause to effect, so the
report names the likely cause first: random generators, then the ``state_dict()`` of loaders,
samplers and schedulers, then Python values, then the step's inputs, then tensors (module
parameters and buffers, optimizer state, plain tensors).
"""

from __future__ import annotations

import hashlib
import pickle
import random
from typing import Any, cast

import torch

from ..format import codec as fmt
from ..providers import RNGState

__all__ = ["KINDS", "fingerprint"]

#: The kinds of keys, likely causes first.
KINDS = ("rng", "state", "value", "input", "tensor")
_SHOWN = 60  # characters of a value shown in a report
_PLAIN = (type(None), bool, int, float, complex, str, bytes)


def fingerprint(state: Any, inputs: Any = None) -> dict:
    """``{key: [kind, digest, shown]}`` for ``state`` (and ``inputs``, under ``inputs``), plus
    the process's random generators under ``rng:torch``, ``rng:cuda:<i>`` (CUDA initialized),
    ``rng:python`` and ``rng:numpy`` -- whether or not the state holds an ``RNGState``. Reads
    only: no generator advances, no tensor changes."""
    out: dict = {}
    _process_rngs(out)
    _walk(state, "", None, out)
    if inputs is not None:
        _walk(inputs, "inputs", "input", out)
    return out


def _digest(*parts: bytes) -> str:
    h = hashlib.blake2b(digest_size=16)
    for part in parts:
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


def _tensor_bytes(t: torch.Tensor) -> bytes:
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    return fmt.tensor_bytes(t.to("cpu")).numpy().tobytes()


def _process_rngs(out: dict) -> None:
    out["rng:torch"] = ["rng", _digest(_tensor_bytes(torch.get_rng_state())), "torch"]
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"rng:cuda:{i}"] = ["rng", _digest(_tensor_bytes(s)), f"cuda:{i}"]
    out["rng:python"] = ["rng", _digest(repr(random.getstate()).encode()), "python"]
    try:
        import numpy as np
    except ImportError:
        return
    # the legacy form (the default): the tuple, never the dict of get_state(legacy=False)
    kind, keys, pos, has_gauss, cached = cast(
        "tuple[str, Any, int, int, float]", np.random.get_state()
    )
    out["rng:numpy"] = [
        "rng",
        _digest(keys.tobytes(), repr((kind, pos, has_gauss, cached)).encode()),
        "numpy",
    ]


def _join(path: str, key: Any) -> str:
    return f"{path}/{key}" if path else str(key)


def _walk(obj: Any, path: str, kind: str | None, out: dict) -> None:
    if isinstance(obj, RNGState):
        return  # its generators are the process's: recorded under rng:*
    if isinstance(obj, torch.Tensor):
        out[path] = [
            kind or "tensor",
            _digest(str(obj.dtype).encode(), repr(list(obj.shape)).encode(), _tensor_bytes(obj)),
            f"{str(obj.dtype).replace('torch.', '')} {list(obj.shape)}",
        ]
    elif isinstance(obj, torch.Generator):
        out[path] = ["rng", _digest(_tensor_bytes(obj.get_state())), "torch.Generator"]
    elif _is_numpy_random(obj):
        out[path] = ["rng", _digest(repr(_numpy_state(obj)).encode()), type(obj).__name__]
    elif isinstance(obj, (torch.nn.Module, torch.optim.Optimizer)):
        _walk(obj.state_dict(), path, kind or "tensor", out)
    elif callable(getattr(obj, "state_dict", None)):
        _walk(obj.state_dict(), path, kind or "state", out)
    elif isinstance(obj, dict):
        for k, v in obj.items():
            _walk(v, _join(path, k), kind, out)
    elif isinstance(obj, (list, tuple)):
        for i, v in enumerate(obj):
            _walk(v, _join(path, i), kind, out)
    else:
        out[path] = [kind or "value", *_value(obj)]


def _value(obj: Any) -> tuple:
    """(digest, shown) of a Python value: its repr for plain values, its pickle otherwise."""
    if isinstance(obj, _PLAIN):
        text = repr(obj)
        return _digest(type(obj).__name__.encode(), text.encode()), _short(text)
    try:
        data = pickle.dumps(obj, protocol=4)
    except Exception:  # unpicklable: only its type can be compared
        return _digest(type(obj).__qualname__.encode()), f"<unpicklable {type(obj).__name__}>"
    return _digest(data), _short(f"<{type(obj).__name__}: {_digest(data)[:8]}>")


def _short(text: str) -> str:
    return text if len(text) <= _SHOWN else text[: _SHOWN - 3] + "..."


def _is_numpy_random(obj: Any) -> bool:
    if not (type(obj).__module__ or "").startswith("numpy"):
        return False
    import numpy as np

    return isinstance(obj, (np.random.Generator, np.random.RandomState))


def _numpy_state(obj: Any) -> Any:
    if hasattr(obj, "bit_generator"):
        return obj.bit_generator.state
    kind, keys, pos, has_gauss, cached = obj.get_state()
    return kind, keys.tobytes(), pos, has_gauss, cached

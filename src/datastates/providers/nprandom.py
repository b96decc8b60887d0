"""NumPy random generators as plain state, so they restore under safe loading.

A pickled ``np.random.Generator`` or ``RandomState`` needs NumPy's reconstruction callables, which
the safe loader of ``restore()`` refuses (and which would have to be trusted). Their state is
plain data: the bit generator's ``state`` dict of strings, integers and unsigned integer arrays,
which the core stores as values and native numpy arrays. Rebuilding an object from it calls only
the constructors of NumPy's own bit generators, named in a fixed table, never a name read from
the checkpoint.
"""

from __future__ import annotations

import sys
from typing import Any

from ..errors import CorruptCheckpointError, StateMismatchError
from . import rngcheck
from .base import StateProvider

#: Bit generators ``load()`` may construct (NumPy's own); another one restores only in place.
BIT_GENERATORS = ("MT19937", "PCG64", "PCG64DXSM", "Philox", "SFC64")
_KINDS = ("Generator", "RandomState")


def _numpy():
    return sys.modules.get("numpy")  # no generator exists before numpy is imported


def _kind(obj: Any) -> str | None:
    np = _numpy()
    if np is None:
        return None
    if isinstance(obj, np.random.Generator):
        return "Generator"
    if isinstance(obj, np.random.RandomState):
        return "RandomState"
    return None


class NumpyRandomProvider(StateProvider):
    """``np.random.Generator`` and ``np.random.RandomState``: saved as ``{"kind", "state"}`` where
    ``state`` is ``bit_generator.state`` (Generator) or ``get_state(legacy=False)``
    (RandomState). Restore sets that state on the live object (``check`` refuses another kind or
    bit generator); ``load()`` builds a new object of the saved kind on a new bit generator of
    the saved type (one of BIT_GENERATORS) and sets the state. ``validate`` proves the state of
    one of BIT_GENERATORS valid first: its fields and ranges, then set on a scratch generator."""

    name = "numpy.random"

    def can_handle(self, obj: Any) -> bool:
        return _kind(obj) is not None

    def state(self, obj: Any) -> Any:
        kind = _kind(obj)
        saved = obj.bit_generator.state if kind == "Generator" else obj.get_state(legacy=False)
        return {"kind": kind, "state": saved}

    def check(self, obj: Any, state: Any, path: str) -> None:
        kind, bit_generator = _parts(state, path)
        live_kind = _kind(obj)
        live_bits = self.state(obj)["state"]["bit_generator"]
        if (kind, bit_generator) != (live_kind, live_bits):
            raise StateMismatchError(
                f"{path!r}: the checkpoint holds a numpy {kind} on "
                f"{bit_generator}, the live object is a {live_kind} on "
                f"{live_bits}"
            )

    def validate(self, state: Any, path: str) -> None:
        kind, bit_generator = _parts(state, path)
        if bit_generator not in BIT_GENERATORS or _numpy() is None:
            return  # a bit generator of its own: restored only into a live one of its type
        saved = state["state"]
        rngcheck.check_bit_generator(bit_generator, saved, f"{path}/state")
        if kind == "RandomState":
            rngcheck.check_int(saved.get("has_gauss"), f"{path}/state/has_gauss", 0, 2)
            rngcheck.check_float(saved.get("gauss"), f"{path}/state/gauss")
        np = _numpy()
        bits = getattr(np.random, bit_generator)
        if kind == "Generator":
            rngcheck.apply_to_scratch(
                bits, lambda b: setattr(b, "state", saved), path, f"numpy's {bit_generator}"
            )
        else:
            rngcheck.apply_to_scratch(
                lambda: np.random.RandomState(bits()),
                lambda r: r.set_state(saved),
                path,
                "numpy's RandomState",
            )

    def load(self, obj: Any, state: Any) -> None:
        """Set the saved state (or the state of a rebuilt generator) on the live ``obj``."""
        if _kind(state) is not None:
            state = self.state(state)
        if state["kind"] == "Generator":
            obj.bit_generator.state = state["state"]
        else:
            obj.set_state(state["state"])

    def rebuild(self, state: Any) -> Any:
        kind, bit_generator = _parts(state, "numpy.random state")
        if bit_generator not in BIT_GENERATORS:
            raise CorruptCheckpointError(
                f"a numpy {kind} on bit generator {bit_generator!r} cannot be built by load(): "
                f"expected one of {', '.join(BIT_GENERATORS)}; restore it into a live {kind} "
                "instead"
            )
        np = _numpy()
        bits = getattr(np.random, bit_generator)()
        obj = np.random.Generator(bits) if kind == "Generator" else np.random.RandomState(bits)
        self.load(obj, state)
        return obj


def _parts(state: Any, where: str) -> tuple[str, str]:
    """(kind, bit generator name) of a saved state; CorruptCheckpointError if it has no such
    structure."""
    inner = state.get("state") if isinstance(state, dict) else None
    kind = state.get("kind") if isinstance(state, dict) else None
    bits = inner.get("bit_generator") if isinstance(inner, dict) else None
    if kind not in _KINDS or not isinstance(bits, str):
        raise CorruptCheckpointError(
            f"{where}: expected a saved numpy Generator or RandomState "
            f"({{'kind', 'state': {{'bit_generator', ...}}}}), found "
            f"{str(state)[:80]}"
        )
    return kind, bits

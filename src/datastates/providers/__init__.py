"""State providers: how each kind of object is captured and restored."""

from .base import AUTO, EAGER, LAZY, Capture, StateProvider, eager, lazy
from .builtin import ModuleProvider, OptimizerProvider, RNGState, RNGStateProvider, StatefulProvider
from .nprandom import NumpyRandomProvider
from .registry import ProviderRegistry

__all__ = [
    "AUTO",
    "EAGER",
    "LAZY",
    "Capture",
    "ModuleProvider",
    "NumpyRandomProvider",
    "OptimizerProvider",
    "ProviderRegistry",
    "RNGState",
    "RNGStateProvider",
    "StateProvider",
    "StatefulProvider",
    "eager",
    "lazy",
]

"""Walk a state through the providers into a JSON tree plus the items to capture.

Runs on the training thread inside ``save()``. Tensors are not copied here unless their capture
policy is eager; Python objects are serialized here (they may change right after ``save()``).
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import torch

from . import serialization
from .providers import EAGER, LAZY, Capture, ProviderRegistry, StateProvider

_SCALARS = (str, int, bool, type(None))


@dataclass
class TensorItem:
    """A tensor to capture. ``tensor`` is the live tensor (lazy) or a private clone (eager)."""

    key: str
    tensor: torch.Tensor
    lazy: bool
    #: Global shape and the offset of this (local) tensor inside it; set for sharded tensors.
    global_shape: tuple[int, ...] | None = None
    global_offset: tuple[int, ...] | None = None
    #: For replicated tensors: identical on every rank, written once.
    replicated: bool = False

    def __post_init__(self) -> None:
        # Kept after the snapshot drops the reference to the tensor.
        self.shape = tuple(self.tensor.shape)
        self.dtype = self.tensor.dtype
        self.nbytes = self.tensor.numel() * self.tensor.element_size()


@dataclass
class ObjectItem:
    key: str
    data: bytes

    @property
    def nbytes(self) -> int:
        return len(self.data)


@dataclass
class Flattened:
    tree: dict
    items: list = field(default_factory=list)
    #: Optimizers found in the state: their step must wait for the lazy snapshot.
    optimizers: list = field(default_factory=list)


def key_of(path: tuple) -> str:
    return "/".join(str(p) for p in path)


class _Walker:
    def __init__(self, registry: ProviderRegistry, replicated: bool):
        self.registry = registry
        self.replicated = replicated
        self.out = Flattened(tree={})
        self._views: dict[tuple, int] = {}

    def node(self, obj: Any, path: tuple, policy: str | None,
             provider: StateProvider | None) -> dict:
        if isinstance(obj, Capture):
            return self.node(obj.value, path, obj.policy, provider)
        if isinstance(obj, torch.Tensor):
            return self.tensor(obj, path, policy, provider)
        if isinstance(obj, _SCALARS) or (type(obj) is float and math.isfinite(obj)):
            return {"t": "value", "v": obj}
        kind = type(obj)
        if kind in (dict, OrderedDict) and all(_json_key(k) for k in obj):
            return {"t": "odict" if kind is OrderedDict else "dict",
                    "items": [[k, self.node(v, path + (k,), policy, provider)]
                              for k, v in obj.items()]}
        if kind in (list, tuple):
            return {"t": kind.__name__,
                    "items": [self.node(v, path + (i,), policy, provider)
                              for i, v in enumerate(obj)]}
        found = self.registry.find(obj)
        if found is not None:
            if isinstance(obj, torch.optim.Optimizer):
                self.out.optimizers.append(obj)
            return {"t": "provider", "name": found.name,
                    "state": self.node(found.state(obj), path, policy, found)}
        return self.object(obj, path)

    def tensor(self, t: torch.Tensor, path: tuple, policy: str | None,
               provider: StateProvider | None) -> dict:
        key = key_of(path)
        param = isinstance(t, torch.nn.Parameter)
        if policy is None:
            policy = provider.capture_of(t) if provider is not None else (LAZY if param else EAGER)
        t = t.detach()
        view = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), t.stride(),
                t.dtype, t.device) if t.numel() else None
        if view is not None and view in self._views:  # the same view saved under two keys
            index = self._views[view]
            item = self.out.items[index]
            if item.lazy and policy == EAGER:
                item.tensor, item.lazy = t.clone(memory_format=torch.contiguous_format), False
            return {"t": "tensor", "e": index, "param": param}
        if policy == EAGER:
            t = t.clone(memory_format=torch.contiguous_format)
        index = len(self.out.items)
        self.out.items.append(TensorItem(key, t, policy == LAZY, replicated=self.replicated))
        if view is not None:
            self._views[view] = index
        return {"t": "tensor", "e": index, "param": param}

    def object(self, obj: Any, path: tuple) -> dict:
        key = key_of(path)
        index = len(self.out.items)
        self.out.items.append(ObjectItem(key, serialization.dumps(obj, key)))
        return {"t": "object", "e": index}


def _json_key(k: Any) -> bool:
    return isinstance(k, _SCALARS) or (type(k) is float and math.isfinite(k))


def flatten(state: Any, registry: ProviderRegistry, *, replicated: bool = False) -> Flattened:
    """Describe ``state``: a JSON tree whose leaves index ``items``.

    The same tensor view reached under two keys is one item (shared storage is written once); if
    either key asks for eager capture, it is captured eagerly.
    """
    walker = _Walker(registry, replicated)
    walker.out.tree = walker.node(state, (), None, None)
    return walker.out

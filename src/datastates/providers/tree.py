"""Walk a state through the providers into a JSON tree plus the items to capture.

Runs on the training thread inside ``save()``. Tensors are never copied here: each item keeps a
reference to the live tensor and its capture policy (``lazy``/``eager`` as marked, ``auto`` for
the storage rule of ``datastates.save.capture``); the pipeline copies it into the host cache. Python
objects are serialized here (they may change right after ``save()``), and refused here when the
safe loader of ``restore()`` would refuse them (unless unsafe objects are allowed).

NumPy arrays of a dtype torch has are tensors here (``torch.from_numpy``, no copy when the array
is C-contiguous and writeable): their node carries ``"np": true`` so that a load gives an
``np.ndarray`` back. Other arrays (object, string, datetime, ``longdouble``, non-native byte
order, subclasses) are pickled objects.

The forms a tensor of the state takes (a tensor, a ``TensorShard`` or DTensor's local box, a numpy
array) are defined here for both directions: ``unwritable`` says which live tensors a restore
cannot fill in place.
"""

from __future__ import annotations

import math
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, cast

import torch

from ..format import serialization
from ..format.checks import MAX_TREE_DEPTH
from ..format.tree import LEAVES, key_of
from ..errors import SerializationError
from .base import AUTO, EAGER, LAZY, Capture, StateProvider
from .registry import ProviderRegistry

_SCALARS = (str, int, bool, type(None))
_STR = {str}


class Items:
    """The items of a flattened state, as columns indexed by item number (the ``e`` of the
    tree's leaves): item ``i`` is an object when ``i in blobs`` (its pickled bytes), else a
    tensor. A tensor's column ``tensors[i]`` is the live tensor (detached when it requires grad
    or is not a plain ``torch.Tensor``), never a copy: eager tensors are copied into the host
    cache before ``save()`` returns, lazy ones in the background; :meth:`release` drops them once
    the snapshot is complete.

    Columns, not a record per item: a save of many small tensors builds them on the training
    thread, and a record is an object the garbage collector tracks for as long as the save lives
    (at 100k tensors, enough survivors to start a full collection inside ``save()``). Lists of
    strings, ints, bools and shape tuples leave it nothing new to scan per tensor."""

    __slots__ = (
        "keys",
        "tensors",
        "policies",
        "lazy",
        "versions",
        "nbytes",
        "shapes",
        "dtypes",
        "replicated",
        "boxes",
        "secondary",
        "blobs",
    )

    def __init__(self):
        self.keys: list[str] = []
        self.tensors: list[torch.Tensor | None] = []  #: None for an object
        #: "lazy", "eager" (marked) or "auto" (the storage rule decides ``lazy``); None for an
        #: object.
        self.policies: list[str | None] = []  # None too where a provider's capture is None
        self.lazy: list[bool] = []  #: decided by ``save.capture.decide``; False for an object
        #: The version counter (``Tensor._version``) of each lazy tensor when ``save()`` decided
        #: it lazy (``save.capture.decide``): its copy fails the save if it moved meanwhile. No
        #: entry for a tensor that keeps no counter (an inference tensor).
        self.versions: dict[int, int] = {}
        self.nbytes: list[int] = []
        #: Kept after the snapshot drops the tensors; None for an object.
        self.shapes: list[tuple[int, ...] | None] = []
        self.dtypes: list[torch.dtype | None] = []
        #: Identical on every rank, written once (declared by ``save(replicated=)``).
        self.replicated: list[bool] = []
        #: ``(global_shape, global_offset)`` of each sharded tensor: the box of the global
        #: tensor its local tensor is.
        self.boxes: dict[int, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        #: Sharded tensors another rank writes (the same box replicated over a mesh dimension).
        self.secondary: set[int] = set()
        self.blobs: dict[int, bytes] = {}  #: the pickled bytes of each object

    def __len__(self) -> int:
        return len(self.keys)

    def add_tensor(
        self,
        key: str,
        t: torch.Tensor,
        policy: str,
        replicated: bool,
        shard: TensorShard | None = None,
    ) -> None:
        """Append tensor ``t`` (its shape read first: a nested tensor has none and raises
        RuntimeError before anything is appended)."""
        shape = tuple(t.shape)
        self.keys.append(key)
        self.tensors.append(t)
        self.policies.append(policy)
        self.lazy.append(False)
        self.nbytes.append(t.numel() * t.element_size())  # not .nbytes: a sparse one has none
        self.shapes.append(shape)
        self.dtypes.append(t.dtype)
        if shard is not None:
            self.boxes[len(self.keys) - 1] = (shard.global_shape, shard.global_offset)
            if not shard.primary:
                self.secondary.add(len(self.keys) - 1)
            replicated = False
        self.replicated.append(replicated)

    def add_object(self, key: str, data: bytes) -> None:
        self.blobs[len(self.keys)] = data
        self.keys.append(key)
        self.tensors.append(None)
        self.policies.append(None)
        self.lazy.append(False)
        self.nbytes.append(len(data))
        self.shapes.append(None)
        self.dtypes.append(None)
        self.replicated.append(False)

    def tensor_indexes(self) -> list[int]:
        """The numbers of the tensor items, in order."""
        blobs = self.blobs
        return [i for i in range(len(self.keys)) if i not in blobs]

    def release(self) -> None:
        """Drop every reference to a live tensor (the snapshot is complete, or never began)."""
        self.tensors = [None] * len(self.keys)


@dataclass
class Flattened:
    tree: dict
    items: Items = field(default_factory=Items)
    #: Optimizers found in the state (as given, possibly wrappers): part of this save.
    optimizers: list = field(default_factory=list)


class TensorShard:
    """A local piece of a larger logical tensor, in the "local shard + global offset" form that
    ZeRO, FSDP and Megatron use: ``local`` is the box of the global tensor (of ``global_shape``)
    starting at ``global_offset``. ``primary=False`` when another rank holds and writes the same
    box (a data-parallel replica of the shard). Restore fills ``local`` in place, reading only the
    saved shards that overlap it, whatever the sharding was at save time."""

    __slots__ = ("local", "global_shape", "global_offset", "primary")

    def __init__(self, local: torch.Tensor, global_shape, global_offset, primary: bool = True):
        self.local = local
        self.global_shape = tuple(int(x) for x in global_shape)
        self.global_offset = tuple(int(x) for x in global_offset)
        self.primary = primary
        if len(self.global_shape) != local.dim() or len(self.global_offset) != local.dim():
            raise ValueError(
                f"TensorShard: local tensor has {local.dim()} dims, global_shape "
                f"{self.global_shape} and global_offset {self.global_offset} must too"
            )
        for size, off, full in zip(local.shape, self.global_offset, self.global_shape):
            if off < 0 or off + size > full:
                raise ValueError(
                    f"TensorShard: local box {tuple(local.shape)} at "
                    f"{self.global_offset} exceeds the global shape {self.global_shape}"
                )

    @property
    def requires_grad(self):
        return self.local.requires_grad


def sharding_of(t) -> TensorShard | None:
    """The local box of a DTensor or TensorShard (None for an ordinary tensor)."""
    if isinstance(t, TensorShard):
        return t
    module = sys.modules.get("torch.distributed.tensor")
    if module is None or not isinstance(t, module.DTensor):  # no DTensor exists before import
        return None
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    mesh, placements = t.device_mesh, t.placements
    _, offset = compute_local_shape_and_global_offset(t.shape, mesh, placements)
    coordinate = mesh.get_coordinate() or []
    primary = True
    for dim, placement in enumerate(placements):
        if isinstance(placement, Replicate):
            primary = primary and coordinate[dim] == 0
        elif not isinstance(placement, Shard):
            raise TypeError(
                f"DTensor placement {placement} cannot be checkpointed; "
                "redistribute partial tensors first"
            )
    return TensorShard(t.to_local(), tuple(t.shape), offset, primary)


#: NumPy dtypes stored as tensors (``torch.from_numpy`` accepts them; the format names them).
NUMPY_DTYPES = frozenset(
    (
        "float64",
        "float32",
        "float16",
        "complex64",
        "complex128",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint64",
        "uint32",
        "uint16",
        "uint8",
        "bool",
    )
)


def numpy_tensor(obj: Any) -> torch.Tensor | None:
    """``obj`` as a CPU tensor on its bytes if it is an ``np.ndarray`` (exactly, not a subclass)
    of a native-byte-order dtype in NUMPY_DTYPES, else None. A C-contiguous writeable array is
    shared (``torch.from_numpy``); any other is copied into a C-contiguous one first."""
    np = sys.modules.get("numpy")  # no ndarray exists before numpy is imported
    if np is None or type(obj) is not np.ndarray:
        return None
    dtype = obj.dtype
    if not dtype.isnative or dtype.name not in NUMPY_DTYPES or dtype.fields or dtype.metadata:
        return None
    if not (obj.flags.c_contiguous and obj.flags.writeable):
        obj = np.array(obj, order="C", copy=True)
    return torch.from_numpy(obj)


def plain_cpu(t: torch.Tensor) -> bool:
    """Whether the bytes of ``t`` are its elements in row-major order at ``t.data_ptr()``: a
    plain contiguous CPU tensor without a lazy conjugate or negative bit (whose bytes are not
    its values). Such a tensor is copied by address, as it is saved and as it is restored,
    without a tensor view made of it."""
    return (
        type(t) is torch.Tensor
        and t.is_cpu
        and t.is_contiguous()
        and not t.is_conj()
        and not t.is_neg()
    )


def unwritable(t: torch.Tensor) -> str | None:
    """Why restore cannot fill the live tensor ``t`` in place (None when it can): torch refuses
    to write into an inference tensor outside inference mode, into a tensor that is not strided,
    and into one whose elements share memory (``expand()``, stride 0); a meta tensor has no data
    to fill. Checked in the planning pass, so such a tensor is refused before any other is
    written."""
    if t.layout != torch.strided:
        return f"has layout {t.layout}; only strided tensors are filled in place"
    if t.is_meta:
        return "is on the meta device (it holds no data to fill)"
    if t.is_inference() and not torch.is_inference_mode_enabled():
        return (
            "is an inference tensor (made under torch.inference_mode()), which torch does "
            "not let anything write outside inference mode"
        )
    if t.numel() == 0 or t.is_contiguous():
        return None
    for dim, (size, stride) in enumerate(zip(t.shape, t.stride())):
        if stride == 0 and size > 1:
            return (
                f"overlaps itself: dimension {dim} of size {size} has stride 0 (made by "
                "expand() or broadcasting); restore into a clone() of it"
            )
    if not _distinct_elements(t):
        return (
            f"overlaps itself: strides {t.stride()} map several of its elements to one "
            "memory location; restore into a clone() of it"
        )
    return None


def _distinct_elements(t: torch.Tensor) -> bool:
    """Whether every element of ``t`` has its own memory location. Sorted by stride, each
    dimension stepping past everything the smaller ones span proves it at once; the rare layouts
    that do not (interleaved strides) are settled by counting the distinct offsets."""
    extent = 1
    for stride, size in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if stride < extent:
            break
        extent += (size - 1) * stride
    else:
        return True
    offsets = torch.zeros((), dtype=torch.int64)
    for size, stride in zip(t.shape, t.stride()):
        offsets = offsets.unsqueeze(-1) + torch.arange(size, dtype=torch.int64) * stride
    return torch.unique(offsets.reshape(-1)).numel() == t.numel()


class _Walker:
    """One walk of a state. Keys are built as the walk descends (a child's key from its
    parent's), and a plain ``torch.Tensor`` -- the commonest leaf -- is dispatched first, before
    the checks the other kinds of value need."""

    def __init__(self, registry: ProviderRegistry, replicated: bool, allow_unsafe: bool):
        self.registry = registry
        self.replicated = replicated
        self.allow_unsafe = allow_unsafe
        self.out = Flattened(tree={})
        #: item of the first tensor starting at each address, and of each view compared
        self._starts: dict[int, int] = {}
        self._views: dict[tuple, int] = {}

    def node(
        self,
        obj: Any,
        path: tuple,
        key: str,
        policy: str | None,
        provider: StateProvider | None,
        depth: int = 1,
    ) -> dict:
        """The tree node of ``obj`` at ``path`` (whose key is ``key``), ``depth`` levels down
        (the root is 1, as the reader counts): deeper than a checkpoint may be is refused here,
        before recursing."""
        if type(obj) is torch.Tensor:
            if depth > MAX_TREE_DEPTH:
                raise _too_deep(path)
            return self.tensor(obj, key, policy, provider)
        if isinstance(obj, Capture):
            return self.node(obj.value, path, key, obj.policy, provider, depth)
        if depth > MAX_TREE_DEPTH:
            raise _too_deep(path)
        if isinstance(obj, (torch.Tensor, TensorShard)):
            return self.tensor(obj, key, policy, provider)
        array = numpy_tensor(obj)
        if array is not None:
            return {**self.tensor(array, key, policy, provider), "np": True}
        if type(obj) in _SCALARS or (type(obj) is float and math.isfinite(obj)):
            return {"t": "value", "v": obj}  # exact types: an IntEnum is pickled, keeping its class
        kind = type(obj)
        prefix = key + "/" if path else ""  # key_of(path + (k,)), the root's children bare
        if kind in (dict, OrderedDict) and _json_keys(obj):
            # A plain tensor child goes straight to tensor(), as node() would send it, without
            # the path tuple and the call only an error or a deeper child needs.
            child, tensor, node = depth + 1, self.tensor, self.node
            plain = child <= MAX_TREE_DEPTH
            # Keys and child nodes in two lists, paired by saved_tree() on the commit thread;
            # each node from its key (a mapping a provider changes under the walk fails here).
            keys = list(obj)
            return {
                "t": "odict" if kind is OrderedDict else "dict",
                "keys": keys,
                "nodes": [
                    tensor(v, f"{prefix}{k}", policy, provider)
                    if plain and type(v) is torch.Tensor
                    else node(v, path + (k,), f"{prefix}{k}", policy, provider, child)
                    for k in keys
                    for v in (obj[k],)
                ],
            }
        if kind in (list, tuple):
            return {
                "t": kind.__name__,
                "items": [
                    self.node(v, path + (i,), f"{prefix}{i}", policy, provider, depth + 1)
                    for i, v in enumerate(obj)
                ],
            }
        found = self.registry.find(obj)
        if found is not None:
            if isinstance(obj, torch.optim.Optimizer):
                self.out.optimizers.append(obj)
            return {
                "t": "provider",
                "name": found.name,
                "state": self.node(found.state(obj), path, key, policy, found, depth + 1),
            }
        return self.object(obj, key)

    def tensor(
        self,
        obj: torch.Tensor | TensorShard,
        key: str,
        policy: str | None,
        provider: StateProvider | None,
    ) -> dict:
        plain = type(obj) is torch.Tensor
        param = not plain and isinstance(obj, torch.nn.Parameter)
        if policy is None and provider is not None:
            # a TensorShard is asked as it is, though capture_of's annotation names tensors
            policy = provider.capture_of(obj)  # type: ignore[arg-type]
        elif policy is None:
            policy = AUTO
        shard = None if plain else sharding_of(obj)
        if shard is not None:
            t = shard.local.detach()
        else:
            t = cast(torch.Tensor, obj)  # sharding_of gives every TensorShard its shard
            if not plain or t.requires_grad:
                t = t.detach()  # a plain tensor that needs no grad is kept as it is: no alias
        items = self.out.items
        index = len(items.keys)
        if t.numel():
            try:
                address = t.data_ptr() if type(t) is torch.Tensor else _address_of(t)
            except RuntimeError:  # a sparse tensor has no data pointer: say so by its key
                _refuse(t, key)
                raise
            if not address:  # a meta tensor: no data to save
                _refuse(t, key)
            first = self._starts.setdefault(address, index)
            if first != index:  # another tensor starts there: the same view, or another one
                first = self._same_view(t, first, index)
                if first != index:  # the same view saved under two keys
                    items.policies[first] = _merge(items.policies[first], policy)
                    return {"t": "tensor", "e": first, "param": param}
        else:
            _refuse(t, key)
        try:
            items.add_tensor(key, t, policy, self.replicated, shard)
        except RuntimeError:  # a nested tensor has no shape
            _refuse(t, key)
            raise
        return {"t": "tensor", "e": index, "param": param}

    def _same_view(self, t: torch.Tensor, first: int, index: int) -> int:
        """The item of the view ``t`` when one was seen before, else ``index`` (``t``'s, now
        recorded). Tensors are told apart by the address of their first byte; only those
        starting where an earlier one does (tied weights, views at the start of a buffer) are
        compared by their whole view (:func:`_view_of`)."""
        seen = self.out.items.tensors[first]
        assert seen is not None, "the live tensors are released after the walk only"
        self._views.setdefault(_view_of(seen), first)
        return self._views.setdefault(_view_of(t), index)

    def object(self, obj: Any, key: str) -> dict:
        if not self.allow_unsafe:
            serialization.refuse_unsaveable(obj, key)
        data = serialization.dumps(obj, key)
        if not self.allow_unsafe:
            serialization.check_loadable(obj, data, key)
        index = len(self.out.items)
        self.out.items.add_object(key, data)
        return {"t": "object", "e": index}


def _view_of(t: torch.Tensor) -> tuple:
    """What makes two tensors the same view: their storage's address, the offset into it,
    shape, strides, dtype and device."""
    return (
        t.untyped_storage().data_ptr(),
        t.storage_offset(),
        tuple(t.shape),
        t.stride(),
        t.dtype,
        t.device,
    )


def _address_of(t: torch.Tensor) -> int:
    """The address of the first element of ``t``: ``data_ptr()`` of a plain tensor, from its
    storage for any other (as :func:`_view_of` sees it)."""
    return t.untyped_storage().data_ptr() + int(t.storage_offset()) * t.element_size()


def _refuse(t: torch.Tensor, key: str) -> None:
    """SerializationError naming ``key`` when ``t`` is a tensor no checkpoint holds: one that is
    not strided (sparse, mkldnn, jagged), nested, or on the meta device with elements (no data).
    Called where such a tensor makes torch fail or would be stored as something else, so the
    check costs nothing on the path of an ordinary tensor."""
    if t.layout != torch.strided or t.is_nested:
        kind = "a nested tensor" if t.is_nested else f"a tensor of layout {t.layout}"
        raise SerializationError(
            f"{key!r}: {kind}; a checkpoint holds strided tensors (convert "
            "it first: .to_dense() for a sparse or mkldnn one, .unbind() "
            "for a nested one)"
        )
    if t.is_meta and t.numel():
        raise SerializationError(
            f"{key!r}: a meta tensor of {t.numel()} elements holds no "
            "data to save (materialize it first, for example with "
            "module.to_empty(device='cpu') and its initialization)"
        )


def _too_deep(path: tuple) -> SerializationError:
    shown = key_of(path[:8]) + ("/..." if len(path) > 8 else "")
    return SerializationError(
        f"{shown!r}: the state is nested more than {MAX_TREE_DEPTH} levels "
        f"deep ({len(path)} keys down to here), the most a checkpoint "
        "holds; a container that holds itself is nested without end"
    )


def _merge(a: str | None, b: str) -> str:
    """The policy of one view reached under two keys: eager wins, then an explicit lazy."""
    if EAGER in (a, b):
        return EAGER
    return LAZY if LAZY in (a, b) else AUTO


def _json_key(k: Any) -> bool:
    return type(k) in _SCALARS or (type(k) is float and math.isfinite(k))


def _json_keys(mapping: dict) -> bool:
    """Every key of ``mapping`` is a JSON scalar (one pass over the key types first: keys are
    nearly always strings)."""
    return set(map(type, mapping)) <= _STR or all(_json_key(k) for k in mapping)


def saved_tree(node: dict) -> dict:
    """``node``, a tree :func:`flatten` made, in the form a manifest holds it: the walk keeps a
    mapping's keys and child nodes in two lists, paired here as ``[key, node]``. Called on the
    commit thread: each pair is a list the garbage collector tracks, one per key."""
    t = node["t"]
    if "keys" in node:
        return {
            "t": t,
            "items": [
                [k, child if child["t"] in LEAVES else saved_tree(child)]
                for k, child in zip(node["keys"], node["nodes"])
            ],
        }
    if t == "provider":
        return {**node, "state": saved_tree(node["state"])}
    if t in ("list", "tuple"):
        return {
            "t": t,
            "items": [
                child if child["t"] in LEAVES else saved_tree(child) for child in node["items"]
            ],
        }
    return node


def flatten(
    state: Any, registry: ProviderRegistry, *, replicated: bool = False, allow_unsafe: bool = False
) -> Flattened:
    """Describe ``state``: a tree whose leaves index ``items`` (a mapping's keys and nodes in
    two lists; :func:`saved_tree` gives the JSON form the manifest holds).

    A state nested deeper than ``MAX_TREE_DEPTH`` levels (a dict, list, tuple or provider
    state is one level; a container holding itself has no end) raises SerializationError naming
    the first keys of the path. A Python object that ``restore()``'s default safe loading would
    refuse (a class outside the allowlist, a torch ``DataLoader``) raises UnsafeObjectError
    naming its key, unless ``allow_unsafe``; an object that cannot be pickled raises
    SerializationError, and so does a tensor no checkpoint holds (not strided, nested, or on the
    meta device with elements), naming its key.

    The same tensor view reached under two keys is one item (shared storage is written once); if
    either key asks for eager capture, it is captured eagerly. ``items.lazy`` is left False: the
    caller decides it (``datastates.save.capture.decide``).
    """
    walker = _Walker(registry, replicated, allow_unsafe)
    walker.out.tree = walker.node(state, (), "", None, None)
    return walker.out

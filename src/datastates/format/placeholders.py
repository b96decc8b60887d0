"""Tensor placeholders of a plain state and their pickle (docs/format.md, "The pickle"): a
placeholder ``(TENSOR_MARK, key, dtype, shape)`` is written as ``torch.save`` writes a tensor
of that dtype and shape on storage ``key``, by :class:`TensorPickler`: the bytes
``zipframe._Pickler`` (the C pickler with a ``persistent_id`` and a ``reducer_override``)
writes, without a Python call per object."""

from __future__ import annotations

import collections
import struct
from typing import Any

import torch

from . import pickler

_U32 = struct.Struct("<I")


#: The first item of a tensor placeholder in a plain state, ``(TENSOR_MARK, key, dtype, shape)``:
#: an exact tuple of objects the garbage collector does not track, so that it stops tracking
#: the placeholder at its first pass (a state of many tensors adds no objects to the full
#: collections while it is pickled). No value of a state tree is this object.
TENSOR_MARK = object()


def placeholder(key: str, dtype: torch.dtype, shape: tuple) -> tuple:
    return (TENSOR_MARK, key, dtype, shape)


def is_placeholder(obj: Any) -> bool:
    return type(obj) is tuple and len(obj) == 4 and obj[0] is TENSOR_MARK


def legacy_storage(dtype: torch.dtype):
    try:
        return getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])
    except (KeyError, AttributeError):
        return None


class TensorPickler(pickler.TreePickler):
    """Writes a tensor placeholder as ``zipframe._Pickler.reducer_override`` and
    ``persistent_id`` make the C pickler write it. Once the globals of its dtype
    are in the memo and the memo holds 256 objects (every BINPUT then 5 bytes), a placeholder
    whose key and shape are new objects is its key and the memo indexes packed into bytes
    fixed per dtype and shape (:meth:`_plan`); any other object by object."""

    def __init__(self) -> None:
        super().__init__()
        #: dtype -> (the rebuild function, the storage type, bytes per storage element or 1
        #: for a typed storage, the dtype's global for ``_rebuild_tensor_v3`` or None).
        self._kinds: dict[torch.dtype, tuple] = {}
        #: (dtype, shape) -> what :meth:`_plan` returns.
        self._plans: dict[tuple, tuple] = {}

    def _kind(self, dtype: torch.dtype) -> tuple:
        kind = self._kinds.get(dtype)
        if kind is None:
            if type(dtype) is not torch.dtype:
                raise pickler.Unsupported("a tensor placeholder without a dtype")
            legacy = legacy_storage(dtype)
            if legacy is None:
                kind = (
                    torch._utils._rebuild_tensor_v3,
                    torch.UntypedStorage,
                    dtype.itemsize,
                    dtype,
                )
            else:
                kind = (torch._utils._rebuild_tensor_v2, legacy, 1, None)
            self._kinds[dtype] = kind
        return kind

    def save_tuple(self, obj: tuple) -> None:
        if len(obj) == 4 and obj[0] is TENSOR_MARK:
            self._tensor(obj)
        else:
            super().save_tuple(obj)

    def _tensor(self, obj: tuple) -> None:
        _, key, dtype, shape = obj
        if type(shape) is not tuple:
            raise pickler.Unsupported("a tensor placeholder's shape is not a tuple")
        for size in shape:  # a bool equals an int as a key of _plans but is pickled otherwise
            if type(size) is not int:
                raise pickler.Unsupported("a tensor placeholder's shape holds a non-int")
        memo, n = self.memo, self.n
        plan = self._plans.get((dtype, shape))
        if plan is None or n < 256 or type(key) is not str or id(key) in memo:
            self._tensor_objects(obj)
            return
        head, first, counted, shape_bytes, rest, segments, _ = plan
        data = key.encode("utf-8", "surrogatepass")
        out = self.out
        out += head
        out += _U32.pack(len(data))
        out += data
        out += first.pack(b"r", n, counted, n + 1)
        memo[id(key)] = n
        n += 2
        if shape:
            known = memo.get(id(shape))
            if known is None:
                out += shape_bytes
                out += _U32.pack(n)
                memo[id(shape)] = n
                n += 1
            else:
                out += b"QK\x00" + pickler.get_bytes(known)
            s0, s1, s2, s3 = segments
            out += rest.pack(s0, n, s1, n + 1, s2, n + 2, s3, n + 3)
            memo[id(obj)] = n + 3
            self.n = n + 4
        else:
            s0, s1, s2 = segments
            out += rest.pack(s0, n, s1, n + 1, s2, n + 2)
            memo[id(obj)] = n + 2
            self.n = n + 3

    def save_item(self, key: Any, value: Any) -> None:
        """A dict item; a new str key before a new tensor placeholder of a known kind (its
        name and shape new objects, the shape not empty, the memo past 256) in one pack."""
        if (
            type(value) is tuple
            and len(value) == 4
            and value[0] is TENSOR_MARK
            and type(key) is str
        ):
            _, name, dtype, shape = value
            memo, n = self.memo, self.n
            plan = self._plans.get((dtype, shape)) if type(shape) is tuple and shape else None
            if (
                plan is not None
                and n >= 256
                and type(name) is str
                and name is not key
                and id(key) not in memo
                and id(value) not in memo
                and id(name) not in memo
                and id(shape) not in memo
                and all(type(size) is int for size in shape)
            ):
                head, _, counted, shape_bytes, _, segments, packers = plan
                s0, s1, s2, s3 = segments
                a = key.encode("utf-8", "surrogatepass")
                b = name.encode("utf-8", "surrogatepass")
                pack = packers.get((len(a), len(b)))
                if pack is None:
                    numbered = (b"r", counted, shape_bytes, *segments)  # each then an index
                    pack = packers[len(a), len(b)] = struct.Struct(
                        f"<1sI{len(a)}s1sI{len(head)}sI{len(b)}s"
                        + "".join(f"{len(f)}sI" for f in numbered)
                    ).pack
                self.out += pack(
                    b"X", len(a), a, b"r", n, head, len(b), b, b"r", n + 1, counted, n + 2,
                    shape_bytes, n + 3, s0, n + 4, s1, n + 5, s2, n + 6, s3, n + 7,
                )  # fmt: skip
                memo[id(key)] = n
                memo[id(name)] = n + 1
                memo[id(shape)] = n + 3
                memo[id(value)] = n + 7
                self.n = n + 8
                return
        self.save(key)
        self.save(value)

    def _tensor_objects(self, obj: tuple) -> None:
        """A tensor placeholder written object by object, as the C pickler walks it."""
        _, key, dtype, shape = obj
        rebuild, storage, factor, v3 = self._kind(dtype)
        stride, numel = contiguous(shape)
        out = self.out
        self.save_global(rebuild)
        out += b"(("
        self.save("storage")
        self.save_global(storage)
        self.save(key)
        self.save("cpu")
        self.save(numel * factor)
        out += b"t"
        out += self.put()
        out += b"QK\x00"
        self.save(shape)
        out += _tuple_body(stride)
        if stride:
            out += self.put()
        out += b"\x89"
        self.save_global(collections.OrderedDict)
        out += b")R"
        out += self.put()
        if v3 is not None:
            self.save_global(v3)
        out += b"t"
        out += self.put()
        out += b"R"
        self.remember(obj)
        if (dtype, shape) not in self._plans:
            plan = self._plan(dtype, shape)
            if plan is not None:
                self._plans[(dtype, shape)] = plan

    def _plan(self, dtype: torch.dtype, shape: tuple) -> tuple | None:
        """The bytes of a placeholder of ``dtype`` and ``shape`` around its key and memo
        indexes, once the globals it names are in the memo: the bytes up to the key's length,
        the packer of the key's and the storage id's BINPUTs with the bytes between them, the
        shape's tuple up to its BINPUT's index, the packer of the rest and its bytes, and the
        packers of a dict item of this kind by the lengths of its key and name
        (:meth:`save_item`)."""
        rebuild, storage, factor, v3 = self._kind(dtype)
        named: tuple = (rebuild, "storage", storage, "cpu", collections.OrderedDict)
        named += (v3,) if v3 is not None else ()
        if any(id(o) not in self.memo for o in named):
            return None
        get = {id(o): pickler.get_bytes(self.memo[id(o)]) for o in named}
        stride, numel = contiguous(shape)
        head = get[id(rebuild)] + b"((" + get[id("storage")] + get[id(storage)] + b"X"
        end = (b"" if v3 is None else get[id(v3)]) + b"tr"
        odict = b"\x89" + get[id(collections.OrderedDict)] + b")Rr"
        counted = get[id("cpu")] + pickler.int_bytes(numel * factor) + b"tr"
        first = struct.Struct(f"<1sI{len(counted)}sI")  # the key's BINPUT, the storage id's
        if shape:  # then the shape's, the strides', the OrderedDict's, the arguments', its own
            segments: tuple = (_tuple_body(stride) + b"r", odict, end, b"Rr")
        else:  # no shape nor strides to memoize
            segments = (b"QK\x00))" + odict, end, b"Rr")
        rest = struct.Struct("<" + "".join(f"{len(s)}sI" for s in segments))
        shape_bytes = b"QK\x00" + _tuple_body(shape) + b"r"
        return head, first, counted, shape_bytes, rest, segments, {}


def contiguous(shape: tuple) -> tuple[tuple, int]:
    """The contiguous strides of ``shape`` and its number of elements, as
    ``zipframe._Pickler.reducer_override`` computes them."""
    stride, acc, numel = [], 1, 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    for size in shape:
        numel *= size
    return tuple(reversed(stride)), numel


def _tuple_body(values: tuple) -> bytes:
    """A tuple of ints as protocol 2 writes it, its BINPUT left out (``)`` when empty)."""
    items = b"".join(pickler.int_bytes(v) for v in values)
    if not values:
        return b")"
    if len(values) > 3:
        return b"(" + items + b"t"
    return items + (b"\x85", b"\x86", b"\x87")[len(values) - 1]

"""The ZIP framing of a version-3 shard file (docs/format.md, "Shard file version 3"): the
bytes that make a shard file also a ``torch.save`` archive, around regions that stay where
version 2 puts them.

Pure functions over sizes, names and trees; no I/O. The writer places the local header of
each tensor record in the slot before the tensor (:func:`local_header`), builds the tail
(:func:`tail`) and the first record's local header (:func:`header_record_header`); the
verifier rebuilds the slots from the index (:func:`slot_bytes`).
"""

from __future__ import annotations

import collections
import functools
import io
import pickle
import struct
from typing import Any, Callable, Iterable, NamedTuple

import torch

from . import pickler

FOLDER = "archive"
#: The first record: empty, its local header fills bytes 0-63 (the datastates header follows it,
#: in no record: a record holding it would have to hold the CRC-32 of the tail, which holds the
#: record's own CRC-32 in the central directory).
HEADER_RECORD = "archive/.datastates/shard"
INDEX_RECORD = "archive/.datastates/index"
#: The bytes of a local header slot; ``BIG_SLOT`` for a record of ``ZIP64_LIMIT`` bytes or more.
SLOT = 64
BIG_SLOT = 128
ZIP64_LIMIT = 0xFFFFFFFF
#: The offset of the datastates header in a version-3 file (the data of the first record).
HEADER_AT = SLOT
_PAD_ID = 0x5344  # "DS"
_DATE = 0x21  # 1980-01-01
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_U32 = struct.Struct("<I")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_Z64_EOCD = struct.Struct("<IQHHIIQQQQ")
_Z64_LOC = struct.Struct("<IIQI")
_EOCD = struct.Struct("<IHHHHIIH")
#: Records of the tail after data.pkl: (name, data).
_TAIL_RECORDS = (
    (f"{FOLDER}/.format_version", b"1"),
    (f"{FOLDER}/.storage_alignment", b"64"),
    (f"{FOLDER}/byteorder", b"little"),
    (f"{FOLDER}/version", b"3\n"),
)


def slot_of(nbytes: int) -> int:
    """The bytes of the local header slot before a record of ``nbytes``."""
    return BIG_SLOT if nbytes >= ZIP64_LIMIT else SLOT


def tensor_name(k: int) -> str:
    return f"{FOLDER}/data/{k}"


_TENSOR_PREFIX = f"{FOLDER}/data/".encode("ascii")  # tensor_name's bytes before the number


def local_header(name: str, nbytes: int, slot: int, crc: int = 0) -> bytes:
    """The local header of a stored record of ``nbytes`` named ``name``, exactly ``slot``
    bytes (padded with the ``DS`` extra field), so that its data starts right after it."""
    raw = name.encode("ascii")
    z64 = nbytes >= ZIP64_LIMIT
    extra = struct.pack("<HHQQ", 1, 16, nbytes, nbytes) if z64 else b""
    pad = slot - _LOCAL.size - len(raw) - len(extra) - 4
    if pad < 0:
        raise ValueError(f"a local header for {name!r} does not fit in {slot} bytes")
    extra += struct.pack("<HH", _PAD_ID, pad) + bytes(pad)
    size = ZIP64_LIMIT if z64 else nbytes
    return (
        _LOCAL.pack(
            0x04034B50, 45 if z64 else 20, 0, 0, 0, _DATE, crc, size, size, len(raw), len(extra)
        )
        + raw
        + extra
    )


def tensor_header(k: int, nbytes: int) -> bytes:
    """The local header slot before tensor record ``k`` of ``nbytes``:
    ``local_header(tensor_name(k), nbytes, slot_of(nbytes))``, from parts made once per name
    length and size (all but the name)."""
    raw = b"%b%d" % (_TENSOR_PREFIX, k)
    try:
        before, after = _header_parts(len(raw), nbytes)
    except ValueError:  # too long a name: say which
        return local_header(tensor_name(k), nbytes, slot_of(nbytes))
    return before + raw + after


def write_tensor_headers(buffer: memoryview, slots: Iterable[tuple[int, int, int]]) -> None:
    """Write into ``buffer``, for each ``(at, k, nbytes)`` of ``slots``, the local header of
    tensor record ``k`` of ``nbytes`` at ``at`` (:func:`tensor_header`, in one loop)."""
    parts: dict[tuple[int, int], tuple[bytes, bytes]] = {}
    prefix = _TENSOR_PREFIX
    for at, k, nbytes in slots:
        raw = b"%b%d" % (prefix, k)
        known = parts.get((len(raw), nbytes))
        if known is None:
            try:
                known = parts[len(raw), nbytes] = _header_parts(len(raw), nbytes)
            except ValueError:
                tensor_header(k, nbytes)  # raises, naming the record
                raise
        data = known[0] + raw + known[1]
        buffer[at : at + len(data)] = data


@functools.lru_cache(maxsize=4096)
def _header_parts(name_length: int, nbytes: int) -> tuple[bytes, bytes]:
    whole = local_header("_" * name_length, nbytes, slot_of(nbytes))
    return whole[: _LOCAL.size], whole[_LOCAL.size + name_length :]


def header_record_header() -> bytes:
    """Bytes 0-63 of a version-3 file: the local header of the empty first record."""
    return local_header(HEADER_RECORD, 0, SLOT)


class Record(NamedTuple):
    """A record of the archive: its name, where its local header is, its bytes and CRC-32."""

    name: str
    header_at: int
    nbytes: int
    crc: int


def slot_bytes(offsets_sizes: Iterable[tuple[int, int]]) -> Iterable[tuple[int, bytes]]:
    """(where, bytes) of each tensor record's local header, for the tensors of an index given
    as (offset, nbytes) in ascending offset order (what ``verify`` compares a file against)."""
    for k, (offset, nbytes) in enumerate(offsets_sizes):
        slot = slot_of(nbytes)
        yield offset - slot, tensor_header(k, nbytes)


# ---------------------------------------------------------------- CRC-32 combination

_POLY = 0xEDB88320


def _times(mat: list[int], vec: int) -> int:
    out, i = 0, 0
    while vec:
        if vec & 1:
            out ^= mat[i]
        vec >>= 1
        i += 1
    return out


def _square(mat: list[int]) -> list[int]:
    return [_times(mat, mat[n]) for n in range(32)]


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of ``A + B`` from CRC-32(A), CRC-32(B) and len(B) (zlib's crc32_combine)."""
    if len2 <= 0:
        return crc1
    odd = [_POLY] + [1 << n for n in range(31)]  # the operator for one zero bit
    even = _square(odd)  # two zero bits
    odd = _square(even)  # four
    while True:
        even = _square(odd)
        if len2 & 1:
            crc1 = _times(even, crc1)
        len2 >>= 1
        if not len2:
            break
        odd = _square(even)
        if len2 & 1:
            crc1 = _times(odd, crc1)
        len2 >>= 1
        if not len2:
            break
    return crc1 ^ crc2


def _native_combine() -> Callable[[int, int, int], int] | None:
    """A compiled crc32_combine (ISA-L, zlib-ng, or the system zlib through ctypes), if any:
    microseconds where the Python one takes milliseconds."""
    try:
        from isal import isal_zlib

        return isal_zlib.crc32_combine
    except (ImportError, AttributeError):
        pass
    try:
        from zlib_ng import zlib_ng

        return zlib_ng.crc32_combine
    except (ImportError, AttributeError):
        pass
    try:
        import ctypes
        import ctypes.util

        name = ctypes.util.find_library("z")
        if name is None:
            return None
        function = ctypes.CDLL(name).crc32_combine64
        function.restype = ctypes.c_ulong
        function.argtypes = [ctypes.c_ulong, ctypes.c_ulong, ctypes.c_int64]
        return lambda crc1, crc2, len2: int(function(crc1, crc2, len2)) & 0xFFFFFFFF
    except (OSError, AttributeError):
        return None


_COMBINE: list = []  # [the combine function], found at the first use


def crc_of_pieces(pieces: Iterable[tuple[int, int]]) -> int:
    """The CRC-32 of a region from its checksum pieces, ``(length, crc32)`` in order (one
    piece, the common case: its CRC-32)."""
    if type(pieces) is tuple and len(pieces) == 1:
        return pieces[0][1]
    crc, first = 0, True
    for length, piece in pieces:
        if first:
            crc, first = piece, False
            continue
        if not _COMBINE:
            _COMBINE.append(_native_combine() or crc32_combine)
        crc = _COMBINE[0](crc, piece, length)
    return crc


# ---------------------------------------------------------------- the pickle


class _Storage(NamedTuple):
    key: str
    dtype: torch.dtype
    numel: int


class _Tensor(NamedTuple):
    key: str
    dtype: torch.dtype
    shape: tuple


#: The first item of a tensor placeholder in a plain state, ``(TENSOR_MARK, key, dtype, shape)``:
#: an exact tuple of objects the garbage collector does not track, so that it stops tracking
#: the placeholder at its first pass (a state of many tensors adds no objects to the full
#: collections while it is pickled). No value of a state tree is this object.
TENSOR_MARK = object()


def _placeholder(key: str, dtype: torch.dtype, shape: tuple) -> tuple:
    return (TENSOR_MARK, key, dtype, shape)


def _is_placeholder(obj: Any) -> bool:
    return type(obj) is tuple and len(obj) == 4 and obj[0] is TENSOR_MARK


def _with_tensors(obj: Any, done: dict[int, tuple]) -> Any:
    """``obj`` with its placeholders as :class:`_Tensor` (what :class:`_Pickler` writes),
    each container and placeholder once (``done``: id -> (it, its copy))."""
    kind = type(obj)
    if kind not in (dict, list, tuple, collections.OrderedDict):
        return obj
    seen = done.get(id(obj))
    if seen is not None:
        return seen[1]
    new: Any
    if _is_placeholder(obj):
        new = _Tensor(obj[1], obj[2], obj[3])
    elif kind is tuple:
        new = tuple(_with_tensors(v, done) for v in obj)
    elif kind is list:
        new = [_with_tensors(v, done) for v in obj]
    else:
        new = kind((k, _with_tensors(v, done)) for k, v in obj.items())
    done[id(obj)] = (obj, new)
    return new


def _legacy_storage(dtype: torch.dtype):
    try:
        return getattr(torch, torch.storage._dtype_to_storage_type_map()[dtype])
    except (KeyError, AttributeError):
        return None


class _Pickler(pickle.Pickler):
    """Writes the placeholders of tensors as ``torch.save`` writes tensors."""

    def persistent_id(self, obj: Any):
        if type(obj) is _Storage:
            legacy = _legacy_storage(obj.dtype)
            if legacy is None:
                return (
                    "storage",
                    torch.UntypedStorage,
                    obj.key,
                    "cpu",
                    obj.numel * obj.dtype.itemsize,
                )
            return ("storage", legacy, obj.key, "cpu", obj.numel)
        return None

    def reducer_override(self, obj: Any):
        if type(obj) is not _Tensor:
            return NotImplemented
        shape = tuple(obj.shape)
        stride, acc = [], 1
        for size in reversed(shape):
            stride.append(acc)
            acc *= max(size, 1)
        numel = 1
        for size in shape:
            numel *= size
        storage = _Storage(obj.key, obj.dtype, numel)
        if _legacy_storage(obj.dtype) is None:
            return (
                torch._utils._rebuild_tensor_v3,
                (
                    storage,
                    0,
                    shape,
                    tuple(reversed(stride)),
                    False,
                    collections.OrderedDict(),
                    obj.dtype,
                ),
            )
        return (
            torch._utils._rebuild_tensor_v2,
            (storage, 0, shape, tuple(reversed(stride)), False, collections.OrderedDict()),
        )


#: Of a tensor entry of the rank's tree (its item number): (record key, dtype, shape of what
#: this file holds) or None when this file holds none of it.
TensorOf = Callable[[int], "tuple[int, torch.dtype, tuple] | None"]


def plain_state(node: dict, tensor_of: TensorOf) -> Any:
    """The weights_only-loadable form of a rank's state tree (docs/format.md, "The pickle"):
    containers and values as they are, tensors as placeholders, everything else None."""
    t = node["t"]
    if t == "dict":
        return {k: plain_state(v, tensor_of) for k, v in node["items"]}
    if t == "odict":
        return collections.OrderedDict((k, plain_state(v, tensor_of)) for k, v in node["items"])
    if t == "list":
        return [plain_state(v, tensor_of) for v in node["items"]]
    if t == "tuple":
        return tuple(plain_state(v, tensor_of) for v in node["items"])
    if t == "value":
        return node["v"]
    if t == "provider":
        return plain_state(node["state"], tensor_of)
    if t == "tensor":
        held = tensor_of(node["e"])
        return None if held is None else _placeholder(str(held[0]), held[1], tuple(held[2]))
    return None


def pickle_state(state: Any) -> bytes:
    """The protocol 2 pickle of ``state`` (what :func:`plain_state` builds), tensors written
    as ``torch.save`` writes them: by :class:`_TreePickler` (the same bytes as
    :class:`_Pickler`, without a Python call per object), or by :class:`_Pickler` for a
    tree it does not write."""
    try:
        return _TreePickler().dumps(state)
    except pickler.Unsupported:
        buf = io.BytesIO()
        _Pickler(buf, protocol=2).dump(_with_tensors(state, {}))
        return buf.getvalue()


class _TreePickler(pickler.TreePickler):
    """Writes a tensor placeholder as :meth:`_Pickler.reducer_override` and
    :meth:`_Pickler.persistent_id` make the C pickler write it. Once the globals of its dtype
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
            legacy = _legacy_storage(dtype)
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
        stride, numel = _contiguous(shape)
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
        stride, numel = _contiguous(shape)
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


def _contiguous(shape: tuple) -> tuple[tuple, int]:
    """The contiguous strides of ``shape`` and its number of elements, as
    :meth:`_Pickler.reducer_override` computes them."""
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


# ---------------------------------------------------------------- the tail


def _padded(name: str, at: int, data: bytes, crc: int) -> bytes:
    """A tail record at ``at``: its local header, padded so that its data starts on 64."""
    base = _LOCAL.size + len(name) + 4
    slot = -(-(at + base) // SLOT) * SLOT - at
    return local_header(name, len(data), slot, crc) + data


def central_entries(records: Iterable[Record]) -> bytes:
    """The central directory entries of ``records``, in order."""
    return b"".join(_central(r) for r in records)


#: A central directory entry of a record below 4 GiB at an offset below 4 GiB: the fixed
#: fields (signature to date), CRC-32, sizes, name length, zeros, offset (``_CENTRAL``).
_SMALL_CENTRAL_HEAD = _CENTRAL.pack(0x02014B50, 45, 20, 0, 0, 0, _DATE, *([0] * 10))[:16]


@functools.lru_cache(maxsize=64)
def _small_central(name_length: int) -> struct.Struct:
    return struct.Struct(f"<16sIIIH12xI{name_length}s")


def tensor_entries(offsets: Iterable[int], sizes: Iterable[int], crcs: Iterable[int]) -> bytes:
    """The central directory entries of tensor records 0, 1, ... (:func:`tensor_name`) whose
    data are at ``offsets``, of ``sizes`` bytes and these CRC-32s: ``central_entries`` of their
    records, each of the common size (below 4 GiB, below 4 GiB into the file) packed at once."""
    out: list[bytes] = []
    append, head, limit = out.append, _SMALL_CENTRAL_HEAD, ZIP64_LIMIT
    packers: dict[int, Any] = {}
    for k, (offset, nbytes, crc) in enumerate(zip(offsets, sizes, crcs)):
        raw = b"%b%d" % (_TENSOR_PREFIX, k)
        at = offset - SLOT
        if nbytes >= limit or at >= limit:
            append(_central(Record(tensor_name(k), offset - slot_of(nbytes), nbytes, crc)))
            continue
        pack = packers.get(len(raw))
        if pack is None:
            pack = packers[len(raw)] = _small_central(len(raw)).pack
        append(pack(head, crc, nbytes, nbytes, len(raw), at, raw))
    return b"".join(out)


def tail(at: int, records: list[Record], pickled: bytes, crc32: Callable[[bytes], int]) -> bytes:
    """The tail of a version-3 file starting at ``at`` (a multiple of 64): the records of the
    pickle and of torch's small files, then the central directory of ``records`` (header,
    tensors, index: those already in the file) and of these, then the end records."""
    return tail_after(at, central_entries(records), len(records), pickled, crc32)


def tail_after(
    at: int, directory: bytes, count: int, pickled: bytes, crc32: Callable[[bytes], int]
) -> bytes:
    """:func:`tail` of ``count`` records whose central directory entries are ``directory``
    (``central_entries``, ``tensor_entries``: the tensors' packed at once)."""
    out = bytearray()
    own = []
    for name, data in ((f"{FOLDER}/data.pkl", pickled), *_TAIL_RECORDS):
        crc = crc32(data)
        own.append(Record(name, at + len(out), len(data), crc))
        out += _padded(name, at + len(out), data, crc)
    directory_at = at + len(out)
    out += directory
    out += central_entries(own)
    directory_size = at + len(out) - directory_at
    count += len(own)
    z64_at = at + len(out)
    out += _Z64_EOCD.pack(0x06064B50, 44, 45, 45, 0, 0, count, count, directory_size, directory_at)
    out += _Z64_LOC.pack(0x07064B50, 0, z64_at, 1)
    out += _EOCD.pack(
        0x06054B50,
        0,
        0,
        min(count, 0xFFFF),
        min(count, 0xFFFF),
        min(directory_size, ZIP64_LIMIT),
        min(directory_at, ZIP64_LIMIT),
        0,
    )
    return bytes(out)


def _central(r: Record) -> bytes:
    raw = r.name.encode("ascii")
    z64 = [v for v in (r.nbytes, r.nbytes, r.header_at) if v >= ZIP64_LIMIT]
    extra = struct.pack("<HH", 1, 8 * len(z64)) + struct.pack(f"<{len(z64)}Q", *z64) if z64 else b""
    size = min(r.nbytes, ZIP64_LIMIT)
    return (
        _CENTRAL.pack(
            0x02014B50,
            45,
            45 if r.nbytes >= ZIP64_LIMIT else 20,
            0,
            0,
            0,
            _DATE,
            r.crc,
            size,
            size,
            len(raw),
            len(extra),
            0,
            0,
            0,
            0,
            min(r.header_at, ZIP64_LIMIT),
        )
        + raw
        + extra
    )

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
import logging
import pickle
import struct
import zipfile
from typing import Any, Callable, Iterable, NamedTuple

import torch

from . import placeholders
from .placeholders import placeholder
from .pickler import Pickled, Unsupported

log = logging.getLogger("datastates")

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
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_Z64_EOCD = struct.Struct("<IQHHIIQQQQ")
_Z64_LOC = struct.Struct("<IIQI")
_EOCD = struct.Struct("<IHHHHIIH")
#: Records of the tail after data.pkl: (name, data). ``.format_version`` 1 tells torch.load that
#: the archive is laid out as ``torch.save`` lays it out (records in the order the pickle first
#: names them, each followed by a data descriptor), so that it may compute a record's offset
#: from the one before (on the meta device, or with ``calculate_storage_offsets``): true of a
#: DCP frame (one record), not of a shard file, whose tail leaves it out so that torch finds
#: each record by its own header (``SHARD_TAIL_RECORDS``).
TAIL_RECORDS = (
    (f"{FOLDER}/.format_version", b"1"),
    (f"{FOLDER}/.storage_alignment", b"64"),
    (f"{FOLDER}/byteorder", b"little"),
    (f"{FOLDER}/version", b"3\n"),
)
SHARD_TAIL_RECORDS = TAIL_RECORDS[1:]


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


def _with_tensors(obj: Any, done: dict[int, tuple], dropped: list[int]) -> Any:
    """``obj`` with its placeholders as :class:`_Tensor` (what :class:`_Pickler` writes) and its
    objects' pickles as None (counted in ``dropped``), each container and placeholder once
    (``done``: id -> (it, its copy))."""
    kind = type(obj)
    if kind is Pickled:
        dropped.append(1)
        return None
    if kind not in (dict, list, tuple, collections.OrderedDict):
        return obj
    seen = done.get(id(obj))
    if seen is not None:
        return seen[1]
    new: Any
    if placeholders.is_placeholder(obj):
        new = _Tensor(obj[1], obj[2], obj[3])
    elif kind is tuple:  # a cycle through a tuple passes a list or dict, known before its items
        new = tuple(_with_tensors(v, done, dropped) for v in obj)
    elif kind is list:
        new = []
        done[id(obj)] = (obj, new)
        new.extend(_with_tensors(v, done, dropped) for v in obj)
    else:
        new = kind()
        done[id(obj)] = (obj, new)
        for k, v in obj.items():
            new[k] = _with_tensors(v, done, dropped)
    done[id(obj)] = (obj, new)
    return new


class _Pickler(pickle.Pickler):
    """Writes the placeholders of tensors as ``torch.save`` writes tensors."""

    def persistent_id(self, obj: Any):
        if type(obj) is _Storage:
            legacy = placeholders.legacy_storage(obj.dtype)
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
        if placeholders.legacy_storage(obj.dtype) is None:
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


#: Of an object entry of the rank's tree (its item number): the object as ``torch.save`` would
#: pickle it, or None when this file holds none of it.
ObjectOf = Callable[[int], Any]


def plain_state(node: dict, tensor_of: TensorOf, object_of: ObjectOf | None = None) -> Any:
    """What ``torch.save`` of a rank's state tree would pickle (docs/format.md, "The pickle"):
    containers and values as they are, tensors as placeholders of their records, objects as
    ``object_of`` gives them (None without it)."""
    t = node["t"]
    if t == "dict":
        return {k: plain_state(v, tensor_of, object_of) for k, v in node["items"]}
    if t == "odict":
        return collections.OrderedDict(
            (k, plain_state(v, tensor_of, object_of)) for k, v in node["items"]
        )
    if t == "list":
        return [plain_state(v, tensor_of, object_of) for v in node["items"]]
    if t == "tuple":
        return tuple(plain_state(v, tensor_of, object_of) for v in node["items"])
    if t == "value":
        return node["v"]
    if t == "provider":
        return plain_state(node["state"], tensor_of, object_of)
    if t == "tensor":
        held = tensor_of(node["e"])
        return None if held is None else placeholder(str(held[0]), held[1], tuple(held[2]))
    if t == "object" and object_of is not None:
        return object_of(node["e"])
    return None


def object_pickle(blob: bytes) -> Pickled:
    """The pickle ``torch.save`` wrote for the object of a blob this process made (its
    ``data.pkl``), to be written into the view as it is (:class:`pickler.TreePickler`): the
    object is never unpickled here. ValueError for an object holding tensors (their storages
    are records of the blob, which the view does not have)."""
    with zipfile.ZipFile(io.BytesIO(blob)) as archive:
        names = archive.namelist()
        if any("/data/" in name for name in names):
            raise ValueError("the object holds tensors, which the view cannot name as records")
        found = [name for name in names if name.endswith("/data.pkl")]
        if len(found) != 1:
            raise ValueError(f"expected one data.pkl in the object's blob, found {found}")
        return Pickled(archive.read(found[0]))


def pickle_state(state: Any) -> bytes:
    """The protocol 2 pickle of ``state`` (what :func:`plain_state` builds), tensors written
    as ``torch.save`` writes them: by :class:`placeholders.TensorPickler` (the same bytes as
    :class:`_Pickler`, without a Python call per object), or by :class:`_Pickler` for a
    tree it does not write."""
    try:
        return placeholders.TensorPickler().dumps(state)
    except (Unsupported, RecursionError):  # the C pickler goes deeper
        dropped: list[int] = []
        buf = io.BytesIO()
        _Pickler(buf, protocol=2).dump(_with_tensors(state, {}, dropped))
        if dropped:
            log.warning(
                "torch.load of the shard file gives None for its %d objects: the state is "
                "written by the C pickler, which cannot insert their pickles",
                len(dropped),
            )
        return buf.getvalue()


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


def tail(
    at: int,
    records: list[Record],
    pickled: bytes,
    crc32: Callable[[bytes], int],
    small: tuple = TAIL_RECORDS,
) -> bytes:
    """The tail of a version-3 file starting at ``at`` (a multiple of 64): the records of the
    pickle and of torch's ``small`` files, then the central directory of ``records`` (header,
    tensors, index: those already in the file) and of these, then the end records."""
    return tail_after(at, central_entries(records), len(records), pickled, crc32, small)


def tail_after(
    at: int,
    directory: bytes,
    count: int,
    pickled: bytes,
    crc32: Callable[[bytes], int],
    small: tuple = TAIL_RECORDS,
) -> bytes:
    """:func:`tail` of ``count`` records whose central directory entries are ``directory``
    (``central_entries``, ``tensor_entries``: the tensors' packed at once)."""
    out = bytearray()
    own = []
    for name, data in ((f"{FOLDER}/data.pkl", pickled), *small):
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

"""The typed data model of the on-disk format (docs/format.md) and its validating parsers.

Three records cross module and process boundaries as JSON: the manifest of a checkpoint, the index
of each shard file, and the report each rank sends to rank 0 at commit. Each has one frozen
dataclass here and one ``parse_*`` function that validates *everything* once — types (a bool is
not an int), ranges, offsets inside the file and non-overlapping, shapes against byte counts
(Python ints, capped by the file size), checksum pieces, tree node types and indices, file names —
before any caller allocates, seeks or indexes with a value. Every violation raises
``CorruptCheckpointError`` (``UnsupportedFormatError`` for a newer version) naming the file and the
JSON path of the bad field; nothing else escapes a parser.

Pure: no I/O (format.py reads the bytes, checks the checksums and calls these parsers).
"""
from __future__ import annotations

import math
import operator
import re
from dataclasses import dataclass, field
from typing import Any, ClassVar, Union

import torch

from . import format as fmt
from .errors import CorruptCheckpointError, UnsupportedFormatError

#: Deepest state tree accepted (a deeper one is rejected as corrupt rather than overflowing the
#: interpreter's stack in a recursive walk).
MAX_TREE_DEPTH = 256
#: Most dimensions of a tensor.
MAX_NDIM = 64
_U32 = 0xFFFFFFFF
_U64 = (1 << 64) - 1
_NODE_TYPES = frozenset(("dict", "odict", "list", "tuple", "tensor", "object", "value",
                         "provider"))


# ---------------------------------------------------------------- records

@dataclass(frozen=True)
class FileRef:
    """One shard file of a checkpoint: ``rank-RRRRR.dsf`` written by ``rank``."""

    name: str
    rank: int
    nbytes: int        #: exact size of the file
    index_crc32: int   #: CRC-32 of its index, also stored in its header


@dataclass(frozen=True)
class ShardRef:
    """A stored box of a tensor: ``shape`` elements at ``global_offset`` of the global tensor,
    raw at ``[offset, offset + nbytes)`` of file ``file``, verified piecewise by ``checksums``."""

    file: int
    offset: int
    nbytes: int
    global_offset: tuple[int, ...]
    shape: tuple[int, ...]
    checksums: tuple[tuple[int, int], ...]   #: consecutive (length, crc32) pieces


@dataclass(frozen=True)
class TensorEntry:
    """A tensor of the checkpoint: its global dtype and shape and the shards that cover it."""

    kind: ClassVar[str] = "tensor"
    key: str
    dtype: str
    shape: tuple[int, ...]
    shards: tuple[ShardRef, ...]
    replicated: bool = False
    rank: int | None = None    #: the rank whose per-rank tensor this is (None: shared/sharded)

    @property
    def torch_dtype(self) -> torch.dtype:
        return fmt.dtype_from_name(self.dtype, self.key)


@dataclass(frozen=True)
class ObjectEntry:
    """A serialized Python object at ``[offset, offset + nbytes)`` of file ``file``."""

    kind: ClassVar[str] = "object"
    key: str
    file: int
    offset: int
    nbytes: int
    crc32: int


Entry = Union[TensorEntry, ObjectEntry]


@dataclass(frozen=True)
class RankTree:
    """The state tree of one rank; its tensor/object nodes index ``Manifest.entries``."""

    rank: int
    tree: dict


@dataclass(frozen=True)
class Manifest:
    """A validated ``manifest.json``."""

    version: int
    name: str
    step: int | None
    seq: int                 #: commit sequence number (0 for version-1 manifests)
    created_unix: float
    world_size: int
    metadata: dict
    files: tuple[FileRef, ...]
    entries: tuple[Entry, ...]
    ranks: tuple[RankTree, ...]
    save_id: str | None = None  #: the nonce of the save that committed it (multi-rank commits)
    #: Object stores: the directory of the checkpoint holding its shard files (None: the
    #: checkpoint directory itself).
    data_dir: str | None = None
    #: per file, its regions (offset, nbytes, entry, shard or None for an object), by offset
    by_file: tuple[tuple[tuple[int, int, Entry, "ShardRef | None"], ...], ...] = \
        field(default=(), repr=False, compare=False)

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    def regions(self, file_id: int) -> list[tuple[int, int, str]]:
        """(offset, nbytes, key) of every region of file ``file_id`` the manifest references."""
        return [(offset, nbytes, e.key) for offset, nbytes, e, _ in self.by_file[file_id]]


@dataclass(frozen=True)
class IndexEntry:
    """A region of a shard file as its own index describes it."""

    key: str
    kind: str                                 #: "tensor" or "object"
    offset: int
    nbytes: int
    checksums: tuple[tuple[int, int], ...]    #: (length, crc32) pieces covering the region
    dtype: str | None = None
    shape: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ShardIndex:
    """The validated index of one shard file."""

    version: int
    rank: int
    entries: tuple[IndexEntry, ...]


@dataclass(frozen=True)
class ReportEntry:
    """One item of a rank's report: a tensor (written by this rank or not) or an object."""

    key: str
    kind: str
    written: bool
    offset: int | None = None
    nbytes: int | None = None
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    checksums: tuple[tuple[int, int], ...] = ()
    crc32: int | None = None
    global_shape: tuple[int, ...] | None = None
    global_offset: tuple[int, ...] | None = None
    replicated: bool = False


@dataclass(frozen=True)
class RankReport:
    """What a rank sends rank 0 after writing its shard file (docs/format.md, commit step 2)."""

    rank: int
    file: FileRef
    entries: tuple[ReportEntry, ...]
    tree: dict = field(repr=False)


# ---------------------------------------------------------------- field checks

class _At:
    """Where a value sits: the file and the JSON path, for error messages. The path is kept as
    links to the parent and rendered only when an error is raised (parsing stays cheap)."""

    __slots__ = ("file", "parent", "part")

    def __init__(self, file: str, parent: "_At | None" = None, part: Any = None):
        self.file, self.parent, self.part = file, parent, part

    def __truediv__(self, part) -> "_At":
        return _At(self.file, self, part)

    @property
    def path(self) -> str:
        parts, node = [], self
        while node is not None and node.parent is not None:
            parts.append(node.part)
            node = node.parent
        out = ""
        for part in reversed(parts):
            out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
        return out

    def bad(self, what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{self.file}: {self.path or 'top level'}: {what}")


# The ``_field_*`` helpers are the fast path of the commonest checks: they test the value with the
# same predicate as the checker they fall back to, and build the field's path (``at / key``) only
# when that checker is about to raise. A manifest has a dozen checked fields per tensor; building
# every path eagerly was most of the time spent validating one.

_MISSING = object()


def _field_int(obj: dict, key: str, at: _At, lo: int = 0, hi: int = _U64) -> int:
    """``obj[key]``, an integer in ``[lo, hi]``."""
    value = obj.get(key, _MISSING)
    if type(value) is int and lo <= value <= hi:
        return value
    return _int(_get(obj, key, at), at / key, lo, hi)


def _field_str(obj: dict, key: str, at: _At) -> str:
    """``obj[key]``, a string."""
    value = obj.get(key, _MISSING)
    if type(value) is str:
        return value
    return _str(_get(obj, key, at), at / key)


def _field_dims(obj: dict, key: str, at: _At) -> tuple[int, ...]:
    """``obj[key]``, a list of at most MAX_NDIM non-negative integers."""
    value = obj.get(key, _MISSING)
    if type(value) is list and len(value) <= MAX_NDIM and \
            all(type(d) is int and 0 <= d <= _U64 for d in value):
        return tuple(value)
    return _dims(_get(obj, key, at), at / key)


def _get(obj: dict, key: str, at: _At) -> Any:
    if key not in obj:
        raise at.bad(f"required field {key!r} is missing")
    return obj[key]


def _int(value: Any, at: _At, lo: int = 0, hi: int = _U64) -> int:
    if type(value) is not int:
        raise at.bad(f"expected an integer, found {_show(value)}")
    if not lo <= value <= hi:
        raise at.bad(f"expected an integer in [{lo}, {hi}], found {value}")
    return value


def _typed(value: Any, at: _At, kind: type, expected: str) -> Any:
    """``value`` if its exact type is ``kind`` (a bool is not an int), else the error naming it."""
    if type(value) is not kind:
        raise at.bad(f"expected {expected}, found {_show(value)}")
    return value


def _str(value: Any, at: _At) -> str:
    return _typed(value, at, str, "a string")


def _bool(value: Any, at: _At) -> bool:
    return _typed(value, at, bool, "true or false")


def _list(value: Any, at: _At) -> list:
    return _typed(value, at, list, "a list")


def _dict(value: Any, at: _At) -> dict:
    return _typed(value, at, dict, "an object")


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40] + '...' if len(text) > 40 else text}"


def _dims(value: Any, at: _At) -> tuple[int, ...]:
    dims = _list(value, at)
    if len(dims) > MAX_NDIM:
        raise at.bad(f"expected at most {MAX_NDIM} dimensions, found {len(dims)}")
    if all(type(d) is int and 0 <= d <= _U64 for d in dims):
        return tuple(dims)
    return tuple(_int(d, at / i, 0, _U64) for i, d in enumerate(dims))  # raises for the bad one


def _numel(shape: tuple[int, ...], cap: int) -> int | None:
    """prod(shape), or None as soon as it exceeds ``cap`` (no huge intermediate products)."""
    if 0 in shape:
        return 0
    n = 1
    for d in shape:
        n *= d
        if n > cap:
            return None
    return n


def _dtype(value: Any, at: _At) -> str:
    name = _str(value, at)
    try:
        fmt.dtype_from_name(name, "")
    except CorruptCheckpointError:
        raise at.bad(f"unknown dtype {name!r}") from None
    return name


def _pieces(value: Any, nbytes: int, at: _At) -> tuple[tuple[int, int], ...]:
    if type(value) is list:  # fast path; anything unusual is checked (and named) below
        pieces, total = [], 0
        for p in value:
            if type(p) is not list or len(p) != 2 or type(p[0]) is not int or \
                    type(p[1]) is not int or not 1 <= p[0] <= nbytes or not 0 <= p[1] <= _U32:
                break
            total += p[0]
            pieces.append((p[0], p[1]))
        else:
            if total == nbytes:
                return tuple(pieces)
    return _checked_pieces(value, nbytes, at)


def _checked_pieces(value: Any, nbytes: int, at: _At) -> tuple[tuple[int, int], ...]:
    pieces, total = [], 0
    for i, p in enumerate(_list(value, at)):
        if type(p) is not list or len(p) != 2:
            raise (at / i).bad(f"expected a [length, crc32] pair, found {_show(p)}")
        length = _int(p[0], at / i / 0, 1, nbytes)
        total += length
        pieces.append((length, _int(p[1], at / i / 1, 0, _U32)))
    if total != nbytes:
        raise at.bad(f"checksum pieces cover {total} bytes, expected nbytes = {nbytes}")
    return tuple(pieces)


def _check_tensor_bytes(dtype: str, shape: tuple[int, ...], nbytes: int, at: _At) -> None:
    itemsize = fmt.dtype_from_name(dtype, "").itemsize
    numel = _numel(shape, nbytes // itemsize if itemsize else 0)
    if numel is None or numel * itemsize != nbytes:
        raise at.bad(f"shape {list(shape)} of {dtype} needs "
                     f"{'more than ' + str(nbytes) if numel is None else numel * itemsize} "
                     f"bytes, nbytes is {nbytes}")


def _check_disjoint(regions: list[tuple[int, int, str]], at: _At, what: str) -> None:
    """Non-empty regions (offset, nbytes, key) must not overlap."""
    end, last = 0, None
    for offset, nbytes, key in sorted(r for r in regions if r[1]):
        if offset < end:
            raise at.bad(f"{what}: region of {key!r} at [{offset}, {offset + nbytes}) overlaps "
                         f"that of {last!r} ending at {end}")
        end, last = offset + nbytes, key


def _version(obj: dict, at: _At, expected_format: str) -> int:
    found = obj.get("format")
    if found != expected_format:
        raise at.bad(f"format is {_show(found)}, expected {expected_format!r}")
    version = _int(_get(obj, "version", at), at / "version", 1, _U32)
    if version > fmt.VERSION:
        raise UnsupportedFormatError(f"{at.file}: format version {version} is newer than this "
                                     f"reader's {fmt.VERSION}; upgrade datastates")
    return version


# ---------------------------------------------------------------- state trees

def check_tree(root: Any, at: _At, entry_kinds: list[str],
               refs: dict[int, set[str]] | None = None) -> dict:
    """Validate a state tree (iteratively: depth is bounded, never the interpreter's stack).

    ``entry_kinds[i]`` is the kind of entry ``i``; tensor/object nodes must index an entry of
    their own kind. ``refs``, if given, collects for each entry index the keys (``a/b/0``, as
    ``flatten.key_of``) of the nodes that refer to it."""
    stack: list = [(root, at, (), 1, "")]  # node, path of its parent, parts below it, depth, key
    kinds = len(entry_kinds)
    while stack:
        node, parent, parts, depth, key = stack.pop()
        if depth <= MAX_TREE_DEPTH and type(node) is dict and node.get("t") in ("tensor", "object"):
            e = node.get("e")  # fast path of the commonest node, a valid leaf: no path built
            if type(e) is int and 0 <= e < kinds and entry_kinds[e] == node["t"] and \
                    type(node.get("param", False)) is bool and ("np" not in node or (
                        node["np"] is True and node["t"] == "tensor")):  # np: exactly true
                if refs is not None:
                    refs.setdefault(e, set()).add(key)
                continue
        where = parent
        for part in parts:
            where = where / part
        if depth > MAX_TREE_DEPTH:
            raise where.bad(f"state tree deeper than {MAX_TREE_DEPTH}")
        node = _dict(node, where)
        t = _get(node, "t", where)
        if type(t) is not str or t not in _NODE_TYPES:
            raise (where / "t").bad(f"unknown node type {_show(t)}")
        if "np" in node and (t != "tensor" or node["np"] is not True):
            raise (where / "np").bad(f"expected true on a tensor node (saved from a numpy "
                                     f"array), found {_show(node['np'])} on a {t} node")
        if t in ("tensor", "object"):
            e = _int(_get(node, "e", where), where / "e", 0, len(entry_kinds) - 1) \
                if entry_kinds else _no_entries(where)
            if entry_kinds[e] != t:
                raise (where / "e").bad(f"a {t} node refers to entry {e}, a {entry_kinds[e]}")
            if refs is not None:
                refs.setdefault(e, set()).add(key)
            if "param" in node:
                _bool(node["param"], where / "param")
        elif t == "value":
            _scalar(_get(node, "v", where), where / "v")
        elif t == "provider":
            _str(_get(node, "name", where), where / "name")
            stack.append((_get(node, "state", where), where, ("state",), depth + 1, key))
        elif t in ("dict", "odict"):
            for i, pair in enumerate(_list(_get(node, "items", where), where / "items")):
                if type(pair) is not list or len(pair) != 2:
                    raise (where / "items" / i).bad(f"expected a [key, node] pair, found "
                                                    f"{_show(pair)}")
                if type(pair[0]) is not str:  # a string key is always valid
                    _scalar(pair[0], where / "items" / i / 0)
                stack.append((pair[1], where, ("items", i, 1), depth + 1,
                              _child_key(key, pair[0])))
        else:
            for i, child in enumerate(_list(_get(node, "items", where), where / "items")):
                stack.append((child, where, ("items", i), depth + 1, _child_key(key, i)))
    return root


def _child_key(key: str, part: Any) -> str:
    return f"{key}/{part}" if key else str(part)


def check_entry_keys(keys: list[str], refs: dict[int, set[str]], at: _At) -> None:
    """Each entry is referenced by a tree node at its own key (other nodes may share it, as tied
    weights do): a tree index pointing at another entry of the same kind is caught here."""
    for i, key in enumerate(keys):
        if key not in refs.get(i, ()):
            found = sorted(refs.get(i, ()))[:3]
            raise (at / i).bad(f"entry {key!r} is not referenced by the tree node at its key "
                               f"(referenced at {found or 'no key'})")


def _no_entries(where: _At) -> int:
    raise (where / "e").bad("refers to an entry, but there are none")


def _scalar(value: Any, at: _At) -> Any:
    if value is None or type(value) in (str, int, bool):
        return value
    if type(value) is float and math.isfinite(value):
        return value
    raise at.bad(f"expected a string, integer, finite number, boolean or null, found "
                 f"{_show(value)}")


# ---------------------------------------------------------------- manifest

_DATA_DIR = re.compile(r"\.data\.[A-Za-z0-9._@-]+")


def parse_manifest(obj: Any, where: str, *, version_1: bool = False) -> Manifest:
    """Validate a decoded ``manifest.json`` completely and return the typed manifest.

    ``version_1`` says the file had no checksum trailer (only then is version 1 accepted)."""
    at = _At(where)
    m = _dict(obj, at)
    version = _version(m, at, fmt.CHECKPOINT_FORMAT)
    if (version == 1) != version_1:
        raise (at / "version").bad(
            f"version {version} {'requires' if version > 1 else 'must not have'} the checksum "
            "trailer ('manifest_crc32')")
    name = _str(_get(m, "name", at), at / "name")
    try:
        fmt.check_name(name)
    except ValueError as exc:
        raise (at / "name").bad(str(exc)) from None
    step = m.get("step")
    if step is not None:
        step = _int(step, at / "step", 0, (1 << 63) - 1)
    seq = 0 if version == 1 else _int(_get(m, "seq", at), at / "seq", 1, (1 << 63) - 1)
    created = m.get("created_unix", 0.0)
    if type(created) not in (int, float) or not math.isfinite(created) or created < 0:
        raise (at / "created_unix").bad(f"expected a finite time, found {_show(created)}")
    world = _int(_get(m, "world_size", at), at / "world_size", 1, 1 << 24)
    metadata = _dict(m.get("metadata", {}), at / "metadata")
    files = _files(_get(m, "files", at), at / "files", world)
    entries = tuple(_entry(e, at / "entries" / i, files, world)
                    for i, e in enumerate(_list(_get(m, "entries", at), at / "entries")))
    by_file = _regions_by_file(entries, len(files))
    for file_id, f in enumerate(files):
        _check_disjoint([(o, n, e.key) for o, n, e, _ in by_file[file_id]], at / "files" / file_id,
                        f"file {f.name}")
    refs: dict[int, set[str]] = {}
    ranks = _ranks(_get(m, "ranks", at), at / "ranks", world, [e.kind for e in entries], refs)
    check_entry_keys([e.key for e in entries], refs, at / "entries")
    save_id = m.get("save_id")
    if save_id is not None:
        save_id = _str(save_id, at / "save_id")
    data_dir = m.get("data_dir")
    if data_dir is not None and (not _DATA_DIR.fullmatch(_str(data_dir, at / "data_dir")) or
                                 ".." in data_dir):
        raise (at / "data_dir").bad(f"expected '.data.<run>-<attempt>', found {_show(data_dir)}")
    return Manifest(version=version, name=name, step=step, seq=seq, created_unix=float(created),
                    world_size=world, metadata=metadata, files=files, entries=entries,
                    ranks=ranks, save_id=save_id, data_dir=data_dir, by_file=by_file)


def _files(value: Any, at: _At, world: int) -> tuple[FileRef, ...]:
    files = _list(value, at)
    if len(files) != world:
        raise at.bad(f"expected one file per rank ({world}), found {len(files)}")
    out = []
    for i, f in enumerate(files):
        out.append(_file_ref(f, at / i, rank=i))
    return tuple(out)


def _file_ref(value: Any, at: _At, rank: int | None) -> FileRef:
    f = _dict(value, at)
    r = _int(_get(f, "rank", at), at / "rank", 0, 1 << 24)
    if rank is not None and r != rank:
        raise (at / "rank").bad(f"expected rank {rank}, found {r}")
    name = _str(_get(f, "name", at), at / "name")
    if name != fmt.shard_file_name(r):
        raise (at / "name").bad(f"expected the file name {fmt.shard_file_name(r)!r}, found "
                                f"{name!r}")
    return FileRef(name=name, rank=r,
                   nbytes=_int(_get(f, "nbytes", at), at / "nbytes", fmt.HEADER_BYTES, _U64),
                   index_crc32=_int(_get(f, "index_crc32", at), at / "index_crc32", 0, _U32))


def _entry(value: Any, at: _At, files: tuple[FileRef, ...], world: int) -> Entry:
    e = _dict(value, at)
    kind = e.get("kind")
    key = _field_str(e, "key", at)
    if kind == "object":
        file_id = _field_int(e, "file", at, 0, len(files) - 1)
        offset, nbytes = _region(e, at, files[file_id])
        crc = _field_int(e, "crc32", at, 0, _U32)
        if nbytes == 0 and crc != 0:
            raise (at / "crc32").bad(f"an empty region has CRC 0, found {crc}")
        return ObjectEntry(key=key, file=file_id, offset=offset, nbytes=nbytes, crc32=crc)
    if kind != "tensor":
        raise (at / "kind").bad(f"unknown entry kind {_show(kind)}")
    dtype = _dtype(_get(e, "dtype", at), at / "dtype")
    shape = _field_dims(e, "shape", at)
    shards = tuple(_shard(s, at / "shards" / i, files, dtype, shape)
                   for i, s in enumerate(_list(_get(e, "shards", at), at / "shards")))
    if not shards:
        raise (at / "shards").bad(f"tensor {key!r} has no stored shard")
    stored = sum(s.nbytes for s in shards)
    _check_tensor_size(dtype, shape, stored, at)
    replicated = e.get("replicated", False)
    if type(replicated) is not bool:
        _bool(replicated, at / "replicated")
    rank = e.get("rank")
    if rank is not None:
        rank = _field_int(e, "rank", at, 0, world - 1)
    return TensorEntry(key=key, dtype=dtype, shape=shape, shards=shards, replicated=replicated,
                       rank=rank)


def _check_tensor_size(dtype: str, shape: tuple[int, ...], stored: int, at: _At) -> None:
    """The global tensor is no bigger than its stored shards (allocation is bounded by data)."""
    itemsize = fmt.dtype_from_name(dtype, "").itemsize
    if _numel(shape, stored // itemsize) is None:
        raise (at / "shape").bad(f"global shape {list(shape)} of {dtype} is larger than its "
                                 f"{stored} stored bytes")


def _region(e: dict, at: _At, f: FileRef) -> tuple[int, int]:
    offset = _field_int(e, "offset", at, fmt.HEADER_BYTES, f.nbytes)
    if offset % fmt.DATA_ALIGN:
        raise (at / "offset").bad(f"expected a multiple of {fmt.DATA_ALIGN}, found {offset}")
    nbytes = _field_int(e, "nbytes", at, 0, f.nbytes - offset)
    return offset, nbytes


def _shard(value: Any, at: _At, files: tuple[FileRef, ...], dtype: str,
           shape: tuple[int, ...]) -> ShardRef:
    s = _dict(value, at)
    file_id = _field_int(s, "file", at, 0, len(files) - 1)
    offset, nbytes = _region(s, at, files[file_id])
    box = _field_dims(s, "shape", at)
    origin = _field_dims(s, "global_offset", at)
    if len(box) != len(shape) or len(origin) != len(shape):
        raise at.bad(f"box {list(origin)}+{list(box)} does not have the {len(shape)} dimensions "
                     f"of the tensor {list(shape)}")
    for d, (o, n, g) in enumerate(zip(origin, box, shape)):
        if o + n > g:
            raise at.bad(f"box {list(origin)}+{list(box)} exceeds the tensor {list(shape)} in "
                         f"dimension {d}")
    _check_tensor_bytes(dtype, box, nbytes, at)
    return ShardRef(file=file_id, offset=offset, nbytes=nbytes, global_offset=origin, shape=box,
                    checksums=_pieces(_get(s, "checksums", at), nbytes, at / "checksums"))


_offset_and_size = operator.itemgetter(0, 1)


def _regions_by_file(entries: tuple[Entry, ...], nfiles: int) -> tuple:
    """One pass over the entries: each file's regions, sorted by offset."""
    out: list[list] = [[] for _ in range(nfiles)]
    for e in entries:
        if isinstance(e, ObjectEntry):
            out[e.file].append((e.offset, e.nbytes, e, None))
        else:
            for s in e.shards:
                out[s.file].append((s.offset, s.nbytes, e, s))
    return tuple(tuple(sorted(regions, key=_offset_and_size)) for regions in out)


def _ranks(value: Any, at: _At, world: int, kinds: list[str],
           refs: dict[int, set[str]]) -> tuple[RankTree, ...]:
    ranks = _list(value, at)
    if len(ranks) != world:
        raise at.bad(f"expected one tree per rank ({world}), found {len(ranks)}")
    out = []
    for i, r in enumerate(ranks):
        r = _dict(r, at / i)
        _int(_get(r, "rank", at / i), at / i / "rank", i, i)
        out.append(RankTree(rank=i, tree=check_tree(_get(r, "tree", at / i), at / i / "tree",
                                                    kinds, refs)))
    return tuple(out)


# ---------------------------------------------------------------- shard index

def parse_shard_index(obj: Any, where: str, index_offset: int) -> ShardIndex:
    """Validate the decoded index of a shard file whose index starts at ``index_offset``: every
    region lies in ``[HEADER_BYTES, index_offset)``, regions are disjoint, checksum pieces cover
    each region exactly, tensor shapes match their byte counts."""
    at = _At(where)
    d = _dict(obj, at)
    version = _version(d, at, fmt.SHARD_FORMAT)
    rank = _int(_get(d, "rank", at), at / "rank", 0, 1 << 24)
    data_end = FileRef("", 0, index_offset, 0)
    entries = []
    for i, e in enumerate(_list(_get(d, "entries", at), at / "entries")):
        entries.append(_index_entry(e, at / "entries" / i, data_end))
    _check_disjoint([(e.offset, e.nbytes, e.key) for e in entries], at, "index")
    return ShardIndex(version=version, rank=rank, entries=tuple(entries))


def _index_entry(value: Any, at: _At, data_end: FileRef) -> IndexEntry:
    e = _dict(value, at)
    key = _str(_get(e, "key", at), at / "key")
    kind = e.get("kind")
    if kind not in ("tensor", "object"):
        raise (at / "kind").bad(f"unknown entry kind {_show(kind)}")
    offset, nbytes = _region(e, at, data_end)
    if "checksums" in e:
        pieces = _pieces(e["checksums"], nbytes, at / "checksums")
    else:
        crc = _int(_get(e, "crc32", at), at / "crc32", 0, _U32)
        if nbytes == 0 and crc != 0:
            raise (at / "crc32").bad(f"an empty region has CRC 0, found {crc}")
        pieces = ((nbytes, crc),) if nbytes else ()
    dtype = shape = None
    if "dtype" in e or "shape" in e:
        dtype = _dtype(_get(e, "dtype", at), at / "dtype")
        shape = _dims(_get(e, "shape", at), at / "shape")
        _check_tensor_bytes(dtype, shape, nbytes, at)
    return IndexEntry(key=key, kind=kind, offset=offset, nbytes=nbytes, checksums=pieces,
                      dtype=dtype, shape=shape)


# ---------------------------------------------------------------- rank reports

def parse_rank_report(obj: Any, where: str) -> RankReport:
    """Validate the report of a rank that wrote its shard file (a report with ``"error"`` is a
    failure and is not parsed here)."""
    at = _At(where)
    d = _dict(obj, at)
    rank = _int(_get(d, "rank", at), at / "rank", 0, 1 << 24)
    f = _report_file(_get(d, "file", at), at / "file", rank)
    entries = tuple(_report_entry(e, at / "entries" / i, f)
                    for i, e in enumerate(_list(_get(d, "entries", at), at / "entries")))
    _check_disjoint([(e.offset, e.nbytes, e.key) for e in entries if e.written], at, "report")
    refs: dict[int, set[str]] = {}
    tree = check_tree(_get(d, "tree", at), at / "tree", [e.kind for e in entries], refs)
    check_entry_keys([e.key for e in entries], refs, at / "entries")
    return RankReport(rank=rank, file=f, entries=entries, tree=tree)


def _report_file(value: Any, at: _At, rank: int) -> FileRef:
    f = _dict(value, at)
    name = _str(_get(f, "name", at), at / "name")
    if name != fmt.shard_file_name(rank):
        raise (at / "name").bad(f"rank {rank} reports the file {name!r}, expected "
                                f"{fmt.shard_file_name(rank)!r}")
    return FileRef(name=name, rank=rank,
                   nbytes=_int(_get(f, "nbytes", at), at / "nbytes", fmt.HEADER_BYTES, _U64),
                   index_crc32=_int(_get(f, "index_crc32", at), at / "index_crc32", 0, _U32))


def _report_entry(value: Any, at: _At, f: FileRef) -> ReportEntry:
    e = _dict(value, at)
    key = _field_str(e, "key", at)
    kind = e.get("kind")
    if kind == "object":
        offset, nbytes = _region(e, at, f)
        return ReportEntry(key=key, kind=kind, written=True, offset=offset, nbytes=nbytes,
                           crc32=_field_int(e, "crc32", at, 0, _U32))
    if kind != "tensor":
        raise (at / "kind").bad(f"unknown entry kind {_show(kind)}")
    dtype = _dtype(_get(e, "dtype", at), at / "dtype")
    shape = _field_dims(e, "shape", at)
    global_shape = global_offset = None
    if e.get("global_shape") is not None:
        global_shape = _dims(e["global_shape"], at / "global_shape")
        global_offset = _dims(_get(e, "global_offset", at), at / "global_offset")
        if not len(global_shape) == len(global_offset) == len(shape) or any(
                o + n > g for o, n, g in zip(global_offset, shape, global_shape)):
            raise at.bad(f"box {list(global_offset)}+{list(shape)} does not fit the global "
                         f"shape {list(global_shape)}")
    replicated, written = e.get("replicated", False), e.get("written", True)
    if type(replicated) is not bool or type(written) is not bool:
        _bool(replicated, at / "replicated")
        _bool(written, at / "written")
    if not written:
        return ReportEntry(key=key, kind=kind, written=False, dtype=dtype, shape=shape,
                           global_shape=global_shape, global_offset=global_offset,
                           replicated=replicated)
    offset, nbytes = _region(e, at, f)
    _check_tensor_bytes(dtype, shape, nbytes, at)
    return ReportEntry(key=key, kind=kind, written=True, offset=offset, nbytes=nbytes,
                       dtype=dtype, shape=shape,
                       checksums=_pieces(_get(e, "checksums", at), nbytes, at / "checksums"),
                       global_shape=global_shape, global_offset=global_offset,
                       replicated=replicated)

"""The validating parsers of the records (``records.py``): every byte that comes from another
process (a rank report, a verdict through the coordination store) or from disk (a manifest, a
shard file's index) is checked here, once, before anyone uses a value.

Each ``parse_*`` validates *everything* -- types (a bool is not an int), ranges, offsets inside the
file and non-overlapping, shapes against byte counts (Python ints, capped by the file size),
checksum pieces, tree node types and indices, file names -- before any caller allocates, seeks or
indexes with a value. Every violation raises ``CorruptCheckpointError`` (``UnsupportedFormatError``
for a newer version) naming the file and the JSON path of the bad field; nothing else escapes.

Pure: no I/O (``files.py`` reads the bytes and checks their checksums). The generic field and
state-tree checks are in ``checks.py``.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Callable, Collection, Mapping, NamedTuple

from ..errors import CorruptCheckpointError
from . import codec as fmt
from . import plain, sharing
from .checks import (
    MAX_METADATA_DEPTH,
    MAX_TREE_DEPTH,
    _U32,
    _U64,
    _At,
    _bool,
    _check_disjoint,
    _check_tensor_bytes,
    _dict,
    _dims,
    _dtype,
    _field_dims,
    _field_int,
    _field_str,
    _finite,
    _get,
    _int,
    _list,
    _nested,
    _numel,
    _pieces,
    _show,
    _str,
    _version,
    check_entry_keys,
    check_tree_refs,
)
from .tiling import check_tiling
from .records import (
    ABORT_KINDS,
    PENDING,
    PUBLISHING,
    CheckpointInfo,
    Entry,
    FileRef,
    IndexEntry,
    Manifest,
    ObjectEntry,
    PartRef,
    RankReport,
    RankTree,
    ReportEntry,
    SaveRef,
    ShardIndex,
    ShardRef,
    TensorEntry,
    Verdict,
    regions_by_file,
    spans_by_file,
)

# ---------------------------------------------------------------- manifest

_DATA_DIR = re.compile(r"\.data\.[A-Za-z0-9._@-]+")


def parse_manifest(
    obj: Any, where: str, *, version_1: bool = False, checked: bool = False
) -> Manifest:
    """Validate a decoded ``manifest.json`` completely and return the typed manifest.

    ``version_1`` says the file had no checksum trailer (only then is version 1 accepted).
    ``checked``: the decoder of ``obj`` already made the ordinary tensor entries records, with
    :func:`entry_converter` (every other entry, and every other field, is checked here)."""
    at = _At(where)
    m = _dict(obj, at)
    head = _head(m, at, version_1)
    entries = _entries(
        _list(_get(m, "entries", at), at / "entries"),
        at / "entries",
        head.files,
        head.world,
        checked,
    )
    return _manifest(m, at, head, entries)


def parse_summary(obj: Any, where: str) -> "tuple[_Head, dict]":
    """The fields of a sealed manifest that describe its checkpoint (``obj``: those before its
    ``entries``), validated exactly as :func:`parse_manifest` validates them: (the head, the
    metrics). What a listing trusts of a manifest it did not parse whole."""
    at = _At(where)
    m = _dict(obj, at)
    return _head(m, at, False), _metrics(m.get("metrics", {}), at / "metrics")


def entry_converter(fields: dict) -> Callable[[Any], TensorEntry | None] | None:
    """For a decoder that reaches a manifest's ``entries`` after its ``world_size`` and
    ``files`` (``fields``: what it decoded so far): the converter making each ordinary tensor
    entry its record at once (``plain.tensor_entry``, None for any other entry, left to
    :func:`parse_manifest`). None when those fields are missing or do not validate: the
    entries are then decoded as they are, and parsed after every field before them."""
    at = _At("")
    try:
        world = _int(_get(fields, "world_size", at), at, 1, 1 << 24)
        files = _files(_get(fields, "files", at), at, world)
    except CorruptCheckpointError:
        return None
    return lambda value: plain.tensor_entry(value, files, world)


def check_written_manifest(
    obj: dict, entries: Mapping[int, Entry], where: str, encode: Callable[[list[bytes]], None]
) -> Manifest:
    """The writer's check of the manifest it is about to write: :func:`parse_manifest` of the
    manifest whose JSON form is ``obj`` (every field but ``entries``, which it holds empty) with
    the entries ``entries`` (``Manifest.entries`` of a whole manifest: indexes 0, 1, ... in
    order), and every check it makes.

    Each entry must read back from its JSON form as the record it came from
    (CorruptCheckpointError naming it otherwise): an ordinary tensor entry is checked on its
    record and encoded at once (``plain.tensor_entry_json``, the checks of
    ``plain.tensor_entry`` on its fields); any other is turned into its JSON form, checked by
    the parser and compared. The entries are encoded a batch at a time, each batch handed to
    ``encode`` as the list of its items' bytes.
    So no JSON form of every entry is ever held at once: a manifest of a million tensors stays a
    million records, not seven million dicts and lists for the garbage collector to walk. The
    manifest returned holds ``entries`` themselves."""
    at = _At(where)
    m = _dict(obj, at)
    head = _head(m, at, False)
    at_entries = at / "entries"
    files, world = head.files, head.world
    items: list[bytes] = []
    for i, (index, e) in enumerate(entries.items()):
        if index != i:
            raise (at_entries / i).bad(f"entry {i} is missing (the next one held is {index})")
        data = plain.tensor_entry_json(e, files, world)
        items.append(data if data is not None else _written_entry(e, at_entries / i, head))
        if len(items) == _BATCH:
            encode(items)
            items = []
    if items:
        encode(items)
    return _manifest(m, at, head, entries)


def _written_entry(e: Entry, at: _At, head: "_Head") -> bytes:
    """The encoded JSON form of the entry record ``e``, once the parser reads it back as ``e``."""
    value = e.to_json()
    parsed: Entry | None = plain.tensor_entry(value, head.files, head.world)
    if parsed is None:
        parsed = _entry(value, at, head.files, head.world)
    if parsed != e:
        raise at.bad(f"the entry {e!r} reads back as {parsed!r}")
    return fmt.encode_json(value)


_BATCH = fmt.ENCODE_BATCH


class _Head(NamedTuple):
    """The fields of a manifest checked before its entries (which need ``files``)."""

    version: int
    name: str
    step: int | None
    seq: int
    created: float
    world: int
    metadata: dict
    files: tuple


def _head(m: dict, at: _At, version_1: bool) -> _Head:
    version = _version(m, at, fmt.CHECKPOINT_FORMAT, fmt.SPLIT_VERSION)
    if (version == 1) != version_1:
        raise (at / "version").bad(
            f"version {version} {'requires' if version > 1 else 'must not have'} the checksum "
            "trailer ('manifest_crc32')"
        )
    name = _str(_get(m, "name", at), at / "name")
    try:
        fmt.check_name(name)
    except ValueError as exc:
        raise (at / "name").bad(str(exc)) from None
    step = _step(m.get("step"), at / "step")
    seq = 0 if version == 1 else _int(_get(m, "seq", at), at / "seq", 1, (1 << 63) - 1)
    created = m.get("created_unix", 0.0)
    if type(created) not in (int, float) or not math.isfinite(created) or created < 0:
        raise (at / "created_unix").bad(f"expected a finite time, found {_show(created)}")
    world = _int(_get(m, "world_size", at), at / "world_size", 1, 1 << 24)
    metadata = _metadata(m.get("metadata", {}), at / "metadata")
    files = _files(_get(m, "files", at), at / "files", world)
    return _Head(version, name, step, seq, float(created), world, metadata, files)


def _manifest(m: dict, at: _At, head: _Head, entries: Mapping[int, Entry]) -> Manifest:
    """The manifest of ``head`` and its checked ``entries``, once the checks across entries
    (disjoint regions, the trees' references) and the remaining fields pass."""
    _check_regions(entries.values(), head.files, at)
    refs: dict = {}
    ranks = _ranks(
        _get(m, "ranks", at),
        at / "ranks",
        head.world,
        [e.kind for e in entries.values()],
        refs,
        head.version >= 3,
    )
    check_entry_keys([e.key for e in entries.values()], refs, at / "entries")
    return _record(m, at, head, entries, ranks)


def _check_regions(entries: Collection[Entry], files: tuple[FileRef, ...], at: _At) -> None:
    """No two of ``entries`` (a sequence of records) overlap in a file (names the overlap)."""
    for file_id, spans in enumerate(spans_by_file(entries, len(files))):
        if not plain.sorted_disjoint(spans):
            regions = regions_by_file(entries, len(files))[file_id]
            _check_disjoint(
                [(o, n, e.key) for o, n, e, _ in regions],
                at / "files" / file_id,
                f"file {files[file_id].name}",
            )


def _record(
    m: dict,
    at: _At,
    head: _Head,
    entries: Mapping[int, Entry],
    ranks: tuple[RankTree, ...],
    view: int | None = None,
) -> Manifest:
    """The manifest record of checked ``head``, ``entries`` and ``ranks``, once the remaining
    fields of ``m`` validate."""
    save_id = m.get("save_id")
    if save_id is not None:
        save_id = _str(save_id, at / "save_id")
    return Manifest(
        version=head.version,
        name=head.name,
        step=head.step,
        seq=head.seq,
        created_unix=head.created,
        world_size=head.world,
        metadata=head.metadata,
        files=head.files,
        entries=entries,
        ranks=ranks,
        save_id=save_id,
        data_dir=data_dir(m, where=at.file),
        metrics=_metrics(m.get("metrics", {}), at / "metrics"),
        view=view,
    )


# ---------------------------------------------------------------- one rank's view


class _AnyKind:
    """Equal to either kind of entry: the kind of an entry a view has not decoded yet."""

    def __eq__(self, other: object) -> bool:
        return True

    def __ne__(self, other: object) -> bool:
        return False

    __hash__ = None  # type: ignore[assignment]


_ANY_KIND = _AnyKind()


class _Kinds:
    """The kinds of a manifest's ``count`` entries as :func:`check_tree_refs` reads them (a
    sequence), of which a view knows those in ``known`` (index -> kind); any other is
    :class:`_AnyKind`."""

    def __init__(self, count: int, known: dict[int, str]):
        self.count, self.known = count, known

    def __len__(self) -> int:
        return self.count

    def __getitem__(self, e: int):
        return self.known.get(e, _ANY_KIND)


def view_tree(
    where: str, rank: int, item: Any, base_item: Any, entry_count: int
) -> tuple[dict, dict]:
    """The first half of :func:`parse_view`: (rank ``rank``'s tree, the entries it refers to as
    ``check_tree_refs`` collects them), its ``same`` nodes resolved against rank 0's tree (a
    split manifest is version 4: its trees share), from their ``ranks`` items ``item`` and
    ``base_item`` (the same for rank 0), checked as :func:`parse_manifest` checks a tree whose
    entries' kinds are not known yet (every index below ``entry_count``). Rank 0's tree is
    checked where ``rank``'s takes its nodes only."""
    at = _At(where) / "ranks"

    def tree_of(value: Any, r: int) -> Any:
        value = _dict(value, at / r)
        _int(_get(value, "rank", at / r), at / r / "rank", r, r)
        return _get(value, "tree", at / r)

    node = tree_of(item, rank)
    if rank:
        node = sharing.resolve(
            node, rank, [tree_of(base_item, 0)], f"{at / rank / 'tree'}", MAX_TREE_DEPTH
        )
    refs: dict = {}
    check_tree_refs(node, at / rank / "tree", _Kinds(entry_count, {}), refs)
    return node, refs


def parse_view(
    m: dict, where: str, rank: int, node: dict, refs: dict, items: dict[int, Any], entry_count: int
) -> Manifest:
    """One rank's view of a split manifest (``Manifest.view``): the head ``m`` validated as
    :func:`parse_manifest` validates it, with the tree ``node`` of rank ``rank`` and ``refs``
    from :func:`view_tree`, and ``items`` (index -> JSON value) the entries among the
    ``entry_count`` of the manifest that the tree refers to, each validated as a whole parse
    validates it; they do not overlap, the tree's nodes have their kinds, and each is referred
    to at its own key."""
    at = _At(where)
    head = _head(m, at, False)
    entries: dict[int, Entry] = {}
    for e, value in sorted(items.items()):
        entry = plain.tensor_entry(value, head.files, head.world)
        entries[e] = (
            entry
            if entry is not None
            else _entry(value, at / "entries" / e, head.files, head.world)
        )
    _check_regions(entries.values(), head.files, at)
    check_tree_refs(
        node,
        at / "ranks" / rank / "tree",
        _Kinds(entry_count, {e: x.kind for e, x in entries.items()}),
        None,
    )
    check_entry_keys({e: x.key for e, x in entries.items()}, refs, at / "entries")
    return _record(m, at, head, entries, (RankTree(rank=rank, tree=node),), view=rank)


def data_dir(m: dict, where: str) -> str | None:
    """The manifest's optional ``data_dir`` (``.data.<run>-<serial>``: one path component)."""
    value = m.get("data_dir")
    at = _At(where) / "data_dir"
    if value is not None and (not _DATA_DIR.fullmatch(_str(value, at)) or ".." in value):
        raise at.bad(f"expected '.data.<run>-<serial>', found {_show(value)}")
    return value


_PART_FIELDS = frozenset(PartRef._fields)


def parse_parts(m: dict, where: str) -> tuple[PartRef, ...]:
    """The table of parts of a split manifest's head ``m`` (its other fields validated by
    :func:`parse_summary`): one entry per part file, in order, named ``manifest-PPPPP.json``
    after its place, its ranks and entries following on from the previous part's and the ranks
    covering ``world_size`` exactly, every size within the format's limits -- all checked before
    a part is read (CorruptCheckpointError naming the field)."""
    at = _At(where)
    head = _head(m, at, False)
    if head.version != fmt.SPLIT_VERSION or "entries" in m or "ranks" in m:
        raise (at / "version").bad(
            f"a split manifest (with 'parts') is version "
            f"{fmt.SPLIT_VERSION} and holds no 'entries' or 'ranks' "
            f"(found version {head.version}, fields {sorted(m)})"
        )
    values = _list(_get(m, "parts", at), at / "parts")
    if not 1 <= len(values) <= head.world:
        raise (at / "parts").bad(
            f"expected 1 to {head.world} parts (one or more ranks each), found {len(values)}"
        )
    out, rank, entry, total = [], 0, 0, 0
    for i, value in enumerate(values):
        pat = at / "parts" / i
        p = _dict(value, pat)
        if p.keys() != _PART_FIELDS:
            raise pat.bad(f"expected the fields {sorted(_PART_FIELDS)}, found {sorted(p)}")
        name = _field_str(p, "name", pat)
        if name != fmt.part_name(i):
            raise (pat / "name").bad(f"expected {fmt.part_name(i)!r}, found {_show(name)}")
        nbytes = _field_int(p, "nbytes", pat, 2, fmt.MAX_MANIFEST_BYTES)
        total += nbytes
        if total > fmt.MAX_SPLIT_BYTES:
            raise (pat / "nbytes").bad(
                f"the parts hold more than the {fmt.MAX_SPLIT_BYTES} bytes a reader accepts"
            )
        part = PartRef(
            name=name,
            first_rank=_field_int(p, "first_rank", pat, rank, rank),
            rank_count=_field_int(p, "rank_count", pat, 1, head.world - rank),
            first_entry=_field_int(p, "first_entry", pat, entry, entry),
            entry_count=_field_int(p, "entry_count", pat, 0, nbytes),
            nbytes=nbytes,
            crc32=_field_int(p, "crc32", pat, 0, _U32),
        )
        rank, entry = rank + part.rank_count, entry + part.entry_count
        out.append(part)
    if rank != head.world:
        raise (at / "parts").bad(
            f"the parts hold the trees of {rank} ranks, the checkpoint has {head.world}"
        )
    return tuple(out)


_PART_OBJECT = frozenset(("format", "version", "entries", "ranks"))


def parse_part(obj: Any, where: str, part: PartRef, trees_only: bool = False) -> tuple[list, list]:
    """(entries, trees) of the decoded part ``part`` of a split manifest: the object
    ``{"format": "datastates-manifest-part", "version": 4, "ranks": [...], "entries": [...]}``
    (in any order) holding as many entries and trees as the head says. The entries and trees
    themselves are validated with the whole manifest (:func:`parse_manifest`), or a rank's
    view (:func:`parse_view`). ``trees_only``: ``obj`` holds the fields before ``entries``
    only (none are returned)."""
    at = _At(where)
    p = _dict(obj, at)
    expected = _PART_OBJECT - {"entries"} if trees_only else _PART_OBJECT
    if p.keys() != expected:
        raise at.bad(f"expected the fields {sorted(expected)}, found {sorted(p)}")
    if p["format"] != fmt.PART_FORMAT:
        raise (at / "format").bad(f"expected {fmt.PART_FORMAT!r}, found {_show(p['format'])}")
    # the head's version rules: a part of another version is damage, not a newer format
    _int(p["version"], at / "version", fmt.SPLIT_VERSION, fmt.SPLIT_VERSION)
    ranks = _list(p["ranks"], at / "ranks")
    entries = [] if trees_only else _list(p["entries"], at / "entries")
    if len(ranks) != part.rank_count or (not trees_only and len(entries) != part.entry_count):
        found = (
            f"{len(ranks)} trees"
            if trees_only
            else f"{len(entries)} entries and {len(ranks)} trees"
        )
        raise at.bad(
            f"{found}, the manifest's table of parts says {part.entry_count} entries "
            f"and {part.rank_count} trees"
        )
    return entries, ranks


def _metrics(value: Any, at: _At) -> dict:
    """The optional ``metrics`` object: string names, each a finite int or float (not a bool)."""
    metrics = _dict(value, at)
    for key, number in metrics.items():
        if type(key) is not str:
            raise at.bad(f"expected metric names that are strings, found {_show(key)}")
        _finite(number, at / key)
    return metrics


def _metadata(value: Any, at: _At) -> dict:
    """The user's ``metadata``: an object nested at most MAX_METADATA_DEPTH levels (itself the
    first; what ``save()`` accepts), every number in it finite as in ``metrics``."""
    return _nested(_dict(value, at), at, MAX_METADATA_DEPTH)


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
        raise (at / "name").bad(
            f"expected the file name {fmt.shard_file_name(r)!r}, found {name!r}"
        )
    return _file(f, at, name, r)


def _file(f: dict, at: _At, name: str, rank: int) -> FileRef:
    """The size and index CRC of a shard file whose name and rank are checked."""
    return FileRef(
        name=name,
        rank=rank,
        nbytes=_int(_get(f, "nbytes", at), at / "nbytes", fmt.HEADER_BYTES, _U64),
        index_crc32=_int(_get(f, "index_crc32", at), at / "index_crc32", 0, _U32),
    )


def _step(value: Any, at: _At) -> int | None:
    """A checkpoint's step: None or an int in [0, 2**63 - 1]."""
    return None if value is None else _int(value, at, 0, (1 << 63) - 1)


def _entries(
    values: list, at: _At, files: tuple[FileRef, ...], world: int, checked: bool = False
) -> dict[int, Entry]:
    """The manifest's entries: each ordinary tensor entry through ``plain.tensor_entry``, any
    other (an object, anything unusual or wrong) through :func:`_entry`; with ``checked``, a
    record among ``values`` is one :func:`entry_converter` made (JSON decodes to no record)."""
    out: dict[int, Entry] = {}
    for i, e in enumerate(values):
        if checked and type(e) is TensorEntry:
            out[i] = e
            continue
        entry = plain.tensor_entry(e, files, world)
        out[i] = entry if entry is not None else _entry(e, at / i, files, world)
    return out


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
    shards = tuple(
        _shard(s, at / "shards" / i, files, dtype, shape)
        for i, s in enumerate(_list(_get(e, "shards", at), at / "shards"))
    )
    if not shards:
        raise (at / "shards").bad(f"tensor {key!r} has no stored shard")
    stored = sum(s.nbytes for s in shards)
    _check_tensor_size(dtype, shape, stored, at)
    check_tiling(key, shape, shards, at)
    replicated = e.get("replicated", False)
    if type(replicated) is not bool:
        _bool(replicated, at / "replicated")
    rank = e.get("rank")
    if rank is not None:
        rank = _field_int(e, "rank", at, 0, world - 1)
    return TensorEntry(
        key=key, dtype=dtype, shape=shape, shards=shards, replicated=replicated, rank=rank
    )


def _check_tensor_size(dtype: str, shape: tuple[int, ...], stored: int, at: _At) -> None:
    """The global tensor is no bigger than its stored shards (allocation is bounded by data)."""
    itemsize = fmt.dtype_from_name(dtype, "").itemsize
    if _numel(shape, stored // itemsize) is None:
        raise (at / "shape").bad(
            f"global shape {list(shape)} of {dtype} is larger than its {stored} stored bytes"
        )


def _region(e: dict, at: _At, f: FileRef) -> tuple[int, int]:
    offset = _field_int(e, "offset", at, fmt.HEADER_BYTES, f.nbytes)
    if offset % fmt.DATA_ALIGN:
        raise (at / "offset").bad(f"expected a multiple of {fmt.DATA_ALIGN}, found {offset}")
    nbytes = _field_int(e, "nbytes", at, 0, f.nbytes - offset)
    return offset, nbytes


def _shard(
    value: Any, at: _At, files: tuple[FileRef, ...], dtype: str, shape: tuple[int, ...]
) -> ShardRef:
    s = _dict(value, at)
    file_id = _field_int(s, "file", at, 0, len(files) - 1)
    offset, nbytes = _region(s, at, files[file_id])
    box = _field_dims(s, "shape", at)
    origin = _field_dims(s, "global_offset", at)
    if len(box) != len(shape) or len(origin) != len(shape):
        raise at.bad(
            f"box {list(origin)}+{list(box)} does not have the {len(shape)} dimensions "
            f"of the tensor {list(shape)}"
        )
    for d, (o, n, g) in enumerate(zip(origin, box, shape)):
        if o + n > g:
            raise at.bad(
                f"box {list(origin)}+{list(box)} exceeds the tensor {list(shape)} in dimension {d}"
            )
    _check_tensor_bytes(dtype, box, nbytes, at)
    return ShardRef(
        file=file_id,
        offset=offset,
        nbytes=nbytes,
        global_offset=origin,
        shape=box,
        checksums=_pieces(_get(s, "checksums", at), nbytes, at / "checksums"),
    )


def _ranks(
    value: Any, at: _At, world: int, kinds: list[str], refs: dict, shared: bool
) -> tuple[RankTree, ...]:
    """The per-rank trees; with ``shared`` (version 3), a rank's ``same`` nodes are rank 0's
    nodes at the same path, put back before the tree is validated (format/sharing.py)."""
    ranks = _list(value, at)
    if len(ranks) != world:
        raise at.bad(f"expected one tree per rank ({world}), found {len(ranks)}")
    out: list[RankTree] = []
    for i, r in enumerate(ranks):
        r = _dict(r, at / i)
        _int(_get(r, "rank", at / i), at / i / "rank", i, i)
        tree = _get(r, "tree", at / i)
        if shared and i:
            tree = sharing.resolve(tree, i, [out[0].tree], f"{at / i / 'tree'}", MAX_TREE_DEPTH)
        out.append(RankTree(rank=i, tree=check_tree_refs(tree, at / i / "tree", kinds, refs)))
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
    return IndexEntry(
        key=key, kind=kind, offset=offset, nbytes=nbytes, checksums=pieces, dtype=dtype, shape=shape
    )


# ---------------------------------------------------------------- rank reports


def decode_rank_report(raw: bytes) -> tuple[Any, bool]:
    """The decoded JSON of a rank report as another rank sent it, and whether its ordinary
    tensor entries were checked and made records as they were decoded (what
    ``parse_rank_report(checked=True)`` takes): ``codec.parse_json_streamed`` with
    :func:`report_entry_converter`, so that an entry's dicts and lists live only until it is
    converted. Anything unusual (not an object, its entries before its ``rank`` and ``file``,
    invalid JSON) is decoded by ``json.loads`` as it is, unchecked, for the parser to judge
    (invalid JSON raises its ValueError)."""
    obj = fmt.parse_json_streamed(raw, "entries", report_entry_converter)
    if obj is not None:
        return obj, True
    return json.loads(raw), False


def report_entry_converter(fields: dict) -> Callable[[Any], ReportEntry | None] | None:
    """For a decoder that reaches a report's ``entries`` after its ``rank`` and ``file``
    (``fields``: what it decoded so far): the converter making each ordinary tensor entry its
    record at once (``plain.report_entry``, None for any other entry, left to
    :func:`parse_rank_report`). None when those fields are missing or do not validate."""
    at = _At("")
    try:
        rank = _int(_get(fields, "rank", at), at, 0, 1 << 24)
        f = _report_file(_get(fields, "file", at), at, rank)
    except CorruptCheckpointError:
        return None
    return lambda value: plain.report_entry(value, f)


def parse_rank_report(obj: Any, where: str, *, checked: bool = False) -> RankReport:
    """Validate the report of another rank: its save, its directory, and either its failure or
    its shard file, entries (disjoint regions inside the file), tree and replica digests.
    ``checked``: the decoder of ``obj`` already made the ordinary tensor entries records, with
    :func:`report_entry_converter` (:func:`decode_rank_report`; every other entry, and every
    other field, is checked here)."""
    at = _At(where)
    d = _dict(obj, at)
    rank = _int(_get(d, "rank", at), at / "rank", 0, 1 << 24)
    save = _save_ref(_get(d, "save", at), at / "save")
    root = _str(_get(d, "root", at), at / "root")
    expired = _bool(d.get("expired", False), at / "expired")
    if "error" in d:
        return RankReport(
            rank=rank, save=save, root=root, error=_str(d["error"], at / "error"), expired=expired
        )
    f = _report_file(_get(d, "file", at), at / "file", rank)
    entries_at = at / "entries"
    entries = tuple(
        e
        if checked and type(e) is ReportEntry
        else plain.report_entry(e, f) or _report_entry(e, entries_at / i, f)
        for i, e in enumerate(_list(_get(d, "entries", at), entries_at))
    )
    _check_disjoint(
        [
            (e.offset, e.nbytes, e.key)
            for e in entries  # a written one has both
            if e.written and e.offset is not None and e.nbytes is not None
        ],
        at,
        "report",
    )
    refs: dict = {}
    tree = check_tree_refs(_get(d, "tree", at), at / "tree", [e.kind for e in entries], refs)
    check_entry_keys([e.key for e in entries], refs, at / "entries")
    replicas = _dict(d.get("replicas", {}), at / "replicas")
    for key, digest in replicas.items():
        _str(digest, at / "replicas" / key)
    return RankReport(
        rank=rank,
        save=save,
        root=root,
        file=f,
        entries=entries,
        tree=tree,
        replicas=replicas,
        expired=expired,
    )


def _save_ref(value: Any, at: _At) -> SaveRef:
    s = _dict(value, at)
    step = _step(s.get("step"), at / "step")
    return SaveRef(
        name=_str(_get(s, "name", at), at / "name"),
        step=step,
        nonce=_str(_get(s, "nonce", at), at / "nonce"),
        overwrite=_bool(s.get("overwrite", False), at / "overwrite"),
    )


def _report_file(value: Any, at: _At, rank: int) -> FileRef:
    f = _dict(value, at)
    name = _str(_get(f, "name", at), at / "name")
    if name != fmt.shard_file_name(rank):
        raise (at / "name").bad(
            f"rank {rank} reports the file {name!r}, expected {fmt.shard_file_name(rank)!r}"
        )
    return _file(f, at, name, rank)


def _report_entry(value: Any, at: _At, f: FileRef) -> ReportEntry:
    e = _dict(value, at)
    key = _field_str(e, "key", at)
    kind = e.get("kind")
    if kind == "object":
        offset, nbytes = _region(e, at, f)
        crc = _field_int(e, "crc32", at, 0, _U32)
        if nbytes == 0 and crc != 0:
            raise (at / "crc32").bad(f"an empty region has CRC 0, found {crc}")
        return ReportEntry(
            key=key, kind=kind, written=True, offset=offset, nbytes=nbytes, crc32=crc
        )
    if kind != "tensor":
        raise (at / "kind").bad(f"unknown entry kind {_show(kind)}")
    dtype = _dtype(_get(e, "dtype", at), at / "dtype")
    shape = _field_dims(e, "shape", at)
    global_shape = global_offset = None
    if e.get("global_shape") is not None:
        global_shape = _dims(e["global_shape"], at / "global_shape")
        global_offset = _dims(_get(e, "global_offset", at), at / "global_offset")
        if not len(global_shape) == len(global_offset) == len(shape) or any(
            o + n > g for o, n, g in zip(global_offset, shape, global_shape)
        ):
            raise at.bad(
                f"box {list(global_offset)}+{list(shape)} does not fit the global "
                f"shape {list(global_shape)}"
            )
    replicated, written = e.get("replicated", False), e.get("written", True)
    if type(replicated) is not bool or type(written) is not bool:
        _bool(replicated, at / "replicated")
        _bool(written, at / "written")
    if not written:
        if not replicated and global_shape is None:
            raise (at / "written").bad(
                f"tensor {key!r} is neither replicated nor a shard of a "
                "global tensor, so this rank must write it"
            )
        return ReportEntry(
            key=key,
            kind=kind,
            written=False,
            dtype=dtype,
            shape=shape,
            global_shape=global_shape,
            global_offset=global_offset,
            replicated=replicated,
        )
    offset, nbytes = _region(e, at, f)
    _check_tensor_bytes(dtype, shape, nbytes, at)
    return ReportEntry(
        key=key,
        kind=kind,
        written=True,
        offset=offset,
        nbytes=nbytes,
        dtype=dtype,
        shape=shape,
        checksums=_pieces(_get(e, "checksums", at), nbytes, at / "checksums"),
        global_shape=global_shape,
        global_offset=global_offset,
        replicated=replicated,
    )


# ---------------------------------------------------------------- verdicts


def parse_verdict(obj: Any, where: str) -> Verdict:
    """Validate a verdict read from the coordination store (written by another rank)."""
    at = _At(where)
    d = _dict(obj, at)
    if d.get("pending") is True:
        return PUBLISHING if d.get("publishing") is True else PENDING
    if _bool(_get(d, "ok", at), at / "ok"):
        info = d.get("info")
        return Verdict.committed(None if info is None else _info(info, at / "info"))
    kind = _str(_get(d, "kind", at), at / "kind")
    if kind not in ABORT_KINDS:
        raise (at / "kind").bad(f"expected one of {list(ABORT_KINDS)}, found {_show(kind)}")
    causes = {}
    for r, cause in _dict(_get(d, "causes", at), at / "causes").items():
        if not r.isdigit():
            raise (at / "causes").bad(f"expected rank numbers as keys, found {_show(r)}")
        causes[int(r)] = _str(cause, at / "causes" / r)
    return Verdict.abort(kind, _str(_get(d, "message", at), at / "message"), causes)


def _info(value: Any, at: _At) -> CheckpointInfo:
    d = _dict(value, at)
    step = _step(d.get("step"), at / "step")
    created = d.get("created_unix")
    if (
        not (type(created) is int or type(created) is float)
        or not math.isfinite(created)
        or created < 0
    ):
        raise (at / "created_unix").bad(f"expected a finite time, found {_show(created)}")
    return CheckpointInfo(
        name=_str(_get(d, "name", at), at / "name"),
        path=_str(_get(d, "path", at), at / "path"),
        step=step,
        created_unix=float(created),
        world_size=_int(_get(d, "world_size", at), at / "world_size", 1, 1 << 24),
        nbytes=_int(_get(d, "nbytes", at), at / "nbytes", 0, _U64),
        metadata=_metadata(d.get("metadata", {}), at / "metadata"),
        seq=_int(_get(d, "seq", at), at / "seq", 0, (1 << 63) - 1),
        metrics=_metrics(d.get("metrics", {}), at / "metrics"),
    )

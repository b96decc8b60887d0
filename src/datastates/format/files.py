"""Reading and writing the checked files of the format as typed records: a shard file's index,
a checkpoint's manifest (docs/format.md).

Bytes are checked first (``codec``: magic, header CRC, the manifest's checksum trailer); the
decoded JSON is then validated completely by ``records`` before anyone uses a value.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import warnings
from typing import Callable, NamedTuple

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedFormatError
from ..storage import Store, open_store
from . import codec, records, tree, validate
from .codec import (
    _TRAILER,
    CHECKPOINT_FORMAT,
    MANIFEST,
    MANIFEST_VERSION,
    MAX_MANIFEST_BYTES,
    PART_FORMAT,
    SPLIT_VERSION,
    TRAILER_BYTES,
    ShardHeader,
    crc32,
    encode_entries,
    encode_json,
    parse_json,
    parse_json_head,
    parse_json_streamed,
    part_name,
    read_header,
    seal_manifest,
)


def read_index(path: str, store: "Store | None" = None) -> "records.ShardIndex":
    """Read, checksum and validate the self-describing index of a shard file."""
    store = store or open_store(path)
    try:
        f = store.open_read(path)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: shard file missing") from None
    try:
        header = read_header(f, path, f.size)
        raw = f.pread(header.index_length, header.index_offset)
    finally:
        f.close()
    return parse_index_bytes(raw, header, path)


def parse_index_bytes(
    raw: bytes | bytearray, header: ShardHeader, path: str
) -> "records.ShardIndex":
    """Check the index bytes against the header's CRC, then validate them."""
    if len(raw) != header.index_length or crc32(raw) != header.index_crc32:
        raise CorruptCheckpointError(
            f"{path}: index checksum mismatch (index at "
            f"{header.index_offset}, {header.index_length} bytes)"
        )
    return validate.parse_shard_index(parse_json(raw, path), path, header.index_offset)


class EncodedManifest(NamedTuple):
    """What a publisher writes for a manifest record (:func:`encode_manifest_record`)."""

    data: bytes  #: the bytes of ``manifest.json``
    written: records.Manifest  #: the record a reader makes of them
    #: a split manifest's parts, (file name, bytes), to be written beside the shard files
    #: before ``manifest.json`` (none for a manifest of one file)
    parts: tuple[tuple[str, bytes], ...] = ()


def encode_manifest_record(manifest: records.Manifest, split: bool = True) -> EncodedManifest:
    """The files to write for a manifest record the review merged, and the record a reader
    makes of them. The merged manifest holds what other processes sent, combined: it is
    checked whole by the reader's own parser before it is written, so a checkpoint is committed
    only if a reader accepts it (CorruptCheckpointError naming the field otherwise). Its entries
    are checked and encoded a batch at a time (``validate.check_written_manifest``).

    A manifest whose one file would pass ``SPLIT_BYTES`` is split (version 4, with ``split``):
    ``manifest.json`` holds the head and a table of parts, each part the trees of a run of ranks
    and the entries they brought, of about ``SPLIT_BYTES`` (docs/format.md, "Split
    manifests"); the logical manifest, and the record returned, are the same."""
    if manifest.version == SPLIT_VERSION:  # a split one read back, written again
        manifest = dataclasses.replace(manifest, version=MANIFEST_VERSION)
    head = manifest.to_json(entries=False)
    items: list[bytes] = []
    written = validate.check_written_manifest(
        head, manifest.entries, "manifest being written", items.extend
    )
    if not split or sum(map(len, items)) < codec.SPLIT_BYTES:
        data = seal_manifest(encode_entries(head, b",".join(items)))
        if not split or len(data) <= codec.SPLIT_BYTES:
            return EncodedManifest(_within_limit(data), written)
    return _split(manifest, head, items, written)


def manifest_record_bytes(manifest: records.Manifest) -> tuple[bytes, records.Manifest]:
    """(the bytes of a one-file ``manifest.json``, the record a reader makes of them) for a
    manifest record, never split (:func:`encode_manifest_record`)."""
    encoded = encode_manifest_record(manifest, split=False)
    return encoded.data, encoded.written


def _split(
    manifest: records.Manifest, head: dict, items: list[bytes], written: records.Manifest
) -> EncodedManifest:
    """The split form of ``manifest`` (its JSON form ``head`` without entries, and ``items``,
    each entry's bytes): ranks in order, each part closed once it holds about ``SPLIT_BYTES``.
    A part takes the entries its ranks brought (an entry belongs to the first rank whose tree
    refers to it), so a rank's tree mostly sits beside its own entries; entries that would
    overfill it go on into the next parts (the shards of sharded tensors, which all come with
    rank 0's tree, spread over as many parts as they fill); the last part takes the rest."""
    trees = [encode_json(r) for r in head.pop("ranks")]
    head.pop("entries")
    bounds, last = [], -1
    for rank in manifest.ranks:
        last = max(last, _last_entry(rank.tree))
        bounds.append(last + 1)
    ends = [0, *itertools.accumulate(len(item) + 1 for item in items)]  # bytes before entry i
    target, refs = codec.SPLIT_BYTES, []
    parts: list[tuple[str, bytes]] = []
    first_rank = first_entry = tree_bytes = 0
    for r in range(len(trees)):
        tree_bytes += len(trees[r])
        fits = bisect.bisect_right(ends, ends[first_entry] + target - tree_bytes) - 1
        end = max(first_entry, min(bounds[r], fits))
        if r + 1 == len(trees):
            end = len(items)
        elif end == bounds[r] and tree_bytes + ends[end] - ends[first_entry] < target:
            continue  # room for the next rank
        data = _part_bytes(items[first_entry:end], trees[first_rank : r + 1])
        refs.append(
            records.PartRef(
                name=part_name(len(parts)),
                first_rank=first_rank,
                rank_count=r + 1 - first_rank,
                first_entry=first_entry,
                entry_count=end - first_entry,
                nbytes=len(data),
                crc32=crc32(data),
            ).to_json()
        )
        parts.append((refs[-1]["name"], _within_limit(data)))
        first_rank, first_entry, tree_bytes = r + 1, end, 0
    if sum(len(data) for _, data in parts) > codec.MAX_SPLIT_BYTES:
        raise CorruptCheckpointError(
            f"manifest being written: its parts hold more than the "
            f"{codec.MAX_SPLIT_BYTES} bytes a reader accepts (fewer "
            "tensors per rank, or fewer ranks per checkpoint)"
        )
    head["version"] = SPLIT_VERSION
    head["parts"] = refs
    return EncodedManifest(
        _within_limit(seal_manifest(encode_json(head))),
        dataclasses.replace(written, version=SPLIT_VERSION),
        tuple(parts),
    )


def _part_bytes(entries: list[bytes], trees: list[bytes]) -> bytes:
    """A part's bytes: its trees before its entries, so that a rank's view takes the trees of a
    part without decoding its entries (:meth:`_Parts.trees`)."""
    return (
        b'{"format":"%s","version":%d,"ranks":[' % (PART_FORMAT.encode(), SPLIT_VERSION)
        + b",".join(trees)
        + b'],"entries":['
        + b",".join(entries)
        + b"]}"
    )


def _last_entry(root: dict) -> int:
    """The highest entry a (validated) state tree references; -1 for none."""
    last, stack = -1, [root]
    while stack:
        node = stack.pop()
        t = node["t"]
        if t in tree.ENTRY_LEAVES:
            last = max(last, node["e"])
        elif t == "provider":
            stack.append(node["state"])
        elif t in tree.MAPPINGS:
            stack.extend(child for _, child in node["items"])
        elif t in tree.SEQUENCES:
            stack.extend(node["items"])
    return last


def encode_manifest(manifest: dict) -> bytes:
    """Validate ``manifest`` with the reader's own parser, then encode and seal it (so what is
    written is exactly what a reader accepts)."""
    return encode_manifest_checked(manifest)[0]


def encode_manifest_checked(manifest: dict) -> "tuple[bytes, records.Manifest]":
    """:func:`encode_manifest`, also returning the typed manifest the reader's parser made of it.

    The parser checks ``manifest`` itself, not a decoded copy of its bytes: the parser accepts
    only what JSON decodes to (exact ``list``, ``dict``, ``str``, ``int``, ``bool``, finite
    ``float``, ``None``; a tuple or an int subclass is refused), and ``metadata``, the one part
    it does not look into, was normalised through JSON by ``save()``. So the bytes decode to
    an equal manifest, while the writer saves a decode and a second copy of every container --
    objects the garbage collector would otherwise promote and traverse in a full collection,
    holding the GIL (docs/benchmarks.md, "Garbage collection")."""
    parsed = validate.parse_manifest(manifest, "manifest being written")
    return _within_limit(seal_manifest(encode_json(manifest))), parsed


def _within_limit(data: bytes) -> bytes:
    """``data``, a manifest about to be written, unless a reader would refuse it for its size
    (then CorruptCheckpointError: such a manifest is never committed)."""
    if len(data) > MAX_MANIFEST_BYTES:
        raise CorruptCheckpointError(
            f"manifest being written: {len(data)} bytes, more than the "
            f"{MAX_MANIFEST_BYTES} a reader accepts (fewer tensors per "
            "rank, or fewer ranks per checkpoint)"
        )
    return data


#: Reads one part of a split manifest: (its path relative to the checkpoint directory, the
#: exact size the head records, which bounds the read) -> its bytes.
PartReader = Callable[[str, int], bytes]


#: Of a reader restoring one rank's state: given the world size a split manifest was saved at,
#: the saved rank whose state it restores, or None when it needs every saved rank's tree. A split
#: manifest of more than one rank is then read as that rank's view (:func:`_view`).
View = Callable[[int], "int | None"]


def read_manifest(
    ckpt_dir: str, store: "Store | None" = None, view: View | None = None
) -> "records.Manifest":
    """Read, checksum and validate ``manifest.json`` of a checkpoint directory (and the parts
    of a split one; ``view``: see :data:`View`): regular files of at most
    ``MAX_MANIFEST_BYTES`` each in it (CorruptCheckpointError naming the path otherwise: a
    link, a FIFO, a device, a directory, a missing part)."""
    store = store or open_store(ckpt_dir)
    path, raw = _read_manifest_file(ckpt_dir, store)
    return parse_manifest_bytes(
        raw, path, part_reader(ckpt_dir, store, refused_is_damage=True), view
    )


def read_info(ckpt_dir: str, store: "Store | None" = None) -> "records.CheckpointInfo":
    """The description of a checkpoint from its manifest's head, read and checked as by
    :func:`read_manifest` (the checksum, the head and, of a split manifest, its table; no part
    is read): what finding a checkpoint by name needs before a reader reads it (the whole
    manifest, or a rank's view). A manifest without such a head is parsed whole."""
    store = store or open_store(ckpt_dir)
    path, raw = _read_manifest_file(ckpt_dir, store)
    info = parse_manifest_summary(raw, path, ckpt_dir)
    if info is not None:
        return info
    return records.info_of(
        ckpt_dir,
        parse_manifest_bytes(raw, path, part_reader(ckpt_dir, store, refused_is_damage=True)),
    )


def _read_manifest_file(ckpt_dir: str, store: Store) -> tuple[str, bytes]:
    """(path, bytes) of the ``manifest.json`` of ``ckpt_dir``: CheckpointNotFoundError if it
    has none, CorruptCheckpointError if it cannot be read as a file."""
    path = store.join(ckpt_dir, MANIFEST)
    try:
        return path, store.read_bytes(path, max_bytes=MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"{ckpt_dir}: no {MANIFEST} (not a committed checkpoint)"
        ) from None
    except (IsADirectoryError, NotADirectoryError, PermissionError) as exc:
        raise CorruptCheckpointError(f"{path}: cannot read ({exc})") from None


def part_reader(ckpt_dir: str, store: Store, refused_is_damage: bool = False) -> PartReader:
    """The :data:`PartReader` of the checkpoint directory ``ckpt_dir``: a part that is missing,
    or a directory, makes the manifest damaged (CorruptCheckpointError naming it); a read the
    storage refused (EACCES) too with ``refused_is_damage``, else it is raised as it is (it
    says nothing of the checkpoint)."""
    damage = (FileNotFoundError, IsADirectoryError, NotADirectoryError) + (
        (PermissionError,) if refused_is_damage else ()
    )

    def read(name: str, nbytes: int) -> bytes:
        path = store.join(ckpt_dir, *name.split("/"))
        try:
            return store.read_bytes(path, max_bytes=nbytes)
        except damage as exc:
            raise CorruptCheckpointError(
                f"{path}: cannot read this part of the manifest ({exc})"
            ) from None

    return read


def _check_seal(raw: bytes, path: str) -> bool:
    """Whether a manifest's bytes end with the checksum trailer; CorruptCheckpointError if they
    do and the CRC-32 of what it covers differs."""
    sealed = _TRAILER.search(raw)
    if sealed is None:
        return False
    covered = raw[: sealed.start()]
    if crc32(covered) != int(sealed.group(1), 16):
        raise CorruptCheckpointError(
            f"{path}: manifest checksum mismatch (CRC-32 of the "
            f"first {len(covered)} bytes is {crc32(covered):08x}, "
            f"the trailer says {sealed.group(1).decode()})"
        )
    return True


#: The fields of a manifest that describe its checkpoint: a listing takes them from the head
#: only when every one of them is there (a field left out would be taken for its default).
HEAD_FIELDS = frozenset(
    (
        "format",
        "version",
        "name",
        "step",
        "created_unix",
        "world_size",
        "seq",
        "metrics",
        "metadata",
        "files",
    )
)


def manifest_data_files(raw: bytes, path: str) -> list[str]:
    """The files a checkpoint's manifest (its bytes ``raw``) says its data is in, as paths
    relative to the checkpoint directory: its shard files and, of a split manifest, its parts
    (read from the head alone). CorruptCheckpointError if the manifest does not validate."""
    if _check_seal(raw, path):
        obj, _ = _decode_manifest(raw, path)
        if "parts" in obj:
            obj.pop("manifest_crc32", None)
            refs = validate.parse_parts(obj, path)
            data_dir = validate.data_dir(obj, path)
            names = [f["name"] for f in obj["files"]] + [ref.name for ref in refs]
            return [f"{data_dir}/{name}" if data_dir else name for name in names]
    manifest = parse_manifest_bytes(raw, path)
    return [
        f"{manifest.data_dir}/{f.name}" if manifest.data_dir else f.name for f in manifest.files
    ]


def parse_manifest_summary(raw: bytes, path: str, ckpt: str) -> "records.CheckpointInfo | None":
    """The description of the checkpoint ``ckpt`` from its manifest's bytes, without decoding
    the entries: the checksum trailer checked (CorruptCheckpointError if it fails), then the
    fields before ``entries`` validated as :func:`parse_manifest_bytes` validates them
    (docs/format.md, "The head"). None unless the head holds every field that describes the
    checkpoint (``HEAD_FIELDS``; a manifest written before the head came first, one without
    the trailer, one in another order): the caller parses it whole. Of a split manifest,
    ``manifest.json`` is all head: it is validated whole, its table of parts too, and no part
    is read."""
    if not _check_seal(raw, path):
        return None
    fields = parse_json_head(raw, "entries")
    if fields is not None and fields.get("version") == SPLIT_VERSION:
        return None  # entries in a split manifest: the whole parse refuses it
    if fields is None:
        fields = parse_json(raw, path, unique=True)
        if "parts" not in fields:
            return None
        fields.pop("manifest_crc32", None)
        validate.parse_parts(fields, path)
    if not HEAD_FIELDS <= fields.keys():
        return None
    return _info(fields, path, ckpt)


def _info(fields: dict, path: str, ckpt: str) -> "records.CheckpointInfo":
    """The description of the checkpoint ``ckpt`` from the head ``fields`` of its manifest,
    validated (``validate.parse_summary``)."""
    head, metrics = validate.parse_summary(fields, path)
    return records.CheckpointInfo(
        name=ckpt.rstrip("/").rsplit("/", 1)[-1],
        path=ckpt,
        step=head.step,
        created_unix=head.created,
        world_size=head.world,
        nbytes=sum(f.nbytes for f in head.files),
        metadata=dict(head.metadata),
        seq=head.seq,
        metrics=dict(metrics),
    )


def parse_manifest_bytes(
    raw: bytes, path: str, parts: PartReader | None = None, view: View | None = None
) -> "records.Manifest":
    """Check the checksum trailer of a manifest's bytes, then validate its JSON; the parts of a
    split manifest are read through ``parts`` (:func:`part_reader`; without it a split manifest
    is refused with CorruptCheckpointError), as ``view`` says (:data:`View`).

    A file without the trailer is accepted only as a version-1 manifest holding no
    ``manifest_crc32`` field (written before manifests carried a checksum), with a warning; any
    damage to a sealed manifest therefore fails its checksum or its version check, it never
    reaches the unchecked path."""
    return _parse_manifest_bytes(raw, path, parts, view)


def _parse_manifest_bytes(
    raw: bytes, path: str, parts: PartReader | None, view: View | None
) -> "records.Manifest":
    if _check_seal(raw, path):
        obj, checked = _decode_manifest(raw, path)
        obj.pop("manifest_crc32", None)
        if "parts" in obj or obj.get("version") == SPLIT_VERSION:
            return _assemble(obj, path, parts, view)
        return validate.parse_manifest(obj, path, checked=checked)
    obj, checked = _decode_manifest(raw, path)
    if "manifest_crc32" in obj or obj.get("version") != 1 or "seq" in obj or "parts" in obj:
        if (
            obj.get("format") == CHECKPOINT_FORMAT
            and type(obj.get("version")) is int
            and obj["version"] > SPLIT_VERSION
            and "manifest_crc32" not in obj
        ):
            raise UnsupportedFormatError(
                f"{path}: format version {obj['version']} is newer than "
                f"this reader's {SPLIT_VERSION}; upgrade datastates"
            )
        raise CorruptCheckpointError(
            f"{path}: the manifest does not end with its checksum "
            f"(expected the last {TRAILER_BYTES} bytes to be "
            '\',"manifest_crc32":"<8 hex digits>"}\')'
        )
    manifest = validate.parse_manifest(obj, path, version_1=True, checked=checked)
    warnings.warn(
        f"{path}: a version-1 manifest has no checksum; its fields are validated but "
        "a damaged value cannot be detected. Save a new checkpoint to get a checked one",
        RuntimeWarning,
        stacklevel=4,
    )
    return manifest


def _assemble(
    head: dict, path: str, read: PartReader | None, view: View | None
) -> "records.Manifest":
    """The manifest of a split one's head (docs/format.md, "Split manifests"): the table of
    parts validated before a part is read, each part read with its recorded size as the bound,
    its size and CRC-32 checked against the head before it is decoded, then the logical
    manifest (the parts' entries and trees, in order) validated as a whole; or, for a
    ``view`` of its world size, that rank's view (:func:`_view`)."""
    refs = validate.parse_parts(head, path)
    if read is None:
        raise CorruptCheckpointError(
            f"{path}: a split manifest (version {SPLIT_VERSION}) is "
            "read with its parts, from its checkpoint directory"
        )
    parts = _Parts(head, path, read, refs)
    saved = head["world_size"]
    rank = view(saved) if view is not None and saved > 1 else None
    if rank is not None:
        if not 0 <= rank < saved:
            raise ValueError(f"{path}: no view of rank {rank} of {saved}")
        return _view(head, path, parts, rank)
    convert = validate.entry_converter(head)
    entries: list = []
    ranks: list = []
    for i in range(len(refs)):
        # records among the entries come from ``convert`` only (JSON decodes to none), so a
        # part decoded without it mixes with the others: its dicts are checked by the parser
        part_entries, part_ranks = parts.decode(i, parts.read(i), convert)
        entries += part_entries
        ranks += part_ranks
    del head["parts"]
    head["entries"], head["ranks"] = entries, ranks
    return validate.parse_manifest(head, path, checked=True)


class _Parts:
    """Reading the parts of the split manifest ``path`` (its head ``head``, its table of parts
    ``refs``, validated) through ``read``."""

    def __init__(self, head: dict, path: str, read: PartReader, refs: tuple[records.PartRef, ...]):
        self.path, self.refs, self.read_bytes = path, refs, read
        self.data_dir = validate.data_dir(head, path)

    def where(self, i: int) -> str:
        return f"{self.path} part {self.name(i)}"

    def name(self, i: int) -> str:
        return f"{self.data_dir}/{self.refs[i].name}" if self.data_dir else self.refs[i].name

    def read(self, i: int) -> bytes:
        """Part ``i``'s bytes, read with its recorded size as the bound; CorruptCheckpointError
        naming it unless its size and CRC-32 are those its table records."""
        ref = self.refs[i]
        raw = self.read_bytes(self.name(i), ref.nbytes)
        if len(raw) != ref.nbytes or crc32(raw) != ref.crc32:
            raise CorruptCheckpointError(
                f"{self.where(i)}: {len(raw)} bytes with CRC-32 "
                f"{crc32(raw):08x}, the manifest records {ref.nbytes} "
                f"bytes with {ref.crc32:08x} (damaged or replaced)"
            )
        return raw

    def decode(self, i: int, raw: bytes, convert=None) -> tuple[list, list]:
        """(entries, trees) of part ``i`` from its bytes ``raw``: each entry as ``convert``
        returns it as soon as it is decoded (``validate.entry_converter`` makes ordinary tensor
        entries records; None keeps them JSON), the trees as JSON."""
        where = self.where(i)
        obj = parse_json_streamed(raw, "entries", lambda _: convert)
        if obj is None:
            obj = parse_json(raw, where, unique=True)
        return validate.parse_part(obj, where, self.refs[i])

    def trees(self, i: int, raw: bytes) -> list:
        """The trees of part ``i`` (JSON), its entries not decoded: a part written by this
        version holds its trees first (:func:`_part_bytes`); one in another order is decoded
        whole."""
        fields = parse_json_head(raw, "entries")
        if fields is None or "ranks" not in fields:
            return self.decode(i, raw, lambda _: 0)[1]
        return validate.parse_part(fields, self.where(i), self.refs[i], trees_only=True)[1]

    def entries(self, i: int, raw: bytes, keep: set[int]) -> list:
        """The entries of part ``i``: those at the places ``keep`` (from 0 in this part) as JSON,
        each other one 0 once decoded (it is never held)."""
        places = itertools.count()
        return self.decode(i, raw, lambda item: item if next(places) in keep else 0)[0]


def _view(head: dict, path: str, parts: _Parts, rank: int) -> "records.Manifest":
    """Rank ``rank``'s view of a split manifest (``Manifest.view``; docs/format.md, "A rank's
    view"): only the parts holding the trees of rank 0 and ``rank`` and the entries ``rank``'s
    tree refers to are read (each checked by its size and CRC-32); of the first, the trees are
    decoded without the entries; of the second, the entries, of which only those ``rank``'s
    tree refers to are kept and validated: a restoring rank's work grows with its own state,
    not with the number of ranks.
    (The job's listing checks every part, so that all ranks agree on the latest checkpoint:
    ``split_summary``.)"""
    refs = parts.refs
    count = refs[-1].first_entry + refs[-1].entry_count
    firsts = [ref.first_rank for ref in refs]

    def part_of(r: int) -> int:
        return bisect.bisect_right(firsts, r) - 1

    held: dict[int, bytes] = {}  # the bytes of the parts holding the two trees
    trees: dict[int, list] = {}
    for i in sorted({part_of(0), part_of(rank)}):
        held[i] = parts.read(i)
        trees[i] = parts.trees(i, held[i])
    mine, base = (trees[part_of(r)][r - refs[part_of(r)].first_rank] for r in (rank, 0))
    node, wanted = validate.view_tree(path, rank, mine, base, count)
    del trees, mine, base
    starts = [ref.first_entry for ref in refs]
    by_part: dict[int, set[int]] = {}
    for e in wanted:
        i = bisect.bisect_right(starts, e) - 1
        by_part.setdefault(i, set()).add(e - refs[i].first_entry)
    held = {i: raw for i, raw in held.items() if i in by_part}  # the others are done with
    found: dict[int, object] = {}
    for i in sorted(by_part):
        entries = parts.entries(i, held.pop(i) if i in held else parts.read(i), by_part[i])
        for place in by_part[i]:
            found[refs[i].first_entry + place] = entries[place]
    return validate.parse_view(head, path, rank, node, wanted, found, count)


def split_summary(
    raw: bytes, path: str, ckpt: str, read: PartReader
) -> "records.CheckpointInfo | None":
    """The description of the checkpoint ``ckpt`` if its sealed manifest ``raw`` is split
    (None otherwise): its head and table of parts validated, then every part read (through
    ``read``, bounded by its recorded size) and its size and CRC-32 compared with the table's,
    CorruptCheckpointError naming what fails. Nothing of a part is decoded: what the listing of
    a job that reads views checks (commit/catalog.py)."""
    if not _check_seal(raw, path) or parse_json_head(raw, "entries") is not None:
        return None
    obj, _ = _decode_manifest(raw, path)
    if "parts" not in obj:
        return None
    obj.pop("manifest_crc32", None)
    parts = _Parts(obj, path, read, validate.parse_parts(obj, path))
    for i in range(len(parts.refs)):
        parts.read(i)
    return _info(obj, path, ckpt)


def _decode_manifest(raw: bytes, path: str) -> tuple[dict, bool]:
    """The decoded JSON object of a manifest, and whether its ordinary tensor entries were
    checked and made records as they were decoded (``codec.parse_json_streamed`` with
    ``validate.entry_converter``: what ``parse_manifest(checked=True)`` takes)."""
    obj = parse_json_streamed(raw, "entries", validate.entry_converter)
    if obj is not None:
        return obj, True
    return parse_json(raw, path, unique=True), False

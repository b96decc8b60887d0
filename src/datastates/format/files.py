"""Reading and writing the checked files of the format as typed records: a shard file's index,
a checkpoint's manifest (docs/format.md).

Bytes are checked first (``codec``: magic, header CRC, the manifest's checksum trailer); the
decoded JSON is then validated completely by ``records`` before anyone uses a value.
"""
from __future__ import annotations

import warnings

from .. import collector
from ..errors import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedFormatError
from ..storage import Store, open_store
from . import records, validate
from .codec import (_TRAILER, CHECKPOINT_FORMAT, MANIFEST, MANIFEST_VERSION, MAX_MANIFEST_BYTES,
                    TRAILER_BYTES, ShardHeader, crc32, encode_entries, encode_json, parse_json,
                    parse_json_head, parse_json_streamed, read_header, seal_manifest)


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


def parse_index_bytes(raw: bytes, header: ShardHeader, path: str) -> "records.ShardIndex":
    """Check the index bytes against the header's CRC, then validate them."""
    if len(raw) != header.index_length or crc32(raw) != header.index_crc32:
        raise CorruptCheckpointError(f"{path}: index checksum mismatch (index at "
                                     f"{header.index_offset}, {header.index_length} bytes)")
    return validate.parse_shard_index(parse_json(raw, path), path, header.index_offset)


def manifest_record_bytes(manifest: records.Manifest) -> tuple[bytes, records.Manifest]:
    """The bytes of ``manifest.json`` for a manifest record the review merged, and the record a
    reader makes of them. The merged manifest holds what other processes sent, combined: it is
    checked whole by the reader's own parser before it is written, so a checkpoint is committed
    only if a reader accepts it (CorruptCheckpointError naming the field otherwise). Its entries
    are checked and encoded a batch at a time (``validate.check_written_manifest``); the
    bytes are those of encoding its whole JSON form. The garbage collector is paused meanwhile
    (``collector``), as for a parse."""
    with collector.paused():
        head = manifest.to_json(entries=False)
        batches: list[bytes] = []
        written = validate.check_written_manifest(
            head, manifest.entries, "manifest being written", batches.append)
        return _within_limit(seal_manifest(encode_entries(head, b",".join(batches)))), written


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
        raise CorruptCheckpointError(f"manifest being written: {len(data)} bytes, more than the "
                                     f"{MAX_MANIFEST_BYTES} a reader accepts (fewer tensors per "
                                     "rank, or fewer ranks per checkpoint)")
    return data


def read_manifest(ckpt_dir: str, store: "Store | None" = None) -> "records.Manifest":
    """Read, checksum and validate ``manifest.json`` of a checkpoint directory: a regular file
    of at most ``MAX_MANIFEST_BYTES`` in it (CorruptCheckpointError naming the path otherwise:
    a link, a FIFO, a device, a directory)."""
    store = store or open_store(ckpt_dir)
    path = store.join(ckpt_dir, MANIFEST)
    try:
        raw = store.read_bytes(path, max_bytes=MAX_MANIFEST_BYTES)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{ckpt_dir}: no {MANIFEST} (not a committed checkpoint)") \
            from None
    except (IsADirectoryError, NotADirectoryError, PermissionError) as exc:
        raise CorruptCheckpointError(f"{path}: cannot read ({exc})") from None
    return parse_manifest_bytes(raw, path)


def _check_seal(raw: bytes, path: str) -> bool:
    """Whether a manifest's bytes end with the checksum trailer; CorruptCheckpointError if they
    do and the CRC-32 of what it covers differs."""
    sealed = _TRAILER.search(raw)
    if sealed is None:
        return False
    covered = raw[:sealed.start()]
    if crc32(covered) != int(sealed.group(1), 16):
        raise CorruptCheckpointError(f"{path}: manifest checksum mismatch (CRC-32 of the "
                                     f"first {len(covered)} bytes is {crc32(covered):08x}, "
                                     f"the trailer says {sealed.group(1).decode()})")
    return True


#: The fields of a manifest that describe its checkpoint: a listing takes them from the head
#: only when every one of them is there (a field left out would be taken for its default).
HEAD_FIELDS = frozenset(("format", "version", "name", "step", "created_unix", "world_size",
                         "seq", "metrics", "metadata", "files"))


def parse_manifest_summary(raw: bytes, path: str, ckpt: str) -> "records.CheckpointInfo | None":
    """The description of the checkpoint ``ckpt`` from its manifest's bytes, without decoding
    the entries: the checksum trailer checked (CorruptCheckpointError if it fails), then the
    fields before ``entries`` validated as :func:`parse_manifest_bytes` validates them
    (docs/format.md, "The head"). None unless the head holds every field that describes the
    checkpoint (``HEAD_FIELDS``; a manifest written before the head came first, one without
    the trailer, one in another order): the caller parses it whole."""
    if not _check_seal(raw, path):
        return None
    fields = parse_json_head(raw, "entries")
    if fields is None or not HEAD_FIELDS <= fields.keys():
        return None
    head, metrics = validate.parse_summary(fields, path)
    return records.CheckpointInfo(
        name=ckpt.rstrip("/").rsplit("/", 1)[-1], path=ckpt, step=head.step,
        created_unix=head.created, world_size=head.world,
        nbytes=sum(f.nbytes for f in head.files), metadata=dict(head.metadata), seq=head.seq,
        metrics=dict(metrics))


def parse_manifest_bytes(raw: bytes, path: str) -> "records.Manifest":
    """Check the checksum trailer of a manifest's bytes, then validate its JSON.

    A file without the trailer is accepted only as a version-1 manifest holding no
    ``manifest_crc32`` field (written before manifests carried a checksum), with a warning; any
    damage to a sealed manifest therefore fails its checksum or its version check, it never
    reaches the unchecked path. The garbage collector is paused meanwhile (``collector``): a
    manifest at scale is millions of small records."""
    with collector.paused():
        return _parse_manifest_bytes(raw, path)


def _parse_manifest_bytes(raw: bytes, path: str) -> "records.Manifest":
    if _check_seal(raw, path):
        obj, checked = _decode_manifest(raw, path)
        obj.pop("manifest_crc32", None)
        return validate.parse_manifest(obj, path, checked=checked)
    obj, checked = _decode_manifest(raw, path)
    if "manifest_crc32" in obj or obj.get("version") != 1 or "seq" in obj:
        if obj.get("format") == CHECKPOINT_FORMAT and type(obj.get("version")) is int and \
                obj["version"] > MANIFEST_VERSION and "manifest_crc32" not in obj:
            raise UnsupportedFormatError(f"{path}: format version {obj['version']} is newer than "
                                         f"this reader's {MANIFEST_VERSION}; upgrade datastates")
        raise CorruptCheckpointError(f"{path}: the manifest does not end with its checksum "
                                     f"(expected the last {TRAILER_BYTES} bytes to be "
                                     '\',"manifest_crc32":"<8 hex digits>"}\')')
    manifest = validate.parse_manifest(obj, path, version_1=True, checked=checked)
    warnings.warn(f"{path}: a version-1 manifest has no checksum; its fields are validated but "
                  "a damaged value cannot be detected. Save a new checkpoint to get a checked one",
                  RuntimeWarning, stacklevel=4)
    return manifest


def _decode_manifest(raw: bytes, path: str) -> tuple[dict, bool]:
    """The decoded JSON object of a manifest, and whether its ordinary tensor entries were
    checked and made records as they were decoded (``codec.parse_json_streamed`` with
    ``validate.entry_converter``: what ``parse_manifest(checked=True)`` takes)."""
    obj = parse_json_streamed(raw, "entries", validate.entry_converter)
    if obj is not None:
        return obj, True
    return parse_json(raw, path, unique=True), False

"""The bytes of the format (docs/format.md): constants, names, dtypes, the shard file header and
index encoding, the manifest's checksum seal, the one JSON encoding.

Functions over bytes; the only I/O is reading a header through an open file. Reading whole files
into typed records is ``files.py``; validating decoded JSON is ``records.py``.
"""

from __future__ import annotations

import array
import itertools
import json
import re
import struct
import sys
from typing import TYPE_CHECKING, Any, Callable, Iterable, NamedTuple, cast

import torch

from ..errors import CorruptCheckpointError, UnsupportedFormatError
from . import checksum

if TYPE_CHECKING:
    from ..storage.store import ReadFile

MAGIC = b"DSTATES\x01"
#: The shard file version written by a framed writer (also a ``torch.save`` archive); writers
#: that do not frame write ``PLAIN_VERSION``.
VERSION = 3
PLAIN_VERSION = 2
#: Manifest versions: 3 may write a rank's subtree equal to rank 0's as a ``same`` node
#: (format/sharing.py); 2 has every rank's tree in full; 1 lacks the checksum trailer.
MANIFEST_VERSION = 3
#: A manifest whose encoding passes ``SPLIT_BYTES`` is written as version 4: ``manifest.json``
#: holds the head and a table of parts, each part the trees of a run of ranks and the entries
#: they brought, about ``SPLIT_BYTES`` each (docs/format.md, "Split manifests").
SPLIT_VERSION = 4
SPLIT_BYTES = 32 << 20
PART_FORMAT = "datastates-manifest-part"
#: Shard files of versions 1 and 2 have one layout (the header at 0); version 3 is also a ZIP
#: archive, its header at 64 (docs/format.md, "Shard file version 3").
SHARD_VERSIONS = (1, 2, 3)
#: The largest tail of a version-3 file (its pickle, torch's small records, the ZIP directory).
MAX_TAIL_BYTES = (256 << 20) + (64 << 10)
_ZIP_START = b"PK\x03\x04"
HEADER_BYTES = 4096
DATA_ALIGN = 64
UNIT_ALIGN = 4096
MANIFEST = "manifest.json"
LATEST = "latest"
#: The hidden folder beside a framework's checkpoint files: the checkpoint behind the file path
#: ``dir/name`` is ``dir/.datastates/name/`` (a checkpoint of the directory ``dir/.datastates``,
#: tag ``name``), and the file at the path is a hard link to its shard file (docs/format.md,
#: "Frameworks' own loaders").
PATH_FOLDER = ".datastates"
SHARD_FORMAT = "datastates-shard"
CHECKPOINT_FORMAT = "datastates-checkpoint"
_HEADER = struct.Struct("<8sIIQQI")  # magic, version, flags, index offset, index length, index crc
_HEADER_USED = _HEADER.size + 4  # ... and the CRC of those 36 bytes; the rest is zero
#: The last bytes of a manifest: its CRC-32 over every byte before them, 8 lowercase hex digits.
#: The largest ``manifest.json`` a reader reads (about a million tensors); larger is refused
#: before a byte is read, so a huge or endless file cannot exhaust memory.
MAX_MANIFEST_BYTES = 256 << 20
#: The most bytes the parts of one split manifest hold together (each part is a file of at most
#: ``MAX_MANIFEST_BYTES``); a head declaring more is refused before a part is read.
MAX_SPLIT_BYTES = 1 << 30
#: The largest shard file index a reader reads (the header's index length is checked first).
MAX_INDEX_BYTES = 256 << 20
#: The deepest nesting of arrays and objects in a JSON document of the format (a manifest, a
#: part, a shard index, a rank report). A valid one needs at most 770 levels: a state tree of
#: ``checks.MAX_TREE_DEPTH`` (256) levels nests three JSON levels per level inside a manifest's
#: three, and its metadata is ``checks.MAX_METADATA_DEPTH`` (256) levels inside the manifest.
#: CPython's decoder reaches about 990 from an empty stack at its default recursion limit: a
#: caller up to about 190 frames deep decodes every document within the bound, and one nested
#: deeper is damage whatever the caller (:func:`parse_json`).
MAX_JSON_DEPTH = 800
_TRAILER = re.compile(rb',"manifest_crc32":"([0-9a-f]{8})"\}\Z')
TRAILER_BYTES = len(b',"manifest_crc32":"00000000"}')

_DTYPES = {
    name: getattr(torch, name)
    for name in (
        "float64",
        "float32",
        "float16",
        "bfloat16",
        "int64",
        "int32",
        "int16",
        "int8",
        "uint8",
        "bool",
        "complex64",
        "complex128",
        "float8_e4m3fn",
        "float8_e5m2",
        "uint16",
        "uint32",
        "uint64",
    )
    if hasattr(torch, name)
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}
#: The torch dtypes the format holds.
SUPPORTED_DTYPES = frozenset(_DTYPE_NAMES)
#: Bytes per element of each dtype name of the format (for checks that must not build a dtype).
ITEMSIZES = {name: dtype.itemsize for name, dtype in _DTYPES.items()}


def crc32(data, value: int = 0) -> int:
    """CRC-32 (zlib's values) of a bytes-like object, continuing from ``value``; computed by the
    fastest installed backend (ISA-L, zlib-ng, else zlib: see checksum.py); releases the GIL for
    large buffers. The backend is looked up at each call (a reloaded checksum module is used)."""
    return checksum.crc32(data, value)


def dtype_name(dtype: torch.dtype) -> str:
    try:
        return _DTYPE_NAMES[dtype]
    except KeyError:
        raise TypeError(f"dtype {dtype} is not supported by the datastates format") from None


def dtype_from_name(name: str, where: str) -> torch.dtype:
    try:
        return _DTYPES[name]
    except (KeyError, TypeError):
        raise CorruptCheckpointError(f"{where}: unknown dtype {name!r}") from None


def tensor_bytes(t: torch.Tensor) -> torch.Tensor:
    """The bytes the format holds for ``t``: its values in row-major order, as a flat uint8
    tensor on its device. A view of its memory when that memory already is those bytes (a
    contiguous tensor without a lazy conjugate or negative bit), else of a copy. A contiguous
    tensor may carry any stride in a dimension of size 1 (``x.t()[2:3, :1]``, one element of
    stride 4), which ``reshape(-1).view(torch.uint8)`` refuses for elements wider than a byte:
    its elements fill one dense range all the same, viewed here with stride 1."""
    t = t.detach()
    if t.is_conj() or t.is_neg():
        t = t.resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    flat = t.reshape(-1)
    if not flat.numel():
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    if flat.stride(0) != 1:
        flat = t.as_strided((t.numel(),), (1,))
    return flat.view(torch.uint8)


def shard_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.dsf"


def part_name(index: int) -> str:
    """The file of part ``index`` of a split manifest (beside the shard files)."""
    return f"manifest-{index:05d}.json"


#: The names :func:`part_name` gives.
PART_NAME = re.compile(r"manifest-[0-9]{5}\.json")
#: What a save writes beside a manifest: shard files (of any rank) and a split manifest's parts.
_SAVED_FILE = re.compile(r"rank-[0-9]{5,}\.dsf|" + PART_NAME.pattern)


def saved_file(name: str) -> bool:
    """Whether ``name`` is one a save gives a file it writes into a checkpoint's directory (or
    its data directory): a shard file (:func:`shard_file_name`) or a part (:func:`part_name`)."""
    return _SAVED_FILE.fullmatch(name) is not None


def step_name(step: int) -> str:
    return f"step-{step:010d}"


def check_name(name: str) -> str:
    """A checkpoint name must be one non-reserved path component."""
    if (
        not isinstance(name, str)
        or not name
        or name.startswith(".")
        or "/" in name
        or "\\" in name
        or name in (LATEST, "latest.tmp")
        or "\x00" in name
    ):
        raise ValueError(
            f"invalid checkpoint name {name!r}: expected a non-empty path component "
            "not starting with '.' and other than 'latest'"
        )
    return name


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


# ---------------------------------------------------------------- shard file header and index


class ShardHeader(NamedTuple):
    """The validated fields of a shard file header that locate its index (and, of a version-3
    file, its tail)."""

    index_offset: int
    index_length: int
    index_crc32: int
    version: int = PLAIN_VERSION
    tail_offset: int = 0
    tail_length: int = 0
    tail_crc32: int = 0

    @property
    def end(self) -> int:
        """Where the file ends: after the index, or after the tail of a version-3 file."""
        if self.version >= 3:
            return self.tail_offset + self.tail_length
        return self.index_offset + self.index_length


_HEADER3 = struct.Struct("<8sIIQQIQQII")  # ... and tail offset, length, crc, first slot
_HEADER3_USED = _HEADER3.size + 4


def pack_header(index_offset: int, index_bytes: bytes) -> bytes:
    """The 4096-byte header of a version-2 shard file (a writer that does not frame)."""
    head = _HEADER.pack(MAGIC, PLAIN_VERSION, 0, index_offset, len(index_bytes), crc32(index_bytes))
    head += struct.pack("<I", crc32(head))
    return head + bytes(HEADER_BYTES - len(head))


def pack_header_v3(
    index_offset: int, index_bytes: bytes, tail_offset: int, tail: bytes, first_slot: bytes = b""
) -> bytes:
    """The first 4096 bytes of a version-3 shard file: the local header of the empty first
    record, the header, zeros, and ``first_slot``, the local header of the first tensor (which
    starts at 4096), if any (docs/format.md, "Shard file version 3")."""
    from . import zipframe

    head = _HEADER3.pack(
        MAGIC,
        VERSION,
        0,
        index_offset,
        len(index_bytes),
        crc32(index_bytes),
        tail_offset,
        len(tail),
        crc32(tail),
        len(first_slot),
    )
    head += struct.pack("<I", crc32(head))
    return (
        zipframe.header_record_header()
        + head
        + bytes(HEADER_BYTES - zipframe.HEADER_AT - len(head) - len(first_slot))
        + first_slot
    )


def is_shard_start(raw: bytes) -> bool:
    """Whether the first bytes of a file (at least 72) are those of a shard file of any
    version: the magic at 0, or a ZIP local header and the magic at 64."""
    return raw.startswith(MAGIC) or (raw.startswith(_ZIP_START) and raw[64:72] == MAGIC)


def encode_index(rank: int, entries: Iterable[dict]) -> bytes:
    """The index of a shard file: its JSON object holding ``entries``, which may be a generator
    (they are encoded a batch at a time, see :func:`encode_entries`)."""
    batches, batch = [], []
    for entry in entries:
        batch.append(entry)
        if len(batch) == ENCODE_BATCH:
            batches.append(encode_json(batch)[1:-1])
            batch = []
    if batch:
        batches.append(encode_json(batch)[1:-1])
    return encode_index_items(rank, b",".join(batches))


def encode_index_items(rank: int, items: bytes) -> bytes:
    """:func:`encode_index` of entries already encoded, ``items`` (``item,item,...``)."""
    return encode_entries(
        {"format": SHARD_FORMAT, "version": PLAIN_VERSION, "rank": rank, "entries": []}, items
    )


#: JSON objects encoded at a time when a writer encodes many (index and manifest entries): few
#: enough that the dicts of a batch die in the garbage collector's youngest generations.
ENCODE_BATCH = 256


def encode_entries(head: dict, entries: bytes) -> bytes:
    """:func:`encode_json` of ``head`` with the encoded items ``entries`` (``item,item,...``)
    as the value of its ``"entries"`` field, which ``head`` holds empty, in its place: the same
    bytes as encoding the whole object, without holding all of it at once."""
    keys = list(head)
    cut = keys.index("entries")
    before = encode_json({k: head[k] for k in keys[:cut]})[:-1]
    after = encode_json({k: head[k] for k in keys[cut + 1 :]})[1:]
    return (
        before
        + (b"," if cut else b"")
        + b'"entries":['
        + entries
        + b"]"
        + (b"," if cut + 1 < len(keys) else b"")
        + after
    )


def read_header(f: "ReadFile", path: str, file_size: int) -> ShardHeader:
    """Validate a shard file's header (magic, CRC, version, flags and reserved bytes zero, index
    inside the file; of a version-3 file also its first record's local header and its tail);
    return where its index is."""
    try:
        raw = bytes(f.pread(min(HEADER_BYTES, file_size), 0))
    except OSError as exc:
        raise CorruptCheckpointError(f"{path}: cannot read the header ({exc})") from None
    if len(raw) < HEADER_BYTES:
        raise CorruptCheckpointError(
            f"{path}: truncated header ({len(raw)} bytes, expected {HEADER_BYTES})"
        )
    if raw.startswith(_ZIP_START):
        return _read_header_v3(raw, path, file_size)
    magic, version, flags, offset, length, index_crc = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise CorruptCheckpointError(
            f"{path}: wrong magic {magic!r}, expected {MAGIC!r} "
            "(not a datastates shard file, or never finished)"
        )
    (head_crc,) = struct.unpack_from("<I", raw, _HEADER.size)
    if head_crc != crc32(raw[: _HEADER.size]):
        raise CorruptCheckpointError(f"{path}: header checksum mismatch")
    _check_version(version, (1, 2), path)
    _check_rest(flags, raw, _HEADER_USED, path)
    _check_index(offset, length, file_size, path)
    return ShardHeader(offset, length, index_crc, version)


def _read_header_v3(raw: bytes, path: str, file_size: int) -> ShardHeader:
    from . import zipframe

    at = zipframe.HEADER_AT
    if raw[:at] != zipframe.header_record_header():
        raise CorruptCheckpointError(
            f"{path}: bytes 0-{at - 1} are not the local header of "
            "the first record (damaged header)"
        )
    (
        magic,
        version,
        flags,
        offset,
        length,
        index_crc,
        tail_offset,
        tail_length,
        tail_crc,
        first_slot,
    ) = _HEADER3.unpack_from(raw, at)
    if magic != MAGIC:
        raise CorruptCheckpointError(
            f"{path}: wrong magic {magic!r} at offset {at}, expected "
            f"{MAGIC!r} (not a datastates shard file)"
        )
    (head_crc,) = struct.unpack_from("<I", raw, at + _HEADER3.size)
    if head_crc != crc32(raw[at : at + _HEADER3.size]):
        raise CorruptCheckpointError(f"{path}: header checksum mismatch")
    _check_version(version, (3,), path)
    if first_slot not in (0, zipframe.SLOT, zipframe.BIG_SLOT) or (
        first_slot and not raw[HEADER_BYTES - first_slot :].startswith(_ZIP_START)
    ):
        raise CorruptCheckpointError(
            f"{path}: the header gives a first local header of "
            f"{first_slot} bytes, expected 0, {zipframe.SLOT} or "
            f"{zipframe.BIG_SLOT} bytes beginning with a signature"
        )
    _check_rest(flags, raw[: HEADER_BYTES - first_slot], at + _HEADER3_USED, path)
    _check_index(offset, length, file_size, path)
    if (
        tail_offset != align_up(offset + length, DATA_ALIGN)
        or tail_length > MAX_TAIL_BYTES
        or tail_offset + tail_length != file_size
    ):
        raise CorruptCheckpointError(
            f"{path}: tail at [{tail_offset}, "
            f"{tail_offset + tail_length}) is not the end of the file "
            f"of {file_size} bytes after the index at [{offset}, "
            f"{offset + length}) (truncated?)"
        )
    return ShardHeader(offset, length, index_crc, version, tail_offset, tail_length, tail_crc)


def _check_version(version: int, known: tuple, path: str) -> None:
    if version > VERSION:
        raise UnsupportedFormatError(
            f"{path}: format version {version} is newer than this "
            f"reader's {VERSION}; upgrade datastates"
        )
    if version not in known:
        raise CorruptCheckpointError(
            f"{path}: header version {version}, expected one of {list(known)}"
        )


def _check_rest(flags: int, raw: bytes, used: int, path: str) -> None:
    """Flags zero, and every byte of ``raw`` from ``used`` on (the reserved bytes)."""
    if flags:
        raise CorruptCheckpointError(f"{path}: header flags are {flags:#x}, expected 0")
    if raw[used:].count(0) != len(raw) - used:
        first = next(i for i in range(used, len(raw)) if raw[i])
        raise CorruptCheckpointError(
            f"{path}: reserved header byte at offset {first} is {raw[first]:#x}, expected 0"
        )


def _check_index(offset: int, length: int, file_size: int, path: str) -> None:
    if length > MAX_INDEX_BYTES:
        raise CorruptCheckpointError(
            f"{path}: the header gives an index of {length} bytes, more "
            f"than the format's limit of {MAX_INDEX_BYTES}"
        )
    if offset < HEADER_BYTES or length == 0 or offset + length > file_size:
        raise CorruptCheckpointError(
            f"{path}: index at [{offset}, {offset + length}) lies outside "
            f"the file of {file_size} bytes (truncated?)"
        )


# ---------------------------------------------------------------- manifest and JSON


def seal_manifest(body: bytes) -> bytes:
    """The bytes of ``manifest.json`` for the compact JSON object ``body``: the object with the
    field ``"manifest_crc32":"HHHHHHHH"`` appended last, the CRC-32 of every byte before it."""
    if not (body.startswith(b"{") and body.endswith(b"}")) or len(body) < 3:
        raise ValueError("a manifest body is a non-empty JSON object")
    covered = body[:-1]
    return covered + b',"manifest_crc32":"%08x"}' % crc32(covered)


def encode_json(value: Any) -> bytes:
    """Compact, ASCII, NaN-free JSON: the one encoding of every JSON record of the format."""
    return json.dumps(value, separators=(",", ":"), allow_nan=False).encode()


def parse_json(raw: bytes | bytearray, path: str, unique: bool = False) -> Any:
    """The JSON object ``raw`` (CorruptCheckpointError naming ``path`` if it is none).
    ``unique``: one of its own fields given twice is an error too (parsers differ on which
    they keep, so a reader of its head and one of the whole could see different values).

    The decoder recurses once per level of nesting. When it runs out of stack, the document is
    damage if it nests deeper than MAX_JSON_DEPTH (:func:`nesting_depth`); otherwise the
    caller's own stack is too deep, which says nothing of the document: RecursionError, never
    CorruptCheckpointError (so whether a checkpoint is damaged never depends on the caller)."""
    pairs_seen: list[bool] = []

    def fields(pairs: list) -> dict:
        obj = dict(pairs)
        pairs_seen.append(len(obj) != len(pairs))  # the outermost object comes last
        return obj

    try:
        value = json.loads(
            raw, parse_constant=_no_constant, object_pairs_hook=fields if unique else None
        )
    except (UnicodeDecodeError, ValueError) as exc:
        raise CorruptCheckpointError(f"{path}: invalid JSON ({exc})") from None
    except RecursionError:
        raise _too_deep(raw, path) from None
    if not isinstance(value, dict):
        raise CorruptCheckpointError(
            f"{path}: expected a JSON object, found {type(value).__name__}"
        )
    if unique and pairs_seen[-1]:
        raise CorruptCheckpointError(f"{path}: a field of the object is given twice")
    return value


def _too_deep(raw: bytes | bytearray, path: str) -> Exception:
    """What the decoder's RecursionError on the document ``raw`` means (see :func:`parse_json`)."""
    depth = nesting_depth(raw)
    if depth > MAX_JSON_DEPTH:
        return CorruptCheckpointError(
            f"{path}: the JSON nests {depth} levels deep, more than the format's {MAX_JSON_DEPTH}"
        )
    return RecursionError(
        f"{path}: the JSON nests {depth} levels deep, within the format's "
        f"{MAX_JSON_DEPTH}, but the caller's stack is too deep to decode it "
        f"(recursion limit {sys.getrecursionlimit()}); this is no damage: "
        "read it from a shallower stack"
    )


_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)
_NOT_BRACKET = re.compile(r"[^\[\]{}]+")
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 and -1 as signed bytes


def nesting_depth(raw: bytes | bytearray) -> int:
    """The deepest nesting of arrays and objects in the JSON text ``raw`` (in any of JSON's
    encodings), counted without decoding it and without recursion: the brackets outside its
    strings, as a running sum. Valid JSON or not (the decoder judges that)."""
    try:
        text = text_of(raw)
    except UnicodeDecodeError:
        return 0
    brackets = _NOT_BRACKET.sub("", _STRING.sub("", text)).encode("ascii")
    return max(itertools.accumulate(array.array("b", brackets.translate(_STEPS))), default=0)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


#: The decoder of the streamed parsers. They use its public ``raw_decode(text, idx)`` only (the
#: start index is in its signature, and in typeshed's, since Python 2.6; tests/unit/test_format.py
#: pins it): nothing of the ``json`` module's private scanner.
_DECODER = json.JSONDecoder(parse_constant=_no_constant)
_decode = _DECODER.raw_decode
#: JSON's whitespace (RFC 8259: space, tab, line feed, carriage return), what separates tokens.
#: A run of zero or more always matches: the match is never None.
_WS = cast("Callable[[str, int], re.Match[str]]", re.compile(r"[ \t\n\r]*").match)
_SPACE = " \t\n\r"


def text_of(raw: bytes | bytearray) -> str:
    """The text of the JSON document ``raw`` in the encoding ``json.loads`` reads it in: UTF-8
    (its BOM dropped), or UTF-16/32 of either byte order, told by the BOM or by
    the zero bytes of the first character (RFC 4627, section 3). UnicodeDecodeError if it is
    not valid in that encoding."""
    if raw.startswith((b"\xff\xfe\x00\x00", b"\x00\x00\xfe\xff")):
        return raw.decode("utf-32", "surrogatepass")
    if raw.startswith((b"\xff\xfe", b"\xfe\xff")):
        return raw.decode("utf-16", "surrogatepass")
    if raw.startswith(b"\xef\xbb\xbf"):
        return raw.decode("utf-8-sig", "surrogatepass")
    if len(raw) >= 4:
        if not raw[0]:
            return raw.decode("utf-16-be" if raw[1] else "utf-32-be", "surrogatepass")
        if not raw[1]:
            return raw.decode("utf-16-le" if raw[2] or raw[3] else "utf-32-le", "surrogatepass")
    elif len(raw) == 2:
        if not raw[0]:
            return raw.decode("utf-16-be", "surrogatepass")
        if not raw[1]:
            return raw.decode("utf-16-le", "surrogatepass")
    return raw.decode("utf-8", "surrogatepass")


def parse_json_streamed(
    raw: bytes, field: str, start: Callable[[dict], Callable[[Any], Any] | None]
) -> dict | None:
    """:func:`parse_json` of a JSON object whose ``field`` is a long array, each item handed
    to a converter as soon as it is decoded: the object holds what the converter returns for
    it (the item itself when that is None). ``start(fields)``, called when ``field`` is reached
    with the fields decoded before it, gives the converter (None: the array is decoded as it
    is). So an item's dicts and lists live only until it is converted, and the garbage
    collector never walks a whole manifest of them.

    The same values as ``json.loads``, with the same decoder and the same whitespace and
    encoding rules; None -- the caller then uses :func:`parse_json` -- for anything unusual or
    wrong: not an object, a field given twice (``json.loads`` keeps the last), invalid JSON
    (whose error ``parse_json`` names), a RecursionError (which ``parse_json`` judges)."""
    try:
        return _streamed_object(text_of(raw), field, start)
    except (UnicodeDecodeError, LookupError, ValueError, IndexError, RecursionError):
        return None  # JSONDecodeError is a ValueError; IndexError: the text ended early


class _Reached(Exception):
    """Raised by :func:`parse_json_head`'s converter to stop the decoding at its field."""

    def __init__(self, fields: dict):
        super().__init__()
        self.fields = fields


def parse_json_head(raw: bytes, field: str) -> dict | None:
    """The fields of the JSON object ``raw`` that come before its array field ``field``, decoded
    as :func:`parse_json` decodes them, without decoding ``field`` or anything after it. None if
    ``raw`` is not an object reaching an array ``field`` at its top level, gives a field twice
    before it, is not valid JSON up to it, or nests too deep for the caller's stack (the caller
    then parses the whole with :func:`parse_json`, which judges each)."""

    def stop(fields: dict):
        raise _Reached(fields)

    try:
        _streamed_object(text_of(raw), field, stop)
    except _Reached as reached:
        return reached.fields
    except (UnicodeDecodeError, LookupError, ValueError, IndexError, RecursionError):
        pass
    return None


def _streamed_object(text: str, field: str, start) -> dict | None:
    idx = _WS(text, 0).end()
    if text[idx] != "{":
        return None
    obj: dict = {}
    idx = _WS(text, idx + 1).end()
    if text[idx] == "}":
        idx += 1
    else:
        while True:
            if text[idx] != '"':
                return None
            key, idx = _decode(text, idx)
            idx = _WS(text, idx).end()
            if key in obj or text[idx] != ":":
                return None
            idx = _WS(text, idx + 1).end()
            convert = start(obj) if key == field and text[idx] == "[" else None
            if convert is not None:
                obj[key], idx = _streamed_array(text, idx, convert)
            else:
                obj[key], idx = _decode(text, idx)
            idx = _WS(text, idx).end()
            if text[idx] == ",":
                idx = _WS(text, idx + 1).end()
            elif text[idx] == "}":
                idx += 1
                break
            else:
                return None
    return obj if _WS(text, idx).end() == len(text) else None


def _streamed_array(text: str, idx: int, convert: Callable[[Any], Any]) -> tuple[list, int]:
    """The array starting at ``text[idx]`` (``[``), each item converted; (list, end)."""
    out: list = []
    idx = _WS(text, idx + 1).end()
    if text[idx] == "]":
        return out, idx + 1
    while True:
        value, idx = _decode(text, idx)
        converted = convert(value)
        out.append(value if converted is None else converted)
        if text[idx] in _SPACE:
            idx = _WS(text, idx).end()
        if text[idx] == ",":
            idx += 1
            if text[idx] in _SPACE:
                idx = _WS(text, idx).end()
        elif text[idx] == "]":
            return out, idx + 1
        else:
            raise ValueError("expected ',' or ']' in an array")

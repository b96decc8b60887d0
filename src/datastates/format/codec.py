"""The bytes of the format (docs/format.md): constants, names, dtypes, the shard file header and
index encoding, the manifest's checksum seal, the one JSON encoding.

Functions over bytes; the only I/O is reading a header through an open file. Reading whole files
into typed records is ``files.py``; validating decoded JSON is ``records.py``.
"""
from __future__ import annotations

import json
import re
import struct
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from ..errors import CorruptCheckpointError, UnsupportedFormatError

if TYPE_CHECKING:
    from ..storage.store import ReadFile

MAGIC = b"DSTATES\x01"
VERSION = 2
#: Shard files of these versions have the same layout; version 1 manifests lack the checksum.
SHARD_VERSIONS = (1, 2)
HEADER_BYTES = 4096
DATA_ALIGN = 64
UNIT_ALIGN = 4096
MANIFEST = "manifest.json"
LATEST = "latest"
SHARD_FORMAT = "datastates-shard"
CHECKPOINT_FORMAT = "datastates-checkpoint"
_HEADER = struct.Struct("<8sIIQQI")  # magic, version, flags, index offset, index length, index crc
_HEADER_USED = _HEADER.size + 4        # ... and the CRC of those 36 bytes; the rest is zero
#: The last bytes of a manifest: its CRC-32 over every byte before them, 8 lowercase hex digits.
#: The largest ``manifest.json`` a reader reads (about a million tensors); larger is refused
#: before a byte is read, so a huge or endless file cannot exhaust memory.
MAX_MANIFEST_BYTES = 256 << 20
#: The largest shard file index a reader reads (the header's index length is checked first).
MAX_INDEX_BYTES = 256 << 20
_TRAILER = re.compile(rb',"manifest_crc32":"([0-9a-f]{8})"\}\Z')
TRAILER_BYTES = len(b',"manifest_crc32":"00000000"}')

_DTYPES = {
    name: getattr(torch, name)
    for name in ("float64", "float32", "float16", "bfloat16", "int64", "int32", "int16", "int8",
                 "uint8", "bool", "complex64", "complex128", "float8_e4m3fn", "float8_e5m2",
                 "uint16", "uint32", "uint64")
    if hasattr(torch, name)
}
_DTYPE_NAMES = {dtype: name for name, dtype in _DTYPES.items()}


def crc32(data, value: int = 0) -> int:
    """CRC-32 (zlib's values) of a bytes-like object, continuing from ``value``; computed by the
    fastest installed backend (ISA-L, zlib-ng, else zlib: see checksum.py); releases the GIL for
    large buffers."""
    from .checksum import crc32 as fast_crc32
    return fast_crc32(data, value)


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


def shard_file_name(rank: int) -> str:
    return f"rank-{rank:05d}.dsf"


def step_name(step: int) -> str:
    return f"step-{step:010d}"


def check_name(name: str) -> str:
    """A checkpoint name must be one non-reserved path component."""
    if (not isinstance(name, str) or not name or name.startswith(".") or "/" in name
            or "\\" in name or name in (LATEST, "latest.tmp") or "\x00" in name):
        raise ValueError(f"invalid checkpoint name {name!r}: expected a non-empty path component "
                         "not starting with '.' and other than 'latest'")
    return name


def align_up(value: int, alignment: int) -> int:
    return (value + alignment - 1) // alignment * alignment


# ---------------------------------------------------------------- shard file header and index

class ShardHeader(NamedTuple):
    """The validated fields of a shard file header that locate its index."""

    index_offset: int
    index_length: int
    index_crc32: int


def pack_header(index_offset: int, index_bytes: bytes) -> bytes:
    head = _HEADER.pack(MAGIC, VERSION, 0, index_offset, len(index_bytes), crc32(index_bytes))
    head += struct.pack("<I", crc32(head))
    return head + bytes(HEADER_BYTES - len(head))


def encode_index(rank: int, entries: list[dict]) -> bytes:
    return json.dumps({"format": SHARD_FORMAT, "version": VERSION, "rank": rank,
                       "entries": entries}, separators=(",", ":"), allow_nan=False).encode()


def read_header(f: "ReadFile", path: str, file_size: int) -> ShardHeader:
    """Validate a shard file's header (magic, CRC, version, flags and reserved bytes zero, index
    inside the file); return where its index is."""
    try:
        raw = bytes(f.pread(min(HEADER_BYTES, file_size), 0))
    except OSError as exc:
        raise CorruptCheckpointError(f"{path}: cannot read the header ({exc})") from None
    if len(raw) < HEADER_BYTES:
        raise CorruptCheckpointError(f"{path}: truncated header ({len(raw)} bytes, expected "
                                     f"{HEADER_BYTES})")
    magic, version, flags, offset, length, index_crc = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise CorruptCheckpointError(f"{path}: wrong magic {magic!r}, expected {MAGIC!r} "
                                     "(not a datastates shard file, or never finished)")
    (head_crc,) = struct.unpack_from("<I", raw, _HEADER.size)
    if head_crc != crc32(raw[:_HEADER.size]):
        raise CorruptCheckpointError(f"{path}: header checksum mismatch")
    if version > VERSION:
        raise UnsupportedFormatError(f"{path}: format version {version} is newer than this "
                                     f"reader's {VERSION}; upgrade datastates")
    if version not in SHARD_VERSIONS:
        raise CorruptCheckpointError(f"{path}: header version {version}, expected one of "
                                     f"{list(SHARD_VERSIONS)}")
    if flags:
        raise CorruptCheckpointError(f"{path}: header flags are {flags:#x}, expected 0")
    if raw[_HEADER_USED:].count(0) != HEADER_BYTES - _HEADER_USED:
        first = next(i for i in range(_HEADER_USED, HEADER_BYTES) if raw[i])
        raise CorruptCheckpointError(f"{path}: reserved header byte at offset {first} is "
                                     f"{raw[first]:#x}, expected 0")
    if length > MAX_INDEX_BYTES:
        raise CorruptCheckpointError(f"{path}: the header gives an index of {length} bytes, more "
                                     f"than the format's limit of {MAX_INDEX_BYTES}")
    if offset < HEADER_BYTES or length == 0 or offset + length > file_size:
        raise CorruptCheckpointError(f"{path}: index at [{offset}, {offset + length}) lies outside "
                                     f"the file of {file_size} bytes (truncated?)")
    return ShardHeader(offset, length, index_crc)


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


def parse_json(raw: bytes, path: str) -> Any:
    try:
        value = json.loads(raw, parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise CorruptCheckpointError(f"{path}: invalid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")

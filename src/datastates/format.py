"""The on-disk format (docs/format.md): shard file header, index, manifest, names.

Pure functions over bytes and dicts; the only I/O is reading a header/index/manifest from a path.
Everything read is validated before it is trusted (sizes, offsets, versions, checksums).
"""
from __future__ import annotations

import json
import os
import struct
import zlib
from typing import Any

import torch

from .errors import CorruptCheckpointError, UnsupportedFormatError

MAGIC = b"DSTATES\x01"
VERSION = 1
HEADER_BYTES = 4096
DATA_ALIGN = 64
UNIT_ALIGN = 4096
MANIFEST = "manifest.json"
LATEST = "latest"
SHARD_FORMAT = "datastates-shard"
CHECKPOINT_FORMAT = "datastates-checkpoint"
_HEADER = struct.Struct("<8sIIQQI")  # magic, version, flags, index offset, index length, index crc

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

def pack_header(index_offset: int, index_bytes: bytes) -> bytes:
    head = _HEADER.pack(MAGIC, VERSION, 0, index_offset, len(index_bytes), crc32(index_bytes))
    head += struct.pack("<I", crc32(head))
    return head + bytes(HEADER_BYTES - len(head))


def encode_index(rank: int, entries: list[dict]) -> bytes:
    return json.dumps({"format": SHARD_FORMAT, "version": VERSION, "rank": rank,
                       "entries": entries}, separators=(",", ":")).encode()


def read_header(fd: int, path: str, file_size: int) -> tuple[int, int, int]:
    """Validate a shard file's header; return (index offset, index length, index crc)."""
    raw = os.pread(fd, _HEADER.size + 4, 0)
    if len(raw) < _HEADER.size + 4:
        raise CorruptCheckpointError(f"{path}: truncated header ({len(raw)} bytes, expected "
                                     f"{HEADER_BYTES})")
    magic, version, _flags, offset, length, index_crc = _HEADER.unpack_from(raw)
    if magic != MAGIC:
        raise CorruptCheckpointError(f"{path}: wrong magic {magic!r}, expected {MAGIC!r} "
                                     "(not a datastates shard file, or never finished)")
    (head_crc,) = struct.unpack_from("<I", raw, _HEADER.size)
    if head_crc != crc32(raw[:_HEADER.size]):
        raise CorruptCheckpointError(f"{path}: header checksum mismatch")
    if version > VERSION:
        raise UnsupportedFormatError(f"{path}: format version {version} is newer than this "
                                     f"reader's {VERSION}; upgrade datastates")
    if offset < HEADER_BYTES or offset + length > file_size:
        raise CorruptCheckpointError(f"{path}: index at [{offset}, {offset + length}) lies outside "
                                     f"the file of {file_size} bytes (truncated?)")
    return offset, length, index_crc


def read_index(path: str) -> dict:
    """Read and validate the self-describing index of a shard file."""
    fd = _open(path)
    try:
        size = os.fstat(fd).st_size
        offset, length, index_crc = read_header(fd, path, size)
        raw = os.pread(fd, length, offset)
    finally:
        os.close(fd)
    if crc32(raw) != index_crc:
        raise CorruptCheckpointError(f"{path}: index checksum mismatch")
    index = _parse_json(raw, path)
    for entry in index.get("entries", []):
        end = int(entry.get("offset", 0)) + int(entry.get("nbytes", 0))
        if end > offset:
            raise CorruptCheckpointError(f"{path}: entry {entry.get('key')!r} ends at {end}, past "
                                         f"the index at {offset}")
    return index


# ---------------------------------------------------------------- manifest

def encode_manifest(manifest: dict) -> bytes:
    return json.dumps(manifest, separators=(",", ":"), allow_nan=False).encode()


def read_manifest(ckpt_dir: str) -> dict:
    """Read and validate ``manifest.json`` of a checkpoint directory."""
    path = os.path.join(ckpt_dir, MANIFEST)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        from .errors import CheckpointNotFoundError
        raise CheckpointNotFoundError(f"{ckpt_dir}: no {MANIFEST} (not a committed checkpoint)") \
            from None
    manifest = _parse_json(raw, path)
    if manifest.get("format") != CHECKPOINT_FORMAT:
        raise CorruptCheckpointError(f"{path}: format is {manifest.get('format')!r}, expected "
                                     f"{CHECKPOINT_FORMAT!r}")
    version = manifest.get("version")
    if not isinstance(version, int):
        raise CorruptCheckpointError(f"{path}: missing integer version")
    if version > VERSION:
        raise UnsupportedFormatError(f"{path}: format version {version} is newer than this "
                                     f"reader's {VERSION}; upgrade datastates")
    _validate_manifest(manifest, path)
    return manifest


def _validate_manifest(m: dict, path: str) -> None:
    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{path}: {what}")

    for field, kind in (("files", list), ("entries", list), ("ranks", list), ("world_size", int)):
        if not isinstance(m.get(field), kind):
            raise bad(f"field {field!r} missing or not a {kind.__name__}")
    nfiles = len(m["files"])
    for f in m["files"]:
        name = f.get("name")
        if not isinstance(name, str) or "/" in name or name.startswith("."):
            raise bad(f"invalid file name {name!r}")
    for i, e in enumerate(m["entries"]):
        kind = e.get("kind")
        if kind == "tensor":
            dtype_from_name(e.get("dtype"), f"{path}: entry {e.get('key')!r}")
            if not isinstance(e.get("shape"), list) or not isinstance(e.get("shards"), list):
                raise bad(f"entry {i} ({e.get('key')!r}) lacks shape or shards")
            for s in e["shards"]:
                if not (isinstance(s.get("file"), int) and 0 <= s["file"] < nfiles):
                    raise bad(f"entry {e.get('key')!r} refers to file {s.get('file')!r} of {nfiles}")
        elif kind == "object":
            if not (isinstance(e.get("file"), int) and 0 <= e["file"] < nfiles):
                raise bad(f"entry {e.get('key')!r} refers to file {e.get('file')!r} of {nfiles}")
        else:
            raise bad(f"entry {i} has unknown kind {kind!r}")


def _parse_json(raw: bytes, path: str) -> Any:
    try:
        value = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptCheckpointError(f"{path}: invalid JSON ({exc})") from None
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"{path}: expected a JSON object, found {type(value).__name__}")
    return value


def _open(path: str) -> int:
    try:
        return os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        from .errors import CheckpointNotFoundError
        raise CheckpointNotFoundError(f"{path}: shard file missing") from None

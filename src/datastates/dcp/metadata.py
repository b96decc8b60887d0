"""DCP ``Metadata`` as JSON, so that reading a folder ``DatastatesWriter`` wrote never unpickles.

``torch.distributed.checkpoint`` keeps its ``Metadata`` (what every key of the state dict is,
how tensors are chunked, where each item was stored) as a pickle. Unpickling a file that came
from someone else can run any code, and an allowlist of module names does not help: pickle
resolves dotted names, so an allowed module prefix reaches ``os.system`` through any module that
imports ``os``. The metadata is only dataclasses of ints, strings, dtypes and shapes, so it is
written here as JSON and rebuilt field by field, every field checked before it is used.

The JSON object (docs/format.md, "DCP folders") holds:

- ``version``: DCP's own ``Metadata.version`` (a string or null);
- ``state_dict``: ``[fqn, item]`` pairs in the state dict's order, ``item`` being
  ``{"kind": "bytes"}`` or ``{"kind": "tensor", "dtype", "layout", "requires_grad",
  "memory_format", "pin_memory", "size", "chunks": [{"offsets", "sizes"}]}``;
- ``planner_data``: null, or ``[fqn, path]`` pairs (the default planner's flattening: ``path``
  is the list of dict keys (strings) and list indexes (ints) leading to the value);
- ``storage_data``: ``[index, info]`` pairs, ``index`` being ``{"fqn", "offset", "index"}``
  (DCP's ``MetadataIndex``) and ``info`` the writer's record of the item (``kind``, ``file``,
  ``offset``, ``length``, ``crc32``; ``dtype`` and ``shape`` for tensors);
- ``storage_meta``: null or ``{"checkpoint_id", "save_id", "load_id", "modules"}``.

This module also reads the two small files of such a folder as input from someone else: the
manifest (``dcp_manifest.json``: format, version, the metadata's size and CRC-32, the shard file
names) and the metadata file, each opened only if it is a regular file of bounded size.
"""

from __future__ import annotations

import json
import os
import re
import stat
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorProperties,
    TensorStorageMetadata,
)

from ..errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    SerializationError,
    UnsupportedFormatError,
)
from ..format import codec as fmt
from .frame import head_bytes as frame_head_bytes
from ..storage.store import file_kind, read_regular

__all__ = ["encode", "decode", "read_manifest", "read_checked"]

METADATA = "dcp_metadata.json"
#: The pickled metadata of format version 1 (read only when trusted).
PICKLED_METADATA = "dcp.metadata"
MANIFEST = "dcp_manifest.json"
FORMAT = "datastates-dcp"
VERSION = 3
#: DCP's own pickled metadata, written from version 3 for its stock ``FileSystemReader``.
PICKLE = ".metadata"
#: Upper bound of the manifest and metadata files read (JSON of a few million items).
MAX_METADATA_BYTES = 1 << 30

_LAYOUTS = {
    "strided": torch.strided,
    "sparse_coo": torch.sparse_coo,
    "sparse_csr": torch.sparse_csr,
    "sparse_csc": torch.sparse_csc,
    "sparse_bsr": torch.sparse_bsr,
    "sparse_bsc": torch.sparse_bsc,
    "jagged": torch.jagged,
}
_MEMORY_FORMATS = {
    "contiguous_format": torch.contiguous_format,
    "channels_last": torch.channels_last,
    "channels_last_3d": torch.channels_last_3d,
    "preserve_format": torch.preserve_format,
}
_NAMES = {v: k for table in (_LAYOUTS, _MEMORY_FORMATS) for k, v in table.items()}
_FILE = re.compile(r"\Arank-\d{5}\.dsf\Z")
_MAX_INT = (1 << 63) - 1


# ---------------------------------------------------------------- the folder's small files


def read_manifest(path: str) -> dict:
    """The validated ``dcp_manifest.json`` of the folder ``path``."""
    mpath = os.path.join(path, MANIFEST)
    try:
        raw = _read_regular(mpath, MAX_METADATA_BYTES)
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"{path}: no {MANIFEST} (not a committed datastates DCP checkpoint)"
        ) from None
    try:
        manifest = json.loads(raw)
    except ValueError as exc:
        raise CorruptCheckpointError(f"{mpath}: not valid JSON ({exc})") from None
    if (
        not isinstance(manifest, dict)
        or manifest.get("format") != FORMAT
        or type(manifest.get("version")) is not int
    ):
        found = manifest.get("format") if isinstance(manifest, dict) else manifest
        raise CorruptCheckpointError(f"{mpath}: format {found!r:.60}, expected {FORMAT!r}")
    if manifest["version"] > VERSION:
        raise UnsupportedFormatError(
            f"{mpath}: version {manifest['version']} is newer than this reader's {VERSION}"
        )
    files = manifest.get("files")
    if not isinstance(files, list) or not all(
        isinstance(f, str) and f == fmt.shard_file_name(i) for i, f in enumerate(sorted(files))
    ):
        raise CorruptCheckpointError(
            f"{mpath}: files {files!r:.80}, expected the shard file "
            "names rank-00000.dsf, rank-00001.dsf, ..."
        )
    fields = ["metadata_bytes", "metadata_crc32"]
    if manifest["version"] >= 3:
        fields += ["pickle_bytes", "pickle_crc32"]
    for field in fields:
        if type(manifest.get(field)) is not int or manifest[field] < 0:
            raise CorruptCheckpointError(
                f"{mpath}: {field} {manifest.get(field)!r:.40}, expected a non-negative integer"
            )
    return manifest


def _read_regular(path: str, limit: int) -> bytes:
    """The bytes of ``path``, a regular file of at most ``limit`` bytes directly in its folder
    (``store.read_regular``: a link, FIFO or device is CorruptCheckpointError naming it; a read
    error stays an OSError, never taken for damage)."""
    return read_regular(path, limit)


def check_regular(path: str) -> None:
    """CorruptCheckpointError unless ``path`` is a regular file (a symlink is refused too)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path}: shard file missing") from None
    if not stat.S_ISREG(st.st_mode):
        raise CorruptCheckpointError(
            f"{path}: expected a regular file, found {file_kind(st.st_mode)}"
        )


def read_checked(folder: str, name: str, manifest: dict) -> bytes:
    """The metadata file ``name``, of the size and checksum ``manifest`` records."""
    path = os.path.join(folder, name)
    try:
        blob = _read_regular(path, MAX_METADATA_BYTES)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{path}: missing (the manifest names it)") from None
    if len(blob) != manifest["metadata_bytes"] or fmt.crc32(blob) != manifest["metadata_crc32"]:
        raise CorruptCheckpointError(
            f"{path}: {len(blob)} bytes with CRC-32 "
            f"{fmt.crc32(blob):08x}, the manifest says "
            f"{manifest['metadata_bytes']} bytes with "
            f"{manifest['metadata_crc32']:08x}"
        )
    return blob


def check_span(path: str, offset: int, length: int, data_end: int) -> None:
    """CorruptCheckpointError unless ``[offset, offset + length)`` is inside the data region."""
    if offset < fmt.HEADER_BYTES or offset + length > data_end:
        raise CorruptCheckpointError(
            f"{path}: item at [{offset}, {offset + length}) lies outside "
            f"the data region [{fmt.HEADER_BYTES}, {data_end})"
        )


# ---------------------------------------------------------------- encode


def encode(metadata: Metadata) -> bytes:
    """The JSON bytes of ``metadata``. SerializationError if a field holds something this format
    does not describe (a planner whose ``planner_data`` is not the default flattening map)."""
    doc = {
        "version": metadata.version,
        "state_dict": [
            [fqn, _encode_item(fqn, item)] for fqn, item in metadata.state_dict_metadata.items()
        ],
        "planner_data": _encode_planner_data(metadata.planner_data),
        "storage_data": [
            [
                {
                    "fqn": i.fqn,
                    "offset": None if i.offset is None else list(i.offset),
                    "index": i.index,
                },
                dict(info),
            ]
            for i, info in (metadata.storage_data or {}).items()
        ],
        "storage_meta": _encode_storage_meta(metadata.storage_meta),
    }
    return json.dumps(doc, separators=(",", ":"), allow_nan=False).encode()


def _encode_item(fqn: str, item: Any) -> dict:
    if isinstance(item, BytesStorageMetadata):
        return {"kind": "bytes"}
    if not isinstance(item, TensorStorageMetadata):
        raise SerializationError(
            f"DCP metadata of {fqn!r} is a {type(item).__name__}; expected "
            "TensorStorageMetadata or BytesStorageMetadata"
        )
    p = item.properties
    return {
        "kind": "tensor",
        "dtype": _dtype_name(p.dtype, fqn),
        "layout": _name(p.layout, fqn),
        "requires_grad": bool(p.requires_grad),
        "memory_format": _name(p.memory_format, fqn),
        "pin_memory": bool(p.pin_memory),
        "size": list(item.size),
        "chunks": [{"offsets": list(c.offsets), "sizes": list(c.sizes)} for c in item.chunks],
    }


def _dtype_name(dtype: torch.dtype, fqn: str) -> str:
    try:
        return fmt.dtype_name(dtype)
    except TypeError:
        raise SerializationError(
            f"DCP tensor {fqn!r}: dtype {dtype} is not supported by the datastates format"
        ) from None


def _name(value: Any, fqn: str) -> str:
    try:
        return _NAMES[value]
    except (KeyError, TypeError):
        raise SerializationError(
            f"DCP tensor {fqn!r}: {value!r} has no name in the JSON metadata"
        ) from None


def _encode_planner_data(data: Any) -> list | None:
    if data is None:
        return None
    if not isinstance(data, dict):
        raise SerializationError(
            f"DCP planner_data is a {type(data).__name__}; the JSON metadata "
            "holds the default planner's map of keys to paths only"
        )
    out = []
    for fqn, path in data.items():
        if (
            not isinstance(fqn, str)
            or not isinstance(path, (tuple, list))
            or not all(type(p) in (str, int) for p in path)
        ):
            raise SerializationError(
                f"DCP planner_data entry {fqn!r}: {path!r} is not a path of strings and ints"
            )
        out.append([fqn, list(path)])
    return out


def _encode_storage_meta(meta: StorageMeta | None) -> dict | None:
    if meta is None:
        return None
    cid = meta.checkpoint_id
    return {
        "checkpoint_id": None if cid is None else str(cid),
        "save_id": meta.save_id,
        "load_id": meta.load_id,
        "modules": list(meta.modules),
    }


# ---------------------------------------------------------------- decode


def decode(raw: bytes, path: str, files: list[str]) -> Metadata:
    """Rebuild the ``Metadata`` that :func:`encode` wrote. Every field is checked (types, sizes
    non-negative, chunks inside their tensor, items stored in one of ``files``, the writer's shard
    files); anything else raises CorruptCheckpointError naming ``path`` and the field."""
    doc = fmt.parse_json(raw, path)  # (nested too deep for the caller's stack: no damage)
    r = _Fields(path)
    r.keys(
        doc, "metadata", {"version", "state_dict", "planner_data", "storage_data", "storage_meta"}
    )
    state = {}
    for fqn, item in r.pairs(doc["state_dict"], "state_dict"):
        if fqn in state:
            raise CorruptCheckpointError(f"{path}: state_dict key {fqn!r} appears twice")
        state[fqn] = _decode_item(r, item, f"state_dict[{fqn!r}]")
    return Metadata(
        state_dict_metadata=state,
        planner_data=_decode_planner_data(r, doc["planner_data"]),
        storage_data=_decode_storage_data(r, doc["storage_data"], set(files)),
        storage_meta=_decode_storage_meta(r, doc["storage_meta"]),
        version=r.opt_str(doc["version"], "version"),
    )


def _decode_item(r: "_Fields", item: Any, where: str):
    kind = r.obj(item, where).get("kind")
    if kind == "bytes":
        r.keys(item, where, {"kind"})
        return BytesStorageMetadata()
    if kind != "tensor":
        raise CorruptCheckpointError(
            f"{r.path}: {where}: kind {kind!r}, expected 'tensor' or 'bytes'"
        )
    r.keys(
        item,
        where,
        {
            "kind",
            "dtype",
            "layout",
            "requires_grad",
            "memory_format",
            "pin_memory",
            "size",
            "chunks",
        },
    )
    size = r.shape(item["size"], f"{where}.size")
    chunks = []
    for i, c in enumerate(r.seq(item["chunks"], f"{where}.chunks")):
        cw = f"{where}.chunks[{i}]"
        r.keys(c, cw, {"offsets", "sizes"})
        offsets, sizes = r.shape(c["offsets"], f"{cw}.offsets"), r.shape(c["sizes"], f"{cw}.sizes")
        if (
            len(offsets) != len(size)
            or len(sizes) != len(size)
            or any(o + s > d for o, s, d in zip(offsets, sizes, size))
        ):
            raise CorruptCheckpointError(
                f"{r.path}: {cw}: box at {offsets} of {sizes} is not "
                f"inside the tensor of size {size}"
            )
        chunks.append(ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes)))
    props = TensorProperties(
        dtype=fmt.dtype_from_name(item["dtype"], f"{r.path}: {where}"),
        layout=r.choice(item["layout"], _LAYOUTS, f"{where}.layout"),
        requires_grad=r.flag(item["requires_grad"], f"{where}.requires_grad"),
        memory_format=r.choice(item["memory_format"], _MEMORY_FORMATS, f"{where}.memory_format"),
        pin_memory=r.flag(item["pin_memory"], f"{where}.pin_memory"),
    )
    return TensorStorageMetadata(properties=props, size=torch.Size(size), chunks=chunks)


def _decode_planner_data(r: "_Fields", data: Any) -> dict | None:
    if data is None:
        return None
    out = {}
    for fqn, path in r.pairs(data, "planner_data"):
        steps = r.seq(path, f"planner_data[{fqn!r}]")
        if not all(type(p) is str or (type(p) is int and 0 <= p <= _MAX_INT) for p in steps):
            raise CorruptCheckpointError(
                f"{r.path}: planner_data[{fqn!r}]: expected a path of "
                f"strings and non-negative ints, found {steps!r:.80}"
            )
        out[fqn] = tuple(steps)
    return out


def _decode_storage_data(r: "_Fields", data: Any, files: set[str]) -> dict:
    out = {}
    for i, pair in enumerate(r.seq(data, "storage_data")):
        where = f"storage_data[{i}]"
        if not isinstance(pair, list) or len(pair) != 2:
            raise CorruptCheckpointError(f"{r.path}: {where}: expected [index, info]")
        index, info = pair
        r.keys(index, f"{where}[0]", {"fqn", "offset", "index"})
        offset = None if index["offset"] is None else r.shape(index["offset"], f"{where}.offset")
        hint = None if index["index"] is None else r.integer(index["index"], f"{where}.index")
        key = MetadataIndex(r.string(index["fqn"], f"{where}.fqn"), offset, hint)
        out[key] = _decode_info(r, info, f"{where}[1]", files)
    return out


def _decode_info(r: "_Fields", info: Any, where: str, files: set[str]) -> dict:
    kind = r.obj(info, where).get("kind")
    base = {"kind", "file", "offset", "length", "crc32"}
    tensor = {"dtype", "shape", "frame"} if "frame" in info else {"dtype", "shape"}
    r.keys(info, where, base | tensor if kind == "tensor" else base)
    if kind not in ("tensor", "object"):
        raise CorruptCheckpointError(
            f"{r.path}: {where}: kind {kind!r}, expected 'tensor' or 'object'"
        )
    if info["file"] not in files or not _FILE.match(str(info["file"])):
        raise CorruptCheckpointError(
            f"{r.path}: {where}: file {info['file']!r} is not one of "
            f"the checkpoint's shard files {sorted(files)}"
        )
    out = {
        "kind": kind,
        "file": info["file"],
        "offset": r.integer(info["offset"], f"{where}.offset"),
        "length": r.integer(info["length"], f"{where}.length"),
        "crc32": r.integer(info["crc32"], f"{where}.crc32"),
    }
    if out["crc32"] >> 32:
        raise CorruptCheckpointError(f"{r.path}: {where}: crc32 {out['crc32']} is not 32 bits")
    if kind == "tensor":
        shape = r.shape(info["shape"], f"{where}.shape")
        dtype = fmt.dtype_from_name(info["dtype"], f"{r.path}: {where}")
        numel = 1
        for d in shape:
            numel *= d
        if numel * dtype.itemsize != out["length"]:
            raise CorruptCheckpointError(
                f"{r.path}: {where}: {out['length']} bytes, expected "
                f"{numel * dtype.itemsize} for {info['dtype']} {shape}"
            )
        out.update(dtype=info["dtype"], shape=shape)
        if "frame" in info:
            out["frame"] = _decode_frame(r, info["frame"], f"{where}.frame", out)
    return out


def _decode_frame(r: "_Fields", frame: Any, where: str, info: dict) -> dict:
    """The ``torch.save`` frame around a tensor region (docs/format.md, "Version 3")."""
    r.keys(frame, where, {"offset", "length", "crc32"})
    out = {k: r.integer(frame[k], f"{where}.{k}") for k in ("offset", "length", "crc32")}
    head = frame_head_bytes(info["length"])
    if (
        out["crc32"] >> 32
        or out["offset"] < fmt.HEADER_BYTES
        or out["offset"] + head != info["offset"]
        or out["length"] < head + info["length"]
    ):
        raise CorruptCheckpointError(
            f"{r.path}: {where}: {out} is not a frame around the region "
            f"[{info['offset']}, {info['offset'] + info['length']})"
        )
    return out


def _decode_storage_meta(r: "_Fields", meta: Any) -> StorageMeta | None:
    if meta is None:
        return None
    r.keys(meta, "storage_meta", {"checkpoint_id", "save_id", "load_id", "modules"})
    return StorageMeta(
        checkpoint_id=r.opt_str(meta["checkpoint_id"], "checkpoint_id"),
        save_id=r.opt_str(meta["save_id"], "save_id"),
        load_id=r.opt_str(meta["load_id"], "load_id"),
        modules=[r.string(m, "modules") for m in r.seq(meta["modules"], "modules")],
    )


class _Fields:
    """Checks of JSON values, each raising CorruptCheckpointError naming the file and field."""

    def __init__(self, path: str):
        self.path = path

    def _bad(self, where: str, expected: str, value: Any) -> CorruptCheckpointError:
        return CorruptCheckpointError(
            f"{self.path}: {where}: expected {expected}, found {value!r:.80}"
        )

    def obj(self, value: Any, where: str) -> dict:
        if not isinstance(value, dict):
            raise self._bad(where, "an object", value)
        return value

    def keys(self, value: Any, where: str, keys: set) -> None:
        if set(self.obj(value, where)) != keys:
            raise self._bad(where, f"the fields {sorted(keys)}", sorted(value))

    def seq(self, value: Any, where: str) -> list:
        if not isinstance(value, list):
            raise self._bad(where, "a list", value)
        return value

    def pairs(self, value: Any, where: str) -> list[tuple[str, Any]]:
        out = []
        for i, pair in enumerate(self.seq(value, where)):
            if not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[0], str):
                raise self._bad(f"{where}[{i}]", "a [key, value] pair", pair)
            out.append((pair[0], pair[1]))
        return out

    def integer(self, value: Any, where: str) -> int:
        if type(value) is not int or not 0 <= value <= _MAX_INT:
            raise self._bad(where, "a non-negative integer", value)
        return value

    def shape(self, value: Any, where: str) -> list[int]:
        return [self.integer(d, where) for d in self.seq(value, where)]

    def flag(self, value: Any, where: str) -> bool:
        if type(value) is not bool:
            raise self._bad(where, "true or false", value)
        return value

    def string(self, value: Any, where: str) -> str:
        if not isinstance(value, str):
            raise self._bad(where, "a string", value)
        return value

    def opt_str(self, value: Any, where: str) -> str | None:
        return None if value is None else self.string(value, where)

    def choice(self, value: Any, table: dict, where: str) -> Any:
        if not isinstance(value, str) or value not in table:
            raise self._bad(where, f"one of {sorted(table)}", value)
        return table[value]

"""Folders that ``DatastatesWriter`` wrote (and stock DCP folders), as the tools handle them:
recognize one, verify every byte of it, load all of it into one state dict.

Behind ``datastates list|verify|inspect|export|import`` for DCP folders. Apart from dcp.py
(the storage layer DCP calls during its own save and load) because these run outside DCP's
collective protocol, in one process, on a folder someone may have handed over: nothing here
unpickles unless the caller says the folder is trusted.
"""

from __future__ import annotations

import io
import os
import pickle
from typing import Any, Callable

import torch
from torch.distributed.checkpoint import FileSystemReader, StorageReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

from ..errors import CheckpointNotFoundError, CorruptCheckpointError, UnsafeObjectError
from ..format import codec as fmt
from ..format import files
from ..storage.store import LOCAL, read_regular

from .layer import DatastatesReader, _key
from .metadata import (
    MANIFEST,
    MAX_METADATA_BYTES,
    METADATA,
    PICKLE,
    check_regular,
    check_span,
    read_manifest,
)

__all__ = ["is_folder", "load_state", "verify_folder"]


def is_folder(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder :class:`DatastatesWriter` committed (it holds the manifest)."""
    return os.path.isfile(os.path.join(os.fspath(path), MANIFEST))


def load_state(path: str | os.PathLike, *, trusted: bool = False) -> dict:
    """Every key of a DCP checkpoint as one nested state dict of full tensors (what DCP's
    ``dcp_to_torch_save`` writes), in this process, without a process group.

    A folder :class:`DatastatesWriter` wrote is read through :class:`DatastatesReader`; its
    non-tensor values are loaded with ``torch.load(weights_only=True)`` unless ``trusted``
    (UnsafeObjectError naming the key otherwise). A stock DCP folder (``.metadata``, written by
    ``FileSystemWriter``) is a pickle through and through, so it is read only when ``trusted``
    (UnsafeObjectError otherwise); CheckpointNotFoundError if ``path`` holds neither."""
    path = os.path.abspath(os.fspath(path))
    reader: StorageReader
    if is_folder(path):
        reader = DatastatesReader(path, trusted=trusted)
        reader.read_metadata()  # its errors raised here, not logged with a traceback by DCP
    elif os.path.isfile(os.path.join(path, ".metadata")):
        if not trusted:
            raise UnsafeObjectError(
                f"{path}: a torch.distributed.checkpoint folder keeps its metadata and values as "
                "pickles, and unpickling them can run code from the folder; pass trusted=True "
                "(--trusted) only if you trust where the folder came from"
            )
        reader = FileSystemReader(path)
    else:
        raise CheckpointNotFoundError(
            f"{path}: not a torch.distributed.checkpoint folder (no .metadata and no {MANIFEST})"
        )
    state: dict = {}
    try:
        _load_state_dict(
            state, storage_reader=reader, planner=_StateLoadPlanner(trusted), no_dist=True
        )
    except BaseException as exc:  # DCP wraps each rank's failure in a CheckpointException
        raise _cause(exc) from None
    return state


def verify_folder(path: str | os.PathLike, progress: Callable[[int], None] | None = None) -> int:
    """Re-read every byte a :class:`DatastatesReader` trusts in the folder ``path``: manifest,
    metadata (size, checksum, every field), each shard file's header and index, and every item's
    CRC-32 (the index agreeing with the metadata). Returns the bytes of the shard files;
    ``progress`` is called with increments adding up to that total. CorruptCheckpointError
    naming the file, key and offset on the first mismatch."""
    path = os.path.abspath(os.fspath(path))
    metadata = DatastatesReader(path).read_metadata()
    manifest = read_manifest(path)
    framed = manifest["version"] >= 3
    if framed:
        _verify_pickle(path, manifest)
    by_file: dict[str, list] = {}
    for index, info in metadata.storage_data.items():
        if framed and info["kind"] == "tensor" and "frame" not in info:
            raise CorruptCheckpointError(
                f"{os.path.join(path, METADATA)}: {_key(index)!r} has no frame "
                f"(every tensor of a version-{manifest['version']} folder has one)"
            )
        by_file.setdefault(info["file"], []).append((_key(index), info))
    total = 0
    for name in manifest["files"]:
        total += _verify_file(
            os.path.join(path, name), by_file.get(name, []), progress or (lambda n: None)
        )
    return total


def _verify_pickle(path: str, manifest: dict) -> None:
    """DCP's own ``.metadata`` (never unpickled here): of the size and CRC-32 the manifest says."""
    where = os.path.join(path, PICKLE)
    try:
        blob = read_regular(where, MAX_METADATA_BYTES)
    except FileNotFoundError:
        raise CorruptCheckpointError(f"{where}: missing (the manifest names it)") from None
    if len(blob) != manifest["pickle_bytes"] or fmt.crc32(blob) != manifest["pickle_crc32"]:
        raise CorruptCheckpointError(
            f"{where}: {len(blob)} bytes with CRC-32 {fmt.crc32(blob):08x}, the manifest says "
            f"{manifest['pickle_bytes']} bytes with {manifest['pickle_crc32']:08x}"
        )


def _span(info: dict) -> tuple[int, int]:
    """The bytes an item occupies in its file: a tensor's frame, an object's region."""
    span = info.get("frame", info)
    return span["offset"], span["offset"] + span["length"]


def _verify_frame(f, path: str, key: str, info: dict) -> None:
    """The CRC-32 of a tensor's frame, the bytes around its region."""
    start, end = _span(info)
    region_end = info["offset"] + info["length"]
    crc = fmt.crc32(f.pread(info["offset"] - start, start))
    crc = fmt.crc32(f.pread(end - region_end, region_end), crc)
    if crc != info["frame"]["crc32"]:
        raise CorruptCheckpointError(
            f"{path}: checksum mismatch in the frame of {key!r} at [{start}, {end})"
        )


def _verify_file(path: str, items: list, report) -> int:
    check_regular(path)
    f = LOCAL.open_read(path)
    try:
        header = fmt.read_header(f, path, f.size)
        index = files.parse_index_bytes(
            bytes(f.pread(header.index_length, header.index_offset)), header, path
        )
        regions = {(e.offset, e.nbytes): e for e in index.entries}
        reported, previous_end = 0, fmt.HEADER_BYTES
        for key, info in sorted(items, key=lambda item: item[1]["offset"]):
            start, end = _span(info)
            if start < previous_end or end > header.index_offset:
                raise CorruptCheckpointError(
                    f"{path}: {key!r} spans [{start}, {end}), overlapping the item before it "
                    f"(which ends at {previous_end}) or the index (at {header.index_offset})"
                )
            previous_end = end
            offset, length = info["offset"], info["length"]
            entry = regions.get((offset, length))
            if (
                entry is None
                or entry.key != key
                or tuple(entry.checksums) != (((length, info["crc32"]),) if length else ())
            ):
                raise CorruptCheckpointError(
                    f"{path}: {key!r} at [{offset}, {offset + length}) "
                    "is not the region of the file's index that the "
                    "metadata names"
                )
            check_span(path, offset, length, header.index_offset)
            if fmt.crc32(f.pread(length, offset)) != info["crc32"]:
                raise CorruptCheckpointError(
                    f"{path}: checksum mismatch for {key!r} at offset {offset} ({length} bytes)"
                )
            if "frame" in info:
                _verify_frame(f, path, key, info)
            report(length)
            reported += length
        report(f.size - reported)
        return f.size
    finally:
        f.close()


class _StateLoadPlanner(_EmptyStateDictLoadPlanner):
    """DCP's planner for loading a whole checkpoint into an empty dict, loading non-tensor
    values with ``torch.load(weights_only=not trusted)`` instead of DCP's unconditional
    ``weights_only=False``."""

    def __init__(self, trusted: bool):
        super().__init__()
        self.trusted = trusted

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        fqn = read_item.dest_index.fqn
        obj = _load_value(value, fqn, self.trusted)
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def _load_value(value: io.BytesIO, fqn: str, trusted: bool) -> Any:
    try:
        return torch.load(value, weights_only=not trusted)
    except pickle.UnpicklingError as exc:
        raise UnsafeObjectError(
            f"DCP value {fqn!r} is not loadable with weights_only=True "
            f"({str(exc).splitlines()[0][:200]}); pass trusted=True "
            "(--trusted) only if you trust where the folder came from"
        ) from None


def _cause(exc: BaseException) -> BaseException:
    """The first rank's own error inside DCP's ``CheckpointException``."""
    failures = getattr(exc, "failures", None)
    if isinstance(failures, dict) and failures:
        first = next(iter(failures.values()))
        first = first[0] if isinstance(first, tuple) else first
        if isinstance(first, BaseException):
            return first
    return exc

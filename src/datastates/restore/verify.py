"""Verification of a committed checkpoint: re-read every byte that a reader trusts.

``datastates verify`` and ``Reader.verify_all`` check, for every shard file, the header (CRC,
flags and reserved bytes zero), the index (its CRC against the header and the manifest, and every
manifest entry agreeing with an index entry), every checksum piece of every tensor and object, and
that the bytes between regions are zero (docs/format.md). Nothing is unpickled, and memory is
bounded: reads go in batches of ``BATCH_BYTES`` (plus one checksum piece), zero checks in 1 MiB.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import torch

from ..format import codec as fmt
from ..format import files
from ..errors import CorruptCheckpointError
from .reads import check_landed
from .matching import _Plan, _Read
from ..storage.store import ReadFile
from ..format.records import Manifest, ObjectEntry, ShardIndex

if TYPE_CHECKING:
    from .reader import Reader

BATCH_BYTES = 64 << 20
_ZEROS = bytes(1 << 20)


def verify_checkpoint(reader: Reader, progress: Callable[[int], None] | None = None) -> int:
    """Verify every shard file of ``reader``'s checkpoint; return the bytes checked (the sum of
    the file sizes). Raises CorruptCheckpointError naming the file, offset and key. ``progress``
    is called with the bytes checked so far in increments (every 64 MiB batch, then the rest of
    each file); the increments add up to the returned total."""
    report = progress or (lambda n: None)
    return sum(_verify_file(reader, file_id, report)
               for file_id in range(len(reader.manifest.files)))


def verify_files(reader: Reader, file_ids: list[int]) -> int:
    """:func:`verify_checkpoint` of the shard files ``file_ids`` only."""
    return sum(_verify_file(reader, file_id, lambda n: None) for file_id in file_ids)


def _verify_file(reader: Reader, file_id: int, report: Callable[[int], None]) -> int:
    f, header = reader.files.open_with_header(file_id)
    path = reader.files.path(file_id)
    raw = bytearray(header.index_length)  # bounded: the header was checked against the file size
    f.read_into([memoryview(raw)], header.index_offset)
    index = files.parse_index_bytes(bytes(raw), header, path)
    _check_index_agrees(reader.manifest, file_id, index, path)
    # One buffer for every batch (a batch is BATCH_BYTES plus at most one piece): fresh memory per
    # batch would cost a page fault per 4 KiB, slower than the copy and the CRC of a warm file.
    largest = max((length for e in index.entries for length, _ in e.checksums), default=0)
    data = sum(length for e in index.entries for length, _ in e.checksums)
    pool = torch.empty(min(data, BATCH_BYTES + largest), dtype=torch.uint8)
    batch: list[_Read] = []
    batch_bytes = reported = 0
    for e in index.entries:
        pos = 0
        for length, crc in e.checksums:
            batch.append(_Read(file_id, e.offset + pos, length,
                               pool[batch_bytes:batch_bytes + length], [(length, crc)], e.key))
            pos += length
            batch_bytes += length
            if batch_bytes >= BATCH_BYTES:
                _verify_reads(reader, batch, path)
                report(batch_bytes)
                reported += batch_bytes
                batch, batch_bytes = [], 0
    _verify_reads(reader, batch, path)
    _verify_zero_gaps(f, index, header.index_offset, path)
    total = header.index_offset + header.index_length
    report(total - reported)
    return total


def _verify_reads(reader: Reader, reads: list[_Read], path: str) -> None:
    plan = _Plan(reader, None, False, False)
    plan.reads = reads
    reader._execute(plan)
    if not reader.verify:  # the reader checks what it reads only when it verifies
        for r in reads:
            check_landed(r, path)


def _verify_zero_gaps(f: ReadFile, index: ShardIndex, data_end: int, path: str) -> None:
    """The bytes not covered by a region, from the header to the index, are zero."""
    pos = fmt.HEADER_BYTES
    for e in sorted((e for e in index.entries if e.nbytes), key=lambda e: e.offset):
        _check_zero(f, pos, e.offset, path)
        pos = e.offset + e.nbytes
    _check_zero(f, pos, data_end, path)


def _check_zero(f: ReadFile, start: int, end: int, path: str) -> None:
    buf = bytearray(min(max(end - start, 0), len(_ZEROS)))
    while start < end:
        view = memoryview(buf)[:min(end - start, len(buf))]
        f.read_into([view], start)
        if view != _ZEROS[:view.nbytes]:
            first = next(i for i, b in enumerate(view) if b)
            raise CorruptCheckpointError(f"{path}: byte at offset {start + first} between "
                                         f"regions is {view[first]:#x}, expected 0")
        start += view.nbytes


def _check_index_agrees(manifest: Manifest, file_id: int, index: ShardIndex, path: str) -> None:
    """Every region the manifest names in this file is an index entry with the same key, kind,
    bytes and checksums (and dtype and box shape for tensors)."""
    by_offset = {(e.offset, e.nbytes): e for e in index.entries}
    for offset, nbytes, entry, shard in manifest.by_file[file_id]:
        if isinstance(entry, ObjectEntry):
            _agree(by_offset, entry.key, "object", offset, nbytes,
                   ((nbytes, entry.crc32),) if nbytes else (), None, None, path)
        else:
            _agree(by_offset, entry.key, "tensor", offset, nbytes, shard.checksums, entry.dtype,
                   shard.shape, path)


def _agree(by_offset: dict, key: str, kind: str, offset: int, nbytes: int, checksums: tuple,
           dtype, shape, path: str) -> None:
    found = by_offset.get((offset, nbytes))
    if found is None:
        raise CorruptCheckpointError(f"{path}: the manifest's {kind} {key!r} at [{offset}, "
                                     f"{offset + nbytes}) is not a region of the file's index")
    expected = (key, kind, tuple(checksums), dtype if kind == "tensor" else None,
                tuple(shape) if kind == "tensor" else None)
    actual = (found.key, found.kind, found.checksums, found.dtype if kind == "tensor" else None,
              found.shape if kind == "tensor" else None)
    if expected != actual:
        names = ("key", "kind", "checksums", "dtype", "shape")
        diff = next(n for n, a, b in zip(names, expected, actual) if a != b)
        raise CorruptCheckpointError(f"{path}: {kind} {key!r} at offset {offset}: the manifest "
                                     f"and the index disagree on its {diff}")

"""Verification of a committed checkpoint: re-read every byte that a reader trusts.

``datastates verify`` and ``Reader.verify_all`` check, for every shard file, the header (CRC,
flags and reserved bytes zero), the index (its CRC against the header and the manifest, and every
manifest entry agreeing with an index entry), every checksum piece of every tensor and object, and
that the bytes between regions are zero (docs/format.md). Nothing is unpickled, and memory is
bounded: the checksum pieces are read in spans of at most ``SPAN_BYTES``, several spans at once
(``threads``), each thread streaming its span through one buffer of the file's
``step_bytes`` (1 MiB locally, so the bytes are checksummed while still in the CPU cache); the
zero checks read 1 MiB at a time.
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor, as_completed
from typing import Callable, Sequence

from ..errors import CorruptCheckpointError
from ..format import codec as fmt
from ..format import files, zipframe
from ..format.codec import ShardHeader
from ..format.records import Manifest, ObjectEntry, ShardIndex
from ..storage.store import ReadFile
from .opened import OpenCheckpoint
from .plan import Read
from .reads import COALESCE_GAP, Checker

SPAN_BYTES = 64 << 20  # the longest span one thread reads (a larger piece is a span alone)
_ZEROS = bytes(1 << 20)


def verify_checkpoint(
    ckpt: OpenCheckpoint, progress: Callable[[int], None] | None = None, threads: int = 4
) -> int:
    """Verify every shard file of ``ckpt``; return the bytes checked (the sum of the file sizes).
    Raises CorruptCheckpointError naming the file, offset and key. ``progress`` is called with
    the bytes checked so far in increments (as each span of pieces is checked, then the rest of
    each file); the increments add up to the returned total. ValueError for a rank's view
    (``Manifest.view``): the whole manifest is checked against the files."""
    if ckpt.manifest.view is not None:
        raise ValueError(
            f"{ckpt.dir}: verifying needs the whole manifest, not the view of "
            f"rank {ckpt.manifest.view}"
        )
    report = progress or (lambda n: None)
    return sum(
        _verify_file(ckpt, file_id, report, threads) for file_id in range(len(ckpt.manifest.files))
    )


def verify_files(ckpt: OpenCheckpoint, file_ids: Sequence[int], threads: int = 4) -> int:
    """:func:`verify_checkpoint` of the shard files ``file_ids`` only."""
    return sum(_verify_file(ckpt, file_id, lambda n: None, threads) for file_id in file_ids)


def _verify_file(
    ckpt: OpenCheckpoint, file_id: int, report: Callable[[int], None], threads: int
) -> int:
    f, header = ckpt.files.open_with_header(file_id)
    f.advise_sequential()
    path = ckpt.files.path(file_id)
    raw = bytearray(header.index_length)  # bounded: the header was checked against the file size
    f.read_into([memoryview(raw)], header.index_offset)
    index = files.parse_index_bytes(bytes(raw), header, path)
    _check_index_agrees(ckpt.manifest, file_id, index, path)
    pieces = []
    for e in index.entries:
        pos = 0
        for length, crc in e.checksums:
            if length:
                pieces.append(
                    Read(file_id, e.offset + pos, length, None, [(length, crc)], e.key, pos)
                )
            pos += length
    for e in index.entries:  # a region the index names must lie before the index
        if e.offset + e.nbytes > header.index_offset:
            raise CorruptCheckpointError(
                f"{path}: {e.key!r} at [{e.offset}, "
                f"{e.offset + e.nbytes}) extends past the data ending "
                f"at {header.index_offset}"
            )
    reported = _check_spans(f, _spans(pieces), path, threads, report)
    _verify_zero_gaps(f, index, header, path)
    total = header.end
    report(total - reported)
    return total


def _spans(pieces: list[Read]) -> list[list[Read]]:
    """The pieces in file order, grouped into spans read front to back by one thread: pieces
    at most ``reads.COALESCE_GAP`` apart, a span at most ``SPAN_BYTES`` long (a larger piece
    alone). An overlapping piece (a hostile index) starts a span of its own."""
    spans: list[list[Read]] = []
    end = -1
    for p in sorted(pieces, key=lambda p: p.offset):
        if (
            spans
            and end <= p.offset <= end + COALESCE_GAP
            and p.offset + p.nbytes - spans[-1][0].offset <= SPAN_BYTES
        ):
            spans[-1].append(p)
        else:
            spans.append([p])
        end = p.offset + p.nbytes
    return spans


def _check_spans(
    f: ReadFile, spans: list[list[Read]], path: str, threads: int, report: Callable[[int], None]
) -> int:
    """Check every span's pieces, ``threads`` spans at once, each thread streaming its bytes
    through one reused buffer of ``f.step_bytes`` (memory: a buffer per thread, whatever the
    pieces' sizes; the bytes are checksummed while in the CPU cache). ``report`` is called on
    this thread as spans finish; returns the bytes reported. The first failure raises, and
    spans not yet started are not read."""
    scratch = threading.local()

    def check(span: list[Read]) -> int:
        buf = getattr(scratch, "buf", None)
        if buf is None:
            buf = scratch.buf = memoryview(bytearray(f.step_bytes))
        _check_span(f, span, path, buf)
        return sum(p.nbytes for p in span)

    done = 0
    if threads <= 1 or len(spans) <= 1:
        for span in spans:
            n = check(span)
            report(n)
            done += n
        return done
    with ThreadPoolExecutor(
        min(threads, len(spans)), thread_name_prefix="datastates-verify"
    ) as pool:
        futures = [pool.submit(check, span) for span in spans]
        try:
            for future in as_completed(futures):
                n = future.result()
                report(n)
                done += n
        except BaseException:
            for future in futures:
                future.cancel()
            raise
    return done


def _check_span(f: ReadFile, span: list[Read], path: str, buf: memoryview) -> None:
    """Read the bytes of ``span`` (disjoint pieces in file order) through ``buf``, window by
    window, feeding each piece's bytes to its checksum as they land."""
    pos, end = span[0].offset, max(p.offset + p.nbytes for p in span)
    k, checker = 0, None
    while pos < end:
        window = buf[: min(buf.nbytes, end - pos)]
        f.read_into([window], pos)
        stop = pos + window.nbytes
        while k < len(span) and span[k].offset < stop:
            p = span[k]
            lo, hi = max(p.offset, pos) - pos, min(p.offset + p.nbytes, stop) - pos
            if checker is None:
                checker = Checker(p, path)
            checker.feed(window[lo:hi])
            if p.offset + p.nbytes > stop:
                break
            checker.finish()
            k, checker = k + 1, None
        pos = stop


def _verify_zero_gaps(f: ReadFile, index: ShardIndex, header: ShardHeader, path: str) -> None:
    """The bytes not covered by a region, from the header to the index, are zero -- but, in a
    version-3 file, the ZIP framing: each tensor's local header slot and the index record's
    local header are what a writer makes of the index, and the tail has its CRC-32."""
    slots = {}
    if header.version >= 3:
        tensors = sorted((e.offset, e.nbytes) for e in index.entries if e.kind == "tensor")
        slots = dict(zipframe.slot_bytes(tensors))
        at = header.index_offset - zipframe.SLOT
        slots[at] = zipframe.local_header(
            zipframe.INDEX_RECORD, header.index_length, zipframe.SLOT, header.index_crc32
        )
    pos = fmt.HEADER_BYTES
    regions = [(e.offset, e.nbytes) for e in index.entries if e.nbytes]
    regions += [(at, len(data)) for at, data in slots.items()]
    for offset, nbytes in sorted(regions):
        _check_zero(f, pos, offset, path)
        if offset in slots:
            _check_slot(f, offset, slots.pop(offset), path)
        pos = max(pos, offset + nbytes)
    _check_zero(f, pos, header.index_offset, path)
    if header.version >= 3:
        _check_zero(f, header.index_offset + header.index_length, header.tail_offset, path)
        tail = bytearray(header.tail_length)  # bounded by the header's check
        f.read_into([memoryview(tail)], header.tail_offset)
        if fmt.crc32(tail) != header.tail_crc32:
            raise CorruptCheckpointError(
                f"{path}: the tail at {header.tail_offset} "
                f"({header.tail_length} bytes) fails its CRC-32"
            )


def _check_slot(f: ReadFile, at: int, expected: bytes, path: str) -> None:
    found = bytearray(len(expected))
    f.read_into([memoryview(found)], at)
    if found != expected:
        raise CorruptCheckpointError(
            f"{path}: the ZIP local header at offset {at} is not the one the index makes"
        )


def _check_zero(f: ReadFile, start: int, end: int, path: str) -> None:
    buf = bytearray(min(max(end - start, 0), len(_ZEROS)))
    while start < end:
        view = memoryview(buf)[: min(end - start, len(buf))]
        f.read_into([view], start)
        if view != _ZEROS[: view.nbytes]:
            first = next(i for i, b in enumerate(view) if b)
            raise CorruptCheckpointError(
                f"{path}: byte at offset {start + first} between "
                f"regions is {view[first]:#x}, expected 0"
            )
        start += view.nbytes


def _check_index_agrees(manifest: Manifest, file_id: int, index: ShardIndex, path: str) -> None:
    """Every region the manifest names in this file is an index entry with the same key, kind,
    bytes and checksums (and dtype and box shape for tensors)."""
    by_offset = {(e.offset, e.nbytes): e for e in index.entries}
    for offset, nbytes, entry, shard in manifest.by_file[file_id]:
        if isinstance(entry, ObjectEntry):
            _agree(
                by_offset,
                entry.key,
                "object",
                offset,
                nbytes,
                ((nbytes, entry.crc32),) if nbytes else (),
                None,
                None,
                path,
            )
        else:
            assert shard is not None  # Manifest.by_file: a tensor's region is one of its shards
            _agree(
                by_offset,
                entry.key,
                "tensor",
                offset,
                nbytes,
                shard.checksums,
                entry.dtype,
                shard.shape,
                path,
            )


def _agree(
    by_offset: dict,
    key: str,
    kind: str,
    offset: int,
    nbytes: int,
    checksums: tuple,
    dtype,
    shape,
    path: str,
) -> None:
    found = by_offset.get((offset, nbytes))
    if found is None:
        raise CorruptCheckpointError(
            f"{path}: the manifest's {kind} {key!r} at [{offset}, "
            f"{offset + nbytes}) is not a region of the file's index"
        )
    expected = (
        key,
        kind,
        tuple(checksums),
        dtype if kind == "tensor" else None,
        tuple(shape) if kind == "tensor" else None,
    )
    actual = (
        found.key,
        found.kind,
        found.checksums,
        found.dtype if kind == "tensor" else None,
        found.shape if kind == "tensor" else None,
    )
    if expected != actual:
        names = ("key", "kind", "checksums", "dtype", "shape")
        diff = next(n for n, a, b in zip(names, expected, actual) if a != b)
        raise CorruptCheckpointError(
            f"{path}: {kind} {key!r} at offset {offset}: the manifest "
            f"and the index disagree on its {diff}"
        )

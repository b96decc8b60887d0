"""The ordinary per-tensor entries of a manifest and of a rank report, each parsed in one
function: where a checkpoint of many small tensors spends its parsing.

An entry is ordinary when it is a tensor (not an object) held whole or in shards of the usual
form, and valid. Each function here takes the decoded JSON of one entry and returns its record
when every check of the general parser of ``validate.py`` passes on it, else None -- the general
parser then checks the entry again and names what is wrong. So ``validate.py`` keeps the one
definition of every rule (exact types, ranges, offsets inside the file, boxes inside the tensor
and the bytes of each box, checksum pieces covering each region); these follow it, written out
without a call or an error path per field, and tests hold them to it on mutated entries
(tests/unit/test_many_tensors.py).

Pure: no I/O.
"""
from __future__ import annotations

from typing import Any

from . import codec as fmt
from .checks import MAX_NDIM, _U32, _U64
from .records import FileRef, ReportEntry, ShardRef, TensorEntry

_ITEMSIZES = fmt.ITEMSIZES


def tensor_entry(e: Any, files: tuple[FileRef, ...], world: int) -> TensorEntry | None:
    """The manifest entry ``e`` of a tensor as its record, or None (``validate._entry`` decides):
    the checks of ``validate._entry`` and ``validate._shard``, for a manifest of ``world`` ranks
    whose shard files are ``files``."""
    if type(e) is not dict or e.get("kind") != "tensor":
        return None
    key, dtype, shards = e.get("key"), e.get("dtype"), e.get("shards")
    if type(key) is not str or type(dtype) is not str or type(shards) is not list or \
            not shards:
        return None
    itemsize = _ITEMSIZES.get(dtype)
    shape = _dims(e.get("shape"))
    if itemsize is None or shape is None:
        return None
    refs, stored = [], 0
    for s in shards:
        ref = _shard(s, files, shape, itemsize)
        if ref is None:
            return None
        refs.append(ref)
        stored += ref.nbytes
    numel = 1
    for n in shape:
        numel *= n
    replicated, rank = e.get("replicated", False), e.get("rank")
    if numel * itemsize > stored or type(replicated) is not bool or (
            rank is not None and (type(rank) is not int or not 0 <= rank < world)):
        return None
    return TensorEntry(key, dtype, shape, tuple(refs), replicated, rank)


def _shard(s: Any, files: tuple[FileRef, ...], shape: tuple[int, ...],
                 itemsize: int) -> ShardRef | None:
    """One shard of :func:`tensor_entry`, or None."""
    if type(s) is not dict:
        return None
    file_id, offset, nbytes = s.get("file"), s.get("offset"), s.get("nbytes")
    if type(file_id) is not int or type(offset) is not int or type(nbytes) is not int or \
            not 0 <= file_id < len(files):
        return None
    size = files[file_id].nbytes
    if not fmt.HEADER_BYTES <= offset <= size or offset % fmt.DATA_ALIGN or \
            not 0 <= nbytes <= size - offset:
        return None
    box, origin = _dims(s.get("shape")), _dims(s.get("global_offset"))
    if box is None or origin is None or len(box) != len(shape) or len(origin) != len(shape):
        return None
    numel = 1
    for o, n, g in zip(origin, box, shape):
        if o + n > g:
            return None
        numel *= n
    pieces = _pieces(s.get("checksums"), nbytes)
    if numel * itemsize != nbytes or pieces is None:
        return None
    return ShardRef(file_id, offset, nbytes, origin, box, pieces)


def _pieces(found: Any, nbytes: int) -> tuple[tuple[int, int], ...] | None:
    """Checksum pieces covering ``nbytes`` exactly (the checks of ``checks._pieces``), or None."""
    if type(found) is not list:
        return None
    pieces, total = [], 0
    for p in found:
        if type(p) is not list or len(p) != 2:
            return None
        length, crc = p
        if type(length) is not int or type(crc) is not int or not 1 <= length <= nbytes or \
                not 0 <= crc <= _U32:
            return None
        total += length
        pieces.append((length, crc))
    return tuple(pieces) if total == nbytes else None


def _dims(value: Any) -> tuple[int, ...] | None:
    """``value`` as a shape (a list of at most MAX_NDIM integers in [0, 2**64)), or None."""
    if type(value) is not list or len(value) > MAX_NDIM:
        return None
    for d in value:
        if type(d) is not int or not 0 <= d <= _U64:
            return None
    return tuple(value)


def sorted_disjoint(regions) -> bool:
    """Whether the non-empty regions (offset, nbytes, ...), sorted by offset, do not overlap
    (what ``checks._check_disjoint`` checks, without sorting again)."""
    end = 0
    for region in regions:
        if region[1]:
            if region[0] < end:
                return False
            end = region[0] + region[1]
    return True


def report_entry(e: Any, f: FileRef) -> ReportEntry | None:
    """The report entry ``e`` of a tensor its rank wrote, not a shard of a global one, as its
    record, or None (``validate._report_entry`` decides): the checks of
    ``validate._report_entry`` for a report whose shard file is ``f``."""
    if type(e) is not dict or e.get("kind") != "tensor" or e.get("global_shape") is not None:
        return None
    key, dtype, offset, nbytes = e.get("key"), e.get("dtype"), e.get("offset"), e.get("nbytes")
    replicated, written = e.get("replicated", False), e.get("written", True)
    if type(key) is not str or type(dtype) is not str or type(replicated) is not bool or \
            written is not True or type(offset) is not int or type(nbytes) is not int:
        return None
    itemsize, shape = _ITEMSIZES.get(dtype), _dims(e.get("shape"))
    if itemsize is None or shape is None or not fmt.HEADER_BYTES <= offset <= f.nbytes or \
            offset % fmt.DATA_ALIGN or not 0 <= nbytes <= f.nbytes - offset:
        return None
    numel = 1
    for n in shape:
        numel *= n
    pieces = _pieces(e.get("checksums"), nbytes)
    if numel * itemsize != nbytes or pieces is None:
        return None
    return ReportEntry(key, "tensor", True, offset, nbytes, dtype, shape, pieces,
                       replicated=replicated)

"""The ordinary per-tensor entries of a manifest and of a rank report, each parsed in one
function: where a checkpoint of many small tensors spends its parsing.

An entry is ordinary when it is a tensor (not an object) held whole or in shards of the usual
form, and valid. Each function here takes the decoded JSON of one entry and returns its record
when every check of the general parser of ``validate.py`` passes on it, else None -- the general
parser then checks the entry again and names what is wrong. So ``validate.py`` keeps the one
definition of every rule (exact types, ranges, offsets inside the file, boxes inside the tensor
and the bytes of each box, checksum pieces covering each region; the tiling of a tensor by its
boxes is ``tiling.py``'s, called from both); these follow it, written out without a call or an
error path per field, and tests hold them to it on mutated entries
(tests/unit/test_many_tensors.py). The writer's side is the same in reverse:
:func:`tensor_entry_json` takes the record of a manifest entry about to be written and gives its
bytes when the reader's :func:`tensor_entry` would read them back as that record, else None (the
writer then takes the general path: JSON form, parse, compare), and :func:`report_entry_json`
writes a rank's own report entry into its shard file's index (the encoder's bytes, or None).

Pure: no I/O.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from typing import TypeGuard  # Python 3.10

from . import codec as fmt
from .checks import MAX_DIM, MAX_NDIM, _U32
from .tiling import tiled
from .records import FileRef, ReportEntry, ShardRef, TensorEntry

_ITEMSIZES = fmt.ITEMSIZES


def tensor_entry(e: Any, files: tuple[FileRef, ...], world: int) -> TensorEntry | None:
    """The manifest entry ``e`` of a tensor as its record, or None (``validate._entry`` decides):
    the checks of ``validate._entry`` and ``validate._shard``, for a manifest of ``world`` ranks
    whose shard files are ``files``."""
    if type(e) is not dict or e.get("kind") != "tensor":
        return None
    key, dtype, shards = e.get("key"), e.get("dtype"), e.get("shards")
    if type(key) is not str or type(dtype) is not str or type(shards) is not list or not shards:
        return None
    itemsize = _ITEMSIZES.get(dtype)
    shape = _dims(e.get("shape"))
    if itemsize is None or shape is None:
        return None
    refs, stored = [], 0
    for s in shards:
        ref = _box(s, files, shape, itemsize)  # the commonest shard, else the general one
        if ref is None:
            ref = _shard(s, files, shape, itemsize)
            if ref is None:
                return None
        refs.append(ref)
        stored += ref.nbytes
    replicated, rank = e.get("replicated", False), e.get("rank")
    # the shards store at least the tensor's bytes, and tile it (one box of its shape lies
    # inside it at its origin: the commonest entry, told at once)
    if (
        _numel(shape) * itemsize > stored
        or not _owner_fields(replicated, rank, world)
        or (len(refs) != 1 or refs[0].shape != shape)
        and not tiled(shape, refs)
    ):
        return None
    return TensorEntry(key, dtype, shape, tuple(refs), replicated, rank)


def _box(
    s: Any, files: tuple[FileRef, ...], shape: tuple[int, ...], itemsize: int
) -> ShardRef | None:
    """The decoded shard ``s`` as its record when :func:`_is_box` accepts its fields, else None
    (the caller then asks :func:`_shard`, which decides). A shard holding the whole tensor
    shares ``shape`` and a tuple of zeros with every other such shard."""
    if type(s) is not dict:
        return None
    fields: tuple[Any, ...] = (
        s.get("file"),
        s.get("offset"),
        s.get("nbytes"),
        s.get("global_offset"),
        s.get("shape"),
        s.get("checksums"),
    )
    if not _is_box(fields, files, shape, itemsize, list):
        return None
    file_id, offset, nbytes, origin, box, sums = fields
    box = tuple(box)
    return ShardRef(
        file_id,
        offset,
        nbytes,
        tuple(origin) if any(origin) else _ZEROS[len(shape)],
        shape if box == shape else box,
        ((nbytes, sums[0][1]),),
    )


def _is_box(
    fields: tuple[Any, ...],
    files: tuple[FileRef, ...],
    shape: tuple[int, ...],
    itemsize: int,
    form: type[list] | type[tuple],
) -> bool:
    """Whether the shard whose fields are ``fields`` (file, offset, nbytes, global offset, shape,
    checksums: each box and the checksum pieces as they come, in ``form``) is of the commonest
    kind -- one region checked by one checksum piece, a box inside the tensor of ``shape``
    (the whole tensor, or a rank's part of it) -- and valid: the checks of
    :func:`_shard_fields` for that kind, in one frame."""
    file_id, offset, nbytes, origin, box, sums = fields
    if (
        type(origin) is not form
        or type(box) is not form
        or type(sums) is not form
        or len(sums) != 1
        or len(box) != len(shape)
        or len(origin) != len(shape)
    ):
        return False
    numel = 1
    for o, n, g in zip(origin, box, shape):
        if type(o) is not int or type(n) is not int or o < 0 or n < 0 or o + n > g:
            return False
        numel *= n
    piece = sums[0]
    if type(piece) is not form or len(piece) != 2:
        return False
    length, crc = piece
    return (
        type(length) is int
        and type(crc) is int
        and length == nbytes
        and length >= 1
        and 0 <= crc <= _U32
        and _in_file(file_id, offset, nbytes, files)
        and numel * itemsize == nbytes
    )


_ZEROS = [(0,) * n for n in range(MAX_NDIM + 1)]  # the origin of a tensor held whole, shared


def tensor_entry_json(e: Any, files: tuple[FileRef, ...], world: int) -> bytes | None:
    """The encoded JSON form (``codec.encode_json(e.to_json())``) of the tensor entry record
    ``e`` when :func:`tensor_entry` reads that form back as a record equal to ``e``, else None
    (the writer's check then takes the general path and names what is wrong). The checks of
    :func:`tensor_entry` on the record's own fields, and the bytes written out directly: a
    writer checks and encodes a million entries without their dicts and lists."""
    if type(e) is not TensorEntry:
        return None
    key, dtype, shape, shards, replicated, rank = e
    itemsize = _ITEMSIZES.get(dtype) if type(dtype) is str else None
    if (
        type(key) is not str
        or itemsize is None
        or not _is_dims(shape)
        or type(shards) is not tuple
        or not shards
    ):
        return None
    dims = _ints(shape)
    parts, stored = [], 0
    for s in shards:
        if type(s) is ShardRef and _is_box(s, files, shape, itemsize, tuple):
            file_id, offset, nbytes, origin, box, ((_, crc),) = s  # the commonest shard
            parts.append(
                f'{{"file":{file_id},"offset":{offset},"nbytes":{nbytes},'
                f'"global_offset":[{_ints(origin)}],"shape":['
                f"{dims if box == shape else _ints(box)}],"
                f'"checksums":[[{nbytes},{crc}]]}}'
            )
        elif (
            type(s) is not ShardRef
            or not _is_dims(s.global_offset)
            or not _is_dims(s.shape)
            or _shard_fields(s, files, shape, itemsize, tuple) is None
        ):
            return None
        else:
            parts.append(_shard_text(s))
        stored += s.nbytes
    # the shards store at least the tensor's bytes, and tile it (as in tensor_entry)
    if (
        _numel(shape) * itemsize > stored
        or not _owner_fields(replicated, rank, world)
        or (len(shards) != 1 or shards[0].shape != shape)
        and not tiled(shape, shards)
    ):
        return None
    tail = (',"replicated":true' if replicated else "") + (
        "" if rank is None else f',"rank":{int.__repr__(rank)}'
    )
    return (
        f'{{"kind":"tensor","key":{_string(key)},"dtype":{_string(dtype)},"shape":['
        f'{dims}],"shards":[{",".join(parts)}]{tail}}}'
    ).encode()


def _owner_fields(replicated: Any, rank: Any, world: int) -> bool:
    """The checks of a tensor entry's ``replicated`` and ``rank`` fields."""
    return type(replicated) is bool and (rank is None or type(rank) is int and 0 <= rank < world)


def _shard(
    s: Any, files: tuple[FileRef, ...], shape: tuple[int, ...], itemsize: int
) -> ShardRef | None:
    """One shard of :func:`tensor_entry`, or None."""
    if type(s) is not dict:
        return None
    return _shard_fields(
        (
            s.get("file"),
            s.get("offset"),
            s.get("nbytes"),
            _dims(s.get("global_offset")),
            _dims(s.get("shape")),
            s.get("checksums"),
        ),
        files,
        shape,
        itemsize,
        list,
    )


def _shard_fields(
    fields: tuple,
    files: tuple[FileRef, ...],
    shape: tuple[int, ...],
    itemsize: int,
    form: type[list] | type[tuple],
) -> ShardRef | None:
    """The shard whose fields are ``fields`` (file, offset, nbytes, global offset, shape,
    checksums; the two boxes already shapes or None, the checksum pieces in ``form``: list
    from JSON, tuple in a record) as its record, or None."""
    file_id, offset, nbytes, origin, box, checksums = fields
    if origin is None or box is None or not _in_file(file_id, offset, nbytes, files):
        return None
    numel = _fits(origin, box, shape)
    pieces = _pieces(checksums, nbytes, form)
    if numel is None or numel * itemsize != nbytes or pieces is None:
        return None
    return ShardRef(file_id, offset, nbytes, origin, box, pieces)


def _shard_text(s: ShardRef) -> str:
    """The JSON text of a checked shard record (``encode_json(s.to_json())``)."""
    return (
        f'{{"file":{s.file},"offset":{s.offset},"nbytes":{s.nbytes},"global_offset":['
        f'{_ints(s.global_offset)}],"shape":[{_ints(s.shape)}],"checksums":['
        f"{_sums(s.checksums)}]}}"
    )


def _sums(pieces: tuple[tuple[int, int], ...]) -> str:
    """Checked (length, crc32) pieces as the items of a JSON array."""
    return ",".join([f"[{length},{crc}]" for length, crc in pieces])


def _in_file(file_id: Any, offset: Any, nbytes: Any, files: tuple[FileRef, ...]) -> bool:
    """Whether ``[offset, offset + nbytes)`` of file ``file_id`` is a region the format allows:
    integers, the file one of ``files``, the region aligned and inside its data."""
    if (
        type(file_id) is not int
        or type(offset) is not int
        or type(nbytes) is not int
        or not 0 <= file_id < len(files)
    ):
        return False
    size = files[file_id].nbytes
    return (
        fmt.HEADER_BYTES <= offset <= size
        and not offset % fmt.DATA_ALIGN
        and 0 <= nbytes <= size - offset
    )


def _fits(origin: tuple[int, ...], box: tuple[int, ...], shape: tuple[int, ...]) -> int | None:
    """The elements of the box ``box`` at ``origin`` when it lies inside ``shape`` (with its
    number of dimensions), else None."""
    if len(box) != len(shape) or len(origin) != len(shape):
        return None
    numel = 1
    for o, n, g in zip(origin, box, shape):
        if o + n > g:
            return None
        numel *= n
    return numel


def _numel(shape: tuple[int, ...]) -> int:
    numel = 1
    for n in shape:
        numel *= n
    return numel


def _pieces(
    found: Any, nbytes: int, form: type[list] | type[tuple] = list
) -> tuple[tuple[int, int], ...] | None:
    """Checksum pieces covering ``nbytes`` exactly (the checks of ``checks._pieces``), each
    piece and their sequence of type ``form``, as a tuple of pairs; or None."""
    if type(found) is not form:
        return None
    pieces, total = [], 0
    for p in found:
        if type(p) is not form or len(p) != 2:
            return None
        length, crc = p
        if (
            type(length) is not int
            or type(crc) is not int
            or not 1 <= length <= nbytes
            or not 0 <= crc <= _U32
        ):
            return None
        total += length
        pieces.append((length, crc))
    return tuple(pieces) if total == nbytes else None


def _dims(value: Any) -> tuple[int, ...] | None:
    """``value`` as a shape (a list of at most MAX_NDIM integers in [0, 2**64)), or None."""
    return tuple(value) if type(value) is list and _all_dims(value) else None


def _is_dims(value: Any) -> TypeGuard[tuple[int, ...]]:
    """Whether ``value`` is a shape as :func:`_dims` makes one (a tuple)."""
    return type(value) is tuple and _all_dims(value)


def _all_dims(values) -> bool:
    """At most MAX_NDIM items, each an integer in [0, 2**63) (``checks.MAX_DIM``)."""
    if len(values) > MAX_NDIM:
        return False
    for d in values:
        if type(d) is not int or not 0 <= d <= MAX_DIM:
            return False
    return True


def _ints(values: tuple[int, ...]) -> str:
    """Exact ints (checked by the caller) as the items of a JSON array (what ``json.dumps``
    writes for each). One or two, most shapes and offsets, written by an f-string, which costs
    less than the join (0.14–0.17 µs against 0.65–0.82 µs for one int on the 2-core VM;
    docs/benchmarks-history.md, "One-off probes")."""
    if len(values) == 1:
        return f"{values[0]}"
    if len(values) == 2:
        return f"{values[0]},{values[1]}"
    return ",".join(map(int.__repr__, values))


_string = json.encoder.encode_basestring_ascii  # what encode_json writes for a str


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
    """The report entry ``e`` of a tensor as its record, or None (``validate._report_entry``
    decides): the checks of ``validate._report_entry`` for a report whose shard file is ``f``,
    for a tensor held whole or a shard of a global tensor, written by this rank or not."""
    if type(e) is not dict or e.get("kind") != "tensor":
        return None
    key, dtype, shape = e.get("key"), e.get("dtype"), _dims(e.get("shape"))
    replicated, written = e.get("replicated", False), e.get("written", True)
    if (
        type(key) is not str
        or type(dtype) is not str
        or type(replicated) is not bool
        or type(written) is not bool
        or shape is None
    ):
        return None
    itemsize = _ITEMSIZES.get(dtype)
    if itemsize is None:
        return None
    global_shape = global_offset = None
    if e.get("global_shape") is not None:
        global_shape, global_offset = _dims(e["global_shape"]), _dims(e.get("global_offset"))
        if (
            global_shape is None
            or global_offset is None
            or _fits(global_offset, shape, global_shape) is None
        ):
            return None
    if not written:
        if not replicated and global_shape is None:
            return None
        return ReportEntry(
            key,
            "tensor",
            False,
            None,
            None,
            dtype,
            shape,
            (),
            None,
            global_shape,
            global_offset,
            replicated,
        )
    offset, nbytes = e.get("offset"), e.get("nbytes")
    if not _in_file(0, offset, nbytes, (f,)) or _numel(shape) * itemsize != nbytes:
        return None
    pieces = _pieces(e.get("checksums"), nbytes)
    if pieces is None:
        return None
    return ReportEntry(
        key,
        "tensor",
        True,
        offset,
        nbytes,
        dtype,
        shape,
        pieces,
        None,
        global_shape,
        global_offset,
        replicated,
    )


def report_entry_json(e: ReportEntry) -> str | None:
    """The JSON text (``codec.encode_json(e.to_json())``, as str) of the report entry ``e`` of
    a tensor this rank wrote, for its shard file's index, when every field has the exact type
    this rank's own records give it; else None (the writer then encodes ``e.to_json()``).
    Written out directly: the index of a save of many small tensors is encoded without a dict
    and a JSON encoder pass per tensor."""
    (
        key,
        kind,
        written,
        offset,
        nbytes,
        dtype,
        shape,
        checksums,
        _,
        global_shape,
        global_offset,
        replicated,
    ) = e
    if (
        kind != "tensor"
        or written is not True
        or type(key) is not str
        or type(dtype) is not str
        or type(offset) is not int
        or type(nbytes) is not int
        or type(replicated) is not bool
        or not _is_dims(shape)
        or type(checksums) is not tuple
    ):
        return None
    for piece in checksums:
        if (
            type(piece) is not tuple
            or len(piece) != 2
            or type(piece[0]) is not int
            or type(piece[1]) is not int
        ):
            return None
    extra = ""
    if global_shape is not None:
        if not _is_dims(global_shape) or not _is_dims(global_offset):
            return None
        extra = f',"global_shape":[{_ints(global_shape)}],"global_offset":[{_ints(global_offset)}]'
    if replicated:
        extra += ',"replicated":true'
    return (
        f'{{"key":{_string(key)},"kind":"tensor","dtype":{_string(dtype)},"shape":['
        f'{_ints(shape)}]{extra},"offset":{offset},"nbytes":{nbytes},"checksums":['
        f"{_sums(checksums)}]}}"
    )

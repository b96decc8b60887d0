"""Pure planning: where every item goes in a rank's shard file, and which rank writes what.

No I/O, no process group: sizes in, layout out, so it is unit-tested directly.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .format import DATA_ALIGN, HEADER_BYTES, UNIT_ALIGN, align_up


@dataclass(frozen=True)
class Piece:
    """``nbytes`` of item ``item`` starting at ``item_offset``, placed at ``unit_offset`` in a unit."""

    item: int
    item_offset: int
    unit_offset: int
    nbytes: int


@dataclass
class Unit:
    """One contiguous file range copied into one cache slot and written with one request."""

    file_offset: int
    nbytes: int = 0
    pieces: list[Piece] = field(default_factory=list)


@dataclass
class Layout:
    units: list[Unit]
    #: File offset of each tensor item (index into the sizes given), and of each blob.
    tensor_offsets: list[int]
    blob_offsets: list[int]
    #: Where the index starts (4096-aligned, after tensors and blobs).
    index_offset: int

    def pieces_by_item(self) -> dict[int, list[Piece]]:
        out: dict[int, list[Piece]] = {}
        for unit in self.units:
            for piece in unit.pieces:
                out.setdefault(piece.item, []).append(piece)
        return out


def plan_layout(tensor_sizes: list[int], blob_sizes: list[int], unit_bytes: int) -> Layout:
    """Coalesce tensors into units of at most ``unit_bytes``.

    Small tensors are packed into one unit at 64-byte alignment; a tensor that does not fit the
    current unit starts a new one on a 4096 boundary; a tensor larger than a unit is split over
    consecutive full units (contiguous in the file). Blobs follow the tensor data on a 4096 boundary, then the index.
    """
    if unit_bytes <= 0 or unit_bytes % UNIT_ALIGN:
        raise ValueError(f"unit_bytes must be a positive multiple of {UNIT_ALIGN}, got {unit_bytes}")
    units: list[Unit] = []
    offsets = [0] * len(tensor_sizes)
    end = HEADER_BYTES  # end of data written so far

    def new_unit() -> Unit:
        unit = Unit(align_up(end, UNIT_ALIGN))
        units.append(unit)
        return unit

    unit: Unit | None = None
    for item, size in enumerate(tensor_sizes):
        if size == 0:
            offsets[item] = align_up(end, DATA_ALIGN)
            continue
        pos = align_up(unit.nbytes, DATA_ALIGN) if unit is not None else 0
        if unit is None or pos + size > unit_bytes:
            unit, pos = new_unit(), 0
        offsets[item] = unit.file_offset + pos
        done = 0
        while done < size:
            n = min(size - done, unit_bytes - pos)
            unit.pieces.append(Piece(item, done, pos, n))
            unit.nbytes = pos + n
            done += n
            end = unit.file_offset + unit.nbytes
            if done < size:
                unit, pos = new_unit(), 0
    blob_offsets = []
    # Blobs start on a fresh 4096 boundary: the last unit may be written padded (O_DIRECT).
    end = align_up(end, UNIT_ALIGN)
    for size in blob_sizes:
        blob_offsets.append(end)
        end = align_up(end + size, DATA_ALIGN)
    return Layout(units, offsets, blob_offsets, align_up(max(end, HEADER_BYTES), UNIT_ALIGN))


def assign_replicated(sizes_per_key: dict[str, int], world_size: int,
                      preloaded: list[int] | None = None) -> dict[str, int]:
    """Spread replicated items over ranks: largest first to the least-loaded rank.

    Deterministic (ties broken by key, then by rank), so every rank computes the same answer from
    the same inputs without communicating. ``preloaded`` is each rank's bytes of non-replicated data.
    """
    load = list(preloaded) if preloaded is not None else [0] * world_size
    owner: dict[str, int] = {}
    for key, size in sorted(sizes_per_key.items(), key=lambda kv: (-kv[1], kv[0])):
        rank = min(range(world_size), key=lambda r: (load[r], r))
        owner[key] = rank
        load[rank] += size
    return owner

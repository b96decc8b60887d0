"""Pure planning: where every item goes in a rank's shard file, and which rank writes each
replicated tensor.

No I/O, no process group: sizes, reports and trees in, answers out, so it is unit-tested directly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..format.codec import DATA_ALIGN, HEADER_BYTES, UNIT_ALIGN, align_up
from ..format.zipframe import SLOT, slot_of

#: A piece of a unit: ``(item, item_offset, unit_offset, nbytes)``, the ``nbytes`` of tensor
#: ``item`` from ``item_offset`` on, placed at ``unit_offset`` in the unit. A plain tuple of ints,
#: not a named one: a layout holds one per tensor, and the garbage collector stops tracking a
#: plain tuple of ints at its first pass, where it keeps scanning a named tuple (a subclass) for
#: as long as the save lives -- with 100k tensors, a full collection inside ``save()``.
Piece = tuple[int, int, int, int]


@dataclass
class Unit:
    """One contiguous file range copied into one cache slot and written with one request."""

    file_offset: int
    nbytes: int = 0
    pieces: list[Piece] = field(default_factory=list)  #: in the order of their items
    #: ZIP local header slots in the unit, ``(unit_offset, k, nbytes)``: the slot of the
    #: ``k``-th tensor of the file, of ``nbytes`` (format version 3; ``format/zipframe.py``)
    slots: list[tuple[int, int, int]] = field(default_factory=list)

    @property
    def end(self) -> int:
        """Where the unit's write ends: its bytes padded to ``UNIT_ALIGN`` (O_DIRECT writes)."""
        return self.file_offset + align_up(self.nbytes, UNIT_ALIGN)


@dataclass
class Layout:
    units: list[Unit]
    #: File offset of each tensor item (index into the sizes given), and of each blob.
    tensor_offsets: list[int]
    blob_offsets: list[int]
    #: Where the index starts (4096-aligned, after tensors and blobs).
    index_offset: int
    #: Whether the file is framed as a ZIP archive (format version 3).
    framed: bool = False


def plan_layout(
    tensor_sizes: list[int], blob_sizes: list[int], unit_bytes: int, framed: bool = False
) -> Layout:
    """Coalesce tensors into a dense stream cut into units of ``unit_bytes``.

    Every tensor starts at a 64-byte aligned offset right after the previous one; a tensor that
    crosses a unit boundary continues in the next unit (a piece per unit). Units are contiguous
    in the file from offset 4096, so the whole state needs ``ceil(bytes / unit_bytes)`` cache
    slots and every unit is one aligned write. Blobs follow on a 4096 boundary, then the index.
    ``framed`` (format version 3): each tensor is preceded by its ZIP local header slot (64
    bytes, 128 from 4 GiB; docs/format.md, "Shard file version 3"), planned in the unit that
    holds it -- but the first tensor's, which ends the header block (the first tensor stays at
    4096) -- and the index by 64 bytes for its own.
    """
    if unit_bytes <= 0 or unit_bytes % UNIT_ALIGN:
        raise ValueError(
            f"unit_bytes must be a positive multiple of {UNIT_ALIGN}, got {unit_bytes}"
        )
    units: list[Unit] = []
    offsets = [0] * len(tensor_sizes)
    pos = 0  # offset in the data stream, which starts at HEADER_BYTES in the file
    base = 0  # where the last unit starts in the stream
    for item, size in enumerate(tensor_sizes):
        if framed and item == 0:  # at 4096: its slot ends the header block (finish_file)
            pass
        elif framed:
            slot = slot_of(size)
            pos = (pos + slot + slot - 1) // slot * slot
            index = (pos - slot) // unit_bytes
            while len(units) <= index:
                units.append(Unit(HEADER_BYTES + len(units) * unit_bytes))
            base = index * unit_bytes
            unit = units[index]
            unit.slots.append((pos - slot - base, item, size))
            unit.nbytes = max(unit.nbytes, pos - base)  # a slot never crosses a unit's end
        else:
            pos = (pos + DATA_ALIGN - 1) // DATA_ALIGN * DATA_ALIGN
        offsets[item] = HEADER_BYTES + pos
        if units and 0 < size <= base + unit_bytes - pos:  # one piece, in the last unit
            unit = units[-1]
            unit.pieces.append((item, 0, pos - base, size))
            pos += size
            unit.nbytes = pos - base
            continue
        done = 0
        while done < size:
            index, within = divmod(pos, unit_bytes)
            while len(units) <= index:
                units.append(Unit(HEADER_BYTES + len(units) * unit_bytes))
            base = index * unit_bytes
            n = min(size - done, unit_bytes - within)
            unit = units[index]
            unit.pieces.append((item, done, within, n))
            unit.nbytes = within + n
            pos += n
            done += n
    end = HEADER_BYTES + pos
    blob_offsets = []
    # Blobs start on a fresh 4096 boundary: the last unit may be written padded (O_DIRECT).
    end = align_up(end, UNIT_ALIGN)
    for size in blob_sizes:
        blob_offsets.append(end)
        end = align_up(end + size, DATA_ALIGN)
    if framed:
        end += SLOT  # the index record's local header
    return Layout(
        units, offsets, blob_offsets, align_up(max(end, HEADER_BYTES), UNIT_ALIGN), framed
    )


def assign_replicated(
    sizes_per_key: dict[str, int], world_size: int, preloaded: list[int] | None = None
) -> dict[str, int]:
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


def units_holding(layout, count: int) -> int:
    """How many leading units of ``layout`` hold pieces of its first ``count`` tensors."""
    held = 0
    for number, unit in enumerate(layout.units):
        if unit.pieces and unit.pieces[0][0] < count:  # a unit's pieces follow item order
            held = number + 1
    return held

"""The pure planning functions: file layout and replicated-item assignment."""
from __future__ import annotations

import pytest

from datastates.format import HEADER_BYTES
from datastates.planning import assign_replicated, plan_layout

UNIT = 16 << 10


def covered(layout, item):
    return sorted((p.item_offset, p.nbytes) for u in layout.units for p in u.pieces if p.item == item)


def test_small_tensors_are_packed_into_one_unit_at_64_byte_alignment():
    layout = plan_layout([10, 100, 1000], [], UNIT)
    assert len(layout.units) == 1
    assert layout.tensor_offsets == [HEADER_BYTES, HEADER_BYTES + 64, HEADER_BYTES + 192]
    assert layout.units[0].nbytes == 192 + 1000


def test_tensor_larger_than_unit_is_split_contiguously():
    size = 3 * UNIT + 5
    layout = plan_layout([100, size, 7], [], UNIT)
    pieces = covered(layout, 1)
    assert sum(n for _, n in pieces) == size
    assert [o for o, _ in pieces] == [0, UNIT, 2 * UNIT, 3 * UNIT]
    starts = [u.file_offset for u in layout.units]
    assert all(s % 4096 == 0 for s in starts)
    # contiguous in the file: the split units follow each other without gaps
    big_units = [u for u in layout.units if any(p.item == 1 for p in u.pieces)]
    for a, b in zip(big_units, big_units[1:]):
        assert a.file_offset + a.nbytes == b.file_offset
    assert all(u.nbytes <= UNIT for u in layout.units)


def test_units_do_not_overlap_and_blobs_and_index_follow():
    layout = plan_layout([5000, 9000, 0, 20000, 1], [33, 4000], UNIT)
    spans = sorted((u.file_offset, u.file_offset + u.nbytes) for u in layout.units)
    for (a0, a1), (b0, b1) in zip(spans, spans[1:]):
        assert a1 <= b0
    assert layout.blob_offsets[0] % 4096 == 0 and layout.blob_offsets[0] >= spans[-1][1]
    assert layout.blob_offsets[1] >= layout.blob_offsets[0] + 33
    assert layout.index_offset % 4096 == 0 and layout.index_offset >= layout.blob_offsets[1] + 4000


def test_empty_state_has_an_index_after_the_header():
    layout = plan_layout([], [], UNIT)
    assert layout.units == [] and layout.index_offset == HEADER_BYTES


def test_rejects_unaligned_unit():
    with pytest.raises(ValueError):
        plan_layout([1], [], 1000)


def test_replicated_assignment_is_balanced_and_deterministic():
    sizes = {f"k{i}": s for i, s in enumerate([100, 90, 80, 70, 10, 10, 5])}
    owner = assign_replicated(sizes, 3)
    assert owner == assign_replicated(dict(reversed(list(sizes.items()))), 3)
    load = [sum(sizes[k] for k, r in owner.items() if r == rank) for rank in range(3)]
    assert max(load) - min(load) <= 100
    assert set(owner.values()) == {0, 1, 2}

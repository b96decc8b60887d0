"""The pure planning functions: file layout and replicated-item assignment."""

from __future__ import annotations

import math

import pytest

from datastates.format.codec import HEADER_BYTES
from datastates.save.planning import assign_replicated, plan_layout

UNIT = 16 << 10


def pieces_of(layout, item):
    return sorted(
        (begin, nbytes) for u in layout.units for it, begin, _, nbytes in u.pieces if it == item
    )


def test_small_tensors_are_packed_into_one_unit_at_64_byte_alignment():
    layout = plan_layout([10, 100, 1000], [], UNIT)
    assert len(layout.units) == 1
    assert layout.tensor_offsets == [HEADER_BYTES, HEADER_BYTES + 64, HEADER_BYTES + 192]
    assert layout.units[0].nbytes == 192 + 1000


def test_units_are_dense_so_the_state_needs_the_fewest_slots():
    sizes = [UNIT // 2 + 100] * 7 + [3 * UNIT + 5, 7]
    layout = plan_layout(sizes, [], UNIT)
    stream = layout.tensor_offsets[-1] + sizes[-1] - HEADER_BYTES
    assert len(layout.units) == math.ceil(stream / UNIT)
    for k, unit in enumerate(layout.units):
        assert unit.file_offset == HEADER_BYTES + k * UNIT  # contiguous, 4096-aligned writes
        assert unit.nbytes <= UNIT
    assert all(u.nbytes == UNIT for u in layout.units[:-1])


def test_every_tensor_is_covered_exactly_once_in_file_order():
    sizes = [5000, 3 * UNIT + 5, 0, 20000, 1, UNIT]
    layout = plan_layout(sizes, [], UNIT)
    for item, size in enumerate(sizes):
        pieces = pieces_of(layout, item)
        assert sum(n for _, n in pieces) == size
        assert [o for o, _ in pieces] == [sum(n for _, n in pieces[:i]) for i in range(len(pieces))]
        assert layout.tensor_offsets[item] % 64 == 0
    for unit in layout.units:
        for item, begin, at, _ in unit.pieces:  # where a piece sits matches the tensor's offset
            assert unit.file_offset + at == layout.tensor_offsets[item] + begin


def test_blobs_and_index_follow_the_data():
    layout = plan_layout([5000, 9000, 0, 20000, 1], [33, 4000], UNIT)
    data_end = max(u.file_offset + u.nbytes for u in layout.units)
    assert layout.blob_offsets[0] % 4096 == 0 and layout.blob_offsets[0] >= data_end
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

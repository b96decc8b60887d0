"""The general tiling check (``format/tiling.py``): which boxes overlap, decided exactly, in
O(n log n) where the boxes differ in at most two dimensions, and within a bounded number of
comparisons otherwise -- a hostile manifest of irregular shards cannot stall a reader."""

from __future__ import annotations

import itertools
import random

import pytest

from datastates import CorruptCheckpointError
from datastates.commit.review import check_tiling
from datastates.format import codec, plain, validate
from datastates.format.checks import _At
from datastates.format.records import FileRef, Manifest, ShardRef, TensorEntry
from datastates.format.tiling import (
    COMPARISONS_PER_BOX,
    MAX_COMPARISONS,
    TooIrregular,
    overlapping,
    tiled,
    tiling_fault,
    volume,
)


def _meet(a, b) -> bool:
    return all(
        max(oa, ob) < min(oa + na, ob + nb) for oa, na, ob, nb in zip(a[0], a[1], b[0], b[1])
    )


def _pairs(found) -> set:
    return {frozenset((a[2], b[2])) for a, b in found}


def _random_boxes(rng: random.Random):
    """Up to 12 boxes of one to four dimensions with small origins and extents (some empty),
    one dimension sometimes held whole by every box: every way boxes can touch or overlap."""
    ndim = rng.randint(1, 4)
    same = rng.randrange(ndim) if ndim > 2 and rng.random() < 0.5 else None
    boxes = []
    for i in range(rng.randint(0, 12)):
        origin = tuple(0 if d == same else rng.randint(0, 5) for d in range(ndim))
        extent = tuple(3 if d == same else rng.choice([0, 1, 1, 2, 3]) for d in range(ndim))
        boxes.append((origin, extent, i))
    return boxes


def test_every_overlapping_pair_is_found_and_no_other():
    """Against comparing every pair: the same pairs, whatever the layout (two dimensions or
    fewer that differ take the O(n log n) path first, the others the sweep)."""
    rng = random.Random(11)
    overlapped = 0
    for _ in range(4000):
        boxes = _random_boxes(rng)
        want = {
            frozenset((a[2], b[2]))
            for a, b in itertools.combinations(boxes, 2)
            if _meet(a, b) and all(a[1]) and all(b[1])
        }
        assert _pairs(overlapping(boxes)) == want, boxes
        overlapped += bool(want)
    assert overlapped > 1000


def _bricks(rows: int, per_row: int, width: int = 16) -> list:
    """Rows of height 1 cut into bricks, each row's cuts shifted: an exact tiling that is
    neither slabs nor a grid, whose every column crosses every row (the case that made the
    sweep quadratic)."""
    boxes = []
    for r in range(rows):
        cuts = sorted(
            {0, per_row * width, *((r * 7) % width + k * width for k in range(1, per_row))}
        )
        boxes += [((r, a), (1, b - a), len(boxes)) for a, b in zip(cuts, cuts[1:])]
    return boxes


def _shards(boxes) -> tuple:
    """The boxes as shards of four ranks' files, each its own region of its file."""
    out, ends = [], [codec.HEADER_BYTES] * 4
    for i, (off, box, *_) in enumerate(boxes):
        nbytes = 4 * volume(box)
        out.append(
            ShardRef(
                file=i % 4,
                offset=ends[i % 4],
                nbytes=nbytes,
                global_offset=tuple(off),
                shape=tuple(box),
                checksums=((nbytes, 0),) if nbytes else (),
            )
        )
        ends[i % 4] += codec.align_up(max(nbytes, 1), codec.DATA_ALIGN)
    return tuple(out)


def _manifest(shape, boxes) -> Manifest:
    shards = _shards(boxes)
    ends = [max((s.offset + s.nbytes for s in shards if s.file == r), default=0) for r in range(4)]
    files = tuple(
        FileRef(name=codec.shard_file_name(r), rank=r, nbytes=ends[r], index_crc32=0)
        for r in range(4)
    )
    entry = TensorEntry(key="w", dtype="float32", shape=tuple(shape), shards=shards)
    return Manifest(
        version=3,
        name="step-1",
        step=1,
        seq=1,
        created_unix=0.0,
        world_size=4,
        metadata={},
        files=files,
        entries={0: entry},
        ranks=(),
    )


def test_forty_thousand_bricks_tile_and_one_moved_brick_is_named():
    """40,000 bricks in 200 rows: an exact tiling for the review and the readers (the sweep
    compared each brick with the 200 rows it crosses: 11 s; now O(n log n)). One brick made
    one column wider: the overlap is named."""
    boxes = _bricks(200, 200)
    shape = (200, 200 * 16)
    assert (
        tiling_fault(shape, _shards(boxes)) is None and check_tiling(_manifest(shape, boxes)) == []
    )
    (r, a), (h, w), i = boxes[5000]
    boxes[5000] = ((r, a), (h, w + 1), i)
    fault = tiling_fault(shape, _shards(boxes))
    nxt = boxes[5001][0][1]
    assert (
        fault == f"boxes [{r}:{r + 1}, {a}:{a + w + 1}] and [{r}:{r + 1}, {nxt}:"
        f"{boxes[5001][0][1] + boxes[5001][1][1]}] overlap"
    )
    problems = check_tiling(_manifest(shape, boxes))
    assert len(problems) == 1 and "which overlap" in problems[0][1]


def _bricks_3d(n: int, width: int = 16) -> tuple[tuple, list]:
    """n x n rows along the last dimension, each cut into n bricks at shifted columns: an exact
    tiling whose boxes differ in all three dimensions."""
    boxes = []
    for r, q in itertools.product(range(n), range(n)):
        cuts = sorted({0, n * width, *(((r * n + q) * 7) % width + k * width for k in range(1, n))})
        boxes += [((r, q, a), (1, 1, b - a)) for a, b in zip(cuts, cuts[1:])]
    return (n, n, n * width), boxes


def test_a_small_irregular_layout_of_three_dimensions_is_checked():
    shape, boxes = _bricks_3d(8)
    assert tiled(shape, _shards(boxes)) and check_tiling(_manifest(shape, boxes)) == []


def test_too_irregular_a_layout_is_refused_by_the_review_and_by_both_parsers():
    """8,000 bricks differing in three dimensions need more comparisons than the budget: the
    review names every rank holding a box, and a reader's two parsers refuse the entry -- a
    decision, not minutes of checking."""
    shape, boxes = _bricks_3d(20)
    budget = MAX_COMPARISONS + COMPARISONS_PER_BOX * len(boxes)
    with pytest.raises(TooIrregular, match=f"its 8000 boxes .* within {budget} comparisons"):
        list(overlapping(boxes))
    fault = tiling_fault(shape, _shards(boxes))
    assert (
        fault == f"its 8000 boxes are neither slabs nor a grid and too irregular to check "
        f"within {budget} comparisons"
    )
    manifest = _manifest(shape, boxes)
    assert check_tiling(manifest) == [
        ([0, 1, 2, 3], f"the shards of 'w' (shape {list(shape)}): {fault}")
    ]
    value = manifest.entries[0].to_json()
    assert plain.tensor_entry(value, manifest.files, 4) is None  # left to the general parser
    with pytest.raises(CorruptCheckpointError, match="do not tile its shape .* too irregular"):
        validate._entry(value, _At("m"), manifest.files, 4)


def test_many_boxes_all_overlapping_give_a_bounded_answer():
    """5,000 copies of one box: 12.5 million overlapping pairs. A reader stops at the first;
    the enumeration stops within its budget, having named some."""
    boxes = [((0,), (10,), i) for i in range(5000)]
    assert tiling_fault((10,), _shards(boxes)) == "boxes [0:10] and [0:10] overlap"
    found = list(overlapping(boxes))
    assert 0 < len(found) <= MAX_COMPARISONS + COMPARISONS_PER_BOX * len(boxes)
    assert all(_meet(a, b) for a, b in found)


def test_a_two_dimensional_layout_crossing_too_many_boxes_is_refused():
    """100,000 boxes that all cross one another's sweep line, each new one ordered first: the
    ordered set moved n^2/4 entries (40 s at 400,000 boxes); past the budget of boxes
    crossed the layout is refused as too irregular, by the same rule for writer and readers."""
    n = 100_000
    boxes = [((i, n - i), (2 * n, 1), i) for i in range(n)]
    with pytest.raises(TooIrregular, match="its 100000 boxes .* crossed at once"):
        list(overlapping(boxes))
    assert "too irregular to check" in tiling_fault((3 * n, 2 * n), _shards(boxes))

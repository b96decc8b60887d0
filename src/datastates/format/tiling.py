"""The tiling of a tensor by its shards: the boxes (an origin and a shape: ``global_offset`` and
``shape`` of a shard record) must cover its global shape exactly, every element in exactly one
non-empty box. One definition for the writer's review (``commit/review.py``) and every reader
(``validate.py``, ``plain.py``): a reader accepts exactly the layouts a writer commits. Fast
paths tell the common layouts in one pass (one whole box, slabs along one dimension, the cells
of a grid); the general check sweeps for overlaps.

Pure: no I/O.
"""

from __future__ import annotations

import bisect
import heapq


def slabs(shape: tuple[int, ...], shards) -> bool:
    """Whether the boxes of ``shards`` are one box holding the whole tensor of ``shape``, or
    slabs of it along one dimension (whole in every other) laid end to end from 0 to its
    extent: an exact tiling, the layout of nearly every tensor, told in one pass. False leaves
    the boxes to the general check (:func:`tiling_fault`, which finds no fault where this
    says True)."""
    if not shards:
        return False
    first = shards[0]
    if len(shards) == 1 and first.shape == shape and not any(first.global_offset):
        return True  # the commonest: one box, the whole tensor (a scalar too)
    ndim = len(shape)
    if not ndim or len(first.shape) != ndim:
        return False
    dim = 0  # the dimension of the slabs: the first in which the first box is not whole
    while dim < ndim and first.shape[dim] == shape[dim]:
        dim += 1
    if dim == ndim:
        dim = 0
    after = dim + 1
    lo, hi = shape[:dim], shape[after:]
    zeros_lo, zeros_hi = (0,) * dim, (0,) * (ndim - after)
    spans = []
    for s in shards:  # (slices compared whole: a frame per box costs more than the check)
        off, box = s.global_offset, s.shape
        if (
            len(off) != ndim
            or len(box) != ndim
            or box[after:] != hi
            or off[after:] != zeros_hi
            or dim
            and (box[:dim] != lo or off[:dim] != zeros_lo)
        ):
            return False
        spans.append((off[dim], box[dim]))
    spans.sort()
    end = 0
    for o, n in spans:
        if o != end or n < 0:
            return False
        end = o + n
    return end == shape[dim]


def grid(shape: tuple[int, ...], shards) -> bool:
    """Whether the non-empty boxes of ``shards`` are the cells of a grid, each once: every
    dimension cut into intervals laid end to end from 0 to its extent, each box one interval of
    each dimension (a tensor sharded along several dimensions at once: tensor parallel within
    data parallel, a 2-D mesh). An exact tiling, told in O(n) for n boxes; False leaves the
    boxes to the general check (as :func:`slabs`)."""
    ndim = len(shape)
    spans: list[dict] = [{} for _ in range(ndim)]  # per dimension: start -> length
    cells = set()
    for s in shards:
        off, box = s.global_offset, s.shape
        if len(off) != ndim or len(box) != ndim:
            return False
        if 0 in box:
            continue  # an empty box holds no element
        for d in range(ndim):
            if spans[d].setdefault(off[d], box[d]) != box[d]:
                return False  # two intervals start at one offset
        cells.add(off)
    count = 1
    for d in range(ndim):
        end = 0
        for o, n in sorted(spans[d].items()):
            if o != end or n < 0:
                return False
            end = o + n
        if end != shape[d]:
            return False
        count *= len(spans[d])
    return len(cells) == count == sum(0 not in s.shape for s in shards)


def tiling_fault(shape: tuple[int, ...], shards) -> str | None:
    """What keeps the boxes of ``shards``, each inside the tensor of ``shape`` (with its number
    of dimensions), from tiling it exactly: the first two non-empty boxes found to overlap, or
    the elements no box covers, or that they are too irregular to check (:class:`TooIrregular`);
    None when they tile it. The general check, for any layout."""
    boxes = [(s.global_offset, s.shape) for s in shards]
    try:
        pair = next(overlapping(boxes), None)
    except TooIrregular as exc:
        return str(exc)
    if pair is not None:
        return f"boxes {box_text(*pair[0])} and {box_text(*pair[1])} overlap"
    covered = sum(volume(box) for _, box in boxes)
    if covered == volume(shape):
        return None
    shown = ", ".join(box_text(*b) for b in sorted(boxes)[:8])
    return (
        f"its {len(boxes)} boxes {shown}{', ...' if len(boxes) > 8 else ''} cover "
        f"{covered} of its {volume(shape)} elements: a gap"
    )


def tiled(shape: tuple[int, ...], shards) -> bool:
    """Whether the boxes of ``shards`` (each inside the tensor of ``shape``) tile it exactly."""
    return slabs(shape, shards) or grid(shape, shards) or tiling_fault(shape, shards) is None


def check_tiling(key: str, shape: tuple[int, ...], shards, at) -> None:
    """The boxes of tensor ``key``'s ``shards``, each inside its ``shape``, tile it exactly
    (CorruptCheckpointError naming the key and the boxes otherwise, at the JSON path ``at``, a
    ``checks._At``)."""
    if not slabs(shape, shards) and not grid(shape, shards):
        fault = tiling_fault(shape, shards)
        if fault is not None:
            raise (at / "shards").bad(
                f"the shards of tensor {key!r} do not tile its shape {list(shape)}: {fault}"
            )


#: The general check's budget of box comparisons for one tensor, beyond :data:`COMPARISONS_PER_BOX`
#: per box: a layout of three or more dimensions that is neither slabs nor a grid, and so
#: irregular that the sweep would compare more pairs than this, is refused as too irregular to
#: check (:class:`TooIrregular`) rather than checked for minutes (refused in about 7 s per
#: million boxes on a 2-core machine, about what parsing their records costs). Writers and
#: readers apply one rule, so a reader accepts exactly what a writer commits.
MAX_COMPARISONS = 1 << 18
COMPARISONS_PER_BOX = 8
#: The check of layouts differing in at most two dimensions (O(n log n) comparisons) has a
#: budget too: the boxes crossed at each step of its sweep, summed, beyond
#: :data:`SHIFTS_PER_BOX` per box (what keeping them ordered moves in memory: n^2/4 for a
#: hostile layout of n boxes). Real layouts cross few boxes at once (40,000 bricks in 200
#: rows: 8 million); past the budget (about a second) the layout is refused as too irregular.
MAX_SHIFTS = 1 << 28
SHIFTS_PER_BOX = 256


class TooIrregular(Exception):
    """The general tiling check gave up: the boxes need more than their budget of comparisons
    (:data:`MAX_COMPARISONS`) or of crossed boxes (:data:`MAX_SHIFTS`). The message says how
    many boxes, and the budget."""


def overlapping(boxes: list):
    """The pairs of non-empty boxes among ``boxes`` (tuples whose first two items are an origin
    and a shape, of one number of dimensions) that share an element, as they are found. A
    generator: a caller wanting one pair stops at the first.

    Where the boxes differ in one or two dimensions only (every box holding the same interval of
    the others): decided in O(n log n) comparisons (a sweep keeping the boxes it crosses ordered
    along the other dimension; :class:`TooIrregular` past ``MAX_SHIFTS + SHIFTS_PER_BOX * n``
    boxes crossed, summed); where there is an overlap, the pairs are then enumerated by the general
    sweep, up to its budget (at least one pair is always yielded). Three or more: the general
    sweep along the dimension with the most distinct offsets, which compares each box
    with the boxes it crosses, within a budget of ``MAX_COMPARISONS + COMPARISONS_PER_BOX * n``
    comparisons; past it, :class:`TooIrregular` if no overlap was found yet (undecided), else
    the enumeration stops (the pairs found are the answer)."""
    boxes = [b for b in boxes if volume(b[1])]
    if len(boxes) < 2:
        return
    ndim = len(boxes[0][0])
    if ndim == 0:
        for b in boxes[1:]:
            yield boxes[0], b
        return
    # a dimension in which every box holds the same interval decides nothing: left out
    dims = [d for d in range(ndim) if len({(b[0][d], b[1][d]) for b in boxes}) > 1] or [0]
    dim = max(dims, key=lambda d: len({b[0][d] for b in boxes}))
    first = None
    if len(dims) <= 2:
        first = _first_overlap_planar(boxes, dim, next((d for d in dims if d != dim), None))
        if first is None:
            return
    budget = MAX_COMPARISONS + COMPARISONS_PER_BOX * len(boxes)
    found = False
    try:
        for pair in _sweep(boxes, dim, budget):
            found = True
            yield pair
    except TooIrregular:
        if first is not None and not found:
            yield first
        elif not found:
            raise
        return


def _sweep(boxes: list, dim: int, budget: int):
    """Every overlapping pair, by a sweep along ``dim`` comparing each box with the boxes it
    crosses there; TooIrregular once more than ``budget`` comparisons were made."""
    ndim = len(boxes[0][0])
    active: list = []
    spent = 0
    for b in sorted(boxes, key=lambda b: b[0][dim]):
        spent += 2 * len(active) + 1
        if spent > budget:
            raise TooIrregular(
                f"its {len(boxes)} boxes are neither slabs nor a grid and too "
                f"irregular to check within {budget} comparisons"
            )
        active = [a for a in active if a[0][dim] + a[1][dim] > b[0][dim]]
        for a in active:
            if all(
                max(a[0][d], b[0][d]) < min(a[0][d] + a[1][d], b[0][d] + b[1][d])
                for d in range(ndim)
            ):
                yield a, b
        active.append(b)


def _first_overlap_planar(boxes: list, dim: int, other: int | None):
    """One overlapping pair of the non-empty boxes, or None, where only the dimensions ``dim``
    and ``other`` (None: only ``dim``) tell boxes apart: a sweep along ``dim`` keeping the boxes
    it crosses ordered by their start in ``other``. Boxes crossed at one point of the sweep
    must be disjoint in ``other``, so a new box need only be compared with its two neighbours
    there: O(n log n) comparisons, and TooIrregular once the crossed boxes, summed over the
    sweep, pass the budget (each insertion and deletion moves them)."""
    starts: list[int] = []  # the crossed boxes' starts in the other dimension, ascending
    crossing: dict[int, tuple] = {}  # start -> (end, box)
    ends: list[tuple] = []  # heap of (end along dim, order, start)
    budget, shifted = MAX_SHIFTS + SHIFTS_PER_BOX * len(boxes), 0
    for i, b in enumerate(sorted(boxes, key=lambda b: b[0][dim])):
        at = b[0][dim]
        shifted += len(starts)  # what an insertion or a deletion below moves, at most
        if shifted > budget:
            raise TooIrregular(
                f"its {len(boxes)} boxes are neither slabs nor a grid and too "
                f"irregular to check: more than {budget} of them crossed at "
                "once, summed over the sweep"
            )
        while ends and ends[0][0] <= at:
            lo = heapq.heappop(ends)[2]
            del starts[bisect.bisect_left(starts, lo)]
            del crossing[lo]
        lo, hi = (b[0][other], b[0][other] + b[1][other]) if other is not None else (0, 1)
        j = bisect.bisect_right(starts, lo)
        if j and crossing[starts[j - 1]][0] > lo:
            return crossing[starts[j - 1]][1], b
        if j < len(starts) and starts[j] < hi:
            return crossing[starts[j]][1], b
        starts.insert(j, lo)
        crossing[lo] = (hi, b)
        heapq.heappush(ends, (at + b[1][dim], i, lo))
    return None


def volume(shape) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def box_text(off, box) -> str:
    """The box at ``off`` of shape ``box`` as slices: ``[0:4, 2:3]``."""
    return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(off, box)) + "]"

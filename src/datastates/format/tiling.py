"""The tiling of a tensor by its shards: the boxes (an origin and a shape: ``global_offset`` and
``shape`` of a shard record) must cover its global shape exactly, every element in exactly one
non-empty box. One definition for the writer's review (``commit/review.py``) and every reader
(``validate.py``, ``plain.py``): a reader accepts exactly the layouts a writer commits. Fast
paths tell the common layouts in one pass (one whole box, slabs along one dimension, the cells
of a grid); the general check sweeps for overlaps.

Pure: no I/O.
"""
from __future__ import annotations

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
        if len(off) != ndim or len(box) != ndim or box[after:] != hi or \
                off[after:] != zeros_hi or dim and (box[:dim] != lo or off[:dim] != zeros_lo):
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
    the elements no box covers; None when they tile it. The general check, for any layout."""
    boxes = [(s.global_offset, s.shape) for s in shards]
    pair = next(overlapping(boxes), None)
    if pair is not None:
        return f"boxes {box_text(*pair[0])} and {box_text(*pair[1])} overlap"
    covered = sum(volume(box) for _, box in boxes)
    if covered == volume(shape):
        return None
    shown = ", ".join(box_text(*b) for b in sorted(boxes)[:8])
    return (f"its {len(boxes)} boxes {shown}{', ...' if len(boxes) > 8 else ''} cover "
            f"{covered} of its {volume(shape)} elements: a gap")


def tiled(shape: tuple[int, ...], shards) -> bool:
    """Whether the boxes of ``shards`` (each inside the tensor of ``shape``) tile it exactly."""
    return slabs(shape, shards) or grid(shape, shards) or \
        tiling_fault(shape, shards) is None


def check_tiling(key: str, shape: tuple[int, ...], shards, at) -> None:
    """The boxes of tensor ``key``'s ``shards``, each inside its ``shape``, tile it exactly
    (CorruptCheckpointError naming the key and the boxes otherwise, at the JSON path ``at``, a
    ``checks._At``)."""
    if not slabs(shape, shards) and not grid(shape, shards):
        fault = tiling_fault(shape, shards)
        if fault is not None:
            raise (at / "shards").bad(f"the shards of tensor {key!r} do not tile its shape "
                                      f"{list(shape)}: {fault}")


def overlapping(boxes: list):
    """The pairs of non-empty boxes among ``boxes`` (tuples whose first two items are an origin
    and a shape, of one number of dimensions) that share an element, as they are found: a sweep
    along the dimension with the most distinct offsets, so row or column shardings cost
    O(n log n). A generator: a caller wanting one pair stops at the first."""
    boxes = [b for b in boxes if volume(b[1])]
    if len(boxes) < 2:
        return
    ndim = len(boxes[0][0])
    if ndim == 0:
        for b in boxes[1:]:
            yield boxes[0], b
        return
    dim = max(range(ndim), key=lambda d: len({b[0][d] for b in boxes}))
    active: list = []
    for b in sorted(boxes, key=lambda b: b[0][dim]):
        active = [a for a in active if a[0][dim] + a[1][dim] > b[0][dim]]
        for a in active:
            if all(max(a[0][d], b[0][d]) < min(a[0][d] + a[1][d], b[0][d] + b[1][d])
                   for d in range(ndim)):
                yield a, b
        active.append(b)


def volume(shape) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def box_text(off, box) -> str:
    """The box at ``off`` of shape ``box`` as slices: ``[0:4, 2:3]``."""
    return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(off, box)) + "]"



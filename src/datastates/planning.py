"""Pure planning: where every item goes in a rank's shard file, which rank writes what, whether
the ranks' reports form one consistent global plan (checked by rank 0 at commit), and which saved
state is per rank (checked when restoring at another world size).

No I/O, no process group: sizes, reports and trees in, answers out, so it is unit-tested directly.
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
    """Coalesce tensors into a dense stream cut into units of ``unit_bytes``.

    Every tensor starts at a 64-byte aligned offset right after the previous one; a tensor that
    crosses a unit boundary continues in the next unit (a piece per unit). Units are contiguous
    in the file from offset 4096, so the whole state needs ``ceil(bytes / unit_bytes)`` cache
    slots and every unit is one aligned write. Blobs follow on a 4096 boundary, then the index.
    """
    if unit_bytes <= 0 or unit_bytes % UNIT_ALIGN:
        raise ValueError(f"unit_bytes must be a positive multiple of {UNIT_ALIGN}, got {unit_bytes}")
    units: list[Unit] = []
    offsets = [0] * len(tensor_sizes)
    pos = 0  # offset in the data stream, which starts at HEADER_BYTES in the file
    for item, size in enumerate(tensor_sizes):
        pos = align_up(pos, DATA_ALIGN)
        offsets[item] = HEADER_BYTES + pos
        done = 0
        while done < size:
            index, within = divmod(pos, unit_bytes)
            while len(units) <= index:
                units.append(Unit(HEADER_BYTES + len(units) * unit_bytes))
            n = min(size - done, unit_bytes - within)
            unit = units[index]
            unit.pieces.append(Piece(item, done, within, n))
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


# ---------------------------------------------------------------- per-rank state (resharding)

#: How a restore at another world size treats per-rank state: "strict" raises ReshardError,
#: "rank0" gives every rank saved rank 0's, "same" gives rank r saved rank r's (rank 0's if
#: there is no saved rank r).
RANK_POLICIES = ("strict", "rank0", "same")


def per_rank_keys(trees: list[dict], entries: list, keys: list[str] | None) -> list[str]:
    """Keys whose saved state differs between the saved ranks: Python values, objects and
    tensors kept per rank whose bytes differ, or a structure present on some ranks only.

    Global state (sharded or replicated tensors: one entry shared by every rank's tree) and
    per-rank copies with identical bytes are not per-rank. A list or tuple is named as a whole.
    ``keys`` (prefixes, as in
    ``restore(keys=...)``) restricts the answer to the requested keys; None means all.
    """
    out: list[str] = []
    _differ(trees, (), entries, keys, out)
    return out


def _differ(nodes: list[dict], path: tuple, entries: list, keys, out: list[str]) -> None:
    scope = _scope(path, keys)
    if scope is None:
        return
    kinds = {n["t"] for n in nodes}
    if len(kinds) > 1 or (kinds & {"provider"} and len({n["name"] for n in nodes}) > 1):
        out.append(_key(path))
        return
    kind = kinds.pop()
    if kind in ("dict", "odict"):
        maps = [dict((k, v) for k, v in n["items"]) for n in nodes]
        for k in dict.fromkeys(k for m in maps for k in m):
            if not all(k in m for m in maps):
                if _scope(path + (k,), keys) is not None:
                    out.append(_key(path + (k,)))
                continue
            _differ([m[k] for m in maps], path + (k,), entries, keys, out)
    elif kind in ("list", "tuple"):
        if len({len(n["items"]) for n in nodes}) > 1:
            out.append(_key(path))
            return
        found: list[str] = []  # a sequence is one value: name it, not each element
        for i, children in enumerate(zip(*(n["items"] for n in nodes))):
            _differ(list(children), path + (i,), entries, keys, found)
        if found:
            out.append(_key(path) if scope == "all" else found[0])
    elif kind == "provider":
        _differ([n["state"] for n in nodes], path, entries, keys, out)
    elif scope == "all" and len({_content(n, entries) for n in nodes}) > 1:
        out.append(_key(path))


def _content(node: dict, entries: list):
    """What a leaf holds, comparable across ranks (``entries``: the manifest's typed entries)."""
    if node["t"] == "value":
        return ("value", type(node["v"]).__name__, repr(node["v"]))
    e = entries[node["e"]]
    if e.kind == "object":
        return ("object", e.nbytes, e.crc32)
    return ("tensor", e.dtype, tuple(e.shape),
            tuple((tuple(s.global_offset), s.nbytes, tuple(map(tuple, s.checksums)))
                  for s in e.shards))


def _key(path: tuple) -> str:
    return "/".join(str(p) for p in path)


def _scope(path: tuple, keys) -> str | None:
    """"all" inside a requested prefix, "some" on the way to one, None outside."""
    if keys is None:
        return "all"
    key = _key(path)
    if any(not k or key == k or key.startswith(k + "/") for k in keys):
        return "all"
    if not path or any(k.startswith(key + "/") for k in keys):
        return "some"
    return None


# ---------------------------------------------------------------- the global plan, checked at commit
# Each returns a list of problems, (ranks involved, text); empty when the reports form a checkpoint.

def check_same_save(reports: dict[int, dict]) -> list[tuple[list[int], str]]:
    """Every report belongs to rank 0's save: same name, step, nonce and overwrite flag."""
    mine = reports[0]
    want = (mine["save"]["name"], mine["save"]["step"], mine["save"]["nonce"],
            bool(mine.get("overwrite")))
    problems = []
    for r, rep in sorted(reports.items()):
        got = (rep["save"]["name"], rep["save"]["step"], rep["save"]["nonce"],
               bool(rep.get("overwrite")))
        if got != want:
            problems.append(([r], f"reported save {got[0]!r} step {got[1]} overwrite={got[3]}, "
                                  f"rank 0 saves {want[0]!r} step {want[1]} overwrite={want[3]}"))
    return problems


def check_tiling(manifest: dict) -> list[tuple[list[int], str]]:
    """The written boxes of every tensor tile its shape exactly: inside it, no two overlapping
    (two ranks writing one box is an error unless one declares itself a replica with
    ``primary=False``), and no element left uncovered."""
    problems = []
    rank_of = [f["rank"] for f in manifest["files"]]
    for e in manifest["entries"]:
        if e["kind"] != "tensor":
            continue
        shape = tuple(e["shape"])
        boxes = [(tuple(s["global_offset"]), tuple(s["shape"]), rank_of[s["file"]])
                 for s in e["shards"]]
        outside = [([r], f"box {_box(off, box)} of {e['key']!r} lies outside its global "
                         f"shape {list(shape)}") for off, box, r in boxes
                   if len(off) != len(shape) or len(box) != len(shape) or
                   any(o < 0 or o + n > g for o, n, g in zip(off, box, shape))]
        if outside:
            problems += outside
            continue
        overlaps = [([a[2], b[2]], f"ranks {a[2]} and {b[2]} both wrote {e['key']!r} boxes "
                     f"{_box(*a[:2])} and {_box(*b[:2])}, which overlap (declare replicas with "
                     "primary=False or replicated=...)") for a, b in _overlapping(boxes)]
        problems += overlaps
        covered = sum(_volume(box) for _, box, _ in boxes)
        if not overlaps and covered != _volume(shape):
            problems.append((sorted({r for *_, r in boxes}), f"the boxes written for "
                             f"{e['key']!r} cover {covered} of its {_volume(shape)} elements "
                             f"(shape {list(shape)}): a gap"))
    return problems


def check_replicas(reports: dict[int, dict]) -> list[tuple[list[int], str]]:
    """Declared replicas hold the same bytes on every rank (``replicas``: key → digest)."""
    seen: dict[str, dict[str, list[int]]] = {}
    for r, rep in sorted(reports.items()):
        for key, digest in (rep.get("replicas") or {}).items():
            seen.setdefault(key, {}).setdefault(str(digest), []).append(r)
    problems = []
    for key, groups in sorted(seen.items()):
        if len(groups) > 1:
            ranks = sorted(r for rs in groups.values() for r in rs)
            shown = "; ".join(f"ranks {rs} hold digest {d}" for d, rs in
                              sorted(groups.items(), key=lambda kv: kv[1]))
            problems.append((ranks, f"replicated tensor {key!r} differs across ranks ({shown})"))
    return problems


def _volume(shape) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def _box(off, box) -> str:
    return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(off, box)) + "]"


def _overlapping(boxes: list) -> list[tuple]:
    """Pairs of non-empty boxes that share an element: a sweep along the dimension with the
    most distinct offsets, so row or column shardings cost O(n log n)."""
    boxes = [b for b in boxes if _volume(b[1])]
    if len(boxes) < 2:
        return []
    ndim = len(boxes[0][0])
    if ndim == 0:
        return [(boxes[0], b) for b in boxes[1:]]
    dim = max(range(ndim), key=lambda d: len({b[0][d] for b in boxes}))
    pairs, active = [], []
    for b in sorted(boxes, key=lambda b: b[0][dim]):
        active = [a for a in active if a[0][dim] + a[1][dim] > b[0][dim]]
        for a in active:
            if all(max(a[0][d], b[0][d]) < min(a[0][d] + a[1][d], b[0][d] + b[1][d])
                   for d in range(ndim)):
                pairs.append((a, b))
        active.append(b)
    return pairs

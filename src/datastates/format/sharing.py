"""Per-rank state trees written once where the ranks agree (docs/format.md, "Shared subtrees").

A manifest holds one state tree per rank. Under data parallelism most of it is the same on every
rank: the model and the optimizer are replicated, so their subtrees name the same entries with the
same keys, and only a few leaves differ (the RNG state, a per-rank value). Written out in full,
the manifest would grow with ranks × tree and every rank would read all of it. So a rank's tree
may replace any subtree equal to rank 0's subtree at the same path by ``{"t": "same", "r": 0}``:
the manifest grows with what differs. A reader puts rank 0's node back (the very object, so the
parsed trees share memory too) before the trees are validated, so nothing downstream sees the
marker.

Pure: no I/O. :func:`share` runs on trees this process built; :func:`resolve` on JSON from disk,
which is bounded here (depth, the rank named, the path existing in that rank's tree) before
anything relies on it (recursion is bounded by ``max_depth``, 256, far below the interpreter's
limit).
"""

from __future__ import annotations

from typing import Any

from ..errors import CorruptCheckpointError

SAME = "same"
MAPPINGS = ("dict", "odict")
SEQUENCES = ("list", "tuple")


def share(node: dict, base: dict | None) -> dict:
    """``node`` (a rank's tree) with every subtree equal to ``base``'s at the same path (rank
    0's tree) replaced by a ``same`` marker. Equal means the same JSON (:func:`same_json`:
    ``1``, ``1.0`` and ``true`` differ). Only containers with the same type and, for
    mappings, the same keys in the same order are entered; ``node`` is not modified."""
    if base is None:
        return node
    if same_json(node, base):
        return {"t": SAME, "r": 0}
    t = node.get("t")
    if t != base.get("t"):
        return node
    if t in MAPPINGS:
        mine, theirs = node["items"], base["items"]
        if not same_json([k for k, _ in mine], [k for k, _ in theirs]):
            return node
        return {
            **node,
            "items": [[k, share(child, other[1])] for (k, child), other in zip(mine, theirs)],
        }
    if t in SEQUENCES:
        if len(node["items"]) != len(base["items"]):
            return node
        return {**node, "items": [share(c, b) for c, b in zip(node["items"], base["items"])]}
    if t == "provider" and node.get("name") == base.get("name") and "state" in node:
        return {**node, "state": share(node["state"], base.get("state"))}
    return node


def same_json(a: Any, b: Any) -> bool:
    """Whether ``a`` and ``b`` encode to the same JSON: Python's ``==`` takes ``1``, ``1.0``
    and ``True`` (and ``0.0`` and ``-0.0``) for equal, which would hand a rank another rank's
    value."""
    if type(a) is not type(b):
        return False
    if type(a) is dict:
        return a.keys() == b.keys() and all(same_json(v, b[k]) for k, v in a.items())
    if type(a) in (list, tuple):
        return len(a) == len(b) and all(map(same_json, a, b))
    if type(a) is float:
        return a.hex() == b.hex()
    return a == b


def resolve(node: Any, rank: int, bases: list[dict], where: str, max_depth: int) -> Any:
    """``node`` (rank ``rank``'s tree as read) with every ``same`` marker replaced by the node
    at the same path of the earlier rank it names (``bases[r]``, already resolved and
    validated). CorruptCheckpointError naming ``where`` and the path for a marker that names no
    earlier rank, a path that rank's tree does not have, or a tree deeper than ``max_depth``.
    ``node`` is not modified: the containers on the way to a marker are new (the caller may
    still encode the JSON it parsed); a subtree holding no marker is given back as it is (no
    copy of a tree that shares nothing)."""
    return _resolve(node, bases[0] if bases else None, rank, bases, where, (), 1, max_depth)


def _resolve(
    node: Any,
    base: Any,
    rank: int,
    bases: list,
    where: str,
    path: tuple,
    depth: int,
    max_depth: int,
) -> Any:
    if depth > max_depth:
        raise CorruptCheckpointError(f"{where}: state tree deeper than {max_depth}")
    if type(node) is not dict:
        return node  # the validation names it
    t = node.get("t")
    if t == SAME:
        return _base(node, base, rank, bases, where, path)
    items = node.get("items")
    if (t in MAPPINGS or t in SEQUENCES) and type(items) is list:
        out, changed = [], False
        for i, item in enumerate(items):
            if t in MAPPINGS:
                if type(item) is not list or len(item) != 2:
                    out.append(item)
                    continue
                key, child = item
                new = _resolve(
                    child,
                    _child(base, t, key, i),
                    rank,
                    bases,
                    where,
                    path + (key,),
                    depth + 1,
                    max_depth,
                )
                out.append(item if new is child else [key, new])
            else:
                child = item
                new = _resolve(
                    child,
                    _child(base, t, i, i),
                    rank,
                    bases,
                    where,
                    path + (i,),
                    depth + 1,
                    max_depth,
                )
                out.append(new)
            changed = changed or new is not child
        return {**node, "items": out} if changed else node
    if t == "provider" and "state" in node:
        child_base = base.get("state") if type(base) is dict else None
        state = _resolve(node["state"], child_base, rank, bases, where, path, depth + 1, max_depth)
        return node if state is node["state"] else {**node, "state": state}
    return node


def _is_same(node: Any) -> bool:
    return type(node) is dict and node.get("t") == SAME


def _base(marker: dict, base: Any, rank: int, bases: list[dict], where: str, path: tuple) -> Any:
    shown = "/".join(map(str, path))
    if set(marker) != {"t", "r"} or type(marker["r"]) is not int or marker["r"] != 0 or rank < 1:
        raise CorruptCheckpointError(
            f"{where}: at {shown!r}, expected a 'same' node naming rank "
            f"0 (an earlier rank), found {marker!r}"
        )
    if base is None:
        raise CorruptCheckpointError(
            f"{where}: at {shown!r}, a 'same' node refers to rank 0's tree, which has no node there"
        )
    return base


def _child(base: Any, t: str, key: Any, index: int) -> Any:
    """The child of ``base`` at ``key`` (mappings: the same key at the same position)."""
    if type(base) is not dict or base.get("t") != t:
        return None
    items = base.get("items")
    if type(items) is not list or index >= len(items):
        return None
    item = items[index]
    if t in MAPPINGS:
        return item[1] if type(item) is list and len(item) == 2 and item[0] == key else None
    return item

"""Which saved state is per rank, and what a restore at another world size does with it: pure
functions over the saved trees and the manifest's entries (unit-tested directly).

The comparison walks every rank's tree at once, so it keeps its own recursion; the node kinds,
children, keys and the rule of ``keys=`` prefixes are format/tree.py's, as for every reader.
"""

from __future__ import annotations

from typing import Any, Mapping

from ..format import tree
from ..format.records import Entry, ObjectEntry


#: How a restore at another world size treats per-rank state: "strict" raises ReshardError,
#: "rank0" gives every rank saved rank 0's, "same" gives rank r saved rank r's (rank 0's if
#: there is no saved rank r).
RANK_POLICIES = ("strict", "rank0", "same")


def per_rank_keys(
    trees: list[dict], entries: Mapping[int, Entry], keys: list[str] | None
) -> list[str]:
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


def _differ(
    nodes: list[dict],
    path: tuple,
    entries: Mapping[int, Entry],
    keys: list[str] | None,
    out: list[str],
) -> None:
    """Append to ``out`` the keys at or below ``path`` where ``nodes`` (one per rank) differ."""
    scope = tree.scope(path, keys)
    if scope is None:
        return
    kinds = {n["t"] for n in nodes}
    if len(kinds) > 1 or (kinds & {"provider"} and len({n["name"] for n in nodes}) > 1):
        out.append(tree.key_of(path))
        return
    kind = kinds.pop()
    if kind in tree.MAPPINGS:
        maps = [dict(tree.items(n)) for n in nodes]
        for k in dict.fromkeys(k for m in maps for k in m):
            if not all(k in m for m in maps):
                if tree.scope(path + (k,), keys) is not None:
                    out.append(tree.key_of(path + (k,)))
                continue
            _differ([m[k] for m in maps], path + (k,), entries, keys, out)
    elif kind in tree.SEQUENCES:
        if len({len(n["items"]) for n in nodes}) > 1:
            out.append(tree.key_of(path))
            return
        found: list[str] = []  # a sequence is one value: name it, not each element
        for i, children in enumerate(zip(*(n["items"] for n in nodes))):
            _differ(list(children), path + (i,), entries, keys, found)
        if found:
            out.append(tree.key_of(path) if scope == "all" else found[0])
    elif kind == "provider":
        _differ([n["state"] for n in nodes], path, entries, keys, out)
    elif scope == "all" and len({_content(n, entries) for n in nodes}) > 1:
        out.append(tree.key_of(path))


def _content(node: dict, entries: Mapping[int, Entry]) -> tuple[Any, ...]:
    """What a leaf holds, comparable across ranks (``entries``: the manifest's typed entries)."""
    if node["t"] == "value":
        return ("value", type(node["v"]).__name__, repr(node["v"]))
    e = entries[node["e"]]
    if isinstance(e, ObjectEntry):
        return ("object", e.nbytes, e.crc32)
    return (
        "tensor",
        e.dtype,
        tuple(e.shape),
        tuple((tuple(s.global_offset), s.nbytes, tuple(map(tuple, s.checksums))) for s in e.shards),
    )

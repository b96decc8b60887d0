"""Which saved state is per rank, and what a restore at another world size does with it: pure
functions over the saved trees and the manifest's entries (unit-tested directly)."""
from __future__ import annotations


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

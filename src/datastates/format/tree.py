"""The saved state tree (docs/format.md, "The state tree"): its node kinds, the keys of its nodes,
and the one walk over it that every reader of a manifest shares.

A rank's ``tree`` in the manifest is JSON: containers (``dict``/``odict`` with ``[key, node]``
items, ``list``/``tuple`` with node items), leaves (``value``, ``tensor``, ``object``) and
``provider`` nodes, which wrap the state a provider produced and add no key of their own. A node's
key is its path of dict keys and list indexes joined with ``"/"`` (``model/0/weight``).

Two operations cover the readers: :func:`leaves` iterates the leaves in tree order with their
paths (describe, export's byte counts), and :func:`fold` rebuilds the tree bottom-up from what a
function makes of each leaf: a new saved tree (:func:`map_leaves`, as the commit renumbers entry
indexes) or the Python structure a reader returns (export's ``build``). Both can be restricted to
key prefixes with the rule restore's ``keys=`` uses (:func:`scope`). The matcher of a restore and
the comparison of the ranks' trees walk something alongside the saved tree (the live state, the
other ranks' trees) and keep their own recursion, built on :func:`items` and :func:`scope`.

Pure: no I/O. The trees walked here are validated ones (``checks.check_tree``): at most
``MAX_TREE_DEPTH`` levels, so :func:`fold`'s recursion stays far below the interpreter's limit;
:func:`leaves` keeps an explicit stack.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable, Iterable, Iterator

MAPPINGS = ("dict", "odict")
SEQUENCES = ("list", "tuple")
#: Leaves that index a manifest entry with ``"e"``.
ENTRY_LEAVES = ("tensor", "object")
LEAVES = ("value",) + ENTRY_LEAVES
NODE_TYPES = frozenset(MAPPINGS + SEQUENCES + LEAVES + ("provider",))

#: A node's place: the dict keys and list positions from the root.
Path = tuple


def key_of(path: Path) -> str:
    """The key of the node at ``path``: its parts joined with "/" (``()`` is ``""``)."""
    return "/".join(map(str, path))


def child_key(key: str | None, part: Any) -> str:
    """The key of the child ``part`` of the node whose key is ``key`` (None: the root, whose
    children's keys are bare; a child of the root's child ``""`` is ``"/part"``)."""
    return str(part) if key is None else f"{key}/{part}"


def prefixes(keys: str | Iterable[str] | None) -> list[str] | None:
    """The key prefixes of a ``keys=`` argument (one string or several), without the slashes
    around them; None (everything) stays None."""
    if keys is None:
        return None
    return [k.strip("/") for k in ([keys] if isinstance(keys, str) else keys)]


def scope(path: Path, wanted: list[str] | None) -> str | None:
    """Where ``path`` stands relative to the prefixes ``wanted``: ``"all"`` at or below one of
    them (or when ``wanted`` is None, or holds ``""``), ``"some"`` on the way to one (the root
    always is), None outside every one."""
    if wanted is None:
        return "all"
    key = key_of(path)
    if any(not k or key == k or key.startswith(k + "/") for k in wanted):
        return "all"
    if not path or any(k.startswith(key + "/") for k in wanted):
        return "some"
    return None


def items(node: dict) -> list[tuple[Any, dict]]:
    """The children of a container node as ``(part, child)``: dict keys for ``dict``/``odict``,
    positions for ``list``/``tuple``."""
    if node["t"] in MAPPINGS:
        return [(k, child) for k, child in node["items"]]
    return list(enumerate(node["items"]))


def leaves(
    root: dict, wanted: list[str] | None = None, whole: Callable[[dict], bool] | None = None
) -> Iterator[tuple[Path, dict]]:
    """``(path, node)`` of every leaf, in tree order (items in order, a provider's state at the
    provider's own path). ``wanted``: only what lies within these key prefixes (see
    :func:`scope`; a leaf on the way to a prefix counts). ``whole(node)``: a container for which
    it is true is yielded as one leaf instead of being entered."""
    stack: list[tuple[Path, dict]] = [((), root)]
    while stack:
        path, node = stack.pop()
        t = node["t"]
        if t in LEAVES or (whole is not None and t != "provider" and whole(node)):
            yield path, node
        elif t == "provider":
            stack.append((path, node["state"]))
        else:
            children = [(path + (part,), child) for part, child in items(node)]
            stack.extend(c for c in reversed(children) if scope(c[0], wanted) is not None)


def fold(
    root: dict,
    leaf: Callable[[Path, dict], Any],
    *,
    mapping: Callable[[dict, list], Any],
    sequence: Callable[[dict, list], Any],
    provider: Callable[[Path, dict, Any], Any],
    wanted: list[str] | None = None,
) -> Any:
    """Rebuild the tree bottom-up, in tree order: ``leaf(path, node)`` for each leaf,
    ``mapping(node, [(key, folded child), ...])`` for a dict or odict,
    ``sequence(node, [(index, folded child), ...])`` for a list or tuple, and
    ``provider(path, node, folded state)`` for a provider. ``wanted``: children outside these key
    prefixes are left out (see :func:`scope`)."""

    def go(node: dict, path: Path) -> Any:
        t = node["t"]
        if t in LEAVES:
            return leaf(path, node)
        if t == "provider":
            return provider(path, node, go(node["state"], path))
        kids = [
            (part, go(child, path + (part,)))
            for part, child in items(node)
            if scope(path + (part,), wanted) is not None
        ]
        return mapping(node, kids) if t in MAPPINGS else sequence(node, kids)

    return go(root, ())


def map_leaves(root: dict, fn: Callable[[Path, dict], dict]) -> dict:
    """A new saved tree of the same shape, each leaf replaced by ``fn(path, leaf)`` (which may
    return the leaf itself); containers are new nodes, a provider node keeps its other fields.
    The input is not modified."""
    return fold(
        root,
        fn,
        mapping=lambda node, kids: {"t": node["t"], "items": [[k, c] for k, c in kids]},
        sequence=lambda node, kids: {"t": node["t"], "items": [c for _, c in kids]},
        provider=lambda path, node, state: {**node, "state": state},
    )


def build(
    root: dict,
    leaf: Callable[[Path, dict], Any],
    *,
    provider: Callable[[Path, dict, Any], Any] | None = None,
    wanted: list[str] | None = None,
) -> Any:
    """The Python structure the tree describes: dicts (``OrderedDict`` for ``odict``), lists
    and tuples holding ``leaf(path, node)`` for each leaf; a provider node becomes
    ``provider(path, node, state)`` (its state as built; by default the state itself).
    ``wanted`` as for :func:`fold`."""
    return fold(
        root,
        leaf,
        wanted=wanted,
        mapping=lambda node, kids: (OrderedDict if node["t"] == "odict" else dict)(kids),
        sequence=lambda node, kids: (tuple if node["t"] == "tuple" else list)(c for _, c in kids),
        provider=provider or (lambda path, node, state: state),
    )

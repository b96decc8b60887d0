"""The field and tree checks the format's parsers (records.py) are built from.

A check takes one decoded JSON value and the place it sits (:class:`_At`: the file and the JSON
path) and returns the value, typed, or raises ``CorruptCheckpointError`` naming that file and path
(``UnsupportedFormatError`` for a newer format version): exact JSON types (a bool is not an int),
integer ranges, dtype names, shapes of at most ``MAX_NDIM`` dimensions whose elements fit their
byte counts, checksum pieces covering a region exactly, disjoint regions, and state trees of
bounded depth whose nodes index entries of their own kind. None of them knows the records of the
format: records.py composes them into the parsers of the manifest, the shard index and the rank
report, so the three parsers share one definition of each rule. (The tiling of a tensor by its
shards' boxes is ``tiling.py``'s.)

Pure: no I/O, and no import of records.py.
"""

from __future__ import annotations

import math
from typing import Any, Protocol

from . import codec as fmt
from . import tree
from ..errors import CorruptCheckpointError, DatastatesError, UnsupportedFormatError

#: Deepest state tree accepted (a deeper one is rejected as corrupt rather than overflowing the
#: interpreter's stack in a recursive walk).
MAX_TREE_DEPTH = 256
#: Deepest nesting of a manifest's ``metadata`` (the object itself is the first level): that of
#: state trees. ``save()`` refuses deeper metadata; a reader refuses it as damage.
MAX_METADATA_DEPTH = MAX_TREE_DEPTH
#: Most dimensions of a tensor.
MAX_NDIM = 64
_U32 = 0xFFFFFFFF
_U64 = (1 << 64) - 1
#: The largest dimension or offset of a tensor: torch's sizes are int64 (a larger one, even in a
#: tensor of no element, would make its allocation raise an untyped error).
MAX_DIM = (1 << 63) - 1
_NODE_TYPES = tree.NODE_TYPES


class EntryKinds(Protocol):
    """The kinds of a manifest's entries, by index (a list of ``"tensor"``/``"object"``, or a
    view's stand-in for the entries it has not decoded)."""

    def __len__(self) -> int: ...

    def __getitem__(self, index: int, /) -> Any: ...


# ---------------------------------------------------------------- field checks


class _At:
    """Where a value sits: the file and the JSON path, for error messages. The path is kept as
    links to the parent and rendered only when an error is raised (parsing stays cheap)."""

    __slots__ = ("file", "parent", "part")

    def __init__(self, file: str, parent: "_At | None" = None, part: Any = None):
        self.file, self.parent, self.part = file, parent, part

    def __truediv__(self, part) -> "_At":
        return _At(self.file, self, part)

    @property
    def path(self) -> str:
        parts, node = [], self
        while node is not None and node.parent is not None:
            parts.append(node.part)
            node = node.parent
        out = ""
        for part in reversed(parts):
            out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
        return out

    def bad(self, what: str) -> DatastatesError:
        """The error to raise for a violation ``what`` here: CorruptCheckpointError (a subclass
        may give another of the tree, for a value that is an argument rather than data)."""
        return CorruptCheckpointError(f"{self.file}: {self.path or 'top level'}: {what}")


# The ``_field_*`` helpers are the fast path of the commonest checks: they test the value with the
# same predicate as the checker they fall back to, and build the field's path (``at / key``) only
# when that checker is about to raise. A manifest has a dozen checked fields per tensor; building
# every path eagerly was most of the time spent validating one.

_MISSING = object()


def _field_int(obj: dict, key: str, at: _At, lo: int = 0, hi: int = _U64) -> int:
    """``obj[key]``, an integer in ``[lo, hi]``."""
    value = obj.get(key, _MISSING)
    if type(value) is int and lo <= value <= hi:
        return value
    return _int(_get(obj, key, at), at / key, lo, hi)


def _field_str(obj: dict, key: str, at: _At) -> str:
    """``obj[key]``, a string."""
    value = obj.get(key, _MISSING)
    if type(value) is str:
        return value
    return _str(_get(obj, key, at), at / key)


def _field_dims(obj: dict, key: str, at: _At) -> tuple[int, ...]:
    """``obj[key]``, a list of at most MAX_NDIM non-negative integers."""
    value = obj.get(key, _MISSING)
    if (
        type(value) is list
        and len(value) <= MAX_NDIM
        and all(type(d) is int and 0 <= d <= MAX_DIM for d in value)
    ):
        return tuple(value)
    return _dims(_get(obj, key, at), at / key)


def _get(obj: dict, key: str, at: _At) -> Any:
    if key not in obj:
        raise at.bad(f"required field {key!r} is missing")
    return obj[key]


def _int(value: Any, at: _At, lo: int = 0, hi: int = _U64) -> int:
    if type(value) is not int:
        raise at.bad(f"expected an integer, found {_show(value)}")
    if not lo <= value <= hi:
        raise at.bad(f"expected an integer in [{lo}, {hi}], found {value}")
    return value


def _typed(value: Any, at: _At, kind: type, expected: str) -> Any:
    """``value`` if its exact type is ``kind`` (a bool is not an int), else the error naming it."""
    if type(value) is not kind:
        raise at.bad(f"expected {expected}, found {_show(value)}")
    return value


def _str(value: Any, at: _At) -> str:
    return _typed(value, at, str, "a string")


def _bool(value: Any, at: _At) -> bool:
    return _typed(value, at, bool, "true or false")


def _list(value: Any, at: _At) -> list:
    return _typed(value, at, list, "a list")


def _dict(value: Any, at: _At) -> dict:
    return _typed(value, at, dict, "an object")


def _show(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text[:40] + '...' if len(text) > 40 else text}"


def _dims(value: Any, at: _At) -> tuple[int, ...]:
    dims = _list(value, at)
    if len(dims) > MAX_NDIM:
        raise at.bad(f"expected at most {MAX_NDIM} dimensions, found {len(dims)}")
    if all(type(d) is int and 0 <= d <= MAX_DIM for d in dims):
        return tuple(dims)
    return tuple(_int(d, at / i, 0, MAX_DIM) for i, d in enumerate(dims))  # raises for the bad one


def _numel(shape: tuple[int, ...], cap: int) -> int | None:
    """prod(shape), or None as soon as it exceeds ``cap`` (no huge intermediate products)."""
    if 0 in shape:
        return 0
    n = 1
    for d in shape:
        n *= d
        if n > cap:
            return None
    return n


def _dtype(value: Any, at: _At) -> str:
    name = _str(value, at)
    try:
        fmt.dtype_from_name(name, "")
    except CorruptCheckpointError:
        raise at.bad(f"unknown dtype {name!r}") from None
    return name


def _pieces(value: Any, nbytes: int, at: _At) -> tuple[tuple[int, int], ...]:
    if type(value) is list:  # fast path; anything unusual is checked (and named) below
        pieces, total = [], 0
        for p in value:
            if (
                type(p) is not list
                or len(p) != 2
                or type(p[0]) is not int
                or type(p[1]) is not int
                or not 1 <= p[0] <= nbytes
                or not 0 <= p[1] <= _U32
            ):
                break
            total += p[0]
            pieces.append((p[0], p[1]))
        else:
            if total == nbytes:
                return tuple(pieces)
    return _checked_pieces(value, nbytes, at)


def _checked_pieces(value: Any, nbytes: int, at: _At) -> tuple[tuple[int, int], ...]:
    pieces, total = [], 0
    for i, p in enumerate(_list(value, at)):
        if type(p) is not list or len(p) != 2:
            raise (at / i).bad(f"expected a [length, crc32] pair, found {_show(p)}")
        length = _int(p[0], at / i / 0, 1, nbytes)
        total += length
        pieces.append((length, _int(p[1], at / i / 1, 0, _U32)))
    if total != nbytes:
        raise at.bad(f"checksum pieces cover {total} bytes, expected nbytes = {nbytes}")
    return tuple(pieces)


def _check_tensor_bytes(dtype: str, shape: tuple[int, ...], nbytes: int, at: _At) -> None:
    itemsize = fmt.dtype_from_name(dtype, "").itemsize
    numel = _numel(shape, nbytes // itemsize if itemsize else 0)
    if numel is None or numel * itemsize != nbytes:
        raise at.bad(
            f"shape {list(shape)} of {dtype} needs "
            f"{'more than ' + str(nbytes) if numel is None else numel * itemsize} "
            f"bytes, nbytes is {nbytes}"
        )


def _check_disjoint(regions: list[tuple[int, int, str]], at: _At, what: str) -> None:
    """Non-empty regions (offset, nbytes, key) must not overlap."""
    end, last = 0, None
    for offset, nbytes, key in sorted(r for r in regions if r[1]):
        if offset < end:
            raise at.bad(
                f"{what}: region of {key!r} at [{offset}, {offset + nbytes}) overlaps "
                f"that of {last!r} ending at {end}"
            )
        end, last = offset + nbytes, key


def _finite(value: Any, at: _At) -> int | float:
    """``value``, an integer or a finite float (not a bool): JSON has no NaN or Infinity, and a
    number too large for a double (``1e400``) decodes to an infinity."""
    if type(value) is int or type(value) is float and math.isfinite(value):
        return value
    raise at.bad(f"expected a finite number, found {_show(value)}")


def _nested(value: Any, at: _At, max_depth: int) -> Any:
    """``value``, decoded JSON whose arrays and objects nest at most ``max_depth`` levels
    (``value`` itself the first) and whose every number is finite (:func:`_finite`); walked
    without recursion, so its depth never meets the interpreter's stack."""
    stack = [(value, at, 1)]
    while stack:
        node, where, depth = stack.pop()
        if depth > max_depth:  # (named at ``at``: the path of the deep node is as deep)
            raise at.bad(f"arrays and objects nested deeper than {max_depth} levels")
        for part, child in node.items() if type(node) is dict else enumerate(node):
            if type(child) is dict or type(child) is list:
                stack.append((child, where / part, depth + 1))
            elif type(child) is float and not math.isfinite(child):
                _finite(child, where / part)  # raises, naming it
    return value


def _version(obj: dict, at: _At, expected_format: str, newest: int = fmt.VERSION) -> int:
    found = obj.get("format")
    if found != expected_format:
        raise at.bad(f"format is {_show(found)}, expected {expected_format!r}")
    version = _int(_get(obj, "version", at), at / "version", 1, _U32)
    if version > newest:
        raise UnsupportedFormatError(
            f"{at.file}: format version {version} is newer than this "
            f"reader's {newest}; upgrade datastates"
        )
    return version


# ---------------------------------------------------------------- state trees


def check_tree(
    root: Any, at: _At, entry_kinds: list[str], refs: dict[int, set[str]] | None = None
) -> dict:
    """Validate a state tree (iteratively: depth is bounded, never the interpreter's stack).

    ``entry_kinds[i]`` is the kind of entry ``i``; tensor/object nodes must index an entry of
    their own kind. ``refs``, if given, collects for each entry index the keys (``a/b/0``, as
    ``tree.key_of``) of the nodes that refer to it.

    Its own walk, not :func:`tree.leaves`: that walker trusts the nodes it is given, while this
    one checks each node's fields before following them and builds the JSON path of an error
    only when it raises (validating stays cheap on large trees)."""
    if refs is None:
        return check_tree_refs(root, at, entry_kinds, None)
    found: dict = {}
    check_tree_refs(root, at, entry_kinds, found)
    for e, keys in found.items():
        refs.setdefault(e, set()).update(_ref_keys(keys))
    return root


def check_tree_refs(root: Any, at: _At, entry_kinds: "EntryKinds", refs: dict | None) -> dict:
    """:func:`check_tree`, collecting into ``refs`` for each entry index the one key referring
    to it, or a set of keys once there are several: a manifest of a million entries needs no
    million sets. :func:`check_entry_keys` reads either form."""
    # node, path of its parent, parts below it, depth, key (None: the root's, whose children's
    # keys are bare; a root dict's child "" has the key "", and its child x the key "/x")
    stack: list = []
    kinds = len(entry_kinds)

    def leaf(node: Any) -> int:
        """The entry of ``node`` if it is a valid tensor or object leaf (the commonest node),
        else -1 (the node is then pushed and checked in full)."""
        if type(node) is dict:
            t, e = node.get("t"), node.get("e")
            if (
                (t == "tensor" or t == "object")
                and type(e) is int
                and 0 <= e < kinds
                and entry_kinds[e] == t
                and type(node.get("param", False)) is bool
                and ("np" not in node or (node["np"] is True and t == "tensor"))
            ):
                return e  # (np: exactly true, on a tensor)
        return -1

    def visit(node: Any, parent: _At, parts: tuple, depth: int, key: str | None) -> None:
        """Check ``node`` at ``depth`` at once if it is a valid leaf, else push it."""
        e = leaf(node) if depth <= MAX_TREE_DEPTH else -1
        if e < 0:
            stack.append((node, parent, parts, depth, key))
        elif refs is not None:
            _ref(refs, e, "" if key is None else key)

    visit(root, at, (), 1, None)
    while stack:  # nodes that are not valid leaves, checked in full
        node, parent, parts, depth, key = stack.pop()
        where = parent
        for part in parts:
            where = where / part
        if depth > MAX_TREE_DEPTH:
            raise where.bad(f"state tree deeper than {MAX_TREE_DEPTH}")
        node = _dict(node, where)
        t = _get(node, "t", where)
        if type(t) is not str or t not in _NODE_TYPES:
            raise (where / "t").bad(f"unknown node type {_show(t)}")
        if "np" in node and (t != "tensor" or node["np"] is not True):
            raise (where / "np").bad(
                f"expected true on a tensor node (saved from a numpy "
                f"array), found {_show(node['np'])} on a {t} node"
            )
        if t in ("tensor", "object"):
            e = (
                _int(_get(node, "e", where), where / "e", 0, len(entry_kinds) - 1)
                if entry_kinds
                else _no_entries(where)
            )
            if entry_kinds[e] != t:
                raise (where / "e").bad(f"a {t} node refers to entry {e}, a {entry_kinds[e]}")
            if refs is not None:
                _ref(refs, e, "" if key is None else key)
            if "param" in node:
                _bool(node["param"], where / "param")
        elif t == "value":
            _scalar(_get(node, "v", where), where / "v")
        elif t == "provider":
            _str(_get(node, "name", where), where / "name")
            visit(_get(node, "state", where), where, ("state",), depth + 1, key)
        else:
            deeper = depth < MAX_TREE_DEPTH  # a child at depth + 1 may be checked in place
            prefix = "" if key is None else key + "/"  # tree.child_key, inline
            items = _list(_get(node, "items", where), where / "items")
            mapping = t in tree.MAPPINGS
            for i, item in enumerate(items):
                if mapping:
                    if type(item) is not list or len(item) != 2:
                        raise (where / "items" / i).bad(
                            f"expected a [key, node] pair, found {_show(item)}"
                        )
                    part, child = item
                    if type(part) is str:  # a string key is always valid
                        child_key = prefix + part
                    else:
                        _scalar(part, where / "items" / i / 0)
                        child_key = tree.child_key(key, part)
                else:
                    child, child_key = item, f"{prefix}{i}"
                e = leaf(child) if deeper else -1  # visit(), inline: the commonest path
                if e < 0:
                    path = ("items", i, 1) if mapping else ("items", i)
                    stack.append((child, where, path, depth + 1, child_key))
                elif refs is not None:
                    _ref(refs, e, child_key)
    return root


def _ref(refs: dict, e: int, key: str) -> None:
    """Record that ``key`` refers to entry ``e``."""
    if refs.setdefault(e, key) is not key and refs[e] != key:
        _add_ref(refs, e, key)


def _add_ref(refs: dict, e: int, key: str) -> None:
    """Record one more key referring to entry ``e`` (``refs[e]`` holds another one already)."""
    known = refs[e]
    if type(known) is set:
        known.add(key)
    elif known != key:
        refs[e] = {known, key}


def _ref_keys(found: Any) -> set:
    """The keys of one entry of ``refs`` (see :func:`check_tree`) as a set."""
    if found is None:
        return set()
    return found if type(found) is set else {found}


def check_entry_keys(keys: list[str] | dict[int, str], refs: dict, at: _At) -> None:
    """Each entry (``keys``: their keys in order, or index -> key for some of them) is
    referenced by a tree node at its own key (other nodes may share it, as tied weights do): a
    tree index pointing at another entry of the same kind is caught here."""
    for i, key in keys.items() if type(keys) is dict else enumerate(keys):
        found = refs.get(i)
        if found != key and (type(found) is not set or key not in found):
            found = sorted(_ref_keys(found))[:3]
            raise (at / i).bad(
                f"entry {key!r} is not referenced by the tree node at its key "
                f"(referenced at {found or 'no key'})"
            )


def _no_entries(where: _At) -> int:
    raise (where / "e").bad("refers to an entry, but there are none")


def _scalar(value: Any, at: _At) -> Any:
    if value is None or type(value) in (str, int, bool):
        return value
    if type(value) is float and math.isfinite(value):
        return value
    raise at.bad(
        f"expected a string, integer, finite number, boolean or null, found {_show(value)}"
    )

"""A pickle protocol 2 writer for plain trees, byte for byte what ``pickle.Pickler(file,
protocol=2).dump`` (the C pickler) writes for them, without a Python call per object.

The plain trees are what ``zipframe.plain_state`` builds: exact ``dict``, ``list``, ``tuple``,
``collections.OrderedDict`` (no attributes), ``str``, ``int``, ``float``, ``bool`` and ``None``
(a subclass may write some tuples otherwise: ``TreePickler.save_tuple``). Anything else raises
:class:`Unsupported`, before a byte is returned: the caller then runs the real pickler.

The C pickler's rules it follows (CPython ``Modules/_pickle.c``, protocol 2): ``None``, booleans,
integers and floats are never memoized; every other object is looked up in the memo by
identity first (``BINGET``) and memoized after it is written (``BINPUT``, its index the memo's
size; ``LONG_BINPUT``/``LONG_BINGET`` from 256 on); the empty tuple is ``EMPTY_TUPLE`` and never
memoized; a tuple of 1 to 3 items ends with ``TUPLE1``-``TUPLE3``, a longer one is
``MARK ... TUPLE``; a dict of one item is ``SETITEM``, a longer one ``MARK ... SETITEMS`` in
batches of 1000 where a dict of a multiple of 1000 items ends with an empty batch; a list the
same with ``APPEND``/``APPENDS`` and no empty batch; an ``OrderedDict`` is reduced to
``REDUCE(OrderedDict, ())`` and its items follow from an iterator (batches of 1000, a last
batch of one item as ``SETITEM``, no empty batch); a class, a function or a ``torch.dtype``
is a ``GLOBAL`` (its bytes taken from the real pickler once per dump).

Objects it memoizes by identity must stay alive while it runs: they are the caller's tree
and module-level objects. Objects the C pickler would build and memoize on the way (a
reduction's argument tuple) are only counted (:meth:`TreePickler.put`): they are new, so no
later object can be one of them.
"""

from __future__ import annotations

import collections
import itertools
import pickle
import pickletools
import struct
from typing import Any, cast

#: Items per ``SETITEMS``/``APPENDS`` batch (``BATCHSIZE`` in ``_pickle.c``).
BATCH = 1000
_PUT = [b"q" + bytes([n]) for n in range(256)]
_GET = [b"h" + bytes([n]) for n in range(256)]
_INT1 = [b"K" + bytes([n]) for n in range(256)]
_U32 = struct.Struct("<I")
_U16 = struct.Struct("<H")
_I32 = struct.Struct("<i")
_F64 = struct.Struct(">d")
_TUPLE_END = {1: b"\x85", 2: b"\x86", 3: b"\x87"}


class Unsupported(Exception):
    """The tree holds something this writer does not write as the C pickler would."""


class Pickled(bytes):
    """A complete protocol 2 pickle of one object (``PROTO`` ... ``STOP``, no persistent id),
    written into the tree's pickle in its place, as it is (:meth:`TreePickler.splice`): the
    object is never built here."""


#: The opcodes of a spliced pickle that name memo entries, by their protocol 2 form.
_MEMO_PUT = {"PUT", "BINPUT", "LONG_BINPUT"}
_MEMO_GET = {"GET", "BINGET", "LONG_BINGET"}


def put_bytes(n: int) -> bytes:
    """``BINPUT``/``LONG_BINPUT`` of memo index ``n``."""
    return _PUT[n] if n < 256 else b"r" + _U32.pack(n)


def get_bytes(n: int) -> bytes:
    """``BINGET``/``LONG_BINGET`` of memo index ``n``."""
    return _GET[n] if n < 256 else b"j" + _U32.pack(n)


def int_bytes(v: int) -> bytes:
    """An integer as protocol 2 writes it (``BININT1``/``BININT2``/``BININT``, else ``LONG1``
    or ``LONG4``)."""
    if 0 <= v < 256:
        return _INT1[v]
    if 0 <= v < 65536:
        return b"M" + _U16.pack(v)
    if -0x80000000 <= v <= 0x7FFFFFFF:
        return b"J" + _I32.pack(v)
    data = pickle.encode_long(v)
    if len(data) < 256:
        return b"\x8a" + bytes([len(data)]) + data
    return b"\x8b" + _I32.pack(len(data)) + data


def str_bytes(s: str) -> bytes:
    """A string's ``BINUNICODE`` (UTF-8, lone surrogates passed, as the C pickler does)."""
    data = s.encode("utf-8", "surrogatepass")
    if len(data) > 0xFFFFFFFF:
        raise Unsupported("a string of 4 GiB or more")
    return b"X" + _U32.pack(len(data)) + data


def global_bytes(obj: Any) -> bytes:
    """The ``GLOBAL`` opcode the C pickler writes for ``obj`` (a class, a function, a
    ``torch.dtype``): from a protocol 2 pickle of ``obj`` alone, checked to be one."""
    raw = pickle.dumps(obj, protocol=2)
    body = raw[2:-3]
    if (
        raw[:2] != b"\x80\x02"
        or raw[-3:] != b"q\x00."
        or body[:1] != b"c"
        or body.count(b"\n") != 2
        or not body.endswith(b"\n")
    ):
        raise Unsupported(f"{obj!r} is not pickled as a global")
    return body


class TreePickler:
    """One dump: :meth:`dumps` returns the bytes ``pickle.Pickler(f, protocol=2).dump(obj)``
    writes, or raises :class:`Unsupported`. A subclass may write some tuples as something
    else (:meth:`save_tuple`: it writes the object and memoizes it)."""

    def __init__(self) -> None:
        self.out = bytearray()
        #: id(object) -> memo index, for the objects written so far that the C pickler memoizes.
        self.memo: dict[int, int] = {}
        #: The memo's size: the index of the next object memoized.
        self.n = 0
        self._globals: dict[int, bytes] = {}

    def dumps(self, obj: Any) -> bytes:
        self.out += b"\x80\x02"
        self.save(obj)
        self.out += b"."
        return bytes(self.out)

    def put(self) -> bytes:
        """Count an object the C pickler memoizes here: its ``BINPUT`` (not written)."""
        n = self.n
        self.n = n + 1
        return _PUT[n] if n < 256 else b"r" + _U32.pack(n)

    def remember(self, obj: Any) -> None:
        """Memoize ``obj`` (written just now) and write its ``BINPUT``."""
        n = self.n
        self.memo[id(obj)] = n
        self.n = n + 1
        self.out += _PUT[n] if n < 256 else b"r" + _U32.pack(n)

    def save_global(self, obj: Any) -> None:
        n = self.memo.get(id(obj))
        if n is not None:
            self.out += get_bytes(n)
            return
        data = self._globals.get(id(obj))
        if data is None:
            data = self._globals[id(obj)] = global_bytes(obj)
        self.out += data
        self.remember(obj)

    def save(self, obj: Any) -> None:
        kind = type(obj)
        if kind is str:  # first: the keys of every dict
            n = self.memo.get(id(obj))
            if n is not None:
                self.out += _GET[n] if n < 256 else b"j" + _U32.pack(n)
                return
            data = obj.encode("utf-8", "surrogatepass")
            if len(data) > 0xFFFFFFFF:
                raise Unsupported("a string of 4 GiB or more")
            n = self.n
            self.memo[id(obj)] = n
            self.n = n + 1
            self.out += (
                b"X" + _U32.pack(len(data)) + data + (_PUT[n] if n < 256 else b"r" + _U32.pack(n))
            )
            return
        if obj is None:
            self.out += b"N"
            return
        if kind is bool:
            self.out += b"\x88" if obj else b"\x89"
            return
        if kind is int:
            self.out += int_bytes(obj)
            return
        if kind is float:
            self.out += b"G" + _F64.pack(obj)
            return
        n = self.memo.get(id(obj))
        if n is not None:
            self.out += get_bytes(n)
            return
        if kind is dict:
            self._dict(obj)
        elif kind is list:
            self._list(obj)
        elif kind is tuple:
            self.save_tuple(obj)
        elif kind is collections.OrderedDict:
            self._odict(obj)
        elif kind is Pickled:
            self.splice(obj)
        else:
            raise Unsupported(f"a {kind.__name__}")

    def splice(self, data: Pickled) -> None:
        """Write the object pickled in ``data`` here: its opcodes between ``PROTO`` and
        ``STOP``, its memo indexes moved past this pickle's (the unpickler's memo then holds
        its objects under indexes nothing else uses)."""
        ops = list(pickletools.genops(data))
        base, top, out = self.n, -1, self.out
        for (op, arg, at), (_, _, end) in zip(ops, ops[1:] + [(None, None, len(data))]):
            name = op.name
            if name in ("PROTO", "STOP"):
                continue
            if name in _MEMO_PUT:
                index = int(cast(int, arg))
                out += put_bytes(base + index)
                top = max(top, index)
            elif name in _MEMO_GET:
                out += get_bytes(base + int(cast(int, arg)))
            elif name in ("MEMOIZE", "PERSID", "BINPERSID", "FRAME"):
                raise Unsupported(f"a pickled object with {name}")
            else:
                out += data[at:end]
        self.n = base + top + 1

    def save_item(self, key: Any, value: Any) -> None:
        """An item of a dict: its key, then its value."""
        self.save(key)
        self.save(value)

    def save_tuple(self, obj: tuple) -> None:
        """A tuple not in the memo."""
        size = len(obj)
        if not size:
            self.out += b")"
            return
        if size > 3:
            self.out += b"("
        for item in obj:
            self.save(item)
        if id(obj) in self.memo:  # only through a cycle: not in a plain tree
            raise Unsupported("a tuple inside itself")
        self.out += _TUPLE_END.get(size, b"t")
        self.remember(obj)

    def _list(self, obj: list) -> None:
        self.out += b"]"
        self.remember(obj)
        size = len(obj)
        if size == 1:
            self.save(obj[0])
            self.out += b"a"
            return
        for start in range(0, size, BATCH):
            self.out += b"("
            for item in obj[start : start + BATCH]:
                self.save(item)
            self.out += b"e"

    def _dict(self, obj: dict) -> None:
        self.out += b"}"
        self.remember(obj)
        size = len(obj)
        if not size:
            return
        if size == 1:
            for key, value in obj.items():
                self.save_item(key, value)
            self.out += b"s"
            return
        items = iter(obj.items())
        while True:  # the C pickler's batches of an exact dict: an empty one after a full one
            self.out += b"("
            count = 0
            for key, value in itertools.islice(items, BATCH):
                self.save_item(key, value)
                count += 1
            self.out += b"u"
            if count < BATCH:
                return

    def _odict(self, obj: collections.OrderedDict) -> None:
        if vars(obj):  # its attributes would be pickled as a state
            raise Unsupported("an OrderedDict with attributes")
        self.save_global(collections.OrderedDict)
        self.out += b")R"
        self.remember(obj)
        items = iter(obj.items())
        while True:  # the batches of an iterator: none empty, a last one of one item alone
            batch = list(itertools.islice(items, BATCH))
            if len(batch) == 1:
                self.save_item(*batch[0])
                self.out += b"s"
            elif batch:
                self.out += b"("
                for key, value in batch:
                    self.save_item(key, value)
                self.out += b"u"
            if len(batch) < BATCH:
                return

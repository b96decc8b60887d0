"""Python objects as byte blobs: serialized at save time, loaded safely by default.

Objects are serialized with ``torch.save`` and loaded with ``torch.load(weights_only=True)``, the
allowlist unpickler PyTorch users already know: plain containers, numbers, strings, tensors and
``torch.Size`` load; any other class must be allowed explicitly (``safe_globals``) or the whole file
trusted (``trusted=True``). Nothing from a checkpoint runs code unless the caller opts in.

Save refuses what that loader would refuse (:func:`check_loadable`), so a checkpoint never holds
an object its default restore cannot read, unless the configuration allows unsafe objects.

A blob is input from someone else, so before torch sees it, it must look like what ``torch.save``
writes and must not make the loader do work out of proportion to its size
(:func:`check_archive`): a zip archive of stored (uncompressed) members lying one after the other
inside the blob, so decompression can neither inflate a small region into gigabytes nor read one
range many times; and every tensor the pickle rebuilds lies inside its storage record, every
allocating constructor it calls asks for no more elements than the blob has bytes (see
:func:`_scan_pickle`). Torch would refuse a tensor outside its storage too, but with an untyped
``RuntimeError``; here it is a ``CorruptCheckpointError`` naming the key.
"""

from __future__ import annotations

import _compat_pickle
import io
import math
import pickle
import pickletools
import re
import struct
import sys
import zipfile
from typing import Any, Iterable, NamedTuple

import torch

from ..errors import CorruptCheckpointError, SerializationError, UnsafeObjectError


def dumps(obj: Any, key: str) -> bytes:
    """Serialize ``obj`` now; raise SerializationError naming ``key`` if it cannot be."""
    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
    except (pickle.PicklingError, TypeError, AttributeError, RuntimeError, ValueError) as exc:
        raise SerializationError(
            f"cannot serialize the object at {key!r} ({type(obj).__qualname__}): {exc}. Make it "
            "picklable, register a state provider for its class, or leave it out of the state"
        ) from exc
    return buf.getvalue()


def loads(
    data: bytes | memoryview, key: str, *, trusted: bool = False, safe_globals: Iterable[Any] = ()
) -> Any:
    """Load a blob written by :func:`dumps`.

    With ``trusted=False`` only allowlisted types load; ``safe_globals`` extends the allowlist for
    this call (classes or functions, as for ``torch.serialization.safe_globals``).
    """
    blob = bytes(data)
    check_archive(blob, key)
    buf = io.BytesIO(blob)
    if trusted:
        return torch.load(buf, weights_only=False, map_location="cpu")
    try:
        with torch.serialization.safe_globals(list(safe_globals)):
            return torch.load(buf, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:
        first = str(exc).strip().splitlines()
        raise UnsafeObjectError(
            f"refusing to load the object at {key!r}: its type is not allowed by safe loading "
            f"({first[0] if first else exc}). If you trust this checkpoint pass trusted=True, or "
            "allow the specific classes with safe_globals=[...]"
        ) from exc
    except Exception as exc:  # only torch's allowlisted functions ran: the blob is at fault
        raise CorruptCheckpointError(
            f"the object at {key!r} does not load ({type(exc).__name__}: "
            f"{_first_line(exc)}): its blob is damaged or forged"
        ) from exc


# ---------------------------------------------------------------- what a blob may hold

_LOCAL_HEADER = struct.Struct("<4s22xHH")  # signature, ..., name length, extra length
_LOCAL_MAGIC = b"PK\x03\x04"


class _Member(NamedTuple):
    name: str
    start: int  # first byte of the member's data in the blob
    size: int


def check_archive(blob: bytes, key: str) -> None:
    """Refuse, with CorruptCheckpointError naming ``key``, a blob that is not what
    :func:`dumps` writes or that would make loading it do unbounded work: not a zip archive;
    a member compressed, declaring another size than it stores, lying outside the blob or
    overlapping another, or named twice; a pickle rebuilding a tensor outside its storage, or
    a storage record of another size than the pickle declares, or calling an allocating
    constructor (``bytearray``, ``torch.*Storage``, ``torch.*Tensor``) with a count larger
    than the blob. Reads only the central directory, the local headers and ``data.pkl``
    (bounded by ``len(blob)``); runs no code from the blob."""
    members = _members(blob, key)
    pickles = [m for m in members.values() if m.name.rpartition("/")[2] == "data.pkl"]
    if len(pickles) != 1:
        raise CorruptCheckpointError(
            f"the object at {key!r}: expected one data.pkl in its archive, found {len(pickles)}"
        )
    pkl = pickles[0]
    prefix = pkl.name[: -len("data.pkl")]
    records = {
        m.name[len(prefix) + len("data/") :]: m.size
        for m in members.values()
        if m.name.startswith(prefix + "data/")
    }
    _scan_pickle(memoryview(blob)[pkl.start : pkl.start + pkl.size], records, len(blob), key)


def _members(blob: bytes, key: str) -> dict[str, _Member]:
    """The archive's members by name, each checked stored, inside the blob and apart."""
    try:
        infos = zipfile.ZipFile(io.BytesIO(blob)).infolist()
    except (zipfile.BadZipFile, zipfile.LargeZipFile, ValueError, EOFError, struct.error) as exc:
        raise CorruptCheckpointError(
            f"the object at {key!r}: its {len(blob)}-byte blob is not "
            f"the zip archive torch.save writes ({exc})"
        ) from None
    members: dict[str, _Member] = {}
    end = 0
    for info in sorted(infos, key=lambda i: i.header_offset):
        where = f"the object at {key!r}: archive member {info.filename!r}"
        if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
            raise CorruptCheckpointError(
                f"{where} is compressed (method {info.compress_type}, {info.compress_size} bytes "
                f"declared to hold {info.file_size}); torch.save stores members uncompressed"
            )
        if info.filename in members:
            raise CorruptCheckpointError(f"{where} appears twice")
        start = _data_start(blob, info, where)
        if info.header_offset < end or start + info.file_size > len(blob):
            raise CorruptCheckpointError(
                f"{where} at [{info.header_offset}, {start + info.file_size}) overlaps the "
                f"member before it (ending at {end}) or runs past the {len(blob)}-byte blob"
            )
        members[info.filename] = _Member(info.filename, start, info.file_size)
        end = start + info.file_size
    return members


def _data_start(blob: bytes, info: zipfile.ZipInfo, where: str) -> int:
    if info.header_offset + _LOCAL_HEADER.size > len(blob):
        raise CorruptCheckpointError(
            f"{where}: local header at {info.header_offset} runs past the {len(blob)}-byte blob"
        )
    magic, name_len, extra_len = _LOCAL_HEADER.unpack_from(blob, info.header_offset)
    if magic != _LOCAL_MAGIC:
        raise CorruptCheckpointError(f"{where}: no local header at offset {info.header_offset}")
    return info.header_offset + _LOCAL_HEADER.size + name_len + extra_len


# ---------------------------------------------------------------- the pickle, read without running it

_MARK = object()
_UNKNOWN = object()
_TENSOR_REBUILDS = {
    "torch._utils._rebuild_tensor",
    "torch._utils._rebuild_tensor_v2",
    "torch._utils._rebuild_qtensor",
}
#: Callables of the loader's allowlist that allocate as many elements as an argument says.
_ALLOCATORS = re.compile(
    r"builtins\.bytearray|"
    r"torch\.(cuda\.)?(sparse\.)?(storage\.)?\w*(Storage|Tensor)"
)
_INTS = {"INT", "BININT", "BININT1", "BININT2", "LONG", "LONG1", "LONG4", "NEWTRUE", "NEWFALSE"}
_STRS = {"UNICODE", "SHORT_BINUNICODE", "BINUNICODE", "BINUNICODE8"}
_TUPLES = {"EMPTY_TUPLE": 0, "TUPLE1": 1, "TUPLE2": 2, "TUPLE3": 3}


class _Global(NamedTuple):
    name: str  # module.qualname


class _Storage(NamedTuple):
    record: str
    nbytes: int
    itemsize: int


#: Bytes per element of the typed storage classes torch.save names (torch.<Name>Storage).
_STORAGE_ITEMSIZE = {
    "Double": 8,
    "Float": 4,
    "Half": 2,
    "BFloat16": 2,
    "Long": 8,
    "Int": 4,
    "Short": 2,
    "Char": 1,
    "Byte": 1,
    "Bool": 1,
    "ComplexDouble": 16,
    "ComplexFloat": 8,
    "QInt8": 1,
    "QUInt8": 1,
    "QInt32": 4,
    "QUInt4x2": 1,
    "QUInt2x4": 1,
}


def _itemsize(storage_class: str) -> int | None:
    """Bytes per element of a storage class named in a pickle (None: not a known one)."""
    if storage_class in ("torch.UntypedStorage", "torch.storage.UntypedStorage"):
        return 1
    module, _, name = storage_class.rpartition(".")
    if module != "torch" or not name.endswith("Storage"):
        return None
    return _STORAGE_ITEMSIZE.get(name[: -len("Storage")])


def _dtype_itemsize(value) -> int | None:
    """Bytes per element of a dtype named in a pickle (``torch.float8_e4m3fn``...)."""
    if not isinstance(value, _Global) or not value.name.startswith("torch."):
        return None
    dtype = getattr(torch, value.name[len("torch.") :], None)
    return dtype.itemsize if isinstance(dtype, torch.dtype) else None


def _scan_pickle(pkl: memoryview, records: dict[str, int], limit: int, key: str) -> None:
    """Follow the stack of the pickle ``pkl`` without building anything: constants, tuples, the
    memo, globals and storage records are tracked, everything else is unknown. Every rebuilt
    tensor, storage record and allocating call whose arguments are known is checked; a pickle
    that stops making sense is left to the loader, which refuses it."""
    stack: list = []
    memo: dict = {}
    try:
        for op, arg, _ in pickletools.genops(bytes(pkl)):
            _step(op, arg, stack, memo, records, limit, key)
    except CorruptCheckpointError:
        raise
    except Exception:  # malformed: torch's own loader refuses it
        return


def _step(op, arg, stack: list, memo: dict, records: dict, limit: int, key: str) -> None:
    name = op.name
    if name in _INTS or name in _STRS:
        stack.append({"NEWTRUE": True, "NEWFALSE": False}.get(name, arg))
    elif name == "MARK":
        stack.append(_MARK)
    elif name == "TUPLE":
        at = len(stack) - 1 - stack[::-1].index(_MARK)
        items = tuple(stack[at + 1 :])
        del stack[at:]
        stack.append(items)
    elif name in _TUPLES:
        count = _TUPLES[name]
        items = tuple(stack[len(stack) - count :]) if count else ()
        del stack[len(stack) - count :]
        stack.append(items)
    elif name in ("PUT", "BINPUT", "LONG_BINPUT"):
        memo[arg] = stack[-1]
    elif name == "MEMOIZE":
        memo[len(memo)] = stack[-1]
    elif name in ("GET", "BINGET", "LONG_BINGET"):
        stack.append(memo.get(arg, _UNKNOWN))
    elif name == "GLOBAL":
        stack.append(_global(*arg.split(" ", 1)))
    elif name == "STACK_GLOBAL":
        qual, module = stack.pop(), stack.pop()
        ok = isinstance(qual, str) and isinstance(module, str)
        stack.append(_global(module, qual) if ok else _UNKNOWN)
    elif name == "DUP":
        stack.append(stack[-1])
    elif name == "BINPERSID":
        stack.append(_storage(stack.pop(), records, key))
    elif name in ("REDUCE", "NEWOBJ"):
        args, func = stack.pop(), stack.pop()
        stack.append(_call(func, args, limit, key))
    else:
        _generic(op, stack)


def _generic(op, stack: list) -> None:
    """An opcode not followed: pop what it consumes, push unknowns for what it produces."""
    before = op.stack_before
    if pickletools.markobject in before:
        at = len(stack) - 1 - stack[::-1].index(_MARK)
        del stack[at:]
        below = before.index(pickletools.markobject)
    else:
        below = len(before)
    if below > len(stack):
        raise IndexError("stack underflow")
    del stack[len(stack) - below :]
    stack.extend(_UNKNOWN for _ in op.stack_after)


def _global(module: str, name: str) -> _Global:
    """The global a loader resolves, Python 2 names mapped as pickle and torch map them
    (``__builtin__.bytearray`` is ``builtins.bytearray``)."""
    if (module, name) in _compat_pickle.NAME_MAPPING:
        module, name = _compat_pickle.NAME_MAPPING[(module, name)]
    else:
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
    return _Global(f"{module}.{name}")


def _storage(pid, records: dict, key: str):
    """A persistent id ``('storage', class, record, location, numel)``: its record must hold
    exactly ``numel`` elements."""
    if not (
        isinstance(pid, tuple)
        and len(pid) == 5
        and pid[0] == "storage"
        and isinstance(pid[1], _Global)
        and isinstance(pid[2], str)
        and type(pid[4]) is int
    ):
        return _UNKNOWN
    itemsize = _itemsize(pid[1].name)
    if itemsize is None:
        return _UNKNOWN
    record, nbytes = pid[2], pid[4] * itemsize
    if records.get(record) != nbytes:
        found = "no such record" if record not in records else f"{records[record]} bytes"
        raise CorruptCheckpointError(
            f"the object at {key!r}: its pickle declares storage data/{record} of {pid[4]} "
            f"{pid[1].name} elements ({nbytes} bytes), its archive holds {found}"
        )
    return _Storage(record, nbytes, itemsize)


def _call(func, args, limit: int, key: str):
    """Check one call of the pickle whose function and arguments are known."""
    if not isinstance(func, _Global) or not isinstance(args, tuple):
        return _UNKNOWN
    if func.name in _TENSOR_REBUILDS and len(args) >= 4 and isinstance(args[0], _Storage):
        _check_tensor(*args[:4], itemsize=args[0].itemsize, key=key)
    elif func.name == "torch._utils._rebuild_tensor_v3" and len(args) >= 7:
        _check_tensor(*args[:4], itemsize=_dtype_itemsize(args[6]), key=key)
    elif func.name == "torch._tensor._rebuild_from_type_v2" and len(args) >= 3:
        _call(args[0], args[2], limit, key)
    elif func.name == "torch.Size" and len(args) == 1 and isinstance(args[0], tuple):
        return args[0]
    elif _ALLOCATORS.fullmatch(func.name):
        count = math.prod(_ints(args))  # a count, or the sizes of a tensor
        if abs(count) > limit:
            raise CorruptCheckpointError(
                f"the object at {key!r}: its pickle calls {func.name} for {count} elements, more "
                f"than its {limit}-byte blob could hold (damaged or forged)"
            )
    return _UNKNOWN


def _ints(value):
    if type(value) is int:
        yield value
    elif isinstance(value, tuple):
        for item in value:
            yield from _ints(item)


def _check_tensor(storage, offset, size, stride, *, itemsize: int | None, key: str) -> None:
    """A tensor ``(size, stride, offset)``, in elements of ``itemsize`` bytes, must lie inside
    its storage."""
    if not (
        isinstance(storage, _Storage)
        and itemsize
        and type(offset) is int
        and _int_tuple(size)
        and _int_tuple(stride)
    ):
        return
    where = (
        f"the object at {key!r}: a tensor of size {tuple(size)}, stride {tuple(stride)} "
        f"and offset {offset}"
    )
    if len(size) != len(stride) or offset < 0 or min(size + stride, default=0) < 0:
        raise CorruptCheckpointError(
            f"{where} is malformed (negative, or as many strides as dimensions expected)"
        )
    if 0 in size:
        return
    needed = (offset + sum((n - 1) * s for n, s in zip(size, stride)) + 1) * itemsize
    if needed > storage.nbytes:
        raise CorruptCheckpointError(
            f"{where} needs {needed} bytes of storage data/"
            f"{storage.record}, which holds {storage.nbytes}: the blob "
            "is damaged or forged"
        )


def _int_tuple(value) -> bool:
    return isinstance(value, tuple) and all(type(v) is int for v in value)


def check_loadable(obj: Any, data: bytes, key: str) -> None:
    """Raise UnsafeObjectError naming ``key`` unless the blob ``data`` (``dumps(obj)``) loads with
    the default safe loading of :func:`loads` (no ``safe_globals``), as ``restore()`` would.

    Runs the allowlist unpickler on the blob, which builds only allowlisted types and calls no
    other code; it costs one load of each object at save time."""
    try:
        loads(data, key)
    except UnsafeObjectError as exc:
        raise UnsafeObjectError(
            f"refusing to save the object at {key!r} ({_class_name(obj)}): restore() with safe "
            f"loading would refuse it ({_first_line(exc.__cause__)}). {save_hint(obj)}"
        ) from None


def refuse_unsaveable(obj: Any, key: str) -> None:
    """Raise UnsafeObjectError naming ``key`` for objects refused before they are even pickled:
    a torch ``DataLoader`` (pickling it would pickle its whole dataset, and a plain loader has no
    position that a restore could give back)."""
    data = sys.modules.get("torch.utils.data")
    if data is not None and isinstance(obj, data.DataLoader):
        raise UnsafeObjectError(
            f"refusing to save the object at {key!r} ({_class_name(obj)}): a plain DataLoader "
            f"is not saved (restore() with safe loading would refuse it). {save_hint(obj)}"
        )


def save_hint(obj: Any) -> str:
    """What to do instead of saving ``obj`` as a pickled object."""
    allow = (
        "or set CheckpointConfig(allow_unsafe_objects=True) to save it pickled anyway "
        "(restore() and load() then need trusted=True or safe_globals=[...])"
    )
    data = sys.modules.get("torch.utils.data")
    if data is not None and isinstance(obj, data.DataLoader):
        return (
            "Save a stateful loader instead: an object with state_dict() and "
            "load_state_dict(), such as torchdata's StatefulDataLoader, is captured by "
            "datastates.StatefulProvider (or save loader.state_dict() yourself); " + allow
        )
    np = sys.modules.get("numpy")
    if np is not None and isinstance(obj, np.ndarray):
        return (
            "NumPy arrays are stored natively only as np.ndarray (not a subclass) of "
            "bool, int8-64, uint8-64, float16/32/64 or complex64/128 in native byte order; "
            f"this one is a {type(obj).__qualname__} of {obj.dtype.str}: convert it, " + allow
        )
    return (
        "Save plain values (dicts, lists, numbers, strings, tensors, numpy arrays) instead, "
        "register a datastates.StateProvider for its class, " + allow
    )


def _class_name(obj: Any) -> str:
    kind = type(obj)
    return f"{kind.__module__}.{kind.__qualname__}"


def _first_line(exc: BaseException | None) -> str:
    """The line of the unpickler's message that names the refused global, else its first."""
    lines = [line.strip() for line in str(exc).strip().splitlines()] if exc is not None else []
    named = [line for line in lines if line.startswith("WeightsUnpickler error")]
    return (named or lines or ["not allowlisted"])[0].split(". Please use")[0]

"""CRC-32 at hardware speed: the one checksum of the format, from the fastest library installed.

The format's checksum is CRC-32 as ``zlib.crc32`` computes it (docs/format.md). CPython's zlib
runs it at about 1.5-3.5 GB/s; ISA-L (``pip install isal``) and zlib-ng (``pip install zlib-ng``)
compute the *same* values with carry-less multiplication at 10-13 GB/s, so a checkpoint written
with one backend verifies with any other. The backend is chosen once, when this module is imported,
by a fixed preference measured on the target machines (docs/benchmarks.md, "Checksums"): ISA-L,
then zlib-ng, then zlib, which is always there. All three release the GIL on large buffers, so
writer and reader threads checksum in parallel with the training thread and with each other.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Callable

#: Preference order (fastest first, measured): name -> (module, attribute).
PREFERENCE: tuple[tuple[str, str, str], ...] = (
    ("isal", "isal.isal_zlib", "crc32"),
    ("zlib-ng", "zlib_ng.zlib_ng", "crc32"),
    ("zlib", "zlib", "crc32"),
)


@dataclass(frozen=True)
class Backend:
    """One CRC-32 implementation: ``fn(data, value) -> int`` with zlib's semantics."""

    name: str
    fn: Callable[..., int]

    def crc32(self, data, value: int = 0) -> int:
        """CRC-32 of a bytes-like object (bytes, bytearray, contiguous memoryview), continuing
        from ``value`` (the CRC of the bytes before it), as an unsigned 32-bit int."""
        return _chunked(self.fn, data, value)


def load(name: str) -> Backend | None:
    """The backend called ``name`` ("isal", "zlib-ng", "zlib"), or None if it does not import."""
    for candidate, module, attr in PREFERENCE:
        if candidate == name:
            try:
                return Backend(name, getattr(importlib.import_module(module), attr))
            except (ImportError, AttributeError):
                return None
    raise ValueError(
        f"unknown CRC-32 backend {name!r}; expected one of {', '.join(n for n, _, _ in PREFERENCE)}"
    )


def available() -> list[Backend]:
    """Every backend that imports here, fastest first (zlib is always last and always there)."""
    return [b for b in (load(name) for name, _, _ in PREFERENCE) if b is not None]


def select() -> Backend:
    """The fastest backend that imports here."""
    return available()[0]


_DEFAULT = select()
#: Name of the backend :func:`crc32` uses in this process.
BACKEND: str = _DEFAULT.name
_fn = _DEFAULT.fn


def crc32(data, value: int = 0) -> int:
    """CRC-32 (zlib's polynomial and values) of a bytes-like object, from the fastest installed
    backend; releases the GIL on large buffers. Chain pieces with ``value=``."""
    if len(data) <= CHUNK:  # the common case, without a further call
        return _fn(data, value) & 0xFFFFFFFF
    return _chunked(_fn, data, value)


#: Larger inputs are fed to a backend in pieces of this size (no backend then sees a length
#: beyond 32 bits, whatever its C interface).
CHUNK = 1 << 30


def _chunked(fn: Callable[..., int], data, value: int) -> int:
    if len(data) <= CHUNK:
        return fn(data, value) & 0xFFFFFFFF
    view = memoryview(data).cast("B")
    for start in range(0, view.nbytes, CHUNK):
        value = fn(view[start : start + CHUNK], value)
    return value & 0xFFFFFFFF


__all__ = ["BACKEND", "CHUNK", "Backend", "PREFERENCE", "available", "crc32", "load", "select"]

"""The ``torch.save`` frame around each tensor of a DCP shard file (docs/format.md, "DCP folders",
"Version 3"): the bytes before and after a tensor region that make the range a whole archive,
so that DCP's stock ``FileSystemReader`` can ``torch.load`` it where it lies.

Pure functions over dtypes, shapes and sizes; no I/O.
"""

from __future__ import annotations

import functools
import struct
from typing import NamedTuple

import torch

from ..format import codec as fmt
from ..format import zipframe as zf

__all__ = ["Frame", "frame", "head_bytes"]

#: The one record of the frame that holds data: the tensor region.
RECORD = zf.tensor_name(0)


class Frame(NamedTuple):
    """The bytes before (``head``) and after (``tail``) a tensor region of ``nbytes``."""

    head: bytes
    tail: bytes

    def length(self, nbytes: int) -> int:
        """The bytes of the whole frame (``head``, the region, ``tail``)."""
        return len(self.head) + nbytes + len(self.tail)


def head_bytes(nbytes: int) -> int:
    """The bytes of the local header before a tensor region of ``nbytes`` (64 or 128)."""
    return zf.slot_of(nbytes)


def frame(dtype: torch.dtype, shape: list[int] | tuple[int, ...], nbytes: int, crc: int) -> Frame:
    """The frame of a tensor region of ``nbytes`` holding ``dtype`` ``shape`` (CRC-32 ``crc``):
    its local header, then zeros to the next 64 bytes after the region, the pickle's and torch's
    small records, the central directory and the end records, offsets counted from the head."""
    head, tail, head_at, tail_at = _template(dtype, tuple(shape), nbytes)
    value = struct.pack("<I", crc)
    return Frame(
        head[:head_at] + value + head[head_at + 4 :], tail[:tail_at] + value + tail[tail_at + 4 :]
    )


def _build(dtype: torch.dtype, shape: tuple[int, ...], nbytes: int, crc: int) -> Frame:
    slot = head_bytes(nbytes)
    head = zf.local_header(RECORD, nbytes, slot, crc)
    at = fmt.align_up(slot + nbytes, zf.SLOT)
    end = zf.tail(at, [zf.Record(RECORD, 0, nbytes, crc)], _pickled(dtype, shape), fmt.crc32)
    return Frame(head, bytes(at - slot - nbytes) + end)


def _crc_at(a: bytes, b: bytes) -> int:
    """Where the 4-byte CRC-32 field differs between two builds (the record's CRC-32 appears
    once in the local header and once in the central directory)."""
    diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
    if len(a) != len(b) or len(diff) != 4 or diff[3] - diff[0] != 3:
        raise AssertionError("the frame's CRC-32 is not one 4-byte field")
    return diff[0]


@functools.lru_cache(maxsize=4096)
def _template(
    dtype: torch.dtype, shape: tuple[int, ...], nbytes: int
) -> tuple[bytes, bytes, int, int]:
    """The frame of a tensor of this dtype, shape and size, with where its two CRC-32 fields
    are: built once per kind of tensor, the CRC-32 written in per tensor."""
    zero, ones = _build(dtype, shape, nbytes, 0), _build(dtype, shape, nbytes, 0xFFFFFFFF)
    head_at, tail_at = _crc_at(zero.head, ones.head), _crc_at(zero.tail, ones.tail)
    return zero.head, zero.tail, head_at, tail_at


@functools.lru_cache(maxsize=4096)
def _pickled(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    """The frame's ``data.pkl``: one tensor placeholder on storage ``"0"``."""
    held = (0, dtype, shape)
    return zf.pickle_state(zf.plain_state({"t": "tensor", "e": 0}, lambda e: held))

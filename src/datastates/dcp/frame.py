"""The ``torch.save`` frame around each tensor of a DCP shard file (docs/format.md, "DCP folders",
"Version 3"): the bytes before and after a tensor region that make the range a whole archive,
so that DCP's stock ``FileSystemReader`` can ``torch.load`` it where it lies.

Pure functions over dtypes, shapes and sizes; no I/O.
"""

from __future__ import annotations

import functools
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
    slot = head_bytes(nbytes)
    head = zf.local_header(RECORD, nbytes, slot, crc)
    pickled = _pickled(dtype, tuple(shape))
    at = fmt.align_up(slot + nbytes, zf.SLOT)
    end = zf.tail(at, [zf.Record(RECORD, 0, nbytes, crc)], pickled, fmt.crc32)
    return Frame(head, bytes(at - slot - nbytes) + end)


@functools.lru_cache(maxsize=4096)
def _pickled(dtype: torch.dtype, shape: tuple[int, ...]) -> bytes:
    """The frame's ``data.pkl``: one tensor placeholder on storage ``"0"``."""
    held = (0, dtype, shape)
    return zf.pickle_state(zf.plain_state({"t": "tensor", "e": 0}, lambda e: held))

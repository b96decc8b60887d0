"""Local file-system primitives: durable writes, directory fsync, atomic rename, O_DIRECT probing.

Every function here is safe to call from any thread; none holds the GIL during I/O.
"""
from __future__ import annotations

import ctypes
import errno
import os
import shutil
import socket
import uuid

import torch

_DIRECT = getattr(os, "O_DIRECT", 0)


def buffer_of(t: torch.Tensor, nbytes: int | None = None) -> memoryview:
    """A writable memoryview over the bytes of a contiguous CPU tensor (no copy, no numpy)."""
    n = t.numel() * t.element_size() if nbytes is None else nbytes
    if n == 0:
        return memoryview(bytearray(0))
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def pwrite_all(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        written = os.pwrite(fd, view, offset)
        if written <= 0:
            raise OSError(errno.EIO, f"pwrite wrote {written} bytes at offset {offset}")
        view, offset = view[written:], offset + written


def pread_into(fd: int, view: memoryview, offset: int, path: str) -> None:
    """Fill ``view`` from ``offset``; a short file raises EOFError naming the path and offset."""
    while view.nbytes:
        got = os.preadv(fd, [view], offset)
        if got <= 0:
            raise EOFError(f"{path}: unexpected end of file at offset {offset}")
        view, offset = view[got:], offset + got


class ShardWriter:
    """Owns the descriptors of one shard file being written: a buffered one and, when the file
    system accepts it, an O_DIRECT one for aligned bulk writes."""

    def __init__(self, path: str, io_mode: str):
        self.path = path
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        self.direct_fd = -1
        if io_mode != "buffered" and _DIRECT:
            try:
                self.direct_fd = os.open(path, os.O_WRONLY | _DIRECT)
            except OSError as exc:
                if io_mode == "direct":
                    os.close(self.fd)
                    raise OSError(exc.errno, f"{path}: O_DIRECT not supported here ({exc.strerror})")
        elif io_mode == "direct":
            os.close(self.fd)
            raise OSError(errno.EINVAL, "O_DIRECT is not available on this platform")

    def write(self, data: memoryview, offset: int, padded: memoryview | None = None) -> None:
        """Write ``data`` at ``offset``.

        ``padded`` is the same bytes extended with zeros to a multiple of 4096, starting at a
        4096-aligned address: given, and with ``offset`` aligned, it goes through O_DIRECT.
        """
        if self.direct_fd >= 0 and padded is not None and offset % 4096 == 0:
            try:
                pwrite_all(self.direct_fd, padded, offset)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                os.close(self.direct_fd)
                self.direct_fd = -1
        pwrite_all(self.fd, data, offset)

    def finish(self, fsync: bool, size: int) -> None:
        """Truncate to ``size`` (drops O_DIRECT padding past the end) and fsync."""
        if self.direct_fd >= 0:
            os.close(self.direct_fd)
            self.direct_fd = -1
        os.ftruncate(self.fd, size)
        if fsync:
            os.fsync(self.fd)

    def close(self) -> None:
        for fd in (self.direct_fd, self.fd):
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.fd = self.direct_fd = -1


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: str, data: bytes, fsync: bool = True) -> None:
    """Write ``path`` through a uniquely named temporary + fsync + rename + fsync of the directory
    (unique, so that several processes replacing the same file never share a temporary)."""
    tmp = f"{path}.tmp.{uuid.uuid4().hex[:8]}@{os.getpid()}@{socket.gethostname()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        pwrite_all(fd, data, 0)
        if fsync:
            os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)
    if fsync:
        fsync_dir(os.path.dirname(path) or ".")


def remove_tree(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)

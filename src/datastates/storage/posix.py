"""Local file-system primitives: durable writes, directory fsync, atomic rename, O_DIRECT probing.

Every function here is safe to call from any thread; none holds the GIL during I/O.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import socket
import sys
import threading
import uuid
from typing import Any

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


class ShardWriter:
    """Owns the descriptors of one shard file being written: a buffered one and, when the file
    system accepts it, an O_DIRECT one for aligned bulk writes.

    ``write`` may be called from several threads at once. If the file system refuses an O_DIRECT
    write (EINVAL), every later write goes through the buffered descriptor; the O_DIRECT one stays
    open (another thread may be writing through it) until ``finish`` or ``close``.
    """

    #: how the file is opened: a new file, never one that exists
    _FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL

    def __init__(self, path: str, io_mode: str):
        self.path = path
        self.fd = os.open(path, self._FLAGS, 0o644)
        self.direct_fd = -1
        self._use_direct = False
        self._lock = threading.Lock()
        if io_mode != "buffered" and _DIRECT:
            try:
                self.direct_fd = os.open(path, os.O_WRONLY | _DIRECT)
                self._use_direct = True
            except OSError as exc:
                if io_mode == "direct":
                    os.close(self.fd)
                    raise OSError(
                        exc.errno, f"{path}: O_DIRECT not supported here ({exc.strerror})"
                    )
        elif io_mode == "direct":
            os.close(self.fd)
            raise OSError(errno.EINVAL, "O_DIRECT is not available on this platform")

    def write(self, data: memoryview, offset: int, padded: memoryview | None = None) -> None:
        """Write ``data`` at ``offset``.

        ``padded`` is the same bytes extended with zeros to a multiple of 4096, starting at a
        4096-aligned address: given, and with ``offset`` aligned, it goes through O_DIRECT.
        """
        if self._use_direct and padded is not None and offset % 4096 == 0:
            try:
                pwrite_all(self.direct_fd, padded, offset)
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                self._use_direct = False  # fall back; the descriptor is closed by finish/close
        pwrite_all(self.fd, data, offset)

    def finish(self, fsync: bool, size: int) -> None:
        """Truncate to ``size`` (drops O_DIRECT padding past the end) and fsync. Call it once
        every write has returned."""
        self._close_direct()
        os.ftruncate(self.fd, size)
        if fsync:
            os.fsync(self.fd)

    def close(self) -> None:
        """Close both descriptors (idempotent). Every descriptor is closed even if one fails;
        the first ``close()`` error is raised (NFS reports deferred write errors there)."""
        first = None
        for close in (self._close_direct, self._close_buffered):
            try:
                close()
            except OSError as exc:
                first = first or exc
        if first is not None:
            raise first

    def _close_direct(self) -> None:
        with self._lock:
            fd, self.direct_fd, self._use_direct = self.direct_fd, -1, False
        if fd >= 0:
            os.close(fd)

    def _close_buffered(self) -> None:
        with self._lock:
            fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


class ReusedShardWriter(ShardWriter):
    """A :class:`ShardWriter` over a file that exists (a spare of the memory tier: its pages are
    already allocated, so writing over them costs a copy, not an allocation). What this save does
    not write is zeroed by :meth:`finish`, so no byte of the old file is left inside the new one
    (a reader checks that the gaps between regions are zero)."""

    _FLAGS = os.O_WRONLY | getattr(os, "O_NOFOLLOW", 0)

    def __init__(self, path: str, io_mode: str):
        super().__init__(path, io_mode)
        self._written: list[tuple[int, int]] = []

    def write(self, data: memoryview, offset: int, padded: memoryview | None = None) -> None:
        super().write(data, offset, padded)
        with self._lock:
            self._written.append((offset, data.nbytes))

    def finish(self, fsync: bool, size: int) -> None:
        pos, zeros = 0, bytes(1 << 20)
        for offset, nbytes in sorted(self._written) + [(size, 0)]:
            while pos < min(offset, size):
                n = min(len(zeros), offset - pos)
                pwrite_all(self.fd, memoryview(zeros)[:n], pos)
                pos += n
            pos = max(pos, offset + nbytes)
        super().finish(fsync, size)


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_AT_FDCWD = -100
_RENAME_EXCHANGE = 2
_renameat2: Any
try:
    _renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    _renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
except (AttributeError, OSError):  # not Linux, or a C library without it
    _renameat2 = None
#: errno values by which a file system says it cannot exchange two names (NFS, FUSE...)
_NO_EXCHANGE = {errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EXDEV}


def exchange(a: str, b: str) -> bool:
    """Swap the two existing names ``a`` and ``b`` in one atomic step (Linux ``renameat2`` with
    ``RENAME_EXCHANGE``): a reader of either path sees the one entry or the other, never none.
    False, with nothing changed, where the C library or the file system cannot (the caller then
    renames twice); OSError otherwise (FileNotFoundError when either name is gone)."""
    if _renameat2 is None:
        return False
    if _renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in _NO_EXCHANGE:
        return False
    raise OSError(code, os.strerror(code), a, None, b)


def write_file_atomic(
    path: str,
    data: bytes | bytearray,
    fsync: bool = True,
    *,
    exclusive: bool = False,
    owner: str | None = None,
) -> os.stat_result:
    """Write ``path`` through a uniquely named temporary + fsync + rename + fsync of the directory
    (unique, so that several processes replacing the same file never share a temporary). Returns
    the written file's status, taken before the rename (the file that ``path`` names after it).
    ``exclusive``: link the temporary into place instead, which fails with FileExistsError if
    ``path`` exists (the temporary is removed either way). ``owner``: the lease token the
    temporary is named after, ``<path>.tmp.<owner>.<uid>`` (``datastates.storage.temporaries``), so that a
    cleaner knows whether its writer lives; without it, ``<path>.tmp.<uid>@<pid>@<host>``."""
    uid = uuid.uuid4().hex[:8]
    tmp = (
        f"{path}.tmp.{owner}.{uid}"
        if owner is not None
        else f"{path}.tmp.{uid}@{os.getpid()}@{socket.gethostname()}"
    )
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        try:
            pwrite_all(fd, data, 0)
            if fsync:
                os.fsync(fd)
            status = os.fstat(fd)
        finally:
            os.close(fd)
        if exclusive:
            os.link(tmp, path)
            os.remove(tmp)
        else:
            os.replace(tmp, path)
    except BaseException:
        _remove_quietly(tmp)  # the temporary never outlives a failed write (disk full...)
        raise
    if fsync:
        fsync_dir(os.path.dirname(path) or ".")
    return status


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except OSError:
        pass  # already gone; otherwise the original failure is the one to report


def remove_tree(path: str) -> None:
    """Delete ``path`` and everything under it; a missing ``path`` is not an error. A ``path``
    that is a symbolic link is removed itself, never what it points to (a link planted in a
    checkpoint root is refused by the readers, and removing it must not reach outside).

    Everything that can be removed is; then the first failure is raised as an ``OSError`` naming
    the entry that could not be removed (never ignored: leftovers must be reported)."""
    errors: list[OSError] = []

    def collect(_function, failed_path, exc_info):
        exc = exc_info[1] if isinstance(exc_info, tuple) else exc_info
        if not isinstance(exc, FileNotFoundError):
            errors.append(exc if isinstance(exc, OSError) else OSError(str(exc)))
            errors[-1].filename = errors[-1].filename or failed_path

    if not os.path.lexists(path):
        return
    if os.path.islink(path):
        try:
            os.remove(path)
        except FileNotFoundError:
            pass
        return
    if sys.version_info >= (3, 12):
        shutil.rmtree(path, onexc=collect)
    else:
        shutil.rmtree(path, onerror=collect)
    if errors:
        first = errors[0]
        raise OSError(
            first.errno,
            f"could not remove {first.filename} while deleting {path}: "
            f"{first.strerror or first} ({len(errors)} error(s))",
            first.filename,
        )

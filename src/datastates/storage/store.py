"""Where checkpoints live: the storage interface and its local (POSIX) implementation.

Everything above this layer (the writer pipeline, the commit protocol, restore, verify, the tools)
names files by path strings — a local path, or a URL such as ``s3://bucket/run/step-1`` — and does
every file operation through a :class:`Store`. Two implementations exist: :class:`LocalStore`
(this module: ``os`` calls, O_DIRECT writes, atomic renames) and the object store of
``datastates.storage.s3`` (S3-compatible; no rename, so the manifest written last is the commit
marker). docs/storage.md states what each guarantees and what a reader can observe.
"""

from __future__ import annotations

import errno
import os
import posixpath
import stat
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch

from ..errors import CorruptCheckpointError
from . import posix

SCHEMES = ("s3",)


def is_url(path: str) -> bool:
    """Whether ``path`` names an object store (``s3://...``) rather than a local path."""
    scheme, sep, _ = str(path).partition("://")
    return bool(sep) and scheme.lower() in SCHEMES


def normalize(path: str | os.PathLike) -> str:
    """The canonical form of a checkpoint location: an absolute local path (``file://`` prefix
    dropped), or an object-store URL without a trailing slash."""
    text = os.fspath(path)
    if text.startswith("file://"):
        text = text[len("file://") :]
    if is_url(text):
        return text.rstrip("/")
    if "://" in text:
        scheme = text.split("://", 1)[0]
        raise ValueError(
            f"unsupported storage URL {text!r}: expected a local path, file://... or "
            f"{', '.join(s + '://...' for s in SCHEMES)} (found scheme {scheme!r})"
        )
    text = os.path.abspath(text)
    # The folder a user names may be a link (to a scratch disk...): it is resolved here, so
    # that the readers, which refuse every link inside it (open_regular), read what it names.
    return os.path.realpath(text) if os.path.islink(text) else text


# ---------------------------------------------------------------- opening untrusted files

_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_READ_FLAGS = os.O_RDONLY | _NOFOLLOW | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_CLOEXEC", 0)
_DIR_FLAGS = os.O_RDONLY | _NOFOLLOW | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_CLOEXEC", 0)
_KINDS = (
    (stat.S_ISREG, "a regular file"),
    (stat.S_ISLNK, "a symbolic link"),
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISDIR, "a directory"),
)


def file_kind(mode: int) -> str:
    """What an ``st_mode`` is, for messages: "a regular file", "a symbolic link", "a FIFO
    (named pipe)"..."""
    return next((name for test, name in _KINDS if test(mode)), "a special file")


def open_regular(path: str, max_bytes: int | None = None) -> tuple[int, os.stat_result]:
    """Open the local file ``path`` of a checkpoint folder for reading: (descriptor, its status).

    A checkpoint folder is input from someone else, so only a regular file that lies directly in
    its folder is opened: neither the file nor its folder may be a symbolic link (a link may
    point anywhere: ``/dev/zero``, a private key), and a FIFO, device or socket is refused before
    it is opened (opening a FIFO for reading blocks until a writer comes; reading a device may
    never end). Checked twice: on the entry (``lstat`` through the folder's descriptor) and on the
    descriptor opened with ``O_NOFOLLOW | O_NONBLOCK`` (``fstat``, same inode), so a file swapped
    in between is refused too. ``max_bytes``: the format's limit for this file. The descriptor is
    returned in blocking mode; the caller closes it.

    FileNotFoundError (or NotADirectoryError) if it does not exist; CorruptCheckpointError naming
    ``path`` for a link, a special file or a size over ``max_bytes``."""
    folder, name = os.path.split(path)
    try:
        dir_fd = os.open(folder or ".", _DIR_FLAGS)
    except OSError as exc:
        # Linux answers ENOTDIR for a link to a folder opened with O_DIRECTORY | O_NOFOLLOW
        if exc.errno == errno.ELOOP or (exc.errno == errno.ENOTDIR and os.path.islink(folder)):
            raise CorruptCheckpointError(
                f"{path}: its folder {folder} is a symbolic link; datastates reads only files in "
                "the checkpoint folders themselves (name the folder a link points to instead)"
            ) from None
        raise
    try:
        entry = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        _check_regular(path, entry, max_bytes)
        fd = _open_entry(path, name, dir_fd)
    finally:
        os.close(dir_fd)
    try:
        opened = os.fstat(fd)
        _check_regular(path, opened, max_bytes)
        if (opened.st_dev, opened.st_ino) != (entry.st_dev, entry.st_ino):
            raise CorruptCheckpointError(f"{path}: replaced while it was being opened")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd, opened


def _open_entry(path: str, name: str, dir_fd: int) -> int:
    try:
        return os.open(name, _READ_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENXIO):  # became a link or a socket since the lstat
            raise CorruptCheckpointError(f"{path}: not a regular file ({exc.strerror})") from None
        raise


def _check_regular(path: str, st: os.stat_result, max_bytes: int | None) -> None:
    """CorruptCheckpointError naming ``path`` unless ``st`` is a regular file of at most
    ``max_bytes`` bytes."""
    if not stat.S_ISREG(st.st_mode):
        raise CorruptCheckpointError(
            f"{path}: is {file_kind(st.st_mode)}, expected a regular file (datastates "
            "opens nothing else in a checkpoint folder)"
        )
    if max_bytes is not None and st.st_size > max_bytes:
        raise CorruptCheckpointError(
            f"{path}: {st.st_size} bytes, more than the format's limit "
            f"of {max_bytes} bytes for this file"
        )


def read_regular(path: str, max_bytes: int | None = None) -> bytes:
    """The whole regular file ``path`` (see :func:`open_regular`); CorruptCheckpointError if it
    grows past ``max_bytes`` while it is read."""
    fd, st = open_regular(path, max_bytes)
    try:
        chunks: list[bytes] = []
        total, want = 0, st.st_size + 1  # one read, unless the file grew
        while True:
            chunk = os.read(fd, want)
            want = 1 << 20
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            total += len(chunk)
            if max_bytes is not None and total > max_bytes:
                raise CorruptCheckpointError(
                    f"{path}: grew past the format's limit of {max_bytes} bytes while it was read"
                )
    finally:
        os.close(fd)


# ---------------------------------------------------------------- the storage interface


class ShardFileWriter(Protocol):
    """What :meth:`Store.shard_writer` returns (``posix.ShardWriter`` is the model): the writer
    of one shard file, ``write`` callable from several threads at once, then ``finish`` once
    every write returned, or ``close`` to give up (an object store aborts its upload)."""

    path: str

    def write(self, data: memoryview, offset: int, padded: memoryview | None = None) -> None: ...

    def finish(self, fsync: bool, size: int) -> None: ...

    def close(self) -> None: ...


@runtime_checkable
class MappedFileWriter(ShardFileWriter, Protocol):
    """A shard writer whose file is mapped in memory (the memory tier's), so that units are
    captured straight into it: ``pin`` registers the mapping with CUDA (False: it cannot),
    ``unit_view`` is the mapped range a unit is copied into, ``mapped`` the range to read back."""

    def pin(self) -> bool: ...

    def unit_view(self, offset: int, nbytes: int) -> torch.Tensor: ...

    def mapped(self, offset: int, nbytes: int) -> torch.Tensor: ...


class ReadFile:
    """One file opened for reading: its size and positional reads into caller buffers."""

    path: str
    size: int
    #: Bytes per read request of a restore (``reads.steps``): small enough that a step is still
    #: in the CPU cache when it is checksummed, large enough to amortize the request.
    step_bytes: int = 1 << 20

    def read_into(self, views: list[memoryview], offset: int) -> None:
        """Fill ``views`` in order from ``offset``; CorruptCheckpointError if the file ends first."""
        raise NotImplementedError

    def pread(self, nbytes: int, offset: int) -> bytearray:
        """``nbytes`` from ``offset`` (CorruptCheckpointError if the file ends first)."""
        buf = bytearray(nbytes)
        self.read_into([memoryview(buf)], offset)
        return buf

    def advise_sequential(self) -> None:
        """Hint that the file is about to be read front to back (best effort)."""

    def close(self) -> None:
        pass


class Store:
    """The file operations of datastates. Paths are strings in the store's own form.

    ``renames`` says how a checkpoint is committed: True — the checkpoint is written in a
    temporary directory renamed into place; False — the data files are written under the
    checkpoint's own prefix in a uniquely named data directory, and writing ``manifest.json``
    (which names that data directory) commits it.
    """

    renames: bool = True

    def join(self, *parts: str) -> str:
        return os.path.join(*parts)

    # ---- whole files
    def read_bytes(self, path: str, max_bytes: int | None = None) -> bytes:
        """The whole file; FileNotFoundError if it does not exist; CorruptCheckpointError
        naming ``path`` if it is larger than ``max_bytes`` (checked before it is read) or, on a
        local disk, not a regular file in its folder (:func:`open_regular`)."""
        raise NotImplementedError

    def write_atomic(self, path: str, data: bytes | bytearray, fsync: bool) -> Any:
        """Replace ``path`` with ``data`` so that a reader sees the old or the new bytes. Returns
        the stamp of the file written, as :meth:`file_stamps` reports it (None if unknown)."""
        raise NotImplementedError

    def write_new(self, path: str, data: bytes, fsync: bool) -> Any:
        """Like :meth:`write_atomic`, but only if ``path`` does not exist yet: FileExistsError
        otherwise, decided atomically by the store (no window between a check and the write)."""
        raise NotImplementedError

    def remove(self, path: str) -> None:
        """Delete one file; a missing file is not an error."""
        raise NotImplementedError

    # ---- directories (prefixes)
    def isdir(self, path: str) -> bool:
        raise NotImplementedError

    def listdir(self, path: str) -> list[str]:
        """Names of the entries directly under ``path``; FileNotFoundError if it does not exist."""
        raise NotImplementedError

    def isfile(self, path: str) -> bool:
        """Whether a file is at ``path``. Locally, anything but a directory counts, a final
        symbolic link not followed: a FIFO or a link there is a file its reader refuses."""
        raise NotImplementedError

    def file_stamps(self, path: str, file_name: str) -> dict[str, Any]:
        """For each entry ``E`` directly under ``path`` holding a file ``E/file_name``: a stamp
        of that file, a value that differs whenever the file was replaced (None: unknown, the
        caller must read the file). One listing; FileNotFoundError if ``path`` does not exist.
        This default reports every entry with stamp None."""
        return {name: None for name in self.listdir(path)}

    def mtime(self, path: str) -> float:
        """Last modification (Unix time) of a file or of the newest file under a directory."""
        raise NotImplementedError

    def makedirs(self, path: str, fsync: bool) -> None:
        raise NotImplementedError

    def remove_tree(self, path: str) -> None:
        """Delete ``path`` and everything under it (missing is not an error); OSError naming
        what could not be removed."""
        raise NotImplementedError

    def copy(self, src: str, dst: str) -> None:
        """Copy the file ``src`` to ``dst`` (replacing it), as the store can without the bytes
        passing through this process; FileNotFoundError if ``src`` does not exist. Stores that
        do not rename need it: it is how a damaged checkpoint is moved aside."""
        raise NotImplementedError

    # ---- shard files
    def open_read(self, path: str) -> ReadFile:
        """FileNotFoundError if missing; locally, CorruptCheckpointError naming ``path`` unless
        it is a regular file in its folder (:func:`open_regular`)."""
        raise NotImplementedError

    def shard_writer(self, path: str, io_mode: str, layout: Any) -> ShardFileWriter:
        """A writer for one shard file (:class:`ShardFileWriter`); ``layout`` is the file's
        ``planning.Layout`` (object stores cut their upload parts from it)."""
        raise NotImplementedError

    def cleanup_uploads(self, root: str, is_stale) -> list[str]:
        """Abort unfinished uploads under ``root`` for which ``is_stale(key relative to root,
        started_unix)``; return their keys. Nothing to do where writes are not multipart uploads."""
        return []


class LocalReadFile(ReadFile):
    """A regular file of a local checkpoint folder (opened by :func:`open_regular`)."""

    def __init__(self, path: str):
        self.path = path
        self.fd, st = open_regular(path)
        self.size = st.st_size

    def read_into(self, views: list[memoryview], offset: int) -> None:
        views = [v for v in views if v.nbytes]
        while views:
            got = os.preadv(self.fd, views, offset)
            if got <= 0:
                raise CorruptCheckpointError(
                    f"{self.path}: unexpected end of file at offset {offset} (file truncated)"
                )
            offset += got
            while got:
                if got >= views[0].nbytes:
                    got -= views.pop(0).nbytes
                else:
                    views[0], got = views[0][got:], 0

    def advise_sequential(self) -> None:
        if hasattr(os, "posix_fadvise"):
            try:
                os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            except OSError:
                pass

    def close(self) -> None:
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


class LocalStore(Store):
    """A local (POSIX) directory tree."""

    def read_bytes(self, path: str, max_bytes: int | None = None) -> bytes:
        return read_regular(path, max_bytes)

    def write_atomic(self, path: str, data: bytes | bytearray, fsync: bool) -> Any:
        return _stamp(posix.write_file_atomic(path, data, fsync))

    def write_new(self, path: str, data: bytes, fsync: bool) -> Any:
        return _stamp(posix.write_file_atomic(path, data, fsync, exclusive=True))

    def remove(self, path: str) -> None:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def isfile(self, path: str) -> bool:
        try:
            return not stat.S_ISDIR(os.lstat(path).st_mode)
        except (FileNotFoundError, NotADirectoryError):
            return False

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def file_stamps(self, path: str, file_name: str) -> dict[str, Any]:
        """Stamp: (inode, size, modification time in ns) of the entry itself (``lstat``: a link
        is not followed) — a replaced file is a new inode, and a file rewritten in place changes
        size or time. An entry that is a symbolic link to a folder holding ``file_name`` is
        reported with stamp None: its reader refuses the link, so it is named, never skipped.
        So is an entry gone by the time it is looked at (renamed or deleted since the listing):
        its reader finds it gone and lists again (``Catalog.scan``)."""
        out: dict[str, Any] = {}
        for name in os.listdir(path):
            entry = os.path.join(path, name)
            try:
                if os.path.islink(entry):
                    os.stat(os.path.join(entry, file_name))  # is the link's target a checkpoint?
                    out[name] = None
                else:
                    out[name] = _stamp(os.lstat(os.path.join(entry, file_name)))
            except (FileNotFoundError, NotADirectoryError):
                if not os.path.lexists(entry):
                    out[name] = None
                continue
            except OSError:
                out[name] = None  # unreadable here: let the reader report it
        return out

    def mtime(self, path: str) -> float:
        return os.stat(path).st_mtime

    def makedirs(self, path: str, fsync: bool) -> None:
        if not os.path.isdir(path):
            os.makedirs(path, exist_ok=True)
            if fsync:
                posix.fsync_dir(os.path.dirname(path))

    def remove_tree(self, path: str) -> None:
        posix.remove_tree(path)

    def open_read(self, path: str) -> ReadFile:
        return LocalReadFile(path)

    def shard_writer(self, path: str, io_mode: str, layout: Any) -> posix.ShardWriter:
        return posix.ShardWriter(path, io_mode)


def _stamp(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_ino, st.st_size, st.st_mtime_ns)


LOCAL = LocalStore()


def url_join(base: str, *names: str) -> str:
    """``base/name/...`` for URLs (``posixpath`` semantics, never an absolute reset)."""
    return posixpath.join(base, *(n.lstrip("/") for n in names))

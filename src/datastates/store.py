"""Where checkpoints live: the storage interface and its local (POSIX) implementation.

Everything above this layer (the writer pipeline, the commit protocol, restore, verify, the tools)
names files by path strings — a local path, or a URL such as ``s3://bucket/run/step-1`` — and does
every file operation through a :class:`Store`. Two implementations exist: :class:`LocalStore`
(this module: ``os`` calls, O_DIRECT writes, atomic renames) and the object store of
``datastates.objstore`` (S3-compatible; no rename, so the manifest written last is the commit
marker). docs/storage.md states what each guarantees and what a reader can observe.
"""
from __future__ import annotations

import os
import posixpath
from typing import Any, Mapping

from .errors import CorruptCheckpointError
from . import storage

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
        text = text[len("file://"):]
    if is_url(text):
        return text.rstrip("/")
    if "://" in text:
        scheme = text.split("://", 1)[0]
        raise ValueError(f"unsupported storage URL {text!r}: expected a local path, file://... or "
                         f"{', '.join(s + '://...' for s in SCHEMES)} (found scheme {scheme!r})")
    return os.path.abspath(text)


def open_store(path: str, storage_options: Mapping[str, Any] | None = None) -> "Store":
    """The store holding ``path`` (see :func:`normalize`). Object stores take their endpoint and
    credentials from ``storage_options`` or, the standard way, from the environment
    (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``...); never from a checkpoint."""
    if is_url(path):
        from .objstore import S3Store
        return S3Store.for_url(path, storage_options)
    if storage_options:
        raise ValueError(f"storage_options are for object stores; {path!r} is a local path")
    return LOCAL


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
    def read_bytes(self, path: str) -> bytes:
        """The whole file; FileNotFoundError if it does not exist."""
        raise NotImplementedError

    def write_atomic(self, path: str, data: bytes, fsync: bool) -> Any:
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

    # ---- shard files
    def open_read(self, path: str) -> ReadFile:
        """FileNotFoundError if missing."""
        raise NotImplementedError

    def shard_writer(self, path: str, io_mode: str, layout: Any) -> Any:
        """A writer for one shard file with ``write(data, offset, padded=None)``,
        ``finish(fsync, size)`` and ``close()`` (see ``storage.ShardWriter``); ``layout`` is the
        file's ``planning.Layout`` (object stores cut their upload parts from it)."""
        raise NotImplementedError

    def cleanup_uploads(self, root: str, is_stale) -> list[str]:
        """Abort unfinished uploads under ``root`` for which ``is_stale(key, started_unix)``;
        return their keys. Nothing to do where writes are not multipart uploads."""
        return []


class LocalReadFile(ReadFile):
    def __init__(self, path: str):
        self.path = path
        self.fd = os.open(path, os.O_RDONLY)
        self.size = os.fstat(self.fd).st_size

    def read_into(self, views: list[memoryview], offset: int) -> None:
        views = [v for v in views if v.nbytes]
        while views:
            got = os.preadv(self.fd, views, offset)
            if got <= 0:
                raise CorruptCheckpointError(f"{self.path}: unexpected end of file at offset "
                                             f"{offset} (file truncated)")
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

    def read_bytes(self, path: str) -> bytes:
        with open(path, "rb") as f:
            return f.read()

    def write_atomic(self, path: str, data: bytes, fsync: bool) -> Any:
        return _stamp(storage.write_file_atomic(path, data, fsync))

    def write_new(self, path: str, data: bytes, fsync: bool) -> Any:
        return _stamp(storage.write_file_atomic(path, data, fsync, exclusive=True))

    def remove(self, path: str) -> None:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass

    def isdir(self, path: str) -> bool:
        return os.path.isdir(path)

    def isfile(self, path: str) -> bool:
        return os.path.isfile(path)

    def listdir(self, path: str) -> list[str]:
        return os.listdir(path)

    def file_stamps(self, path: str, file_name: str) -> dict[str, Any]:
        """Stamp: (inode, size, modification time in ns) — a replaced file is a new inode, and a
        file rewritten in place changes size or time."""
        out = {}
        for name in os.listdir(path):
            try:
                out[name] = _stamp(os.stat(os.path.join(path, name, file_name)))
            except (FileNotFoundError, NotADirectoryError):
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
                storage.fsync_dir(os.path.dirname(path))

    def remove_tree(self, path: str) -> None:
        storage.remove_tree(path)

    def open_read(self, path: str) -> ReadFile:
        return LocalReadFile(path)

    def shard_writer(self, path: str, io_mode: str, layout: Any) -> storage.ShardWriter:
        return storage.ShardWriter(path, io_mode)


def _stamp(st: os.stat_result) -> tuple[int, int, int]:
    return (st.st_ino, st.st_size, st.st_mtime_ns)


LOCAL = LocalStore()


def url_join(base: str, *names: str) -> str:
    """``base/name/...`` for URLs (``posixpath`` semantics, never an absolute reset)."""
    return posixpath.join(base, *(n.lstrip("/") for n in names))

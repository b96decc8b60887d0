"""Where checkpoints live: the storage interface and its local implementation (``store``), the
POSIX primitives under it (``posix``: durable writes, directory fsync, O_DIRECT), the S3-compatible
object store (``s3``, imported only for an ``s3://`` path), and the temporaries of a local root
(``temporaries``: their names, owners and leases).

The names below are the public surface for code outside the core."""

from __future__ import annotations

from typing import Any, Mapping

from .posix import fsync_dir
from .store import (
    LOCAL,
    LocalStore,
    ReadFile,
    Store,
    file_kind,
    is_url,
    normalize,
    open_regular,
    read_regular,
)

__all__ = [
    "LOCAL",
    "LocalStore",
    "ReadFile",
    "Store",
    "file_kind",
    "fsync_dir",
    "is_url",
    "normalize",
    "open_regular",
    "open_store",
    "read_regular",
]


def open_store(path: str, storage_options: Mapping[str, Any] | None = None) -> "Store":
    """The store holding ``path`` (see :func:`normalize`). Object stores take their endpoint and
    credentials from ``storage_options`` or, the standard way, from the environment
    (``AWS_ACCESS_KEY_ID``, ``AWS_ENDPOINT_URL``...); never from a checkpoint."""
    if is_url(path):
        from .s3 import S3Store

        return S3Store.for_url(path, storage_options)
    if storage_options:
        raise ValueError(f"storage_options are for object stores; {path!r} is a local path")
    return LOCAL

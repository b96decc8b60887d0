"""The keeper writes a memory checkpoint to storage through the commit protocol.

:func:`persist_newest` takes the newest committed checkpoint of the memory root; if storage
holds no checkpoint of that step (or a newer one), it checks every byte of it
(``verify_checkpoint``: headers, indexes, every checksum, so a damaged memory checkpoint is never
made durable), copies its shard files into a temporary of the storage root that this process
owns (a lease, as a trainer's save has), fsyncs them, and commits it there as a save of one
process would: the manifest numbered after storage's newest, written last, the directory
renamed into place, ``latest`` moved, retention applied. A crash at any instant leaves storage
as it was, apart from a temporary the next cleanup removes.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import time

from ..commit.catalog import Catalog
from ..commit.committer import SaveTarget, after_commit, publish_numbered
from ..commit.publish import publisher_for
from ..commit.retention import RetentionPolicy
from ..commit.round import SaveId, new_run_id
from ..config import CheckpointConfig
from ..errors import CheckpointExistsError, CheckpointNotFoundError, KeeperError
from ..format.records import CheckpointInfo
from ..providers import ProviderRegistry
from ..restore.reader import Reader
from ..restore.verify import verify_checkpoint
from ..storage import LOCAL, fsync_dir
from . import nodes

log = logging.getLogger("datastates")

_COPY_CHUNK = 64 << 20


def _order(info: CheckpointInfo) -> int:
    return -1 if info.step is None else info.step


def due(memory: list[CheckpointInfo], storage: list[CheckpointInfo]) -> CheckpointInfo | None:
    """The memory checkpoint to persist: the newest one, unless storage has its step or a newer
    one (or a checkpoint of its name)."""
    if not memory:
        return None
    newest = memory[-1]
    if any(_order(s) >= _order(newest) or s.name == newest.name for s in storage):
        return None
    return newest


def persist_newest(
    memory_root: str,
    storage_root: str,
    config: CheckpointConfig,
    run_id: str | None = None,
    checked=None,
    name: str | None = None,
    overwrite: bool = False,
) -> CheckpointInfo | None:
    """Persist the memory checkpoint :func:`due` names, or None when nothing is due.

    ``name``: the memory checkpoint of that name instead (a save due for storage, handed on),
    committed as the trainer would have committed it, whatever steps storage holds under other
    names; if storage holds a committed checkpoint of that name, it is replaced only with
    ``overwrite`` (the save's), else CheckpointExistsError, storage unchanged. Returns what
    storage committed. Raises what the check, the copy or the commit raised (storage is
    unchanged but for a temporary); CheckpointNotFoundError if memory holds no checkpoint
    ``name``. ``checked(info)``: whether every byte of ``info`` was checked since it was last
    written (``marks.holds``), so the copy need not check it again. KeeperError, storage
    untouched, when the memory holds one node's part of the job only (nodes.py)."""
    part = nodes.part_only(os.path.dirname(memory_root))
    if part is not None:
        raise KeeperError(
            f"the memory checkpoints in {memory_root} are not written to storage: {part}"
        )
    memory = Catalog(memory_root, LOCAL).scan() if os.path.isdir(memory_root) else []
    storage = Catalog(storage_root, LOCAL).scan() if os.path.isdir(storage_root) else []
    if name is not None:
        named = [i for i in memory if i.name == name]
        if not named:
            raise CheckpointNotFoundError(
                f"the memory tier holds no committed checkpoint {name!r} (in {memory_root})"
            )
        info: CheckpointInfo | None = named[0]
        if not overwrite and any(s.name == name for s in storage):
            raise CheckpointExistsError(
                f"storage {storage_root} already holds a committed "
                f"checkpoint {name!r}; the save handed on under that "
                "name was not written there (save(..., overwrite=True) "
                "replaces it)"
            )
    else:
        info = due(memory, storage)
    if info is None:
        return None
    return copy_commit(
        info,
        storage_root,
        config,
        run_id or new_run_id(),
        verify=not (checked is not None and checked(info)),
        overwrite=overwrite,
    )


def copy_commit(
    info: CheckpointInfo,
    root: str,
    config: CheckpointConfig,
    run_id: str,
    verify: bool = True,
    overwrite: bool = False,
) -> CheckpointInfo:
    """Commit a copy of the committed checkpoint ``info`` into the storage root ``root``,
    after checking every byte of it (``verify=False``: it was checked since its last write);
    ``overwrite``: it replaces a committed checkpoint of its name there."""
    t0 = time.perf_counter()
    with Reader(
        info.path,
        registry=ProviderRegistry.default(),
        verify=True,
        store=LOCAL,
        world_size=info.world_size,
        rank_policy="rank0",
    ) as reader:
        manifest = reader.manifest
        if verify:
            verify_checkpoint(reader.checkpoint)
    publisher = publisher_for(LOCAL)
    try:
        publisher.check_root(root)
        LOCAL.makedirs(root, config.fsync)
        publisher.hold(root, run_id, config.fsync)
        tmp = publisher.tmp_location(root, info.name, run_id, 0)
        LOCAL.makedirs(tmp, False)
        try:
            for ref in manifest.files:
                _copy_file(
                    os.path.join(info.path, ref.name),
                    os.path.join(tmp, ref.name),
                    ref.nbytes,
                    config.fsync,
                )
            if config.fsync:
                fsync_dir(tmp)
            catalog = Catalog(root, LOCAL)
            target = SaveTarget(
                sid=SaveId(run_id, info.name, info.step, 0, run_id[:24], 0),
                name=info.name,
                step=info.step,
                root=root,
                tmp=tmp,
                rank=0,
                store=LOCAL,
                overwrite=overwrite,
                deadline=time.monotonic() + config.commit_timeout_s,
                timeout_s=config.commit_timeout_s,
                fsync=config.fsync,
                replica_check=False,
                retention=RetentionPolicy(
                    config.keep_last,
                    config.keep_every,
                    config.keep_best,
                    config.best_metric,
                    config.best_mode,
                ),
                catalog=catalog,
            )
            published = publish_numbered(target, dataclasses.replace(manifest))
        except BaseException:
            publisher.discard(tmp, 0, keep_file=False)
            raise
        after_commit(target, published.info, published)
    finally:
        publisher.close()
    log.info(
        "persisted the memory checkpoint %s (%d bytes) to %s in %.2f s",
        info.name,
        manifest.nbytes,
        root,
        time.perf_counter() - t0,
    )
    return published.info


def _copy_file(src: str, dst: str, nbytes: int, fsync: bool) -> None:
    """Copy ``nbytes`` of ``src`` (a regular file of exactly that size) into a new ``dst``."""
    fd_in = os.open(src, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | os.O_CLOEXEC)
    try:
        size = os.fstat(fd_in).st_size
        if size != nbytes:
            raise OSError(f"{src} has {size} bytes, its manifest says {nbytes}")
        fd_out = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
        try:
            done, same_fs = 0, True
            while done < nbytes:
                count = min(_COPY_CHUNK, nbytes - done)
                if same_fs:
                    try:
                        n = os.copy_file_range(fd_in, fd_out, count, done, done)
                    except OSError as exc:  # from tmpfs to a disk: not across file systems
                        if exc.errno not in (
                            errno.EXDEV,
                            errno.ENOSYS,
                            errno.EINVAL,
                            errno.EOPNOTSUPP,
                        ):
                            raise
                        same_fs = False
                        continue
                else:
                    os.lseek(fd_out, done, os.SEEK_SET)
                    n = os.sendfile(fd_out, fd_in, done, count)
                if n == 0:
                    raise OSError(f"{src} ended at {done} bytes, expected {nbytes}")
                done += n
            if fsync:
                os.fsync(fd_out)
        finally:
            os.close(fd_out)
    finally:
        os.close(fd_in)

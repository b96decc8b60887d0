"""Removing checkpoints: deleting one (out of sight first -- a rename, or deleting its manifest --
then its files), applying the retention policy after a commit, and cleaning up what dead writers
left: temporary directories, interrupted deletions, a checkpoint whose replacement was interrupted
between its two renames (put back), object-store data no manifest names, unfinished multipart
uploads. commit.py makes checkpoints visible; this module takes them away (and puts back the one
a crash caught being replaced).

Only checkpoints are ever removed: a directory of the root counts as one when it holds a
``manifest.json`` (committed, or damaged since), never merely because of its name. A damaged
checkpoint whose name a new save needs is moved aside to ``.damaged.<name>.<uid>``, kept there
for inspection and never removed by this module.
"""
from __future__ import annotations

import logging
import os
import re
import socket
import stat
import time
import uuid
import warnings

from . import format as fmt
from .catalog import Catalog, CheckpointInfo, DamagedCheckpoint, human_bytes
from .errors import CheckpointNotFoundError, CorruptCheckpointError
from .storage import fsync_dir, remove_tree
from .store import LOCAL, Store

_OWNER_IN_NAME = re.compile(r"@(\d+)@([^@/]+)-\d+$")
_OWNER_IN_TMP_FILE = re.compile(r"@(\d+)@([^@/]+)$")  # storage.write_file_atomic

log = logging.getLogger("datastates")


def delete(root: str, name: str, fsync: bool = True, store: Store = LOCAL) -> None:
    """Remove the checkpoint ``root/name`` atomically: rename it away (object stores: delete its
    manifest) first, then delete the files.

    Only a checkpoint is removed, committed or damaged: a directory (not a symbolic link) holding
    a regular file ``manifest.json`` (object stores: a ``manifest.json`` object under the
    prefix). Anything else raises CheckpointNotFoundError and nothing is removed."""
    path = store.join(root, fmt.check_name(name))
    if not store.renames:
        if not store.isfile(store.join(path, fmt.MANIFEST)):
            raise CheckpointNotFoundError(f"no checkpoint {name!r} in {root!r}: no "
                                          f"{store.join(path, fmt.MANIFEST)}; nothing was "
                                          "removed")
        store.remove(store.join(path, fmt.MANIFEST))
        trash = path
    else:
        _check_checkpoint_dir(root, name, path)
        trash = os.path.join(root, f".trash.{name}.{uuid.uuid4().hex[:8]}")
        os.rename(path, trash)
        if fsync:
            fsync_dir(root)
    try:
        store.remove_tree(trash)
    except OSError as exc:
        raise OSError(exc.errno, f"checkpoint {name!r} was deleted (no longer listed) but its "
                                 f"files in {trash} could not be removed: {exc.strerror or exc}",
                      exc.filename) from exc


def _check_checkpoint_dir(root: str, name: str, path: str) -> None:
    """CheckpointNotFoundError unless ``path`` is a directory, not a link, holding a regular
    file ``manifest.json``."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"no checkpoint {name!r} in {root!r}") from None
    if not stat.S_ISDIR(mode):
        raise CheckpointNotFoundError(f"{path} is not a checkpoint: expected a directory, found "
                                      f"a {_kind(mode)}; nothing was removed")
    manifest = os.path.join(path, fmt.MANIFEST)
    try:
        mode = os.lstat(manifest).st_mode
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"{path} is not a checkpoint: it holds no {fmt.MANIFEST} "
                                      "(only a commit writes one); nothing was removed") from None
    if not stat.S_ISREG(mode):
        raise CheckpointNotFoundError(f"{path} is not a checkpoint: {manifest} is a "
                                      f"{_kind(mode)}, expected a regular file; nothing was "
                                      "removed")


def _kind(mode: int) -> str:
    kinds = ((stat.S_ISLNK, "symbolic link"), (stat.S_ISDIR, "directory"),
             (stat.S_ISREG, "regular file"), (stat.S_ISFIFO, "FIFO"))
    return next((text for test, text in kinds if test(mode)), "special file")


def set_aside(root: str, damaged: DamagedCheckpoint, fsync: bool) -> str:
    """Local store: move the damaged checkpoint ``damaged`` out of the way of a new save of its
    name, to ``root/.damaged.<name>.<uid>`` (never listed, never removed by datastates: its
    bytes stay for inspection), with a WARNING naming the reason and the new path. Returns
    the new path."""
    aside = os.path.join(root, f".damaged.{damaged.name}.{uuid.uuid4().hex[:8]}")
    os.rename(damaged.path, aside)
    if fsync:
        fsync_dir(root)
    log.warning("the damaged checkpoint %s was moved to %s to make room for a new save of that "
                "name: %s", damaged.name, aside, damaged.reason)
    return aside


def apply_retention(root: str, keep_last: int | None, keep_every: int | None,
                    protect: str, fsync: bool, store: Store = LOCAL,
                    committed: list[CheckpointInfo] | None = None,
                    damaged: list[DamagedCheckpoint] | None = None) -> list[str]:
    """Delete committed checkpoints beyond the policy; return the deleted names.

    ``committed``: the committed checkpoints of ``root``, oldest first, as the commit just made
    saw them (``Published.committed``), and ``damaged`` the damaged ones that listing found
    (``Catalog.damaged()``; None: none); with ``committed`` None, ``root`` is listed for both.
    A checkpoint of those lists already gone (deleted meanwhile by another process) is skipped,
    not an error.

    Keeps the ``keep_last`` most recently committed checkpoints (commit order, steps and tags
    alike), every checkpoint whose step is a multiple of ``keep_every``, and ``protect``. The
    newest checkpoint is therefore never deleted. A damaged checkpoint is deleted when its
    ``manifest.json`` is older (modification time) than that of each of the ``keep_last`` most
    recent ones: it would have been deleted had it been readable; a newer one is kept for
    inspection. One INFO record per deletion. Also retries the removal of ``.trash.*`` left by
    earlier deletions whose files could not be removed, so they do not accumulate unnoticed. Every
    deletion is attempted; then an OSError naming each path that could not be removed is raised."""
    if keep_last is None:
        return []
    failures = _remove_trash(root) if store.renames else []
    if committed is None:
        catalog = Catalog(root, store)
        committed, damaged = catalog.scan(), catalog.damaged()
    found = committed
    keep = {i.name for i in found[-keep_last:]} | {protect}
    if found:
        keep.add(found[-1].name)
    removed = []
    for info in found:
        if info.name in keep:
            continue
        if keep_every and info.step is not None and info.step % keep_every == 0:
            continue
        if _remove(root, info.name, fsync, store, failures):
            removed.append(info.name)
            log.info("retention deleted %s (%s of files)", info.name,
                     human_bytes(info.nbytes))
    for gone in _aged_out(damaged or [], found[-keep_last:], store):
        if _remove(root, gone.name, fsync, store, failures):
            removed.append(gone.name)
            log.info("retention deleted the damaged checkpoint %s, older than every checkpoint "
                     "kept: %s", gone.name, gone.reason)
    if failures:
        raise OSError(failures[0].errno, "retention could not remove: " +
                      "; ".join(str(e) for e in failures), failures[0].filename)
    return removed


def _remove(root: str, name: str, fsync: bool, store: Store, failures: list) -> bool:
    """Delete one checkpoint for retention: True if deleted; False if gone meanwhile or if it
    failed (the OSError is appended to ``failures``)."""
    try:
        delete(root, name, fsync, store)
        return True
    except CheckpointNotFoundError:
        return False  # deleted meanwhile by another process
    except OSError as exc:
        failures.append(exc)
        return False


def _aged_out(damaged: list[DamagedCheckpoint], window: list[CheckpointInfo],
              store: Store) -> list[DamagedCheckpoint]:
    """The damaged checkpoints whose manifest is older than the manifest of each checkpoint of
    ``window`` (a stat per checkpoint of the window, only when there is damage)."""
    if not damaged or not window:
        return []
    try:
        oldest_kept = min(store.mtime(store.join(i.path, fmt.MANIFEST)) for i in window)
    except OSError:
        return []  # changed meanwhile: decide at the next commit
    return [d for d in damaged if d.mtime is not None and d.mtime < oldest_kept]


def _remove_trash(root: str) -> list[OSError]:
    failures = []
    for name in sorted(os.listdir(root)):
        if name.startswith(".trash."):
            try:
                remove_tree(os.path.join(root, name))
            except OSError as exc:
                failures.append(exc)
    return failures


def clean_stale(root: str, max_age_s: float, store: Store = LOCAL) -> list[str]:
    """Remove temporaries left by dead writers: those owned by a dead process on this host, those
    older than ``max_age_s``, and interrupted deletions. Restores a checkpoint whose replacement
    was interrupted between the two renames. Object stores: data directories no manifest names
    and unfinished multipart uploads, by the same rule."""
    if not store.renames:
        return _clean_stale_objects(root, max_age_s, store)
    removed = []
    now = time.time()
    host = socket.gethostname()
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if name.startswith(fmt.LATEST + ".tmp.") and os.path.isfile(path):
            owner = _OWNER_IN_TMP_FILE.search(name)
            if (owner and owner.group(2) == host and not _alive(int(owner.group(1)))) or \
                    now - os.stat(path).st_mtime > max_age_s:
                os.remove(path)
                removed.append(name)
            continue
        if name.startswith(".old."):
            original = os.path.join(root, name[5:].rsplit(".", 1)[0])
            if not os.path.exists(original):
                os.rename(path, original)
                continue
        if not name.startswith((".tmp.", ".trash.", ".old.")) or not os.path.isdir(path):
            continue
        stale = name.startswith((".trash.", ".old."))
        owner = _OWNER_IN_NAME.search(name)  # the run id names the owner: see dist.new_run_id
        if owner and owner.group(2) == host and not _alive(int(owner.group(1))):
            stale = True
        try:
            stale = stale or now - os.stat(path).st_mtime > max_age_s
        except OSError:
            continue
        if stale:
            try:
                remove_tree(path)
            except OSError as exc:
                warnings.warn(f"datastates: could not remove the stale temporary {path}: {exc}",
                              RuntimeWarning, stacklevel=2)
                continue
            removed.append(name)
    return removed


def _clean_stale_objects(root: str, max_age_s: float, store: Store) -> list[str]:
    now, host = time.time(), socket.gethostname()

    def stale(data_dir: str, started: float) -> bool:
        owner = _OWNER_IN_NAME.search(data_dir)
        dead = owner is not None and owner.group(2) == host and not _alive(int(owner.group(1)))
        return dead or now - started > max_age_s

    removed = []
    for name in sorted(store.listdir(root)):
        if name.startswith(".") or name == fmt.LATEST:
            continue
        ckpt = store.join(root, name)
        children = store.listdir(ckpt)
        data_dirs = [child for child in children if child.startswith(".data.")]
        committed = fmt.MANIFEST in children
        if not data_dirs or (committed and len(data_dirs) == 1):
            # The one data directory of a committed checkpoint is the one its manifest names
            # (if it names another, the checkpoint is damaged and its leftovers are kept): no
            # manifest is read for the common case, one per checkpoint with leftovers.
            continue
        current = None
        if committed:
            try:
                current = fmt.read_manifest(ckpt, store).data_dir
            except CheckpointNotFoundError:
                pass  # deleted meanwhile: every data directory is a leftover
            except (CorruptCheckpointError, OSError):
                continue  # leave a checkpoint that cannot be read as it is
        for child in data_dirs:
            path = store.join(ckpt, child)
            if child == current:
                continue
            try:
                if not stale(child, store.mtime(path)):
                    continue
            except FileNotFoundError:
                continue  # removed meanwhile, or an empty prefix some servers keep listing
            try:
                store.remove_tree(path)
                removed.append(f"{name}/{child}")
            except OSError as exc:
                warnings.warn(f"datastates: could not remove the stale data {path}: {exc}",
                              RuntimeWarning, stacklevel=2)
    removed += store.cleanup_uploads(
        root, lambda key, started: stale(key.rsplit("/", 2)[-2] if key.count("/") >= 2 else "",
                                         started))
    return removed


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

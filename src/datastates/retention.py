"""Removing checkpoints: deleting one (out of sight first -- a rename, or deleting its manifest --
then its files), applying the retention policy after a commit, and cleaning up what dead writers
left: temporary directories, interrupted deletions, a checkpoint whose replacement was interrupted
between its two renames (put back), object-store data no manifest names, unfinished multipart
uploads. commit.py makes checkpoints visible; this module takes them away (and puts back the one
a crash caught being replaced).
"""
from __future__ import annotations

import os
import re
import socket
import time
import uuid
import warnings

from . import format as fmt
from .catalog import CheckpointInfo, list_checkpoints
from .errors import CheckpointNotFoundError, CorruptCheckpointError
from .storage import fsync_dir, remove_tree
from .store import LOCAL, Store

_OWNER_IN_NAME = re.compile(r"@(\d+)@([^@/]+)-\d+$")
_OWNER_IN_TMP_FILE = re.compile(r"@(\d+)@([^@/]+)$")  # storage.write_file_atomic


def delete(root: str, name: str, fsync: bool = True, store: Store = LOCAL) -> None:
    """Remove a checkpoint atomically: rename it away (object stores: delete its manifest)
    first, then delete the files."""
    path = store.join(root, fmt.check_name(name))
    if not store.renames:
        if not store.isfile(store.join(path, fmt.MANIFEST)):
            raise CheckpointNotFoundError(f"no checkpoint {name!r} in {root!r}")
        store.remove(store.join(path, fmt.MANIFEST))
        trash = path
    else:
        if not os.path.isdir(path):
            raise CheckpointNotFoundError(f"no checkpoint {name!r} in {root!r}")
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


def apply_retention(root: str, keep_last: int | None, keep_every: int | None,
                    protect: str, fsync: bool, store: Store = LOCAL,
                    committed: list[CheckpointInfo] | None = None) -> list[str]:
    """Delete committed checkpoints beyond the policy; return the deleted names.

    ``committed``: the committed checkpoints of ``root``, oldest first, as the commit just made
    saw them (``Published.committed``); None lists ``root``. A checkpoint of that list already
    gone (deleted meanwhile by another process) is skipped, not an error.

    Keeps the ``keep_last`` most recently committed checkpoints (commit order, steps and tags
    alike), every checkpoint whose step is a multiple of ``keep_every``, and ``protect``. The
    newest checkpoint is therefore never deleted. Also retries the removal of ``.trash.*`` left by
    earlier deletions whose files could not be removed, so they do not accumulate unnoticed. Every
    deletion is attempted; then an OSError naming each path that could not be removed is raised."""
    if keep_last is None:
        return []
    failures = _remove_trash(root) if store.renames else []
    found = committed if committed is not None else list_checkpoints(root, store)
    keep = {i.name for i in found[-keep_last:]} | {protect}
    if found:
        keep.add(found[-1].name)
    removed = []
    for info in found:
        if info.name in keep:
            continue
        if keep_every and info.step is not None and info.step % keep_every == 0:
            continue
        try:
            delete(root, info.name, fsync, store)
            removed.append(info.name)
        except CheckpointNotFoundError:
            continue  # deleted meanwhile by another process
        except OSError as exc:
            failures.append(exc)
    if failures:
        raise OSError(failures[0].errno, "retention could not remove: " +
                      "; ".join(str(e) for e in failures), failures[0].filename)
    return removed


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

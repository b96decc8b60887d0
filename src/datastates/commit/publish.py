"""Atomic visibility, one strategy per kind of store (docs/format.md, "Commit protocol").

A checkpoint is written where no reader looks, then made visible in one atomic step, and taken
away in one atomic step before its files are removed. How depends on the store:

- :class:`RenamePublisher`, for stores whose directories rename atomically (a local POSIX file
  system): the checkpoint is written in a hidden temporary directory of the root, renamed into
  place; a deletion renames it away first. Every temporary is named after a lease-holding owner
  (``datastates.storage.temporaries``), so that a cleanup in another process never touches a live writer's.
- :class:`ManifestPublisher`, for object stores (no rename): the data files are written under
  the checkpoint's own prefix, in a data directory named after the save, and the PUT of
  ``manifest.json`` (which names that directory) commits it; a deletion deletes the manifest
  first.

Each publisher owns the naming of the temporary location, the publish, the deletion, the
existence checks and the cleanup of what dead writers left; the commit (``committer.py``)
and retention (``retention.py``) call them and never branch on the kind of store.
"""

from __future__ import annotations

import dataclasses
import errno
import logging
import os
import stat
import threading
import time
import warnings
from typing import Any, Callable, Literal

from ..format import codec as fmt
from ..format import files
from ..format import records
from ..storage import posix
from .catalog import CheckpointInfo, DamagedCheckpoint, examine, written_by_datastates
from ..errors import (
    CheckpointExistsError,
    CheckpointNotFoundError,
    CheckpointWriteError,
    CorruptCheckpointError,
)
from ..storage.store import Store, file_kind
from ..storage.temporaries import (
    TAKEN_ERRNOS,
    Lease,
    damaged_name,
    data_dir_name,
    fresh_token,
    is_data_dir,
    is_data_key,
    old_name,
    owner_token,
    parse_temporary,
    skipped,
    sweep,
    tmp_name,
    trash_name,
)

log = logging.getLogger("datastates")


class Publisher:
    """How checkpoints become visible and are taken away in one kind of store.

    Calls, per save: :meth:`check_name` and :meth:`hold` (training thread, every rank, before
    the save is queued), :meth:`tmp_location` (the same on every rank), then on the commit
    thread either :meth:`publish` (rank 0) and :meth:`write_latest`, or :meth:`discard`.
    :meth:`delete`, :meth:`clean_stale` and :meth:`check_root` may be
    called by any process at any time. :meth:`close` releases what :meth:`hold` took
    (idempotent)."""

    renames: bool = True

    def __init__(self, store: Store):
        self.store = store

    def tmp_location(self, root: str, name: str, run_id: str, serial: int) -> str:
        """Where every rank writes its file of one save (``run_id`` and ``serial`` come from
        the save's identity, ``SaveId.serial``): a location no reader lists."""
        raise NotImplementedError

    def check_root(self, root: str) -> None:
        """Construction: raise if ``root`` can never hold checkpoints (it is a file...)."""

    def check_name(self, root: str, name: str, overwrite: bool) -> None:
        """Training thread, at ``save()``: raise CheckpointExistsError if a save of ``name`` can
        be refused now (without a request to a remote service)."""

    def hold(self, root: str, run_id: str, fsync: bool) -> None:
        """Training thread, once a save is planned and before it is queued: make this process
        the live owner of the temporaries of ``run_id`` in ``root`` (idempotent)."""

    def publish(
        self,
        root: str,
        tmp: str,
        name: str,
        manifest: records.Manifest,
        overwrite: bool,
        fsync: bool,
        fence: Callable[[], None] | None = None,
    ) -> tuple[str, Any, records.Manifest]:
        """Rank 0: write ``manifest`` and make ``tmp`` the checkpoint ``root/name`` atomically;
        (its path, the manifest's stamp, the manifest as written: a store may record where the
        data is, ``data_dir``). ``fence()`` is called right before the atomic step (nothing is
        visible yet); what it raises propagates and nothing becomes visible.
        CheckpointExistsError if a committed checkpoint holds ``name`` and ``overwrite`` is
        False (also when another writer committed it meanwhile); a damaged one is replaced."""
        raise NotImplementedError

    def discard(self, tmp: str, rank: int, keep_file: bool) -> None:
        """After an abort: rank 0 removes the temporary location, another rank its own file
        (``keep_file``: a rank that lost the coordination store keeps it; rank 0 may still be
        reading it). Never raises: what is left is the stale cleanup's."""
        raise NotImplementedError

    def delete(self, root: str, name: str, fsync: bool) -> None:
        """Take the checkpoint ``root/name`` (committed or damaged) out of sight atomically,
        then remove its files. CheckpointNotFoundError, nothing removed, unless it is one;
        OSError naming the leftovers if its files could not all be removed."""
        raise NotImplementedError

    def quarantine(self, root: str, name: str, reason: str, fsync: bool) -> str:
        """Take the committed checkpoint ``root/name``, found damaged by a restore, out of
        sight under ``root/.damaged.<name>.<uid>`` (never listed, never removed by datastates),
        with ``reason`` written beside it in ``reason.txt``; return that path.
        CheckpointNotFoundError, nothing moved, unless ``root/name`` is a checkpoint."""
        raise NotImplementedError

    def write_latest(self, root: str, name: str, fsync: bool) -> None:
        """Point the ``latest`` hint at ``name``."""
        self.store.write_atomic(self.store.join(root, fmt.LATEST), name.encode(), fsync)

    def clean_stale(self, root: str, max_age_s: float) -> list[str]:
        """Remove what dead writers left in ``root``; return what was removed. Never raises for
        one entry (one that vanished meanwhile is skipped; one that cannot be removed is
        logged and left), so that a reader can always open a root, even a read-only one."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what :meth:`hold` took."""


def publisher_for(store: Store) -> Publisher:
    """The publisher of ``store``: :class:`RenamePublisher` if it renames, else
    :class:`ManifestPublisher`."""
    return RenamePublisher(store) if store.renames else ManifestPublisher(store)


def placeholder(path: str) -> bool:
    """Whether ``path`` is free for a checkpoint: missing, or an empty directory (not a link),
    which a framework's adapter makes at once so that the name of a save in flight exists
    (docs/integrations.md, Lightning)."""
    try:
        if not stat.S_ISDIR(os.lstat(path).st_mode):
            return False
        with os.scandir(path) as entries:
            return next(entries, None) is None
    except FileNotFoundError:
        return True
    except NotADirectoryError:
        return False


def not_a_checkpoint(path: str) -> CheckpointExistsError:
    return CheckpointExistsError(
        f"{path} exists and is not a checkpoint (it holds no "
        f"{fmt.MANIFEST} datastates wrote); it is left alone: remove it "
        "or save under another name"
    )


def _tidy_warning(final: str, exc: OSError) -> None:
    warnings.warn(
        f"datastates: {final} is committed, but tidying up after the commit failed: {exc}",
        RuntimeWarning,
        stacklevel=4,
    )


def _taken_meanwhile(final: str) -> CheckpointExistsError:
    return CheckpointExistsError(
        f"{final} was committed by another writer meanwhile; pass overwrite=True to replace it"
    )


#: How many times an overwrite makes room and renames before it gives up: each try that fails
#: lost to another writer's commit, which is then the one replaced.
_SWAPS = 8


# ---------------------------------------------------------------- stores that rename


class RenamePublisher(Publisher):
    """A local (POSIX) root: temporary directories renamed into place. Every temporary is named
    after an owner holding a lease (``datastates.storage.temporaries``, docs/format.md "Names"):
    ``.tmp.<run>-<serial>.<key>`` (the run's lease, held from the first :meth:`hold` to
    :meth:`close`), ``.old.<op>.<uid>.<hex name>``, ``.trash.<op>.<uid>`` and
    ``latest.tmp.<op>.<uid>`` (a lease held for that one operation).

    An empty directory at a checkpoint's name (not a link) is a placeholder: the name is free,
    and the commit renames the new checkpoint over it in one atomic step (a rename onto an
    empty directory). A directory holding anything else that is not a checkpoint is never
    replaced."""

    renames = True

    def __init__(self, store: Store):
        super().__init__(store)
        self._leases: dict[tuple[str, str], Lease] = {}

    def tmp_location(self, root: str, name: str, run_id: str, serial: int) -> str:
        return os.path.join(root, tmp_name(name, owner_token(run_id), serial))

    def check_root(self, root: str) -> None:
        """NotADirectoryError unless ``root`` is a directory or can become one (its nearest
        existing ancestor is a directory)."""
        existing = root
        while not os.path.exists(existing) and os.path.dirname(existing) != existing:
            existing = os.path.dirname(existing)
        if not os.path.isdir(existing):
            raise NotADirectoryError(
                errno.ENOTDIR,
                f"cannot use {root} as a checkpoint "
                f"directory: {existing} is a file, expected a directory",
                root,
            )

    def check_name(self, root: str, name: str, overwrite: bool) -> None:
        """CheckpointExistsError if ``root/name`` is a committed checkpoint and ``overwrite``
        is False, or exists without being a checkpoint at all (no ``manifest.json``: never
        replaced); a damaged checkpoint is no obstacle (the commit moves it aside). Reads the
        manifest only when the name is taken and ``overwrite`` is False."""
        path = os.path.join(root, name)
        if placeholder(path):
            return
        if not os.path.lexists(os.path.join(path, fmt.MANIFEST)):
            raise not_a_checkpoint(path)
        if overwrite:
            return
        found, _ = examine(path)
        if isinstance(found, CheckpointInfo):
            raise CheckpointExistsError(
                f"checkpoint {name!r} already exists in {root}; pass overwrite=True to replace it"
            )

    def hold(self, root: str, run_id: str, fsync: bool) -> None:
        """Once per run and root: create the root and hold the run's lease in it, until
        :meth:`close`. CheckpointWriteError if the root does not take it."""
        key = (root, owner_token(run_id))
        if key in self._leases:
            return
        try:
            self.store.makedirs(root, fsync)
            self._leases[key] = Lease.hold(*key)
        except OSError as exc:
            raise CheckpointWriteError(
                exc.errno,
                f"cannot save into {root}: creating it or "
                f"its lease file failed: {exc.strerror or exc}",
                exc.filename,
            ) from exc

    def close(self) -> None:
        leases, self._leases = self._leases, {}
        for lease in leases.values():
            lease.release()

    # ---- publish
    def publish(
        self,
        root: str,
        tmp: str,
        name: str,
        manifest: records.Manifest,
        overwrite: bool,
        fsync: bool,
        fence: Callable[[], None] | None = None,
    ) -> tuple[str, Any, records.Manifest]:
        """Writes the manifest into ``tmp``, then (after ``fence()``) renames ``tmp`` into place
        (the manifest's stamp, taken before the rename, stays valid: the rename does not touch
        the file). A
        damaged checkpoint of that name is moved aside (:meth:`set_aside`); a committed one is
        replaced only with ``overwrite``; a directory that is no checkpoint never."""
        final = os.path.join(root, name)
        encoded = files.encode_manifest_record(manifest)
        for part, data in encoded.parts:  # a split manifest's parts, before its head
            self.store.write_atomic(os.path.join(tmp, part), data, fsync)
        stamp = self.store.write_atomic(os.path.join(tmp, fmt.MANIFEST), encoded.data, fsync)
        replace = self._make_room(root, name, overwrite, fsync)
        if fence is not None:
            fence()
        self._swap_in(root, tmp, name, replace, overwrite, fsync, fence)
        return final, stamp, encoded.written

    def _make_room(self, root: str, name: str, overwrite: bool, fsync: bool) -> bool:
        """Whether a committed checkpoint ``root/name`` is to be replaced (see :meth:`publish`)."""
        final = os.path.join(root, name)
        if placeholder(final):
            return False  # renamed over: a rename replaces an empty directory atomically
        found, _ = examine(final, self.store)
        if isinstance(found, DamagedCheckpoint):
            self.set_aside(root, found, fsync)  # its bytes are kept, never replaced
            return False
        if found is None:
            raise not_a_checkpoint(final)
        if not overwrite:
            raise CheckpointExistsError(
                f"{final} already exists (committed meanwhile); pass overwrite=True to replace it"
            )
        return True

    def make_visible(self, root: str, tmp: str, name: str, replace: bool, fsync: bool) -> None:
        """Rename the finished directory ``tmp`` to ``root/name``. ``replace``: the two are
        exchanged in one atomic step where the file system can (:func:`posix.exchange`), so a
        reader of ``root/name`` never finds it missing, and the old one, now at ``tmp``, is
        removed (a crash first leaves it to the cleanup of dead writers' temporaries); else
        what is there is moved aside to an owned ``.old.`` first and removed once the new one
        is in place (put back if the rename fails). CheckpointExistsError if ``root/name`` was
        taken meanwhile (another writer's commit won the race). After the rename the
        checkpoint is visible: later failures (the fsync of ``root``, removing the old one) are
        warnings."""
        if not self._rename_in(root, tmp, name, replace, fsync):
            raise _taken_meanwhile(os.path.join(root, name))

    def _swap_in(
        self,
        root: str,
        tmp: str,
        name: str,
        replace: bool,
        overwrite: bool,
        fsync: bool,
        fence: Callable[[], None] | None = None,
    ) -> None:
        """:meth:`make_visible`, except that with ``overwrite`` a name another writer's commit
        took meanwhile (between :meth:`_make_room` and the rename: both saved a new name, or it
        came between the two renames of a replacement) is replaced in turn: room is made again
        (``fence()`` called again) and ``tmp`` exchanged with what is there now, up to
        ``_SWAPS`` tries in all."""
        final = os.path.join(root, name)
        for attempt in range(_SWAPS):
            if attempt:
                replace = self._make_room(root, name, overwrite, fsync)
                if fence is not None:
                    fence()
            if self._rename_in(root, tmp, name, replace, fsync):
                return
            if not overwrite:
                raise _taken_meanwhile(final)
            log.info("%s was committed by another writer meanwhile; replacing it", final)
        raise CheckpointExistsError(
            f"{final}: expected to replace it (overwrite=True), found it "
            f"committed anew by other writers at each of {_SWAPS} "
            f"tries; {tmp} was not committed"
        )

    def _rename_in(self, root: str, tmp: str, name: str, replace: bool, fsync: bool) -> bool:
        """:meth:`make_visible`; False, nothing changed, if ``root/name`` was taken meanwhile."""
        final = os.path.join(root, name)
        lease = Lease.hold(root, fresh_token()) if replace else None
        old, left = None, False
        try:
            if lease is not None:
                try:
                    if posix.exchange(tmp, final):  # the replaced one is at tmp now
                        left = self._tidy(
                            root, final, tmp, fsync, os.path.join(root, trash_name(lease.token))
                        )
                        return True
                except FileNotFoundError:
                    pass  # deleted meanwhile: renamed below, as when nothing is replaced
                try:
                    old = os.path.join(root, old_name(name, lease.token))
                except ValueError as exc:
                    raise CheckpointWriteError(
                        errno.ENAMETOOLONG, f"{final}: {exc}; nothing was changed", final
                    ) from None
                try:
                    os.rename(final, old)
                except FileNotFoundError:
                    old = None  # deleted meanwhile: nothing to replace
            try:
                os.rename(tmp, final)
            except OSError as exc:
                left = old is not None and not self._put_back(old, final)
                if exc.errno in TAKEN_ERRNOS:
                    return False
                raise
            left = self._tidy(root, final, old, fsync)
            return True
        finally:
            if lease is not None:
                lease.release(leftovers=left)

    def _put_back(self, old: str, final: str) -> bool:
        """A failed save changes nothing: the replaced checkpoint goes back -- or, if another
        writer's commit took its name meanwhile, it is replaced by that one and removed. False
        (it stays ``old``, the cleanup's) if that fails too."""
        try:
            os.rename(old, final)
            return True
        except OSError as exc:
            if exc.errno in TAKEN_ERRNOS:
                try:
                    _discard_replaced(old)
                    return True
                except OSError as failed:
                    exc = failed
            log.warning(
                "the checkpoint %s replaced by a failed save could not be put back "
                "(%s); it is kept as %s",
                final,
                exc,
                old,
            )
            return False

    def _tidy(
        self, root: str, final: str, old: str | None, fsync: bool, trash: str | None = None
    ) -> bool:
        """After the commit: fsync ``root``, remove ``old`` (renamed to ``trash`` first, by
        default the ``.trash.`` name matching its ``.old.`` one); True if ``old`` is left."""
        left = False
        for step in (
            lambda: posix.fsync_dir(root) if fsync else None,
            lambda: _discard_replaced(old, trash) if old is not None else None,
        ):
            try:
                step()
            except FileNotFoundError:
                pass
            except OSError as exc:
                left = old is not None
                _tidy_warning(final, exc)
        return left

    def set_aside(self, root: str, damaged: DamagedCheckpoint, fsync: bool) -> str:
        """Move the damaged checkpoint out of the way of a new save of its name, to
        ``root/.damaged.<name>.<uid>`` (never listed, never removed by datastates: its bytes
        stay for inspection), with a WARNING naming the reason and the new path."""
        aside = self._move_aside(root, damaged.name, damaged.path, fsync)
        log.warning(
            "the damaged checkpoint %s was moved to %s to make room for a new save of "
            "that name: %s",
            damaged.name,
            aside,
            damaged.reason,
        )
        return aside

    def quarantine(self, root: str, name: str, reason: str, fsync: bool) -> str:
        path = os.path.join(root, fmt.check_name(name))
        _check_checkpoint_dir(root, name, path)
        aside = self._move_aside(root, name, path, fsync)
        try:
            posix.write_file_atomic(os.path.join(aside, "reason.txt"), reason.encode(), fsync)
        except OSError as exc:  # the move is done; the log keeps the reason
            log.warning("could not write the reason into %s: %s", aside, exc)
        return aside

    @staticmethod
    def _move_aside(root: str, name: str, path: str, fsync: bool) -> str:
        aside = os.path.join(root, damaged_name(name))
        os.rename(path, aside)
        if fsync:
            posix.fsync_dir(root)
        return aside

    def discard(self, tmp: str, rank: int, keep_file: bool) -> None:
        if rank == 0:
            try:
                self.store.remove_tree(tmp)
            except OSError:
                pass  # named by the caller's own retry, else left to the stale cleanup
            return
        if keep_file:
            return
        try:
            self.store.remove(os.path.join(tmp, fmt.shard_file_name(rank)))
            os.rmdir(tmp)
        except OSError:
            pass  # absent, or other ranks' files still there (rank 0 removes the rest)

    # ---- take away
    def delete(self, root: str, name: str, fsync: bool) -> None:
        """Renames ``root/name`` to an owned ``.trash.`` (the deletion is then done: the name is
        free), then removes it. Only a directory (not a link) holding a regular file
        ``manifest.json`` is deleted."""
        path = os.path.join(root, fmt.check_name(name))
        _check_checkpoint_dir(root, name, path)
        with Lease.hold(root, fresh_token()) as lease:
            trash = os.path.join(root, trash_name(lease.token))
            try:
                os.rename(path, trash)
            except FileNotFoundError:
                raise CheckpointNotFoundError(
                    f"no checkpoint {name!r} in {root!r} (deleted meanwhile)"
                ) from None
            if fsync:
                posix.fsync_dir(root)
            try:
                self.store.remove_tree(trash)
            except OSError as exc:
                lease.release(leftovers=True)
                raise OSError(
                    exc.errno,
                    f"checkpoint {name!r} was deleted (no longer listed) "
                    f"but its files in {trash} could not be removed: "
                    f"{exc.strerror or exc}",
                    exc.filename,
                ) from exc

    def write_latest(self, root: str, name: str, fsync: bool) -> None:
        with Lease.hold(root, fresh_token()) as lease:
            posix.write_file_atomic(
                os.path.join(root, fmt.LATEST), name.encode(), fsync, owner=lease.token
            )

    # ---- what dead writers left
    def clean_stale(self, root: str, max_age_s: float) -> list[str]:
        """Removes the temporaries of dead owners (whatever their age), and those of no known
        owner older than ``max_age_s``; puts back a checkpoint whose replacement was interrupted
        between its two renames (its ``.old.`` while ``root/<name>`` is missing). A live owner's
        temporaries are never touched. Then removes the lease files of dead owners."""
        removed, failures = sweep(root, max_age_s)
        for path, exc in failures:
            skipped(path, exc)
        return removed


def _check_checkpoint_dir(root: str, name: str, path: str) -> None:
    """CheckpointNotFoundError unless ``path`` is a directory, not a link, holding a regular
    file ``manifest.json`` and bearing a mark of this library (``written_by_datastates``)."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        raise CheckpointNotFoundError(f"no checkpoint {name!r} in {root!r}") from None
    if not stat.S_ISDIR(mode):
        raise CheckpointNotFoundError(
            f"{path} is not a checkpoint: expected a directory, found "
            f"{file_kind(mode)}; nothing was removed"
        )
    manifest = os.path.join(path, fmt.MANIFEST)
    try:
        mode = os.lstat(manifest).st_mode
    except FileNotFoundError:
        raise CheckpointNotFoundError(
            f"{path} is not a checkpoint: it holds no {fmt.MANIFEST} "
            "(only a commit writes one); nothing was removed"
        ) from None
    if not stat.S_ISREG(mode):
        raise CheckpointNotFoundError(
            f"{path} is not a checkpoint: {manifest} is "
            f"{file_kind(mode)}, expected a regular file; nothing was "
            "removed"
        )
    if not written_by_datastates(path):
        raise CheckpointNotFoundError(_foreign_text(path))


def _foreign_text(path: str, done: str = "removed") -> str:
    return (
        f"{path} is not a checkpoint: its {fmt.MANIFEST} is not one datastates wrote (it "
        "does not begin or end as one, and no datastates shard file lies beside it); "
        f"nothing was {done}"
    )


# ---------------------------------------------------------------- stores the manifest commits


def _children(store: Store, path: str) -> list[str]:
    try:
        return store.listdir(path)
    except FileNotFoundError:
        return []


def _written_by(store: Store, path: str, when: float) -> bool:
    """Whether every file under ``path`` was written before ``when`` (False if none is left;
    a file of the same second as ``when`` may be a later one: kept)."""
    try:
        return store.mtime(path) < when
    except FileNotFoundError:
        return False


def _only_data(store: Store, path: str) -> bool:
    """Whether the data directory ``path`` holds only files a save writes (nothing else of
    anyone's is removed with it)."""
    return all(fmt.saved_file(name) for name in _children(store, path))


def _discard_replaced(old: str, trash: str | None = None) -> None:
    """Remove a replaced checkpoint's directory ``old``. It is first renamed to ``trash`` (by
    default a ``.trash.`` name of the ``.old.``'s owner): a removal that fails halfway then
    leaves a deletion for the cleanup to finish, never an ``.old.`` that a cleanup would put
    back under a name deleted since."""
    if trash is None:
        aside = parse_temporary(os.path.basename(old))
        owner = aside.owner if aside is not None and aside.owner else fresh_token()
        trash = os.path.join(os.path.dirname(old), trash_name(owner))
    os.rename(old, trash)
    posix.remove_tree(trash)


#: How long ManifestPublisher.close waits for damaged checkpoints' shard files to be moved.
_MOVE_WAIT_S = 600.0
#: ManifestPublisher.quarantine: copies in flight at once.
_COPIES = 32  # server-side copies: no byte through this process, only requests


def _data_files(manifest_bytes: bytes, path: str) -> list[tuple[str, ...]]:
    """The shard files (and a split manifest's parts) the manifest ``path`` names, as key parts
    under its checkpoint (inside its data directory); none if it no longer parses (the manifest
    alone is then moved)."""
    try:
        return [tuple(name.split("/")) for name in files.manifest_data_files(manifest_bytes, path)]
    except CorruptCheckpointError:
        return []


class ManifestPublisher(Publisher):
    """An object store: data under ``<root>/<name>/.data.<run>-<serial>/``, committed by the
    PUT of ``<root>/<name>/manifest.json``. Object stores have no locks, so a data directory
    that no manifest names is removed only once older than ``max_age_s``."""

    renames = False

    def __init__(self, store: Store):
        super().__init__(store)
        #: threads moving quarantined checkpoints' shard files (:meth:`quarantine`)
        self._moving: list[threading.Thread] = []

    def tmp_location(self, root: str, name: str, run_id: str, serial: int) -> str:
        return self.store.join(root, name, data_dir_name(owner_token(run_id), serial))

    def publish(
        self,
        root: str,
        tmp: str,
        name: str,
        manifest: records.Manifest,
        overwrite: bool,
        fsync: bool,
        fence: Callable[[], None] | None = None,
    ) -> tuple[str, Any, records.Manifest]:
        """The shard files are already in place; writing ``manifest.json`` (one PUT, atomic,
        after ``fence()``) commits. Without ``overwrite`` the PUT is conditional, so the store
        refuses it if another writer committed meanwhile. A replaced checkpoint's data directory
        is deleted after the new manifest is in place, so a reader sees the old manifest with the
        old data or the new manifest with the new data, never a mix."""
        store, final = self.store, self.store.join(root, name)
        manifest = dataclasses.replace(manifest, data_dir=tmp.rstrip("/").rsplit("/", 1)[-1])
        # examine: a manifest that cannot be *read* (a refused or failed GET) raises, it is never
        # taken for damage and overwritten without overwrite=True
        old: records.Manifest | Literal[False] | None  # False: a damaged one, to replace
        found, old = examine(final, store)
        if isinstance(found, DamagedCheckpoint) and not written_by_datastates(
            final, store, besides=manifest.data_dir
        ):
            found = None  # its only mark is the data this save uploaded into that folder
        if found is None and (
            store.isfile(store.join(final, fmt.MANIFEST))
            or any(not is_data_dir(child) for child in _children(store, final))
        ):
            raise not_a_checkpoint(final)  # another program's folder: never written into
        if isinstance(found, DamagedCheckpoint):
            old = False  # a damaged manifest: replace it, leave its data for clean_stale
            log.warning(
                "the damaged checkpoint %s is replaced by a new save of that name (its "
                "data directories stay until the cleanup of stale data removes them): "
                "%s",
                final,
                found.reason,
            )
        if old and not overwrite:
            raise CheckpointExistsError(
                f"{final} already exists (committed meanwhile); pass overwrite=True to replace it"
            )
        encoded = files.encode_manifest_record(manifest)
        for part, data in encoded.parts:  # a split manifest's parts, in the data directory
            store.write_atomic(store.join(tmp, part), data, True)
        target = store.join(final, fmt.MANIFEST)
        replace = overwrite or old is False
        if fence is not None:
            fence()
        try:
            stamp = (store.write_atomic if replace else store.write_new)(target, encoded.data, True)
        except FileExistsError:
            raise _taken_meanwhile(final) from None
        if old and old.data_dir and old.data_dir != manifest.data_dir:
            try:
                store.remove_tree(store.join(final, old.data_dir))
            except OSError as exc:
                _tidy_warning(final, exc)
        return final, stamp, encoded.written

    def discard(self, tmp: str, rank: int, keep_file: bool) -> None:
        try:
            if rank == 0:
                self.store.remove_tree(tmp)
            elif not keep_file:
                self.store.remove(self.store.join(tmp, fmt.shard_file_name(rank)))
        except OSError:
            pass  # left to the stale cleanup

    def delete(self, root: str, name: str, fsync: bool) -> None:
        """Deletes ``manifest.json`` first (the checkpoint is then gone), then the data it
        names and the data directories written before it (leftovers of earlier saves of the
        name), not the prefix: the data another process is uploading for a new save of this
        name stays (a data directory no manifest names is the stale cleanup's, by age). A
        damaged manifest names nothing: the prefix goes."""
        store = self.store
        path, manifest = self._checkpoint(root, name, "removed")
        try:
            committed = store.mtime(manifest)
            named = files.manifest_data_files(
                store.read_bytes(manifest, max_bytes=fmt.MAX_MANIFEST_BYTES), manifest
            )
        except CorruptCheckpointError:
            named = None
        except FileNotFoundError:
            raise CheckpointNotFoundError(
                f"no checkpoint {name!r} in {root!r}: its manifest "
                "was deleted meanwhile; nothing was removed"
            ) from None
        store.remove(manifest)
        try:
            if named is None:
                store.remove_tree(path)
                return
            folders = {n.split("/")[0] for n in named if "/" in n}
            for child in _children(store, path):
                if (
                    child in folders
                    or is_data_dir(child)
                    and _written_by(store, store.join(path, child), committed)
                    and _only_data(store, store.join(path, child))
                ):
                    store.remove_tree(store.join(path, child))
            for loose in (n for n in named if "/" not in n):
                store.remove(store.join(path, loose))
        except OSError as exc:
            raise OSError(
                exc.errno,
                f"checkpoint {name!r} was deleted (no longer listed) but "
                f"its files in {path} could not be removed: "
                f"{exc.strerror or exc}",
                exc.filename,
            ) from exc

    def _checkpoint(self, root: str, name: str, done: str) -> tuple[str, str]:
        """(prefix, manifest key) of the checkpoint ``root/name``; CheckpointNotFoundError
        saying nothing was ``done`` unless its manifest exists."""
        path = self.store.join(root, fmt.check_name(name))
        manifest = self.store.join(path, fmt.MANIFEST)
        if not self.store.isfile(manifest):
            raise CheckpointNotFoundError(
                f"no checkpoint {name!r} in {root!r}: no {manifest}; nothing was {done}"
            )
        if not written_by_datastates(path, self.store):
            raise CheckpointNotFoundError(_foreign_text(path, done))
        return path, manifest

    def quarantine(self, root: str, name: str, reason: str, fsync: bool) -> str:
        """An object store renames nothing, so the checkpoint is moved by copies, in two parts.

        At once (the ranks of a fallback restore wait for it): its manifest and ``reason.txt``
        are written to ``root/.damaged.<name>.<uid>/``, then its manifest is deleted (the
        checkpoint is gone, its name free). A failure before that deletion leaves the
        checkpoint as it was and removes what was written.

        Then, on a thread of its own (:meth:`close` waits for it): the shard files the manifest
        names are copied by the store (``Store.copy``: server-side, 32 at a time; a missing one,
        the damage found, is not) to the same keys under the quarantine, and each original is
        removed once copied. Until a file is copied it is data no manifest names, which the
        cleanup of stale data would remove after ``stale_tmp_age_s``. A store that cannot copy
        leaves the data there (logged)."""
        store = self.store
        path, manifest = self._checkpoint(root, name, "moved")
        aside = store.join(root, damaged_name(name))
        data = store.read_bytes(manifest, fmt.MAX_MANIFEST_BYTES)
        try:
            store.write_new(store.join(aside, fmt.MANIFEST), data, True)
            store.write_new(store.join(aside, "reason.txt"), reason.encode(), True)
            store.remove(manifest)
        except BaseException:
            try:
                store.remove_tree(aside)
            except OSError as exc:
                log.warning(
                    "could not remove %s, the partial record of the damaged checkpoint %s: %s",
                    aside,
                    path,
                    exc,
                )
            raise
        data_files = _data_files(data, manifest)
        if data_files:
            mover = threading.Thread(
                target=self._move_data,
                args=(path, aside, data_files),
                name="datastates-quarantine",
                daemon=True,
            )
            self._moving.append(mover)
            mover.start()
        return aside

    def _move_data(self, path: str, aside: str, data_files: list[tuple[str, ...]]) -> None:
        """Copy each of ``data_files`` (key parts under ``path``) to the same parts under
        ``aside``, then remove the originals copied. Logs, never raises."""
        from concurrent.futures import ThreadPoolExecutor

        store = self.store

        def copy(parts: tuple[str, ...]) -> bool:
            try:
                store.copy(store.join(path, *parts), store.join(aside, *parts))
            except FileNotFoundError:
                return False
            return True

        try:
            with ThreadPoolExecutor(max(1, min(_COPIES, len(data_files)))) as pool:
                copied = [p for p, done in zip(data_files, pool.map(copy, data_files)) if done]
        except NotImplementedError:
            log.warning(
                "the store of %s cannot copy: the shard files of the damaged checkpoint "
                "stay in %s, for the cleanup of stale data",
                aside,
                path,
            )
            return
        except Exception as exc:  # noqa: BLE001 - logged; the originals stay where they are
            log.warning(
                "moving the shard files of the damaged checkpoint %s to %s failed (they "
                "stay there, for the cleanup of stale data): %r",
                path,
                aside,
                exc,
            )
            return
        for parts in copied:
            original = store.join(path, *parts)
            try:
                store.remove(original)
            except OSError as exc:
                log.warning(
                    "the damaged checkpoint %s was moved to %s, but its original %s "
                    "could not be removed (the cleanup of stale data will): %s",
                    path,
                    aside,
                    original,
                    exc,
                )
        log.info(
            "moved %d shard file(s) of the damaged checkpoint %s to %s", len(copied), path, aside
        )

    def wait_moves(self, timeout_s: float | None = None) -> bool:
        """Wait for the shard files of quarantined checkpoints to be moved; whether all are."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        for mover in list(self._moving):
            mover.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        self._moving = [m for m in self._moving if m.is_alive()]
        return not self._moving

    def close(self) -> None:
        if not self.wait_moves(_MOVE_WAIT_S):
            log.warning(
                "the shard files of a damaged checkpoint are still being moved aside "
                "after %.0f s; the rest stays for the cleanup of stale data",
                _MOVE_WAIT_S,
            )
        super().close()

    def clean_stale(self, root: str, max_age_s: float) -> list[str]:
        """Data directories older than ``max_age_s`` that no manifest names, and unfinished
        multipart uploads older than that. A committed checkpoint with its one data directory
        costs no manifest read: it is the one its manifest names (if it names another, the
        checkpoint is damaged and its leftovers are kept); one with leftovers costs one GET."""
        now, store = time.time(), self.store
        removed = []
        for name in sorted(store.listdir(root)):
            if name.startswith(".") or name == fmt.LATEST:
                continue
            removed += self._clean_checkpoint(root, name, now, max_age_s)
        removed += store.cleanup_uploads(
            root,
            lambda key, started: is_data_key(key, fmt.saved_file) and now - started > max_age_s,
        )
        return removed

    def _clean_checkpoint(self, root: str, name: str, now: float, max_age_s: float) -> list[str]:
        """The stale data directories of the folder ``name``: named as a save names them
        (``.data.<owner>-<serial>``) and holding only the files a save writes there."""
        store, ckpt = self.store, self.store.join(root, name)
        children = store.listdir(ckpt)
        data_dirs = [child for child in children if is_data_dir(child)]
        committed = fmt.MANIFEST in children
        if not data_dirs or (committed and len(data_dirs) == 1):
            return []
        current = None
        if committed:
            try:
                current = files.read_manifest(ckpt, store).data_dir
            except CheckpointNotFoundError:
                pass  # deleted meanwhile: every data directory is a leftover
            except (CorruptCheckpointError, OSError):
                return []  # leave a checkpoint that cannot be read as it is
        removed = []
        for child in data_dirs:
            path = store.join(ckpt, child)
            try:
                if (
                    child == current
                    or now - store.mtime(path) <= max_age_s
                    or not _only_data(store, path)
                ):
                    continue
                store.remove_tree(path)
            except FileNotFoundError:
                continue  # removed meanwhile, or an empty prefix some servers keep listing
            except OSError as exc:
                skipped(path, exc)
                continue
            removed.append(f"{name}/{child}")
        return removed

"""The committed checkpoints of one directory: listing them, and keeping what was read between commits.

Numbering a commit (``seq``, docs/format.md) and applying retention both need the committed
checkpoints of the root, and knowing them means reading and validating each one's manifest (a
manifest of a few hundred tensors takes milliseconds of Python to validate, holding the GIL the
training thread needs). Done from scratch at every commit, that cost grows with the directory, so a
run that saves every step would slow down as it goes. A :class:`Catalog` lists the root once per
scan, with a cheap change stamp per manifest (:meth:`Store.file_stamps`: inode, size and
modification time of ``manifest.json`` on a local disk; the ETag reported by the same LIST request
on an object store), and reads again only the manifests that are new or whose stamp changed. So a
checkpoint committed, replaced or deleted by another process is seen at the next scan, exactly as
a full listing would see it.

A listing needs only what describes a checkpoint (its step, commit number, size, metrics), which a
manifest holds before its entries (docs/format.md, "The head"): a manifest read at a scan has its
checksum checked and only that head decoded and validated, so the first scan of a directory of many
large checkpoints costs a read and a CRC per manifest, not a parse of every entry (a 10,000-tensor
manifest: 2.3 MB, about 0.15 s to parse whole). The newest checkpoint's manifest is then parsed and
validated whole before a scan returns (the one ``latest()`` and ``restore()`` use, and whose ``seq``
numbers the next commit): a manifest whose body does not validate, or does not say what its head
says, makes that checkpoint damaged, and the next newest is checked in turn. An older checkpoint is
parsed whole when it is read (``restore``/``load``/``verify`` of it, a fallback reaching it).

The catalog also keeps the validated manifest of the newest checkpoint (read at a scan, or recorded
by the commit that wrote it), so that ``restore()`` of the latest checkpoint does not read and
validate that manifest a second time; it is handed out only while its stamp is the one the last
scan saw.

A directory holding a ``manifest.json`` that does not decode or validate is a damaged checkpoint
(only a commit writes that file) when it bears a mark of this library
(:func:`written_by_datastates`; without one it is another program's folder, named in a WARNING
and left alone): the catalog keeps it as a :class:`DamagedCheckpoint`, never
restores it, and says which of them are passed over when the latest checkpoint is chosen. A
manifest that could not be *read* (an I/O error, a store that does not answer) is no damage: it is
kept nowhere, read again at the next scan, and the scan fails meanwhile -- the newest checkpoint
is unknown, and neither an older one nor a reused commit number may stand in for it.

On a local disk whose file system cannot exchange two directories, an overwrite renames the
replaced checkpoint to ``.old.<name>.…`` before it renames the new one to ``<name>``: a name
missing while such an entry is there is that checkpoint, read from there (:func:`set_aside`), so
a reader coming between the two renames finds the old checkpoint, never none.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from dataclasses import dataclass
from typing import Any, Iterable

from ..format import codec as fmt
from ..format import files
from ..format import records
from ..format.records import CheckpointInfo, info_of
from ..errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    StorageError,
    UnsupportedFormatError,
)
from ..storage.store import LOCAL, Store
from ..storage.temporaries import parse_temporary

log = logging.getLogger("datastates")

#: How many times a scan lists the root again when a name moved while it was listed.
_RESCANS = 3


@dataclass(frozen=True)
class DamagedCheckpoint:
    """A directory of the root that holds a ``manifest.json`` which does not decode or validate
    (or is no regular file): it was committed once (only a commit writes that file) and is
    damaged now. It is never restored, but it is listed, fails ``verify``, is named in a WARNING
    when ``latest()`` or ``restore()`` pass over it, and retention and ``delete()`` may remove
    it. ``reason`` is the error that reading the manifest raised; ``mtime`` the modification time
    of its ``manifest.json`` (None if it could not be read), which orders it among the others.
    ``newer_format``: the manifest is intact but of a format version this datastates does not
    read (a newer writer's): it is reported like damage, but retention never deletes it."""

    name: str
    path: str
    reason: str
    mtime: float | None = None
    newer_format: bool = False


def human_bytes(n: int) -> str:
    """A size as people read it in logs and listings: ``1536`` gives ``"1.5 KiB"``, ``512``
    gives ``"512 B"`` (binary units up to TiB, one decimal)."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024:
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"


def examine(
    path: str, store: Store = LOCAL, head: bool = False
) -> tuple[CheckpointInfo | DamagedCheckpoint | None, records.Manifest | None]:
    """What the directory ``path`` holds: (info, its validated manifest) for a committed
    checkpoint, (DamagedCheckpoint, None) when its ``manifest.json`` exists but is damaged (it
    does not decode or validate, or it is no regular file), (None, None) when it has no
    ``manifest.json`` (not a checkpoint, or deleted). ``head``: (info, None) when the
    manifest's checksum and head validate (``files.parse_manifest_summary``; the body is not
    decoded), the whole parsed as without it for a manifest that has no such head.

    An ``OSError`` reading the manifest (EIO, ESTALE, a store that does not answer) says nothing
    about the checkpoint: it is raised, never taken for damage."""
    return _examine(path, store, head)[:2]


def _examine(
    path: str, store: Store, head: bool, raw: bytes | None = None, split_head: bool = False
) -> tuple:
    """:func:`examine`, with the manifest's bytes as a third value (None if none were read);
    ``raw``: those bytes, read before (not read again). ``split_head``: a split manifest is
    described by its head once every part's size and CRC-32 are checked
    (``files.split_summary``), without a manifest."""
    file = store.join(path, fmt.MANIFEST)
    try:  # read here, not by files.read_manifest, which takes a refused read (EACCES) for damage
        if raw is None:
            raw = store.read_bytes(file, max_bytes=fmt.MAX_MANIFEST_BYTES)
        if head:
            info = files.parse_manifest_summary(raw, file, path)
            if info is not None:
                return info, None, raw
        parts = files.part_reader(path, store)
        if split_head:
            info = files.split_summary(raw, file, path, parts)
            if info is not None:
                return info, None, raw
        manifest = files.parse_manifest_bytes(raw, file, parts)
    except FileNotFoundError:
        return None, None, None
    except CorruptCheckpointError as exc:
        if not written_by_datastates(path, store, raw):
            _foreign(path, exc)
            return None, None, raw
        return (
            DamagedCheckpoint(
                os.path.basename(path),
                path,
                f"{type(exc).__name__}: {exc}",
                _mtime(store, file),
                isinstance(exc, UnsupportedFormatError),
            ),
            None,
            raw,
        )
    return info_of(path, manifest), manifest, raw


#: How a manifest this library wrote begins (every version) and ends (a sealed one).
_MANIFEST_START = b'{"format":"%s"' % fmt.CHECKPOINT_FORMAT.encode()
_SEAL = b',"manifest_crc32":"'
_MARK_BYTES = 72
_foreign_named: set[str] = set()
_foreign_lock = threading.Lock()


def written_by_datastates(
    path: str, store: Store = LOCAL, raw: bytes | None = None, besides: str | None = None
) -> bool:
    """Whether the directory ``path``, whose ``manifest.json`` does not validate, bears a mark
    of this library, so that it counts as a damaged checkpoint (listed, set aside, deleted by
    retention and ``delete()``): its manifest begins as every manifest written here begins or
    ends with the checksum field that seals one, or its rank 0 shard file (on an object store,
    in one of its ``.data.`` directories) begins with the shard magic. ``raw``: the manifest's
    bytes if they were read (otherwise its first bytes are read, from a regular file only). A
    directory without a mark is not a checkpoint: some other
    program's folder that happens to hold a file named ``manifest.json``, never removed.
    ``besides``: a data directory that does not count (the one a save is committing now)."""
    if raw is None:
        raw = _first_bytes(store.join(path, fmt.MANIFEST), store)
    if raw.startswith(_MANIFEST_START) or _SEAL in raw[-fmt.TRAILER_BYTES :]:
        return True
    try:  # an object store keeps the shard files in a data directory of the checkpoint
        folders = [""] + [
            name for name in store.listdir(path) if name.startswith(".data.") and name != besides
        ]
    except OSError:
        folders = [""]
    return any(
        fmt.is_shard_start(
            _first_bytes(
                store.join(path, folder, fmt.shard_file_name(0))
                if folder
                else store.join(path, fmt.shard_file_name(0)),
                store,
            )
        )
        for folder in folders
    )


def _first_bytes(path: str, store: Store) -> bytes:
    """The first ``_MARK_BYTES`` of the regular file ``path``; empty if it cannot be read."""
    try:
        f = store.open_read(path)
    except (OSError, CorruptCheckpointError):
        return b""
    try:
        return bytes(f.pread(min(_MARK_BYTES, f.size), 0))
    except (OSError, CorruptCheckpointError):
        return b""
    finally:
        f.close()


def _foreign(path: str, exc: Exception) -> None:
    """One WARNING per process and directory: ``path`` holds a ``manifest.json`` that is no
    checkpoint's, left alone."""
    with _foreign_lock:
        if path in _foreign_named:
            return
        _foreign_named.add(path)
    log.warning(
        "%s is not a checkpoint and is left alone: its %s bears no mark of datastates (%s)",
        path,
        fmt.MANIFEST,
        exc,
    )


def _mtime(store: Store, path: str) -> float | None:
    try:
        return store.mtime(path)
    except OSError:
        return None


def set_aside(names: Iterable[str]) -> dict[str, str]:
    """Of the entries ``names`` of a local root: checkpoint name -> the ``.old.`` entry holding
    it, for each name missing from ``names`` whose replaced copy is there. An overwrite where
    the file system cannot exchange two directories renames the old checkpoint so, then the new
    one into place (``RenamePublisher.make_visible``); a crash between the two leaves it until a
    cleanup puts it back. Either way the name is still that checkpoint. Of two such entries, the
    first in sorted order (the one a cleanup puts back)."""
    present = set(names)
    found: dict[str, str] = {}
    for entry in sorted(present):
        temp = parse_temporary(entry) if entry.startswith(".old.") else None
        if (
            temp is not None
            and temp.kind == "old"
            and temp.original
            and not temp.original.startswith(".")
            and temp.original != fmt.LATEST
            and temp.original not in present
        ):
            found.setdefault(temp.original, entry)
    return found


def _as_named(found, name: str):
    """``found`` (an info, a damaged checkpoint or None) under the checkpoint name ``name``."""
    return found if found is None or found.name == name else dataclasses.replace(found, name=name)


def commit_order(info: CheckpointInfo):
    """Sort key of committed checkpoints: by ``seq``; ties (only concurrent writers make them)
    by step, creation time, name. Version-1 checkpoints (seq 0) come first, in step order."""
    return (info.seq, info.step if info.step is not None else -1, info.created_unix, info.name)


class Catalog:
    """The committed checkpoints of ``root`` as of the last :meth:`scan`, for one writer.

    Thread-safe. Holds, per checkpoint name, the stamp of its manifest and what the manifest said
    (or that it was damaged); nothing is trusted across scans without its stamp being unchanged.
    A store that reports no stamp (None) gets every manifest re-read at every scan.

    ``world_size``: that of the job listing (every rank of it lists). A job of several ranks
    reads a split manifest through each rank's view where it can (``files.View``), so its
    listing does not parse the newest one whole: it checks its head and the size and CRC-32 of
    every part (``files.split_summary``), the same on every rank; each rank's reader validates
    what it decodes (the whole manifest where it needs every rank's tree)."""

    def __init__(self, root: str, store: Store = LOCAL, world_size: int = 1):
        self.root, self.store, self.world_size = root, store, world_size
        self._seen: dict[str, tuple[Any, CheckpointInfo | DamagedCheckpoint | None]] = {}
        #: Names in ``_seen`` known from their manifest's head only (not parsed whole yet).
        self._heads: set[str] = set()
        #: (info, stamp, manifest) of the newest checkpoint whose manifest was read or recorded.
        self._newest: tuple[CheckpointInfo, Any, records.Manifest] | None = None
        #: Names :meth:`record` noted (committed by this job): kept when a listing misses them.
        self._recorded: set[str] = set()
        self._lock = threading.Lock()

    def scan(self) -> list[CheckpointInfo]:
        """Committed checkpoints, oldest first (:func:`commit_order`); damaged ones are left out
        of it and kept for :meth:`damaged`. One listing of the root; a manifest is read only if
        new or changed since the last scan. A name that moved while the root was listed (its
        manifest gone when read: another process overwrote it by two renames, or deleted it)
        makes it listed again, up to ``_RESCANS`` times, so that a checkpoint at that name
        all along is found, old or new, never skipped. CheckpointNotFoundError if ``root``
        does not exist.

        StorageError naming each manifest that could not be read (an ``OSError``: EIO, ESTALE,
        a store that does not answer after its retries): the newest checkpoint cannot be known
        then, and an older one is never returned in its place. Nothing is kept of that read:
        the next scan reads that manifest again."""
        with self._lock:
            for _ in range(_RESCANS):
                found = self._scan_once(last=False)
                if found is not None:
                    return found
            found = self._scan_once(last=True)
            assert found is not None, "the last listing is always kept"  # _scan_once's contract
            return found

    def _scan_once(self, last: bool) -> list[CheckpointInfo] | None:
        """One listing of :meth:`scan` (lock held); None if a name moved while it was listed
        (:meth:`_moved`) and this is not the ``last`` listing: nothing is kept of it then."""
        try:
            stamps = self.store.file_stamps(self.root, fmt.MANIFEST)
        except (FileNotFoundError, NotADirectoryError):
            raise CheckpointNotFoundError(
                f"checkpoint directory {self.root!r} does not exist"
            ) from None
        seen, heads, unreadable, moved = {}, set(), [], []
        newest_raw: tuple[CheckpointInfo, bytes] | None = None  # of the newest head read
        aside = set_aside(stamps) if self.store.renames else {}
        entries = list(stamps.items()) + [  # an entry's own stamp would be its old name's
            (name, None if stamps[entry] is None else (entry, stamps[entry]))
            for name, entry in aside.items()
        ]
        for name, stamp in entries:
            if name.startswith(".") or name == fmt.LATEST:
                continue
            known = self._seen.get(name)
            if stamp is not None and known is not None and known[0] == stamp:
                seen[name] = known
                if name in self._heads:
                    heads.add(name)
                continue
            try:
                found, manifest, raw = _examine(
                    self.store.join(self.root, aside.get(name, name)), self.store, head=True
                )
                found = _as_named(found, name)
            except OSError as exc:
                unreadable.append(
                    f"{self.store.join(self.root, name, fmt.MANIFEST)} "
                    f"({type(exc).__name__}: {exc})"
                )
                continue
            if found is None and raw is None and self._moved(name, stamp):
                moved.append(name)
                continue
            seen[name] = (stamp, found)
            if manifest is not None:
                self._keep(found, stamp, manifest)
            elif isinstance(found, CheckpointInfo):
                heads.add(name)
                if newest_raw is None or commit_order(found) > commit_order(newest_raw[0]):
                    newest_raw = (found, raw)  # likely parsed whole next: not read twice
        if moved and not last:
            log.debug(
                "%s: %s moved while the root was listed (a commit, an overwrite "
                "or a deletion by another process); listing it again",
                self.root,
                ", ".join(moved),
            )
            return None
        self._keep_recorded(seen)
        if not unreadable:
            unreadable = self._parse_newest(seen, heads, newest_raw)
        self._seen, self._heads = seen, heads
        if unreadable:
            raise StorageError(
                f"could not read the manifest of {len(unreadable)} "
                f"checkpoint(s) of {self.root}, so its newest checkpoint is "
                f"unknown (retry once the storage answers): "
                f"{'; '.join(unreadable)}"
            )
        return self._committed()

    def _moved(self, name: str, stamp: Any) -> bool:
        """Whether ``name``, listed by a scan and found without a manifest when read, moved
        meanwhile: a manifest was stamped at the listing (``stamp``), or nothing is at the
        name any more (an overwrite between its two renames, a deletion)."""
        path = self.store.join(self.root, name)
        return stamp is not None or not (self.store.isdir(path) or self.store.isfile(path))

    def record(
        self, info: CheckpointInfo, stamp: Any, manifest: "records.Manifest | None" = None
    ) -> list[CheckpointInfo]:
        """Note a checkpoint this process just committed (its manifest is not read back);
        ``stamp`` is what ``Store.write_atomic`` returned for it (None: read it at the next
        scan), ``manifest`` the validated manifest written. Returns the committed checkpoints
        as now known, oldest first."""
        with self._lock:
            self._seen[info.name] = (stamp, info)
            self._heads.discard(info.name)
            self._recorded.add(info.name)
            if manifest is not None:
                self._keep(info, stamp, manifest)
            return self._committed()

    def _keep_recorded(self, seen: dict) -> None:
        """A listing may lag behind a commit (NFS caches directory attributes; another rank's
        rename is not yet visible here): a checkpoint :meth:`record` noted and the listing lacks
        is kept while its manifest is still found by its own path, forgotten once it is gone."""
        for name in sorted(self._recorded - seen.keys()):
            known = self._seen.get(name)
            if known is not None and self.store.isfile(
                self.store.join(self.root, name, fmt.MANIFEST)
            ):
                seen[name] = known
            else:
                self._recorded.discard(name)

    def info(self, name: str) -> CheckpointInfo | None:
        """The committed checkpoint ``name`` as the last :meth:`scan` (or :meth:`record`) saw
        it; None if it was not one."""
        with self._lock:
            known = self._seen.get(name)
        return known[1] if known is not None and isinstance(known[1], CheckpointInfo) else None

    def damaged(self) -> list[DamagedCheckpoint]:
        """The damaged checkpoints the last :meth:`scan` found, by name."""
        with self._lock:
            return sorted(
                (d for _, d in self._seen.values() if isinstance(d, DamagedCheckpoint)),
                key=lambda d: d.name,
            )

    def passed_over(self, used: CheckpointInfo | None) -> list[DamagedCheckpoint]:
        """The damaged checkpoints of the last :meth:`scan` that may be newer than ``used`` (the
        checkpoint chosen as the latest; None: no readable one), by name, then the folders
        without a manifest that hold shard files of this library (:meth:`_headless`, listed
        anew).

        A damaged checkpoint's commit sequence number is unreadable, so "newer" is decided by the
        modification time of ``manifest.json``: a damaged one whose manifest was modified at or
        after that of ``used`` (or whose time cannot be read) is passed over; an older one would
        not have been chosen anyway. Damage written into a manifest renews its time, so it counts
        as newer: the rule errs towards naming a damaged checkpoint, never towards silence."""
        found = self.damaged() + self._headless()
        if used is None or not found:
            return found
        used_mtime = _mtime(self.store, self.store.join(used.path, fmt.MANIFEST))
        return [d for d in found if d.mtime is None or used_mtime is None or d.mtime >= used_mtime]

    def _headless(self) -> list[DamagedCheckpoint]:
        """The folders of the root that hold no ``manifest.json`` but a shard file of this
        library (:func:`written_by_datastates`), as damaged checkpoints that are never listed,
        deleted or restored: a checkpoint whose manifest was deleted by hand, or one whose
        save or deletion (on an object store, which has no rename) is under way or was
        interrupted. :meth:`passed_over` names those newer than the checkpoint used, so that a
        resume never goes back a step without a word. Hidden names (temporaries) are not
        looked at; ``mtime`` is the folder's (locally, changed when its manifest is deleted;
        on an object store, its newest file). A folder the scan did not see that holds a
        manifest now was committed (or an overwrite's new copy put in place) since the scan:
        it is no damage, and the next scan lists it."""
        try:
            names = self.store.listdir(self.root)
        except OSError:
            return []
        with self._lock:
            known = set(self._seen)
        found = []
        for name in sorted(names):
            path = self.store.join(self.root, name)
            if (
                name.startswith(".")
                or name == fmt.LATEST
                or name in known
                or not written_by_datastates(path, self.store, raw=b"")
                or self.store.isfile(self.store.join(path, fmt.MANIFEST))
            ):
                continue  # (a manifest now: committed or put in place since the scan)
            found.append(
                DamagedCheckpoint(
                    name,
                    path,
                    f"it holds shard files of datastates but no {fmt.MANIFEST}: its "
                    "manifest was deleted, or a save or deletion of it is under way or was "
                    "interrupted",
                    _mtime(self.store, path),
                )
            )
        return found

    def manifest(self, info: CheckpointInfo) -> "records.Manifest | None":
        """The validated manifest of ``info`` (from the last scan or the commit that wrote it)
        if it is the newest checkpoint and its stamp is still the one that scan saw, else None
        (read it from the store)."""
        with self._lock:
            known = self._seen.get(info.name)
            if self._newest is None or known is None or known[1] != info:
                return None
            kept_info, stamp, manifest = self._newest
            return manifest if kept_info == info and stamp == known[0] else None

    def _keep(self, info: CheckpointInfo, stamp: Any, manifest: "records.Manifest") -> None:
        """Keep ``manifest`` if its checkpoint is the newest read or recorded so far (a known
        stamp only)."""
        if stamp is not None and (
            self._newest is None or commit_order(info) >= commit_order(self._newest[0])
        ):
            self._newest = (info, stamp, manifest)

    def _parse_newest(
        self, seen: dict, heads: set[str], newest_raw: "tuple[CheckpointInfo, bytes] | None"
    ) -> list[str]:
        """Parse whole the manifest of the newest checkpoint of ``seen`` while it is known from
        its head only (``heads``, updated): a body that does not validate, or says other than
        the head, makes it damaged, and the next newest is parsed in turn. ``newest_raw``: a
        checkpoint described by a head this scan read, and those bytes. The manifests that
        could not be read (an ``OSError``: as for a scan)."""
        while True:
            newest = max(
                (
                    (info, name)
                    for name, (_, info) in seen.items()
                    if isinstance(info, CheckpointInfo)
                ),
                key=lambda pair: commit_order(pair[0]),
                default=None,
            )
            if newest is None or newest[1] not in heads:
                return []
            info, name = newest
            stamp = seen[name][0]
            raw = newest_raw[1] if newest_raw is not None and newest_raw[0] == info else None
            # The bytes the head was read from, or the file as it is now (if it was replaced
            # since, its body is compared with its own head below, never with the old one).
            try:
                found, manifest, raw = _examine(
                    info.path, self.store, False, raw, self.world_size > 1
                )
            except OSError as exc:
                return [f"{self.store.join(info.path, fmt.MANIFEST)} ({type(exc).__name__}: {exc})"]
            found = _as_named(found, name)  # (read at its .old. name: set_aside)
            heads.discard(name)
            if manifest is not None:
                head = _as_named(_examine(info.path, self.store, True, raw)[0], name)
                if head != found:
                    found, manifest = (
                        DamagedCheckpoint(
                            name,
                            info.path,
                            f"CorruptCheckpointError: the manifest's head "
                            f"describes {head}, its body {found}",
                            _mtime(self.store, self.store.join(info.path, fmt.MANIFEST)),
                        ),
                        None,
                    )
            if manifest is not None:
                self._keep(found, stamp, manifest)
            seen[name] = (stamp, found)

    def _committed(self) -> list[CheckpointInfo]:
        return sorted(
            (info for _, info in self._seen.values() if isinstance(info, CheckpointInfo)),
            key=commit_order,
        )


def log_passed_over(
    passed: list[DamagedCheckpoint], used: CheckpointInfo | None, caller: str
) -> None:
    """One WARNING on the ``datastates`` logger per damaged checkpoint ``caller`` (``latest()``,
    ``restore()``...) passed over, naming it, why it is damaged and the checkpoint used."""
    chosen = used.name if used is not None else "none (no readable checkpoint)"
    for d in passed:
        log.warning(
            "%s passed over the damaged checkpoint %s at %s and used %s: %s",
            caller,
            d.name,
            d.path,
            chosen,
            d.reason,
        )


def list_checkpoints(root: str, store: Store = LOCAL) -> list[CheckpointInfo]:
    """Committed checkpoints in ``root``, oldest first: in commit order (``seq``), which is also
    step order for checkpoints saved by step. Damaged ones are left out."""
    return Catalog(root, store).scan()


# ---------------------------------------------------------------- finding a checkpoint


def committed_save(
    root: str, name: str, save_id: str, store: Store = LOCAL
) -> "CheckpointInfo | None":
    """The committed checkpoint ``root/name`` if its manifest records ``save_id``, else None:
    how a rank learns the verdict from the disk when the coordination store is gone."""
    path = store.join(root, name)
    try:
        manifest = files.read_manifest(path, store)
    except (OSError, CorruptCheckpointError):
        return None
    return info_of(path, manifest) if manifest.save_id == save_id else None


def latest(
    root: str, store: Store = LOCAL, catalog: Catalog | None = None
) -> CheckpointInfo | None:
    """The newest committed checkpoint of ``root`` (highest commit sequence number), or None.

    The ``latest`` file is only a hint written after each commit, for people and tools; it is
    not read here. So a crash between a commit and the update of ``latest`` still resumes from
    the checkpoint just committed, and tagged checkpoints count by when they were committed. To
    roll back, delete the newer checkpoints. ``catalog``: the caller's catalog of ``root``, so that
    only the manifests changed since its last scan are read (without it, every one is)."""
    found = (catalog if catalog is not None else Catalog(root, store)).scan()
    return found[-1] if found else None


def _read_named(root: str, name: str, store: Store) -> CheckpointInfo:
    """The checkpoint ``root/name`` (``files.read_info``), found at its ``.old.`` name while a
    replacement by two renames is under way (:func:`set_aside`); CheckpointNotFoundError if
    neither holds it."""
    path = store.join(root, name)
    try:
        return files.read_info(path, store)
    except CheckpointNotFoundError:
        if not store.renames:
            raise
    try:
        entry = set_aside(store.listdir(root)).get(name)
    except (FileNotFoundError, NotADirectoryError):
        entry = None
    if entry is not None:
        try:
            return _as_named(files.read_info(store.join(root, entry), store), name)
        except CheckpointNotFoundError:
            pass  # the new one is in place now, and the old one removed
    return files.read_info(path, store)


def resolve(
    root: str,
    step: int | None = None,
    tag: str | None = None,
    store: Store = LOCAL,
    catalog: Catalog | None = None,
) -> CheckpointInfo:
    """Find a committed checkpoint by tag, by step, or the latest (``catalog``: as for
    :func:`latest`). CheckpointNotFoundError when there is none, naming the damaged
    checkpoints found instead."""
    name = (
        fmt.check_name(tag)
        if tag is not None
        else fmt.step_name(step)
        if step is not None
        else None
    )
    if name is not None:
        try:  # its reader reads the manifest (or its rank's view of it)
            return _read_named(root, name, store)
        except CheckpointNotFoundError:
            if tag is None:
                matches = [i for i in list_checkpoints(root, store) if i.step == step]
                if matches:
                    return matches[-1]
            raise CheckpointNotFoundError(f"no checkpoint {name!r} in {root!r}") from None
    catalog = catalog if catalog is not None else Catalog(root, store)
    try:
        found = latest(root, store, catalog)
    except CheckpointNotFoundError:  # the root does not exist
        raise CheckpointNotFoundError(
            f"no committed checkpoint in {root!r}: the directory does not exist"
        ) from None
    if found is None:
        damaged = "".join(f"; {d.name} is damaged ({d.reason})" for d in catalog.damaged())
        raise CheckpointNotFoundError(f"no committed checkpoint in {root!r}{damaged}")
    return found

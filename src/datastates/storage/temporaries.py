"""The temporaries of a local checkpoint root: their names, who owns each, whether that owner
still lives, and the cleanup of what dead owners left.

A writer names every temporary it creates in a root after an owner token (a cleanup must never
remove, or rename back, what a live writer in another process is using), and holds a shared
``flock`` on ``<root>/.owner.<token>`` for as long as those temporaries may be in use. The kernel
releases the lock when the process ends, however it ends, so a cleaner that can take the lock
exclusively (without waiting) knows the owner is gone: unlike a PID, this holds across PID
namespaces and, on file systems whose locks are shared by their clients (local disks, NFSv4),
across hosts. While the cleaner holds that exclusive lock it removes the dead owner's temporaries;
then it removes the lease file, unless a temporary of that owner is left.

A temporary whose token has no lease file (a name of an earlier version, or a lease another
cleaner is retiring) is nobody's known property: the cleanup removes it only by age.

A file system that refuses ``flock`` (``NO_LOCK_ERRNOS``: Lustre mounted without it, some FUSE
file systems) has no leases: a writer keeps no lease file there and a cleaner takes a lease file
it finds for an unknown owner's, so every temporary of that root is removed by age only (one
WARNING per process and root, :func:`locks_refused`; docs/storage.md, "File systems without
flock").
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import re
import stat
import threading
import time
import uuid
import warnings
from dataclasses import dataclass
from typing import Callable

from .posix import remove_tree

LEASE_PREFIX = ".owner."
_OPEN_FLAGS = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
#: errors that say the root cannot be changed by this process (a reader's copy, a read-only mount)
READ_ONLY_ERRNOS = (errno.EROFS, errno.EACCES, errno.EPERM)
#: what a rename onto a directory that is not empty fails with
TAKEN_ERRNOS = (errno.EEXIST, errno.ENOTEMPTY)
#: what ``flock`` fails with on a file system that has no such locks (Lustre without ``flock``,
#: some FUSE file systems, NFS without a lock manager)
NO_LOCK_ERRNOS = (errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.ENOLCK)
_TOKEN = r"(?P<owner>[0-9a-f]{16})"
_UID = r"[0-9a-f]{8}"
#: The temporaries of a rename store, each named after its owner (docs/format.md, "Names"). No
#: name carries the checkpoint's name as it is spelled: a framework that lists the root and
#: matches its own names in it (Lightning's ``hpc_ckpt_<n>``, ``last``) never takes one for a
#: checkpoint. An ``.old.`` carries the name hex-encoded (``encoded``), to be put back under it.
_OWNED = (
    ("latest", re.compile(rf"latest\.tmp\.{_TOKEN}\.{_UID}")),
    ("tmp", re.compile(rf"\.tmp\.{_TOKEN}-\d+\.[0-9a-f]{{8}}")),
    ("old", re.compile(rf"\.old\.{_TOKEN}\.{_UID}\.(?P<encoded>(?:[0-9a-f]{{2}})+)")),
    ("trash", re.compile(rf"\.trash\.{_TOKEN}\.{_UID}")),
)
#: Earlier versions' owned names, which spelled the checkpoint's name out (``original``).
_EARLIER = (
    ("tmp", re.compile(rf"\.tmp\.(?P<original>.+)\.{_TOKEN}-\d+")),
    ("old", re.compile(rf"\.old\.(?P<original>.+)\.{_TOKEN}\.{_UID}")),
    ("trash", re.compile(rf"\.trash\.(?P<original>.+)\.{_TOKEN}\.{_UID}")),
)
#: The same kinds as still earlier versions named them (no owner: removed by age only).
_UNOWNED = (("latest", "latest.tmp."), ("tmp", ".tmp."), ("old", ".old."), ("trash", ".trash."))
#: The data directories of saves in a store without rename (:func:`data_dir_name`).
_DATA_DIR = re.compile(rf"\.data\.{_TOKEN}-[0-9]+")
#: The longest entry name a local file system takes (POSIX ``NAME_MAX`` on Linux file systems).
NAME_MAX = 255

log = logging.getLogger("datastates")
_unlocked_roots: set[str] = set()
_unlocked_lock = threading.Lock()


def flock(fd: int, operation: int) -> None:
    """``fcntl.flock``: the one call through which leases are locked (a test plays a file
    system without locks by replacing it)."""
    fcntl.flock(fd, operation)


def locks_refused(root: str, exc: OSError) -> None:
    """One WARNING per process and root: its file system refused ``flock`` (``exc``), so its
    temporaries are told stale by age alone."""
    with _unlocked_lock:
        if root in _unlocked_roots:
            return
        _unlocked_roots.add(root)
    log.warning(
        "the file system of %s refused a lock (flock: %s); saves go on without "
        "leases, and a temporary there is removed by the cleanup of stale temporaries "
        "only once older than stale_tmp_age_s, which must exceed the longest save "
        '(docs/storage.md, "File systems without flock")',
        root,
        exc.strerror or exc,
    )


def owner_token(run_id: str) -> str:
    """The owner token of the run ``run_id``: the same on every rank, 16 hex digits (no dot, so
    that it is found at a fixed place at the end of a temporary's name)."""
    return hashlib.sha256(run_id.encode()).hexdigest()[:16]


def fresh_token() -> str:
    """A token for one operation of this process (an overwrite, a deletion)."""
    return uuid.uuid4().hex[:16]


def name_key(name: str) -> str:
    """8 hex digits of the SHA-256 of the checkpoint name ``name``: in a ``.tmp.`` name, so that
    saves of two names with one run token and serial never share a directory."""
    return hashlib.sha256(name.encode()).hexdigest()[:8]


def tmp_name(name: str, token: str, serial: int) -> str:
    """The temporary directory of a save of ``name``: ``.tmp.<token>-<serial>.<key>``."""
    return f".tmp.{token}-{serial}.{name_key(name)}"


def old_name(name: str, token: str) -> str:
    """Where an overwrite keeps the checkpoint ``name`` it replaces, between its two renames:
    ``.old.<token>.<uid>.<hex of name>``. ValueError if that is longer than ``NAME_MAX`` (a name
    of more than 112 bytes), before anything is renamed."""
    entry = f".old.{token}.{uuid.uuid4().hex[:8]}.{name.encode().hex()}"
    if len(entry.encode()) > NAME_MAX:
        raise ValueError(
            f"cannot set the checkpoint {name!r} aside to replace it: expected a "
            f"name of at most {(NAME_MAX - 31) // 2} bytes (its aside name is "
            f"its hex encoding), found {len(name.encode())} bytes"
        )
    return entry


def trash_name(token: str) -> str:
    """A checkpoint being deleted: ``.trash.<token>.<uid>``."""
    return f".trash.{token}.{uuid.uuid4().hex[:8]}"


def damaged_name(name: str) -> str:
    """Where a damaged checkpoint ``name`` is set aside: ``.damaged.<name>.<uid>``. Not a
    temporary: never listed as a checkpoint, never removed by datastates."""
    return f".damaged.{name}.{uuid.uuid4().hex[:8]}"


def data_dir_name(token: str, serial: int) -> str:
    """The data directory of a save in a store without rename, inside its checkpoint's folder
    (``<name>/.data.<token>-<serial>``): its shard files and parts go there, and the manifest
    committing the save names it. Not a temporary of the root: :func:`is_data_dir` finds it."""
    return f".data.{token}-{serial}"


def is_data_dir(name: str) -> bool:
    """Whether the entry ``name`` of a checkpoint's folder is a name :func:`data_dir_name`
    gives."""
    return _DATA_DIR.fullmatch(name) is not None


def is_data_key(key: str, saved: Callable[[str], bool]) -> bool:
    """Whether ``key`` (relative to a root) is ``<name>/<data directory>/<file>``, ``file`` a
    name ``saved`` says a save writes there: what the cleanup of stale uploads may abort."""
    parts = key.split("/")
    return len(parts) == 3 and bool(parts[0]) and is_data_dir(parts[1]) and saved(parts[2])


def lease_path(root: str, token: str) -> str:
    return os.path.join(root, LEASE_PREFIX + token)


class Lease:
    """A shared lock on ``<root>/.owner.<token>``, held from :meth:`hold` to :meth:`release`.

    Several holders of one token (in one process or several) may hold it at once; it is free
    only when the last one released it or died. On a file system that refuses locks the lease
    holds nothing and leaves no file: its temporaries are removed by age."""

    def __init__(self, root: str, token: str, fd: int):
        self.root, self.token, self._fd = root, token, fd

    @classmethod
    def hold(cls, root: str, token: str) -> "Lease":
        """Create (or open) the lease file and take the shared lock. If a cleaner retired the
        file between the open and the lock (it took it for a dead owner's), start again with a
        new file. If the file system refuses the lock (``NO_LOCK_ERRNOS``), remove the file and
        return a lease that holds nothing (:func:`locks_refused` logs it). OSError if the root
        does not take the file (missing, read-only)."""
        path = lease_path(root, token)
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | getattr(os, "O_CLOEXEC", 0), 0o644)
            try:
                flock(fd, fcntl.LOCK_SH)
                if same_file(path, fd):
                    return cls(root, token, fd)
            except OSError as exc:
                if exc.errno not in NO_LOCK_ERRNOS:
                    os.close(fd)
                    raise
                try:
                    if same_file(path, fd):
                        os.remove(path)
                except OSError:
                    pass  # a lease file without a lock is an unknown owner's: removed by age
                finally:
                    os.close(fd)
                locks_refused(root, exc)
                return cls(root, token, -1)
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)

    def release(self, leftovers: bool | None = None) -> None:
        """Drop the lock (idempotent). The lease file is removed when no other holder has it and
        no temporary named after the token is left (``leftovers``: whether the caller left one;
        None: look in the root); a leftover keeps it, so the next cleanup finds a dead owner."""
        fd, self._fd = self._fd, -1
        if fd < 0:
            return
        try:
            flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if leftovers is None:
                leftovers = any(
                    self.token in name and not name.startswith(LEASE_PREFIX)
                    for name in os.listdir(self.root)
                )
            if not leftovers and same_file(lease_path(self.root, self.token), fd):
                os.remove(lease_path(self.root, self.token))
        except OSError:
            pass  # held by another holder, or the root changed: the file is a cleanup's to remove
        finally:
            os.close(fd)

    def __enter__(self) -> "Lease":
        return self

    def __exit__(self, *exc) -> None:
        self.release()


def same_file(path: str, fd: int) -> bool:
    """Whether ``path`` still names the file open as ``fd``."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    opened = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (opened.st_dev, opened.st_ino)


class Owners:
    """The owners of one root's temporaries, as one cleanup finds them.

    :meth:`state` says, per token: ``"live"`` (its lease is held, by its owner or by another
    cleaner retiring it), ``"dead"`` (this cleanup now holds its lease exclusively, until
    :meth:`close`), or ``"unknown"`` (no lease file). :meth:`close` removes the lease file of
    each dead owner none of whose temporaries was left, and drops the locks."""

    def __init__(self, root: str, names: list[str]):
        self.root = root
        self._leases = {n[len(LEASE_PREFIX) :] for n in names if n.startswith(LEASE_PREFIX)}
        self._dead: dict[str, int] = {}
        self._live: set[str] = set()
        self._kept: set[str] = set()

    def lease_tokens(self) -> set[str]:
        return set(self._leases)

    def state(self, token: str | None) -> str:
        if token is None:
            return "unknown"
        if token in self._dead:
            return "dead"
        if token in self._live:
            return "live"
        path = lease_path(self.root, token)
        try:  # not decided from the listing: a lease created while it ran may be missing there
            fd = os.open(path, _OPEN_FLAGS)
        except FileNotFoundError:
            return "unknown"  # none, or retired with its temporaries by another cleaner
        except OSError:  # a link, or another user's lease: whether its owner lives is unknown,
            self._live.add(token)  # so its temporaries are kept, as a live owner's would be
            return "live"
        try:
            flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            self._live.add(token)
            return "live"
        except OSError as exc:
            os.close(fd)
            if exc.errno not in NO_LOCK_ERRNOS:
                raise
            locks_refused(self.root, exc)
            return "unknown"  # no lock can tell whether its owner lives: removed by age
        if not same_file(path, fd):
            os.close(fd)
            self._live.add(token)
            return "live"
        self._dead[token] = fd
        return "dead"

    def keep(self, token: str | None) -> None:
        """A temporary of ``token`` is left: its lease file stays."""
        if token is not None:
            self._kept.add(token)

    def close(self) -> list[str]:
        """Retire the leases of the dead owners; return the lease files removed."""
        removed = []
        for token, fd in self._dead.items():
            try:
                if token not in self._kept and same_file(lease_path(self.root, token), fd):
                    os.remove(lease_path(self.root, token))
                    removed.append(LEASE_PREFIX + token)
            except OSError as exc:
                skipped(lease_path(self.root, token), exc)
            finally:
                os.close(fd)
        self._dead.clear()
        return removed


def skipped(path: str, exc: OSError) -> None:
    """Report a cleanup step that could not be done: an INFO record when the root cannot be
    changed by this process (a read-only copy: a reader never needs to write), else a
    RuntimeWarning naming the path."""
    if exc.errno in READ_ONLY_ERRNOS:
        log.info(
            "the cleanup of stale temporaries left %s (the root cannot be changed here: %s)",
            path,
            exc.strerror or exc,
        )
        return
    warnings.warn(
        f"datastates: could not remove the stale temporary {path}: {exc}",
        RuntimeWarning,
        stacklevel=3,
    )


# ---------------------------------------------------------------- the temporaries of a root


@dataclass(frozen=True)
class Temporary:
    """A temporary entry of a root: its kind (``tmp``, ``old``, ``trash``, ``latest``), its
    name, the checkpoint name it stands for (``old``: the one to put back; None if unknown) and
    its owner token (None: an earlier version's name, without owner)."""

    kind: str
    name: str
    original: str | None
    owner: str | None


def parse_temporary(name: str) -> Temporary | None:
    """The temporary ``name`` names, or None if it names none: this version's names, then
    those of earlier versions."""
    for kind, pattern in _OWNED + _EARLIER:
        found = pattern.fullmatch(name)
        if found:
            fields = found.groupdict()
            original = fields.get("original")
            if fields.get("encoded") is not None:
                try:
                    original = bytes.fromhex(fields["encoded"]).decode()
                except UnicodeDecodeError:
                    continue  # not a name this library encoded
            return Temporary(kind, name, original, found["owner"])
    for kind, prefix in _UNOWNED:
        if name.startswith(prefix):
            original = name[len(prefix) :].rsplit(".", 1)[0] if kind == "old" else None
            return Temporary(kind, name, original or None, None)
    return None


def sweep(
    root: str, max_age_s: float, kinds: tuple[str, ...] | None = None
) -> tuple[list[str], list[tuple[str, OSError]]]:
    """Remove the temporaries of dead owners in ``root`` (whatever their age) and those of no
    known owner older than ``max_age_s``; put back a checkpoint whose replacement was interrupted
    between its two renames (its ``.old.`` while ``root/<name>`` is missing); never touch a live
    owner's. Only the ``kinds`` given (None: all, and then the lease files of dead owners are
    retired too). Returns (names removed, (path, error) of each entry that could not be handled);
    an entry that vanished meanwhile is skipped."""
    try:
        names = sorted(os.listdir(root))
    except (FileNotFoundError, NotADirectoryError):
        return [], []
    owners, now = Owners(root, names), time.time()
    removed, failures = [], []
    try:
        for name in names:
            temp = parse_temporary(name)
            if temp is None or (kinds is not None and temp.kind not in kinds):
                continue
            try:
                if _clean_one(root, temp, owners, now, max_age_s):
                    removed.append(name)
            except FileNotFoundError:
                continue  # gone meanwhile: its writer renamed or removed it
            except OSError as exc:
                owners.keep(temp.owner)
                failures.append((os.path.join(root, name), exc))
        if kinds is None:
            for token in owners.lease_tokens():
                owners.state(token)  # a dead owner without temporaries: retire its lease
    finally:
        owners.close()
    return removed, failures


def _clean_one(root: str, temp: Temporary, owners: Owners, now: float, max_age_s: float) -> bool:
    """Handle one temporary; True if it was removed."""
    state = owners.state(temp.owner)
    if state == "live":
        return False
    path = os.path.join(root, temp.name)
    st = os.lstat(path)
    if state == "unknown" and now - st.st_mtime <= max_age_s:
        return False
    if temp.kind == "latest":
        if not stat.S_ISREG(st.st_mode):
            return False
        os.remove(path)
        return True
    if not stat.S_ISDIR(st.st_mode):
        return False  # not a temporary of datastates: left alone
    if (
        temp.kind == "old"
        and temp.original is not None
        and _restore_replaced(root, path, temp.original)
    ):
        return False
    remove_tree(path)
    return True


def _restore_replaced(root: str, path: str, original: str) -> bool:
    """Put the ``.old.`` directory ``path`` back as ``root/original`` if that name is free:
    a crash came between the two renames of an overwrite."""
    target = os.path.join(root, original)
    if os.path.lexists(target):
        return False
    try:
        os.rename(path, target)
    except OSError as exc:
        if exc.errno in TAKEN_ERRNOS:
            return False  # a new checkpoint took the name meanwhile: this one is replaced
        raise
    log.info("put back the checkpoint %s, whose replacement was interrupted", target)
    return True

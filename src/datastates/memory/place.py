"""Where a job's memory tier lives, and how its keeper is found.

``<root>/datastates-<uid>-<digest>/`` (the digest is of the storage directory's real path, so
that a restarted trainer finds the memory of the job it continues) holds:

- ``keeper.lock``: the live keeper holds an exclusive ``flock`` on it for its whole life; the
  kernel releases it when the keeper ends, however it ends, so "the lock can be taken" means
  "no keeper runs" (a PID could be reused);
- ``ckpt/``: a checkpoint root like any other (same format, same commit protocol), written by
  the trainer's ranks and read back by a restore.

A shared-memory root (``/dev/shm``) is writable by every user: the directory must be a real
directory (not a link), owned by this user, with no access for anyone else, or the tier refuses
it (KeeperError) rather than write into or trust a directory another user prepared.

The keeper listens on a Unix socket in the abstract namespace (no file: nothing to leave
behind, no path-length limit), named after the directory; it accepts only peers of its own uid.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import os
import socket
import stat
import struct
import tempfile

from ..errors import KeeperError

LOCK = "keeper.lock"
CKPT = "ckpt"
_OPEN = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
_PROBE = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)


def _digest(storage_dir: str) -> str:
    return hashlib.sha256(os.path.realpath(storage_dir).encode()).hexdigest()[:16]


def memory_dir(root: str, storage_dir: str) -> str:
    """The memory directory of the job checkpointing into ``storage_dir``."""
    return os.path.join(os.path.abspath(root), f"datastates-{os.getuid()}-{_digest(storage_dir)}")


def default_log(storage_dir: str) -> str:
    return os.path.join(
        tempfile.gettempdir(), f"datastates-keeper-{os.getuid()}-{_digest(storage_dir)}.log"
    )


def socket_address(memdir: str) -> bytes:
    """The keeper's abstract socket address for ``memdir``."""
    digest = hashlib.sha256(os.path.realpath(memdir).encode()).hexdigest()[:32]
    return b"\0datastates-keeper-" + digest.encode()


def peer_uid(sock: socket.socket) -> int:
    """The uid of the process at the other end of the Unix socket ``sock``."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", creds)[1]


def ensure_private_dir(path: str) -> None:
    """Create ``path`` (mode 0700), or check that the one there is this user's private
    directory; KeeperError otherwise (nothing is written into it)."""
    parent = os.path.dirname(path)
    if not os.path.isdir(parent):
        raise KeeperError(f"the memory tier's root {parent} is not a directory")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError as exc:
        raise KeeperError(f"cannot create the memory directory {path}: {exc}") from None
    check_private_dir(path)


def check_private_dir(path: str) -> None:
    """KeeperError unless ``path`` is a directory (not a link) of this user, closed to others."""
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise KeeperError(f"the memory directory {path} cannot be examined: {exc}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise KeeperError(
            f"the memory directory {path} is not a directory (found a "
            f"{_kind(st.st_mode)}); refusing to use it"
        )
    if st.st_uid != os.getuid():
        raise KeeperError(
            f"the memory directory {path} belongs to uid {st.st_uid}, not to "
            f"this user ({os.getuid()}); refusing to use it"
        )
    if st.st_mode & 0o077:
        raise KeeperError(
            f"the memory directory {path} is open to other users (mode "
            f"{stat.S_IMODE(st.st_mode):o}, expected 700); refusing to use it"
        )


def _kind(mode: int) -> str:
    return (
        "symbolic link" if stat.S_ISLNK(mode) else "file" if stat.S_ISREG(mode) else "special file"
    )


def open_lock(memdir: str) -> int:
    """The descriptor of ``memdir/keeper.lock`` (created if missing; never through a link)."""
    try:
        return os.open(os.path.join(memdir, LOCK), _OPEN, 0o600)
    except OSError as exc:
        raise KeeperError(
            f"cannot open the keeper's lock {os.path.join(memdir, LOCK)}: {exc}"
        ) from None


def take_lock(fd: int) -> bool:
    """Take the keeper's exclusive lock without waiting; False if a live keeper holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError as exc:
        if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            return False
        raise


def keeper_running(memdir: str) -> bool:
    """Whether a live keeper holds ``memdir``'s lock (False when there is no such directory or
    no lock file in it).

    A probe: it creates nothing. An ending keeper removes its lock file, then the directory;
    a probe that created the file between the two would leave the memory directory behind."""
    try:
        fd = os.open(os.path.join(memdir, LOCK), _PROBE)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise KeeperError(
            f"cannot open the keeper's lock {os.path.join(memdir, LOCK)}: {exc}"
        ) from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
                return True
            raise
        return False
    finally:
        os.close(fd)


def mapped_by(memdir: str) -> list[int]:
    """The pids of this user's processes (other than this one) that map a file under
    ``memdir`` (``/proc/<pid>/maps``): a trainer keeps its memory shard files mapped from one
    save to the next. Empty where ``/proc`` is not there."""
    prefix = os.path.realpath(memdir) + os.sep
    pids = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/maps", "rb") as f:
                maps = f.read()
        except OSError:  # ended meanwhile, or another user's
            continue
        if b" " + prefix.encode() in maps:
            pids.append(int(entry))
    return sorted(pids)

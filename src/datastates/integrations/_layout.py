"""The files at a framework's checkpoint path ``dir/name`` (docs/lightning.md, "Files on disk"):
the checkpoint ``dir/.datastates/name/`` behind it (a checkpoint of the hidden directory
``dir/.datastates``, whose every other file, ``latest`` hint, leases and temporaries, stays in
there too, so a listing of ``dir`` shows the framework's names only), the hard link to its shard
file put at the path after the commit, the empty placeholder standing there while a save is in
flight, and the files earlier versions left (a checkpoint directory at the path, a
``.plain.<name>`` file set aside). Functions of the file system only; :mod:`._paths` decides
when each runs."""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import socket
import uuid

from datastates.format import PATH_FOLDER

log = logging.getLogger("datastates.integrations")


def is_checkpoint_dir(path) -> bool:
    """True if ``path`` is a committed datastates checkpoint."""
    return os.path.isfile(os.path.join(os.fspath(path), "manifest.json"))


#: The hidden directory of ``dir`` holding the checkpoints behind its paths: ``dir/.datastates``.
FOLDER = PATH_FOLDER
#: The prefix of the name under which an earlier version kept another engine's plain file while
#: the datastates checkpoint replacing it was saved: ``dir/.plain.<name>``. Still read (a crash
#: may have left one) and removed with the path; saves no longer set files aside.
ASIDE_PREFIX = ".plain."
#: What ``os.link`` fails with where the file system has no hard links here (a FUSE or object
#: store mount, a link count at its limit, another device): the path then gets no file.
LINK_REFUSED_ERRNOS = (
    errno.EPERM,
    errno.EXDEV,
    errno.ENOTSUP,
    errno.EOPNOTSUPP,
    errno.EMLINK,
    errno.ENOSYS,
)
#: The temporary name of a link being put in place: ``.link-<host>-<pid>-<8 hex>``, ``<host>``
#: 8 hex digits of this machine's name (a folder shared by several nodes: a process is judged
#: gone only by its own node). It never spells the checkpoint's name, so a framework matching
#: its names in a listing (Lightning's ``hpc_ckpt_<n>``, ``last``) never takes it for one.
_LINK_TMP = re.compile(r"\.link-(?P<host>[0-9a-f]{8})-(?P<pid>[0-9]+)-[0-9a-f]{8}")
HOST = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


def hidden_root(root: str) -> str:
    """The root of the Checkpointer whose checkpoints are those behind the paths in ``root``."""
    return os.path.join(root, FOLDER)


def checkpoint_dir(full: str) -> str:
    """The datastates checkpoint directory behind the path ``full``: ``dir/.datastates/name``."""
    return os.path.join(hidden_root(os.path.dirname(full)), os.path.basename(full))


def aside_path(full: str) -> str:
    """Where an earlier version kept the plain file ``full`` while its replacement was saved."""
    root, name = os.path.split(full)
    return os.path.join(root, ASIDE_PREFIX + name)


def drop_aside(full: str) -> None:
    """After the commit of ``full``, or its removal: remove a file an earlier version set aside."""
    try:
        os.remove(aside_path(full))
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning(
            "could not remove %s, replaced by the checkpoint %s: %r", aside_path(full), full, exc
        )


# The name of a save in flight exists (a framework decides on a new name, ModelCheckpoint's
# ``-v<n>``, by asking whether the path exists): ``save`` creates an empty file at the path
# before the save starts, unless something is there already, and the link made after the commit
# is renamed over it. A failed save removes the placeholder it made if it is still that empty
# file. Readers here take an empty file (no ``torch.save`` output is empty) or an empty
# directory (an earlier version's placeholder) for no checkpoint (:func:`vacant`).


def make_placeholder(full: str) -> tuple[int, int] | None:
    """Create the empty file ``full``; its (device, inode), or None if ``full`` exists."""
    try:
        fd = os.open(full, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0))
    except FileExistsError:
        return None
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    return st.st_dev, st.st_ino


def drop_placeholder(full: str, made: tuple[int, int] | None) -> None:
    """Remove the placeholder ``made`` at ``full`` if it is still that empty file (anything
    else there is left alone)."""
    if made is None:
        return
    try:
        st = os.lstat(full)
        if (st.st_dev, st.st_ino) == made and st.st_size == 0:
            os.remove(full)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove %s, the placeholder of a save: %r", full, exc)


def vacant(full: str) -> bool:
    """Whether no checkpoint and no file is at ``full``: missing, an empty file, or an empty
    directory."""
    try:
        st = os.stat(full)
        if os.path.isdir(full):
            return not os.path.islink(full) and not os.listdir(full)
    except (FileNotFoundError, NotADirectoryError):
        return True
    return st.st_size == 0


def file_at(full: str) -> bool:
    """Whether a file a stock loader reads is at ``full`` (a link to one counts; an empty
    placeholder does not)."""
    return os.path.isfile(full) and os.path.getsize(full) > 0


def file_is_newer(full: str) -> bool:
    """Whether the file at ``full`` was written (or a symbolic link made there) after the
    checkpoint behind it (:func:`checkpoint_dir`) was committed: another engine saved to the path since, so it
    is what the path holds. A link made by :meth:`PathCheckpoints.save`, or a file older than
    the commit (a crash came between the commit and the link), is not."""
    from datastates.format import MANIFEST

    try:
        written = os.lstat(full).st_mtime_ns
        committed = os.stat(os.path.join(checkpoint_dir(full), MANIFEST)).st_mtime_ns
    except OSError:
        return False
    return written > committed


def link_into_place(full: str) -> None:
    """Make ``full`` a hard link to the shard file of the committed checkpoint behind it
    (:func:`checkpoint_dir`, in the same directory tree): linked under a temporary name in
    the directory of ``full``, renamed over
    ``full`` (one atomic step: the path holds the old file or the new one), directory synced.
    OSError from ``os.link`` as raised (the caller tells refusals apart)."""
    from datastates.format import shard_file_name
    from datastates.storage import fsync_dir

    root = os.path.dirname(full)
    tmp = os.path.join(root, f".link-{HOST}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.link(os.path.join(checkpoint_dir(full), shard_file_name(0)), tmp)
    try:
        os.replace(tmp, full)
    except BaseException:
        try:
            os.remove(tmp)
        except OSError:
            pass
        raise
    fsync_dir(root)


def drop_stale_links(root: str) -> None:
    """Remove the temporary links (:func:`link_into_place`) of processes that are gone."""
    try:
        names = os.listdir(root)
    except OSError:
        return
    for name in names:
        found = _LINK_TMP.fullmatch(name)
        if found is None or found["host"] != HOST:  # another node's: it judges its own
            continue
        if int(found["pid"]) == os.getpid() or _alive(int(found["pid"])):
            continue
        try:
            os.remove(os.path.join(root, name))
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not remove the stale link %s: %r", os.path.join(root, name), exc)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:
        return True  # another user's process
    return True

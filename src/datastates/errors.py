"""The one error tree of datastates.

Every class also subclasses the matching built-in exception, so code that already catches
``FileNotFoundError`` or ``ValueError`` keeps working. Messages say what was expected, what was found
and where (file, offset, rank, key).
"""

from __future__ import annotations


class DatastatesError(Exception):
    """Base class of every error raised by datastates."""


class ConfigError(DatastatesError, ValueError):
    """A configuration value is invalid."""


class CheckpointNotFoundError(DatastatesError, FileNotFoundError):
    """The directory, the checkpoint or one of its files does not exist."""


class CheckpointExistsError(DatastatesError, FileExistsError):
    """A committed checkpoint with that name exists and overwriting was not requested."""


class CorruptCheckpointError(DatastatesError, ValueError):
    """A file is truncated, has a wrong magic number, an invalid index or a checksum mismatch."""


class UnsupportedFormatError(CorruptCheckpointError):
    """The checkpoint was written by a newer format version than this reader understands."""


class StateMismatchError(DatastatesError, ValueError):
    """The live state does not match the checkpoint (keys, shapes or dtypes) on a strict restore."""


class SerializationError(DatastatesError, TypeError):
    """A Python object cannot be serialized at save time, or cannot be loaded safely."""


class UnsafeObjectError(SerializationError):
    """A checkpoint holds a Python object whose type is not allowed by safe loading."""


class CheckpointWriteError(DatastatesError, OSError):
    """The background pipeline failed to write or commit a checkpoint (disk full, permission...)."""


class CommitError(DatastatesError, RuntimeError):
    """One or more ranks failed a checkpoint; it was not committed.

    ``causes`` maps each failed rank to the text of its error; every rank raises the same error.
    """

    def __init__(self, message: str, causes: dict[int, str] | None = None):
        super().__init__(message)
        self.causes = dict(causes or {})


class CommitTimeoutError(CommitError, TimeoutError):
    """Some ranks did not report within the commit timeout (a rank died or hangs)."""


class CommitUnknownError(CommitError):
    """This rank cannot learn whether the checkpoint was committed: the coordination store is
    unreachable (or rank 0 fell silent while making it visible) and no manifest of this save
    appeared on disk within the commit timeout. The checkpoint may still appear; a restore
    finds whatever is on disk. ``causes`` maps this rank to what it saw."""


class LazyWriteError(DatastatesError, RuntimeError):
    """Tensors captured lazily were written in place after ``save()`` while the snapshot was
    still being copied in the background (their version counter moved), so it cannot be trusted;
    the save was not committed. ``keys`` are the keys of those tensors on the rank that found
    it (in a save of several ranks, every rank raises a CommitError whose ``causes`` name that
    rank, and on that rank its ``__cause__`` is this error)."""

    def __init__(self, message: str, keys: "tuple[str, ...] | list[str]" = ()):
        super().__init__(message)
        self.keys = tuple(keys)


class RestoreAbortedError(DatastatesError, RuntimeError):
    """A restore with ``fallback=True`` stopped on every rank before live state was modified,
    because another rank failed it (a mismatch, an error other than damage) or did not answer in
    time. ``causes`` maps each such rank to the text of its error (the failing rank itself raises
    its own error)."""

    def __init__(self, message: str, causes: dict[int, str] | None = None):
        super().__init__(message)
        self.causes = dict(causes or {})


class ReshardError(DatastatesError, ValueError):
    """Per-rank state cannot be mapped onto a different world size without the user saying how."""


class CheckpointerClosedError(DatastatesError, RuntimeError):
    """``save``/``restore``/``load`` was called on a closed Checkpointer (or on one sharing the
    pipeline of a Checkpointer that was closed)."""


class StorageError(DatastatesError, OSError):
    """The storage service failed a request (unreachable, refused, or an unexpected reply)."""


class StorageAccessError(StorageError, PermissionError):
    """The storage service refused the credentials (wrong key, no permission on the bucket)."""


class BucketNotFoundError(StorageError, FileNotFoundError):
    """The bucket of an object-store location does not exist."""


def write_error(rank: int, what: str, exc: BaseException) -> BaseException:
    """A background failure as the error a save's handle raises: OS errors become
    CheckpointWriteError with the same errno (``e.errno == errno.ENOSPC`` keeps working) and a
    message naming the rank and what failed; other errors are returned as they are."""
    if isinstance(exc, DatastatesError) or not isinstance(exc, OSError):
        return exc
    error = CheckpointWriteError(exc.errno, f"rank {rank}: {what} failed: {exc.strerror or exc}")
    if exc.filename is not None:
        error.filename = exc.filename
    error.__cause__ = exc
    return error


class KeeperError(DatastatesError, RuntimeError):
    """The memory tier's keeper process could not be started, reached or trusted (its memory
    directory is not this user's private directory, it did not answer in time)."""


class KeeperUnresponsiveError(KeeperError, TimeoutError):
    """The keeper process lives (it holds its lock, or its socket takes the connection) but
    does not answer in time: stopped (SIGSTOP, a frozen container) or hung. A Checkpointer
    being constructed then does without the memory tier (docs/memory-tier.md)."""

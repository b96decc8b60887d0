"""Saves due for storage go to memory first; the keeper then writes them to storage.

With ``MemoryTier(storage_writer="keeper")`` (the default), a save due for storage
(``persist_every``, ``persist=True``) is committed into the memory tier like any other, and rank
0 hands the committed memory checkpoint on: the keeper copies it into storage through the commit
protocol (``persist.py``: every byte checked, the copy fsynced, the manifest numbered after
storage's newest and written last), in its own process. The trainer's threads and host cache
are free again once the memory commit is done, whatever the disk's speed.

These rules keep it safe:

- **The bytes stay while they are copied.** The memory tier's retention keeps a checkpoint this
  module still holds (``held``; ``RetentionPolicy.held``), so its shard files are not recycled
  into the next save while the keeper reads them, and applies itself again once it is written.
  Host memory then holds at most two more states: the one being written and the one waiting.
- **One writer of storage at a time.** Rank 0 commits nothing into storage itself (a save with a
  tag) while a checkpoint is being written there: its commit waits for :meth:`Handoff.idle`
  (``SaveTarget.exclusive``). New hand-ons come only from the commit thread, after a memory
  commit, so none starts while that commit of storage runs.
- **Nothing is lost silently.** A checkpoint still waiting when a newer one is handed on is
  replaced by it (storage gets the newer one), with a WARNING; a write that fails is logged as
  an ERROR and raised by the next ``Checkpointer.wait()`` (KeeperError); a keeper that is gone
  (``KeeperLink.lost``) makes rank 0 write the checkpoint to storage itself, on this module's
  thread, with a WARNING.
- **A name storage holds is never skipped silently.** A handed-on save carries its
  ``overwrite``: the keeper replaces a checkpoint of that name in storage only with
  ``overwrite=True``, and otherwise refuses the write (CheckpointExistsError, raised by rank
  0's next ``wait()`` as a failed write). ``save()`` already refuses the name on every rank
  when storage holds it at that time, as a save straight to storage would.
- **Nothing deletes what is being written, and storage is read when no write runs.** ``delete()``
  of a memory checkpoint held here waits until its write to storage is done
  (:meth:`Handoff.paused`); ``delete()`` in storage, and a ``restore()``/``load()`` that reads
  storage, wait until no write to storage runs (a commit there applies retention, which could
  remove what is being read).
- **A slow keeper is waited for, never raced.** The keeper's answer is awaited as long as it
  lives, however long its copy takes: until then the checkpoint stays held and rank 0 commits
  nothing to storage. A request given up at a deadline would release both while the keeper
  still copies (its shard file recycled under the copy; two writers committing into storage).
  ``wait()`` gives up at ``commit_timeout_s`` (CommitTimeoutError) and the write goes on;
  ``close()`` then detaches (:meth:`Handoff.abandon`) and leaves the write to the keeper.

``storage_writer="trainer"`` commits the saves due for storage straight into storage from the
trainer's own pipeline, as a Checkpointer without a memory tier does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Iterator

from ..commit.retention import RetentionPolicy
from ..config import CheckpointConfig
from ..errors import CommitTimeoutError, KeeperError
from ..format.records import CheckpointInfo
from ..storage.store import Store
from . import marks, place
from .link import KeeperLink
from .persist import persist_newest

log = logging.getLogger("datastates")

#: How many names ``written`` and ``replaced`` keep (a long run hands on many).
_KEPT_NAMES = 64


@dataclass(frozen=True)
class Due:
    """A committed memory checkpoint handed on to be written to storage, and whether that write
    may replace a checkpoint of the same name there (the save's ``overwrite``)."""

    info: CheckpointInfo
    overwrite: bool = False

    @property
    def name(self) -> str:
        return self.info.name


class Handoff:
    """Rank 0's queue of memory checkpoints to be written to storage (module docstring): one
    being written, one waiting at most."""

    def __init__(
        self,
        link: KeeperLink | None,
        memdir: str,
        storage: str,
        config: CheckpointConfig,
        keep_last: int | None,
        store: Store,
    ):
        """Hand on from the memory directory ``memdir`` (its checkpoints in ``store``) to the
        storage directory ``storage``, through the keeper at ``link``."""
        self._link, self._memdir, self._storage, self._config = link, memdir, storage, config
        self._store = store
        #: The memory tier's retention: the newest ``keep_last``, and those held here.
        self.retention = RetentionPolicy(keep_last, None, None, None, "min", held=self.held)
        self._cond = threading.Condition()
        self._waiting: Due | None = None
        self._writing: Due | None = None
        self._busy = False  # from taking one until its write and the retention after it end
        self._errors: list[KeeperError] = []
        self._closed = False
        self._abandoned = False  # the trainer closes without waiting for the keeper (abandon)
        #: The last checkpoints handed on and written to storage, by name, oldest first.
        self.written: deque[str] = deque(maxlen=_KEPT_NAMES)
        #: The last checkpoints replaced while waiting by a newer one (storage got the newer).
        self.replaced: deque[str] = deque(maxlen=_KEPT_NAMES)
        self._thread = threading.Thread(target=self._loop, name="datastates-handoff", daemon=True)
        self._thread.start()

    def held(self) -> set[str]:
        """The memory checkpoints waiting or being written (memory retention keeps them)."""
        with self._cond:
            return {i.name for i in (self._waiting, self._writing) if i is not None}

    def waiting(self) -> str | None:
        """The name of the checkpoint waiting behind the one being written, or None."""
        with self._cond:
            return None if self._waiting is None else self._waiting.name

    @property
    def running(self) -> bool:
        """Whether the thread that hands on is still running (it ends with :meth:`close`)."""
        return self._thread.is_alive()

    def submit(self, info: CheckpointInfo, overwrite: bool = False) -> None:
        """Hand on the committed memory checkpoint ``info`` (the commit thread, after its memory
        commit and before any later commit's retention could remove it); ``overwrite``: its
        write may replace a checkpoint of that name in storage."""
        with self._cond:
            if self._closed:
                raise KeeperError(
                    f"{info.name} was committed to memory after the handoff to storage closed"
                )
            if self._waiting is not None:
                log.warning(
                    "datastates: %s was still waiting to be written to storage when %s "
                    "was saved; storage gets %s instead (writing %s takes longer than "
                    "the saves between them)",
                    self._waiting.name,
                    info.name,
                    info.name,
                    self._writing.name if self._writing else "the one before",
                )
                self.replaced.append(self._waiting.name)
            self._waiting = Due(info, overwrite)
            self._cond.notify_all()

    def idle(self, deadline: float | None = None) -> None:
        """Return once nothing is waiting or being written; CommitTimeoutError at ``deadline``
        (``time.monotonic()``) if something still is."""
        with self._cond:
            while self._waiting is not None or self._busy:
                left = None if deadline is None else deadline - time.monotonic()
                if left is not None and left <= 0:
                    busy = self._writing or self._waiting
                    raise CommitTimeoutError(
                        f"the memory tier was still writing "
                        f"{busy.name if busy else 'a checkpoint'} to "
                        f"storage at the commit deadline",
                        {0: "busy"},
                    )
                self._cond.wait(left)

    @contextlib.contextmanager
    def paused(self, name: str | None, deadline: float) -> Iterator[None]:
        """Hold the hand-ons back (``submit`` waits) for the body of the ``with``, once ``name``
        is neither waiting nor being written (``name=None``: once nothing is): what ``delete()``
        runs in, so that it never removes what the keeper copies, nor deletes in storage while
        the keeper commits there. CommitTimeoutError at ``deadline`` (``time.monotonic()``) if
        it still is; nothing was deleted then."""
        with self._cond:
            self._wait_free(name, deadline, "nothing was deleted (wait() first)")
            yield

    def released(self, name: str, deadline: float) -> None:
        """Return once ``name`` is neither waiting nor being written: the memory commit of a
        save replacing it (``overwrite=True``) waits here, so the files the keeper copies are
        not recycled under the copy. CommitTimeoutError at ``deadline``."""
        with self._cond:
            self._wait_free(name, deadline, "its replacement was not committed")

    def _wait_free(self, name: str | None, deadline: float, outcome: str) -> None:
        """With the lock held: :meth:`paused`'s wait."""
        while (
            (self._busy or self._waiting is not None)
            if name is None
            else name in {d.name for d in (self._waiting, self._writing) if d is not None}
        ):
            left = deadline - time.monotonic()
            if left <= 0:
                raise CommitTimeoutError(
                    f"the memory tier was still writing "
                    f"{name or 'a checkpoint'} to storage at the "
                    f"deadline; {outcome}",
                    {0: "busy"},
                )
            self._cond.wait(left)

    def take_errors(self) -> list[KeeperError]:
        """The failed writes not reported yet (oldest first); they are reported once."""
        with self._cond:
            errors, self._errors = self._errors, []
        return errors

    def abandon(self) -> None:
        """Stop without waiting (``close()`` past its deadline, the keeper not answering): what
        is waiting is dropped, and the write in progress is the keeper's. Should the link end
        before the keeper answers, this process does not write that checkpoint to storage
        itself, nor apply the memory retention after it: the keeper may still be copying it,
        and writes the newest memory checkpoint itself once this trainer is gone. Call
        :meth:`close` once the link is closed (the thread ends with it)."""
        with self._cond:
            self._closed = self._abandoned = True
            if self._waiting is not None:
                log.error(
                    "datastates: closing: %s, due for storage, was not written there "
                    "(still waiting behind %s); it stays in memory, for the keeper to "
                    "write as the newest (persist_on_exit)",
                    self._waiting.name,
                    self._writing.name if self._writing else "another write",
                )
            self._waiting = None
            self._cond.notify_all()

    def close(self) -> None:
        """Write what is waiting, then stop the thread (idempotent)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    # ------------------------------------------------------------ the thread
    def _loop(self) -> None:
        while True:
            with self._cond:
                while self._waiting is None and not self._closed:
                    self._cond.wait()
                if self._waiting is None:
                    return
                due = self._writing = self._waiting
                self._waiting, self._busy = None, True
            info, error = due.info, None
            try:
                self._write(due)
            except Exception as exc:  # noqa: BLE001 - the thread lives on; wait() raises it
                if self._abandoned:
                    log.warning(
                        "datastates: closing: the write of %s to storage did not end here (%s)",
                        info.name,
                        exc,
                    )
                    self._end_abandoned()
                    return
                log.error(
                    "datastates: writing the memory checkpoint %s to storage (%s) failed: "
                    "%s; it stays in memory only",
                    info.name,
                    self._storage,
                    exc,
                )
                error = KeeperError(
                    f"writing the memory checkpoint {info.name} to storage failed: {exc}"
                )
                error.__cause__ = exc
            with self._cond:
                self._writing = None  # released: the retention below may delete it
            if self._abandoned:
                self._end_abandoned()
                return
            self._tidy()
            with self._cond:
                self._busy = False
                if error is None:
                    self.written.append(info.name)
                else:
                    self._errors.append(error)
                self._cond.notify_all()

    def _end_abandoned(self) -> None:
        """The thread ends after :meth:`abandon`: nothing is written any more (``idle()``
        returns at once), and the retention is the keeper's."""
        with self._cond:
            self._writing, self._busy = None, False
            self._cond.notify_all()

    def _tidy(self) -> None:
        """Apply the memory tier's retention again, now that a checkpoint it kept is released
        (a commit thread's retention running meanwhile skips what this one removed)."""
        try:
            self.retention.apply(os.path.join(self._memdir, place.CKPT), None, False, self._store)
        except Exception as exc:  # noqa: BLE001 - the next memory commit's retention retries
            log.warning("datastates: applying the memory tier's retention failed: %s", exc)

    def _write(self, due: Due) -> None:
        link = self._link
        if link is not None and not link.lost:
            try:  # waited for as long as the keeper lives: see the docstring
                reply = link.request(
                    {"op": "persist", "name": due.name, "overwrite": due.overwrite}, None
                )
            except KeeperError:
                if not link.lost or self._abandoned:
                    raise
            else:
                if reply.get("persisted") != due.name:  # a keeper of another version?
                    raise KeeperError(
                        f"the keeper answered {reply} to the request to write "
                        f"{due.name} to storage; it was not written"
                    )
                return
        log.warning(
            "datastates: the memory keeper is gone; rank 0 writes %s to storage itself", due.name
        )
        persist_newest(
            os.path.join(self._memdir, place.CKPT),
            self._storage,
            self._config,
            name=due.name,
            overwrite=due.overwrite,
            checked=lambda i: marks.holds(self._memdir, i),
        )

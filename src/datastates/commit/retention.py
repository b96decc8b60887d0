"""Removing checkpoints: deleting one (out of sight first -- a rename, or deleting its manifest --
then its files), applying the retention policy (the newest, steps, the best by a metric) after a
commit, and cleaning up what dead writers left: temporary directories, interrupted deletions, a
checkpoint whose replacement was interrupted between its two renames (put back), object-store
data no manifest names, unfinished multipart uploads. How each is done on each kind of store is
the publisher's (publish.py); this module decides what to remove.

Only checkpoints are ever removed: a directory of the root counts as one when it holds a
``manifest.json`` (committed, or damaged since), never merely because of its name. A damaged
checkpoint whose name a new save needs is moved aside to ``.damaged.<name>.<uid>``, kept there
for inspection and never removed by this module.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Collection

from ..format import codec as fmt
from .catalog import Catalog, CheckpointInfo, DamagedCheckpoint, human_bytes
from ..errors import CheckpointNotFoundError
from .publish import publisher_for
from ..storage.store import LOCAL, Store
from ..storage.temporaries import sweep

log = logging.getLogger("datastates")


def delete(root: str, name: str, fsync: bool = True, store: Store = LOCAL) -> None:
    """Remove the checkpoint ``root/name`` atomically: out of sight first (a rename, or deleting
    its manifest on an object store), then its files (:meth:`Publisher.delete`).

    Only a checkpoint is removed, committed or damaged: a directory (not a symbolic link) holding
    a regular file ``manifest.json`` (object stores: a ``manifest.json`` object under the
    prefix). Anything else raises CheckpointNotFoundError and nothing is removed."""
    publisher_for(store).delete(root, name, fsync)


@dataclass(frozen=True)
class RetentionPolicy:
    """Which committed checkpoints a root keeps after each commit (``CheckpointConfig``'s
    ``keep_last`` / ``keep_every`` / ``keep_best``, ``best_metric``, ``best_mode``). Applied by
    the commit, on rank 0, right after a checkpoint became visible (``committer.py``).

    ``keep_last`` None keeps everything, ``keep_best`` or not: ``keep_best`` only protects
    checkpoints that ``keep_last`` would delete, it never deletes one by itself."""

    keep_last: int | None = None
    keep_every: int | None = None
    keep_best: int | None = None
    best_metric: str | None = None
    best_mode: str = "min"
    #: The names another reader still needs (the memory tier's checkpoints being copied to
    #: storage, ``memory/handoff.py``): kept this time, deleted by a later commit's retention.
    held: Callable[[], Collection[str]] | None = field(default=None, compare=False)

    def apply(
        self,
        root: str,
        protect: str | None,
        fsync: bool,
        store: Store = LOCAL,
        committed: list[CheckpointInfo] | None = None,
        damaged: list[DamagedCheckpoint] | None = None,
    ) -> list[str]:
        """Delete committed checkpoints beyond the policy; return the deleted names.

        ``committed``: the committed checkpoints of ``root``, oldest first, as the commit just made
        saw them (``Published.committed``), and ``damaged`` the damaged ones that listing found
        (``Catalog.damaged()``; None: none); with ``committed`` None, ``root`` is listed for both.
        A checkpoint of those lists already gone (deleted meanwhile by another process) is skipped,
        not an error.

        Keeps the ``keep_last`` most recently committed checkpoints (commit order, steps and tags
        alike), every checkpoint whose step is a multiple of ``keep_every``, the ``keep_best``
        ones whose ``best_metric`` is best (:meth:`best`), and ``protect``. The newest checkpoint
        is therefore never deleted, and a checkpoint saved without the metric is kept or deleted
        by the other rules alone. A damaged checkpoint is deleted when its ``manifest.json`` is
        older (modification time) than that of each of the ``keep_last`` most recent ones: it
        would have been deleted had it been readable; a newer one is kept for inspection, and so
        is every damaged one under ``keep_best`` (its metric is unreadable: it may have been among
        the best). One INFO record per deletion. Also retries the removal of ``.trash.*`` left
        by earlier deletions whose files could not be removed, so they do not accumulate
        unnoticed. Every deletion is attempted; then an OSError naming each path that could not
        be removed is raised."""
        if self.keep_last is None:
            return []
        failures = _remove_trash(root, store)
        if committed is None:
            catalog = Catalog(root, store)
            committed, damaged = catalog.scan(), catalog.damaged()
        found = committed
        keep = {i.name for i in found[-self.keep_last :]} | {protect} | set(self.best(found))
        keep.discard(None)
        keep |= set(self.held()) if self.held is not None else set()
        if found:
            keep.add(found[-1].name)
        removed = []
        for info in found:
            if info.name in keep:
                continue
            if self.keep_every and info.step is not None and info.step % self.keep_every == 0:
                continue
            if _remove(root, info.name, fsync, store, failures):
                removed.append(info.name)
                log.info("retention deleted %s (%s of files)", info.name, human_bytes(info.nbytes))
        aged = (
            []
            if self.keep_best
            else _aged_out(damaged or [], found[-self.keep_last :], store, self.keep_every)
        )
        for gone in aged:
            if _remove(root, gone.name, fsync, store, failures):
                removed.append(gone.name)
                log.info(
                    "retention deleted the damaged checkpoint %s, older than every checkpoint "
                    "kept: %s",
                    gone.name,
                    gone.reason,
                )
        if failures:
            raise OSError(
                failures[0].errno,
                "retention could not remove: " + "; ".join(str(e) for e in failures),
                failures[0].filename,
            )
        return removed

    def best(self, found: list[CheckpointInfo]) -> list[str]:
        """The names of the ``keep_best`` checkpoints of ``found`` (oldest first) with the best
        value of ``best_metric``, best first: the lowest (``best_mode`` "min") or the highest
        ("max"); of equal values the newer wins. Those without the metric are never among them;
        none without ``keep_best``."""
        if not self.keep_best:
            return []
        sign = 1 if self.best_mode == "min" else -1
        ranked = sorted(
            (sign * info.metrics[self.best_metric], -order, info.name)
            for order, info in enumerate(found)
            if self.best_metric in info.metrics
        )
        return [name for _, _, name in ranked[: self.keep_best]]


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


def _aged_out(
    damaged: list[DamagedCheckpoint],
    window: list[CheckpointInfo],
    store: Store,
    keep_every: int | None,
) -> list[DamagedCheckpoint]:
    """The damaged checkpoints whose manifest is older than the manifest of each checkpoint of
    ``window`` (a stat per checkpoint of the window, only when there is damage). Never one of a
    newer format (intact, only unreadable here), nor, with ``keep_every``, one that may be a
    kept step: its step is unreadable, so only a ``step-N`` name with N not a multiple of
    ``keep_every`` proves it is not."""
    damaged = [
        d
        for d in damaged
        if not d.newer_format and (not keep_every or _step_of(d.name) % keep_every != 0)
    ]
    if not damaged or not window:
        return []
    try:
        oldest_kept = min(store.mtime(store.join(i.path, fmt.MANIFEST)) for i in window)
    except OSError:
        return []  # changed meanwhile: decide at the next commit
    return [d for d in damaged if d.mtime is not None and d.mtime < oldest_kept]


def _step_of(name: str) -> int:
    """The step a ``step-N`` name says (``fmt.step_name``); 0 for any other name (a multiple of
    every ``keep_every``: kept)."""
    digits = name[len("step-") :]
    return int(digits) if name.startswith("step-") and digits.isdigit() else 0


def _remove_trash(root: str, store: Store) -> list[OSError]:
    """Remove the interrupted deletions (``.trash.``) of dead owners, those of earlier versions
    (no owner) included; the errors of those that could not be."""
    if not publisher_for(store).renames:
        return []
    _, failures = sweep(root, 0.0, kinds=("trash",))
    return [exc for _, exc in failures]


def clean_stale(root: str, max_age_s: float, store: Store = LOCAL) -> list[str]:
    """Remove what dead writers left in ``root`` (:meth:`Publisher.clean_stale`): on a local disk
    the temporaries of owners whose lease is free, those of no known owner older than
    ``max_age_s``, interrupted deletions, and a checkpoint whose replacement was interrupted
    between its two renames is put back; on an object store, data directories no manifest names
    and unfinished multipart uploads older than ``max_age_s``. Entries that vanish meanwhile are
    skipped; one that cannot be removed (a read-only root) is logged and left, never raised."""
    return publisher_for(store).clean_stale(root, max_age_s)

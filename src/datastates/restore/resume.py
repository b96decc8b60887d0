"""Resume from the newest checkpoint that every rank can read: the fallback of ``restore()``.

A restore of the latest checkpoint with ``fallback=True`` runs in rounds. In each round every rank
takes the newest committed checkpoint not yet rejected, plans its restore (every check that
``restore()`` makes; nothing live changes) and re-reads and checks the shard files that plan
reads (``Reader.verify_planned``: headers, indexes, every checksum). The ranks then exchange
what they found through the coordination store (``StoreCommunicator.exchange``, off the
training group), and every rank applies the same rule to the same answers:

- every rank chose the same checkpoint and found it intact: it is restored, on every rank;
- any rank failed for another reason than damage (a strict mismatch, an unsafe object, a read
  error of the storage): every rank raises, that rank its own error and the others
  RestoreAbortedError naming it; nothing live was modified;
- otherwise the checkpoints some rank found damaged are rejected (rank 0 quarantines each:
  ``Publisher.quarantine`` moves it under a name that is never listed, keeping its bytes), so
  is every choice newer than the oldest choice (a rank that did not choose it does not list it:
  its manifest is damaged or missing there), and the next round starts.

Damage is CorruptCheckpointError (a checksum, a header, an index, a size) or a shard file that
is missing. The rounds end with a checkpoint restored, or CheckpointNotFoundError on every rank
when none is left. A failure while reading into the live state after the checks (the bytes
changed since) raises CorruptCheckpointError as ``restore()`` does: by then live state may have
been modified, so it is never turned into a fallback.

The cost is the check: each rank reads the files of its restore twice (once to check, once into
the live tensors; the second read is usually served by the page cache).
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from ..commit.catalog import Catalog
from ..errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    RestoreAbortedError,
    UnsupportedFormatError,
)
from ..format.records import CheckpointInfo, SkippedCheckpoint
from .reader import Reader

log = logging.getLogger("datastates")

TOPIC = "restore-fallback"


def choose(
    catalog: Catalog,
    comm,
    *,
    open_reader: Callable[[CheckpointInfo], Reader],
    prepare: Callable[[Reader], Any],
    quarantine: Callable[[str, str], str | None],
    timeout_s: float,
    caller: str,
    apply: Callable[[Reader, Any], Any] | None = None,
    order: Callable[[CheckpointInfo], int] | None = None,
    eligible: Callable[[CheckpointInfo], bool] | None = None,
    mover: Callable[[list[int]], bool] | None = None,
) -> tuple[Reader, Any, list[SkippedCheckpoint], int, float]:
    """Run the rounds (module docstring): (the open reader of the checkpoint chosen, what
    ``prepare(reader)`` returned for it, the checkpoints skipped newest first, the bytes
    verified, the seconds spent). ``prepare`` plans and verifies, returning the plan and the
    bytes it verified; ``quarantine(name, reason)`` (rank 0) returns where the checkpoint went.

    ``apply`` (optimistic: the memory tier, where a second pass over the bytes would cost as
    much as the restore): ``prepare`` only plans, and once every rank planned the same
    checkpoint, each rank runs ``apply(reader, plan)`` (the read into the live state, checksums
    verified as it goes) and the ranks exchange once more; damage found there on any rank
    rejects that checkpoint for all and the rounds go on, the next checkpoint overwriting what
    the failed read wrote. What is returned in place of the plan is what ``apply`` returned.

    ``order`` (default: the commit number) ranks the checkpoints, newest first, and compares
    the ranks' choices; the memory tier of several nodes orders by step, as each node numbers
    its own commits. ``eligible``: only the checkpoints it accepts are candidates (the memory
    tier: none older than storage's newest). ``mover(ranks)``: whether this rank moves aside a
    checkpoint that ``ranks`` found damaged (default: rank 0 of ``comm`` moves every one; the
    memory tier of several nodes: each node's lowest rank, when a rank of its node found it)."""
    start = time.perf_counter()
    order = order or (lambda c: c.seq)
    try:
        candidates = sorted(
            (c for c in catalog.scan() if eligible is None or eligible(c)), key=order, reverse=True
        )
    except Exception as exc:
        refuse(comm, exc, timeout_s)
        raise
    mover = mover or (lambda ranks: comm.rank == 0)
    rejected: dict[str, SkippedCheckpoint] = {}
    verified = 0
    while True:
        info = next((c for c in candidates if c.name not in rejected), None)
        reader: Reader | None = None
        prepared: Any = None
        own_error: Exception | None = None
        status: dict[str, Any] = {"name": None, "seq": -1}
        if info is not None:
            status = {"name": info.name, "seq": order(info)}
            try:
                reader = open_reader(info)
                prepared, nbytes = prepare(reader)
                verified += nbytes
            except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
                status.update(
                    damaged=f"{type(exc).__name__}: {exc}",
                    quarantine=not isinstance(exc, UnsupportedFormatError),
                )
            except Exception as exc:  # noqa: BLE001 - every rank must learn of it, then it is raised
                own_error = exc
                status["error"] = f"{type(exc).__name__}: {exc}"
            if "damaged" in status or own_error is not None:
                if reader is not None:
                    reader.files.close()
                reader = None
        try:
            answers = comm.exchange(TOPIC, status, timeout_s)
        except TimeoutError as exc:
            if reader is not None:
                reader.files.close()
            raise RestoreAbortedError(
                f"{caller}: the ranks could not agree on a checkpoint to restore: {exc}"
            ) from None
        errors = {r: a["error"] for r, a in answers.items() if "error" in a}
        if errors:
            if reader is not None:
                reader.files.close()
            if own_error is not None:
                raise own_error
            raise RestoreAbortedError(
                f"{caller}: rank(s) {sorted(errors)} refused to restore "
                f"{status['name']!r}, so no rank did; nothing was modified: "
                + "; ".join(f"rank {r}: {e}" for r, e in sorted(errors.items())),
                errors,
            )
        names = {a["name"] for a in answers.values()}
        damaged = {r: a for r, a in answers.items() if "damaged" in a}
        if len(names) == 1 and not damaged:
            if info is None or reader is None:  # (no rank chose one: none is left)
                raise CheckpointNotFoundError(_none_left(catalog.root, rejected, caller))
            if apply is not None:
                prepared, answers = _apply(reader, prepared, apply, status, comm, timeout_s, caller)
                damaged = {r: a for r, a in answers.items() if "damaged" in a}
            if not damaged:
                skipped = [rejected[c.name] for c in candidates if c.name in rejected]
                return reader, prepared, skipped, verified, time.perf_counter() - start
        if reader is not None:
            reader.files.close()
        _reject(answers, damaged, rejected, quarantine, mover, caller)


def refuse(comm, exc: BaseException, timeout_s: float) -> None:
    """Answer the first round's exchange with ``exc`` for a rank that cannot take part in a
    fallback restore (its call was refused, or its listing failed, before the rounds): the other
    ranks then raise RestoreAbortedError naming it at once instead of at their timeout, and,
    the exchanges being counted per rank, every rank's next fallback restore meets the others'.
    The caller raises ``exc`` after it; an exchange that fails is the other ranks' concern."""
    try:
        comm.exchange(
            TOPIC, {"name": None, "seq": -1, "error": f"{type(exc).__name__}: {exc}"}, timeout_s
        )
    except Exception:  # noqa: BLE001 - ``exc`` is what this rank raises
        pass


def _apply(reader: Reader, plan, apply, status: dict, comm, timeout_s: float, caller: str):
    """The optimistic read of :func:`choose`: (what ``apply`` returned, every rank's answer)."""
    result, answer = None, dict(status)
    try:
        result = apply(reader, plan)
    except (CorruptCheckpointError, CheckpointNotFoundError) as exc:
        answer.update(
            damaged=f"{type(exc).__name__}: {exc}",
            quarantine=not isinstance(exc, UnsupportedFormatError),
        )
    except BaseException:
        reader.files.close()
        raise  # a read error of another kind: as a restore without fallback
    try:
        answers = comm.exchange(TOPIC + "-read", answer, timeout_s)
    except TimeoutError as exc:
        reader.files.close()
        raise RestoreAbortedError(
            f"{caller}: the ranks could not agree that the checkpoint "
            f"{status['name']!r} was read intact: {exc}"
        ) from None
    return result, answers


def _reject(
    answers: dict,
    damaged: dict,
    rejected: dict,
    quarantine,
    mover: Callable[[list[int]], bool],
    caller: str,
) -> None:
    """Add this round's rejections to ``rejected`` (the same on every rank); a rank for which
    ``mover(the ranks that found it)`` holds quarantines a damaged checkpoint."""
    oldest = min(answers.values(), key=lambda a: (a["seq"], a["name"] or ""))
    found: dict[str, tuple[list[str], bool, list[int]]] = {}
    for r, a in sorted(damaged.items()):
        reasons, movable, ranks = found.get(a["name"], ([], False, []))
        found[a["name"]] = (
            reasons + [f"rank {r}: {a['damaged']}"],
            movable or a["quarantine"],
            ranks + [r],
        )
    for name, (reasons, movable, ranks) in found.items():
        reason = "; ".join(reasons)
        where = quarantine(name, reason) if movable and mover(ranks) else None
        rejected[name] = SkippedCheckpoint(name, reason, where)
        log.warning(
            "%s: the checkpoint %s is damaged (%s)%s; falling back to an older one",
            caller,
            name,
            reason,
            f", moved to {where}" if where else "",
        )
    for r, a in sorted(answers.items()):
        name = a["name"]
        if name is not None and name != oldest["name"] and name not in rejected:
            lacking = sorted(k for k, b in answers.items() if b["name"] != name)
            reason = f"rank(s) {lacking} do not list it (its manifest is damaged or missing there)"
            rejected[name] = SkippedCheckpoint(name, reason)
            log.warning(
                "%s: the checkpoint %s is skipped: %s; falling back to an older one",
                caller,
                name,
                reason,
            )


def _none_left(root: str, rejected: dict[str, SkippedCheckpoint], caller: str) -> str:
    why = "".join(f"; {s.name}: {s.reason}" for s in rejected.values())
    return f"{caller}: no committed checkpoint in {root!r} that every rank can restore{why}"

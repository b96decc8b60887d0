"""One save of one rank: its record, the handle ``save()`` returns, and its outcome.

A :class:`Job` is everything the pipeline threads (pipeline.py) share about one save: what to write
and where, the events that say how far it got, the checksums of what was written and the first
failure. A :class:`SaveHandle` is the caller's view of that job. At the end of a save the job also
yields this rank's part of the checkpoint: the shard file's index and header, and the report the
rank brings to the commit round (:func:`finish_file`). None of this needs the threads, so it lives
apart from them: pipeline.py imports this module, never the other way round.
"""

from __future__ import annotations

import logging
import threading
import time
import warnings
from dataclasses import dataclass
from typing import cast


from .. import errors
from ..commit.catalog import human_bytes
from ..commit.committer import SaveTarget
from ..errors import CommitTimeoutError
from ..format import codec as fmt
from ..format import zipframe
from ..format import plain
from ..format.records import CheckpointInfo, FileRef, RankReport, ReportEntry, SaveRef
from ..providers.tree import Flattened, Items, saved_tree
from ..storage.posix import fsync_dir
from ..storage.store import ShardFileWriter
from .planning import Layout

log = logging.getLogger("datastates")


@dataclass
class SaveStats:
    """Timings of one save, in seconds from the moment ``save()`` was entered, and what this
    rank wrote."""

    blocked_s: float = 0.0  #: how long save() blocked the caller
    snapshot_s: float = 0.0  #: until the state was captured in host memory
    commit_s: float = 0.0  #: until the checkpoint was durable and committed
    step_wait_s: float = 0.0  #: time guarded optimizer steps waited for this snapshot
    #: tensor and object bytes this rank writes: a tensor declared replicated counts on the one
    #: rank that writes it, a shard that another rank writes (``primary=False``) on that rank,
    #: so the ranks' ``nbytes`` add up to the checkpoint's tensor and object bytes
    nbytes: int = 0
    #: files this rank wrote into the committed checkpoint: its shard file, and on rank 0 the
    #: manifest too (the ranks' ``files`` add up to the files of the checkpoint); 0 until the
    #: save is committed
    files: int = 0
    #: size of this rank's shard file (header, tensors, objects, alignment padding, index): the
    #: ranks' ``file_nbytes`` add up to ``CheckpointInfo.nbytes``; 0 until the file is written
    file_nbytes: int = 0
    #: tensor bytes of this rank captured lazily (after save() returned); the other tensor
    #: bytes were copied into the host cache inside save()
    lazy_nbytes: int = 0


class Job:
    """One save of one rank, shared by the pipeline threads."""

    def __init__(
        self,
        target: SaveTarget,
        *,
        flat: Flattened,
        layout: Layout,
        write_tensors: list[int],
        objects: list[int],
        metadata: dict,
        ready,
        t0: float,
        eager_units: int = 0,
        eager_items: int = 0,
        digest_replicas: bool = False,
        view: str | None = None,
    ):
        #: Where and as what this save commits (name, directory, rank, deadline...).
        self.target = target
        #: Digest of every declared-replicated tensor (key → text), compared across ranks.
        self.replicas: dict[str, str] = {}
        #: Whether this rank digests every declared-replicated tensor, the ones other ranks
        #: write included (replica check on, more than one rank).
        self.digest_replicas = digest_replicas
        #: The top-level key whose value alone the shard file's pickle holds, or None for the
        #: whole state (``save(view=...)``; docs/format.md, "The pickle").
        self.view = view
        self.flat, self.layout = flat, layout
        #: Flat item indices of the tensors this rank writes (layout order) and of the objects.
        self.write_tensors, self.objects = write_tensors, objects
        self.metadata, self.ready, self.t0 = metadata, ready, t0
        self.stats = SaveStats(
            nbytes=sum(flat.items.nbytes[i] for i in write_tensors)
            + sum(flat.items.nbytes[i] for i in objects)
        )
        #: The leading units of the layout that hold eager tensors; once they are in the cache
        #: (or written), ``eager_captured`` is set and ``save()`` may return.
        self.eager_units = eager_units
        #: The first ``eager_items`` tensors of ``write_tensors`` are eager: once their last piece
        #: is copied, ``save()`` may return (the rest of that unit holds lazy tensors).
        self.eager_items = eager_items
        self.eager_captured = threading.Event()
        self.captured = threading.Event()
        self.opened = threading.Event()
        self.finished = threading.Event()
        self.cancelled = threading.Event()
        self.error: BaseException | None = None
        self.info: CheckpointInfo | None = None
        self.writer: ShardFileWriter | None = None
        #: The capture copies the units straight into the shard file (pipeline.IN_PLACE).
        self.in_place = False
        #: CRC-32 of every piece of each written unit (by the unit's file offset), in the
        #: unit's piece order.
        self.crcs: dict[int, list[int]] = {}
        self._lock = threading.Lock()
        self._outstanding = 0
        self._capture_over = False
        #: Units written while the capture was running, whose checksums wait (holding their slot)
        #: so that checksumming does not compete with the capture for the CPU.
        self._deferred: list[tuple] = []
        #: Threads blocked in ``SaveHandle.wait()`` (a failure they will raise is not logged).
        self.waiters = 0
        #: Set once every unit write of this save has returned (its slots are back).
        self.all_written = threading.Event()
        #: Set once every write returned or the save expired: what the commit thread waits for.
        self.unblocked = threading.Event()
        #: The deadline passed before the commit round began (see :meth:`expire`).
        self.expired = False
        #: The commit round began: from here on the round's own deadline applies (round.py).
        self.deciding = False

    def reads_lazy(self) -> bool:
        """Whether the capture reads a lazy tensor after ``save()`` returned: one this rank
        writes, or a replicated one it only digests. Until every such read is done the
        snapshot is not complete (``captured``), so the guarded step waits for it."""
        lazy = self.flat.items.lazy
        if any(lazy[i] for i in self.write_tensors):
            return True
        return self.digest_replicas and any(
            a and b for a, b in zip(lazy, self.flat.items.replicated)
        )

    def abandon(self, exc: BaseException) -> None:
        """Finish a save the pipeline refused (``save()`` raises ``exc``): nothing was
        captured or queued, and nothing may wait for it."""
        self.fail(exc)
        self.flat.items.release()
        for event in (
            self.opened,
            self.eager_captured,
            self.captured,
            self.all_written,
            self.unblocked,
            self.finished,
        ):
            event.set()

    def fail(self, exc: BaseException) -> None:
        with self._lock:
            if self.error is None:
                self.error = exc
        self.cancelled.set()

    def unit_queued(self) -> None:
        with self._lock:
            self._outstanding += 1

    def unit_done(self) -> None:
        with self._lock:
            self._outstanding -= 1
            done = self._capture_over and self._outstanding == 0
        if done:
            self.mark_written()

    def mark_written(self) -> None:
        """Every write of this save has returned."""
        self.all_written.set()
        self.unblocked.set()

    def expire(self) -> bool:
        """The deadline passed (deadline thread): fail this save with CommitTimeoutError (unless
        it already failed), cancel its remaining capture and writes, and tell its shard writer
        to send nothing more. Does nothing once the commit round began (the round keeps its own
        deadline) or the save finished. Returns whether it expired."""
        with self._lock:
            if self.deciding or self.expired or self.finished.is_set():
                return False
            self.expired = True
            if self.error is None:
                elapsed = time.perf_counter() - self.t0
                self.error = CommitTimeoutError(
                    f"checkpoint {self.target.name!r} was not committed: rank {self.target.rank} had not "
                    f"written it when its commit_timeout_s ran out, {elapsed:.1f} s after "
                    f"save() ({self._outstanding} unit write(s) of its shard file pending); "
                    "nothing was committed",
                    {self.target.rank: f"writing not finished {elapsed:.1f} s after save()"},
                )
        self.cancelled.set()
        cancel = getattr(self.writer, "cancel", None)
        if cancel is not None:
            cancel()
        self.unblocked.set()
        return True

    def begin_decision(self) -> None:
        """The commit thread enters the commit round: :meth:`expire` no longer applies."""
        with self._lock:
            self.deciding = True

    def capture_over(self) -> None:
        self.stats.snapshot_s = time.perf_counter() - self.t0
        self.flat.items.release()  # hold no reference to live state after the snapshot
        with self._lock:
            self._capture_over = True
            done = self._outstanding == 0
        self.eager_captured.set()
        self.captured.set()
        if done:
            self.mark_written()

    def defer(self, unit, slot: int) -> bool:
        """Keep a written unit's checksums for later if the capture is still running."""
        with self._lock:
            if self._capture_over:
                return False
            self._deferred.append((unit, slot))
            return True

    def take_deferred(self) -> list[tuple]:
        with self._lock:
            deferred, self._deferred = self._deferred, []
        return deferred

    def finish(self) -> None:
        self.stats.commit_s = time.perf_counter() - self.t0
        if self.error is None:  # committed: rank 0 wrote the manifest as well
            self.stats.files = 2 if self.target.rank == 0 else 1
        with self._lock:
            waited = self.waiters > 0
        _log_outcome(self, waited)
        self.finished.set()


def _log_outcome(job: "Job", waited: bool) -> None:
    """One INFO line per committed save; a WARNING, when it happens, for a failure that no
    ``wait()`` is blocked on (it is also raised by the handle and warned about if never seen)."""
    s = job.stats
    if job.error is None:
        rate = s.nbytes / s.commit_s / 1e9 if s.commit_s > 0 else 0.0
        log.info(
            "committed %s (rank %d): %s, blocked %.1f ms, snapshot %.3f s, commit %.3f s, "
            "%.2f GB/s",
            job.target.name,
            job.target.rank,
            human_bytes(s.nbytes),
            s.blocked_s * 1e3,
            s.snapshot_s,
            s.commit_s,
            rate,
        )
    elif not waited:
        log.warning(
            "checkpoint %s failed on rank %d: %r", job.target.name, job.target.rank, job.error
        )


def write_error(job: "Job", what: str, exc: BaseException) -> BaseException:
    """:func:`datastates.errors.write_error` for this job's rank."""
    return errors.write_error(job.target.rank, what, exc)


def replica_digests(items: Items, indexes: list[int]) -> dict[str, str]:
    """``"<nbytes>:<crc32>"`` of the tensors ``indexes`` of ``items``, read from the
    live tensor: the caller digests eager items before ``save()`` returns and lazy ones before the
    snapshot completes, so both still hold their values at ``save()``. Non-CPU tensors are
    digested through bounded host copies."""
    out = {}
    for i in indexes:
        t = items.tensors[i]
        if t is not None:
            data = fmt.tensor_bytes(t)
            crc, step = 0, 64 << 20
            for start in range(0, data.numel(), step):
                piece = data[start : start + step]
                piece = piece if piece.device.type == "cpu" else piece.cpu()
                crc = fmt.crc32(piece.contiguous().numpy(), crc)
            out[items.keys[i]] = f"{data.numel()}:{crc:08x}"
    return out


class SaveHandle:
    """The future of one ``save()``. Thread-safe; every method may be called any number of times.

    ``wait()`` re-raises a background failure. A handle whose failure was never looked at warns
    when it is garbage-collected, and the next ``save()`` warns too: errors are never lost.
    """

    def __init__(self, job: Job):
        self._job = job
        self._observed = False

    @property
    def name(self) -> str:
        return self._job.target.name

    @property
    def step(self) -> int | None:
        return self._job.target.step

    @property
    def stats(self) -> SaveStats:
        return self._job.stats

    @property
    def save_id(self) -> str:
        """The nonce of this save (the same on every rank; recorded in the manifest)."""
        return self._job.target.sid.nonce

    @property
    def started(self) -> float:
        """When ``save()`` was called (``time.perf_counter()``): the order saves were made in."""
        return self._job.t0

    def wait_finished(self) -> None:
        """Block until the save has committed or failed, raising nothing (see :meth:`wait`)."""
        self._job.finished.wait()

    def snapshot_done(self) -> bool:
        """True once the state is captured in host memory (or the save failed)."""
        return self._job.captured.is_set()

    def done(self) -> bool:
        """True once the checkpoint is committed or has failed."""
        return self._job.finished.is_set()

    def wait_snapshot(self, timeout: float | None = None) -> None:
        """Block until the state is captured; after that the live state may change freely."""
        if not self._job.captured.wait(timeout):
            raise TimeoutError(f"snapshot of {self.name!r} not complete after {timeout} s")
        if self._job.error is not None and self._job.finished.is_set():
            self._raise()

    def wait(self, timeout: float | None = None) -> CheckpointInfo:
        """Block until committed; return its info or raise its error."""
        job = self._job
        with job._lock:
            job.waiters += 1
        try:
            done = job.finished.wait(timeout)
        finally:
            with job._lock:
                job.waiters -= 1
        if not done:
            raise TimeoutError(f"checkpoint {self.name!r} not committed after {timeout} s")
        if self._job.error is not None:
            self._raise()
        self._observed = True
        info = self._job.info
        assert info is not None, "a job finished without an error has its checkpoint's info"
        return info

    result = wait

    def exception(self) -> BaseException | None:
        """The failure of a finished save, or None (also None while still running)."""
        if self._job.finished.is_set():
            self._observed = True
            return self._job.error
        return None

    def _raise(self):
        self._observed = True
        raise self._job.error

    def _unobserved_error(self) -> BaseException | None:
        if self._job.finished.is_set() and self._job.error is not None and not self._observed:
            return self._job.error
        return None

    def __del__(self):
        try:
            err = self._unobserved_error()
        except Exception:  # interpreter shutdown
            return
        if err is not None:
            warnings.warn(
                f"datastates: checkpoint {self.name!r} failed and its handle was "
                f"dropped without wait(): {err!r}",
                RuntimeWarning,
                stacklevel=2,
            )


def failed_report(job: Job) -> RankReport:
    """This rank's report for a save that failed here (its error, described)."""
    error = job.error
    cause = f"{type(error).__name__}: {error}" if error is not None else "unknown failure"
    return RankReport(
        rank=job.target.rank,
        save=_save_ref(job),
        root=job.target.root,
        error=cause,
        expired=job.expired,
    )


def _save_ref(job: Job) -> SaveRef:
    t = job.target
    return SaveRef(name=t.name, step=t.step, nonce=t.sid.nonce, overwrite=t.overwrite)


def finish_file(job: Job, fsync: bool) -> RankReport | None:
    """Commit thread: write the object blobs (while tensor units are still in flight), then,
    once every unit is written, the index and header, and make the file durable. Returns this
    rank's report for the commit round, or None if the save failed."""
    job.opened.wait()
    items = job.flat.items
    entries: list[ReportEntry | None] = [None] * len(items)
    for i, offset in zip(job.objects, job.layout.blob_offsets):
        if job.writer is None or job.error is not None:
            break
        data = items.blobs[i]  # written while the tensor units are in flight
        job.writer.write(memoryview(data), offset)
        entries[i] = ReportEntry(
            key=items.keys[i],
            kind="object",
            written=True,
            offset=offset,
            nbytes=len(data),
            crc32=fmt.crc32(data),
        )
    job.unblocked.wait()  # every unit written, or the deadline passed
    if job.error is not None:
        return None
    writer = job.writer
    if writer is None:  # opened is set without a writer only for a failed job
        raise RuntimeError(
            f"the shard file of {job.target.name!r} was never opened, and the "
            "save recorded no error"
        )
    position = {flat_i: t_i for t_i, flat_i in enumerate(job.write_tensors)}
    checksums = _checksums(job)
    offsets = job.layout.tensor_offsets
    for i in items.tensor_indexes():
        t_i = position.get(i)
        entries[i] = _tensor_entry(
            items,
            i,
            None if t_i is None else offsets[t_i],
            checksums[t_i] if t_i is not None else (),
        )
    assert None not in entries, "every item has its entry: objects above, tensors just now"
    done = cast("list[ReportEntry]", entries)
    index = fmt.encode_index_items(
        job.target.rank, ",".join([_index_text(e) for e in done if e.written]).encode()
    )
    tree = saved_tree(job.flat.tree)
    if job.layout.framed:
        size = _write_framed(job, index, checksums, tree)
    else:
        writer.write(memoryview(index), job.layout.index_offset)
        writer.write(memoryview(fmt.pack_header(job.layout.index_offset, index)), 0)
        size = job.layout.index_offset + len(index)
    writer.finish(fsync, size)
    job.stats.file_nbytes = size
    if fsync and job.target.store.renames:  # the file's entry in the temporary directory
        fsync_dir(job.target.tmp)
    rank = job.target.rank
    return RankReport(
        rank=rank,
        save=_save_ref(job),
        root=job.target.root,
        file=FileRef(
            name=fmt.shard_file_name(rank), rank=rank, nbytes=size, index_crc32=fmt.crc32(index)
        ),
        entries=tuple(done),
        tree=tree,
        replicas=dict(job.replicas),
        expired=job.expired,
    )


def _write_framed(job: Job, index: bytes, checksums: list, tree: dict) -> int:
    """Write the index as a ZIP record, the tail (the pickle of the rank's state naming the
    tensor records, the central directory) and the header of a version-3 file (docs/format.md,
    "Shard file version 3"); return the file's size."""
    items, layout, writer = job.flat.items, job.layout, job.writer
    assert writer is not None  # opened by the capture thread before any unit
    at = layout.index_offset
    index_crc = fmt.crc32(index)
    writer.write(
        memoryview(
            zipframe.local_header(zipframe.INDEX_RECORD, len(index), zipframe.SLOT, index_crc)
        ),
        at - zipframe.SLOT,
    )
    writer.write(memoryview(index), at)
    sizes = items.nbytes
    directory = (
        zipframe.central_entries([zipframe.Record(zipframe.HEADER_RECORD, 0, 0, 0)])
        + zipframe.tensor_entries(
            layout.tensor_offsets,
            [sizes[i] for i in job.write_tensors],
            [zipframe.crc_of_pieces(pieces) for pieces in checksums],
        )
        + zipframe.central_entries(
            [zipframe.Record(zipframe.INDEX_RECORD, at - zipframe.SLOT, len(index), index_crc)]
        )
    )
    position = {flat_i: k for k, flat_i in enumerate(job.write_tensors)}

    def held(i: int):
        k = position.get(i)
        return None if k is None else (k, items.dtypes[i], items.shapes[i])

    def held_object(i: int):
        blob = items.blobs.get(i)
        if blob is None:
            return None
        try:
            return zipframe.object_pickle(blob)
        except ValueError as exc:
            log.warning(
                "%s: torch.load of the shard file gives None for %r: %s (datastates reads "
                "it from its blob as usual)",
                job.target.name,
                items.keys[i],
                exc,
            )
            return None

    # the whole state, or the value of one top-level key (save(view=...))
    shown = tree if job.view is None else _view_node(tree, job.view, held)
    pickled = zipframe.pickle_state(zipframe.plain_state(shown, held, held_object))
    tail_at = fmt.align_up(at + len(index), fmt.DATA_ALIGN)
    tail = zipframe.tail_after(
        tail_at,
        directory,
        len(job.write_tensors) + 2,
        pickled,
        fmt.crc32,
        zipframe.SHARD_TAIL_RECORDS,
    )
    writer.write(memoryview(tail), tail_at)
    first = b""
    if job.write_tensors:
        n0 = items.nbytes[job.write_tensors[0]]
        first = zipframe.tensor_header(0, n0)
    writer.write(memoryview(fmt.pack_header_v3(at, index, tail_at, tail, first)), 0)
    return tail_at + len(tail)


def _view_node(tree: dict, view: str, held) -> dict:
    """The node of the top-level key ``view`` of a rank's tree (a dict or odict: checked by
    ``save()``), without the tensors this file does not hold (``held`` gives None) where a
    mapping holds them: a view leaves them out instead of giving None (docs/format.md, "The
    pickle"). A list or tuple keeps its positions (None there, as in the whole state)."""
    for key, node in tree["items"]:
        if key == view:
            return _held_only(node, held)
    raise KeyError(f"view {view!r} is not a top-level key of the saved tree")


def _held_only(node: dict, held) -> dict:
    t = node["t"]
    if t in ("dict", "odict"):
        return {
            "t": t,
            "items": [[k, _held_only(v, held)] for k, v in node["items"] if not _absent(v, held)],
        }
    if t in ("list", "tuple"):
        return {"t": t, "items": [_held_only(v, held) for v in node["items"]]}
    if t == "provider":
        return {**node, "state": _held_only(node["state"], held)}
    return node


def _absent(node: dict, held) -> bool:
    """A tensor (or a provider's tensor) whose bytes are in another rank's file."""
    while node["t"] == "provider":
        node = node["state"]
    return node["t"] == "tensor" and held(node["e"]) is None


def _checksums(job: Job) -> list[tuple[tuple[int, int], ...]]:
    """The (length, crc32) pieces of every tensor this rank writes (by its position in
    ``write_tensors``), in one pass over the units: their pieces follow the tensors' order."""
    out: list = [()] * len(job.write_tensors)
    crcs = job.crcs
    for unit in job.layout.units:
        for (item, _, _, nbytes), crc in zip(unit.pieces, crcs[unit.file_offset]):
            out[item] += ((nbytes, crc),)
    return out


def _index_text(e: ReportEntry) -> str:
    """The JSON text of ``e`` in the shard file's index (``encode_json(e.to_json())``)."""
    text = plain.report_entry_json(e)
    return text if text is not None else fmt.encode_json(e.to_json()).decode()


def _tensor_entry(items: Items, i: int, offset: int | None, checksums: tuple) -> ReportEntry:
    """The report entry of tensor ``i``: written at ``offset`` with these checksum pieces, or
    not written by this rank (``offset`` None). Its fields in order (one call per tensor of a
    save, without keyword arguments to match)."""
    box = items.boxes.get(i)
    dtype = items.dtypes[i]
    assert dtype is not None, "a tensor item has its dtype"
    return ReportEntry(
        items.keys[i],
        "tensor",
        offset is not None,
        offset,
        items.nbytes[i] if offset is not None else None,
        fmt.dtype_name(dtype),
        items.shapes[i],
        checksums,
        None,
        tuple(box[0]) if box else None,
        tuple(box[1]) if box else None,
        bool(items.replicated[i]),
    )

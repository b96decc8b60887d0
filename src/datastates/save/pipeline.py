"""The save pipeline's threads: capture → writers → commit, and a deadline thread (the job: job.py).

Threads (one set per Checkpointer, started once):
- capture: for each job in order, copies units of tensors into host-cache slots (blocking on free
  slots: backpressure): first the units holding eager tensors — ``save()`` waits for those
  (``Job.eager_captured``) — then the lazy ones, each unit's copies checked for lazy tensors
  written since ``save()`` once complete (``capture.check_unwritten``: the save fails), then
  marks the snapshot complete;
- writers: checksum each unit's pieces and write the unit at its file offset, release the slot;
- commit: opens nothing on the training thread; writes the object blobs while tensor units are in
  flight (metadata overlaps bulk I/O), then index + header + fsync, then commits the save
  (``commit/committer.py``: the round, rank 0's review and publish, the verdict applied);
- deadline: fails every save still unwritten when its ``commit_timeout_s`` runs out
  (``Job.expire``), so no wait of a save outlasts its deadline by more than one storage request
  already in flight (bounded by the storage client's own timeouts).
Any exception fails only its job: it reaches the handle, the process keeps running. Every thread
loop catches what its work raises into the job's failure (a thread never dies), so every wait on a
job's events ends, with the data or with an error.
"""

from __future__ import annotations

import bisect
import ctypes
import queue
import threading
import time
import warnings
from typing import Callable, NamedTuple

import torch

from ..commit.committer import commit_save
from ..config import CheckpointConfig
from ..errors import CheckpointerClosedError, StorageError
from ..format import codec as fmt
from ..format import zipframe
from ..providers.tree import plain_cpu
from .capture import check_unwritten
from .job import Job, failed_report, finish_file, replica_digests, write_error
from .planning import Piece, Unit
from .staging import DeviceCopier, HostCache, zero_bytes
from ..storage.posix import buffer_of
from ..storage.store import MappedFileWriter

#: A unit whose pieces average fewer bytes than this is zeroed whole before its pieces are
#: copied (one call), rather than gap by gap (a call per piece).
_DENSE_PIECE_BYTES = 4096


#: The "slot" of a unit captured in place: straight into the shard file's mapping (the memory
#: tier's ``MappedShardWriter``), not into the host cache.
IN_PLACE = -1


class WriteUnit(NamedTuple):
    """Writer threads: write ``unit`` of ``job`` from cache slot ``slot`` (IN_PLACE: nothing to
    write, only its checksums to take)."""

    job: Job
    unit: Unit
    slot: int


class TakeChecksums(NamedTuple):
    """Writer threads: the capture of ``job`` is over; checksum its deferred units."""

    job: Job


class Pipeline:
    """The background threads and the host cache; owned by one Checkpointer, possibly shared by
    others (``Checkpointer(share=...)``) so that many directories reuse one host cache."""

    def __init__(self, config: CheckpointConfig, comm):
        self.config = config
        self.comm = comm
        self._closed = False
        self._lock = threading.Lock()
        #: Wakes the deadline thread (a job was submitted, or the pipeline stops).
        self._wakeup = threading.Condition(self._lock)
        self._stopping = False
        #: Jobs submitted and not finished yet, in submission order (see ``drain``).
        self._active: list[Job] = []
        #: What the cleanup of failed saves could not do yet (commit thread): a description and
        #: the call that does it (a temporary directory to remove, an upload to abort), retried
        #: after every later save and at ``close``.
        self._leftovers: list[tuple[str, Callable[[], None]]] = []
        pin = torch.cuda.is_available()
        self.cache = HostCache(config.host_cache_bytes, config.unit_bytes, pin)
        self.copier = DeviceCopier()
        self._capture_q: queue.Queue = queue.Queue()
        self._write_q: queue.Queue = queue.Queue()
        self._commit_q: queue.Queue = queue.Queue()
        self._threads = [
            threading.Thread(target=self._capture_loop, name="datastates-capture", daemon=True),
            threading.Thread(target=self._commit_loop, name="datastates-commit", daemon=True),
            threading.Thread(target=self._deadline_loop, name="datastates-deadline", daemon=True),
        ]
        self._threads += [
            threading.Thread(target=self._write_loop, name=f"datastates-writer-{i}", daemon=True)
            for i in range(config.writer_threads)
        ]
        for t in self._threads:
            t.start()

    @property
    def closed(self) -> bool:
        return self._closed

    def submit(self, job: Job) -> None:
        """Queue ``job`` (training thread). Raises CheckpointerClosedError once ``close`` began."""
        with self._lock:
            if self._closed:
                raise CheckpointerClosedError("the Checkpointer owning this pipeline was closed")
            self._active.append(job)
            job.in_place = _captures_in_place(job)
            if not job.in_place:
                self.cache.reserve(len(job.layout.units) * self.config.unit_bytes)
            self._capture_q.put(job)
            self._commit_q.put(job)
            self._wakeup.notify()

    def drain(self) -> None:
        """Block until every job submitted so far (by any Checkpointer sharing this pipeline) is
        committed or failed. Failures stay on the jobs' handles; nothing is raised here."""
        with self._lock:
            pending = list(self._active)
        for job in pending:
            job.finished.wait()

    def submit_failed(self, job: Job) -> None:
        """Announce a save that failed inside ``save()`` (``job.error`` set, nothing captured):
        its round still runs, so the other ranks fail that save too instead of waiting."""
        with self._lock:
            if self._closed:
                raise CheckpointerClosedError("the Checkpointer owning this pipeline was closed")
            self._active.append(job)
            job.opened.set()
            job.capture_over()
            self._commit_q.put(job)
            self._wakeup.notify()

    def close(self) -> None:
        """Finish every queued job (of every Checkpointer sharing this pipeline), then stop the
        threads (idempotent). New submissions are refused from the moment it is called."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        self.drain()  # the stop signals must queue behind every unit of every job
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        self._capture_q.put(None)
        self._commit_q.put(None)
        for _ in range(self.config.writer_threads):
            self._write_q.put(None)
        for t in self._threads:
            t.join()
        self._retry_leftovers(warn=True)
        self.copier.close()
        self.cache.close()

    # ------------------------------------------------------------ capture thread
    def _capture_loop(self) -> None:
        while (job := self._capture_q.get()) is not None:
            try:
                self._open(job)
                self._capture(job)
                self._digest_replicas(job, lazy=False)  # no-op if done before eager_captured
                self._digest_replicas(job, lazy=True)
                # every lazy tensor once more, last before the snapshot is complete: a write
                # still running at its unit's check has returned (or is after save()'s step)
                items = job.flat.items
                check_unwritten(items, items.versions, job.target.name, job.target.rank)
            except BaseException as exc:
                job.fail(write_error(job, f"preparing {job.target.tmp}", exc))
            finally:
                job.opened.set()
                try:
                    job.capture_over()
                except BaseException as exc:  # never leave the training loop waiting
                    job.fail(exc)
                    job.captured.set()
                    job.mark_written()
                self._write_q.put(TakeChecksums(job))

    def _open(self, job: Job) -> None:
        store = job.target.store
        store.makedirs(job.target.root, self.config.fsync)  # the first save creates the directory
        store.makedirs(job.target.tmp, False)  # its name says which process owns it
        job.writer = store.shard_writer(
            store.join(job.target.tmp, fmt.shard_file_name(job.target.rank)),
            self.config.io_mode,
            job.layout,
        )
        if job.in_place and _has_cuda(job) and not _mapped(job).pin():
            job.in_place = False  # staged in the pinned host cache, then written, instead
            self.cache.reserve(len(job.layout.units) * self.config.unit_bytes)
        job.opened.set()

    def _digest_replicas(self, job: Job, lazy: bool) -> None:
        """Digest the declared replicas of one capture policy while their values are still those
        of ``save()``: eager ones before ``save()`` may return, lazy ones before the snapshot
        completes (the guarded step waits for it; a lazy one written since ``save()`` fails the
        save, as its copy does)."""
        if job.digest_replicas:
            items = job.flat.items
            todo = [
                i
                for i in items.tensor_indexes()
                if items.replicated[i]
                and items.lazy[i] == lazy
                and items.keys[i] not in job.replicas
            ]
            job.replicas.update(replica_digests(items, todo))
            if lazy:
                check_unwritten(items, todo, job.target.name, job.target.rank)

    def _eager_done(self, job: Job) -> None:
        """Every eager tensor is in the cache: the caller of ``save()`` may change them now."""
        if job.eager_captured.is_set():
            return
        fence = self.copier.fence()  # device copies must have read their sources
        if fence is not None:
            fence.synchronize()
        self._digest_replicas(job, lazy=False)
        job.eager_captured.set()
        if not job.reads_lazy():  # nothing lazy left to read: the snapshot is complete
            job.captured.set()

    def _capture(self, job: Job) -> None:
        copier, write, target = self.copier, job.write_tensors, job.target
        kept: dict[int, torch.Tensor] = {}  # flat bytes of a tensor whose pieces span units
        copier.begin(job.ready)
        last_unit, last_piece = _last_eager_piece(job)
        for number, unit in enumerate(job.layout.units):
            if number == job.eager_units:
                self._eager_done(job)
            if job.in_place:
                if job.cancelled.is_set():
                    return
                slot = IN_PLACE
                dst = _mapped(job).unit_view(
                    unit.file_offset, fmt.align_up(unit.nbytes, fmt.UNIT_ALIGN)
                )
            else:
                acquired = self._acquire(job)
                if acquired is None:
                    return
                slot = acquired
                dst = self.cache.tensor(slot)
            job.unit_queued()
            try:
                self._fill(job, unit, dst, last_piece if number == last_unit else -1, kept)
                # its copies are complete: were its lazy tensors written since save()?
                check_unwritten(
                    job.flat.items,
                    [write[p[0]] for p in unit.pieces if p[0] >= job.eager_items],
                    target.name,
                    target.rank,
                )
            except BaseException:
                copier.cancel()
                self._release_slot(slot)
                job.unit_done()
                raise
            del dst
            self._write_q.put(WriteUnit(job, unit, slot))

    def _fill(
        self, job: Job, unit: Unit, dst: torch.Tensor, eager_cut: int, kept: dict[int, torch.Tensor]
    ) -> None:
        """Copy the pieces of ``unit`` into ``dst`` (a cache slot, or the unit's bytes in the
        shard file when the job captures in place), zero its gaps and padding, and wait for the
        copies (the fence). After piece number ``eager_cut``, the last piece of an eager tensor,
        the eager tensors are all captured (``_eager_done``).

        A plain contiguous CPU tensor is copied by address (``DeviceCopier.copy_addresses``: no
        tensor view per piece, adjacent sources in one copy); any other (CUDA, non-contiguous)
        through its flat bytes (``DeviceCopier.flat``, kept in ``kept`` while later units need
        them). A unit of many small pieces is zeroed whole first, one gap at a time otherwise."""
        tensors, write, copier = job.flat.items.tensors, job.write_tensors, self.copier
        base = dst.data_ptr()
        padded = fmt.align_up(unit.nbytes, fmt.UNIT_ALIGN)
        dense = len(unit.pieces) * _DENSE_PIECE_BYTES > unit.nbytes
        if dense:
            zero_bytes(base, padded)
        pos, sources = 0, []
        copies: list[tuple[int, int, int]] = []  # (cache address, source address, bytes)
        for number, piece in enumerate(unit.pieces):
            item, begin, start, nbytes = piece
            if start > pos and not dense:
                zero_bytes(base + pos, start - pos)
            t = tensors[write[item]]
            assert t is not None, "a unit is captured before its tensors are released"
            if plain_cpu(t):
                copies.append((base + start, t.data_ptr() + begin, nbytes))
                sources.append(t)
            else:
                copier.copy_addresses(copies)
                copies = []
                sources.append(self._copy_piece(job, piece, dst, kept))
            pos = start + nbytes
            if number == eager_cut:
                copier.copy_addresses(copies)
                copies = []
                self._eager_done(job)
        if padded > pos and not dense:
            zero_bytes(base + pos, padded - pos)
        if unit.slots:  # in gaps zeroed above, apart from every piece
            slots = memoryview((ctypes.c_char * padded).from_address(base)).cast("B")
            zipframe.write_tensor_headers(slots, unit.slots)
        copier.copy_addresses(copies)
        fence = copier.fence()
        if fence is not None:
            fence.synchronize()
        sources.clear()

    def _copy_piece(
        self, job: Job, piece: Piece, dst: torch.Tensor, kept: dict[int, torch.Tensor]
    ) -> torch.Tensor:
        """Copy one piece of a tensor that is not a plain CPU one into the slot ``dst``, through
        its flat bytes (made once, kept in ``kept`` while a later unit continues the tensor);
        returns them (the caller keeps them alive until the fence)."""
        number, begin, start, size = piece
        items, i = job.flat.items, job.write_tensors[number]
        src = kept.pop(number, None)
        if src is None:
            t = items.tensors[i]
            assert t is not None, "a unit is captured before its tensors are released"
            src = self.copier.flat(t)
        if begin + size < items.nbytes[i]:  # the next unit continues it
            kept[number] = src
        self.copier.copy(dst[start : start + size], src[begin : begin + size])
        return src

    def _acquire(self, job: Job) -> int | None:
        """A free slot for the capture; when none is free, checksum (here, at once) the written
        units whose checksums were deferred, which frees their slots. None if the job failed."""
        slot = self.cache.try_acquire()
        while slot is None:
            for unit, held in job.take_deferred():
                self._checksum(job, unit, held)
            slot = self.cache.acquire(job.cancelled, timeout=0.01)
            if slot is None and job.cancelled.is_set():
                return None
        return slot

    # ------------------------------------------------------------ writer threads
    def _write_loop(self) -> None:
        """Write each unit at once; checksum it now, or after the snapshot if the capture is still
        running (the slot stays held until its checksums are taken)."""
        while (work := self._write_q.get()) is not None:
            job = work.job
            try:
                if isinstance(work, TakeChecksums):
                    for unit, slot in job.take_deferred():
                        self._checksum(job, unit, slot)
                else:
                    self._write_unit(job, work.unit, work.slot)
            except BaseException as exc:  # last resort: the job fails, the thread lives on
                job.fail(exc)

    def _write_unit(self, job: Job, unit, slot: int) -> None:
        try:
            if not job.cancelled.is_set() and slot != IN_PLACE:  # in place: already there
                view = self.cache.view(slot)
                padded = fmt.align_up(unit.nbytes, fmt.UNIT_ALIGN)
                if job.writer is None:  # failed below like a write that failed
                    raise RuntimeError("the shard file is not open")
                job.writer.write(view[: unit.nbytes], unit.file_offset, view[:padded])
        except BaseException as exc:
            job.fail(
                write_error(
                    job,
                    f"writing {job.writer.path if job.writer else job.target.tmp}"
                    f" at offset {unit.file_offset}",
                    exc,
                )
            )
        if job.cancelled.is_set() or not job.defer(unit, slot):
            self._checksum(job, unit, slot)

    def _checksum(self, job: Job, unit, slot: int) -> None:
        """Record the CRC-32 of every piece of a written unit, then free its slot. Never raises:
        a failure fails the job (any thread may call this)."""
        try:
            if not job.cancelled.is_set():
                if slot == IN_PLACE:  # the tensor keeps the mapping while its bytes are read
                    mapped = _mapped(job).mapped(unit.file_offset, unit.nbytes)
                    view = buffer_of(mapped)
                else:
                    view = self.cache.view(slot)
                crc32 = fmt.crc32
                job.crcs[unit.file_offset] = [
                    crc32(view[at : at + nbytes]) for _, _, at, nbytes in unit.pieces
                ]
        except BaseException as exc:
            job.fail(
                write_error(
                    job,
                    f"checksumming a unit at offset {unit.file_offset} of {job.target.tmp}",
                    exc,
                )
            )
        finally:
            self._release_slot(slot)
            job.unit_done()

    def _release_slot(self, slot: int) -> None:
        if slot != IN_PLACE:
            self.cache.release(slot)

    # ------------------------------------------------------------ deadline thread
    def _deadline_loop(self) -> None:
        """Expire each save whose deadline passes before its commit round begins: its capture
        stops, its writer sends nothing more, and the commit thread stops waiting for it."""
        with self._wakeup:
            while not self._stopping:
                now = time.monotonic()
                waiting = [j for j in self._active if not (j.expired or j.deciding)]
                for job in waiting:
                    if job.target.deadline <= now:
                        job.expire()
                later = [j.target.deadline for j in waiting if j.target.deadline > now]
                self._wakeup.wait(min(later) - now if later else None)

    # ------------------------------------------------------------ commit thread
    def _commit_loop(self) -> None:
        """Commit or fail each job, in order. A failed save is tidied up (its upload aborted,
        its temporary directory removed) before its handle is released, except when the storage
        stopped answering (the save expired, or a request failed with StorageError): then the
        handle is released at once and the tidying, which needs that storage, follows."""
        while (job := self._commit_q.get()) is not None:
            try:
                self._commit(job)
            except BaseException as exc:  # last resort: the job fails, the thread lives on
                job.fail(exc)
            release_first = job.error is not None and (
                job.expired or _caused_by(job.error, StorageError)
            )
            if release_first:
                self._release(job)
            self._tidy(job)
            self._retry_leftovers(warn=False)  # before the release: wait() sees it done
            if not release_first:
                self._release(job)

    def _release(self, job: Job) -> None:
        job.finish()
        with self._lock:
            self._active.remove(job)

    def _tidy(self, job: Job) -> None:
        """After a save's outcome: once every write of a failed save returned, close its writer
        (aborting its upload), and on rank 0 remove its temporary directory. Never raises; what
        fails is warned about and retried after the next save and at ``close``."""
        try:
            job.all_written.wait()  # cancelled writes end within the storage client's timeouts
            if job.error is not None:
                self._discard_writer(job)
                if job.target.rank == 0:
                    self._remove_failed(job)
        except BaseException as exc:  # tidying up must never stop the commit thread
            warnings.warn(
                f"datastates: cleaning up after {job.target.name!r} failed: {exc!r}",
                RuntimeWarning,
                stacklevel=2,
            )

    def _commit(self, job: Job) -> None:
        """Finish this rank's shard file, then take its report into the commit round
        (``commit/committer.py``); the outcome goes onto the job."""
        report = None
        try:
            report = finish_file(job, self.config.fsync)
        except BaseException as exc:
            job.fail(write_error(job, f"finishing {job.target.tmp}", exc))
        job.unblocked.wait()  # every write returned, or the deadline passed
        if job.error is None:
            self._close_writer(job)
        job.begin_decision()
        if job.error is not None or report is None:
            report = failed_report(job)
        outcome = commit_save(
            job.target.comm or self.comm, job.target, report, job.metadata, job.error
        )
        job.info, job.error = outcome.info, outcome.error

    @staticmethod
    def _close_writer(job: Job) -> None:
        """Close the shard file; a close error (NFS reports write errors there) fails the save."""
        if job.writer is None:
            return
        try:
            job.writer.close()
        except OSError as exc:
            if job.error is None:
                job.fail(write_error(job, f"closing {job.writer.path}", exc))

    def _discard_writer(self, job: Job) -> None:
        """Close a failed save's shard writer, which aborts its upload on an object store."""
        writer = job.writer
        if writer is None:
            return
        try:
            writer.close()
        except OSError as exc:
            self._leave(f"the unfinished upload of {writer.path}", writer.close, job, exc)

    def _remove_failed(self, job: Job) -> None:
        """Rank 0: delete the temporary directory of a failed save."""
        store, tmp = job.target.store, job.target.tmp
        try:
            store.remove_tree(tmp)
        except OSError as exc:
            self._leave(f"the temporary directory {tmp}", lambda: store.remove_tree(tmp), job, exc)

    def _leave(self, what: str, retry: Callable[[], None], job: Job, exc: OSError) -> None:
        """Keep a cleanup that failed for later, and warn naming what is left."""
        self._leftovers.append((what, retry))
        warnings.warn(
            f"datastates: checkpoint {job.target.name!r} failed and {what} could not be "
            f"removed ({exc}); retrying after the next save and at close",
            RuntimeWarning,
            stacklevel=3,
        )

    def _retry_leftovers(self, warn: bool) -> None:
        left = []
        for what, retry in self._leftovers:
            try:
                retry()
            except Exception as exc:  # kept for later; the commit thread goes on
                left.append((what, retry))
                if warn:
                    warnings.warn(
                        f"datastates: {what}, left by a failed save, could still "
                        f"not be removed: {exc}",
                        RuntimeWarning,
                        stacklevel=2,
                    )
        self._leftovers = left


def _caused_by(error: BaseException | None, kind: type) -> bool:
    """Whether ``error`` or an error in its chain of causes is a ``kind``."""
    seen = 0
    while error is not None and seen < 32:
        if isinstance(error, kind):
            return True
        error, seen = error.__cause__ or error.__context__, seen + 1
    return False


def _captures_in_place(job: Job) -> bool:
    """Whether the capture copies ``job``'s units straight into its shard file: the store maps
    its shard files (the memory tier), and either every tensor written is a CPU one or the
    store can register its mappings with CUDA (``maps_cuda``; the writer then pins the file's
    mapping when it opens it, ``_open``)."""
    store = job.target.store
    if not getattr(store, "maps_units", False):
        return False
    return not _has_cuda(job) or getattr(store, "maps_cuda", False)


def _mapped(job: Job) -> MappedFileWriter:
    """The writer of a job captured in place: a mapped one (``_captures_in_place`` chose it)."""
    writer = job.writer
    if not isinstance(writer, MappedFileWriter):
        raise RuntimeError(
            f"{job.target.name!r}: a unit captured in place needs a mapped shard "
            f"file, found the writer {type(writer).__name__}"
        )
    return writer


def _has_cuda(job: Job) -> bool:
    tensors = job.flat.items.tensors
    for i in job.write_tensors:
        t = tensors[i]
        assert t is not None, "asked before the save's tensors are released"
        if t.is_cuda:
            return True
    return False


def _last_eager_piece(job: Job) -> tuple[int, int]:
    """(unit number, piece number) of the last piece of an eager tensor, (-1, -1) if none: a
    unit's pieces follow the order of the tensors, whose first ``eager_items`` are eager."""
    if not job.eager_units:
        return -1, -1
    number = job.eager_units - 1
    pieces = job.layout.units[number].pieces
    return number, bisect.bisect_left([p[0] for p in pieces], job.eager_items) - 1

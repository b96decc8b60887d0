"""Restore: parallel, coalesced reads straight into the live tensors (or into new ones).

``Reader`` plans every read first (matching the checkpoint tree against the live state through
the providers: matching.py), validates everything — a strict mismatch, a live tensor torch cannot
write into, or a provider state its provider refuses raises before one byte of live state is
touched — then reads with a thread pool, verifies checksums and lets providers apply the result.
Each restore logs one INFO record on the ``datastates`` logger: the checkpoint, the bytes read,
the seconds taken and the rate.

The one read path of the library: restore, ``verify`` (verify.py) and export (tools/export.py)
all read through a ``Reader``, so the shard files are found the same way (in the checkpoint
directory, or in the data directory its manifest names), checked the same way when opened, and
their bytes verified by the same checksum code (reads.py). Export takes regions as views of a
memory map of the file (``Reader.mapped``) rather than reads into new memory.
"""
from __future__ import annotations

import logging
import mmap
import threading
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Iterable

import torch

from ..format import codec as fmt
from ..format import files
from ..format import serialization
from ..format import tree
from ..format.codec import ShardHeader
from .matching import RestoreReport, _Cast, _Plan, _Read  # RestoreReport: public here too
from ..format.records import Manifest, ObjectEntry
from ..errors import (CheckpointNotFoundError, ConfigError, CorruptCheckpointError, ReshardError,
                      StorageError)
from .ranks import RANK_POLICIES, per_rank_keys
from ..providers import ProviderRegistry
from ..commit.catalog import human_bytes
from .reads import MAX_RUN, check_landed, coalesce, group_limit, read_run
from ..storage import ReadFile, Store, open_store
from ..storage.store import LocalReadFile

log = logging.getLogger("datastates")


class _Files:
    """The shard files of a checkpoint, each opened only when a read needs it (a rank restoring
    its own state opens the files its tree refers to, not every rank's: :meth:`check` before
    planning), its size checked against the manifest when opened, its header validated against
    the manifest once."""

    def __init__(self, ckpt_dir: str, manifest: Manifest, store: Store):
        self.dir, self.manifest, self.store = ckpt_dir, manifest, store
        #: where the shard files are: the checkpoint directory, or its data directory
        self.data = store.join(ckpt_dir, manifest.data_dir) if manifest.data_dir else ckpt_dir
        self._opened: dict[int, ReadFile] = {}
        self._checked: dict[int, tuple[ReadFile, ShardHeader]] = {}
        self._maps: dict[int, mmap.mmap] = {}
        self._lock = threading.Lock()

    def path(self, file_id: int) -> str:
        return self.store.join(self.data, self.manifest.files[file_id].name)

    def check(self, file_ids) -> None:
        """Open the files ``file_ids`` and check their sizes, before anything is allocated
        from the manifest's sizes (CheckpointNotFoundError, CorruptCheckpointError)."""
        with self._lock:
            for file_id in sorted(file_ids):
                self._check_size(file_id)

    def _check_size(self, file_id: int) -> ReadFile:
        """The file, opened once: it is there and has the size the manifest records (which
        bounds every region in it). The file stays open. Called with the lock held."""
        if file_id in self._opened:
            return self._opened[file_id]
        path = self.path(file_id)
        try:
            f = self.store.open_read(path)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{path}: shard file listed in the manifest is "
                                          "missing") from None
        except StorageError:  # the service failed the request: says nothing of the checkpoint
            raise             # (taken for damage, a fallback would move a good one aside)
        except OSError as exc:
            raise CorruptCheckpointError(f"{path}: cannot open the shard file ({exc})") from None
        if f.size != self.manifest.files[file_id].nbytes:
            f.close()
            raise CorruptCheckpointError(f"{path}: {f.size} bytes, the manifest records "
                                         f"{self.manifest.files[file_id].nbytes} (truncated or "
                                         "replaced?)")
        self._opened[file_id] = f
        return f

    def open(self, file_id: int) -> tuple[ReadFile, int]:
        """(file, index offset) of a validated file."""
        f, header = self.open_with_header(file_id)
        return f, header.index_offset

    def open_with_header(self, file_id: int) -> tuple[ReadFile, ShardHeader]:
        """(file, header) of a file whose header agrees with the manifest: same index CRC, index
        4096-aligned and last in the file, every region the manifest names before the index."""
        with self._lock:
            if file_id not in self._checked:
                f = self._check_size(file_id)
                self._checked[file_id] = (f, self._check_header(f, file_id, self.path(file_id)))
            return self._checked[file_id]

    def _check_header(self, f: ReadFile, file_id: int, path: str) -> ShardHeader:
        ref = self.manifest.files[file_id]
        size = f.size
        header = fmt.read_header(f, path, size)
        if header.index_crc32 != ref.index_crc32:
            raise CorruptCheckpointError(f"{path}: index checksum {header.index_crc32} differs "
                                         f"from the manifest's {ref.index_crc32} (file replaced?)")
        if header.index_offset % fmt.UNIT_ALIGN or \
                header.end != size or size != ref.nbytes:
            raise CorruptCheckpointError(
                f"{path}: index at [{header.index_offset}, "
                f"{header.index_offset + header.index_length}) is not the 4096-aligned end of "
                f"the file of {size} bytes (the manifest records {ref.nbytes})")
        for offset, nbytes, key in self.manifest.regions(file_id):
            if offset + nbytes > header.index_offset:
                raise CorruptCheckpointError(f"{path}: {key!r} at [{offset}, {offset + nbytes}) "
                                             f"extends past the data ending at "
                                             f"{header.index_offset}")
        return header

    def map(self, file_id: int) -> mmap.mmap:
        """A private, copy-on-write memory map of a validated local file (its header checked
        as by :meth:`open`): reading it costs page cache only, and nothing is written back.
        ConfigError for a file of an object store, which has no mapping."""
        f, _ = self.open(file_id)
        with self._lock:
            if file_id not in self._maps:
                if not isinstance(f, LocalReadFile):
                    raise ConfigError(f"{self.path(file_id)}: only a file on a local disk can "
                                      "be memory-mapped")
                self._maps[file_id] = mmap.mmap(f.fd, f.size, access=mmap.ACCESS_COPY)
            return self._maps[file_id]

    def close(self) -> None:
        with self._lock:
            for m in self._maps.values():
                try:
                    m.close()
                except BufferError:  # a tensor still views it: the mapping goes with the tensor
                    pass
            self._maps.clear()
            for f in self._opened.values():
                f.close()
            self._opened.clear()
            self._checked.clear()


def check_rank_policy(rank_policy) -> None:
    """Raise ConfigError unless ``rank_policy`` is one of RANK_POLICIES."""
    if not isinstance(rank_policy, str) or rank_policy not in RANK_POLICIES:
        raise ConfigError(f"rank_policy must be one of {', '.join(map(repr, RANK_POLICIES))}; "
                          f"found {rank_policy!r}")


class Reader:
    """Reads one committed checkpoint. Use as a context manager (it owns file descriptors).
    ``manifest``: its validated manifest when the caller already holds it (else it is read:
    with ``view``, a split manifest as the view of the saved rank this rank restores where one
    saved rank decides it, ``files.View``)."""

    def __init__(self, ckpt_dir: str, *, registry: ProviderRegistry, rank: int = 0,
                 world_size: int = 1, threads: int = 4, verify: bool = True,
                 trusted: bool = False, safe_globals: Iterable[Any] = (),
                 map_location: Any = None, rank_policy: str = "strict",
                 store: Store | None = None, manifest: Manifest | None = None,
                 view: bool = False):
        check_rank_policy(rank_policy)
        self.dir = ckpt_dir
        self.store = store or open_store(ckpt_dir)
        self.registry, self.verify, self.threads = registry, verify, threads
        self.trusted, self.safe_globals = trusted, list(safe_globals)
        self.map_location = map_location
        self.rank, self.world_size = rank, world_size
        self.rank_policy = rank_policy
        if manifest is None:  # with ``view``, a split manifest is read as the view of the saved
            # rank this one restores where one decides it: for restoring or loading this rank's
            # state only (not for verify_all, nor for a copy of the checkpoint)
            manifest = files.read_manifest(ckpt_dir, self.store,
                                           self._saved_rank if view else None)
        elif manifest.view is not None and manifest.view != self._saved_rank(
                manifest.world_size):
            raise ValueError(f"{ckpt_dir}: the view of saved rank {manifest.view} is no "
                             f"manifest for rank {rank} of {world_size} "
                             f"(rank_policy={rank_policy!r})")
        self.manifest = manifest
        self.files = _Files(ckpt_dir, self.manifest, self.store)
        self.entries = self.manifest.entries

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.files.close()

    # ------------------------------------------------------------ tree selection
    def _saved_rank(self, saved: int) -> int | None:
        """The saved rank (of ``saved``) whose tree this rank restores, or None when that
        depends on every saved rank's tree (the strict policy at another world size)."""
        if saved == self.world_size:
            return self.rank
        if self.rank_policy == "rank0":
            return 0
        if self.rank_policy == "strict" and saved > 1:
            return None
        return self.rank if self.rank < saved else 0

    def _tree_for(self, keys=None) -> dict:
        """The saved tree this rank restores. At another world size, state that differs between
        the saved ranks (values, objects, per-rank tensors) among the requested ``keys`` cannot be
        mapped silently: ReshardError unless ``rank_policy`` says how (see RANK_POLICIES)."""
        saved, rank = self.manifest.world_size, self.rank
        trees = {r.rank: r.tree for r in self.manifest.ranks}
        chosen = self._saved_rank(saved)
        if chosen is not None:
            return trees[chosen]
        # the strict policy, several saved ranks, another world size
        per_rank = per_rank_keys([trees[r] for r in sorted(trees)], self.entries,
                                 tree.prefixes(keys))
        if per_rank:
            shown = ", ".join(per_rank[:10]) + (f" ... ({len(per_rank)} keys in all)"
                                                if len(per_rank) > 10 else "")
            raise ReshardError(
                f"{self.dir}: saved by {saved} ranks, loading on {self.world_size} (this is "
                f"rank {rank}); per-rank state differs between the saved ranks and cannot be "
                f"remapped ({shown}). Pass rank_policy='rank0' to give every rank rank 0's "
                "per-rank state, 'same' to map rank r to saved rank r where it exists, or "
                "keys=[...] to restore only global state")
        return trees[rank if rank < saved else 0]

    def _files_of(self, saved: dict, keys) -> set[int]:
        """The shard files the leaves of ``saved`` within ``keys`` refer to (a superset of what
        the restore reads: a sharded tensor counts every file of its shards)."""
        out: set[int] = set()
        for _, node in tree.leaves(saved, tree.prefixes(keys)):
            if node["t"] in tree.ENTRY_LEAVES:
                entry = self.entries[node["e"]]
                if isinstance(entry, ObjectEntry):
                    out.add(entry.file)
                else:
                    out.update(s.file for s in entry.shards)
        return out

    # ------------------------------------------------------------ public operations
    def restore_into(self, state: Any, *, keys=None, strict: bool = True,
                     cast: bool = False) -> RestoreReport:
        """Plan (every check of the matcher and the providers; nothing live changes), then read
        into the live tensors, then set plain values into the live dicts and lists (filled in
        place: the caller's containers stay the same objects), then let providers apply their
        state. With ``cast``, live floating-point tensors of another floating-point dtype than
        the saved one are filled through temporaries (``_run_casts``). Logs one INFO record
        when done."""
        start = time.perf_counter()
        return self.apply(self.plan_restore(state, keys=keys, strict=strict, cast=cast), start)

    def plan_restore(self, state: Any, *, keys=None, strict: bool = True,
                     cast: bool = False) -> _Plan:
        """The first half of :meth:`restore_into`: match and check; nothing live changes (the
        saved Python objects are read and unpickled here, their checksums verified)."""
        saved = self._tree_for(keys)
        self.files.check(self._files_of(saved, keys))
        plan = _Plan(self, keys, strict, in_place=True, cast=cast)
        plan.match_root(state, saved)
        plan.check()
        return plan

    def apply(self, plan: _Plan, start: float | None = None) -> RestoreReport:
        """The second half of :meth:`restore_into`: read, write back, let providers apply."""
        start = time.perf_counter() if start is None else start
        self._execute(plan)
        for container, key, loaded in plan.writebacks:
            container[key] = plan.resolve(loaded)
        for load, live, loaded in plan.finalizers:
            load(live, plan.resolve(loaded))
        plan.report.nbytes = plan.nbytes()
        self._log_restore(plan.report, time.perf_counter() - start)
        return plan.report

    def verify_planned(self, plan: _Plan) -> int:
        """Re-read and check every shard file that ``plan`` reads from, whole (header, index
        against the manifest, every checksum, zero padding: ``verify.verify_checkpoint``), before
        anything live changes; return the bytes checked. Raises CorruptCheckpointError."""
        from .verify import verify_files
        return verify_files(self, sorted(plan.files()))

    def _log_restore(self, report: RestoreReport, seconds: float) -> None:
        rate = report.nbytes / seconds / 1e9 if seconds > 0 else 0.0
        step = "" if report.step is None else f" (step {report.step})"
        log.info("restored %s%s from %s on rank %d: %s in %.3f s, %.2f GB/s, %d keys",
                 report.name, step, self.dir, self.rank, human_bytes(report.nbytes), seconds,
                 rate, len(report.restored))

    def load(self, *, keys=None, dtype: torch.dtype | None = None) -> Any:
        """The saved state in new objects; with ``dtype``, its floating-point tensors converted
        to that dtype (others as saved), after ``map_location`` moved them."""
        return self.finish_load(*self.plan_load(keys=keys, dtype=dtype))

    def plan_load(self, *, keys=None, dtype: torch.dtype | None = None) -> tuple:
        """The first half of :meth:`load`: (plan, structure, dtype); nothing is read but the
        Python objects."""
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ConfigError(f"load(dtype=...) takes a floating-point torch.dtype; found "
                              f"{dtype!r}")
        saved = self._tree_for(keys)
        self.files.check(self._files_of(saved, keys))
        plan = _Plan(self, keys, strict=False, in_place=False)
        return plan, plan.match(None, saved, (), None), dtype

    def finish_load(self, plan: _Plan, value: Any, dtype: torch.dtype | None) -> Any:
        """The second half of :meth:`load`: read the tensors into the structure."""
        self._execute(plan)
        value = plan.resolve(value)
        if self.map_location is not None or dtype is not None:
            value = _move(value, self.map_location, dtype)
        return value

    def verify_all(self, progress=None) -> int:
        """Re-read every byte of every shard file and return the bytes checked (see
        ``verify.verify_checkpoint``: headers, indexes against the manifest, every region's
        checksums, zero padding; ``progress(nbytes)`` is called as bytes are checked). Nothing
        is unpickled; memory is bounded. Not on a rank's view (``Manifest.view``): it checks
        the whole manifest against the files (ValueError)."""
        from .verify import verify_checkpoint
        return verify_checkpoint(self, progress)

    # ------------------------------------------------------------ reading
    def read_object(self, entry: ObjectEntry) -> Any:
        f, _ = self.files.open(entry.file)  # validates that the region lies before the index
        path = self.files.path(entry.file)
        buf = bytearray(entry.nbytes)
        f.read_into([memoryview(buf)], entry.offset)
        if self.verify and fmt.crc32(buf) != entry.crc32:
            raise CorruptCheckpointError(f"{path}: checksum mismatch for object {entry.key!r} "
                                         f"at offset {entry.offset}")
        return serialization.loads(buf, entry.key, trusted=self.trusted,
                                   safe_globals=self.safe_globals)

    def mapped(self, file_id: int, offset: int, nbytes: int, checksums, key: str) -> torch.Tensor:
        """The ``nbytes`` at ``offset`` of shard file ``file_id`` (the region of ``key``, whose
        ``checksums`` are ``[[length, crc32], ...]``) as a flat uint8 tensor viewing the file's
        memory map (:meth:`_Files.map`): nothing is copied, so memory stays bounded by the page
        cache however large the region. Checked as a read is: the region lies before the file's
        index and, with ``verify``, its checksums match (CorruptCheckpointError naming the file,
        key and offsets)."""
        path = self.files.path(file_id)
        region = self.files.map(file_id)
        _, index_offset = self.files.open(file_id)
        if offset + nbytes > index_offset:
            raise CorruptCheckpointError(f"{path}: {key!r} at [{offset}, {offset + nbytes}) "
                                         f"extends past the data ending at {index_offset}")
        view = torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset) \
            if nbytes else torch.empty(0, dtype=torch.uint8)
        if self.verify:
            check_landed(_Read(file_id, offset, nbytes, view, checksums, key), path)
        return view

    def _execute(self, plan: "_Plan") -> None:
        """First the tensors of providers that validate values: read, copied, validated (a
        refusal raises CorruptCheckpointError before any other read); then every other read."""
        for provider, loaded, key, reads, copies, casts in plan.early:
            self._run(reads, copies)
            self._run_casts(plan, casts)
            provider.validate_values(plan.resolve(loaded), key)
        self._run(plan.reads, plan.post_copies)
        self._run_casts(plan, plan.casts)

    def _run_casts(self, plan: "_Plan", casts: list[_Cast]) -> None:
        """Fill the live tensors of ``casts``: in batches of temporaries of at most MAX_RUN
        bytes (or one tensor, if larger), each batch read and verified as saved, then copied
        into its live tensors (``dest.copy_``: torch's rounding, onto the live device). A
        checksum error raises before its batch's live tensors change."""
        for batch in _batches(casts, MAX_RUN):
            temps = [cast.temporary() for cast in batch]
            reads: list[_Read] = []
            copies: list = []
            for cast, temp in zip(batch, temps):
                more_reads, more_copies = plan.regions(temp, cast.entry, cast.key,
                                                       cast.box_offset)
                reads += more_reads
                copies += more_copies
            self._run(reads, copies)
            for cast, temp in zip(batch, temps):
                cast.dest.copy_(temp)

    def _run(self, reads: list[_Read], post_copies: list) -> None:
        """Read every region, verifying each step of bytes right after it lands (while it is
        still in the CPU cache), with ``threads`` runs in flight; then run the copies that
        finish non-contiguous or non-CPU destinations."""
        groups = coalesce(reads, group_limit(reads, self.threads))
        for file_id in sorted({g[0].file for g in groups}):
            self.files.open(file_id)[0].advise_sequential()
        if len(groups) <= 1 or self.threads == 1:
            for g in groups:
                self._read_group(g)
        else:
            with ThreadPoolExecutor(min(self.threads, len(groups)),
                                    thread_name_prefix="datastates-reader") as pool:
                futures = [pool.submit(self._read_group, g) for g in groups]
                try:
                    for f in futures:
                        f.result()
                except BaseException:
                    for f in futures:  # runs not started never start: a failing store is not
                        f.cancel()     # asked again for each of them
                    raise
        for fix in post_copies:
            fix()

    def _read_group(self, group: list[_Read]) -> None:
        """Read one coalesced run of one file (see ``reads.read_run``). Runs on a reader
        thread; raises CorruptCheckpointError."""
        f, index_offset = self.files.open(group[0].file)
        path = self.files.path(group[0].file)
        end = group[-1].offset + group[-1].nbytes
        if end > index_offset:
            raise CorruptCheckpointError(f"{path}: {group[-1].key!r} at [{group[-1].offset}, "
                                         f"{end}) extends past the data ending at {index_offset}")
        read_run(f, group, path, self.verify)


def _batches(casts: list[_Cast], limit: int) -> list[list[_Cast]]:
    """``casts`` in order, cut into batches whose temporaries hold at most ``limit`` bytes (a
    larger one alone)."""
    batches: list[list[_Cast]] = []
    size = 0
    for cast in casts:
        nbytes = cast.dest.numel() * cast.entry.torch_dtype.itemsize
        if not batches or size + nbytes > limit:
            batches.append([])
            size = 0
        batches[-1].append(cast)
        size += nbytes
    return batches


def _move(value: Any, device: Any, dtype: torch.dtype | None = None) -> Any:
    """``value`` with its tensors on ``device`` (None: where they are) and its floating-point
    tensors of ``dtype`` (None: as they are)."""
    if isinstance(value, torch.Tensor):
        if dtype is not None and value.is_floating_point():
            return value.to(device, dtype)
        return value.to(device) if device is not None else value
    if isinstance(value, (dict, OrderedDict)):
        return type(value)((k, _move(v, device, dtype)) for k, v in value.items())
    if type(value) in (list, tuple):
        return type(value)(_move(v, device, dtype) for v in value)
    return value

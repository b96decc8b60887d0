"""Restore: parallel, coalesced reads straight into the live tensors (or into new ones).

``Reader`` is the top of the restore stage. It opens one committed checkpoint (an
:class:`~datastates.restore.opened.OpenCheckpoint`: the manifest this rank needs, its shard files),
picks the saved tree this rank restores (``rank_policy``), has it matched against the live state
(matching.py builds a :class:`~datastates.restore.plan.Plan`: every check of the matcher and the
providers -- a strict mismatch, a live tensor torch cannot write into, or a provider state its
provider refuses raises before one byte of live state is touched), then carries the plan out:
reads with a thread pool (reads.py), checksums verified as the bytes land, values set back and
providers applied. Each restore logs one INFO record on the ``datastates`` logger: the checkpoint,
the bytes read, the seconds taken and the rate.

The one read path of the library: restore, ``verify`` (verify.py) and export (tools/export.py)
all read through the open checkpoint of a ``Reader``, so the shard files are found, checked and
verified the same way. Export takes regions as views of a memory map of the file
(``OpenCheckpoint.mapped``) rather than reads into new memory.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterable, Mapping

import torch

from ..commit.catalog import human_bytes
from ..errors import ConfigError, CorruptCheckpointError, ReshardError
from ..format import files
from ..format import tree
from ..format.records import Entry, Manifest
from ..providers import ProviderRegistry
from ..storage import Store, open_store
from .matching import plan_load, plan_restore, regions
from .opened import OpenCheckpoint, ShardFiles
from .plan import Cast, Plan, Read, RestoreReport
from .ranks import RANK_POLICIES, per_rank_keys
from .reads import MAX_RUN, coalesce, group_limit, read_run
from .verify import verify_checkpoint, verify_files

__all__ = ["Reader", "RestoreReport", "check_rank_policy"]

log = logging.getLogger("datastates")


def check_rank_policy(rank_policy) -> None:
    """Raise ConfigError unless ``rank_policy`` is one of RANK_POLICIES."""
    if not isinstance(rank_policy, str) or rank_policy not in RANK_POLICIES:
        raise ConfigError(
            f"rank_policy must be one of {', '.join(map(repr, RANK_POLICIES))}; "
            f"found {rank_policy!r}"
        )


class Reader:
    """Reads one committed checkpoint. Use as a context manager (it owns file descriptors: its
    :attr:`checkpoint`). ``manifest``: its validated manifest when the caller already holds it
    (else it is read: with ``view``, a split manifest as the view of the saved rank this rank
    restores where one saved rank decides it, ``files.View``)."""

    def __init__(
        self,
        ckpt_dir: str,
        *,
        registry: ProviderRegistry,
        rank: int = 0,
        world_size: int = 1,
        threads: int = 4,
        verify: bool = True,
        trusted: bool = False,
        safe_globals: Iterable[Any] = (),
        map_location: Any = None,
        rank_policy: str = "strict",
        store: Store | None = None,
        manifest: Manifest | None = None,
        view: bool = False,
    ):
        check_rank_policy(rank_policy)
        store = store or open_store(ckpt_dir)
        self.registry, self.threads = registry, threads
        self.map_location = map_location
        self.rank, self.world_size = rank, world_size
        self.rank_policy = rank_policy
        if manifest is None:  # with ``view``, a split manifest is read as the view of the saved
            # rank this one restores where one decides it: for restoring or loading this rank's
            # state only (not for verify_all, nor for a copy of the checkpoint)
            manifest = files.read_manifest(ckpt_dir, store, self._saved_rank if view else None)
        elif manifest.view is not None and manifest.view != self._saved_rank(manifest.world_size):
            raise ValueError(
                f"{ckpt_dir}: the view of saved rank {manifest.view} is no "
                f"manifest for rank {rank} of {world_size} "
                f"(rank_policy={rank_policy!r})"
            )
        #: the open checkpoint every read goes through (closed with this reader)
        self.checkpoint = OpenCheckpoint.open(
            ckpt_dir, manifest, store, verify=verify, trusted=trusted, safe_globals=safe_globals
        )

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the checkpoint's files (idempotent)."""
        self.checkpoint.close()

    # ------------------------------------------------------------ the open checkpoint
    @property
    def dir(self) -> str:
        return self.checkpoint.dir

    @property
    def manifest(self) -> Manifest:
        return self.checkpoint.manifest

    @property
    def entries(self) -> Mapping[int, Entry]:
        return self.checkpoint.entries

    @property
    def files(self) -> ShardFiles:
        return self.checkpoint.files

    @property
    def verify(self) -> bool:
        """Whether checksums are checked as the bytes land."""
        return self.checkpoint.verify

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

    def _tree_for(self, keys: str | Iterable[str] | None = None) -> dict:
        """The saved tree this rank restores, its shard files opened and their sizes checked.
        At another world size, state that differs between the saved ranks (values, objects,
        per-rank tensors) among the requested ``keys`` cannot be mapped silently: ReshardError
        unless ``rank_policy`` says how (see RANK_POLICIES)."""
        saved = self._saved_tree(keys)
        self.files.check(self.checkpoint.files_of(saved, keys))
        return saved

    def _saved_tree(self, keys: str | Iterable[str] | None) -> dict:
        saved, rank = self.manifest.world_size, self.rank
        trees = {r.rank: r.tree for r in self.manifest.ranks}
        chosen = self._saved_rank(saved)
        if chosen is not None:
            return trees[chosen]
        # the strict policy, several saved ranks, another world size
        per_rank = per_rank_keys(
            [trees[r] for r in sorted(trees)], self.entries, tree.prefixes(keys)
        )
        if per_rank:
            shown = ", ".join(per_rank[:10]) + (
                f" ... ({len(per_rank)} keys in all)" if len(per_rank) > 10 else ""
            )
            raise ReshardError(
                f"{self.dir}: saved by {saved} ranks, loading on {self.world_size} (this is "
                f"rank {rank}); per-rank state differs between the saved ranks and cannot be "
                f"remapped ({shown}). Pass rank_policy='rank0' to give every rank rank 0's "
                "per-rank state, 'same' to map rank r to saved rank r where it exists, or "
                "keys=[...] to restore only global state"
            )
        return trees[rank if rank < saved else 0]

    # ------------------------------------------------------------ public operations
    def restore_into(
        self,
        state: Any,
        *,
        keys: str | Iterable[str] | None = None,
        strict: bool = True,
        cast: bool = False,
    ) -> RestoreReport:
        """Plan (every check of the matcher and the providers; nothing live changes), then read
        into the live tensors, then set plain values into the live dicts and lists (filled in
        place: the caller's containers stay the same objects), then let providers apply their
        state. With ``cast``, live floating-point tensors of another floating-point dtype than
        the saved one are filled through temporaries (``_run_casts``). Logs one INFO record
        when done."""
        start = time.perf_counter()
        return self.apply(self.plan_restore(state, keys=keys, strict=strict, cast=cast), start)

    def plan_restore(
        self,
        state: Any,
        *,
        keys: str | Iterable[str] | None = None,
        strict: bool = True,
        cast: bool = False,
    ) -> Plan:
        """The first half of :meth:`restore_into`: match and check; nothing live changes (the
        saved Python objects are read and unpickled here, their checksums verified)."""
        return plan_restore(
            self.checkpoint,
            self.registry,
            state,
            self._tree_for(keys),
            keys=keys,
            strict=strict,
            cast=cast,
        )

    def apply(self, plan: Plan, start: float | None = None) -> RestoreReport:
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

    def verify_planned(self, plan: Plan) -> int:
        """Re-read and check every shard file that ``plan`` reads from, whole (header, index
        against the manifest, every checksum, zero padding: ``verify.verify_checkpoint``), before
        anything live changes; return the bytes checked. Raises CorruptCheckpointError."""
        return verify_files(self.checkpoint, sorted(plan.files()), self.threads)

    def _log_restore(self, report: RestoreReport, seconds: float) -> None:
        rate = report.nbytes / seconds / 1e9 if seconds > 0 else 0.0
        step = "" if report.step is None else f" (step {report.step})"
        log.info(
            "restored %s%s from %s on rank %d: %s in %.3f s, %.2f GB/s, %d keys",
            report.name,
            step,
            self.dir,
            self.rank,
            human_bytes(report.nbytes),
            seconds,
            rate,
            len(report.restored),
        )

    def load(
        self, *, keys: str | Iterable[str] | None = None, dtype: torch.dtype | None = None
    ) -> Any:
        """The saved state in new objects; with ``dtype``, its floating-point tensors converted
        to that dtype (others as saved), after ``map_location`` moved them."""
        return self.finish_load(*self.plan_load(keys=keys, dtype=dtype))

    def plan_load(
        self, *, keys: str | Iterable[str] | None = None, dtype: torch.dtype | None = None
    ) -> tuple[Plan, Any, torch.dtype | None]:
        """The first half of :meth:`load`: (plan, structure, dtype); nothing is read but the
        Python objects."""
        if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
            raise ConfigError(
                f"load(dtype=...) takes a floating-point torch.dtype; found {dtype!r}"
            )
        plan, value = plan_load(self.checkpoint, self.registry, self._tree_for(keys), keys=keys)
        return plan, value, dtype

    def finish_load(self, plan: Plan, value: Any, dtype: torch.dtype | None) -> Any:
        """The second half of :meth:`load`: read the tensors into the structure."""
        self._execute(plan)
        value = plan.resolve(value)
        if self.map_location is not None or dtype is not None:
            value = _move(value, self.map_location, dtype)
        return value

    def verify_all(self, progress: Callable[[int], None] | None = None) -> int:
        """Re-read every byte of every shard file and return the bytes checked (see
        ``verify.verify_checkpoint``: headers, indexes against the manifest, every region's
        checksums, zero padding; ``progress(nbytes)`` is called as bytes are checked). Nothing
        is unpickled; memory is bounded. Not on a rank's view (``Manifest.view``): it checks
        the whole manifest against the files (ValueError)."""
        return verify_checkpoint(self.checkpoint, progress, self.threads)

    # ------------------------------------------------------------ reading
    def _execute(self, plan: Plan) -> None:
        """First the tensors of providers that validate values: read, copied, validated (a
        refusal raises CorruptCheckpointError before any other read); then every other read."""
        for early in plan.early:
            self._run(early.reads, early.copies)
            self._run_casts(early.casts)
            early.provider.validate_values(plan.resolve(early.loaded), early.key)
        self._run(plan.reads, plan.post_copies)
        self._run_casts(plan.casts)

    def _run_casts(self, casts: list[Cast]) -> None:
        """Fill the live tensors of ``casts``: in batches of temporaries of at most MAX_RUN
        bytes (or one tensor, if larger), each batch read and verified as saved, then copied
        into its live tensors (``dest.copy_``: torch's rounding, onto the live device). A
        checksum error raises before its batch's live tensors change."""
        for batch in _batches(casts, MAX_RUN):
            temps = [cast.temporary() for cast in batch]
            reads: list[Read] = []
            copies: list[Callable[[], Any]] = []
            for cast, temp in zip(batch, temps):
                more_reads, more_copies = regions(
                    temp, cast.entry, cast.key, cast.box_offset, self.dir
                )
                reads += more_reads
                copies += more_copies
            self._run(reads, copies)
            for cast, temp in zip(batch, temps):
                cast.dest.copy_(temp)

    def _run(self, reads: list[Read], post_copies: list[Callable[[], Any]]) -> None:
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
            with ThreadPoolExecutor(
                min(self.threads, len(groups)), thread_name_prefix="datastates-reader"
            ) as pool:
                futures = [pool.submit(self._read_group, g) for g in groups]
                try:
                    for f in futures:
                        f.result()
                except BaseException:
                    for f in futures:  # runs not started never start: a failing store is not
                        f.cancel()  # asked again for each of them
                    raise
        for fix in post_copies:
            fix()

    def _read_group(self, group: list[Read]) -> None:
        """Read one coalesced run of one file (see ``reads.read_run``). Runs on a reader
        thread; raises CorruptCheckpointError."""
        f, index_offset = self.files.open(group[0].file)
        path = self.files.path(group[0].file)
        end = group[-1].offset + group[-1].nbytes
        if end > index_offset:
            raise CorruptCheckpointError(
                f"{path}: {group[-1].key!r} at [{group[-1].offset}, "
                f"{end}) extends past the data ending at {index_offset}"
            )
        read_run(f, group, path, self.verify)


def _batches(casts: list[Cast], limit: int) -> list[list[Cast]]:
    """``casts`` in order, cut into batches whose temporaries hold at most ``limit`` bytes (a
    larger one alone)."""
    batches: list[list[Cast]] = []
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

"""``torch.distributed.checkpoint`` storage layer writing datastates files.

Usage::

    import torch.distributed.checkpoint as dcp
    from datastates.integrations.dcp import DatastatesWriter, DatastatesReader

    dcp.save(state_dict, storage_writer=DatastatesWriter("ckpt/step-100"))
    fut = dcp.async_save(state_dict, storage_writer=writer)   # keep `writer` across saves
    dcp.load(state_dict, storage_reader=DatastatesReader("ckpt/step-100"))

DCP still plans (dedup, resharding) and calls us in this order (``StorageWriter`` docstring):
``reset`` → ``set_up_storage_writer`` → ``prepare_local_plan`` (all ranks) →
``prepare_global_plan`` (coordinator) → ``write_data`` (all ranks) → ``finish`` (coordinator).

What we add over ``FileSystemWriter``:

- **Coalesced files**: one datastates shard file per rank (``rank-RRRRR.dsf``, the core format:
  magic, version, 4 KiB header, 64-byte aligned regions, JSON index; docs/format.md); tensors
  are raw bytes, not one ``torch.save`` zip record each.
- **Checksums**: CRC-32 of every item, verified by :class:`DatastatesReader` before use.
- **Atomic commit**: every rank writes into one hidden temporary directory that the coordinator
  names in ``prepare_global_plan``; files are fsynced in ``write_data``; ``finish`` writes the
  metadata and renames the directory to its final name (replacing an older checkpoint of that
  name only once the new one is complete). A crash never leaves a half-written checkpoint at
  ``path``, unlike ``FileSystemWriter(overwrite=True)`` which rewrites shards in place.
- **Read by DCP's own tools as well** (format version 3): each tensor region sits inside a
  ``torch.save`` frame (``dcp/frame.py``: a local header before it, the pickle and a central
  directory after it, in the gap before the next item), and ``finish`` also writes DCP's stock
  ``.metadata`` pointing at the frames, so ``dcp.load(state, checkpoint_id=path)`` with the
  default ``FileSystemReader`` and ``dcp_to_torch_save`` read the folder as it is; no tensor
  byte is written twice. That reader checks no checksum; ours and ``datastates verify`` do.
- **No pickle read by datastates**: the DCP ``Metadata`` is also written as JSON
  (``dcp/metadata.py``) and rebuilt field by field, so reading a folder someone handed you with
  :class:`DatastatesReader` runs no code from it (it never opens ``.metadata``). Folders of
  format version 1 (a pickled ``dcp.metadata``) are read only with ``trusted=True``. The
  non-tensor values of the state dict are ``torch.save`` bytes that DCP's own load planner
  unpickles; ``dcp/folders.load_state`` (behind ``datastates export`` and ``import``) loads them
  with ``weights_only=True`` unless trusted.
- ``dcp.async_save``: the writer is its own ``AsyncStager``; staging copies into CPU buffers kept
  across saves (pinned on CUDA), so later saves do not allocate.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import pickle
import time
import uuid
from typing import TYPE_CHECKING, Any

import torch
from torch.futures import Future
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex, StorageMeta
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    SavePlan,
    SavePlanner,
    WriteItemType,
)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult

from ..errors import ConfigError, CorruptCheckpointError, UnsafeObjectError
from ..format import codec as fmt
from ..commit.publish import RenamePublisher
from ..storage.posix import fsync_dir
from ..storage.store import LOCAL

from . import metadata as dcp_metadata
from .frame import frame
from .metadata import (
    FORMAT,
    MANIFEST,
    METADATA,
    PICKLE,
    PICKLED_METADATA,
    VERSION,
    check_regular,
    check_span,
    read_checked,
    read_manifest,
)

if TYPE_CHECKING:
    from ..save.job import SaveStats

__all__ = ["DatastatesWriter", "DatastatesReader"]

#: The library's atomic visibility on a local disk: names the temporary directory, renames it
#: into place (an older folder of that name moved aside first, removed once the new one is in).
_PUBLISHER = RenamePublisher(LOCAL)


@dataclasses.dataclass(frozen=True)
class _PlanData:
    tmp: str  # temporary directory shared by all ranks
    rank: int


class DatastatesWriter(StorageWriter, AsyncStager):
    """DCP ``StorageWriter`` (see module docstring). One instance per rank; reusable across
    saves (pass a new ``checkpoint_id`` to ``dcp.save`` or construct with the path).

    ``sync_files=False`` skips fsync (throwaway benchmarks only); ``overwrite=False`` refuses to
    replace an existing checkpoint at the path; ``cache_staged_state_dict`` keeps the CPU staging
    buffers of ``dcp.async_save`` between saves. ``thread_count`` (an int >= 1) is accepted as
    ``FileSystemWriter`` takes it and does not change how the one shard file per rank is
    written; ``_extensions`` (DCP's stream transforms, compression) must be None or empty:
    ConfigError otherwise, since datastates does not compress.

    ``last_save_stats`` is the :class:`datastates.SaveStats` of this rank's most recent save
    (None before the first): ``nbytes`` the item bytes this rank wrote, ``blocked_s`` the
    seconds the caller was held by this writer (``stage()``'s copy under ``dcp.async_save``,
    else ``write_data``, which writes and fsyncs), ``snapshot_s`` until the data was out of
    the caller's tensors, ``commit_s`` until this rank's file was durable, and on the
    coordinator until ``finish`` published the checkpoint; each counted from the first of
    ``stage``/``write_data`` of that save.
    """

    _synchronize_after_execute = False

    def __init__(
        self,
        path: str | os.PathLike | None = None,
        *,
        sync_files: bool = True,
        overwrite: bool = True,
        cache_staged_state_dict: bool = True,
        thread_count: int = 1,
        _extensions: Any = None,
    ):
        super().__init__()
        if type(thread_count) is not int or thread_count < 1:
            raise ConfigError(
                f"DatastatesWriter: thread_count must be an int >= 1 (as for "
                f"FileSystemWriter), found {thread_count!r}"
            )
        if _extensions:
            names = ", ".join(type(e).__name__ for e in _extensions)
            raise ConfigError(
                f"DatastatesWriter: _extensions=[{names}] asks for a stream "
                "transform (compression) of every item; datastates writes raw "
                "tensor bytes with a CRC-32 each and does not compress: pass "
                "_extensions=None (or use FileSystemWriter for compressed files)"
            )
        #: Accepted for FileSystemWriter's signature; each rank writes its one coalesced shard
        #: file from the thread that calls ``write_data``, whatever the count.
        self.thread_count = thread_count
        self.path = os.path.abspath(os.fspath(path)) if path is not None else None
        self.sync_files, self.overwrite = sync_files, overwrite
        self.cache_staged_state_dict = cache_staged_state_dict
        self._staged: Any = None
        self.save_id = uuid.uuid4().hex
        self.last_save_stats: SaveStats | None = None
        self._staged_at: tuple[float, float] | None = None  # (start, seconds) of the last stage
        self._stats_t0: float | None = None
        self.is_coordinator, self.rank = True, 0

    # ------------------------------------------------------------ StorageWriter
    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = os.path.abspath(os.fspath(checkpoint_id))
        self.save_id = uuid.uuid4().hex

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator
        self.rank = int(kwargs.get("rank", 0) or 0)

    def _root(self) -> str:
        """The checkpoint's folder; ValueError when none was given yet."""
        if self.path is None:
            raise ValueError(
                "DatastatesWriter: no checkpoint path (pass one to the writer or "
                "checkpoint_id= to dcp.save)"
            )
        return self.path

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        path = self._root()
        if not self.overwrite and os.path.exists(path):
            raise FileExistsError(f"{path} exists and overwrite=False")
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        os.makedirs(os.path.dirname(self._root()), exist_ok=True)
        tmp = self._tmp_dir()
        os.makedirs(tmp)
        return [dataclasses.replace(p, storage_data=_PlanData(tmp, i)) for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        t0 = time.perf_counter()
        data: _PlanData = plan.storage_data
        fname = fmt.shard_file_name(data.rank)
        path = os.path.join(data.tmp, fname)
        results, entries = [], []
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            offset = fmt.HEADER_BYTES
            for item in plan.items:
                blob, info = _encode(item, planner.resolve_data(item))
                nbytes = memoryview(blob).nbytes
                crc = fmt.crc32(blob)
                framed = None
                if info["kind"] == "tensor":
                    # the frame that makes [head, tail) a torch.save archive of this tensor
                    framed = frame(
                        fmt.dtype_from_name(info["dtype"], _key(item.index)),
                        info["shape"],
                        nbytes,
                        crc,
                    )
                    offset += len(framed.head)
                offset = fmt.align_up(offset, fmt.DATA_ALIGN)
                _pwrite(fd, blob, offset)
                info.update(file=fname, offset=offset, length=nbytes, crc32=crc)
                if framed is not None:
                    start = offset - len(framed.head)
                    _pwrite(fd, framed.head, start)
                    _pwrite(fd, framed.tail, offset + nbytes)
                    info["frame"] = {
                        "offset": start,
                        "length": framed.length(nbytes),
                        "crc32": fmt.crc32(framed.tail, fmt.crc32(framed.head)),
                    }
                    offset += len(framed.tail)
                entries.append(
                    {
                        "key": _key(item.index),
                        "kind": info["kind"],
                        "offset": info["offset"],
                        "nbytes": nbytes,
                        "crc32": crc,
                    }
                )
                results.append(
                    WriteResult(index=item.index, size_in_bytes=nbytes, storage_data=info)
                )
                offset += nbytes
            index = fmt.encode_index(data.rank, entries)
            _pwrite(fd, index, offset)
            _pwrite(fd, fmt.pack_header(offset, index), 0)
            if self.sync_files:
                os.fsync(fd)
        finally:
            os.close(fd)
        self._record_stats(t0, sum(r.size_in_bytes for r in results))
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        storage = {}
        files = set()
        for per_rank in results:
            for wr in per_rank:
                storage[wr.index] = wr.storage_data
                files.add(wr.storage_data["file"])
        metadata.storage_data = storage
        tmp_dir = self._tmp_dir()
        blob = dcp_metadata.encode(metadata)
        _write_file(os.path.join(tmp_dir, METADATA), blob, self.sync_files)
        # DCP's own metadata file, pickled as FileSystemWriter pickles it, pointing at each
        # tensor's frame and each object's bytes (read by FileSystemReader, never by us)
        stock = pickle.dumps(
            dataclasses.replace(
                metadata,
                storage_data={index: _stock_info(info) for index, info in storage.items()},
            )
        )
        _write_file(os.path.join(tmp_dir, PICKLE), stock, self.sync_files)
        manifest = {
            "format": FORMAT,
            "version": VERSION,
            "save_id": self.save_id,
            "metadata_crc32": fmt.crc32(blob),
            "metadata_bytes": len(blob),
            "pickle_crc32": fmt.crc32(stock),
            "pickle_bytes": len(stock),
            "files": sorted(files),
        }
        _write_file(os.path.join(tmp_dir, MANIFEST), json.dumps(manifest).encode(), self.sync_files)
        if self.sync_files:
            fsync_dir(tmp_dir)
        path = self._root()
        parent, name = os.path.split(path)
        if not self.overwrite and os.path.lexists(path):
            raise FileExistsError(f"{path} exists and overwrite=False")
        _PUBLISHER.make_visible(
            parent, tmp_dir, name, replace=os.path.lexists(path), fsync=self.sync_files
        )
        if self.last_save_stats is not None and self._stats_t0 is not None:
            self.last_save_stats.commit_s = time.perf_counter() - self._stats_t0

    def _record_stats(self, t0: float, nbytes: int) -> None:
        """This rank's SaveStats once its file is written (see the class docstring)."""
        from ..save.job import SaveStats

        now = time.perf_counter()
        staged, self._staged_at = self._staged_at, None
        self._stats_t0 = staged[0] if staged is not None else t0
        written = now - self._stats_t0
        captured = staged[1] if staged is not None else written
        self.last_save_stats = SaveStats(
            blocked_s=captured, snapshot_s=captured, commit_s=written, nbytes=nbytes, files=1
        )

    def _tmp_dir(self) -> str:
        parent, name = os.path.split(self._root())
        return _PUBLISHER.tmp_location(parent, name, self.save_id, 0)

    def storage_meta(self) -> StorageMeta | None:
        return StorageMeta(checkpoint_id=self.path, save_id=self.save_id)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))

    # ------------------------------------------------------------ AsyncStager
    def stage(self, state_dict):
        """Copy ``state_dict`` to CPU buffers (reused by later saves when cached)."""
        t0 = time.perf_counter()
        staged = self._stage(state_dict)
        self._staged_at = (t0, time.perf_counter() - t0)
        return staged

    def _stage(self, state_dict):
        from torch.distributed._state_dict_utils import _copy_state_dict, _create_cpu_state_dict

        pin = torch.cuda.is_available()
        if not self.cache_staged_state_dict:
            staged = _create_cpu_state_dict(state_dict, pin_memory=pin)
            return _copy_state_dict(state_dict, staged)
        if self._staged is None:
            self._staged = _create_cpu_state_dict(state_dict, pin_memory=pin)
        return _copy_state_dict(state_dict, self._staged)

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        self._staged = None


class DatastatesReader(StorageReader):
    """DCP ``StorageReader`` for checkpoints written by :class:`DatastatesWriter`: verifies the
    manifest, the metadata checksum and every item's CRC-32 before DCP uses the bytes; reads each
    file's items in offset order, merging adjacent ones into one read.

    Nothing is unpickled by :meth:`read_metadata`: the metadata is JSON. A folder of format
    version 1 (pickled metadata) is refused with ``UnsafeObjectError`` unless ``trusted=True``.
    The non-tensor values are handed to the planner, which decides how to load them (DCP's
    default planner uses ``torch.load(weights_only=False)``; see :func:`load_state`)."""

    def __init__(
        self, path: str | os.PathLike | None = None, *, verify: bool = True, trusted: bool = False
    ):
        super().__init__()
        self.path = os.path.abspath(os.fspath(path)) if path is not None else None
        self.verify, self.trusted = verify, trusted
        self.storage_data: dict = {}
        self.load_id = uuid.uuid4().hex

    def _root(self) -> str:
        """The checkpoint's folder; ValueError when none was given yet."""
        if self.path is None:
            raise ValueError(
                "DatastatesReader: no checkpoint path (pass one to the reader or "
                "checkpoint_id= to dcp.load)"
            )
        return self.path

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        self.storage_data = {}
        if checkpoint_id is not None:
            self.path = os.path.abspath(os.fspath(checkpoint_id))
        self.load_id = uuid.uuid4().hex

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """The DCP ``Metadata``, every field checked. CheckpointNotFoundError if the folder holds
        no manifest, CorruptCheckpointError if the manifest or the metadata do not validate,
        UnsafeObjectError for pickled (version 1) metadata unless trusted."""
        root = self._root()
        manifest = read_manifest(root)
        if manifest["version"] == 1:
            metadata = self._read_pickled(manifest)
        else:
            blob = read_checked(root, METADATA, manifest)
            metadata = dcp_metadata.decode(blob, os.path.join(root, METADATA), manifest["files"])
        storage_meta = getattr(metadata, "storage_meta", None)
        if storage_meta is not None:
            storage_meta.load_id = self.load_id
        return metadata

    def _read_pickled(self, manifest: dict) -> Metadata:
        path = os.path.join(self._root(), PICKLED_METADATA)
        if not self.trusted:
            raise UnsafeObjectError(
                f"{path}: the DCP metadata of this folder (datastates-dcp version 1) is a "
                "pickle, and unpickling it can run code from the folder; pass trusted=True "
                "(--trusted) only if you trust where the folder came from"
            )
        metadata = pickle.loads(read_checked(self._root(), PICKLED_METADATA, manifest))
        if not isinstance(metadata, Metadata):
            raise CorruptCheckpointError(f"{path}: not DCP Metadata")
        return metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        self.storage_data = metadata.storage_data

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list] = {}
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            by_file.setdefault(info["file"], []).append((info, req))
        for fname, reqs in by_file.items():
            path = os.path.join(self._root(), fname)
            check_regular(path)
            f = LOCAL.open_read(path)
            try:
                header = fmt.read_header(f, path, f.size)
                for run in _runs(sorted(reqs, key=lambda r: r[0]["offset"])):
                    start = run[0][0]["offset"]
                    end = max(i["offset"] + i["length"] for i, _ in run)
                    check_span(path, start, end - start, header.index_offset)
                    buf = f.pread(end - start, start)
                    for info, req in run:
                        lo = info["offset"] - start
                        view = memoryview(buf)[lo : lo + info["length"]]
                        if self.verify and fmt.crc32(view) != info["crc32"]:
                            raise CorruptCheckpointError(
                                f"{path}: checksum mismatch for {_key(req.storage_index)} at "
                                f"offset {info['offset']} ({info['length']} bytes)"
                            )
                        self._apply(req, info, view, planner)
            finally:
                f.close()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @staticmethod
    def _apply(req, info: dict, view: memoryview, planner: LoadPlanner) -> None:
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(bytes(view)))
            return
        dtype = fmt.dtype_from_name(info["dtype"], _key(req.storage_index))
        saved = (
            torch.frombuffer(bytearray(view), dtype=dtype)
            if len(view)
            else torch.empty(0, dtype=dtype)
        )
        saved = saved.view(info["shape"])
        for dim, (off, length) in enumerate(zip(req.storage_offsets, req.lengths)):
            saved = saved.narrow(dim, off, length)
        target = planner.resolve_tensor(req).detach()
        if target.size() != saved.size():
            raise CorruptCheckpointError(
                f"{_key(req.storage_index)}: saved chunk region "
                f"{tuple(saved.shape)} != requested {tuple(target.shape)}"
            )
        target.copy_(saved)
        planner.commit_tensor(req, target)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return isinstance(checkpoint_id, (str, os.PathLike))


# ---------------------------------------------------------------- helpers


def _key(index: MetadataIndex) -> str:
    return index.fqn + ("" if index.offset is None else "@" + ",".join(map(str, index.offset)))


def _encode(item, data) -> tuple[bytes | memoryview, dict]:
    if item.type == WriteItemType.BYTE_IO:
        return data.getvalue(), {"kind": "object"}
    t = data.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    info = {"kind": "tensor", "dtype": fmt.dtype_name(t.dtype), "shape": list(t.shape)}
    if t.numel() == 0:
        return b"", info
    return fmt.tensor_bytes(t).numpy().data.cast("B"), info


def _stock_info(info: dict) -> _StorageInfo:
    """Where DCP's ``FileSystemReader`` finds an item: a tensor's frame, an object's bytes."""
    span = info.get("frame", info)
    return _StorageInfo(relative_path=info["file"], offset=span["offset"], length=span["length"])


def _runs(reqs: list) -> list[list]:
    """Group requests whose byte ranges touch or are within 1 MiB of each other."""
    runs: list[list] = []
    for info, req in reqs:
        if runs and info["offset"] <= runs[-1][-1][0]["offset"] + runs[-1][-1][0]["length"] + (
            1 << 20
        ):
            runs[-1].append((info, req))
        else:
            runs.append([(info, req)])
    return runs


def _pwrite(fd: int, data, offset: int) -> None:
    view = memoryview(data).cast("B")
    while view.nbytes:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _write_file(path: str, data: bytes, sync: bool) -> None:
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        if sync:
            os.fsync(f.fileno())

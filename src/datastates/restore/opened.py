"""An open checkpoint: its validated manifest, its shard files (each opened when first needed and
checked against the manifest), and the reads of one region or one Python object.

The bottom of the restore stage: matching (matching.py), verification (verify.py) and ``Reader``
(reader.py) read a checkpoint through an :class:`OpenCheckpoint` only, so the shard files are
found the same way (in the checkpoint directory, or in the data directory its manifest names),
checked the same way when opened, and their bytes verified by the same checksum code (reads.py).
Which manifest it holds (the whole one, or the view of one saved rank) is the opener's choice.
"""

from __future__ import annotations

import mmap
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

import torch

from ..errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError, StorageError
from ..format import codec as fmt
from ..format import serialization
from ..format import tree
from ..format.codec import ShardHeader
from ..format.records import Entry, Manifest, ObjectEntry
from ..storage import ReadFile, Store
from ..storage.store import LocalReadFile
from .plan import Read
from .reads import check_landed


class ShardFiles:
    """The shard files of a checkpoint, each opened only when a read needs it (a rank restoring
    its own state opens the files its tree refers to, not every rank's: :meth:`check` before
    planning), its size checked against the manifest when opened, its header validated against
    the manifest once. Thread-safe: reader threads open files through it."""

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

    def check(self, file_ids: Iterable[int]) -> None:
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
            raise CheckpointNotFoundError(
                f"{path}: shard file listed in the manifest is missing"
            ) from None
        except StorageError:  # the service failed the request: says nothing of the checkpoint
            raise  # (taken for damage, a fallback would move a good one aside)
        except OSError as exc:
            raise CorruptCheckpointError(f"{path}: cannot open the shard file ({exc})") from None
        if f.size != self.manifest.files[file_id].nbytes:
            f.close()
            raise CorruptCheckpointError(
                f"{path}: {f.size} bytes, the manifest records "
                f"{self.manifest.files[file_id].nbytes} (truncated or "
                "replaced?)"
            )
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
            raise CorruptCheckpointError(
                f"{path}: index checksum {header.index_crc32} differs "
                f"from the manifest's {ref.index_crc32} (file replaced?)"
            )
        if header.index_offset % fmt.UNIT_ALIGN or header.end != size or size != ref.nbytes:
            raise CorruptCheckpointError(
                f"{path}: index at [{header.index_offset}, "
                f"{header.index_offset + header.index_length}) is not the 4096-aligned end of "
                f"the file of {size} bytes (the manifest records {ref.nbytes})"
            )
        for offset, nbytes, key in self.manifest.regions(file_id):
            if offset + nbytes > header.index_offset:
                raise CorruptCheckpointError(
                    f"{path}: {key!r} at [{offset}, {offset + nbytes}) "
                    f"extends past the data ending at "
                    f"{header.index_offset}"
                )
        return header

    def map(self, file_id: int) -> mmap.mmap:
        """A private, copy-on-write memory map of a validated local file (its header checked
        as by :meth:`open`): reading it costs page cache only, and nothing is written back.
        ConfigError for a file of an object store, which has no mapping."""
        f, _ = self.open(file_id)
        with self._lock:
            if file_id not in self._maps:
                if not isinstance(f, LocalReadFile):
                    raise ConfigError(
                        f"{self.path(file_id)}: only a file on a local disk can be memory-mapped"
                    )
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


@dataclass(frozen=True)
class OpenCheckpoint:
    """One committed checkpoint, open for reading: its directory and store, its validated
    ``manifest`` (whole, or the view of one saved rank: ``Manifest.view``), its shard files, and
    how its bytes are trusted (``verify``: checksums checked as they land; ``trusted`` and
    ``safe_globals``: how its Python objects are unpickled, format/serialization.py). The owner
    closes it (:meth:`close`: the files and their memory maps)."""

    dir: str
    store: Store
    manifest: Manifest
    files: ShardFiles
    verify: bool = True
    trusted: bool = False
    safe_globals: tuple[Any, ...] = ()

    @classmethod
    def open(
        cls,
        ckpt_dir: str,
        manifest: Manifest,
        store: Store,
        *,
        verify: bool = True,
        trusted: bool = False,
        safe_globals: Iterable[Any] = (),
    ) -> OpenCheckpoint:
        """The checkpoint at ``ckpt_dir`` of ``manifest``; no file is opened yet."""
        return cls(
            ckpt_dir,
            store,
            manifest,
            ShardFiles(ckpt_dir, manifest, store),
            verify,
            trusted,
            tuple(safe_globals),
        )

    @property
    def entries(self) -> Mapping[int, Entry]:
        """The manifest's entries (``Manifest.entries``), which the trees' nodes index."""
        return self.manifest.entries

    def files_of(self, saved: dict, keys: str | Iterable[str] | None = None) -> set[int]:
        """The shard files the leaves of the saved tree ``saved`` within ``keys`` (prefixes, as
        in ``restore(keys=...)``) refer to: a superset of what a restore of them reads (a
        sharded tensor counts every file of its shards)."""
        out: set[int] = set()
        entries = self.manifest.entries
        for _, node in tree.leaves(saved, tree.prefixes(keys)):
            if node["t"] in tree.ENTRY_LEAVES:
                entry = entries[node["e"]]
                if isinstance(entry, ObjectEntry):
                    out.add(entry.file)
                else:
                    out.update(s.file for s in entry.shards)
        return out

    def read_object(self, entry: Entry) -> Any:
        """The saved Python object of ``entry``, its checksum verified (with ``verify``), loaded
        as ``trusted`` and ``safe_globals`` allow. CorruptCheckpointError (also for an entry
        that is no object), SerializationError."""
        if not isinstance(entry, ObjectEntry):  # the tree's checks give objects object entries
            raise CorruptCheckpointError(f"{self.dir}: {entry.key!r} is no object")
        f, _ = self.files.open(entry.file)  # validates that the region lies before the index
        path = self.files.path(entry.file)
        buf = bytearray(entry.nbytes)
        f.read_into([memoryview(buf)], entry.offset)
        if self.verify and fmt.crc32(buf) != entry.crc32:
            raise CorruptCheckpointError(
                f"{path}: checksum mismatch for object {entry.key!r} at offset {entry.offset}"
            )
        return serialization.loads(
            memoryview(buf), entry.key, trusted=self.trusted, safe_globals=list(self.safe_globals)
        )

    def mapped(
        self, file_id: int, offset: int, nbytes: int, checksums: Sequence[Sequence[int]], key: str
    ) -> torch.Tensor:
        """The ``nbytes`` at ``offset`` of shard file ``file_id`` (the region of ``key``, whose
        ``checksums`` are ``[[length, crc32], ...]``) as a flat uint8 tensor viewing the file's
        memory map (:meth:`ShardFiles.map`): nothing is copied, so memory stays bounded by the
        page cache however large the region. Checked as a read is: the region lies before the
        file's index and, with ``verify``, its checksums match (CorruptCheckpointError naming
        the file, key and offsets)."""
        path = self.files.path(file_id)
        region = self.files.map(file_id)
        _, index_offset = self.files.open(file_id)
        if offset + nbytes > index_offset:
            raise CorruptCheckpointError(
                f"{path}: {key!r} at [{offset}, {offset + nbytes}) "
                f"extends past the data ending at {index_offset}"
            )
        view = (
            torch.frombuffer(region, dtype=torch.uint8, count=nbytes, offset=offset)
            if nbytes
            else torch.empty(0, dtype=torch.uint8)
        )
        if self.verify:
            check_landed(Read(file_id, offset, nbytes, view, checksums, key), path)
        return view

    def close(self) -> None:
        """Close the shard files and their memory maps (idempotent)."""
        self.files.close()

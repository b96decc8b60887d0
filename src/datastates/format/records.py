"""The typed records of the on-disk model and of the commit round (docs/format.md), each with its
JSON form.

A record is built by its writer -- the shard writer builds its rank's :class:`RankReport`, rank 0's
review merges the reports into a :class:`Manifest`, publishing takes a copy of it with the commit
number, the round's arbiter decides a :class:`Verdict` -- and read back from JSON only by
``validate.py``, whose ``parse_*`` functions check every byte that comes from another process or
from disk (and the merged manifest before it is written: it combines what other processes sent).
``to_json()`` gives the JSON a reader parses back into an equal record.

The records a checkpoint holds one of per tensor (a manifest entry, its shards, an index entry, a
report entry) are named tuples, immutable and typed like the frozen dataclasses of the others but
several times cheaper to build: a checkpoint of many small tensors builds hundreds of thousands.

Pure: no I/O, no validation here (``validate.py`` validates, ``files.py`` reads and writes bytes).
"""

from __future__ import annotations

import functools
import operator
from dataclasses import dataclass, field
from typing import Any, Iterable, Literal, Mapping, NamedTuple, Union

import torch

from . import codec as fmt
from . import sharing


# ---------------------------------------------------------------- records


@dataclass(frozen=True)
class FileRef:
    """One shard file of a checkpoint: ``rank-RRRRR.dsf`` written by ``rank``."""

    name: str
    rank: int
    nbytes: int  #: exact size of the file
    index_crc32: int  #: CRC-32 of its index, also stored in its header

    def to_json(self) -> dict:
        return {
            "rank": self.rank,
            "name": self.name,
            "nbytes": self.nbytes,
            "index_crc32": self.index_crc32,
        }


class PartRef(NamedTuple):
    """One part of a split manifest (version 4) as its head lists it: the file ``name`` (beside
    the shard files) holds the trees of ranks ``[first_rank, first_rank + rank_count)`` and the
    manifest's entries ``[first_entry, first_entry + entry_count)``; its bytes are exactly
    ``nbytes`` long with CRC-32 ``crc32``."""

    name: str
    first_rank: int
    rank_count: int
    first_entry: int
    entry_count: int
    nbytes: int
    crc32: int

    def to_json(self) -> dict:
        return self._asdict()


class ShardRef(NamedTuple):
    """A stored box of a tensor: ``shape`` elements at ``global_offset`` of the global tensor,
    raw at ``[offset, offset + nbytes)`` of file ``file``, verified piecewise by ``checksums``."""

    file: int
    offset: int
    nbytes: int
    global_offset: tuple[int, ...]
    shape: tuple[int, ...]
    checksums: tuple[tuple[int, int], ...]  #: consecutive (length, crc32) pieces

    def to_json(self) -> dict:
        return {
            "file": self.file,
            "offset": self.offset,
            "nbytes": self.nbytes,
            "global_offset": list(self.global_offset),
            "shape": list(self.shape),
            "checksums": list(map(list, self.checksums)),
        }


class TensorEntry(NamedTuple):
    """A tensor of the checkpoint: its global dtype and shape and the shards that cover it."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    shards: tuple[ShardRef, ...]
    replicated: bool = False
    rank: int | None = None  #: the rank whose per-rank tensor this is (None: shared/sharded)

    @property
    def kind(self) -> Literal["tensor"]:
        return "tensor"

    @property
    def torch_dtype(self) -> torch.dtype:
        return fmt.dtype_from_name(self.dtype, self.key)

    def to_json(self) -> dict:
        out: dict[str, Any] = {
            "kind": "tensor",
            "key": self.key,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "shards": list(map(ShardRef.to_json, self.shards)),
        }
        if self.replicated:
            out["replicated"] = True
        if self.rank is not None:
            out["rank"] = self.rank
        return out


class ObjectEntry(NamedTuple):
    """A serialized Python object at ``[offset, offset + nbytes)`` of file ``file``."""

    key: str
    file: int
    offset: int
    nbytes: int
    crc32: int

    @property
    def kind(self) -> Literal["object"]:
        return "object"

    def to_json(self) -> dict:
        return {
            "kind": "object",
            "key": self.key,
            "file": self.file,
            "offset": self.offset,
            "nbytes": self.nbytes,
            "crc32": self.crc32,
        }


Entry = Union[TensorEntry, ObjectEntry]


def entry_table(entries: Iterable[Entry]) -> dict[int, Entry]:
    """``entries`` by their index, from 0 in order: the ``entries`` of a whole manifest."""
    return dict(enumerate(entries))


@dataclass(frozen=True)
class RankTree:
    """The state tree of one rank; its tensor/object nodes index ``Manifest.entries``."""

    rank: int
    tree: dict

    def to_json(self) -> dict:
        return {"rank": self.rank, "tree": self.tree}


@dataclass(frozen=True)
class Manifest:
    """A validated ``manifest.json``; or one rank's view of a split one (``view``, below)."""

    version: int
    name: str
    step: int | None
    seq: int  #: commit sequence number (0 for version-1 manifests)
    created_unix: float
    world_size: int
    metadata: dict
    files: tuple[FileRef, ...]
    #: The entries by index (a tree's tensor and object nodes hold the index; JSON: a list).
    #: A whole manifest holds every index from 0 to ``len(entries) - 1``, in order
    #: (:func:`entry_table`); a rank's view (``view``) holds those its tree refers to.
    entries: Mapping[int, Entry]
    ranks: tuple[RankTree, ...]
    save_id: str | None = None  #: the nonce of the save that committed it (multi-rank commits)
    #: Object stores: the directory of the checkpoint holding its shard files (None: the
    #: checkpoint directory itself).
    data_dir: str | None = None
    #: The numbers ``save(metrics=...)`` recorded (name → finite int or float; optional field).
    metrics: dict = field(default_factory=dict)
    #: None for a whole manifest. For one rank's view of a split manifest (files._view),
    #: that rank: ``ranks`` then holds its tree only and ``entries`` the entries its tree
    #: refers to, at their indexes in the whole manifest. Only a reader restoring that rank
    #: at the saved world size is given a view.
    view: int | None = None

    @functools.cached_property
    def by_file(self) -> tuple[tuple[tuple[int, int, Entry, "ShardRef | None"], ...], ...]:
        """Per file, its regions (offset, nbytes, entry, shard or None for an object), by offset
        (:func:`regions_by_file`), made when first asked: the manifest rank 0 merges and the
        one it checks before writing never are, and a copy with other entries
        (``dataclasses.replace``) has its own."""
        return regions_by_file(self.entries.values(), len(self.files))

    @property
    def nbytes(self) -> int:
        return sum(f.nbytes for f in self.files)

    def regions(self, file_id: int) -> list[tuple[int, int, str]]:
        """(offset, nbytes, key) of every region of file ``file_id`` the manifest references."""
        return [(offset, nbytes, e.key) for offset, nbytes, e, _ in self.by_file[file_id]]

    def _ranks_json(self) -> list[dict]:
        """The per-rank trees; from version 3 on, what a rank shares with rank 0 is written
        once (format/sharing.py)."""
        if self.version < 3 or len(self.ranks) < 2:
            return [r.to_json() for r in self.ranks]
        base = self.ranks[0].tree
        return [self.ranks[0].to_json()] + [
            {"rank": r.rank, "tree": sharing.share(r.tree, base)} for r in self.ranks[1:]
        ]

    def to_json(self, entries: bool = True) -> dict:
        """The JSON object ``manifest.json`` holds (before its checksum seal); with
        ``entries=False`` its ``entries`` field is left empty (for a writer that turns them into
        JSON a batch at a time: ``validate.check_written_manifest``). ValueError for a rank's
        view, which holds part of the manifest only."""
        if self.view is not None:
            raise ValueError(
                f"the view of rank {self.view} of checkpoint {self.name!r} is not "
                "a whole manifest: it cannot be written"
            )
        out = {
            "format": fmt.CHECKPOINT_FORMAT,
            "version": self.version,
            "name": self.name,
            "step": self.step,
            "created_unix": self.created_unix,
            "world_size": self.world_size,
        }
        # Every field a listing needs comes before "entries" (docs/format.md, "The head"):
        # a catalog reads a checkpoint's description without decoding its entries.
        if self.version > 1:
            out["seq"] = self.seq
        if self.save_id is not None:
            out["save_id"] = self.save_id
        if self.data_dir is not None:
            out["data_dir"] = self.data_dir
        if self.metrics or self.version > 1:  # always in a head (files.HEAD_FIELDS)
            out["metrics"] = self.metrics
        out["metadata"] = self.metadata
        out["files"] = [f.to_json() for f in self.files]
        out["entries"] = (
            [self.entries[i].to_json() for i in range(len(self.entries))] if entries else []
        )
        out["ranks"] = self._ranks_json()
        return out


class IndexEntry(NamedTuple):
    """A region of a shard file as its own index describes it."""

    key: str
    kind: str  #: "tensor" or "object"
    offset: int
    nbytes: int
    checksums: tuple[tuple[int, int], ...]  #: (length, crc32) pieces covering the region
    dtype: str | None = None
    shape: tuple[int, ...] | None = None


@dataclass(frozen=True)
class ShardIndex:
    """The validated index of one shard file."""

    version: int
    rank: int
    entries: tuple[IndexEntry, ...]


class ReportEntry(NamedTuple):
    """One item of a rank's report: a tensor (written by this rank or not) or an object."""

    key: str
    kind: str
    written: bool
    offset: int | None = None
    nbytes: int | None = None
    dtype: str | None = None
    shape: tuple[int, ...] | None = None
    checksums: tuple[tuple[int, int], ...] = ()
    crc32: int | None = None
    global_shape: tuple[int, ...] | None = None
    global_offset: tuple[int, ...] | None = None
    replicated: bool = False

    def to_json(self) -> dict:
        if self.kind == "object":
            return {
                "key": self.key,
                "kind": "object",
                "offset": self.offset,
                "nbytes": self.nbytes,
                "crc32": self.crc32,
            }
        out: dict[str, Any] = {
            "key": self.key,
            "kind": "tensor",
            "dtype": self.dtype,
            "shape": _list_of(self.shape),
        }
        if self.global_shape is not None:
            out["global_shape"] = list(self.global_shape)
            out["global_offset"] = _list_of(self.global_offset)
        if self.replicated:
            out["replicated"] = True
        if not self.written:
            out["written"] = False
            return out
        out["offset"], out["nbytes"] = self.offset, self.nbytes
        out["checksums"] = list(map(list, self.checksums))
        return out


@dataclass(frozen=True)
class SaveRef:
    """Which save a rank report belongs to: every rank derives the same one on its own."""

    name: str
    step: int | None
    nonce: str  #: names the round's keys; recorded in the manifest as ``save_id``
    overwrite: bool = False

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "step": self.step,
            "nonce": self.nonce,
            "overwrite": self.overwrite,
        }


@dataclass(frozen=True)
class RankReport:
    """What a rank sends rank 0 once its save is over (docs/format.md, commit step 2): its shard
    file and entries, or its failure. Built by the shard writer (``save/job.finish_file``)."""

    rank: int
    save: SaveRef
    root: str  #: the directory this rank saves into, as it spells it
    file: FileRef | None = None  #: None for a failed save
    entries: tuple[ReportEntry, ...] = ()
    tree: dict | None = field(default=None, repr=False)
    #: Digest of every declared-replicated tensor (key → text), compared across ranks.
    replicas: Mapping[str, str] = field(default_factory=dict)
    error: str | None = None  #: this rank's own failure, described
    expired: bool = False  #: its deadline passed before the round began

    @property
    def failed(self) -> bool:
        return self.error is not None

    def to_json(self) -> dict:
        out: dict[str, Any] = {"rank": self.rank, "save": self.save.to_json(), "root": self.root}
        if self.failed:
            out.update(error=self.error, expired=self.expired)
            return out
        assert self.file is not None  # a report without an error names its file
        out.update(
            file=self.file.to_json(),
            entries=[e.to_json() for e in self.entries],
            tree=self.tree,
            replicas=dict(self.replicas),
            expired=self.expired,
        )
        return out


# ---------------------------------------------------------------- the commit round's outcome


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint. ``seq`` is its commit sequence number: the newest checkpoint of a
    directory is the one with the highest ``seq`` (0 for checkpoints of format version 1)."""

    name: str
    path: str
    step: int | None
    created_unix: float
    world_size: int
    nbytes: int
    metadata: dict = field(default_factory=dict)
    seq: int = 0
    #: The metrics saved with it (``save(metrics=...)``): name → int or float; empty if none.
    metrics: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {
            "name": self.name,
            "path": self.path,
            "step": self.step,
            "created_unix": self.created_unix,
            "world_size": self.world_size,
            "nbytes": self.nbytes,
            "metadata": self.metadata,
            "seq": self.seq,
            "metrics": self.metrics,
        }


@dataclass(frozen=True)
class SkippedCheckpoint:
    """A committed checkpoint that a restore with ``fallback=True`` did not use: its name, why
    (which rank found what), and where it was moved (``quarantined``: the path, never listed;
    None when it was not moved: another rank does not list it, its damage is no damage of its
    bytes, or the move failed — the log says which)."""

    name: str
    reason: str
    quarantined: str | None = None


def info_of(path: str, manifest: Manifest) -> CheckpointInfo:
    """The description of the checkpoint at ``path`` with this manifest."""
    return CheckpointInfo(
        name=path.rstrip("/").rsplit("/", 1)[-1],
        path=path,
        step=manifest.step,
        created_unix=manifest.created_unix,
        world_size=manifest.world_size,
        nbytes=manifest.nbytes,
        metadata=dict(manifest.metadata),
        seq=manifest.seq,
        metrics=dict(manifest.metrics),
    )


#: Why a round did not commit: ``timeout`` (a rank did not report, or its deadline passed),
#: ``failed`` (a rank's own error), ``mismatch`` (different saves), ``invalid`` (the reports do not
#: form a checkpoint), ``store`` (coordination lost), ``commit`` (rank 0's publish failed),
#: ``unknown`` (this rank cannot learn the verdict: no store and no manifest of the save on disk;
#: never written to the store).
ABORT_KINDS = ("timeout", "failed", "mismatch", "invalid", "store", "commit", "unknown")


@dataclass(frozen=True)
class Verdict:
    """The outcome of one commit round, the same on every rank: committed (``info``: the
    checkpoint, as rank 0 names it; None when a rank learnt it from the disk and named it itself),
    pending (rank 0 claimed the round and is reviewing; ``publishing``: it won the fence and
    makes the checkpoint visible now), or aborted (``kind`` in ABORT_KINDS, ``message``, and each
    involved rank's cause). See commit/round.py for the order of these states."""

    ok: bool
    kind: str = ""
    message: str = ""
    causes: Mapping[int, str] = field(default_factory=dict)
    info: CheckpointInfo | None = None
    pending: bool = False
    publishing: bool = False

    @classmethod
    def committed(cls, info: CheckpointInfo | None) -> "Verdict":
        return cls(ok=True, info=info)

    @classmethod
    def abort(cls, kind: str, message: str, causes: Mapping[int, str]) -> "Verdict":
        if kind not in ABORT_KINDS:
            raise ValueError(f"abort kind {kind!r} is not one of {ABORT_KINDS}")
        return cls(ok=False, kind=kind, message=message, causes=dict(sorted(causes.items())))

    def to_json(self) -> dict:
        if self.pending:
            return {"pending": True, "publishing": True} if self.publishing else {"pending": True}
        if self.ok:
            return {"ok": True, "info": self.info.to_json() if self.info is not None else None}
        return {
            "ok": False,
            "kind": self.kind,
            "message": self.message,
            "causes": {str(r): c for r, c in self.causes.items()},
        }


#: Rank 0's claim of a round: it reviews the reports and writes the manifest; until it moves the
#: key on to PUBLISHING, a rank that gives up on it can still replace it with an abort.
PENDING = Verdict(ok=False, pending=True)
#: Rank 0 won the fence (compare-and-set from PENDING): it makes the checkpoint visible now; the
#: final verdict (commit, or abort if that failed) follows, written by rank 0 only.
PUBLISHING = Verdict(ok=False, pending=True, publishing=True)


# ---------------------------------------------------------------- shared by writers and parsers

_offset_and_size = operator.itemgetter(0, 1)


def _list_of(dims: tuple[int, ...] | None) -> list[int] | None:
    return None if dims is None else list(dims)


def spans_by_file(entries: Iterable[Entry], nfiles: int) -> list[list[tuple[int, int]]]:
    """Each file's regions as (offset, nbytes), sorted: what :func:`regions_by_file` gives
    without the entries (pairs of ints, which the garbage collector stops tracking)."""
    out: list[list] = [[] for _ in range(nfiles)]
    for e in entries:
        if isinstance(e, ObjectEntry):
            out[e.file].append((e.offset, e.nbytes))
        else:
            for s in e.shards:
                out[s.file].append((s.offset, s.nbytes))
    for spans in out:
        spans.sort()
    return out


def regions_by_file(entries: Iterable[Entry], nfiles: int) -> tuple:
    """One pass over the entries: each file's regions (offset, nbytes, entry, shard or None for
    an object), sorted by offset -- ``Manifest.by_file``."""
    out: list[list] = [[] for _ in range(nfiles)]
    for e in entries:
        if isinstance(e, ObjectEntry):
            out[e.file].append((e.offset, e.nbytes, e, None))
        else:
            for s in e.shards:
                out[s.file].append((s.offset, s.nbytes, e, s))
    return tuple(tuple(sorted(regions, key=_offset_and_size)) for regions in out)

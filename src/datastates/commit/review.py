"""Rank 0's review of one commit round: do the rank reports form one checkpoint of this save?
If so, merge them into its manifest (docs/format.md, "Commit protocol", steps 2-3).

Pure except :func:`check_files` (a stat per shard file): reports in (rank 0's own as built, the
others already validated by the round), a verdict or a manifest record out. Each check returns
its problems as (ranks involved, text); none means the reports form a checkpoint.
"""

from __future__ import annotations

import time
from typing import Any

from ..errors import CorruptCheckpointError
from ..format import codec as fmt
from ..format import tree
from ..format.tiling import TooIrregular, box_text, grid, overlapping, volume
from ..format.tiling import slabs as _slabs  # (a test replaces it: the general check agrees)
from ..format.records import (
    Entry,
    FileRef,
    Manifest,
    ObjectEntry,
    RankReport,
    RankTree,
    ReportEntry,
    ShardRef,
    TensorEntry,
    Verdict,
    entry_table,
)
from ..storage.store import Store

Problems = list[tuple[list[int], str]]


def review(
    reports: dict[int, RankReport],
    *,
    name: str,
    step: int | None,
    metadata: dict,
    save_id: str,
    tmp: str,
    replica_check: bool,
    store: Store,
    metrics: dict | None = None,
) -> tuple[Verdict | None, Manifest | None]:
    """(abort verdict, None) if the reports do not form one checkpoint of this save, else
    (None, manifest). Checks, in order: a rank's own failure, that every report belongs to this
    save, the manifest merge, exact tiling of every tensor, replica digests (optional), and a
    stat of every file the manifest will reference."""
    failed = {r: rep.error for r, rep in reports.items() if rep.error is not None}
    if failed:
        return Verdict.abort(
            "failed",
            f"checkpoint {name!r} failed on rank(s) {sorted(failed)}; nothing was committed",
            failed,
        ), None
    problems = check_same_save(reports)
    if problems:
        return _invalid(
            "mismatch", f"the ranks made different saves; {name!r} was not committed", problems
        ), None
    try:
        manifest = build_manifest(
            [reports[r] for r in sorted(reports)],
            name=name,
            step=step,
            metadata=metadata,
            save_id=save_id,
            metrics=metrics,
        )
    except CorruptCheckpointError as exc:
        return _invalid(
            "invalid", f"checkpoint {name!r} was not committed", [([0], str(exc))]
        ), None
    problems = check_tiling(manifest) + (check_replicas(reports) if replica_check else [])
    problems = problems or check_files(tmp, manifest, store)
    if problems:
        return _invalid(
            "invalid",
            f"checkpoint {name!r} was not committed: the ranks' reports "
            "do not form a consistent checkpoint",
            problems,
        ), None
    return None, manifest


def _invalid(kind: str, message: str, problems: Problems) -> Verdict:
    causes: dict[int, str] = {}
    for ranks, text in problems:
        for r in ranks:
            causes[r] = f"{causes[r]}; {text}" if r in causes else text
    return Verdict.abort(kind, message, causes)


# ---------------------------------------------------------------- the merge


def build_manifest(
    reports: list[RankReport],
    *,
    name: str,
    step: int | None,
    metadata: dict,
    save_id: str | None = None,
    metrics: dict | None = None,
) -> Manifest:
    """Merge every rank's report into one manifest (its commit number is set when it is
    published: ``seq`` 0 here).

    Replicated tensors (same key, declared replicated) become one entry written by their owner;
    shards of one global tensor become one entry with several shards (every written box is kept:
    :func:`check_tiling` rejects overlaps and gaps); anything else stays per rank, so two ranks
    holding different tensors under one key never collapse into one. ``save_id`` (the round's
    nonce) is recorded so that a rank can recognise its own save on disk; ``metrics`` (rank 0's,
    checked by ``save()``) as they are, the field left out when there are none."""
    files: list[FileRef] = []
    ranks: list[RankTree] = []
    merged = _Merged()
    for report in sorted(reports, key=lambda rep: rep.rank):
        file_id = len(files)
        f, tree = report.file, report.tree
        if f is None or tree is None:
            raise CorruptCheckpointError(
                f"rank {report.rank} reported no shard file and tree "
                f"to merge (its failure: {report.error})"
            )
        files.append(
            FileRef(name=f.name, rank=report.rank, nbytes=f.nbytes, index_crc32=f.index_crc32)
        )
        table = [merged.add(e, file_id, report.rank) for e in report.entries]
        if table != list(range(len(table))):  # else (rank 0): as it is
            tree = _remap(tree, table)
        ranks.append(RankTree(rank=report.rank, tree=tree))
    entries = merged.entries()
    return Manifest(
        version=fmt.MANIFEST_VERSION,
        name=name,
        step=step,
        seq=0,
        created_unix=time.time(),
        world_size=len(reports),
        metadata=metadata,
        files=tuple(files),
        entries=entries,
        ranks=tuple(ranks),
        save_id=save_id,
        metrics=dict(metrics or {}),
    )


def _remap(node: dict, table: list[int]) -> dict:
    """A copy of a rank's tree whose tensor and object nodes index the manifest's entries: what
    ``tree.map_leaves`` makes of it with that leaf function, without building the path of every
    node (a validated tree: its depth is bounded)."""
    t = node["t"]
    if t in tree.ENTRY_LEAVES:
        return {**node, "e": table[node["e"]]}
    if t in tree.LEAVES:
        return node
    if t == "provider":
        return {**node, "state": _remap(node["state"], table)}
    if t in tree.MAPPINGS:
        return {"t": t, "items": [[k, _remap(child, table)] for k, child in node["items"]]}
    return {"t": t, "items": [_remap(child, table) for child in node["items"]]}


class _Merged:
    """The manifest's entries while the reports are merged: one per object and per-rank tensor,
    one per replicated key and per sharded key (its shards gathered)."""

    def __init__(self) -> None:
        #: finished entries (an object, a per-rank tensor), or the fields of a tensor whose
        #: shards are still gathered (replicated, sharded)
        self._entries: list[Any] = []
        self._grouped: dict[tuple, int] = {}

    def add(self, e: ReportEntry, file_id: int, rank: int) -> int:
        """Merge one report entry; its index in the manifest's entries."""
        # The parser of reports (validate.parse_rank_report) gave every written entry its
        # region, and every tensor entry its dtype and shape.
        if e.kind == "object":
            assert e.offset is not None and e.nbytes is not None and e.crc32 is not None
            self._entries.append(
                ObjectEntry(
                    key=e.key, file=file_id, offset=e.offset, nbytes=e.nbytes, crc32=e.crc32
                )
            )
            return len(self._entries) - 1
        assert e.dtype is not None and e.shape is not None
        if e.written and e.global_shape is None and not e.replicated:  # this rank's own tensor
            assert e.offset is not None and e.nbytes is not None
            own = ShardRef(file_id, e.offset, e.nbytes, (0,) * len(e.shape), e.shape, e.checksums)
            self._entries.append(TensorEntry(e.key, e.dtype, e.shape, (own,), False, rank))
            return len(self._entries) - 1
        shard = None
        if e.written:
            assert e.offset is not None and e.nbytes is not None
            shard = ShardRef(
                file=file_id,
                offset=e.offset,
                nbytes=e.nbytes,
                global_offset=e.global_offset or (0,) * len(e.shape),
                shape=e.shape,
                checksums=e.checksums,
            )
        sharded = e.global_shape is not None
        group = ("sharded", e.key) if sharded else ("replicated", e.key) if e.replicated else None
        shape = e.global_shape or e.shape
        if group is not None and group in self._grouped:
            target = self._entries[self._grouped[group]]
            if target["dtype"] != e.dtype or target["shape"] != shape:
                raise CorruptCheckpointError(
                    f"rank {rank} holds {e.key!r} as {e.dtype}{list(shape)} but another rank as "
                    f"{target['dtype']}{list(target['shape'])}"
                )
            if shard is not None:
                target["shards"].append(shard)
            return self._grouped[group]
        self._entries.append(
            {
                "key": e.key,
                "dtype": e.dtype,
                "shape": shape,
                "shards": [shard] if shard else [],
                "replicated": e.replicated,
                "rank": None if sharded or e.replicated else rank,
            }
        )
        if group is not None:
            self._grouped[group] = len(self._entries) - 1
        return len(self._entries) - 1

    def entries(self) -> dict[int, Entry]:
        """The merged entries by index (``Manifest.entries``)."""
        out: list[Entry] = []
        for e in self._entries:
            if type(e) is not dict:  # finished when merged
                out.append(e)
                continue
            if not e["shards"]:
                what = "replicated tensor" if e["replicated"] else "tensor"
                raise CorruptCheckpointError(
                    f"{what} {e['key']!r} was written by no rank (every "
                    "rank declared its copy a replica: primary=False)"
                )
            out.append(
                TensorEntry(
                    key=e["key"],
                    dtype=e["dtype"],
                    shape=e["shape"],
                    shards=tuple(e["shards"]),
                    replicated=e["replicated"],
                    rank=e["rank"],
                )
            )
        return entry_table(out)


# ---------------------------------------------------------------- the checks


def check_same_save(reports: dict[int, RankReport]) -> Problems:
    """Every report belongs to rank 0's save: same name, step, nonce and overwrite flag."""
    want = reports[0].save
    problems = []
    for r, rep in sorted(reports.items()):
        got = rep.save
        if (got.name, got.step, got.nonce, got.overwrite) != (
            want.name,
            want.step,
            want.nonce,
            want.overwrite,
        ):
            problems.append(
                (
                    [r],
                    f"reported save {got.name!r} step {got.step} "
                    f"overwrite={got.overwrite}, rank 0 saves {want.name!r} step "
                    f"{want.step} overwrite={want.overwrite}",
                )
            )
    return problems


def check_tiling(manifest: Manifest) -> Problems:
    """The written boxes of every tensor tile its shape exactly: inside it, no two overlapping
    (two ranks writing one box is an error unless one declares itself a replica with
    ``primary=False``), and no element left uncovered. The tiling rules are the format's
    (``format/tiling.py``), which every reader applies to the manifest committed."""
    problems = []
    rank_of = [f.rank for f in manifest.files]
    own: dict[str, list[int]] = {}  # key -> ranks holding a tensor of their own under it
    for e in manifest.entries.values():
        if isinstance(e, TensorEntry) and e.rank is not None:
            own.setdefault(e.key, []).append(e.rank)
    for e in manifest.entries.values():
        if not isinstance(e, TensorEntry) or _slabs(e.shape, e.shards) or grid(e.shape, e.shards):
            continue  # one box of the whole tensor, slabs, or the cells of a grid: tiled
        shape = e.shape
        boxes = [(s.global_offset, s.shape, rank_of[s.file]) for s in e.shards]
        outside = [
            (
                [r],
                f"box {box_text(off, box)} of {e.key!r} lies outside its global "
                f"shape {list(shape)}",
            )
            for off, box, r in boxes
            if len(off) != len(shape)
            or len(box) != len(shape)
            or any(o < 0 or o + n > g for o, n, g in zip(off, box, shape))
        ]
        if outside:
            problems += outside
            continue
        try:
            overlaps = [
                (
                    [a[2], b[2]],
                    f"ranks {a[2]} and {b[2]} both wrote {e.key!r} boxes "
                    f"{box_text(*a[:2])} and {box_text(*b[:2])}, which overlap (declare "
                    "replicas with primary=False or replicated=...)",
                )
                for a, b in overlapping(boxes)
            ]
        except TooIrregular as exc:
            problems.append(
                (
                    sorted({r for *_, r in boxes}),
                    f"the shards of {e.key!r} (shape {list(shape)}): {exc}",
                )
            )
            continue
        problems += overlaps
        covered = sum(volume(box) for _, box, _ in boxes)
        if not overlaps and covered != volume(shape):
            plain = sorted(own.get(e.key, ()))
            hint = (
                f"; rank(s) {plain} saved {e.key!r} as a tensor of their own, not a "
                "TensorShard of it"
                if plain
                else ""
            )
            problems.append(
                (
                    sorted({r for *_, r in boxes} | set(plain)),
                    f"the boxes written "
                    f"for {e.key!r} cover {covered} of its {volume(shape)} elements "
                    f"(shape {list(shape)}): a gap{hint}",
                )
            )
    return problems


def check_replicas(reports: dict[int, RankReport]) -> Problems:
    """Declared replicas hold the same bytes on every rank (``replicas``: key → digest)."""
    seen: dict[str, dict[str, list[int]]] = {}
    for r, rep in sorted(reports.items()):
        for key, digest in rep.replicas.items():
            seen.setdefault(key, {}).setdefault(str(digest), []).append(r)
    problems = []
    for key, groups in sorted(seen.items()):
        if len(groups) > 1:
            ranks = sorted(r for rs in groups.values() for r in rs)
            shown = "; ".join(
                f"ranks {rs} hold digest {d}"
                for d, rs in sorted(groups.items(), key=lambda kv: kv[1])
            )
            problems.append((ranks, f"replicated tensor {key!r} differs across ranks ({shown})"))
    return problems


def check_files(tmp: str, manifest: Manifest, store: Store) -> Problems:
    """Every file the manifest references exists in ``tmp`` with the reported size (a stat
    per file, on the coordinator, just before the publish)."""
    problems = []
    for f in manifest.files:
        path = store.join(tmp, f.name)
        try:
            reader = store.open_read(path)
            size = reader.size
            reader.close()
        except OSError as exc:
            problems.append(([f.rank], f"{path}: cannot stat the shard file ({exc})"))
            continue
        if size != f.nbytes:
            problems.append(([f.rank], f"{path}: {size} bytes on disk, {f.nbytes} reported"))
    return problems

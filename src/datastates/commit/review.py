"""The commit protocol on a directory: manifest assembly, rank 0's review, numbering the commit,
``latest`` and finding the newest checkpoint (docs/format.md, "Commit protocol"). How a checkpoint
becomes visible on each kind of store is publish.py; removing checkpoints -- deletion, retention,
stale temporaries -- is retention.py."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from ..format import codec as fmt
from ..format import files
from ..format import records
from .catalog import Catalog, CheckpointInfo, info_of, list_checkpoints  # noqa: F401 (re-exported)
from .rounds import abort_decision
from ..errors import CheckpointNotFoundError, CommitError, CorruptCheckpointError, StorageError
from .publish import publisher_for
from ..storage.store import LOCAL, Store


@dataclass(frozen=True)
class Published:
    """What :func:`publish` committed: the checkpoint, and the committed checkpoints of the root
    right after the commit, oldest first (what retention counts)."""

    info: CheckpointInfo
    committed: list[CheckpointInfo]


# ---------------------------------------------------------------- manifest assembly (pure)

def build_manifest(payloads: list[dict], *, name: str, step: int | None,
                   metadata: dict, save_id: str | None = None, own_rank: int | None = 0) -> dict:
    """Merge every rank's report into one manifest.

    Replicated tensors (same key, declared replicated) become one entry written by their owner;
    shards of one global tensor become one entry with several shards (every written box is kept:
    :func:`check_tiling` rejects overlaps and gaps); anything else stays per rank, so two ranks
    holding different tensors under one key never collapse into one. ``save_id`` (the round's
    nonce) is recorded so that a rank can recognise its own save on disk.

    The reports of the other ranks are validated first; that of ``own_rank`` (the caller's own,
    built by this process) is not — the manifest merged from it is validated whole before it is
    written (``format.encode_manifest_checked``), so its bytes are checked once, not twice.
    """
    for i, payload in enumerate(payloads):
        if own_rank is None or _rank_of(payload) != own_rank:
            records.parse_rank_report(payload, f"report {i} (rank {_rank_of(payload)})")
    files, entries, ranks = [], [], []
    grouped: dict[tuple, int] = {}
    for payload in sorted(payloads, key=lambda p: p["rank"]):
        file_id = len(files)
        files.append({"rank": payload["rank"], **payload["file"]})
        local_to_global = []
        for e in payload["entries"]:
            local_to_global.append(_merge_entry(e, file_id, payload["rank"], entries, grouped))
        tree = payload["tree"]
        if local_to_global != list(range(len(local_to_global))):  # else (rank 0): as it is
            tree = _remap(tree, local_to_global)
        ranks.append({"rank": payload["rank"], "tree": tree})
    for e in entries:
        if e["kind"] == "tensor" and e.get("replicated") and not e["shards"]:
            raise CorruptCheckpointError(f"replicated tensor {e['key']!r} was written by no rank")
    manifest = {"format": fmt.CHECKPOINT_FORMAT, "version": fmt.VERSION, "name": name,
                "step": step, "created_unix": time.time(), "world_size": len(payloads),
                "metadata": metadata, "files": files, "entries": entries, "ranks": ranks}
    if save_id is not None:
        manifest["save_id"] = save_id
    return manifest


def _rank_of(payload: Any) -> Any:
    return payload.get("rank") if isinstance(payload, dict) else None


def _merge_entry(e: dict, file_id: int, rank: int, entries: list, grouped: dict) -> int:
    if e["kind"] == "object":
        entries.append({"kind": "object", "key": e["key"], "file": file_id, "offset": e["offset"],
                        "nbytes": e["nbytes"], "crc32": e["crc32"]})
        return len(entries) - 1
    shard = None
    if e.get("written", True):
        shard = {"file": file_id, "offset": e["offset"], "nbytes": e["nbytes"],
                 "global_offset": e.get("global_offset") or [0] * len(e["shape"]),
                 "shape": e["shape"], "checksums": e["checksums"]}
    sharded = e.get("global_shape") is not None
    group = None
    if sharded:
        group = ("sharded", e["key"])
    elif e.get("replicated"):
        group = ("replicated", e["key"])
    if group is not None and group in grouped:
        target = entries[grouped[group]]
        if target["dtype"] != e["dtype"] or target["shape"] != (e.get("global_shape") or e["shape"]):
            raise CorruptCheckpointError(
                f"rank {rank} holds {e['key']!r} as {e['dtype']}{e.get('global_shape') or e['shape']}"
                f" but another rank as {target['dtype']}{target['shape']}")
        if shard is not None:
            target["shards"].append(shard)
        return grouped[group]
    entry = {"kind": "tensor", "key": e["key"], "dtype": e["dtype"],
             "shape": e.get("global_shape") or e["shape"], "shards": [shard] if shard else []}
    if e.get("replicated"):
        entry["replicated"] = True
    if not sharded and not e.get("replicated"):
        entry["rank"] = rank
    entries.append(entry)
    if group is not None:
        grouped[group] = len(entries) - 1
    return len(entries) - 1


def _remap(node: Any, table: list[int]) -> Any:
    t = node["t"]
    if t in ("tensor", "object"):
        return {**node, "e": table[node["e"]]}
    if t in ("dict", "odict"):
        return {"t": t, "items": [[k, _remap(v, table)] for k, v in node["items"]]}
    if t in ("list", "tuple"):
        return {"t": t, "items": [_remap(v, table) for v in node["items"]]}
    if t == "provider":
        return {**node, "state": _remap(node["state"], table)}
    return node


# ---------------------------------------------------------------- rank 0's review before a rename

def review(reports: dict[int, dict], *, name: str, step: int | None, metadata: dict,
           save_id: str, tmp: str, replica_check: bool,
           store: Store = LOCAL) -> tuple[dict | None, dict | None]:
    """Rank 0: (abort verdict, None) if the reports do not form one checkpoint of this save,
    else (None, manifest). Checks, in order: a rank's own failure, that every report belongs to
    this save, the manifest merge, exact tiling of every tensor, replica digests (optional), and
    a stat of every file the manifest will reference."""
    failed = {r: rep["error"] for r, rep in reports.items() if "error" in rep}
    if failed:
        return abort_decision("failed", f"checkpoint {name!r} failed on rank(s) "
                              f"{sorted(failed)}; nothing was committed", failed), None
    problems = check_same_save(reports)
    if problems:
        return _invalid("mismatch", f"the ranks made different saves; {name!r} was not "
                        "committed", problems), None
    try:
        manifest = build_manifest([reports[r] for r in sorted(reports)], name=name, step=step,
                                  metadata=metadata, save_id=save_id)
    except CorruptCheckpointError as exc:
        return _invalid("invalid", f"checkpoint {name!r} was not committed",
                        [([0], str(exc))]), None
    problems = check_tiling(manifest) + (check_replicas(reports) if replica_check else [])
    problems = problems or check_files(tmp, manifest, store)
    if problems:
        return _invalid("invalid", f"checkpoint {name!r} was not committed: the ranks' reports "
                        "do not form a consistent checkpoint", problems), None
    return None, manifest


def _invalid(kind: str, message: str, problems: list) -> dict:
    causes: dict[int, str] = {}
    for ranks, text in problems:
        for r in ranks:
            causes[r] = f"{causes[r]}; {text}" if r in causes else text
    return abort_decision(kind, message, causes)


def discard(tmp: str, rank: int, keep_file: bool, store: Store = LOCAL) -> None:
    """After an abort: each rank removes its own file, rank 0 the whole temporary location
    (:meth:`Publisher.discard`)."""
    publisher_for(store).discard(tmp, rank, keep_file)


def check_files(tmp: str, manifest: dict, store: Store = LOCAL) -> list[tuple[list[int], str]]:
    """Every file the manifest references exists in ``tmp`` with the reported size (a stat
    per file, on the coordinator, just before the rename)."""
    problems = []
    for f in manifest["files"]:
        path = store.join(tmp, f["name"])
        try:
            reader = store.open_read(path)
            size = reader.size
            reader.close()
        except OSError as exc:
            problems.append(([f["rank"]], f"{path}: cannot stat the shard file ({exc})"))
            continue
        if size != f["nbytes"]:
            problems.append(([f["rank"]], f"{path}: {size} bytes on disk, {f['nbytes']} reported"))
    return problems


def committed_save(root: str, name: str, save_id: str,
                   store: Store = LOCAL) -> "CheckpointInfo | None":
    """The committed checkpoint ``root/name`` if its manifest records ``save_id``, else None:
    how a rank learns the verdict from the disk when the coordination store is gone."""
    path = store.join(root, name)
    try:
        manifest = files.read_manifest(path, store)
    except (OSError, CorruptCheckpointError):
        return None
    return info_of(path, manifest) if manifest.save_id == save_id else None


# ---------------------------------------------------------------- visibility

def tmp_dir(root: str, name: str, run_id: str, attempt: int, store: Store = LOCAL) -> str:
    """The temporary location of one save: the same on every rank (name, run id and attempt
    all come from the save's identity), so all ranks write where rank 0 commits
    (:meth:`Publisher.tmp_location`)."""
    return publisher_for(store).tmp_location(root, name, run_id, attempt)


def publish(root: str, tmp: str, name: str, manifest: dict, *, overwrite: bool,
            fsync: bool, store: Store = LOCAL, catalog: Catalog | None = None) -> Published:
    """Make ``tmp`` the committed checkpoint ``root/name`` atomically (:meth:`Publisher.publish`).

    Rank 0 only. Sets ``manifest["seq"]`` to the commit sequence number (one more than the
    highest of the checkpoints committed in ``root``) before the manifest is written, so the
    caller's dict describes the committed checkpoint. ``catalog``: the writer's catalog of
    ``root``, kept between commits, so that numbering the commit reads only the manifests that
    changed since the previous one (without it, every manifest of ``root`` is read); the new
    checkpoint is recorded in it. The manifest is validated once, before it is written.

    CommitError, nothing committed, when the number cannot be decided: a manifest of ``root``
    could not be read (an I/O error, a store that does not answer: the checkpoint it belongs to
    may hold the highest number, which the commit would then reuse).

    When ``root/name`` exists: a committed checkpoint is replaced only with ``overwrite``
    (CheckpointExistsError otherwise, also when another writer committed it meanwhile); a
    damaged one (its ``manifest.json`` does not decode or validate) is replaced whatever
    ``overwrite`` says, its bytes kept -- moved aside to ``.damaged.<name>.<uid>`` on a local
    disk, left to the cleanup of stale data on an object store -- with a WARNING; a local
    directory that is no checkpoint is never replaced (CheckpointExistsError)."""
    catalog = catalog if catalog is not None else Catalog(root, store)
    manifest["seq"] = _next_seq(catalog, name)
    final, stamp, parsed = publisher_for(store).publish(root, tmp, name, manifest, overwrite,
                                                        fsync)
    info = info_of(final, parsed)
    return Published(info, catalog.record(info, stamp, parsed))


def _next_seq(catalog: Catalog, name: str) -> int:
    """One more than the highest commit number of the catalog's root; CommitError if some
    manifest could not be read (see :func:`publish`)."""
    try:
        committed = catalog.scan()
    except StorageError as exc:
        raise CommitError(f"checkpoint {name!r} was not committed: its commit number cannot be "
                          f"decided ({exc})", {0: str(exc)}) from exc
    return max((i.seq for i in committed), default=0) + 1


def set_latest(root: str, name: str, fsync: bool, store: Store = LOCAL) -> None:
    """Point the ``latest`` hint at ``name`` (for people and tools; readers do not need it)."""
    publisher_for(store).write_latest(root, name, fsync)


def latest(root: str, store: Store = LOCAL,
           catalog: Catalog | None = None) -> CheckpointInfo | None:
    """The newest committed checkpoint of ``root`` (highest commit sequence number), or None.

    The ``latest`` file is only a hint written after each commit, for people and tools; it is
    not read here. So a crash between a commit and the update of ``latest`` still resumes from
    the checkpoint just committed, and tagged checkpoints count by when they were committed. To
    roll back, delete the newer checkpoints. ``catalog``: the caller's catalog of ``root``, so that
    only the manifests changed since its last scan are read (without it, every one is)."""
    found = (catalog if catalog is not None else Catalog(root, store)).scan()
    return found[-1] if found else None


def resolve(root: str, step: int | None = None, tag: str | None = None,
            store: Store = LOCAL, catalog: Catalog | None = None) -> CheckpointInfo:
    """Find a committed checkpoint by tag, by step, or the latest (``catalog``: as for
    :func:`latest`). CheckpointNotFoundError when there is none, naming the damaged
    checkpoints found instead."""
    if tag is not None or step is not None:
        name = fmt.check_name(tag) if tag is not None else fmt.step_name(step)
        path = store.join(root, name)
        try:
            return info_of(path, files.read_manifest(path, store))
        except CheckpointNotFoundError:
            if tag is None:
                matches = [i for i in list_checkpoints(root, store) if i.step == step]
                if matches:
                    return matches[-1]
            raise CheckpointNotFoundError(f"no checkpoint {name!r} in {root!r}") from None
    if not publisher_for(store).root_exists(root):
        raise CheckpointNotFoundError(f"no committed checkpoint in {root!r}: the directory does "
                                      "not exist")
    catalog = catalog if catalog is not None else Catalog(root, store)
    found = latest(root, store, catalog)
    if found is None:
        damaged = "".join(f"; {d.name} is damaged ({d.reason})" for d in catalog.damaged())
        raise CheckpointNotFoundError(f"no committed checkpoint in {root!r}{damaged}")
    return found


# ---------------------------------------------------------------- the global plan, checked at commit
# Each returns a list of problems, (ranks involved, text); empty when the reports form a checkpoint.

def check_same_save(reports: dict[int, dict]) -> list[tuple[list[int], str]]:
    """Every report belongs to rank 0's save: same name, step, nonce and overwrite flag."""
    mine = reports[0]
    want = (mine["save"]["name"], mine["save"]["step"], mine["save"]["nonce"],
            bool(mine.get("overwrite")))
    problems = []
    for r, rep in sorted(reports.items()):
        got = (rep["save"]["name"], rep["save"]["step"], rep["save"]["nonce"],
               bool(rep.get("overwrite")))
        if got != want:
            problems.append(([r], f"reported save {got[0]!r} step {got[1]} overwrite={got[3]}, "
                                  f"rank 0 saves {want[0]!r} step {want[1]} overwrite={want[3]}"))
    return problems


def check_tiling(manifest: dict) -> list[tuple[list[int], str]]:
    """The written boxes of every tensor tile its shape exactly: inside it, no two overlapping
    (two ranks writing one box is an error unless one declares itself a replica with
    ``primary=False``), and no element left uncovered."""
    problems = []
    rank_of = [f["rank"] for f in manifest["files"]]
    for e in manifest["entries"]:
        if e["kind"] != "tensor":
            continue
        shape = tuple(e["shape"])
        boxes = [(tuple(s["global_offset"]), tuple(s["shape"]), rank_of[s["file"]])
                 for s in e["shards"]]
        outside = [([r], f"box {_box(off, box)} of {e['key']!r} lies outside its global "
                         f"shape {list(shape)}") for off, box, r in boxes
                   if len(off) != len(shape) or len(box) != len(shape) or
                   any(o < 0 or o + n > g for o, n, g in zip(off, box, shape))]
        if outside:
            problems += outside
            continue
        overlaps = [([a[2], b[2]], f"ranks {a[2]} and {b[2]} both wrote {e['key']!r} boxes "
                     f"{_box(*a[:2])} and {_box(*b[:2])}, which overlap (declare replicas with "
                     "primary=False or replicated=...)") for a, b in _overlapping(boxes)]
        problems += overlaps
        covered = sum(_volume(box) for _, box, _ in boxes)
        if not overlaps and covered != _volume(shape):
            problems.append((sorted({r for *_, r in boxes}), f"the boxes written for "
                             f"{e['key']!r} cover {covered} of its {_volume(shape)} elements "
                             f"(shape {list(shape)}): a gap"))
    return problems


def check_replicas(reports: dict[int, dict]) -> list[tuple[list[int], str]]:
    """Declared replicas hold the same bytes on every rank (``replicas``: key → digest)."""
    seen: dict[str, dict[str, list[int]]] = {}
    for r, rep in sorted(reports.items()):
        for key, digest in (rep.get("replicas") or {}).items():
            seen.setdefault(key, {}).setdefault(str(digest), []).append(r)
    problems = []
    for key, groups in sorted(seen.items()):
        if len(groups) > 1:
            ranks = sorted(r for rs in groups.values() for r in rs)
            shown = "; ".join(f"ranks {rs} hold digest {d}" for d, rs in
                              sorted(groups.items(), key=lambda kv: kv[1]))
            problems.append((ranks, f"replicated tensor {key!r} differs across ranks ({shown})"))
    return problems


def _volume(shape) -> int:
    n = 1
    for x in shape:
        n *= x
    return n


def _box(off, box) -> str:
    return "[" + ", ".join(f"{o}:{o + n}" for o, n in zip(off, box)) + "]"


def _overlapping(boxes: list) -> list[tuple]:
    """Pairs of non-empty boxes that share an element: a sweep along the dimension with the
    most distinct offsets, so row or column shardings cost O(n log n)."""
    boxes = [b for b in boxes if _volume(b[1])]
    if len(boxes) < 2:
        return []
    ndim = len(boxes[0][0])
    if ndim == 0:
        return [(boxes[0], b) for b in boxes[1:]]
    dim = max(range(ndim), key=lambda d: len({b[0][d] for b in boxes}))
    pairs, active = [], []
    for b in sorted(boxes, key=lambda b: b[0][dim]):
        active = [a for a in active if a[0][dim] + a[1][dim] > b[0][dim]]
        for a in active:
            if all(max(a[0][d], b[0][d]) < min(a[0][d] + a[1][d], b[0][d] + b[1][d])
                   for d in range(ndim)):
                pairs.append((a, b))
        active.append(b)
    return pairs

"""The commit protocol on a directory: manifest assembly, atomic visibility, ``latest``, retention,
listing and cleanup of stale temporaries (docs/format.md, "Commit protocol")."""
from __future__ import annotations

import os
import re
import socket
import time
import uuid
import warnings
from dataclasses import dataclass, field
from typing import Any

from . import format as fmt
from .errors import CheckpointNotFoundError, CorruptCheckpointError
from .storage import fsync_dir, remove_tree, write_file_atomic

_OWNER_IN_NAME = re.compile(r"@(\d+)@([^@/]+)-\d+$")
_OWNER_IN_TMP_FILE = re.compile(r"@(\d+)@([^@/]+)$")  # storage.write_file_atomic


@dataclass(frozen=True)
class CheckpointInfo:
    """A committed checkpoint."""

    name: str
    path: str
    step: int | None
    created_unix: float
    world_size: int
    nbytes: int
    metadata: dict = field(default_factory=dict)


# ---------------------------------------------------------------- manifest assembly (pure)

def build_manifest(payloads: list[dict], *, name: str, step: int | None,
                   metadata: dict, save_id: str | None = None) -> dict:
    """Merge every rank's report into one manifest.

    Replicated tensors (same key, declared replicated) become one entry written by their owner;
    shards of one global tensor become one entry with several shards (every written box is kept:
    :func:`check_tiling` rejects overlaps and gaps); anything else stays per rank, so two ranks
    holding different tensors under one key never collapse into one. ``save_id`` (the round's
    nonce) is recorded so that a rank can recognise its own save on disk.
    """
    files, entries, ranks = [], [], []
    grouped: dict[tuple, int] = {}
    for payload in sorted(payloads, key=lambda p: p["rank"]):
        file_id = len(files)
        files.append({"rank": payload["rank"], **payload["file"]})
        local_to_global = []
        for e in payload["entries"]:
            local_to_global.append(_merge_entry(e, file_id, payload["rank"], entries, grouped))
        ranks.append({"rank": payload["rank"], "tree": _remap(payload["tree"], local_to_global)})
    for e in entries:
        if e["kind"] == "tensor" and e.get("replicated") and not e["shards"]:
            raise CorruptCheckpointError(f"replicated tensor {e['key']!r} was written by no rank")
    manifest = {"format": fmt.CHECKPOINT_FORMAT, "version": fmt.VERSION, "name": name,
                "step": step, "created_unix": time.time(), "world_size": len(payloads),
                "metadata": metadata, "files": files, "entries": entries, "ranks": ranks}
    if save_id is not None:
        manifest["save_id"] = save_id
    return manifest


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


# ---------------------------------------------------------------- checks before a commit (pure)
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


def check_files(tmp: str, manifest: dict) -> list[tuple[list[int], str]]:
    """Every file the manifest references exists in ``tmp`` with the reported size (a stat
    per file, on the coordinator, just before the rename)."""
    problems = []
    for f in manifest["files"]:
        path = os.path.join(tmp, f["name"])
        try:
            size = os.stat(path).st_size
        except OSError as exc:
            problems.append(([f["rank"]], f"{path}: cannot stat the shard file ({exc})"))
            continue
        if size != f["nbytes"]:
            problems.append(([f["rank"]], f"{path}: {size} bytes on disk, {f['nbytes']} reported"))
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


def committed_save(root: str, name: str, save_id: str) -> "CheckpointInfo | None":
    """The committed checkpoint ``root/name`` if its manifest records ``save_id``, else None:
    how a rank learns the verdict from the disk when the coordination store is gone."""
    path = os.path.join(root, name)
    try:
        manifest = fmt.read_manifest(path)
    except (OSError, CorruptCheckpointError):
        return None
    return info_of(path, manifest) if manifest.get("save_id") == save_id else None


# ---------------------------------------------------------------- directory operations

def tmp_dir(root: str, name: str, run_id: str, attempt: int) -> str:
    """The temporary directory of one save: the same on every rank (name, run id and attempt
    all come from the save's identity), so all ranks write into the directory rank 0 renames."""
    return os.path.join(root, f".tmp.{name}.{run_id}-{attempt}")


def publish(root: str, tmp: str, name: str, manifest: dict, *, overwrite: bool,
            fsync: bool) -> str:
    """Make ``tmp`` the committed checkpoint ``root/name`` atomically. Returns its path."""
    final = os.path.join(root, name)
    write_file_atomic(os.path.join(tmp, fmt.MANIFEST), fmt.encode_manifest(manifest), fsync)
    old = None
    if os.path.exists(final):
        if not overwrite:
            from .errors import CheckpointExistsError
            raise CheckpointExistsError(f"{final} already exists (committed meanwhile); pass "
                                        "overwrite=True to replace it")
        old = os.path.join(root, f".old.{name}.{uuid.uuid4().hex[:8]}")
        os.rename(final, old)
    os.rename(tmp, final)
    # Committed from here on: later failures are warnings, never a failed save that is listed.
    for step in (lambda: fsync_dir(root) if fsync else None,
                 lambda: remove_tree(old) if old is not None else None):
        try:
            step()
        except FileNotFoundError:
            pass
        except OSError as exc:
            warnings.warn(f"datastates: {final} is committed, but tidying up after the rename "
                          f"failed: {exc}", RuntimeWarning, stacklevel=2)
    return final


def set_latest(root: str, name: str, fsync: bool) -> None:
    write_file_atomic(os.path.join(root, fmt.LATEST), name.encode(), fsync)


def info_of(path: str, manifest: dict) -> CheckpointInfo:
    return CheckpointInfo(name=os.path.basename(path), path=path, step=manifest.get("step"),
                          created_unix=float(manifest.get("created_unix", 0.0)),
                          world_size=int(manifest["world_size"]),
                          nbytes=sum(int(f.get("nbytes", 0)) for f in manifest["files"]),
                          metadata=manifest.get("metadata") or {})


def list_checkpoints(root: str) -> list[CheckpointInfo]:
    """Committed checkpoints in ``root``, oldest first (by step, then creation time)."""
    if not os.path.isdir(root):
        raise CheckpointNotFoundError(f"checkpoint directory {root!r} does not exist")
    found = []
    for name in os.listdir(root):
        path = os.path.join(root, name)
        if name.startswith(".") or not os.path.isfile(os.path.join(path, fmt.MANIFEST)):
            continue
        try:
            found.append(info_of(path, fmt.read_manifest(path)))
        except (CorruptCheckpointError, CheckpointNotFoundError, OSError):
            continue
    return sorted(found, key=_order)


def _order(info: CheckpointInfo):
    return (info.step if info.step is not None else -1, info.created_unix, info.name)


def latest(root: str) -> CheckpointInfo | None:
    """The checkpoint the ``latest`` file names if it is committed, else the newest committed one.

    The file wins over commit times so that a user can roll back by editing it (as with
    DeepSpeed's ``latest``). A crash between a commit and the update of ``latest`` therefore resumes
    from the previous checkpoint; saving that step again then needs ``overwrite=True``."""
    try:
        with open(os.path.join(root, fmt.LATEST), "rb") as f:
            name = f.read().decode("utf-8", "replace").strip()
        path = os.path.join(root, fmt.check_name(name))
        return info_of(path, fmt.read_manifest(path))
    except (OSError, ValueError, CorruptCheckpointError):
        pass
    found = list_checkpoints(root)
    return found[-1] if found else None


def resolve(root: str, step: int | None = None, tag: str | None = None) -> CheckpointInfo:
    """Find a committed checkpoint by tag, by step, or the latest."""
    if tag is not None or step is not None:
        name = fmt.check_name(tag) if tag is not None else fmt.step_name(step)
        path = os.path.join(root, name)
        if not os.path.isdir(path) and tag is None:
            matches = [i for i in list_checkpoints(root) if i.step == step]
            if matches:
                return matches[-1]
        if not os.path.isdir(path):
            raise CheckpointNotFoundError(f"no checkpoint {name!r} in {root!r}")
        return info_of(path, fmt.read_manifest(path))
    if not os.path.isdir(root):
        raise CheckpointNotFoundError(f"checkpoint directory {root!r} does not exist")
    found = latest(root)
    if found is None:
        raise CheckpointNotFoundError(f"no committed checkpoint in {root!r}")
    return found


def delete(root: str, name: str, fsync: bool = True) -> None:
    """Remove a checkpoint atomically: rename it away first, then delete the files."""
    path = os.path.join(root, fmt.check_name(name))
    if not os.path.isdir(path):
        raise CheckpointNotFoundError(f"no checkpoint {name!r} in {root!r}")
    trash = os.path.join(root, f".trash.{name}.{uuid.uuid4().hex[:8]}")
    os.rename(path, trash)
    if fsync:
        fsync_dir(root)
    remove_tree(trash)


def apply_retention(root: str, keep_last: int | None, keep_every: int | None,
                    protect: str, fsync: bool) -> list[str]:
    """Delete committed checkpoints beyond the policy; never ``protect`` or what latest names."""
    if keep_last is None:
        return []
    found = list_checkpoints(root)
    keep = {i.name for i in found[-keep_last:]} | {protect}
    current = latest(root)
    if current is not None:
        keep.add(current.name)
    removed = []
    for info in found:
        if info.name in keep:
            continue
        if keep_every and info.step is not None and info.step % keep_every == 0:
            continue
        delete(root, info.name, fsync)
        removed.append(info.name)
    return removed


def clean_stale(root: str, max_age_s: float) -> list[str]:
    """Remove temporaries left by dead writers: those owned by a dead process on this host, those
    older than ``max_age_s``, and interrupted deletions. Restores a checkpoint whose replacement
    was interrupted between the two renames."""
    removed = []
    now = time.time()
    host = socket.gethostname()
    for name in sorted(os.listdir(root)):
        path = os.path.join(root, name)
        if name.startswith(fmt.LATEST + ".tmp.") and os.path.isfile(path):
            owner = _OWNER_IN_TMP_FILE.search(name)
            if (owner and owner.group(2) == host and not _alive(int(owner.group(1)))) or \
                    now - os.stat(path).st_mtime > max_age_s:
                os.remove(path)
                removed.append(name)
            continue
        if name.startswith(".old."):
            original = os.path.join(root, name[5:].rsplit(".", 1)[0])
            if not os.path.exists(original):
                os.rename(path, original)
                continue
        if not name.startswith((".tmp.", ".trash.", ".old.")) or not os.path.isdir(path):
            continue
        stale = name.startswith((".trash.", ".old."))
        owner = _OWNER_IN_NAME.search(name)  # the run id names the owner: see dist.new_run_id
        if owner and owner.group(2) == host and not _alive(int(owner.group(1))):
            stale = True
        try:
            stale = stale or now - os.stat(path).st_mtime > max_age_s
        except OSError:
            continue
        if stale:
            remove_tree(path)
            removed.append(name)
    return removed


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True

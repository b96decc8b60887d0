"""Living with checkpoints: find them and see inside them.

Behind the ``datastates list|inspect|verify`` commands and the function ``datastates.inspect``.
Everything here reads the format through its manifests (format/records.py validates ours):
nothing is unpickled and no shard byte is read. Getting data out of a checkpoint and bringing data
in (``datastates.export``, ``datastates.import_checkpoint``) live in export.py and importing.py,
which build on this module.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, replace

from ..commit.catalog import resolve
from ..format import codec as fmt
from ..format import files
from ..format import tree
from ..commit.catalog import (
    Catalog,
    CheckpointInfo,
    DamagedCheckpoint,
    human_bytes,
    info_of,
    log_passed_over,
)
from ..errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError, DatastatesError
from ..format.records import TensorEntry
from ..storage import LOCAL, normalize, open_store, read_regular

#: Files that tell another framework's checkpoint apart from an empty folder.
_FOREIGN = (
    ("model.safetensors", "Hugging Face / safetensors"),
    (".safetensors", "safetensors"),
    (".metadata", "torch.distributed.checkpoint"),
    (".ckpt", "Lightning"),
    ("_model_states.pt", "DeepSpeed"),
    (".pt", "torch.save"),
    (".bin", "torch.save"),
)
#: The files of one DeepSpeed tag (``save_dir/global_stepN/<file>``), each a checkpoint here.
_DEEPSPEED_FILE = re.compile(r"(model_states|optim_states)\.pt\Z")
DCP_LAYOUT = "torch.distributed.checkpoint"


# ---------------------------------------------------------------- finding checkpoints


@dataclass(frozen=True)
class Selection:
    """What a path designates: ``checkpoints`` (committed, readable, oldest first; a DCP folder
    is one, with ``metadata["layout"] == "torch.distributed.checkpoint"``), and ``damaged``,
    the directories of the folder that were committed once but whose manifest no longer reads
    or validates (named ``tag/file`` inside a DeepSpeed save folder)."""

    checkpoints: list[CheckpointInfo]
    damaged: list[DamagedCheckpoint]


def find(
    path: str | os.PathLike,
    step: int | None = None,
    tag: str | None = None,
    *,
    every: bool = False,
    storage_options: dict | None = None,
) -> list[CheckpointInfo]:
    """The committed checkpoints ``path`` designates, oldest first (see :func:`select`); never
    empty: CheckpointNotFoundError naming the damaged ones when only those are there."""
    found = select(path, step, tag, every=every, storage_options=storage_options)
    if not found.checkpoints:
        raise CheckpointNotFoundError(
            f"no datastates checkpoint in {normalize(path)} that "
            f"reads{_damaged_hint(found.damaged)}"
        )
    return found.checkpoints


def select(
    path: str | os.PathLike,
    step: int | None = None,
    tag: str | None = None,
    *,
    every: bool = False,
    storage_options: dict | None = None,
) -> Selection:
    """The checkpoints ``path`` designates, and the damaged ones of its folder.

    ``path`` may be: a checkpoint folder; a framework's checkpoint file (``last.ckpt``,
    ``mp_rank_00_model_states.pt``): the checkpoint behind it, ``.datastates/<name>`` in its
    folder; a folder ``DatastatesWriter`` (DCP) wrote; a folder of checkpoints (a
    Checkpointer's directory, a Lightning or HF output folder; for a folder of a framework's
    files, the checkpoints behind them, in its ``.datastates`` folder), where
    ``step``/``tag`` pick one, ``every=True`` takes all, and otherwise the newest committed one
    is meant; a DeepSpeed tag folder (``global_stepN``, whose checkpoints are the files DeepSpeed
    names, ``mp_rank_00_model_states.pt`` ...): all of them, as they make one checkpoint
    together; a DeepSpeed save folder (tag folders and ``latest``): the tag ``latest`` names (or
    the newest), every tag with ``every=True``; or a folder of DCP folders. Raises
    ``CheckpointNotFoundError`` saying what was found instead (a file, an empty folder, another
    framework's files); ``checkpoints`` is empty only when ``damaged`` is not. ``path`` may be
    an object-store URL (``s3://bucket/prefix``; ``storage_options`` as for ``Checkpointer``)."""
    path = normalize(path)
    store = open_store(path, storage_options)
    if store.renames and os.path.isfile(path):
        hidden = os.path.join(os.path.dirname(path), fmt.PATH_FOLDER)
        behind = os.path.join(hidden, os.path.basename(path))
        if not os.path.islink(hidden) and not os.path.islink(behind) and os.path.isdir(behind):
            path = behind  # a framework's file: the checkpoint behind it (no link followed)
    if store.renames and os.path.isfile(path):
        raise CheckpointNotFoundError(
            f"{path} is a file; expected a checkpoint folder or a folder of checkpoints"
        )
    if not store.isdir(path):
        raise CheckpointNotFoundError(
            f"{path} does not exist"
            if store.renames
            else f"no datastates checkpoint in {path} (nothing stored there)"
        )
    if store.isfile(store.join(path, fmt.MANIFEST)):
        return Selection([info_of(path, files.read_manifest(path, store))], [])
    if store.renames and _is_dcp(path):
        return Selection([dcp_info(path)], [])
    if store.renames:
        path = _behind_files(path)
    if step is not None or tag is not None:
        return Selection([resolve(path, step, tag, store)], [])
    catalog = Catalog(path, store)
    found, damaged = catalog.scan(), catalog.damaged()
    if not found and store.renames and not damaged:
        return _select_nested(path, every)
    if not found:
        if damaged:
            return Selection([], damaged)
        raise CheckpointNotFoundError(f"no datastates checkpoint in {path} (nothing stored there)")
    if (
        every
        or _is_tag_folder(found)
        or not (
            store.isfile(store.join(path, fmt.LATEST)) or all(_is_step_name(i.name) for i in found)
        )
    ):
        return Selection(found, damaged)
    log_passed_over(catalog.passed_over(found[-1]), found[-1], f"finding the newest in {path}")
    return Selection([found[-1]], damaged)


def _select_nested(path: str, every: bool) -> Selection:
    """A folder holding no checkpoint itself: a DeepSpeed save folder, or a folder of DCP
    folders."""
    tags, dcps = {}, []
    for name in sorted(os.listdir(path)):
        sub = os.path.join(path, name)
        if name.startswith(".") or not os.path.isdir(sub) or os.path.islink(sub):
            continue
        if _is_dcp(sub):
            dcps.append(_dcp_or_damaged(sub))
            continue
        catalog = Catalog(_behind_files(sub), LOCAL)
        found = catalog.scan()
        if found and _is_tag_folder(found) or catalog.damaged() and not found:
            tags[name] = (
                [replace(i, name=f"{name}/{i.name}") for i in found],
                [replace(d, name=f"{name}/{d.name}") for d in catalog.damaged()],
            )
    good = [d for d in dcps if isinstance(d, CheckpointInfo)]
    damaged = [d for d in dcps if isinstance(d, DamagedCheckpoint)]
    if tags:
        chosen = list(tags) if every else [_latest_tag(path, tags)]
        return Selection(
            [i for t in chosen for i in tags[t][0]] + good,
            damaged + [d for t in chosen for d in tags[t][1]],
        )
    if good or damaged:
        good.sort(key=lambda i: (i.created_unix, i.name))
        return Selection(good if every else good[-1:], damaged)
    raise CheckpointNotFoundError(f"no datastates checkpoint in {path}{_foreign_hint(path)}")


def _behind_files(path: str) -> str:
    """The folder of checkpoints meant by the local folder ``path``: its hidden folder
    ``.datastates``, holding the checkpoints behind a framework's files there (Lightning's
    ``dirpath``, a DeepSpeed tag folder), unless ``path`` holds committed checkpoints itself
    (a Checkpointer's directory, a tag folder of an earlier version)."""
    hidden = os.path.join(path, fmt.PATH_FOLDER)
    if not os.path.isdir(hidden) or os.path.islink(hidden):
        return path
    return path if Catalog(path, LOCAL).scan() else hidden


def _latest_tag(path: str, tags: dict) -> str:
    """The tag DeepSpeed's ``latest`` names, else the one of the highest step in its name (also
    when ``latest`` is no regular file of at most 4 KiB: a link, a FIFO)."""
    try:
        named = (
            read_regular(os.path.join(path, fmt.LATEST), 4096).decode("utf-8", "replace").strip()
        )
    except (OSError, CorruptCheckpointError):
        named = ""
    if named in tags:
        return named
    return max(tags, key=lambda t: (int(m.group()) if (m := re.search(r"\d+", t)) else -1, t))


def _is_tag_folder(found: list[CheckpointInfo]) -> bool:
    """Checkpoints named as DeepSpeed names the files of one tag: together, one checkpoint."""
    return any(_DEEPSPEED_FILE.search(i.name) for i in found)


def dcp_info(path: str) -> CheckpointInfo:
    """The description of a folder ``DatastatesWriter`` wrote (its manifest validated)."""
    from ..dcp.metadata import read_manifest

    files = read_manifest(path)["files"]
    sizes = [os.path.getsize(os.path.join(path, f)) for f in files]
    return CheckpointInfo(
        name=os.path.basename(path),
        path=path,
        step=None,
        created_unix=os.path.getmtime(os.path.join(path, _DCP_MANIFEST)),
        world_size=len(files),
        nbytes=sum(sizes),
        metadata={"layout": DCP_LAYOUT},
    )


def _dcp_or_damaged(path: str) -> CheckpointInfo | DamagedCheckpoint:
    try:
        return dcp_info(path)
    except (DatastatesError, OSError) as exc:
        return DamagedCheckpoint(os.path.basename(path), path, f"{type(exc).__name__}: {exc}")


def is_dcp_info(info: CheckpointInfo) -> bool:
    """Whether ``info`` describes a DCP folder (from :func:`dcp_info`)."""
    return info.metadata.get("layout") == DCP_LAYOUT and os.path.isfile(
        os.path.join(info.path, _DCP_MANIFEST)
    )


def _is_step_name(name: str) -> bool:
    return name.startswith("step-") and name[5:].isdigit()


def _foreign_hint(path: str) -> str:
    try:
        names = os.listdir(path)
    except OSError:
        return ""
    if not names:
        return " (the folder is empty)"
    for suffix, kind in _FOREIGN:
        hits = sorted(n for n in names if n.endswith(suffix))
        if hits and suffix == ".metadata":
            return (
                f" (it holds {kind} files such as {hits[0]!r}: import them with `datastates "
                "import DIR --from dcp --trusted` if you trust where they came from)"
            )
        if hits:
            return f" (it holds {kind} files such as {hits[0]!r}, which datastates does not read)"
    return f" (it holds {len(names)} other entries)"


def _damaged_hint(damaged: list[DamagedCheckpoint]) -> str:
    if not damaged:
        return ""
    return (
        f": {len(damaged)} damaged ("
        + "; ".join(f"{d.name}: {d.reason}" for d in damaged[:3])
        + ")"
    )


# ---------------------------------------------------------------- inspect

#: A list or tuple of more plain values than this is one value of :func:`inspect` (a Python RNG
#: state is 625 ints), not one value per item.
COLLAPSE_ITEMS = 8


def inspect(
    path: str | os.PathLike,
    step: int | None = None,
    tag: str | None = None,
    *,
    keys: list[str] | None = None,
    storage_options: dict | None = None,
) -> dict:
    """A JSON-ready description of one checkpoint: name, step, commit number, format version,
    time, metadata, metrics (``save(metrics=...)``; empty if none), files per rank, and every
    tensor (key, dtype, shape, bytes, shards and the ranks holding them; ``alias_of``: None, or
    for a name tied to another one, as a tied ``head.weight`` is to the embedding, the key whose
    storage it shares, stored once under that key: its ``nbytes`` is 0), object (key, bytes, rank) and plain value of
    rank 0's tree (a list or tuple of more than ``COLLAPSE_ITEMS`` plain
    values is one value, the list). ``keys``: only the entries under these key prefixes.

    ``path`` as for :func:`select`; a folder holding several checkpoints without a latest one
    (a DeepSpeed tag) raises ``ConfigError`` asking for ``step``/``tag`` or a single folder."""
    infos = find(path, step, tag, storage_options=storage_options)
    if len(infos) > 1:
        raise ConfigError(
            f"{path} holds {len(infos)} checkpoints "
            f"({', '.join(i.name for i in infos[:5])}); inspect one of them"
        )
    return describe(infos[0], keys=keys, storage_options=storage_options)


def describe(
    info: CheckpointInfo, *, keys: list[str] | None = None, storage_options: dict | None = None
) -> dict:
    """:func:`inspect`'s description of the checkpoint ``info`` (from :func:`select`)."""
    summary = (
        _describe_dcp(info)
        if is_dcp_info(info)
        else _describe(info, open_store(info.path, storage_options))
    )
    if keys is not None:
        for field in ("tensors", "objects"):
            summary[field] = [e for e in summary[field] if _under(e["key"], keys)]
        summary["values"] = {k: v for k, v in summary["values"].items() if _under(k, keys)}
    return summary


def _describe(info: CheckpointInfo, store) -> dict:
    m = files.read_manifest(info.path, store)
    tensors, objects = [], []
    for e in m.entries.values():
        if isinstance(e, TensorEntry):
            ranks = sorted({m.files[s.file].rank for s in e.shards})
            tensors.append(
                {
                    "key": e.key,
                    "dtype": e.dtype,
                    "shape": list(e.shape),
                    "nbytes": _numel(e.shape) * e.torch_dtype.itemsize,
                    "shards": len(e.shards),
                    "ranks": ranks,
                    "replicated": e.replicated,
                    "rank": e.rank,
                    "alias_of": None,
                }
            )
        else:
            objects.append({"key": e.key, "nbytes": e.nbytes, "rank": m.files[e.file].rank})
    stored = {t["key"]: t for t in tensors}
    for key, index in _aliases(m):
        tensors.append(
            {
                **stored[m.entries[index].key],
                "key": key,
                "nbytes": 0,
                "alias_of": m.entries[index].key,
            }
        )  # it stores nothing of its own
    return {
        "path": info.path,
        "name": m.name,
        "step": m.step,
        "seq": m.seq,
        "format_version": m.version,
        "created_unix": m.created_unix,
        "world_size": m.world_size,
        "metadata": m.metadata,
        "metrics": m.metrics,
        "nbytes": m.nbytes,
        "files": [{"name": f.name, "rank": f.rank, "nbytes": f.nbytes} for f in m.files],
        "tensors": tensors,
        "objects": objects,
        "values": _values(m.ranks[0].tree),
    }


def _aliases(m) -> list[tuple[str, int]]:
    """``(key, entry index)`` of every tensor name of the ranks' trees that reaches an entry
    stored under another key (tied weights: the tree points at the entry saved first)."""
    seen: set[str] = set()
    out = []
    for r in m.ranks:
        for path, node in tree.leaves(r.tree):
            key = tree.key_of(path)
            if node["t"] == "tensor" and key != m.entries[node["e"]].key and key not in seen:
                seen.add(key)
                out.append((key, node["e"]))
    return out


def _under(key: str, prefixes: list[str]) -> bool:
    return any(
        not p.strip("/")
        or key == p.strip("/")
        or key.startswith(p.strip("/") + "/")
        or key.startswith(p.strip("/") + ".")
        for p in prefixes
    )


def _values(root: dict) -> dict:
    """The plain values of a saved tree by key; a long list or tuple of plain values is one."""
    out: dict = {}
    for path, node in tree.leaves(root, whole=_collapsed):
        if node["t"] == "value":
            out[tree.key_of(path)] = node["v"]
        elif node["t"] not in tree.ENTRY_LEAVES:  # a list or tuple, collapsed
            out[tree.key_of(path)] = [c["v"] for c in node["items"]]
    return out


def _collapsed(node: dict) -> bool:
    return (
        node["t"] in tree.SEQUENCES
        and len(node["items"]) > COLLAPSE_ITEMS
        and all(c["t"] == "value" for c in node["items"])
    )


def render_inspect(summary: dict) -> str:
    """The human form of :func:`inspect`'s result: one line per entry, long values cut."""
    s = summary
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(s["created_unix"]))
    stored = [t for t in s["tensors"] if not t.get("alias_of")]
    tied = len(s["tensors"]) - len(stored)
    tensor_bytes = sum(t["nbytes"] for t in stored)
    lines = [
        f"checkpoint  {s['path']}",
        f"name        {s['name']}   step {s['step']}   commit #{s['seq']}   saved {when}",
        f"format      datastates-checkpoint version {s['format_version']}, "
        f"{s['world_size']} rank(s), {human_bytes(s['nbytes'])} in {len(s['files'])} file(s)",
        f"contents    {len(stored)} tensors ({human_bytes(tensor_bytes)})"
        + (f" and {tied} tied name(s) sharing their storage" if tied else "")
        + ", "
        f"{len(s['objects'])} objects, {len(s['values'])} plain values",
    ]
    if s["metadata"]:
        lines.append(f"metadata    {_cut(json.dumps(s['metadata'], sort_keys=True), 200)}")
    if s["metrics"]:
        lines.append(f"metrics     {_cut(render_metrics(s['metrics']), 200)}")
    for f in s["files"]:
        lines.append(f"  rank {f['rank']:<5} {f['name']}  {human_bytes(f['nbytes'])}")
    rows = [("key", "dtype", "shape", "size", "where")]
    for t in s["tensors"]:
        where = (
            f"shares the storage of {t['alias_of']}"
            if t.get("alias_of")
            else "replicated"
            if t["replicated"]
            else f"rank {t['rank']}"
            if t["rank"] is not None
            else f"{t['shards']} shards on ranks {t['ranks']}"
        )
        size = "-" if t.get("alias_of") else human_bytes(t["nbytes"])
        rows.append((t["key"], t["dtype"], str(t["shape"]), size, where))
    for o in s["objects"]:
        rows.append((o["key"], "object", "", human_bytes(o["nbytes"]), f"rank {o['rank']}"))
    for key, value in s["values"].items():
        kind = f"{len(value)} values" if isinstance(value, list) else "value"
        rows.append((key, kind, "", "", _cut(repr(value), 40)))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines.append("")
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def render_metrics(metrics: dict) -> str:
    """``acc=0.9 val_loss=0.31``: the metrics by name, floats to 6 significant digits (the JSON
    of :func:`inspect` keeps them exact)."""
    return " ".join(
        f"{k}={v:.6g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(metrics.items())
    )


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


# ---------------------------------------------------------------- DCP folders

_DCP_MANIFEST = "dcp_manifest.json"  # dcp.metadata.MANIFEST (that module imports DCP)


def _is_dcp(path) -> bool:
    """A folder written by ``datastates.integrations.dcp.DatastatesWriter``."""
    return os.path.isfile(os.path.join(os.fspath(path), _DCP_MANIFEST))


def _describe_dcp(info: CheckpointInfo) -> dict:
    from ..dcp.layer import DatastatesReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    meta = DatastatesReader(info.path).read_metadata()  # JSON, checked: nothing is unpickled
    tensors, objects = [], []
    for key, item in sorted(meta.state_dict_metadata.items()):
        if isinstance(item, TensorStorageMetadata):
            dtype = item.properties.dtype
            tensors.append(
                {
                    "key": key,
                    "dtype": fmt.dtype_name(dtype),
                    "shape": list(item.size),
                    "nbytes": _numel(item.size) * dtype.itemsize,
                    "shards": len(item.chunks),
                    "ranks": [],
                    "replicated": False,
                    "rank": None,
                    "alias_of": None,
                }
            )
        else:
            objects.append({"key": key, "nbytes": 0, "rank": 0})
    files = sorted({d["file"] for d in meta.storage_data.values()})
    sizes = [os.path.getsize(os.path.join(info.path, f)) for f in files]
    return {
        "path": info.path,
        "name": info.name,
        "step": None,
        "seq": 0,
        "format_version": 1,
        "created_unix": info.created_unix,
        "world_size": info.world_size,
        "metadata": {"layout": DCP_LAYOUT},
        "metrics": {},
        "nbytes": sum(sizes),
        "files": [
            {"name": f, "rank": i, "nbytes": n} for i, (f, n) in enumerate(zip(files, sizes))
        ],
        "tensors": tensors,
        "objects": objects,
        "values": {},
    }


# ---------------------------------------------------------------- shared with export.py


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n

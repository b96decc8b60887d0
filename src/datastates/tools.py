"""Living with checkpoints: find them and see inside them.

Behind the ``datastates list|inspect|verify`` commands and the function ``datastates.inspect``.
Everything here reads the format through its manifests (schema.py validates ours): nothing
is unpickled and no shard byte is read. Getting data out of a checkpoint and bringing data in
(``datastates.export``, ``datastates.import_checkpoint``) live in interchange.py, which builds on
this module.
"""
from __future__ import annotations

import json
import os
import time

from . import commit as commit_mod
from . import format as fmt
from .errors import CheckpointNotFoundError, ConfigError
from .schema import TensorEntry
from .store import is_url, normalize, open_store

#: Files that tell another framework's checkpoint apart from an empty folder.
_FOREIGN = (("model.safetensors", "Hugging Face / safetensors"), (".safetensors", "safetensors"),
            (".metadata", "torch.distributed.checkpoint"), (".ckpt", "Lightning"),
            ("_model_states.pt", "DeepSpeed"), (".pt", "torch.save"), (".bin", "torch.save"))


# ---------------------------------------------------------------- finding checkpoints

def find(path: str | os.PathLike, step: int | None = None, tag: str | None = None, *,
         every: bool = False, storage_options: dict | None = None
         ) -> list[commit_mod.CheckpointInfo]:
    """The committed checkpoints ``path`` designates, oldest first.

    ``path`` may be a checkpoint folder itself, or a folder of checkpoints (a Checkpointer's
    directory, a DeepSpeed tag folder, a Lightning checkpoint folder): then ``step``/``tag`` pick
    one, ``every=True`` takes all, and otherwise the newest committed one is taken — or, in a
    folder without a ``latest`` hint whose checkpoints are files of a framework (DeepSpeed's
    ``mp_rank_00_model_states.pt`` ...), all of them. Raises ``CheckpointNotFoundError`` saying what
    was found instead (a file, an empty folder, another framework's files). ``path`` may be an
    object-store URL (``s3://bucket/prefix``; ``storage_options`` as for ``Checkpointer``).
    """
    path = normalize(path)
    store = open_store(path, storage_options)
    if store.renames and os.path.isfile(path):
        raise CheckpointNotFoundError(f"{path} is a file; expected a checkpoint folder or a folder "
                                      "of checkpoints")
    if not store.isdir(path):
        raise CheckpointNotFoundError(f"{path} does not exist" if store.renames else
                                      f"no datastates checkpoint in {path} (nothing stored there)")
    if store.isfile(store.join(path, fmt.MANIFEST)):
        return [commit_mod.info_of(path, fmt.read_manifest(path, store))]
    if step is not None or tag is not None:
        return [commit_mod.resolve(path, step, tag, store)]
    found = commit_mod.list_checkpoints(path, store)
    if not found:
        hint = _foreign_hint(path) if store.renames else ""
        raise CheckpointNotFoundError(f"no datastates checkpoint in {path}{hint}")
    if every or not (store.isfile(store.join(path, fmt.LATEST)) or
                     all(_is_step_name(i.name) for i in found)):
        return found
    return [found[-1]]


def is_single(path: str | os.PathLike) -> bool:
    """Whether ``path`` designates one checkpoint by itself: a checkpoint folder, a DCP folder,
    or a folder of checkpoints whose newest is the one meant (see :func:`find`)."""
    if not is_url(os.fspath(path)) and (_is_dcp(path) or not os.path.isdir(path)):
        return True
    return len(find(path)) == 1


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
        if hits:
            return f" (it holds {kind} files such as {hits[0]!r}, which datastates does not read)"
    return f" (it holds {len(names)} other entries)"


# ---------------------------------------------------------------- inspect

def inspect(path: str | os.PathLike, step: int | None = None, tag: str | None = None, *,
            storage_options: dict | None = None) -> dict:
    """A JSON-ready description of one checkpoint: name, step, commit number, format version,
    time, metadata, files per rank, and every tensor (key, dtype, shape, bytes, shards and the
    ranks holding them), object (key, bytes, rank) and plain value of rank 0's tree.

    ``path`` as for :func:`find`; a folder holding several checkpoints without a latest one
    (a DeepSpeed tag) raises ``ConfigError`` asking for ``step``/``tag`` or a single folder."""
    if not is_url(os.fspath(path)) and _is_dcp(path):
        return _inspect_dcp(os.path.abspath(os.fspath(path)))
    infos = find(path, step, tag, storage_options=storage_options)
    if len(infos) > 1:
        raise ConfigError(f"{path} holds {len(infos)} checkpoints "
                          f"({', '.join(i.name for i in infos[:5])}); inspect one of them")
    info = infos[0]
    m = fmt.read_manifest(info.path, open_store(info.path, storage_options))
    tensors, objects = [], []
    for e in m.entries:
        if isinstance(e, TensorEntry):
            ranks = sorted({m.files[s.file].rank for s in e.shards})
            tensors.append({"key": e.key, "dtype": e.dtype, "shape": list(e.shape),
                            "nbytes": _numel(e.shape) * e.torch_dtype.itemsize,
                            "shards": len(e.shards), "ranks": ranks,
                            "replicated": e.replicated, "rank": e.rank})
        else:
            objects.append({"key": e.key, "nbytes": e.nbytes, "rank": m.files[e.file].rank})
    return {"path": info.path, "name": m.name, "step": m.step, "seq": m.seq,
            "format_version": m.version, "created_unix": m.created_unix,
            "world_size": m.world_size, "metadata": m.metadata, "nbytes": m.nbytes,
            "files": [{"name": f.name, "rank": f.rank, "nbytes": f.nbytes} for f in m.files],
            "tensors": tensors, "objects": objects, "values": _values(m.ranks[0].tree, ())}


def _values(node: dict, path: tuple) -> dict:
    t = node["t"]
    if t == "value":
        return {_key(path): node["v"]}
    out: dict = {}
    if t == "provider":
        return _values(node["state"], path)
    if t in ("dict", "odict"):
        for k, child in node["items"]:
            out.update(_values(child, path + (k,)))
    elif t in ("list", "tuple"):
        for i, child in enumerate(node["items"]):
            out.update(_values(child, path + (i,)))
    return out


def render_inspect(summary: dict) -> str:
    """The human form of :func:`inspect`'s result."""
    s = summary
    when = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(s["created_unix"]))
    tensor_bytes = sum(t["nbytes"] for t in s["tensors"])
    lines = [f"checkpoint  {s['path']}",
             f"name        {s['name']}   step {s['step']}   commit #{s['seq']}   saved {when}",
             f"format      datastates-checkpoint version {s['format_version']}, "
             f"{s['world_size']} rank(s), {human_bytes(s['nbytes'])} in {len(s['files'])} file(s)",
             f"contents    {len(s['tensors'])} tensors ({human_bytes(tensor_bytes)}), "
             f"{len(s['objects'])} objects, {len(s['values'])} plain values"]
    if s["metadata"]:
        lines.append(f"metadata    {json.dumps(s['metadata'], sort_keys=True)}")
    for f in s["files"]:
        lines.append(f"  rank {f['rank']:<5} {f['name']}  {human_bytes(f['nbytes'])}")
    rows = [("key", "dtype", "shape", "size", "where")]
    for t in s["tensors"]:
        where = ("replicated" if t["replicated"] else
                 f"rank {t['rank']}" if t["rank"] is not None else
                 f"{t['shards']} shards on ranks {t['ranks']}")
        rows.append((t["key"], t["dtype"], str(t["shape"]), human_bytes(t["nbytes"]), where))
    for o in s["objects"]:
        rows.append((o["key"], "object", "", human_bytes(o["nbytes"]), f"rank {o['rank']}"))
    for key, value in s["values"].items():
        rows.append((key, "value", "", "", repr(value)[:40]))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines.append("")
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    return "\n".join(lines)


def human_bytes(n: int) -> str:
    """``1536`` → ``"1.5 KiB"``."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} B" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{n} B"


# ---------------------------------------------------------------- DCP folders

_DCP_MANIFEST = "dcp_manifest.json"  # integrations.dcp.MANIFEST (that module needs DCP imported)


def _is_dcp(path) -> bool:
    """A folder written by ``datastates.integrations.dcp.DatastatesWriter``."""
    return os.path.isfile(os.path.join(os.fspath(path), _DCP_MANIFEST))


def _inspect_dcp(path: str) -> dict:
    from .integrations.dcp import DatastatesReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata
    meta = DatastatesReader(path).read_metadata()
    tensors, objects = [], []
    for key, item in sorted(meta.state_dict_metadata.items()):
        if isinstance(item, TensorStorageMetadata):
            dtype = item.properties.dtype
            tensors.append({"key": key, "dtype": fmt.dtype_name(dtype), "shape": list(item.size),
                            "nbytes": _numel(item.size) * dtype.itemsize,
                            "shards": len(item.chunks), "ranks": [], "replicated": False,
                            "rank": None})
        else:
            objects.append({"key": key, "nbytes": 0, "rank": 0})
    files = sorted({d["file"] for d in meta.storage_data.values()})
    sizes = [os.path.getsize(os.path.join(path, f)) for f in files]
    return {"path": path, "name": os.path.basename(path), "step": None, "seq": 0,
            "format_version": 1, "created_unix": os.path.getmtime(os.path.join(path, _DCP_MANIFEST)),
            "world_size": len(files), "metadata": {"layout": "torch.distributed.checkpoint"},
            "nbytes": sum(sizes),
            "files": [{"name": f, "rank": i, "nbytes": n} for i, (f, n) in
                      enumerate(zip(files, sizes))],
            "tensors": tensors, "objects": objects, "values": {}}


# ---------------------------------------------------------------- shared with interchange.py

def _key(path: tuple) -> str:
    return "/".join(str(p) for p in path)


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


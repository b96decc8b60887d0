"""Getting data out of a checkpoint: export to a ``torch.save`` file, a safetensors file or a
Hugging Face model folder (bringing data in, ``import_checkpoint``, lives in importing.py and is
re-exported here).

Behind the ``datastates export|import`` commands and the functions ``datastates.export`` and
``datastates.import_checkpoint``. It is its own module, apart from describe.py (finding checkpoints
and describing them from their manifests), because converting is a different job: it reads and
verifies the shard bytes, may load Python objects, writes files of other formats atomically and
saves through a ``Checkpointer``. It builds on describe.py (which checkpoint a path designates,
whether a folder is a DCP one) and describe.py never imports it at load time, so the dependency
points one way. The bytes are read through restore's ``Reader``, the one read path of the
library: the same shard file paths (the manifest's ``data_dir`` included), file and region checks,
checksum verification and object loading as a restore. Nothing is unpickled unless the caller
says the checkpoint is trusted, and Python objects are only loaded when an export needs them.
Exports stream: tensors are memory-mapped views of the shard files (``OpenCheckpoint.mapped``),
verified piece by piece and written one after the other, so a state larger than RAM exports with
bounded memory.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import stat
import time
import uuid
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from ..format import codec as fmt
from ..format import files
from ..format import tree
from ..errors import CheckpointExistsError, CheckpointNotFoundError, ConfigError
from ..commit.catalog import CheckpointInfo
from ..providers import ProviderRegistry
from ..format.records import Manifest, ShardRef, TensorEntry
from ..storage.posix import buffer_of, fsync_dir
from ..storage.store import is_url
from .importing import import_checkpoint
from .describe import _numel, describe, find, is_dcp_info
from ..restore.reader import Reader

__all__ = ["ExportReport", "export", "import_checkpoint", "planned_bytes"]

log = logging.getLogger("datastates.tools.export")


# ---------------------------------------------------------------- export


@dataclass(frozen=True)
class ExportReport:
    """What :func:`export` wrote."""

    path: str  #: the file written
    fmt: str  #: "torch" or "safetensors"
    tensors: int  #: tensors written (tied tensors once)
    nbytes: int  #: tensor bytes written
    seconds: float
    skipped: tuple = ()  #: keys not written (safetensors holds tensors only)
    aliases: dict | None = None  #: safetensors: dropped name -> the name holding the same tensor
    #: hf: (file name, why) of the checkpoint's entries not copied (links, special files)
    refused: tuple = ()


def export(
    path: str | os.PathLike,
    out: str | os.PathLike,
    to: str = "torch",
    *,
    keys: Iterable[str] | None = None,
    step: int | None = None,
    tag: str | None = None,
    trusted: bool = False,
    registry: ProviderRegistry | None = None,
    progress: Callable[[int], None] | None = None,
) -> ExportReport:
    """Write rank 0's view of a checkpoint to one file of another format, atomically.

    ``to="torch"``: a ``torch.save`` file of the structure ``Checkpointer.load`` returns (modules
    and optimizers as their state dicts), loadable with ``torch.load(weights_only=True)`` when the
    checkpoint holds no other Python objects; tied tensors stay tied. ``to="safetensors"``: the
    tensors only, named by their keys (relative to the single prefix when exactly one is given in
    ``keys``, so ``keys=["model"]`` gives the model's own state-dict names); a tensor reached under
    several keys is written once under the first, the others listed in the file's metadata under
    ``"datastates.aliases"`` (as ``safetensors.torch.save_model`` drops tied names).
    ``to="hf"``: ``out`` is a new folder holding ``model.safetensors`` (the ``model`` key) and the
    ``config.json``/tokenizer files that the HF integration keeps in ``checkpoint-N``, so
    ``from_pretrained(out)`` loads it.

    Every tensor is checksummed as it is read; a mismatch raises ``CorruptCheckpointError`` and
    leaves no output file. Objects load safely unless ``trusted=True``. ``progress`` is called with
    the bytes of each tensor written. Memory: the shard files are memory-mapped and each tensor is
    written from the mapping, so memory stays bounded by the page cache, not the state size
    (sharded tensors are assembled one at a time).
    """
    if to not in ("torch", "safetensors", "hf"):
        raise ConfigError(f"export: expected to='torch', 'safetensors' or 'hf', found {to!r}")
    if is_url(os.fspath(path)):
        raise ConfigError(
            f"export reads local checkpoints (it memory-maps the shard files); "
            f"{path} is in an object store: load it with Checkpointer(...).load() "
            "or copy the checkpoint folder to a local disk first"
        )
    info = _one(path, step, tag)
    if is_dcp_info(info):
        return _export_dcp(info.path, out, to, trusted)
    prefixes = tree.prefixes(keys)
    if to == "hf":
        return _export_hf(info.path, out, trusted, registry, progress)
    t0 = time.perf_counter()
    with _MappedCheckpoint(
        info.path, trusted, registry or ProviderRegistry.default(), progress
    ) as ckpt:
        if to == "safetensors":
            _check_safetensors_dtypes(ckpt, prefixes)
        state = ckpt.build(prefixes, load_objects=to == "torch")
        out = os.path.abspath(os.fspath(out))
        if to == "torch":
            _write_atomic(out, lambda f: torch.save(state, f))
            skipped: list = []
            aliases = None
        else:
            skipped, aliases = _write_safetensors(out, ckpt, prefixes)
        return ExportReport(
            out,
            to,
            len(ckpt.tensors),
            ckpt.nbytes,
            time.perf_counter() - t0,
            tuple(skipped),
            aliases,
        )


def _one(path, step: int | None, tag: str | None) -> CheckpointInfo:
    """The single checkpoint ``path`` designates (ConfigError naming them if several)."""
    infos = find(path, step, tag)
    if len(infos) != 1:
        raise ConfigError(
            f"{path} holds {len(infos)} checkpoints "
            f"({', '.join(i.name for i in infos[:5])}); export one of them "
            "(--tag NAME, or the folder of one)"
        )
    return infos[0]


def planned_bytes(
    path: str | os.PathLike,
    to: str = "torch",
    *,
    keys: Iterable[str] | None = None,
    step: int | None = None,
    tag: str | None = None,
) -> int:
    """The tensor bytes :func:`export` with the same arguments will write (what its
    ``progress`` calls add up to), from the manifest alone: the total of a progress bar."""
    info = _one(path, step, tag)
    if is_dcp_info(info):
        summary = describe(info)
        return sum(t["nbytes"] for t in summary["tensors"])
    prefixes = ["model"] if to == "hf" else tree.prefixes(keys)
    manifest = files.read_manifest(info.path)
    return sum(
        _numel(e.shape) * e.torch_dtype.itemsize
        for e in (_tensor(manifest, i) for i in _tensor_indexes(manifest.ranks[0].tree, prefixes))
    )


def _tensor(manifest: Manifest, i: int) -> TensorEntry:
    """Entry ``i`` of ``manifest``, which a tree's tensor node refers to (the parser checked
    that it is a tensor entry)."""
    entry = manifest.entries[i]
    assert isinstance(entry, TensorEntry), f"entry {i} is referred to as a tensor"
    return entry


def _tensor_indexes(root: dict, prefixes: list[str] | None) -> set[int]:
    """The entry indexes of the tensors within ``prefixes`` (None: all)."""
    return {node["e"] for _, node in tree.leaves(root, prefixes) if node["t"] == "tensor"}


def _export_hf(ckpt_dir: str, out, trusted: bool, registry, progress) -> ExportReport:
    """A Hugging Face model folder: ``model.safetensors`` of the ``model`` key plus the config
    and tokenizer files the HF integration keeps next to the checkpoint; made in a temporary
    folder and renamed into place."""
    if not os.path.isfile(os.path.join(ckpt_dir, "config.json")):
        raise ConfigError(
            f"{ckpt_dir} has no config.json: only checkpoints written by "
            "datastates.integrations.hf.DatastatesTrainer export to an HF folder; "
            "use to='safetensors' with keys=['model'] for the weights alone"
        )
    out = os.path.abspath(os.fspath(out))
    if os.path.exists(out):
        raise CheckpointExistsError(f"export: {out} already exists")
    parent = os.path.dirname(out)
    tmp = os.path.join(parent, f".{os.path.basename(out)}.tmp.{uuid.uuid4().hex[:8]}")
    os.makedirs(tmp)
    try:
        report = export(
            ckpt_dir,
            os.path.join(tmp, "model.safetensors"),
            "safetensors",
            keys=["model"],
            trusted=trusted,
            registry=registry,
            progress=progress,
        )
        refused = _copy_model_files(ckpt_dir, tmp)
        os.rename(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(parent)
    return dataclasses.replace(report, path=out, fmt="hf", refused=refused)


_NOT_MODEL_FILES = (fmt.MANIFEST, "trainer_state.json")


def _copy_model_files(ckpt_dir: str, dest: str) -> tuple:
    """Copy the config and tokenizer files of ``ckpt_dir`` into ``dest``: regular files only,
    opened without following a link, so nothing outside the checkpoint (a ``tokenizer.json``
    linked to a private key) lands in a folder meant for upload. Returns ``(name, why)`` of
    each entry left out, each also logged as a WARNING."""
    refused = []
    for name in sorted(os.listdir(ckpt_dir)):
        if name in _NOT_MODEL_FILES or name.endswith(".dsf") or fmt.PART_NAME.fullmatch(name):
            continue
        src = os.path.join(ckpt_dir, name)
        try:
            fd = os.open(src, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            why = "a symbolic link" if os.path.islink(src) else f"not readable ({exc.strerror})"
            refused.append((name, why))
            continue
        with os.fdopen(fd, "rb") as f:
            st = os.fstat(f.fileno())
            if not stat.S_ISREG(st.st_mode):
                if not stat.S_ISDIR(st.st_mode):
                    refused.append((name, "not a regular file"))
                continue
            with open(os.path.join(dest, name), "xb") as g:
                shutil.copyfileobj(f, g)
    for name, why in refused:
        log.warning("export: %s/%s is %s: not copied to the HF folder", ckpt_dir, name, why)
    return tuple(refused)


def _export_dcp(path: str, out, to: str, trusted: bool) -> ExportReport:
    """What DCP's ``dcp_to_torch_save`` does, for a folder our DCP writer wrote: every key of the
    DCP state dict, full tensors, one ``torch.save`` file; its values loaded with
    ``weights_only=True`` unless ``trusted``."""
    if to != "torch":
        raise ConfigError(f"export: a DCP folder exports to='torch' only, found {to!r}")
    from ..dcp.folders import load_state

    t0 = time.perf_counter()
    state = load_state(path, trusted=trusted)
    out = os.path.abspath(os.fspath(out))
    _write_atomic(out, lambda f: torch.save(state, f))
    tensors = _tensors_in(state)
    return ExportReport(
        out,
        "torch",
        len(tensors),
        sum(t.numel() * t.element_size() for t in tensors),
        time.perf_counter() - t0,
    )


class _MappedCheckpoint:
    """Tensors of one checkpoint as verified views of its memory-mapped shard files, read
    through restore's ``Reader``: the same file paths (the manifest's ``data_dir`` included),
    the same checks of each file and region, and the same checksum verification and object
    loading as a restore."""

    def __init__(
        self,
        ckpt_dir: str,
        trusted: bool,
        registry: ProviderRegistry,
        progress: Callable[[int], None] | None,
    ):
        self.dir, self.registry, self.progress = ckpt_dir, registry, progress
        self.reader = Reader(ckpt_dir, registry=registry, trusted=trusted)
        self.manifest: Manifest = self.reader.manifest
        #: entry index -> (first key, tensor); keys in the order the tree reaches them
        self.tensors: dict[int, tuple[str, torch.Tensor]] = {}
        self.named: list[tuple[str, int]] = []
        #: keys of plain values and objects (what a tensors-only format leaves out)
        self.skipped: list[str] = []
        self.nbytes = 0
        self.load_objects = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.tensors.clear()
        self.reader.__exit__(*exc)  # closes the files and their mappings

    def build(self, prefixes: list[str] | None, load_objects: bool) -> Any:
        """The saved structure (restricted to ``prefixes``) with tensors as mapped views."""
        self.load_objects = load_objects
        return tree.build(
            self.manifest.ranks[0].tree, self._leaf, provider=self._rebuild, wanted=prefixes
        )

    def _leaf(self, path: tuple, node: dict) -> Any:
        if node["t"] == "tensor":
            return self._tensor(node["e"], tree.key_of(path))
        self.skipped.append(tree.key_of(path))
        if node["t"] == "value":
            return node["v"]
        if not self.load_objects:  # never unpickled when the export has no use for it
            return None
        return self.reader.checkpoint.read_object(self.manifest.entries[node["e"]])

    def _rebuild(self, path: tuple, node: dict, state: Any) -> Any:
        provider = self.registry.get(node["name"])
        return provider.rebuild(state) if provider is not None else state

    def _tensor(self, index: int, key: str) -> torch.Tensor:
        self.named.append((key, index))
        if index in self.tensors:
            return self.tensors[index][1]
        entry = self.manifest.entries[index]
        assert isinstance(entry, TensorEntry)
        dtype = entry.torch_dtype
        whole = [s for s in entry.shards if s.shape == entry.shape]
        if whole:  # one stored box is the whole tensor: a view of the mapping, nothing copied
            tensor = self._view(whole[0], dtype, key)
        else:
            tensor = torch.empty(entry.shape, dtype=dtype)
            for s in entry.shards:
                box = tensor
                for dim, (off, size) in enumerate(zip(s.global_offset, s.shape)):
                    box = box.narrow(dim, off, size)
                box.copy_(self._view(s, dtype, key))
        self.tensors[index] = (key, tensor)
        self.nbytes += tensor.numel() * tensor.element_size()
        if self.progress is not None:
            self.progress(tensor.numel() * tensor.element_size())
        return tensor

    def _view(self, shard: ShardRef, dtype: torch.dtype, key: str) -> torch.Tensor:
        if _numel(shard.shape) == 0:
            return torch.empty(shard.shape, dtype=dtype)
        raw = self.reader.checkpoint.mapped(
            shard.file, shard.offset, shard.nbytes, shard.checksums, key
        )
        return raw.view(dtype).reshape(shard.shape)


def _write_safetensors(out: str, ckpt: _MappedCheckpoint, prefixes) -> tuple[list, dict]:
    """The safetensors layout (8-byte little-endian header length, JSON header, raw data),
    written tensor by tensor from the mappings."""
    strip = prefixes[0] + "/" if prefixes is not None and len(prefixes) == 1 and prefixes[0] else ""
    names: dict[int, str] = {}
    aliases: dict[str, str] = {}
    for key, index in ckpt.named:
        name = key[len(strip) :] if strip and key.startswith(strip) else key
        if index in names:
            aliases[name] = names[index]
        else:
            names[index] = name
    header: dict[str, Any] = {}
    pos = 0
    for index, name in names.items():
        t = ckpt.tensors[index][1]
        n = t.numel() * t.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[t.dtype],
            "shape": list(t.shape),
            "data_offsets": [pos, pos + n],
        }
        pos += n
    meta = {"format": "pt", "datastates.source": os.path.basename(ckpt.dir)}
    if aliases:
        meta["datastates.aliases"] = json.dumps(aliases, sort_keys=True)
    header["__metadata__"] = meta
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)

    def write(f) -> None:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for index in names:
            t = ckpt.tensors[index][1]
            if t.numel():
                f.write(buffer_of(t.contiguous()))

    _write_atomic(out, write)
    return list(ckpt.skipped), aliases


def _check_safetensors_dtypes(ckpt: "_MappedCheckpoint", prefixes) -> None:
    """ConfigError naming the first tensor whose dtype safetensors cannot hold, before any
    byte is read or written."""
    for i in sorted(_tensor_indexes(ckpt.manifest.ranks[0].tree, prefixes)):
        entry = _tensor(ckpt.manifest, i)
        if entry.torch_dtype not in _SAFETENSORS_DTYPES:
            raise ConfigError(
                f"export: tensor {entry.key!r} is {entry.dtype}, which safetensors "
                f"cannot hold (it holds {', '.join(sorted(_ST_NAMES))}); export "
                "to torch, or leave the key out with --keys"
            )


_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
    torch.complex64: "C64",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.uint16: "U16",
    torch.uint32: "U32",
    torch.uint64: "U64",
}
_ST_NAMES = {str(d).removeprefix("torch.") for d in _SAFETENSORS_DTYPES}


def _write_atomic(out: str, write: Callable[[Any], None]) -> None:
    """Write ``out`` through a temporary next to it, fsync, rename, fsync the folder."""
    folder = os.path.dirname(out) or "."
    if not os.path.isdir(folder):
        raise CheckpointNotFoundError(f"cannot write {out}: folder {folder} does not exist")
    tmp = os.path.join(folder, f".{os.path.basename(out)}.tmp.{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, out)
    except BaseException:
        try:
            os.remove(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(folder)


def _tensors_in(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors_in(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors_in(v)]
    return []

"""Restore: parallel, coalesced reads straight into the live tensors (or into new ones).

``Reader`` plans every read first (matching the checkpoint tree against the live state through
the providers), validates everything — a strict mismatch raises before one byte of live state is
touched — then reads with a thread pool, verifies checksums and lets providers apply the result.
"""
from __future__ import annotations

import os
import sys
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Iterable

import torch

from . import format as fmt
from . import serialization
from .format import ShardHeader
from .schema import Manifest, ObjectEntry, ShardRef, TensorEntry
from .errors import (CheckpointNotFoundError, ConfigError, CorruptCheckpointError,
                     ReshardError, StateMismatchError)
from .flatten import NUMPY_DTYPES, TensorShard, key_of, sharding_of
from .planning import RANK_POLICIES, per_rank_keys
from .providers import Capture, ProviderRegistry, StateProvider
from .reads import coalesce, group_limit, read_run
from .store import ReadFile, Store, open_store



@dataclass
class RestoreReport:
    """What an in-place restore did. On a strict restore the lists other than ``restored`` are
    empty (a mismatch raises instead)."""

    name: str
    step: int | None
    restored: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)      #: in the live state, not in the checkpoint
    unexpected: list[str] = field(default_factory=list)   #: in the checkpoint, not in the live state
    #: shape, dtype, type or length differs, or a provider's check refused it (skipped)
    mismatched: list[str] = field(default_factory=list)
    nbytes: int = 0


@dataclass
class _Read:
    file: int
    offset: int
    nbytes: int
    dest: torch.Tensor        # flat uint8 CPU tensor receiving the bytes
    checksums: list           # [[length, crc], ...] over [offset, offset + nbytes)
    key: str


class _Files:
    """The shard files of a checkpoint: their sizes checked against the manifest at once, each
    opened on demand with its header validated against the manifest once."""

    def __init__(self, ckpt_dir: str, manifest: Manifest, store: Store):
        self.dir, self.manifest, self.store = ckpt_dir, manifest, store
        #: where the shard files are: the checkpoint directory, or its data directory
        self.data = store.join(ckpt_dir, manifest.data_dir) if manifest.data_dir else ckpt_dir
        self._opened: dict[int, ReadFile] = {}
        self._checked: dict[int, tuple[ReadFile, ShardHeader]] = {}
        self._lock = threading.Lock()
        try:
            for file_id in range(len(manifest.files)):
                self._check_size(file_id)
        except BaseException:
            self.close()
            raise

    def path(self, file_id: int) -> str:
        return self.store.join(self.data, self.manifest.files[file_id].name)

    def _check_size(self, file_id: int) -> None:
        """Before anything is allocated from the manifest's sizes: the file is there and has the
        size the manifest records (which bounds every region in it). The file stays open."""
        path = self.path(file_id)
        try:
            f = self.store.open_read(path)
        except FileNotFoundError:
            raise CheckpointNotFoundError(f"{path}: shard file listed in the manifest is "
                                          "missing") from None
        except OSError as exc:
            raise CorruptCheckpointError(f"{path}: cannot open the shard file ({exc})") from None
        self._opened[file_id] = f
        if f.size != self.manifest.files[file_id].nbytes:
            raise CorruptCheckpointError(f"{path}: {f.size} bytes, the manifest records "
                                         f"{self.manifest.files[file_id].nbytes} (truncated or "
                                         "replaced?)")

    def open(self, file_id: int) -> tuple[ReadFile, int]:
        """(file, index offset) of a validated file."""
        f, header = self.open_with_header(file_id)
        return f, header.index_offset

    def open_with_header(self, file_id: int) -> tuple[ReadFile, ShardHeader]:
        """(file, header) of a file whose header agrees with the manifest: same index CRC, index
        4096-aligned and last in the file, every region the manifest names before the index."""
        with self._lock:
            if file_id not in self._checked:
                f = self._opened[file_id]
                self._checked[file_id] = (f, self._check_header(f, file_id, self.path(file_id)))
            return self._checked[file_id]

    def _check_header(self, f: ReadFile, file_id: int, path: str) -> ShardHeader:
        ref = self.manifest.files[file_id]
        size = f.size
        header = fmt.read_header(f, path, size)
        if header.index_crc32 != ref.index_crc32:
            raise CorruptCheckpointError(f"{path}: index checksum {header.index_crc32} differs "
                                         f"from the manifest's {ref.index_crc32} (file replaced?)")
        if header.index_offset % fmt.UNIT_ALIGN or \
                header.index_offset + header.index_length != size or size != ref.nbytes:
            raise CorruptCheckpointError(
                f"{path}: index at [{header.index_offset}, "
                f"{header.index_offset + header.index_length}) is not the 4096-aligned end of "
                f"the file of {size} bytes (the manifest records {ref.nbytes})")
        for offset, nbytes, key in self.manifest.regions(file_id):
            if offset + nbytes > header.index_offset:
                raise CorruptCheckpointError(f"{path}: {key!r} at [{offset}, {offset + nbytes}) "
                                             f"extends past the data ending at "
                                             f"{header.index_offset}")
        return header

    def close(self) -> None:
        with self._lock:
            for f in self._opened.values():
                f.close()
            self._opened.clear()
            self._checked.clear()


def check_rank_policy(rank_policy) -> None:
    """Raise ConfigError unless ``rank_policy`` is one of RANK_POLICIES."""
    if not isinstance(rank_policy, str) or rank_policy not in RANK_POLICIES:
        raise ConfigError(f"rank_policy must be one of {', '.join(map(repr, RANK_POLICIES))}; "
                          f"found {rank_policy!r}")


class Reader:
    """Reads one committed checkpoint. Use as a context manager (it owns file descriptors).
    ``manifest``: its validated manifest when the caller already holds it (else it is read)."""

    def __init__(self, ckpt_dir: str, *, registry: ProviderRegistry, rank: int = 0,
                 world_size: int = 1, threads: int = 4, verify: bool = True,
                 trusted: bool = False, safe_globals: Iterable[Any] = (),
                 map_location: Any = None, rank_policy: str = "strict",
                 store: Store | None = None, manifest: Manifest | None = None):
        check_rank_policy(rank_policy)
        self.dir = ckpt_dir
        self.store = store or open_store(ckpt_dir)
        self.manifest = manifest if manifest is not None else fmt.read_manifest(ckpt_dir,
                                                                               self.store)
        self.registry, self.verify, self.threads = registry, verify, threads
        self.trusted, self.safe_globals = trusted, list(safe_globals)
        self.map_location = map_location
        self.rank, self.world_size = rank, world_size
        self.rank_policy = rank_policy
        self.files = _Files(ckpt_dir, self.manifest, self.store)
        self.entries = self.manifest.entries

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.files.close()

    # ------------------------------------------------------------ tree selection
    def _tree_for(self, keys=None) -> dict:
        """The saved tree this rank restores. At another world size, state that differs between
        the saved ranks (values, objects, per-rank tensors) among the requested ``keys`` cannot be
        mapped silently: ReshardError unless ``rank_policy`` says how (see RANK_POLICIES)."""
        saved, rank = self.manifest.world_size, self.rank
        trees = {r.rank: r.tree for r in self.manifest.ranks}
        if saved == self.world_size:
            return trees[rank]
        if self.rank_policy == "rank0":
            return trees[0]
        if self.rank_policy == "strict" and saved > 1:
            wanted = None if keys is None else [k.strip("/") for k in
                                                ([keys] if isinstance(keys, str) else keys)]
            per_rank = per_rank_keys([trees[r] for r in sorted(trees)], self.entries, wanted)
            if per_rank:
                shown = ", ".join(per_rank[:10]) + (f" ... ({len(per_rank)} keys in all)"
                                                    if len(per_rank) > 10 else "")
                raise ReshardError(
                    f"{self.dir}: saved by {saved} ranks, loading on {self.world_size} (this is "
                    f"rank {rank}); per-rank state differs between the saved ranks and cannot be "
                    f"remapped ({shown}). Pass rank_policy='rank0' to give every rank rank 0's "
                    "per-rank state, 'same' to map rank r to saved rank r where it exists, or "
                    "keys=[...] to restore only global state")
        return trees[rank if rank < saved else 0]

    # ------------------------------------------------------------ public operations
    def restore_into(self, state: Any, *, keys=None, strict: bool = True) -> RestoreReport:
        """Plan (every check of the matcher and the providers; nothing live changes), then read
        into the live tensors, then set plain values, then let providers apply their state."""
        plan = _Plan(self, keys, strict, in_place=True)
        plan.match(state, self._tree_for(keys), (), None)
        plan.check()
        self._execute(plan)
        for container, key, loaded in plan.writebacks:
            container[key] = plan.resolve(loaded)
        for load, live, loaded in plan.finalizers:
            load(live, plan.resolve(loaded))
        plan.report.nbytes = sum(r.nbytes for r in plan.reads)
        return plan.report

    def load(self, *, keys=None) -> Any:
        plan = _Plan(self, keys, strict=False, in_place=False)
        value = plan.match(None, self._tree_for(keys), (), None)
        self._execute(plan)
        value = plan.resolve(value)
        if self.map_location is not None:
            value = _move(value, self.map_location)
        return value

    def verify_all(self, progress=None) -> int:
        """Re-read every byte of every shard file and return the bytes checked (see
        ``verify.verify_checkpoint``: headers, indexes against the manifest, every region's
        checksums, zero padding; ``progress(nbytes)`` is called as bytes are checked). Nothing
        is unpickled; memory is bounded."""
        from .verify import verify_checkpoint
        return verify_checkpoint(self, progress)

    # ------------------------------------------------------------ reading
    def read_object(self, entry: ObjectEntry) -> Any:
        f, _ = self.files.open(entry.file)  # validates that the region lies before the index
        path = self.files.path(entry.file)
        buf = bytearray(entry.nbytes)
        f.read_into([memoryview(buf)], entry.offset)
        if self.verify and fmt.crc32(buf) != entry.crc32:
            raise CorruptCheckpointError(f"{path}: checksum mismatch for object {entry.key!r} "
                                         f"at offset {entry.offset}")
        return serialization.loads(buf, entry.key, trusted=self.trusted,
                                   safe_globals=self.safe_globals)

    def _execute(self, plan: "_Plan") -> None:
        """Read every planned region, verifying each step of bytes right after it lands (while it
        is still in the CPU cache), with ``threads`` runs in flight; then run the copies that
        finish non-contiguous or non-CPU destinations."""
        groups = coalesce(plan.reads, group_limit(plan.reads, self.threads))
        for file_id in sorted({g[0].file for g in groups}):
            self.files.open(file_id)[0].advise_sequential()
        if len(groups) <= 1 or self.threads == 1:
            for g in groups:
                self._read_group(g)
        else:
            with ThreadPoolExecutor(min(self.threads, len(groups)),
                                    thread_name_prefix="datastates-reader") as pool:
                for f in [pool.submit(self._read_group, g) for g in groups]:
                    f.result()
        for fix in plan.post_copies:
            fix()

    def _read_group(self, group: list[_Read]) -> None:
        """Read one coalesced run of one file (see ``reads.read_run``). Runs on a reader
        thread; raises CorruptCheckpointError."""
        f, index_offset = self.files.open(group[0].file)
        path = self.files.path(group[0].file)
        end = group[-1].offset + group[-1].nbytes
        if end > index_offset:
            raise CorruptCheckpointError(f"{path}: {group[-1].key!r} at [{group[-1].offset}, "
                                         f"{end}) extends past the data ending at {index_offset}")
        read_run(f, group, path, self.verify)


_NODE_KINDS = {"tensor": "tensor", "dict": "dict", "odict": "dict", "list": "list",
               "tuple": "tuple"}


def _same_kind(t: str, live: Any) -> bool:
    """Whether a live value can receive a saved node of type ``t`` (plain values and pickled
    objects are compared by exact type once loaded; providers check their own objects)."""
    if t == "tensor":
        return isinstance(live, (torch.Tensor, TensorShard)) or _is_ndarray(live)
    if t in ("dict", "odict"):
        return isinstance(live, dict)
    if t in ("list", "tuple"):
        return isinstance(live, (list, tuple))
    return True


def _is_ndarray(value: Any) -> bool:
    np = sys.modules.get("numpy")  # no ndarray exists before numpy is imported
    return np is not None and isinstance(value, np.ndarray)


def _writable_tensor(array: Any) -> torch.Tensor | None:
    """A tensor on the bytes of the live ndarray ``array``, or None when restore cannot write
    into it: read-only, a dtype torch lacks, or strides torch cannot view (negative)."""
    if not array.flags.writeable or array.dtype.name not in NUMPY_DTYPES or \
            not array.dtype.isnative:
        return None
    try:
        return torch.from_numpy(array)
    except (TypeError, ValueError, RuntimeError):
        return None


def _as_numpy(tensor: torch.Tensor, entry: TensorEntry, where: str) -> Any:
    """The ndarray of a freshly read tensor whose tree node says it was saved from numpy."""
    if entry.dtype not in NUMPY_DTYPES:
        raise CorruptCheckpointError(f"{where}: {entry.key!r} is marked as a numpy array but "
                                     f"its dtype {entry.dtype} has no numpy equivalent")
    return tensor.numpy()


def _move(value: Any, device: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (dict, OrderedDict)):
        return type(value)((k, _move(v, device)) for k, v in value.items())
    if type(value) in (list, tuple):
        return type(value)(_move(v, device) for v in value)
    return value


class _Rebuild:
    """A provider's ``rebuild(state)``, done once, after the reads (``_Plan.resolve``)."""

    __slots__ = ("provider", "state", "done", "value")

    def __init__(self, provider: StateProvider, state: Any):
        self.provider, self.state, self.done, self.value = provider, state, False, None


def _resolve(value: Any) -> Any:
    if isinstance(value, _Rebuild):
        if not value.done:
            value.value, value.done = value.provider.rebuild(_resolve(value.state)), True
        return value.value
    if type(value) in (dict, OrderedDict):
        items = [(k, v, _resolve(v)) for k, v in value.items()]
        if all(v is r for _, v, r in items):
            return value
        return type(value)((k, r) for k, _, r in items)
    if type(value) in (list, tuple):
        items = [(v, _resolve(v)) for v in value]
        if all(v is r for v, r in items):
            return value
        return type(value)(r for _, r in items)
    return value


class _Plan:
    """Matches the checkpoint tree with the live state; collects reads, errors and finalizers."""

    def __init__(self, reader: Reader, keys, strict: bool, in_place: bool):
        self.reader, self.strict, self.in_place = reader, strict, in_place
        self.keys = None if keys is None else [k.strip("/") for k in
                                               ([keys] if isinstance(keys, str) else keys)]
        self.reads: list[_Read] = []
        self.post_copies: list = []
        self.finalizers: list = []
        self.fresh: dict[int, torch.Tensor] = {}
        self.filled: set[tuple[int, int]] = set()
        #: (container, key, value): plain values of the live dicts/lists, replaced after the reads
        self.writebacks: list = []
        #: providers' rebuilds waiting for the reads of their tensors (see ``resolve``)
        self.deferred = 0
        m = reader.manifest
        self.report = RestoreReport(name=os.path.basename(reader.dir), step=m.step)

    def wanted(self, path: tuple) -> str | None:
        if self.keys is None:
            return "all"
        key = key_of(path)
        if any(key == k or key.startswith(k + "/") or not k for k in self.keys):
            return "all"
        if not path or any(k.startswith(key + "/") for k in self.keys):
            return "some"
        return None

    def check(self) -> None:
        r = self.report
        if self.strict and (r.missing or r.unexpected or r.mismatched):
            def show(xs):
                return ", ".join(xs[:10]) + (f" ... ({len(xs)} in all)" if len(xs) > 10 else "")
            parts = []
            if r.missing:
                parts.append(f"missing from the checkpoint: {show(r.missing)}")
            if r.unexpected:
                parts.append(f"in the checkpoint but not in the live state: {show(r.unexpected)}")
            if r.mismatched:
                parts.append(f"do not match: {show(r.mismatched)}")
            raise StateMismatchError(f"{self.reader.dir}: the live state does not match the "
                                     f"checkpoint; {'; '.join(parts)}. Nothing was modified. "
                                     "Pass strict=False to restore what matches, or keys=[...]")

    def match(self, live: Any, node: dict, path: tuple, provider: StateProvider | None) -> Any:
        if isinstance(live, Capture):
            live = live.value
        t = node["t"]
        checked = self.in_place and live is not None and self._strict_here(provider)
        if checked and not _same_kind(t, live):
            return self._mismatch(live, path, f"checkpoint {_NODE_KINDS.get(t, t)}, live "
                                              f"{type(live).__qualname__}")
        if t == "value":
            if checked and type(node["v"]) is not type(live):
                return self._mismatch(live, path, f"checkpoint {type(node['v']).__qualname__}, "
                                                  f"live {type(live).__qualname__}")
            return node["v"]
        if t == "object":
            loaded = self.reader.read_object(self.reader.entries[node["e"]])
            if checked and type(loaded) is not type(live):
                return self._mismatch(live, path, f"checkpoint {type(loaded).__qualname__}, "
                                                  f"live {type(live).__qualname__}")
            return loaded
        if t == "tensor":
            return self.tensor(live, node, path)
        if t == "provider":
            return self.provider(live, node, path)
        if t in ("dict", "odict"):
            return self.mapping(live, node, path, provider)
        if t in ("list", "tuple"):
            return self.sequence(live, node, path, provider)
        raise CorruptCheckpointError(f"{self.reader.dir}: unknown tree node {t!r} at "
                                     f"{key_of(path)!r}")

    def provider(self, live: Any, node: dict, path: tuple) -> Any:
        prov = self.reader.registry.get(node["name"])
        if prov is None:
            raise CorruptCheckpointError(
                f"{self.reader.dir}: {key_of(path)!r} was saved by provider {node['name']!r}, "
                "which is not registered here; register it in the ProviderRegistry you pass")
        if live is not None and self.in_place:
            if not prov.can_handle(live):
                raise StateMismatchError(f"{key_of(path)!r}: the checkpoint holds a "
                                         f"{node['name']} state, the live object is a "
                                         f"{type(live).__qualname__}")
            mark = self._mark()
            loaded = self.match(prov.state(live), node["state"], path, prov)
            try:
                prov.check(live, loaded, key_of(path))
            except StateMismatchError as exc:
                self._rollback(mark)  # nothing of this object is read or applied
                return self._mismatch(live, path, str(exc))
            self.finalizers.append((prov.load, live, loaded))
            return live
        self.deferred += 1
        return _Rebuild(prov, self.match(None, node["state"], path, prov))

    def resolve(self, value: Any) -> Any:
        """``value`` with every provider's rebuild done: run after the reads, so a provider
        rebuilding an object (a numpy Generator) from its state sees the bytes read, not the
        empty tensors planned. Containers are kept as they are unless something inside them
        was rebuilt."""
        return _resolve(value) if self.deferred else value

    def _mismatch(self, live: Any, path: tuple, why: str) -> Any:
        """Record that the live value at ``path`` is left alone (an error if strict)."""
        self.report.mismatched.append(f"{key_of(path)} ({why})")
        return live

    def _mark(self) -> tuple:
        return (list(self.reads), list(self.post_copies), list(self.finalizers),
                list(self.writebacks), len(self.report.restored), set(self.filled),
                dict(self.fresh))

    def _rollback(self, mark: tuple) -> None:
        (self.reads, self.post_copies, self.finalizers, self.writebacks, restored, self.filled,
         self.fresh) = mark
        del self.report.restored[restored:]

    def _strict_here(self, provider: StateProvider | None) -> bool:
        return provider is None or not provider.allow_new_keys

    def mapping(self, live: Any, node: dict, path: tuple, provider) -> Any:
        out = OrderedDict() if node["t"] == "odict" else {}
        live_map = live if isinstance(live, dict) else None
        seen = set()
        for k, child in node["items"]:
            sub = path + (k,)
            if self.wanted(sub) is None:
                continue
            seen.add(k)
            if live_map is not None and k not in live_map and self._strict_here(provider):
                self.report.unexpected.append(key_of(sub))
                continue
            out[k] = self.match(live_map.get(k) if live_map is not None else None, child, sub,
                                provider)
            if self.in_place and live_map is not None and live_map.get(k) is not out[k]:
                self.writebacks.append((live_map, k, out[k]))  # plain values: set after reads
        if live_map is not None and self._strict_here(provider):
            for k in live_map:
                if k not in seen and self.wanted(path + (k,)) == "all":
                    self.report.missing.append(key_of(path + (k,)))
        return out

    def sequence(self, live: Any, node: dict, path: tuple, provider) -> Any:
        live_seq = live if isinstance(live, (list, tuple)) else None
        if (self.in_place and live_seq is not None and self._strict_here(provider)
                and len(live_seq) != len(node["items"]) and self.wanted(path) == "all"):
            return self._mismatch(live, path, f"checkpoint {len(node['items'])} items, live "
                                              f"{len(live_seq)}")
        out = []
        for i, child in enumerate(node["items"]):
            if self.wanted(path + (i,)) is None:
                continue
            lv = live_seq[i] if live_seq is not None and i < len(live_seq) else None
            out.append(self.match(lv, child, path + (i,), provider))
            if self.in_place and isinstance(live, list) and i < len(live) and lv is not out[-1]:
                self.writebacks.append((live, i, out[-1]))
        return tuple(out) if node["t"] == "tuple" else out

    def tensor(self, live: Any, node: dict, path: tuple) -> Any:
        """A tensor node: filled into the live tensor, or into a live numpy array in place
        (a writeable ``np.ndarray`` of the same shape and dtype: other references to it see the
        restored values; a different shape or dtype is a mismatch, as for tensors; a read-only
        array is replaced by a new one); else a new tensor, or a new ``np.ndarray`` for a node
        saved from numpy (``"np": true``)."""
        entry = self.reader.entries[node["e"]]
        key = key_of(path)
        if self.in_place and _is_ndarray(live):
            writable = _writable_tensor(live)
            if writable is not None or tuple(live.shape) != entry.shape or \
                    live.dtype.name != entry.dtype:
                self.into_live(writable if writable is not None else live, None, node, entry,
                               key)
                return live
        elif self.in_place and isinstance(live, (torch.Tensor, TensorShard)):
            self.into_live(live, sharding_of(live), node, entry, key)
            return live
        if node["e"] not in self.fresh:  # shared storage: one tensor for every key
            fresh = torch.empty(entry.shape, dtype=entry.torch_dtype)  # as torch.load gives
            self._fill(fresh, entry, key)
            self.fresh[node["e"]] = fresh
        if node.get("np") or _is_ndarray(live):
            return _as_numpy(self.fresh[node["e"]], entry, self.reader.dir)
        return self.fresh[node["e"]]

    def into_live(self, live: Any, shard: TensorShard | None, node: dict, entry: TensorEntry,
                  key: str) -> None:
        """Schedule filling the live tensor (or the local box of a sharded one) in place, or
        record a shape/dtype mismatch."""
        local = shard.local if shard is not None else live
        global_shape = shard.global_shape if shard is not None else tuple(live.shape)
        live_dtype = str(local.dtype).replace("torch.", "")  # numpy: its name, '>f4' if swapped
        if global_shape != entry.shape or live_dtype != entry.dtype:
            self.report.mismatched.append(f"{key} (checkpoint {entry.dtype}{list(entry.shape)}, "
                                          f"live {live_dtype}{list(global_shape)})")
            return
        self.report.restored.append(key)
        target = (node["e"], local.data_ptr())
        if target not in self.filled:  # tied weights: one read for every key
            self.filled.add(target)
            self._fill(local.detach(), entry, key,
                       shard.global_offset if shard is not None else None)

    def _fill(self, dest: torch.Tensor, entry: TensorEntry, key: str, box_offset=None) -> None:
        """Schedule reads filling ``dest``, the box of the global tensor at ``box_offset``
        (the whole tensor by default), from every saved shard that overlaps it."""
        box_offset = tuple(box_offset) if box_offset is not None else (0,) * dest.dim()
        direct = dest.device.type == "cpu" and dest.is_contiguous()
        target = dest if direct else torch.empty(dest.shape, dtype=dest.dtype)
        if not direct:
            self.post_copies.append(lambda d=dest, s=target: d.copy_(s))
        covered = 0
        for shard in entry.shards:
            covered += self._fill_from(target, box_offset, shard, key)
        if covered != target.numel():
            raise CorruptCheckpointError(
                f"{self.reader.dir}: the saved shards of {key!r} cover {covered} of the "
                f"{target.numel()} elements needed at {list(box_offset)}")

    def _fill_from(self, target: torch.Tensor, box_offset: tuple, shard: ShardRef,
                   key: str) -> int:
        """Read the part of one saved shard that overlaps the target box; return its elements."""
        s_off, s_shape = shard.global_offset, shard.shape
        lo = [max(a, b) for a, b in zip(s_off, box_offset)]
        hi = [min(a + n, b + m) for a, n, b, m in zip(s_off, s_shape, box_offset, target.shape)]
        if any(h <= l for l, h in zip(lo, hi)) and target.dim():
            return 0
        elem = target.element_size()
        numel = 1
        for n in s_shape:
            numel *= n
        if numel * elem != shard.nbytes:
            raise CorruptCheckpointError(f"{self.reader.dir}: shard of {key!r} at {list(s_off)} "
                                         f"holds {shard.nbytes} bytes, expected {numel * elem}")
        if s_off == box_offset and s_shape == tuple(target.shape):  # the same box: read in place
            if numel:
                self.reads.append(_Read(shard.file, shard.offset, shard.nbytes,
                                        target.reshape(-1).view(torch.uint8), shard.checksums,
                                        key))
            return numel
        if (target.dim() and s_shape[1:] == tuple(target.shape[1:]) and
                s_off[1:] == box_offset[1:] and lo[0] == s_off[0] and
                hi[0] == s_off[0] + s_shape[0]):
            # The whole shard is a run of full rows of the target: read it straight into them.
            row = shard.nbytes // s_shape[0] if s_shape[0] else 0
            start = (s_off[0] - box_offset[0]) * row
            flat = target.reshape(-1).view(torch.uint8)
            self.reads.append(_Read(shard.file, shard.offset, shard.nbytes,
                                    flat[start:start + shard.nbytes], shard.checksums, key))
            return numel
        # Rows [r0, r1) of the shard along dim 0 are one contiguous byte range: read only those,
        # widened to whole checksum pieces so that what is read is verified.
        row = shard.nbytes // s_shape[0] if s_shape[0] else 0
        r0, r1 = lo[0] - s_off[0], hi[0] - s_off[0]
        first, last, pieces, pos = None, None, [], 0
        for length, crc in shard.checksums:
            if pos + length > r0 * row and pos < r1 * row:
                first = pos if first is None else first
                last = pos + length
                pieces.append([length, crc])
            pos += length
        buf = torch.empty(last - first, dtype=torch.uint8)
        self.reads.append(_Read(shard.file, shard.offset + first, last - first, buf, pieces,
                                key))
        rows = buf[r0 * row - first:r1 * row - first].view(target.dtype)
        rows = rows.reshape((r1 - r0,) + s_shape[1:])
        src, dst = rows, target
        for dim in range(target.dim()):
            if dim:
                src = src.narrow(dim, lo[dim] - s_off[dim], hi[dim] - lo[dim])
            dst = dst.narrow(dim, lo[dim] - box_offset[dim], hi[dim] - lo[dim])
        self.post_copies.insert(0, lambda d=dst, s=src: d.copy_(s))
        count = 1
        for l, h in zip(lo, hi):
            count *= h - l
        return count

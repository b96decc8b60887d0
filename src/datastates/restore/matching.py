"""Matching a saved state tree against the live state: what a restore will read, set and apply.

Before a byte is read, one rank's saved tree is walked against the live state through the
providers, touching nothing live: mappings by key, sequences by position, tensors and numpy arrays
by shape and dtype, provider objects by their own ``check`` (a refused one is rolled back out of
the plan). What matches becomes a :class:`_Plan`: the regions to read into each live (or new)
tensor from every saved shard overlapping it, the plain values to set and the providers to apply
after the reads; what does not is recorded in the :class:`RestoreReport` (a strict restore raises).
With ``cast=True`` a live floating-point tensor of the saved shape but another floating-point dtype
matches too: it becomes a :class:`_Cast`, read as saved into a temporary, then copied into it.

Kept apart from the reading: ``restore.Reader`` opens and checks the files, hands itself to a plan
and executes the plan's reads (``_Read``, also built by verify.py). The plan uses only the reader it
is given, so restore.py imports this module, never the other way round. The plan walks the live
state alongside the saved tree, so the recursion is its own; the node kinds, children, keys and
the rule of ``keys=`` prefixes are format/tree.py's, shared with every reader of saved trees.
"""
from __future__ import annotations

import os
import sys
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..errors import CorruptCheckpointError, StateMismatchError
from ..format import tree
from ..format.checks import MAX_TREE_DEPTH
from ..format.tree import key_of
from ..format import codec as fmt
from ..providers.tree import NUMPY_DTYPES, TensorShard, plain_cpu, sharding_of, unwritable
from ..providers import Capture, StateProvider
from ..format.records import ShardRef, TensorEntry

if TYPE_CHECKING:
    from .reader import Reader


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
    #: damaged checkpoints newer than this one that finding the latest passed over (by name)
    passed_over: list[str] = field(default_factory=list)
    #: restored into a live tensor of another floating-point dtype (``cast=True``), each as
    #: ``"model/w (float32 -> bfloat16)"``; these keys are in ``restored`` too
    cast: list[str] = field(default_factory=list)
    #: newer committed checkpoints a restore with ``fallback=True`` did not use, newest first
    #: (``SkippedCheckpoint``: name, reason, where it was quarantined)
    skipped: list = field(default_factory=list)
    #: bytes re-read and checked before live state was touched (``fallback=True``), and seconds
    verified_nbytes: int = 0
    verify_s: float = 0.0
    #: where it was read from: "storage" (the directory), or "memory" (the memory tier)
    tier: str = "storage"
    #: with a memory tier, why this restore read storage without asking memory (its keeper
    #: did not answer when the Checkpointer was constructed: stopped or hung), else None
    tier_fallback: str | None = None
    #: True: a memory checkpoint its keeper had checked byte by byte after the last write to it
    #: (datastates/memory/marks.py), copied without checksumming again
    prechecked: bool = False
    #: reads started again because another process replaced or deleted the checkpoint while
    #: it was read (a tag overwritten, the latest deleted by retention): each as
    #: ``"<name>: <the error it caused>"``; the checkpoint restored is the one found last
    rereads: list[str] = field(default_factory=list)


@dataclass
class _Read:
    file: int
    offset: int
    nbytes: int
    #: the CPU tensor receiving the bytes: flat uint8, or any plain contiguous one (``plain_cpu``)
    dest: torch.Tensor
    checksums: list           # [[length, crc], ...] over [offset, offset + nbytes)
    key: str
    #: where these bytes start in the tensor's own bytes (a part of a larger region: see
    #: ``reads.split_at_pieces``); error messages count from the tensor's first byte
    base: int = 0


@dataclass
class _Cast:
    """A live tensor (or the local box of a sharded one) restored from a saved tensor of another
    floating-point dtype: the bytes are read and checked as saved, into a temporary of the saved
    dtype (``temporary``), then copied into ``dest`` with ``dest.copy_`` (torch's rounding), so
    ``dest`` changes only once every byte of it was verified."""

    dest: torch.Tensor
    entry: TensorEntry
    key: str
    box_offset: tuple | None  #: where ``dest`` lies in the global tensor (None: the whole)
    nbytes: int               #: bytes read from the checkpoint

    def temporary(self) -> torch.Tensor:
        return torch.empty(self.dest.shape, dtype=self.entry.torch_dtype)


def _castable(live: Any, entry: TensorEntry) -> bool:
    """Whether ``cast=True`` lets the live tensor receive the saved one of another dtype: both
    floating-point (never int, bool or complex, whose conversions lose values or meaning)."""
    return isinstance(live, torch.Tensor) and live.dtype.is_floating_point and \
        entry.torch_dtype.is_floating_point


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
    if not _fillable(array):
        return None
    try:
        return torch.from_numpy(array)
    except (TypeError, ValueError, RuntimeError):
        return None


def _fillable(array: Any) -> bool:
    """Whether numpy can write the live ndarray ``array`` in place although torch cannot view
    it (negative strides): writeable, of a native dtype the format holds."""
    return array.flags.writeable and array.dtype.name in NUMPY_DTYPES and array.dtype.isnative


def _as_numpy(tensor: torch.Tensor, entry: TensorEntry, where: str) -> Any:
    """The ndarray of a freshly read tensor whose tree node says it was saved from numpy."""
    if entry.dtype not in NUMPY_DTYPES:
        raise CorruptCheckpointError(f"{where}: {entry.key!r} is marked as a numpy array but "
                                     f"its dtype {entry.dtype} has no numpy equivalent")
    return tensor.numpy()


#: The format's name of each torch dtype it holds ("float32"), as ``str(dtype)`` spells it.
_DTYPE_TEXT = {d: str(d).replace("torch.", "") for d in fmt.SUPPORTED_DTYPES}


def _dtype_text(value: Any) -> str:
    """The dtype of a live tensor (or numpy array) as the manifest names it: numpy spells its
    own (``'>f4'`` when byte-swapped), and so does a torch dtype the format lacks."""
    if isinstance(value, torch.Tensor):
        name = _DTYPE_TEXT.get(value.dtype)
        if name is not None:
            return name
    return str(value.dtype).replace("torch.", "")


def _bytes_of(t: torch.Tensor) -> torch.Tensor | None:
    """The memory of the contiguous CPU tensor ``t`` as a flat uint8 tensor on it (no copy), or
    None when its memory is not its values in row-major order (a lazy conjugate or negative
    bit, or not contiguous), which a restore fills through a temporary instead."""
    if t.is_conj() or t.is_neg() or not t.is_contiguous():
        return None
    try:
        return fmt.tensor_bytes(t)
    except RuntimeError:
        return None


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

    def __init__(self, reader: Reader, keys, strict: bool, in_place: bool, cast: bool = False):
        self.reader, self.strict, self.in_place, self.cast = reader, strict, in_place, cast
        self.keys = tree.prefixes(keys)
        self.reads: list[_Read] = []
        self.post_copies: list = []
        #: live tensors filled from a saved tensor of another floating-point dtype, after the
        #: reads, a bounded batch of temporaries at a time (``Reader._run_casts``)
        self.casts: list[_Cast] = []
        self.finalizers: list = []
        self.fresh: dict[int, torch.Tensor] = {}
        self.filled: set[tuple[int, int]] = set()
        #: (container, key, value): plain values of the live dicts/lists, replaced after the reads
        #: (the key ``slice(None)``: a grown or shrunk list's whole contents)
        self.writebacks: list = []
        #: saved Python objects read (unpickled) to tell whether a container is plain, by entry,
        #: each taken by the one node that restores it
        self.objects: dict[int, Any] = {}
        #: (provider, state, key) of the providers overriding ``validate_values``, with the reads,
        #: copies and casts of their own tensors: done first, then validated
        self.early: list = []
        #: providers' rebuilds waiting for the reads of their tensors (see ``resolve``)
        self.deferred = 0
        m = reader.manifest
        self.report = RestoreReport(name=os.path.basename(reader.dir), step=m.step)

    def wanted(self, path: tuple) -> str | None:
        """``"all"``, ``"some"`` or None: where ``path`` stands relative to ``keys=``."""
        return tree.scope(path, self.keys)

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
                                     f"{_advice(r)}")

    def match_root(self, live: Any, node: dict) -> None:
        """:meth:`match` of the whole state. An in-place restore keeps the caller's object, so
        what it would have to replace at the top level is a mismatch: the state itself when it
        cannot be filled in place (a read-only or reversed array), and each item of a top-level
        tuple (immutable) that is not filled in place (a plain value, such an array; items that
        are themselves tuples are looked into). Nothing is lost in silence: strict, the restore
        raises before anything changes; otherwise the report names them."""
        result = self.match(live, node, (), None)
        if not self.in_place or live is None:
            return
        for path in _replaced(result, live, ()):
            what = "an item of a top-level tuple" if path else "the state passed"
            self.report.mismatched.append(
                f"{key_of(path) or '(top level)'} ({what} would have to be replaced, which "
                "restore() cannot do in place: pass a list or dict, or use load())")

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
            loaded = self._object(node)
            if checked and type(loaded) is not type(live):
                return self._mismatch(live, path, f"checkpoint {type(loaded).__qualname__}, "
                                                  f"live {type(live).__qualname__}")
            return loaded
        if t == "tensor":
            return self.tensor(live, node, path)
        if t == "provider":
            return self.provider(live, node, path)
        # plain data on both sides: a value, whose saved items are restored whatever the live
        # length or keys (README, "What can be in a state")
        grows = self.in_place and live is not None and _same_kind(t, live) and \
            self.wanted(path) == "all" and _plain(live) and self._plain_saved(node)
        if t in tree.MAPPINGS:
            return self.mapping(live, node, path, provider, grows)
        if t in tree.SEQUENCES:
            return self.sequence(live, node, path, provider, grows)
        raise CorruptCheckpointError(f"{self.reader.dir}: unknown tree node {t!r} at "
                                     f"{key_of(path)!r}")

    def _plain_saved(self, node: dict) -> bool:
        """Whether the saved subtree ``node`` holds plain data only: plain values, and saved
        Python objects that load as plain data (bytes, a non-finite float, a dict with keys
        JSON lacks), in dicts, lists and tuples. The objects read are kept for :meth:`match`."""
        t = node["t"]
        if t == "value":
            return True
        if t == "object":
            e = node["e"]
            if e not in self.objects:
                self.objects[e] = self.reader.read_object(self.reader.entries[e])
            return _plain(self.objects[e])
        if t in tree.MAPPINGS or t in tree.SEQUENCES:
            return all(self._plain_saved(child) for _, child in tree.items(node))
        return False

    def _object(self, node: dict) -> Any:
        """The saved Python object of the ``object`` node ``node``, read once."""
        e = node["e"]
        if e in self.objects:
            return self.objects.pop(e)
        return self.reader.read_object(self.reader.entries[e])

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
                                         f"{type(live).__qualname__}; put the kind of object "
                                         "it was saved from there before restoring, or read "
                                         "it with load()")
            mark = self._mark()
            loaded = self._provider_state(prov, prov.state(live), node, path)
            try:
                prov.check(live, loaded, key_of(path))
            except StateMismatchError as exc:
                self._rollback(mark)  # nothing of this object is read or applied
                return self._mismatch(live, path, str(exc))
            self.finalizers.append((prov.load, live, loaded))
            return live
        self.deferred += 1
        return _Rebuild(prov, self._provider_state(prov, None, node, path))

    def _provider_state(self, prov: StateProvider, live_state: Any, node: dict,
                        path: tuple) -> Any:
        """The saved state of a provider matched against ``live_state`` (its state of the live
        object, or None) and validated by the provider; a provider checking tensor values gets
        its reads and copies moved into ``early``."""
        reads, copies, casts = len(self.reads), set(map(id, self.post_copies)), len(self.casts)
        mismatched = len(self.report.mismatched)
        loaded = self.match(live_state, node["state"], path, prov)
        if len(self.report.mismatched) == mismatched:
            prov.validate(loaded, key_of(path))
        elif type(prov).validate is not StateProvider.validate:
            # live values stand where the state did not match: validate the saved one
            mark = self._mark()
            prov.validate(self.match(None, node["state"], path, prov), key_of(path))
            self._rollback(mark)
        if type(prov).validate_values is not StateProvider.validate_values:
            mine = [c for c in self.post_copies if id(c) not in copies]
            self.post_copies = [c for c in self.post_copies if id(c) in copies]
            self.early.append((prov, loaded, key_of(path), self.reads[reads:], mine,
                               self.casts[casts:]))
            del self.reads[reads:]
            del self.casts[casts:]
        return loaded

    def nbytes(self) -> int:
        """Bytes the plan reads."""
        early = [r for e in self.early for r in e[3] + e[5]]
        return sum(r.nbytes for r in self.reads + self.casts + early)

    def files(self) -> set[int]:
        """The shard files the plan reads from (a cast counts every file of its tensor)."""
        early_reads = [r for e in self.early for r in e[3]]
        casts = self.casts + [c for e in self.early for c in e[5]]
        return ({r.file for r in self.reads + early_reads} |
                {s.file for c in casts for s in c.entry.shards})

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
                dict(self.fresh), list(self.early), list(self.casts), len(self.report.cast))

    def _rollback(self, mark: tuple) -> None:
        (self.reads, self.post_copies, self.finalizers, self.writebacks, restored, self.filled,
         self.fresh, self.early, self.casts, cast) = mark
        del self.report.restored[restored:]
        del self.report.cast[cast:]

    def _strict_here(self, provider: StateProvider | None) -> bool:
        return provider is None or not provider.allow_new_keys

    def _fills(self, live: Any, provider) -> bool:
        """Whether the live container is filled in place (it is the caller's own: outside any
        provider, whose ``load`` gets the state as saved) rather than replaced."""
        return self.in_place and provider is None and isinstance(live, (dict, list))

    def mapping(self, live: Any, node: dict, path: tuple, provider, grows: bool = False) -> Any:
        """A dict node. A live dict of the caller's is filled in place (same object, its other
        keys kept); otherwise a new dict is built (the live one, inside a provider's state,
        still gets its values set). ``grows``: a dict of plain data on both sides (see
        :meth:`match`), which takes the keys only the checkpoint holds instead of finding
        them unexpected; keys only the live dict holds are missing all the same."""
        live_map = live if isinstance(live, dict) else None
        fill = self._fills(live_map, provider)
        out = live_map if fill else (OrderedDict() if node["t"] == "odict" else {})
        seen = set()
        everything = self.keys is None  # no keys=: every child is wanted
        for k, child in node["items"]:  # tree.items of a mapping, without a list of pairs
            sub = path + (k,)
            if not everything and self.wanted(sub) is None:
                continue
            seen.add(k)
            if live_map is not None and k not in live_map and self._strict_here(provider) and \
                    not grows:
                self.report.unexpected.append(key_of(sub))
                continue
            current = live_map.get(k) if live_map is not None else None
            value = self.match(current, child, sub, provider)
            if self.in_place and live_map is not None and (current is not value or
                                                           k not in live_map):
                self.writebacks.append((live_map, k, value))  # set after the reads
            if not fill:
                out[k] = value
        if live_map is not None and self._strict_here(provider):
            for k in live_map:
                if k not in seen and (everything or self.wanted(path + (k,)) == "all"):
                    self.report.missing.append(key_of(path + (k,)))
        return out

    def sequence(self, live: Any, node: dict, path: tuple, provider, grows: bool = False) -> Any:
        """A list or tuple node, matched item by item: a live list of the caller's is filled in
        place, a tuple rebuilt. ``grows``: a sequence of plain data on both sides (see
        :meth:`match`), which takes the saved items whatever its live length: a live list's
        whole contents are replaced after the reads (the same list; an item both sides hold is
        matched as usual, so a nested list or dict stays the same object)."""
        live_seq = live if isinstance(live, (list, tuple)) else None
        if (self.in_place and live_seq is not None and self._strict_here(provider) and not grows
                and len(live_seq) != len(node["items"]) and self.wanted(path) == "all"):
            n = len(node["items"])
            return self._mismatch(live, path, f"checkpoint {n} items, live {len(live_seq)}; it "
                                              "holds tensors or objects restored in place, so "
                                              f"build it with the {n} saved items")
        fill = self._fills(live_seq, provider)
        # a live tuple of the caller's is rebuilt keeping its items that are not restored
        keep = self.in_place and provider is None and live_seq is not None
        out = []
        for i, child in tree.items(node):
            lv = live_seq[i] if live_seq is not None and i < len(live_seq) else None
            if self.wanted(path + (i,)) is None:
                if keep and i < len(live_seq):
                    out.append(lv)
                continue
            if fill and i >= len(live_seq) and not grows:  # only when keys= names this item
                self.report.unexpected.append(key_of(path + (i,)))
                continue
            out.append(self.match(lv, child, path + (i,), provider))
            if self.in_place and isinstance(live, list) and i < len(live) and lv is not out[-1] \
                    and not grows:
                self.writebacks.append((live, i, out[-1]))
        if fill:
            if grows:
                self.writebacks.append((live, slice(None), out))
            return live
        return tuple(out) if node["t"] == "tuple" else out

    def tensor(self, live: Any, node: dict, path: tuple) -> Any:
        """A tensor node: filled into the live tensor, or into a live numpy array in place
        (a writeable ``np.ndarray`` of the same shape and dtype: other references to it see the
        restored values -- one with strides torch cannot view, negative ones, is filled from a
        temporary after the reads; a different shape or dtype is a mismatch, as for tensors; a
        read-only array is replaced by a new one); else a new tensor, or a new ``np.ndarray``
        for a node saved from numpy (``"np": true``)."""
        entry = self.reader.entries[node["e"]]
        key = key_of(path)
        if self.in_place and type(live) is torch.Tensor:  # the commonest: a plain live tensor
            self.into_live(live, None, node, entry, key)
            return live
        if self.in_place and _is_ndarray(live):
            writable = _writable_tensor(live)
            if writable is None and _fillable(live) and tuple(live.shape) == entry.shape and \
                    live.dtype.name == entry.dtype:  # strides torch cannot view: a temporary
                writable = torch.empty(entry.shape, dtype=entry.torch_dtype)
                self.post_copies.append(lambda a=live, t=writable: a.__setitem__(..., t.numpy()))
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
        record a shape/dtype mismatch. With ``cast``, a floating-point dtype other than the
        saved floating-point one is no mismatch: the tensor is filled through a :class:`_Cast`."""
        local = shard.local if shard is not None else live
        global_shape = shard.global_shape if shard is not None else tuple(live.shape)
        live_dtype = _dtype_text(local)
        cast = live_dtype != entry.dtype and global_shape == entry.shape and self.cast and \
            _castable(local, entry)
        if (global_shape != entry.shape or live_dtype != entry.dtype) and not cast:
            refused = "; cast=True converts between floating-point dtypes only" \
                if self.cast and global_shape == entry.shape and \
                isinstance(local, torch.Tensor) else ""
            self.report.mismatched.append(f"{key} (checkpoint {entry.dtype}{list(entry.shape)}, "
                                          f"live {live_dtype}{list(global_shape)}{refused})")
            return
        why = unwritable(local)
        if why is not None:
            self.report.mismatched.append(f"{key} (the live tensor {why}; it is {live_dtype}"
                                          f"{list(local.shape)} of strides {list(local.stride())})")
            return
        self.report.restored.append(key)
        if cast:
            self.report.cast.append(f"{key} ({entry.dtype} -> {live_dtype})")
        target = (node["e"], local.data_ptr())
        if target not in self.filled:  # tied weights: one read for every key
            self.filled.add(target)
            box = shard.global_offset if shard is not None else None
            # detached only if needed: autograd has nothing to do with bytes read into it
            dest = local if type(local) is torch.Tensor and not local.requires_grad else \
                local.detach()
            if cast:
                self._cast_into(dest, entry, key, box)
            else:
                self._fill(dest, entry, key, box)

    def _cast_into(self, dest: torch.Tensor, entry: TensorEntry, key: str, box_offset) -> None:
        """Schedule a :class:`_Cast` of ``dest``. Its regions are planned now on a meta tensor
        (no memory), so that a checkpoint whose shards do not cover it is refused before
        anything is read; they are planned again on the temporary when it is read."""
        box = tuple(box_offset) if box_offset is not None else None
        probe = torch.empty(dest.shape, dtype=entry.torch_dtype, device="meta")
        reads, _ = self.regions(probe, entry, key, box)
        self.casts.append(_Cast(dest, entry, key, box, sum(r.nbytes for r in reads)))

    def _fill(self, dest: torch.Tensor, entry: TensorEntry, key: str, box_offset=None) -> None:
        """Schedule reads filling ``dest``, the box of the global tensor at ``box_offset``
        (the whole tensor by default), from every saved shard that overlaps it."""
        direct = plain_cpu(dest) or (dest.device.type == "cpu" and dest.is_contiguous() and
                                     _bytes_of(dest) is not None)
        target = dest if direct else torch.empty(dest.shape, dtype=dest.dtype)
        if not direct:
            self.post_copies.append(lambda d=dest, s=target: d.copy_(s))
        reads, copies = self.regions(target, entry, key, box_offset)
        self.reads.extend(reads)
        self.post_copies[:0] = copies  # they fill ``target`` before it is copied anywhere

    def regions(self, target: torch.Tensor, entry: TensorEntry, key: str,
                box_offset=None) -> tuple[list[_Read], list]:
        """The reads filling the contiguous CPU (or meta) tensor ``target``, the box of the
        global tensor at ``box_offset`` (the whole tensor by default), from every saved shard
        that overlaps it, and the copies that must follow them (parts of shards read into
        buffers). CorruptCheckpointError when the shards do not cover the box."""
        box_offset = tuple(box_offset) if box_offset is not None else (0,) * target.dim()
        reads: list[_Read] = []
        copies: list = []
        covered = 0
        for shard in entry.shards:
            covered += self._fill_from(target, box_offset, shard, key, reads, copies)
        if covered != target.numel():
            raise CorruptCheckpointError(
                f"{self.reader.dir}: the saved shards of {key!r} cover {covered} of the "
                f"{target.numel()} elements needed at {list(box_offset)}")
        return reads, copies

    def _fill_from(self, target: torch.Tensor, box_offset: tuple, shard: ShardRef,
                   key: str, reads: list, copies: list) -> int:
        """Plan reading the part of one saved shard that overlaps the target box into ``reads``
        and ``copies``; return its elements."""
        s_off, s_shape = shard.global_offset, shard.shape
        if s_off == box_offset and s_shape == target.shape:  # the same box: read in place
            numel = target.numel()
            if not numel:  # a dimension of size 0: nothing to read
                return 0
            if numel * target.element_size() != shard.nbytes:
                raise CorruptCheckpointError(
                    f"{self.reader.dir}: shard of {key!r} at {list(s_off)} holds {shard.nbytes} "
                    f"bytes, expected {numel * target.element_size()}")
            # a plain CPU tensor is read into as it is (reads.py views its bytes by address)
            reads.append(_Read(shard.file, shard.offset, shard.nbytes,
                               target if plain_cpu(target) else _bytes_of(target),
                               shard.checksums, key))
            return numel
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
                reads.append(_Read(shard.file, shard.offset, shard.nbytes,
                                   _bytes_of(target), shard.checksums, key))
            return numel
        if (target.dim() and s_shape[1:] == tuple(target.shape[1:]) and
                s_off[1:] == box_offset[1:] and lo[0] == s_off[0] and
                hi[0] == s_off[0] + s_shape[0]):
            # The whole shard is a run of full rows of the target: read it straight into them.
            row = shard.nbytes // s_shape[0] if s_shape[0] else 0
            start = (s_off[0] - box_offset[0]) * row
            flat = _bytes_of(target)
            reads.append(_Read(shard.file, shard.offset, shard.nbytes,
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
        # A piece may start inside an element (the format bounds pieces in bytes only): the
        # buffer starts ``lead`` bytes early, so that the rows land at an offset that is a
        # multiple of the element size and can be viewed as elements.
        lead = first % elem
        buf = torch.empty(lead + last - first, dtype=torch.uint8, device=target.device)
        reads.append(_Read(shard.file, shard.offset + first, last - first, buf[lead:], pieces,
                           key, first))
        start = lead + r0 * row - first
        rows = buf[start:start + (r1 - r0) * row].view(target.dtype)
        rows = rows.reshape((r1 - r0,) + s_shape[1:])
        src, dst = rows, target
        for dim in range(target.dim()):
            if dim:
                src = src.narrow(dim, lo[dim] - s_off[dim], hi[dim] - lo[dim])
            dst = dst.narrow(dim, lo[dim] - box_offset[dim], hi[dim] - lo[dim])
        copies.append(lambda d=dst, s=src: d.copy_(s))
        count = 1
        for l, h in zip(lo, hi):
            count *= h - l
        return count


#: Plain values whose equal copies are interchangeable.
_IMMUTABLE = frozenset({int, float, complex, str, bytes, bool, type(None)})
_PLAIN_CONTAINERS = (dict, OrderedDict, list, tuple)


def _plain(value: Any, depth: int = 0) -> bool:
    """Whether ``value`` is plain data: a value of a type in ``_IMMUTABLE``, or a dict,
    OrderedDict, list or tuple of plain data (dict keys plain values too). A container nested
    deeper than a checkpoint may be (one holding itself) is not."""
    kind = type(value)
    if kind in _IMMUTABLE:
        return True
    if kind not in _PLAIN_CONTAINERS or depth >= MAX_TREE_DEPTH:
        return False
    if kind is list or kind is tuple:
        return all(_plain(v, depth + 1) for v in value)
    return all(type(k) in _IMMUTABLE and _plain(v, depth + 1) for k, v in value.items())


def _advice(report: RestoreReport) -> str:
    """How to make a strict restore of the state ``report`` describes succeed keeping the saved
    data: ``strict=False`` is offered as the fix only where it drops nothing saved (keys only the
    live state has)."""
    steps = []
    if report.unexpected:
        steps.append("add the keys only the checkpoint holds")
    if report.mismatched:
        steps.append("give each mismatched container that holds tensors or objects the saved "
                     "length and keys, each tensor the saved shape and dtype (cast=True converts "
                     "between floating-point dtypes), each object the saved type -- or, in your "
                     "own dict or list, set it to None, which takes whatever was saved")
    if report.missing:
        steps.append("remove the keys the checkpoint lacks")
    text = f"To restore the saved data, before restoring {'; '.join(steps)}. load() returns " \
        "the saved state as new objects."
    if report.unexpected or report.mismatched:
        return text + " strict=False would skip what is listed here, dropping its saved data."
    return text + " Or pass strict=False: everything saved is restored, and the keys the " \
        "checkpoint lacks keep their live values."


def _replaced(result: Any, live: Any, path: tuple) -> list[tuple]:
    """The paths of what an in-place restore would have to put in place of ``live``
    (:meth:`_Plan.match_root`): nothing where ``result`` is ``live`` itself or an equal plain
    value; the items of a tuple rebuilt as a tuple, one by one; else ``path`` itself."""
    if isinstance(live, Capture):  # a capture policy's wrapper: its value is what is filled
        live = live.value
    if result is live or type(result) is type(live) and type(live) in _IMMUTABLE and \
            result == live:  # the same value: nothing to replace
        return []
    if type(live) is tuple and type(result) is tuple and len(result) == len(live):
        return [found for i, (r, item) in enumerate(zip(result, live))
                for found in _replaced(r, item, path + (i,))]
    return [path]

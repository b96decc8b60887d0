"""Matching a saved state tree against the live state: what a restore will read, set and apply.

Before a byte is read, one rank's saved tree is walked against the live state through the
providers, touching nothing live: mappings by key, sequences by position, tensors and numpy arrays
by shape and dtype, provider objects by their own ``check`` (a refused one is rolled back out of
the plan). What matches becomes a :class:`~datastates.restore.plan.Plan` (:func:`plan_restore`,
:func:`plan_load`): the regions to read into each live (or new) tensor from every saved shard
overlapping it, the plain values to set and the providers to apply after the reads; what does not
is recorded in its :class:`RestoreReport` (a strict restore raises). With ``cast=True`` a live
floating-point tensor of the saved shape but another floating-point dtype matches too: it becomes
a ``Cast``, read as saved into a temporary, then copied into it.

Kept apart from the reading: matching sees the open checkpoint (opened.py: its manifest, entries
and saved Python objects) and the providers, and builds plan records (plan.py); ``reader.Reader``
above it carries the plan out. The walk goes over the live state alongside the saved tree, so the
recursion is its own; the node kinds, children, keys and the rule of ``keys=`` prefixes are
format/tree.py's, shared with every reader of saved trees.
"""

from __future__ import annotations

import os
import sys
from collections import OrderedDict
from typing import Any, Callable, Iterable

import torch

from ..errors import CorruptCheckpointError, StateMismatchError
from ..format import tree
from ..format.checks import MAX_TREE_DEPTH
from ..format.tree import key_of
from ..format import codec as fmt
from ..providers.tree import NUMPY_DTYPES, TensorShard, plain_cpu, sharding_of, unwritable
from ..providers import Capture, ProviderRegistry, StateProvider
from ..format.records import ShardRef, TensorEntry
from .opened import OpenCheckpoint
from .plan import Cast, Early, Plan, Read, Rebuild, RestoreReport


def _castable(live: Any, entry: TensorEntry) -> bool:
    """Whether ``cast=True`` lets the live tensor receive the saved one of another dtype: both
    floating-point (never int, bool or complex, whose conversions lose values or meaning)."""
    return (
        isinstance(live, torch.Tensor)
        and live.dtype.is_floating_point
        and entry.torch_dtype.is_floating_point
    )


_NODE_KINDS = {
    "tensor": "tensor",
    "dict": "dict",
    "odict": "dict",
    "list": "list",
    "tuple": "tuple",
}


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
        raise CorruptCheckpointError(
            f"{where}: {entry.key!r} is marked as a numpy array but "
            f"its dtype {entry.dtype} has no numpy equivalent"
        )
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


def _copier(dest: torch.Tensor, src: torch.Tensor) -> Callable[[], Any]:
    """A copy of ``src`` into ``dest``, to run after the reads."""
    return lambda: dest.copy_(src)


def _numpy_filler(array: Any, src: torch.Tensor) -> Callable[[], Any]:
    """A copy of ``src`` into the live ndarray ``array`` (by numpy: strides torch cannot view),
    to run after the reads."""
    return lambda: array.__setitem__(..., src.numpy())


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


def plan_restore(
    ckpt: OpenCheckpoint,
    registry: ProviderRegistry,
    state: Any,
    saved: dict,
    *,
    keys: str | Iterable[str] | None = None,
    strict: bool = True,
    cast: bool = False,
) -> Plan:
    """The plan of restoring the saved tree ``saved`` of ``ckpt`` into the live ``state`` in
    place: every check of the matcher and the providers (StateMismatchError when ``strict`` and
    something differs); nothing live changes (the saved Python objects are read and unpickled
    here, their checksums verified)."""
    matcher = _Matcher(ckpt, registry, keys, strict, in_place=True, cast=cast)
    matcher.match_root(state, saved)
    matcher.check()
    return matcher.plan()


def plan_load(
    ckpt: OpenCheckpoint,
    registry: ProviderRegistry,
    saved: dict,
    *,
    keys: str | Iterable[str] | None = None,
) -> tuple[Plan, Any]:
    """(the plan, the structure it fills) of loading the saved tree ``saved`` of ``ckpt`` into
    new objects: nothing is read but the Python objects; the structure holds the new tensors
    (filled by the plan's reads) and the providers' rebuilds (``Plan.resolve``)."""
    matcher = _Matcher(ckpt, registry, keys, strict=False, in_place=False)
    value = matcher.match(None, saved, (), None)
    return matcher.plan(), value


class _Matcher:
    """Matches the checkpoint tree with the live state; collects reads, errors and finalizers
    into the lists a :class:`Plan` is made of (:meth:`plan`)."""

    def __init__(
        self,
        ckpt: OpenCheckpoint,
        registry: ProviderRegistry,
        keys: str | Iterable[str] | None,
        strict: bool,
        in_place: bool,
        cast: bool = False,
    ):
        self.ckpt, self.registry = ckpt, registry
        self.entries = ckpt.entries
        self.strict, self.in_place, self.cast = strict, in_place, cast
        self.keys = tree.prefixes(keys)
        self.reads: list[Read] = []
        self.post_copies: list[Callable[[], Any]] = []
        self.casts: list[Cast] = []
        self.finalizers: list[tuple[Callable[[Any, Any], Any], Any, Any]] = []
        self.fresh: dict[int, torch.Tensor] = {}
        self.filled: set[tuple[int, int]] = set()
        self.writebacks: list[tuple[Any, Any, Any]] = []
        #: saved Python objects read (unpickled) to tell whether a container is plain, by entry,
        #: each taken by the one node that restores it
        self.objects: dict[int, Any] = {}
        self.early: list[Early] = []
        self.deferred = 0
        self.report = RestoreReport(name=os.path.basename(ckpt.dir), step=ckpt.manifest.step)

    def plan(self) -> Plan:
        """What was matched, as a plan record."""
        return Plan(
            report=self.report,
            early=self.early,
            reads=self.reads,
            post_copies=self.post_copies,
            casts=self.casts,
            writebacks=self.writebacks,
            finalizers=self.finalizers,
            deferred=self.deferred,
        )

    def _read_object(self, e: int) -> Any:
        return self.ckpt.read_object(self.entries[e])

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
            raise StateMismatchError(
                f"{self.ckpt.dir}: the live state does not match the "
                f"checkpoint; {'; '.join(parts)}. Nothing was modified. "
                f"{_advice(r)}"
            )

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
                "restore() cannot do in place: pass a list or dict, or use load())"
            )

    def match(self, live: Any, node: dict, path: tuple, provider: StateProvider | None) -> Any:
        if isinstance(live, Capture):
            live = live.value
        t = node["t"]
        checked = self.in_place and live is not None and self._strict_here(provider)
        if checked and not _same_kind(t, live):
            return self._mismatch(
                live, path, f"checkpoint {_NODE_KINDS.get(t, t)}, live {type(live).__qualname__}"
            )
        if t == "value":
            if checked and type(node["v"]) is not type(live):
                return self._mismatch(
                    live,
                    path,
                    f"checkpoint {type(node['v']).__qualname__}, live {type(live).__qualname__}",
                )
            return node["v"]
        if t == "object":
            loaded = self._object(node)
            if checked and type(loaded) is not type(live):
                return self._mismatch(
                    live,
                    path,
                    f"checkpoint {type(loaded).__qualname__}, live {type(live).__qualname__}",
                )
            return loaded
        if t == "tensor":
            return self.tensor(live, node, path)
        if t == "provider":
            return self.provider(live, node, path)
        # plain data on both sides: a value, whose saved items are restored whatever the live
        # length or keys (README, "What can be in a state")
        grows = (
            self.in_place
            and live is not None
            and _same_kind(t, live)
            and self.wanted(path) == "all"
            and _plain(live)
            and self._plain_saved(node)
        )
        if t in tree.MAPPINGS:
            return self.mapping(live, node, path, provider, grows)
        if t in tree.SEQUENCES:
            return self.sequence(live, node, path, provider, grows)
        raise CorruptCheckpointError(
            f"{self.ckpt.dir}: unknown tree node {t!r} at {key_of(path)!r}"
        )

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
                self.objects[e] = self._read_object(e)
            return _plain(self.objects[e])
        if t in tree.MAPPINGS or t in tree.SEQUENCES:
            return all(self._plain_saved(child) for _, child in tree.items(node))
        return False

    def _object(self, node: dict) -> Any:
        """The saved Python object of the ``object`` node ``node``, read once."""
        e = node["e"]
        if e in self.objects:
            return self.objects.pop(e)
        return self._read_object(e)

    def provider(self, live: Any, node: dict, path: tuple) -> Any:
        prov = self.registry.get(node["name"])
        if prov is None:
            raise CorruptCheckpointError(
                f"{self.ckpt.dir}: {key_of(path)!r} was saved by provider {node['name']!r}, "
                "which is not registered here; register it in the ProviderRegistry you pass"
            )
        if live is not None and self.in_place:
            if not prov.can_handle(live):
                raise StateMismatchError(
                    f"{key_of(path)!r}: the checkpoint holds a "
                    f"{node['name']} state, the live object is a "
                    f"{type(live).__qualname__}; put the kind of object "
                    "it was saved from there before restoring, or read "
                    "it with load()"
                )
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
        return Rebuild(prov, self._provider_state(prov, None, node, path))

    def _provider_state(self, prov: StateProvider, live_state: Any, node: dict, path: tuple) -> Any:
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
            self.early.append(
                Early(prov, loaded, key_of(path), self.reads[reads:], mine, self.casts[casts:])
            )
            del self.reads[reads:]
            del self.casts[casts:]
        return loaded

    def _mismatch(self, live: Any, path: tuple, why: str) -> Any:
        """Record that the live value at ``path`` is left alone (an error if strict)."""
        self.report.mismatched.append(f"{key_of(path)} ({why})")
        return live

    def _mark(self) -> tuple:
        return (
            list(self.reads),
            list(self.post_copies),
            list(self.finalizers),
            list(self.writebacks),
            len(self.report.restored),
            set(self.filled),
            dict(self.fresh),
            list(self.early),
            list(self.casts),
            len(self.report.cast),
        )

    def _rollback(self, mark: tuple) -> None:
        (
            self.reads,
            self.post_copies,
            self.finalizers,
            self.writebacks,
            restored,
            self.filled,
            self.fresh,
            self.early,
            self.casts,
            cast,
        ) = mark
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
        out: dict = (
            live_map
            if fill and live_map is not None
            else (OrderedDict() if node["t"] == "odict" else {})
        )
        seen = set()
        everything = self.keys is None  # no keys=: every child is wanted
        for k, child in node["items"]:  # tree.items of a mapping, without a list of pairs
            sub = path + (k,)
            if not everything and self.wanted(sub) is None:
                continue
            seen.add(k)
            if (
                live_map is not None
                and k not in live_map
                and self._strict_here(provider)
                and not grows
            ):
                self.report.unexpected.append(key_of(sub))
                continue
            current = live_map.get(k) if live_map is not None else None
            value = self.match(current, child, sub, provider)
            if (
                self.in_place
                and live_map is not None
                and (current is not value or k not in live_map)
            ):
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
        if (
            self.in_place
            and live_seq is not None
            and self._strict_here(provider)
            and not grows
            and len(live_seq) != len(node["items"])
            and self.wanted(path) == "all"
        ):
            n = len(node["items"])
            return self._mismatch(
                live,
                path,
                f"checkpoint {n} items, live {len(live_seq)}; it "
                "holds tensors or objects restored in place, so "
                f"build it with the {n} saved items",
            )
        fill = self._fills(live_seq, provider)
        # a live tuple of the caller's is rebuilt keeping its items that are not restored
        keep = self.in_place and provider is None and live_seq is not None
        n_live = len(live_seq) if live_seq is not None else 0
        out = []
        for i, child in tree.items(node):
            lv = live_seq[i] if live_seq is not None and i < n_live else None
            if self.wanted(path + (i,)) is None:
                if keep and i < n_live:
                    out.append(lv)
                continue
            if fill and i >= n_live and not grows:  # only when keys= names this item
                self.report.unexpected.append(key_of(path + (i,)))
                continue
            out.append(self.match(lv, child, path + (i,), provider))
            if (
                self.in_place
                and isinstance(live, list)
                and i < len(live)
                and lv is not out[-1]
                and not grows
            ):
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
        entry = self.entries[node["e"]]
        if not isinstance(entry, TensorEntry):  # the tree's checks gave tensors tensor entries
            raise CorruptCheckpointError(f"{self.ckpt.dir}: entry {node['e']} is no tensor")
        key = key_of(path)
        if self.in_place and type(live) is torch.Tensor:  # the commonest: a plain live tensor
            self.into_live(live, None, node, entry, key)
            return live
        if self.in_place and _is_ndarray(live):
            writable = _writable_tensor(live)
            if (
                writable is None
                and _fillable(live)
                and tuple(live.shape) == entry.shape
                and live.dtype.name == entry.dtype
            ):  # strides torch cannot view: a temporary
                writable = torch.empty(entry.shape, dtype=entry.torch_dtype)
                self.post_copies.append(_numpy_filler(live, writable))
            if (
                writable is not None
                or tuple(live.shape) != entry.shape
                or live.dtype.name != entry.dtype
            ):
                self.into_live(writable if writable is not None else live, None, node, entry, key)
                return live
        elif self.in_place and isinstance(live, (torch.Tensor, TensorShard)):
            self.into_live(live, sharding_of(live), node, entry, key)
            return live
        if node["e"] not in self.fresh:  # shared storage: one tensor for every key
            fresh = torch.empty(entry.shape, dtype=entry.torch_dtype)  # as torch.load gives
            self._fill(fresh, entry, key)
            self.fresh[node["e"]] = fresh
        if node.get("np") or _is_ndarray(live):
            return _as_numpy(self.fresh[node["e"]], entry, self.ckpt.dir)
        return self.fresh[node["e"]]

    def into_live(
        self, live: Any, shard: TensorShard | None, node: dict, entry: TensorEntry, key: str
    ) -> None:
        """Schedule filling the live tensor (or the local box of a sharded one) in place, or
        record a shape/dtype mismatch. With ``cast``, a floating-point dtype other than the
        saved floating-point one is no mismatch: the tensor is filled through a ``Cast``."""
        local = shard.local if shard is not None else live
        global_shape = shard.global_shape if shard is not None else tuple(live.shape)
        live_dtype = _dtype_text(local)
        cast = (
            live_dtype != entry.dtype
            and global_shape == entry.shape
            and self.cast
            and _castable(local, entry)
        )
        if (global_shape != entry.shape or live_dtype != entry.dtype) and not cast:
            refused = (
                "; cast=True converts between floating-point dtypes only"
                if self.cast and global_shape == entry.shape and isinstance(local, torch.Tensor)
                else ""
            )
            self.report.mismatched.append(
                f"{key} (checkpoint {entry.dtype}{list(entry.shape)}, "
                f"live {live_dtype}{list(global_shape)}{refused})"
            )
            return
        why = unwritable(local)
        if why is not None:
            self.report.mismatched.append(
                f"{key} (the live tensor {why}; it is {live_dtype}"
                f"{list(local.shape)} of strides {list(local.stride())})"
            )
            return
        self.report.restored.append(key)
        if cast:
            self.report.cast.append(f"{key} ({entry.dtype} -> {live_dtype})")
        target = (node["e"], local.data_ptr())
        if target not in self.filled:  # tied weights: one read for every key
            self.filled.add(target)
            box = shard.global_offset if shard is not None else None
            # detached only if needed: autograd has nothing to do with bytes read into it
            dest = (
                local if type(local) is torch.Tensor and not local.requires_grad else local.detach()
            )
            if cast:
                self._cast_into(dest, entry, key, box)
            else:
                self._fill(dest, entry, key, box)

    def _cast_into(self, dest: torch.Tensor, entry: TensorEntry, key: str, box_offset) -> None:
        """Schedule a ``Cast`` of ``dest``. Its regions are planned now on a meta tensor
        (no memory), so that a checkpoint whose shards do not cover it is refused before
        anything is read; they are planned again on the temporary when it is read."""
        box = tuple(box_offset) if box_offset is not None else None
        probe = torch.empty(dest.shape, dtype=entry.torch_dtype, device="meta")
        reads, _ = regions(probe, entry, key, box, self.ckpt.dir)
        self.casts.append(Cast(dest, entry, key, box, sum(r.nbytes for r in reads)))

    def _fill(self, dest: torch.Tensor, entry: TensorEntry, key: str, box_offset=None) -> None:
        """Schedule reads filling ``dest``, the box of the global tensor at ``box_offset``
        (the whole tensor by default), from every saved shard that overlaps it."""
        direct = plain_cpu(dest) or (
            dest.device.type == "cpu" and dest.is_contiguous() and _bytes_of(dest) is not None
        )
        target = dest if direct else torch.empty(dest.shape, dtype=dest.dtype)
        if not direct:
            self.post_copies.append(_copier(dest, target))
        reads, copies = regions(target, entry, key, box_offset, self.ckpt.dir)
        self.reads.extend(reads)
        self.post_copies[:0] = copies  # they fill ``target`` before it is copied anywhere


def regions(
    target: torch.Tensor, entry: TensorEntry, key: str, box_offset: Iterable[int] | None, where: str
) -> tuple[list[Read], list[Callable[[], Any]]]:
    """The reads filling the contiguous CPU (or meta) tensor ``target``, the box of the
    global tensor at ``box_offset`` (the whole tensor by default), from every saved shard
    that overlaps it, and the copies that must follow them (parts of shards read into
    buffers). CorruptCheckpointError (naming ``where``, the checkpoint) when the shards do not
    cover the box."""
    box = tuple(box_offset) if box_offset is not None else (0,) * target.dim()
    reads: list[Read] = []
    copies: list[Callable[[], Any]] = []
    covered = 0
    for shard in entry.shards:
        covered += _fill_from(target, box, shard, key, reads, copies, where)
    if covered != target.numel():
        raise CorruptCheckpointError(
            f"{where}: the saved shards of {key!r} cover {covered} of the "
            f"{target.numel()} elements needed at {list(box)}"
        )
    return reads, copies


def _fill_from(
    target: torch.Tensor,
    box_offset: tuple,
    shard: ShardRef,
    key: str,
    reads: list[Read],
    copies: list[Callable[[], Any]],
    where: str,
) -> int:
    """Plan reading the part of one saved shard that overlaps the target box into ``reads``
    and ``copies``; return its elements."""
    s_off, s_shape = shard.global_offset, shard.shape
    if s_off == box_offset and s_shape == target.shape:  # the same box: read in place
        numel = target.numel()
        if not numel:  # a dimension of size 0: nothing to read
            return 0
        if numel * target.element_size() != shard.nbytes:
            raise CorruptCheckpointError(
                f"{where}: shard of {key!r} at {list(s_off)} holds {shard.nbytes} "
                f"bytes, expected {numel * target.element_size()}"
            )
        # a plain CPU tensor is read into as it is (reads.py views its bytes by address)
        reads.append(
            Read(
                shard.file,
                shard.offset,
                shard.nbytes,
                target if plain_cpu(target) else _bytes_of(target),
                shard.checksums,
                key,
            )
        )
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
        raise CorruptCheckpointError(
            f"{where}: shard of {key!r} at {list(s_off)} "
            f"holds {shard.nbytes} bytes, expected {numel * elem}"
        )
    if s_off == box_offset and s_shape == tuple(target.shape):  # the same box: read in place
        if numel:
            reads.append(
                Read(
                    shard.file, shard.offset, shard.nbytes, _bytes_of(target), shard.checksums, key
                )
            )
        return numel
    if (
        target.dim()
        and s_shape[1:] == tuple(target.shape[1:])
        and s_off[1:] == box_offset[1:]
        and lo[0] == s_off[0]
        and hi[0] == s_off[0] + s_shape[0]
    ):
        # The whole shard is a run of full rows of the target: read it straight into them.
        row = shard.nbytes // s_shape[0] if s_shape[0] else 0
        start = (s_off[0] - box_offset[0]) * row
        flat = _bytes_of(target)
        assert flat is not None  # a target is contiguous: a live tensor (_fill) or a temporary
        reads.append(
            Read(
                shard.file,
                shard.offset,
                shard.nbytes,
                flat[start : start + shard.nbytes],
                shard.checksums,
                key,
            )
        )
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
    if first is None or last is None:
        raise CorruptCheckpointError(
            f"{where}: the checksum pieces of {key!r} at {list(s_off)} "
            f"do not cover its rows [{r0}, {r1})"
        )
    # A piece may start inside an element (the format bounds pieces in bytes only): the
    # buffer starts ``lead`` bytes early, so that the rows land at an offset that is a
    # multiple of the element size and can be viewed as elements.
    lead = first % elem
    buf = torch.empty(lead + last - first, dtype=torch.uint8, device=target.device)
    reads.append(
        Read(shard.file, shard.offset + first, last - first, buf[lead:], pieces, key, first)
    )
    start = lead + r0 * row - first
    rows = buf[start : start + (r1 - r0) * row].view(target.dtype)
    rows = rows.reshape((r1 - r0,) + s_shape[1:])
    src, dst = rows, target
    for dim in range(target.dim()):
        if dim:
            src = src.narrow(dim, lo[dim] - s_off[dim], hi[dim] - lo[dim])
        dst = dst.narrow(dim, lo[dim] - box_offset[dim], hi[dim] - lo[dim])
    copies.append(_copier(dst, src))
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
        steps.append(
            "give each mismatched container that holds tensors or objects the saved "
            "length and keys, each tensor the saved shape and dtype (cast=True converts "
            "between floating-point dtypes), each object the saved type -- or, in your "
            "own dict or list, set it to None, which takes whatever was saved"
        )
    if report.missing:
        steps.append("remove the keys the checkpoint lacks")
    text = (
        f"To restore the saved data, before restoring {'; '.join(steps)}. load() returns "
        "the saved state as new objects."
    )
    if report.unexpected or report.mismatched:
        return text + " strict=False would skip what is listed here, dropping its saved data."
    return (
        text + " Or pass strict=False: everything saved is restored, and the keys the "
        "checkpoint lacks keep their live values."
    )


def _replaced(result: Any, live: Any, path: tuple) -> list[tuple]:
    """The paths of what an in-place restore would have to put in place of ``live``
    (:meth:`_Matcher.match_root`): nothing where ``result`` is ``live`` itself or an equal plain
    value; the items of a tuple rebuilt as a tuple, one by one; else ``path`` itself."""
    if isinstance(live, Capture):  # a capture policy's wrapper: its value is what is filled
        live = live.value
    if (
        result is live or type(result) is type(live) and type(live) in _IMMUTABLE and result == live
    ):  # the same value: nothing to replace
        return []
    if type(live) is tuple and type(result) is tuple and len(result) == len(live):
        return [
            found
            for i, (r, item) in enumerate(zip(result, live))
            for found in _replaced(r, item, path + (i,))
        ]
    return [path]

"""Resharding restores into live shards of every layout and dtype, at every world size.

A checkpoint saved by 1, 2, 3, 4 or 8 ranks (threads joined by one in-process store, each saving
its rows of every tensor as a ``TensorShard``) is restored, rank by rank, into the ``TensorShard``
boxes of 1, 2, 3, 4 or 8 ranks sharding dimension 0 or 1 (``torch.chunk``'s split, as DTensor's
``Shard`` places it: uneven, with empty boxes at the end). Every local tensor has one of the
layouts a live shard takes (transposed, a step in its last or first dimension, a storage offset,
channels-last, any stride in its dimensions of size 1, a zero-size dimension), in every dtype of
the format; a tensor subclass, a lazy conjugate or negative view. Each box must end up holding
exactly its part of the saved tensor, in the live memory (same tensor objects, same strides), the
memory around it untouched; a box torch cannot write into (an ``expand()``-ed one) is refused
before anything is read, with a StateMismatchError naming its key, dtype, shape and strides.

The same tensors on the save side: those not saved by address (a subclass, a conjugate view; on
CUDA, every one) go through their row-major bytes (``format.codec.tensor_bytes``), and so do the
digests of declared replicas, ``fingerprint`` and the ``torch.distributed.checkpoint`` writer; a
one-element tensor of stride 4, which ``reshape(-1).view(torch.uint8)`` refuses, is among them.
"""

from __future__ import annotations

import threading

import pytest
import torch

import datastates
from datastates import Checkpointer, CheckpointConfig, TensorShard
from datastates.commit.round import MemoryStore, StoreCommunicator
from datastates.providers import ProviderRegistry
from datastates.restore.reader import Reader

NAME = "step-0000000001"
WORLDS = (1, 2, 3, 4, 8)
DTYPES = [
    d
    for d in (
        torch.float16,
        torch.bfloat16,
        torch.float32,
        torch.float64,
        torch.int8,
        torch.uint8,
        torch.bool,
        torch.int64,
        torch.complex64,
        getattr(torch, "float8_e4m3fn", None),
        getattr(torch, "float8_e5m2", None),
    )
    if d is not None
]
#: Global shapes: rows that 8 ranks split unevenly, a single column (boxes of one element at
#: 8 ranks), an image batch (channels-last), and a tensor with no elements.
SHAPES = {"m": (9, 6), "col": (8, 1), "img": (5, 3, 2, 4), "z": (4, 0)}
LAYOUTS = (
    "contiguous",
    "transposed",
    "step_last",
    "step_first",
    "offset",
    "channels_last",
    "size1_strides",
    "subclass",
)


class _Subclass(torch.Tensor):
    """A tensor subclass: saved and restored through a byte view of it, not by address as
    a plain tensor is."""


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """The elements of ``t`` in row-major order, as bytes (any layout)."""
    return t.clone(memory_format=torch.contiguous_format).reshape(-1).view(torch.uint8)


def _random(shape: tuple, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bit patterns of ``dtype`` (NaNs and infinities included), 0/1 for bool."""
    g = torch.Generator().manual_seed(seed)
    numel = 1
    for n in shape:
        numel *= n
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    raw = torch.randint(0, 256, (numel * dtype.itemsize,), generator=g, dtype=torch.uint8)
    return raw.view(dtype).reshape(shape)


def _chunk(n: int, world: int, rank: int) -> tuple[int, int]:
    """(start, length) of ``rank``'s part of ``n`` rows split as ``torch.chunk`` splits them."""
    size = -(-n // world) if n else 0
    start = min(n, rank * size)
    return start, min(n, start + size) - start


def _box(shape: tuple, dim: int, world: int, rank: int) -> tuple[tuple, tuple]:
    """(offset, shape) of ``rank``'s box of a tensor of ``shape`` sharded along ``dim``."""
    start, length = _chunk(shape[dim], world, rank)
    offset = tuple(start if d == dim else 0 for d in range(len(shape)))
    return offset, tuple(length if d == dim else n for d, n in enumerate(shape))


def _part(full: torch.Tensor, offset: tuple, shape: tuple) -> torch.Tensor:
    for d, (o, n) in enumerate(zip(offset, shape)):
        full = full.narrow(d, o, n)
    return full


def _contiguous_strides(shape: tuple) -> list[int]:
    strides, step = [], 1
    for n in reversed(shape):
        strides.insert(0, step)
        step *= max(n, 1)
    return strides


def _live(layout: str, shape: tuple, dtype: torch.dtype, seed: int):
    """(base, local): a local tensor of ``shape`` in ``layout``, a view of the contiguous
    ``base`` (random bytes), which holds more memory than ``local`` for most layouts."""
    n = len(shape)
    if layout == "contiguous":
        base = _random(shape, dtype, seed)
        return base, base
    if layout == "transposed":  # every dimension reversed, three elements of offset
        numel = 1
        for s in shape:
            numel *= s
        base = _random((numel + 3,), dtype, seed)
        return base, base[3:].view(shape[::-1]).permute(*reversed(range(n)))
    if layout == "step_last":  # stride 2 in the last dimension, one element of offset
        base = _random(shape[:-1] + (2 * shape[-1] + 1,), dtype, seed)
        return base, base[..., 1::2]
    if layout == "step_first":
        base = _random((2 * shape[0] + 1,) + shape[1:], dtype, seed)
        return base, base[1::2]
    if layout == "offset":
        numel = 1
        for s in shape:
            numel *= s
        base = _random((numel + 5,), dtype, seed)
        return base, base[5:].view(shape)
    if layout == "channels_last":  # dimension 1 stored last (NHWC for a 4-d tensor)
        stored = (shape[0],) + shape[2:] + (shape[1],)
        base = _random(stored, dtype, seed)
        return base, base.permute(0, n - 1, *range(1, n - 1))
    if layout == "size1_strides":  # a contiguous tensor whose size-1 dims have stride 5
        strides = [5 if s == 1 else st for s, st in zip(shape, _contiguous_strides(shape))]
        span = 1 + sum((s - 1) * st for s, st in zip(shape, strides)) if all(shape) else 0
        base = _random((span + 5,), dtype, seed)
        return base, base.as_strided(shape, strides, 2)
    if layout == "subclass":  # not a plain tensor: its memory is reached through a byte view
        base, local = _live("size1_strides", shape, dtype, seed)
        return base, local.as_subclass(_Subclass)
    if layout == "expanded":  # dimension 0 of stride 0
        base = _random((1,) + shape[1:], dtype, seed)
        return base, base.expand(shape)
    raise AssertionError(layout)


def _full(key: str, dtype: torch.dtype) -> torch.Tensor:
    return _random(SHAPES[key], dtype, seed=100 * list(SHAPES).index(key) + DTYPES.index(dtype))


def _keys():
    return [(f"{str(d).replace('torch.', '')}/{k}", k, d) for d in DTYPES for k in SHAPES]


def _save(root: str, world: int) -> None:
    """``world`` ranks save their rows (dimension 0) of every tensor as TensorShards."""
    store, errors = MemoryStore(), []

    def rank(r: int) -> None:
        try:
            comm = StoreCommunicator(store, r, world, "run")
            state = {}
            for name, key, dtype in _keys():
                full = _full(key, dtype)
                offset, shape = _box(tuple(full.shape), 0, world, r)
                state[name] = TensorShard(_part(full, offset, shape).clone(), full.shape, offset)
            with Checkpointer(root, CheckpointConfig(), communicator=comm) as ckpt:
                ckpt.save(state, step=1).wait(60)
        except BaseException as exc:  # reported by the fixture
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[int, str]:
    """The checkpoint directory saved at each world size of WORLDS."""
    out = {}
    for world in WORLDS:
        root = tmp_path_factory.mktemp(f"saved{world}")
        _save(str(root), world)
        out[world] = str(root / NAME)
    return out


def _live_state(layout: str, world: int, rank: int, dim: int) -> tuple[dict, dict]:
    """The live state of ``rank`` of ``world`` sharding dimension ``dim`` of every tensor, its
    local tensors in ``layout``, and for each key (base, local, its strides, box offset, the
    base as the restore must leave it)."""
    state, checks = {}, {}
    for i, (name, key, dtype) in enumerate(_keys()):
        full = _full(key, dtype)
        offset, shape = _box(tuple(full.shape), dim, world, rank)
        base, local = _live(layout, shape, dtype, seed=10_000 + i)
        expected = base.clone()
        if not (layout == "expanded" and _overlapping(local)):
            expected.as_strided(local.shape, local.stride(), local.storage_offset()).copy_(
                _part(full, offset, shape)
            )
        state[name] = TensorShard(local, full.shape, offset)
        checks[name] = (base, local, tuple(local.stride()), offset, expected)
    return state, checks


def _overlapping(t: torch.Tensor) -> bool:
    return t.numel() > 0 and any(st == 0 and n > 1 for n, st in zip(t.shape, t.stride()))


def _reader(ckpt_dir: str, rank: int, world: int) -> Reader:
    return Reader(
        ckpt_dir, registry=ProviderRegistry.default(), rank=rank, world_size=world, threads=2
    )


def _assert_restored(state: dict, checks: dict, names) -> None:
    for name in names:
        base, local, strides, offset, expected = checks[name]
        shard = state[name]
        assert shard.local is local and tuple(local.stride()) == strides, name
        assert local.untyped_storage().data_ptr() == base.untyped_storage().data_ptr(), name
        key, dtype = name.split("/")[1], local.dtype
        assert torch.equal(
            _bytes(local), _bytes(_part(_full(key, dtype), offset, tuple(local.shape)))
        ), name
        assert torch.equal(_bytes(base), _bytes(expected)), f"{name}: memory around the box"


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("saved_world", WORLDS)
def test_every_box_restores_bit_exact_in_its_live_layout(saved, saved_world, layout):
    """Every rank of every world size, sharding either dimension, gets its box bit-exact in
    its live tensor of ``layout``, for every dtype, and nothing around the box changes."""
    for world in WORLDS:
        for rank in range(world):
            with _reader(saved[saved_world], rank, world) as r:
                for dim in (0, 1):
                    state, checks = _live_state(layout, world, rank, dim)
                    report = r.restore_into(state)
                    assert sorted(report.restored) == sorted(state), (world, dim, rank)
                    _assert_restored(state, checks, state)


@pytest.mark.parametrize("saved_world", WORLDS)
def test_an_expanded_box_is_refused_before_anything_is_read(saved, saved_world):
    """A live box of stride 0 over more than one row cannot hold distinct rows: a strict
    restore raises StateMismatchError (a DatastatesError) naming it, and no live tensor changes;
    with strict=False exactly those boxes are reported and skipped, the others restored."""
    for world in (1, 3, 8):
        for rank in range(world):
            state, checks = _live_state("expanded", world, rank, 0)
            refused = sorted(n for n, (_, local, *_) in checks.items() if _overlapping(local))
            before = {name: base.clone() for name, (base, *_) in checks.items()}
            with _reader(saved[saved_world], rank, world) as r:
                if refused:
                    with pytest.raises(datastates.StateMismatchError) as info:
                        r.restore_into(state)
                    assert isinstance(info.value, datastates.DatastatesError)
                    local = checks[refused[0]][1]
                    assert (
                        f"{refused[0]} (the live tensor overlaps itself: dimension 0 of "
                        f"size {local.shape[0]} has stride 0" in str(info.value)
                    )
                    assert (
                        f"it is {refused[0].split('/')[0]}{list(local.shape)} of strides "
                        f"{list(local.stride())}" in str(info.value)
                    )
                    for name, (base, *_) in checks.items():
                        assert torch.equal(_bytes(base), _bytes(before[name])), name
                report = r.restore_into(state, strict=False)
            assert sorted(m.split(" ")[0] for m in report.mismatched) == refused
            assert sorted(report.restored) == sorted(set(state) - set(refused))
            _assert_restored(state, checks, report.restored)


@pytest.mark.parametrize("saved_world", (3, 8))
def test_conjugate_and_negative_views_restore_their_values(saved, saved_world):
    """A box that is a lazy conjugate (complex) or negative (signed) view, whose memory holds
    the conjugate or negation of its values: after the restore its values are the saved ones,
    and its memory their conjugate or negation."""
    views = {
        "complex64": torch.Tensor.conj,
        "float32": torch._neg_view,
        "int64": torch._neg_view,
        "bfloat16": torch._neg_view,
    }
    for world in (2, 4):
        for rank in range(world):
            state, checks = {}, {}
            for name, key, dtype in _keys():
                kind = name.split("/")[0]
                if kind not in views:
                    continue
                full = _full(key, dtype)
                offset, shape = _box(tuple(full.shape), 1, world, rank)
                base = _random(shape, dtype, seed=3)
                state[name] = TensorShard(views[kind](base), full.shape, offset)
                checks[name] = (base, _part(full, offset, shape))
            with _reader(saved[saved_world], rank, world) as r:
                assert sorted(r.restore_into(state, keys=list(state)).restored) == sorted(state)
            for name, (base, part) in checks.items():
                local = state[name].local
                assert local.is_conj() or local.is_neg(), name
                assert torch.equal(_bytes(local.resolve_conj().resolve_neg()), _bytes(part)), name
                memory = part.conj() if local.is_conj() else -part
                assert torch.equal(_bytes(base), _bytes(memory.resolve_conj().resolve_neg())), name


# ---------------------------------------------------------------- the saved bytes of such tensors


def _one_element(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(base, one element of it): a contiguous (1, 1) view of stride 4 in its last dimension,
    which ``reshape(-1).view(torch.uint8)`` refuses for elements wider than a byte."""
    base = _random((2, 4), dtype, seed=7)
    return base, base.t()[1:2, :1]


def _saved_forms(dtype: torch.dtype) -> dict:
    base, odd = _one_element(dtype)
    forms = {
        "subclass": odd.as_subclass(_Subclass),
        "box": TensorShard(odd.as_subclass(_Subclass), (1, 1), (0, 0)),
    }
    if dtype.is_complex:
        forms["conj"] = base[:, 1:].conj()  # a lazy conjugate: its bytes are not its values
    return forms


@pytest.mark.parametrize("dtype", DTYPES)
def test_tensors_saved_through_their_flat_bytes_keep_their_values(tmp_path, dtype):
    """A tensor that is not a plain CPU one (a subclass, a lazy conjugate; on CUDA, any) is
    saved through its row-major bytes: a one-element one of stride 4, or a conjugate view,
    loads with the values it had, bit-exact."""
    forms = _saved_forms(dtype)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(forms, step=1).wait(60)
        loaded = ckpt.load()
    for name, value in forms.items():
        value = value.local if isinstance(value, TensorShard) else value
        assert torch.equal(
            _bytes(loaded[name]), _bytes(value.resolve_conj().as_subclass(torch.Tensor))
        ), name


@pytest.mark.parametrize("dtype", [torch.float16, torch.complex64])
def test_replicated_tensors_of_odd_strides_are_digested(tmp_path, dtype):
    """Two ranks saving declared replicas (``replicated=True``, checked across ranks) of a
    one-element tensor of stride 4 and of a conjugate view commit, and load bit-exact."""
    base, odd = _one_element(dtype)
    state = {"odd": odd, "conj": base[:, 1:].conj() if dtype.is_complex else base[:, 1:]}
    store, errors = MemoryStore(), []

    def rank(r: int) -> None:
        try:
            comm = StoreCommunicator(store, r, 2, "run")
            with Checkpointer(
                tmp_path, CheckpointConfig(replica_check=True), communicator=comm
            ) as ckpt:
                ckpt.save(state, step=1, replicated=True).wait(60)
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    with Checkpointer(tmp_path) as ckpt:
        loaded = ckpt.load()
    for name, value in state.items():
        assert torch.equal(_bytes(loaded[name]), _bytes(value.resolve_conj())), name


def test_fingerprints_and_dcp_writes_take_the_values_of_such_tensors(tmp_path):
    """``fingerprint`` digests the values (a one-element tensor of stride 4 digests as its
    contiguous copy, a conjugate view as its resolved values), and a DatastatesWriter folder
    written by ``torch.distributed.checkpoint`` loads them back bit-exact."""
    from datastates.tools.fingerprint import fingerprint

    dcp = pytest.importorskip("torch.distributed.checkpoint")
    from datastates.integrations.dcp import DatastatesReader, DatastatesWriter

    base, odd = _one_element(torch.complex64)
    conj = base[:, 1:].conj()
    plain = {"odd": odd.clone(memory_format=torch.contiguous_format), "conj": conj.resolve_conj()}
    assert fingerprint({"odd": odd, "conj": conj}) == fingerprint(plain)
    folder = str(tmp_path / "dcp")
    dcp.save({"odd": odd, "conj": conj}, storage_writer=DatastatesWriter(folder), no_dist=True)
    loaded = {k: torch.zeros_like(v) for k, v in plain.items()}
    dcp.load(loaded, storage_reader=DatastatesReader(folder), no_dist=True)
    for name, value in plain.items():
        assert torch.equal(_bytes(loaded[name]), _bytes(value)), name

"""Restoring across floating-point dtypes, only when asked: ``restore(..., cast=True)`` and
``load(dtype=...)``.

A saved float32 tensor restores into a live bfloat16 (or float16) tensor, and back, with
``cast=True``: the bytes are read and checked as saved, then converted by torch
(``live.copy_(saved)``), so the live tensor holds exactly ``saved.to(live.dtype)``. By default a
dtype difference stays a mismatch, and integer, bool and complex tensors are never cast. Every
cast key is listed in the report. A damaged checkpoint raises the same CorruptCheckpointError as
without ``cast``, before any cast tensor changes.
"""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

import datastates
from datastates import Checkpointer, StateMismatchError, TensorShard
from testkit import SMALL


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8),
            b.contiguous().reshape(-1).view(torch.uint8),
        )
    )


def _saved(tmp_path, state: dict) -> None:
    with Checkpointer(tmp_path, SMALL) as ck:
        ck.save(state, step=1).wait()


def _restore(tmp_path, live: dict, **kwargs):
    with Checkpointer(tmp_path, SMALL) as ck:
        return ck.restore(live, **kwargs)


def _randn(*shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


# ---------------------------------------------------------------- casting when asked


@pytest.mark.parametrize(
    "saved_dtype, live_dtype",
    [
        (torch.float32, torch.bfloat16),
        (torch.float32, torch.float16),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float32),
        (torch.float64, torch.bfloat16),
    ],
)
def test_cast_restores_saved_to_the_live_dtype_bit_for_bit(tmp_path, saved_dtype, live_dtype):
    w = _randn(64, 300, dtype=saved_dtype)
    _saved(tmp_path, {"model": {"w": w}})
    live = {"model": {"w": torch.zeros(64, 300, dtype=live_dtype)}}
    target = live["model"]["w"]
    report = _restore(tmp_path, live, cast=True)
    assert live["model"]["w"] is target
    assert _same_bits(target, w.to(live_dtype))
    name = lambda d: str(d).replace("torch.", "")  # noqa: E731
    assert report.cast == [f"model/w ({name(saved_dtype)} -> {name(live_dtype)})"]
    assert report.restored == ["model/w"] and report.mismatched == []
    assert report.nbytes == w.numel() * w.element_size()


def test_a_bfloat16_checkpoint_restores_into_float32_exactly(tmp_path):
    w = _randn(1000, dtype=torch.bfloat16, seed=3)
    _saved(tmp_path, {"w": w})
    live = {"w": torch.zeros(1000)}
    _restore(tmp_path, live, cast=True)
    assert _same_bits(live["w"].to(torch.bfloat16), w)  # every bfloat16 is a float32
    assert _same_bits(live["w"], w.float())


def test_cast_model_matching_tensors_are_read_as_usual(tmp_path):
    """A float32 module restored into its bfloat16 copy; an int64 buffer of the same dtype and
    a float32 tensor of the same dtype are restored as they are, and are not listed as cast."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.Linear(64, 8))
    extra = _randn(10, seed=5)
    _saved(tmp_path, {"model": model, "extra": extra})
    torch.manual_seed(1)
    live_model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.Linear(64, 8)).to(
        torch.bfloat16
    )
    live = {"model": live_model, "extra": torch.zeros(10)}
    report = _restore(tmp_path, live, cast=True)
    for key, saved in model.state_dict().items():
        expected = saved.to(torch.bfloat16) if saved.is_floating_point() else saved
        assert _same_bits(live_model.state_dict()[key], expected), key
    assert _same_bits(live["extra"], extra)
    cast = {entry.split(" ")[0] for entry in report.cast}
    floats = {f"model/{k}" for k, v in model.state_dict().items() if v.is_floating_point()}
    assert cast == floats and "model/1.num_batches_tracked" in report.restored
    assert not report.mismatched


def test_cast_into_a_non_contiguous_live_tensor(tmp_path):
    w = _randn(12, 8)
    _saved(tmp_path, {"w": w})
    base = torch.zeros(8, 12, dtype=torch.bfloat16)
    live = {"w": base.t()}
    _restore(tmp_path, live, cast=True)
    assert _same_bits(base.t().contiguous(), w.to(torch.bfloat16))


@pytest.mark.parametrize(
    "offset, local_shape", [((4, 0), (4, 8)), ((0, 4), (12, 4)), ((3, 2), (5, 3))]
)
def test_cast_into_a_sharded_live_tensor_reads_its_box(tmp_path, offset, local_shape):
    w = _randn(12, 8, seed=7)
    _saved(tmp_path, {"w": w})
    local = torch.zeros(local_shape, dtype=torch.bfloat16)
    report = _restore(tmp_path, {"w": TensorShard(local, (12, 8), offset)}, cast=True)
    box = w[offset[0] : offset[0] + local_shape[0], offset[1] : offset[1] + local_shape[1]]
    assert _same_bits(local, box.to(torch.bfloat16))
    assert report.cast == ["w (float32 -> bfloat16)"]


def test_many_cast_tensors_each_get_their_own_values(tmp_path):
    saved = {f"t{i}": _randn(7 + i, 5, seed=i) for i in range(40)}
    _saved(tmp_path, saved)
    live = {k: torch.zeros(v.shape, dtype=torch.float16) for k, v in saved.items()}
    report = _restore(tmp_path, live, cast=True)
    for k, v in saved.items():
        assert _same_bits(live[k], v.to(torch.float16)), k
    assert len(report.cast) == 40


# ---------------------------------------------------------------- refused unless asked, or not float


def test_by_default_a_dtype_difference_is_a_mismatch(tmp_path):
    w = _randn(16)
    _saved(tmp_path, {"w": w})
    live = {"w": torch.zeros(16, dtype=torch.bfloat16)}
    with pytest.raises(
        StateMismatchError,
        match=r"w \(checkpoint float32\[16\], live "
        r"bfloat16\[16\]\)",
    ):
        _restore(tmp_path, live)
    assert _same_bits(live["w"], torch.zeros(16, dtype=torch.bfloat16))
    report = _restore(tmp_path, live, strict=False)
    assert report.mismatched == ["w (checkpoint float32[16], live bfloat16[16])"]
    assert report.cast == [] and report.restored == []
    assert _same_bits(live["w"], torch.zeros(16, dtype=torch.bfloat16))


@pytest.mark.parametrize(
    "saved, live",
    [
        (torch.arange(6, dtype=torch.int64), torch.zeros(6, dtype=torch.int32)),
        (torch.arange(6, dtype=torch.int32), torch.zeros(6, dtype=torch.float32)),
        (torch.ones(6), torch.zeros(6, dtype=torch.int32)),
        (torch.ones(6, dtype=torch.bool), torch.zeros(6, dtype=torch.uint8)),
        (torch.ones(6, dtype=torch.complex64), torch.zeros(6, dtype=torch.complex128)),
        (torch.ones(6, dtype=torch.complex64), torch.zeros(6, dtype=torch.float32)),
    ],
)
def test_cast_never_converts_integer_bool_or_complex(tmp_path, saved, live):
    _saved(tmp_path, {"t": saved})
    before = live.clone()
    with pytest.raises(StateMismatchError, match="floating-point dtypes only"):
        _restore(tmp_path, {"t": live}, cast=True)
    report = _restore(tmp_path, {"t": live}, cast=True, strict=False)
    assert len(report.mismatched) == 1 and "floating-point dtypes only" in report.mismatched[0]
    assert report.cast == [] and _same_bits(live, before)


def test_cast_does_not_excuse_a_shape_difference(tmp_path):
    _saved(tmp_path, {"w": _randn(16)})
    live = {"w": torch.zeros(15, dtype=torch.bfloat16)}
    with pytest.raises(
        StateMismatchError,
        match=r"checkpoint float32\[16\], live "
        r"bfloat16\[15\]\)",
    ):
        _restore(tmp_path, live, cast=True)


def test_a_strict_cast_restore_with_a_mismatch_elsewhere_modifies_nothing(tmp_path):
    _saved(tmp_path, {"a": _randn(16), "b": torch.arange(4)})
    live = {"a": torch.zeros(16, dtype=torch.bfloat16), "b": torch.zeros(4, dtype=torch.int32)}
    with pytest.raises(StateMismatchError, match="b "):
        _restore(tmp_path, live, cast=True)
    assert _same_bits(live["a"], torch.zeros(16, dtype=torch.bfloat16))


# ---------------------------------------------------------------- damage


def test_a_damaged_checkpoint_raises_the_same_error_and_leaves_cast_tensors_alone(tmp_path):
    torch.manual_seed(0)
    saved = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 16))
    with Checkpointer(tmp_path, SMALL) as ck:
        path = ck.save({"model": saved}, step=1).wait().path
    shard = next(os.path.join(path, n) for n in os.listdir(path) if n.endswith(".dsf"))
    with open(shard, "r+b") as f:
        middle = os.path.getsize(shard) // 2  # inside the tensor data
        f.seek(middle)
        byte = f.read(1)
        f.seek(middle)
        f.write(bytes([byte[0] ^ 0xFF]))
    torch.manual_seed(1)
    live = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 16)).to(torch.bfloat16)
    before = {k: v.clone() for k, v in live.state_dict().items()}
    with pytest.raises(datastates.CorruptCheckpointError, match="checksum mismatch"):
        _restore(tmp_path, {"model": live}, cast=True)
    for key, value in live.state_dict().items():
        assert _same_bits(value, before[key]), key


# ---------------------------------------------------------------- load(dtype=...)


def test_load_with_a_dtype_converts_floating_tensors_only(tmp_path):
    saved = {
        "w": _randn(5, 3),
        "h": _randn(4, dtype=torch.float16, seed=1),
        "i": torch.arange(5),
        "b": torch.tensor([True, False]),
        "c": torch.ones(2, dtype=torch.complex64),
        "nested": [_randn(3, seed=2), 7],
    }
    _saved(tmp_path, saved)
    with Checkpointer(tmp_path, SMALL) as ck:
        loaded = ck.load(dtype=torch.bfloat16)
        plain = ck.load()
    assert _same_bits(loaded["w"], saved["w"].to(torch.bfloat16))
    assert _same_bits(loaded["h"], saved["h"].to(torch.bfloat16))
    assert _same_bits(loaded["nested"][0], saved["nested"][0].to(torch.bfloat16))
    assert loaded["nested"][1] == 7
    for key in ("i", "b", "c"):
        assert _same_bits(loaded[key], saved[key]), key
    assert _same_bits(plain["w"], saved["w"])


@pytest.mark.parametrize("dtype", [torch.int32, "bfloat16", torch.complex64])
def test_load_refuses_a_dtype_that_is_not_floating_point(tmp_path, dtype):
    _saved(tmp_path, {"w": _randn(3)})
    with Checkpointer(tmp_path, SMALL) as ck:
        with pytest.raises(datastates.ConfigError, match="floating-point torch.dtype"):
            ck.load(dtype=dtype)

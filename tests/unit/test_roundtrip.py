"""Bit-exact round trips of realistic training state."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

import datastates
from datastates import CheckpointConfig, Checkpointer

from helpers import assert_same, clone_state, make_training, train_step
from testkit import SMALL


def odd_tensors():
    base = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    shared = torch.randn(10)
    return {
        "f32": torch.randn(3, 5),
        "bf16": torch.randn(7, 3).to(torch.bfloat16),
        "f16": torch.randn(4).to(torch.float16),
        "i64": torch.randint(-(2**40), 2**40, (9,)),
        "bool": torch.rand(11) > 0.5,
        "u8": torch.randint(0, 255, (5,), dtype=torch.uint8),
        "noncontig": base.t(),
        "strided": base[::2, 1::3],
        "empty": torch.empty(0, 4),
        "scalar": torch.tensor(3.25, dtype=torch.float64),
        "shared_a": shared,
        "shared_b": shared,
        "big": torch.randn(70_000),  # larger than a unit: split over several
    }


@pytest.mark.parametrize("config", [CheckpointConfig(), SMALL], ids=["default", "tiny-cache"])
def test_realistic_state_round_trip(tmp_path, config):
    model, opt, sched, loader = make_training()
    for _ in range(3):
        train_step(model, opt, sched, loader)
    random.seed(7)
    np.random.seed(7)
    extra = {
        "notes": {"epoch": 3, "tags": ("a", "b"), "lr_hist": [0.1, 0.05], "none": None},
        "tensors": odd_tensors(),
        7: "int key",
        "nested": [[1, {"x": 2.5}], ()],
    }
    reference = clone_state(
        {
            "model": model.state_dict(),
            "opt": opt.state_dict(),
            "sched": sched.state_dict(),
            "loader": loader.state_dict(),
            "extra": extra,
        }
    )
    torch_rng, py_rng, np_rng = torch.get_rng_state(), random.getstate(), np.random.get_state()
    state = {
        "model": model,
        "opt": opt,
        "sched": sched,
        "loader": loader,
        "rng": datastates.RNGState(),
        "extra": extra,
    }
    with Checkpointer(tmp_path, config) as ckpt:
        ckpt.save(state, step=3).wait()
        # Fresh objects: restore into them in place and compare to the reference.
        model2, opt2, sched2, loader2 = make_training(seed=99)
        torch.manual_seed(1), random.seed(1), np.random.seed(1)
        ckpt.restore(
            {
                "model": model2,
                "opt": opt2,
                "sched": sched2,
                "loader": loader2,
                "rng": datastates.RNGState(),
                "extra": {},
            },
            strict=False,
        )
        loaded = ckpt.load()
    assert torch.equal(torch.get_rng_state(), torch_rng)
    assert random.getstate() == py_rng
    assert all(
        np.array_equal(a, b) if isinstance(a, np.ndarray) else a == b
        for a, b in zip(np.random.get_state(), np_rng)
    )
    assert_same(reference["model"], model2.state_dict())
    assert_same(reference["opt"], opt2.state_dict())
    assert_same(reference["sched"], sched2.state_dict())
    assert loader2.state_dict() == reference["loader"]
    assert_same(reference["extra"], loaded["extra"])
    assert_same(reference["model"], dict(loaded["model"]))
    assert_same(reference["opt"], loaded["opt"])
    # Non-contiguous tensors come back contiguous with the same values; shared storage stays shared.
    t = loaded["extra"]["tensors"]
    assert t["shared_a"] is t["shared_b"]
    tied = loaded["model"]
    assert tied["wte.weight"] is tied["lm_head.weight"]


def test_shared_storage_written_once(tmp_path):
    shared = torch.randn(100_000)
    with Checkpointer(tmp_path) as ckpt:
        info_one = ckpt.save({"a": shared}, step=1).wait()
        info_two = ckpt.save({"a": shared, "b": shared}, step=2).wait()
    assert info_two.nbytes - info_one.nbytes < 4096


def test_load_subset_of_keys_and_map_location(tmp_path):
    model, opt, sched, loader = make_training()
    train_step(model, opt, sched, loader)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save({"model": model, "opt": opt, "extra": {"x": torch.ones(3)}}, step=1).wait()
        part = ckpt.load(keys=["extra"], map_location="cpu")
        assert list(part) == ["extra"]
        assert torch.equal(part["extra"]["x"], torch.ones(3))
        one = ckpt.load(keys="model/wte.weight")
        assert list(one["model"]) == ["wte.weight"]
        assert torch.equal(one["model"]["wte.weight"], model.wte.weight.detach())
        fresh, *_ = make_training(seed=5)
        report = ckpt.restore({"model": fresh}, keys=["model"])
        assert "model/wte.weight" in report.restored
    assert_same(model.state_dict(), fresh.state_dict())


def test_list_latest_metadata_and_tags(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        assert ckpt.latest() is None and ckpt.list() == []
        ckpt.save({"x": torch.zeros(2)}, step=5, metadata={"loss": 1.5}).wait()
        ckpt.save({"x": torch.ones(2)}, tag="best", metadata={"loss": 0.5}).wait()
        names = [i.name for i in ckpt.list()]
        assert names == ["step-0000000005", "best"]  # commit order, steps and tags alike
        assert [i.seq for i in ckpt.list()] == [1, 2]
        assert ckpt.latest().name == "best"
        assert ckpt.latest().metadata == {"loss": 0.5}
        assert torch.equal(ckpt.load(step=5)["x"], torch.zeros(2))
        assert torch.equal(ckpt.load(tag="best")["x"], torch.ones(2))
        assert torch.equal(ckpt.load()["x"], torch.ones(2))


def test_retention_keeps_last_and_every(tmp_path):
    config = CheckpointConfig(keep_last=2, keep_every=4)
    with Checkpointer(tmp_path, config) as ckpt:
        for step in range(1, 10):
            ckpt.save({"x": torch.full((3,), float(step))}, step=step).wait()
        steps = [i.step for i in ckpt.list()]
    assert steps == [4, 8, 9]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_overwrite_replaces_atomically(tmp_path):
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save({"x": torch.zeros(4)}, tag="last").wait()
        with pytest.raises(datastates.CheckpointExistsError):
            ckpt.save({"x": torch.ones(4)}, tag="last")
        ckpt.save({"x": torch.ones(4)}, tag="last", overwrite=True).wait()
        assert torch.equal(ckpt.load(tag="last")["x"], torch.ones(4))
        assert [i.name for i in ckpt.list()] == ["last"]


def test_queued_saves_do_not_mix(tmp_path):
    config = CheckpointConfig(host_cache_bytes=32 << 10, chunk_bytes=8 << 10, max_pending_saves=3)
    tensors = [torch.full((20_000,), float(i)) for i in range(4)]
    with Checkpointer(tmp_path, config) as ckpt:
        handles = [
            ckpt.save({"t": datastates.lazy(t), "i": i}, step=i) for i, t in enumerate(tensors)
        ]
        for h in handles:
            h.wait_snapshot()
        for t in tensors:
            t.add_(100)
        for h in handles:
            h.wait()
        for i in range(4):
            out = ckpt.load(step=i)
            assert out["i"] == i and torch.equal(out["t"], torch.full((20_000,), float(i)))


def test_checkpointers_sharing_one_pipeline(tmp_path):
    config = SMALL
    owner = Checkpointer(tmp_path / "a", config)
    sharer = Checkpointer(tmp_path / "b", share=owner)
    assert sharer.storage._pipeline is owner.storage._pipeline and sharer.config is owner.config
    with pytest.raises(datastates.ConfigError):
        Checkpointer(tmp_path / "c", CheckpointConfig(), share=owner)
    one, two = torch.randn(30_000), torch.randn(30_000)
    ha = owner.save({"t": one}, step=1)
    hb = sharer.save({"t": two}, step=1)
    ha.wait(), hb.wait()
    sharer.close()  # the owner keeps working
    owner.save({"t": two}, step=2).wait()
    assert torch.equal(owner.load(step=1)["t"], one) and torch.equal(owner.load(step=2)["t"], two)
    late = Checkpointer(tmp_path / "d", share=owner)
    owner.close()
    with pytest.raises(RuntimeError, match="shares"):
        late.save({"t": one}, step=1)
    late.close()  # nothing pending: returns at once
    with Checkpointer(tmp_path / "b") as again:
        assert torch.equal(again.load(step=1)["t"], two)


def test_restore_sets_plain_values_of_the_live_containers(tmp_path):
    weights = torch.randn(8)
    state = {"epoch": 3, "history": [0.5, 0.25], "w": weights, "cfg": {"lr": 0.1}}
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save(state, step=3).wait()
        live = {"epoch": 0, "history": [9.0, 9.0], "w": torch.zeros(8), "cfg": {"lr": 1.0}}
        target = live["w"]
        report = ckpt.restore(live)
    assert report.step == 3
    assert live["epoch"] == 3 and live["history"] == [0.5, 0.25] and live["cfg"] == {"lr": 0.1}
    assert live["w"] is target and torch.equal(target, weights)  # tensors: filled in place


@pytest.mark.parametrize("io_mode", ["buffered", "auto"])
def test_io_modes_write_identical_files(tmp_path, io_mode):
    """O_DIRECT (auto, where the file system accepts it) and buffered writes give the same bytes."""
    state = {"a": torch.randn(50_000), "b": torch.arange(7), "c": "text"}
    config = CheckpointConfig(host_cache_bytes=128 << 10, chunk_bytes=32 << 10, io_mode=io_mode)
    with Checkpointer(tmp_path / io_mode, config) as ckpt:
        ckpt.save(state, step=1).wait()
        out = ckpt.load()
    assert torch.equal(out["a"], state["a"]) and torch.equal(out["b"], state["b"])
    assert out["c"] == "text"
    shard = tmp_path / io_mode / "step-0000000001" / "rank-00000.dsf"
    with Checkpointer(tmp_path / "ref", config.replace(io_mode="buffered")) as ref:
        ref.save(state, step=1).wait()
    reference = (tmp_path / "ref" / "step-0000000001" / "rank-00000.dsf").read_bytes()
    assert shard.read_bytes() == reference

"""Hugging Face's own loader reads a ``DatastatesTrainer`` checkpoint in place:
``AutoModelForCausalLM.from_pretrained("out/checkpoint-N")`` gives the model of step N, bit for
bit, tied weights tied, through the ``pytorch_model.bin.index.json`` that names the rank files
(each one's ``torch.load`` view is the model's state dict: ``save(view="model")``). The
``save_model`` folder loads too. The 2-rank case is tests/dist/test_view_dist.py."""

from __future__ import annotations

import json
import os

import pytest
import torch

from testkit import ONE_WRITER

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import (  # noqa: E402
    AutoModelForCausalLM,
    GPT2LMHeadModel,
    TrainerCallback,
)

import datastates  # noqa: E402
from datastates.integrations.hf import WEIGHTS_INDEX, DatastatesTrainer  # noqa: E402
from datastates.tools import cli  # noqa: E402

from test_hf import args, dataset, tiny_model  # noqa: E402  (the same tiny run)

# slow: Hugging Face Trainer runs
pytestmark = pytest.mark.slow


class Snapshot(TrainerCallback):
    """The model's state dict right after the optimizer step ``step`` (what checkpoint-<step>
    holds: the save follows ``on_step_end``), copied."""

    def __init__(self, step):
        self.step, self.params = step, None

    def on_step_end(self, args, state, control, model=None, **kw):
        if state.global_step == self.step:
            self.params = {k: v.detach().clone() for k, v in model.state_dict().items()}


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            control.should_training_stop = True
            control.should_save = True
        return control


def bits(t: torch.Tensor) -> bytes:
    return bytes(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy())


def assert_bit_equal(expected: dict, model) -> None:
    got = model.state_dict()
    assert sorted(got) == sorted(expected)
    for key, value in expected.items():
        assert got[key].dtype == value.dtype and got[key].shape == value.shape, key
        assert bits(got[key]) == bits(value), key


def test_from_pretrained_reads_checkpoint_n_in_place(tmp_path):
    snap = Snapshot(4)
    t = DatastatesTrainer(
        model=tiny_model(),
        args=args(tmp_path),
        train_dataset=dataset(),
        datastates_config=ONE_WRITER,
        callbacks=[snap],
    )
    t.train()
    t.close_checkpointer()
    assert snap.params is not None
    ckpt = tmp_path / "checkpoint-4"
    # the folder: datastates' files, the model's config and the index naming the rank file
    assert not os.path.exists(ckpt / "pytorch_model.bin")
    assert not os.path.exists(ckpt / "model.safetensors")
    with open(ckpt / WEIGHTS_INDEX) as f:
        index = json.load(f)
    assert index["weight_map"] == {k: "rank-00000.dsf" for k in snap.params}
    assert index["metadata"]["total_size"] == sum(
        v.numel() * v.element_size()
        for k, v in snap.params.items()
        if k != "lm_head.weight"  # tied: stored once
    )

    loaded = AutoModelForCausalLM.from_pretrained(ckpt)
    assert isinstance(loaded, GPT2LMHeadModel)
    assert_bit_equal(snap.params, loaded)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    # step 8 is another model, read from its own folder
    final = {k: v.detach().clone() for k, v in t.model.state_dict().items()}
    assert any(bits(final[k]) != bits(snap.params[k]) for k in final)
    assert_bit_equal(final, AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoint-8"))

    # the rank file alone: torch.load gives the model's state dict (tied entries share storage)
    view = torch.load(ckpt / "rank-00000.dsf", weights_only=True, mmap=True)
    assert list(view) == list(snap.params)
    assert view["lm_head.weight"].data_ptr() == view["transformer.wte.weight"].data_ptr()
    # datastates' own reads still see the whole training state, and verify passes
    with datastates.Checkpointer(tmp_path, ONE_WRITER) as c:
        whole = c.load(tag="checkpoint-4")
    assert {"model", "optimizer", "scheduler", "rng", "trainer_state"} <= set(whole)
    assert cli.main(["verify", str(ckpt)]) == 0


def test_resume_from_a_checkpoint_read_in_place_is_bit_identical(tmp_path):
    """The index and the view change nothing of the resume: step 8 after a resume at 4 equals
    the uninterrupted run, and both checkpoint-8 folders load the same weights."""
    full = DatastatesTrainer(
        model=tiny_model(),
        args=args(tmp_path / "full"),
        train_dataset=dataset(),
        datastates_config=ONE_WRITER,
    )
    full.train()
    full.close_checkpointer()
    out = tmp_path / "run"
    first = DatastatesTrainer(
        model=tiny_model(),
        args=args(out),
        train_dataset=dataset(),
        datastates_config=ONE_WRITER,
        callbacks=[StopAt(4)],
    )
    first.train()
    first.close_checkpointer()
    second = DatastatesTrainer(
        model=tiny_model(), args=args(out), train_dataset=dataset(), datastates_config=ONE_WRITER
    )
    second.train(resume_from_checkpoint=str(out / "checkpoint-4"))
    second.close_checkpointer()
    expected = {k: v.detach().clone() for k, v in full.model.state_dict().items()}
    assert_bit_equal(expected, second.model)
    assert_bit_equal(expected, AutoModelForCausalLM.from_pretrained(out / "checkpoint-8"))


def test_save_model_output_loads(tmp_path):
    t = DatastatesTrainer(
        model=tiny_model(),
        args=args(tmp_path / "run", max_steps=2, save_strategy="no"),
        train_dataset=dataset(),
        datastates_config=ONE_WRITER,
    )
    t.train()
    t.save_model(str(tmp_path / "final"))
    t.close_checkpointer()
    expected = {k: v.detach().clone() for k, v in t.model.state_dict().items()}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "final")
    assert_bit_equal(expected, loaded)
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()

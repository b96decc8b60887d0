"""Hugging Face Trainer end to end on a tiny randomly initialised GPT-2 (no download):
asynchronous atomic checkpoints, resume_from_checkpoint=True bit-exact (dropout on, so the RNG
state matters), save_total_limit, and a partial checkpoint that must not be picked."""

from __future__ import annotations

import os

import pytest
import torch

from testkit import ONE_WRITER

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    TrainerCallback,  # noqa: E402
    TrainingArguments,
)

import datastates  # noqa: E402
from datastates.integrations.hf import DatastatesTrainer  # noqa: E402

from integration_helpers import assert_same  # noqa: E402

# slow: Hugging Face Trainer runs
pytestmark = pytest.mark.slow


def tiny_model():
    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(
            n_layer=2,
            n_head=2,
            n_embd=32,
            vocab_size=64,
            n_positions=16,
            resid_pdrop=0.1,
            embd_pdrop=0.1,
        )
    )


def dataset():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 64, (24, 16), generator=g)
    return [{"input_ids": x, "labels": x} for x in ids]


def args(out, **kw):
    base = dict(
        output_dir=str(out),
        max_steps=8,
        save_steps=4,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        save_strategy="steps",
    )
    base.update(kw)
    return TrainingArguments(**base)


class StopAt(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            control.should_training_stop = True
            control.should_save = True
        return control


def params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_hf_trainer_resume_bit_exact(tmp_path):
    full = DatastatesTrainer(
        model=tiny_model(),
        args=args(tmp_path / "full"),
        train_dataset=dataset(),
        datastates_config=ONE_WRITER,
    )
    full.train()
    continuous = params(full.model)
    full.close_checkpointer()
    assert sorted(os.listdir(tmp_path / "full")) == ["checkpoint-4", "checkpoint-8"]
    for n in ("checkpoint-4", "checkpoint-8"):
        d = tmp_path / "full" / n
        assert os.path.isfile(d / "manifest.json") and os.path.isfile(d / "trainer_state.json")

    # Interrupted at step 4, then a fresh Trainer resumes from the newest committed checkpoint.
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
    os.makedirs(out / "checkpoint-100")  # a partial stock checkpoint (crash while writing)
    with open(out / "checkpoint-100" / "config.json", "w") as f:
        f.write("{}")
    os.remove(out / "checkpoint-4" / "trainer_state.json")  # crash right after the commit
    resumed_model = tiny_model()
    with torch.no_grad():
        for p in resumed_model.parameters():
            p.mul_(0.5)
    second = DatastatesTrainer(
        model=resumed_model, args=args(out), train_dataset=dataset(), datastates_config=ONE_WRITER
    )
    assert second.latest_checkpoint() == str(out / "checkpoint-4")
    second.train(resume_from_checkpoint=True)
    second.close_checkpointer()
    assert second.state.global_step == 8
    assert_same(continuous, params(second.model))


def test_hf_save_total_limit_after_commit(tmp_path):
    t = DatastatesTrainer(
        model=tiny_model(),
        args=args(tmp_path, save_steps=2, save_total_limit=2),
        train_dataset=dataset(),
        datastates_config=ONE_WRITER,
    )
    t.train()
    t.close_checkpointer()
    names = sorted(n for n in os.listdir(tmp_path) if n.startswith("checkpoint-"))
    assert names == ["checkpoint-6", "checkpoint-8"]
    ckpt = datastates.Checkpointer(tmp_path, ONE_WRITER)
    loaded = ckpt.load(tag="checkpoint-8", keys="model")["model"]
    assert_same(params(t.model), {k: v.detach() for k, v in loaded.items()})
    ckpt.close()


def test_hf_checkpoint_exports_to_a_folder_from_pretrained_loads(tmp_path):
    t = DatastatesTrainer(
        model=tiny_model(),
        args=args(tmp_path / "run", max_steps=4),
        train_dataset=dataset(),
        datastates_config=ONE_WRITER,
    )
    t.train()
    t.close_checkpointer()
    ckpt = tmp_path / "run" / "checkpoint-4"
    assert os.path.isfile(ckpt / "config.json")
    report = datastates.export(ckpt, tmp_path / "hf", "hf")
    assert report.fmt == "hf" and os.path.isfile(tmp_path / "hf" / "model.safetensors")
    assert not os.path.exists(tmp_path / "hf" / "manifest.json")
    loaded = GPT2LMHeadModel.from_pretrained(tmp_path / "hf")
    assert_same(params(t.model), params(loaded))
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    with pytest.raises(datastates.CheckpointExistsError):
        datastates.export(ckpt, tmp_path / "hf", "hf")


def test_hf_trainer_exposes_last_save_stats(tmp_path):
    from integration_helpers import assert_stats_of

    t = DatastatesTrainer(
        model=tiny_model(),
        args=args(tmp_path / "run", max_steps=4, save_steps=2),
        train_dataset=dataset(),
        datastates_config=ONE_WRITER,
    )
    assert t.last_save_stats is None
    t.train()
    t.wait_for_checkpoints()
    assert_stats_of(t.last_save_stats, tmp_path / "run" / "checkpoint-4")
    t.close_checkpointer()


def test_hf_save_total_limit_counts_stock_checkpoints(tmp_path):
    """Stock checkpoint-N folders in output_dir count towards save_total_limit (as in Trainer's
    own rotation) and are removed oldest first; a folder that is neither kind stays."""
    from transformers import Trainer

    stock = Trainer(
        model=tiny_model(), args=args(tmp_path, max_steps=4, save_steps=2), train_dataset=dataset()
    )
    stock.train()
    assert sorted(os.listdir(tmp_path)) == ["checkpoint-2", "checkpoint-4"]
    os.makedirs(tmp_path / "checkpoint-1")  # neither: a stock checkpoint cut short
    with open(tmp_path / "checkpoint-1" / "config.json", "w") as f:
        f.write("{}")
    t = DatastatesTrainer(
        model=tiny_model(),
        args=args(tmp_path, save_steps=2, save_total_limit=2),
        train_dataset=dataset(),
        datastates_config=ONE_WRITER,
    )
    t.train(resume_from_checkpoint=True)
    t.close_checkpointer()
    assert t.state.global_step == 8
    names = sorted(n for n in os.listdir(tmp_path) if n.startswith("checkpoint-"))
    assert names == ["checkpoint-1", "checkpoint-6", "checkpoint-8"]
    ckpt = datastates.Checkpointer(tmp_path, ONE_WRITER)
    loaded = ckpt.load(tag="checkpoint-8", keys="model")["model"]
    assert_same(params(t.model), {k: v.detach() for k, v in loaded.items()})
    ckpt.close()


@pytest.mark.parametrize("state_json", [False, True])
def test_hf_resume_from_a_foreign_checkpoint_is_refused(tmp_path, state_json):
    """A datastates checkpoint-N without the Trainer's keys (as the Lightning integration
    writes them) is refused with StateMismatchError saying what was expected and found, before
    the model is touched."""
    ckpt = datastates.Checkpointer(tmp_path, ONE_WRITER)
    ckpt.save(
        {"state_dict": tiny_model().state_dict(), "epoch": 1},
        step=6,
        tag="checkpoint-6",
        metadata={"framework": "lightning"},
    ).wait()
    ckpt.close()
    if state_json:  # a trainer_state.json copied in does not make it the Trainer's
        with open(tmp_path / "checkpoint-6" / "trainer_state.json", "w") as f:
            f.write("{}")
    model = tiny_model()
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(0.5)
    before = params(model)
    t = DatastatesTrainer(
        model=model, args=args(tmp_path), train_dataset=dataset(), datastates_config=ONE_WRITER
    )
    assert t.latest_checkpoint() == str(tmp_path / "checkpoint-6")
    with pytest.raises(datastates.StateMismatchError) as err:
        t.train(resume_from_checkpoint=True)
    message = str(err.value)
    for part in (
        str(tmp_path / "checkpoint-6"),
        "['model', 'trainer_state']",
        "['epoch', 'state_dict']",
        "'lightning'",
    ):
        assert part in message, message
    assert t.state.global_step == 0
    assert_same(before, params(t.model))
    t.close_checkpointer()

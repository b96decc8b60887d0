"""A Hugging Face Trainer run with the memory tier, for test_hf_memory.py (also its model, data
and arguments).

Usage: python hf_memory_worker.py OUT_DIR SHM_ROOT KEEPER_LOG K
Trains with ``DatastatesTrainer`` and a memory tier on ``SHM_ROOT``; at the start of step K+1
(the memory save of step K committed) it prints one line, ``REPORT`` + JSON (the memory checkpoints and the
losses so far) and blocks on stdin until the test SIGKILLs it.
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
from transformers import (
    GPT2Config,
    GPT2LMHeadModel,
    TrainerCallback,  # noqa: E402
    TrainingArguments,
)

import datastates  # noqa: E402
from datastates.integrations.hf import DatastatesTrainer  # noqa: E402

STEPS, SAVE_STEPS = 8, 4
REPORT = "MEMORY-REPORT "  # marks the report among the Trainer's own output lines


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
        max_steps=STEPS,
        save_steps=SAVE_STEPS,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        save_strategy="steps",
    )
    base.update(kw)
    return TrainingArguments(**base)


def config(shm_root, keeper_log, keep_last=1):
    tier = datastates.MemoryTier(
        root=str(shm_root),
        persist_every=None,
        persist_on_exit=False,
        log_path=str(keeper_log),
        keep_last=keep_last,
    )
    return datastates.CheckpointConfig(
        memory_tier=tier, host_cache_bytes=1 << 20, chunk_bytes=1 << 18, writer_threads=1
    )


def losses(state) -> list:
    """(step, loss, grad_norm, learning_rate) of every logged step."""
    return [
        [e["step"], e["loss"], e["grad_norm"], e["learning_rate"]]
        for e in state.log_history
        if "loss" in e
    ]


class HoldAt(TrainerCallback):
    """At the start of step ``k + 1``: report, then block until killed."""

    def __init__(self, k):
        self.k, self.trainer = k, None

    def on_step_begin(self, args, state, control, **kw):
        if state.global_step == self.k:
            self.trainer.wait_for_checkpoints()  # the memory save of step k is committed
            memory = [i.name for i in self.trainer._ds.memory.list()]
            print(REPORT + json.dumps({"memory": memory, "losses": losses(state)}), flush=True)
            sys.stdin.read()  # the test SIGKILLs this process here
            raise AssertionError("not killed")


def main(out, shm_root, keeper_log, k):
    hold = HoldAt(int(k))
    trainer = DatastatesTrainer(
        model=tiny_model(),
        args=args(out),
        train_dataset=dataset(),
        datastates_config=config(shm_root, keeper_log),
        callbacks=[hold],
    )
    hold.trainer = trainer
    trainer.train()
    raise AssertionError("training ended before step K")


if __name__ == "__main__":
    main(*sys.argv[1:])

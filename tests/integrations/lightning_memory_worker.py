"""A Lightning run with the memory tier, for test_lightning_memory.py (also its module, data and
Trainer).

Usage: python lightning_memory_worker.py ROOT SHM_ROOT KEEPER_LOG K
Trains with ``DatastatesCheckpointIO`` (a memory tier on ``SHM_ROOT``), ModelCheckpoint in
``ROOT/ckpts`` and ``io.memory_checkpoints(ROOT/ckpts)``; at the start of the batch after step
K (the saves of the steps so far committed) it prints one line, ``REPORT`` + JSON (the memory
checkpoints and the losses so far), and blocks on stdin until the test SIGKILLs it.
"""

from __future__ import annotations

import json
import os
import sys
import warnings

import torch
import lightning.pytorch as pl
from lightning.pytorch.callbacks import ModelCheckpoint
from torchdata.stateful_dataloader import StatefulDataLoader

import datastates
from datastates.integrations.lightning import DatastatesCheckpointIO

EPOCHS, BATCHES = 3, 4  # 12 optimizer steps; ModelCheckpoint saves at each epoch's end
REPORT = "MEMORY-REPORT "  # marks the report among Lightning's own output lines
warnings.filterwarnings("ignore", ".*does not have many workers.*")


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16),
            torch.nn.BatchNorm1d(16),
            torch.nn.ReLU(),
            torch.nn.Linear(16, 1),
        )
        self.losses: list[float] = []

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 2)}

    def train_dataloader(self):
        # resumable (state_dict/load_state_dict), which Lightning needs to resume mid-epoch
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(
            torch.randn(8 * BATCHES, 8, generator=g), torch.randn(8 * BATCHES, 1, generator=g)
        )
        return StatefulDataLoader(data, batch_size=8, shuffle=False)


def config(shm_root, keeper_log):
    tier = datastates.MemoryTier(
        root=str(shm_root), persist_every=None, persist_on_exit=False, log_path=str(keeper_log)
    )
    return datastates.CheckpointConfig(
        memory_tier=tier, host_cache_bytes=1 << 20, chunk_bytes=1 << 18, writer_threads=1
    )


def trainer(root, callbacks=(), plugins=()):
    return pl.Trainer(
        default_root_dir=str(root),
        max_epochs=EPOCHS,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        deterministic=True,
        callbacks=list(callbacks),
        plugins=list(plugins),
    )


def with_memory(root, shm_root, keeper_log, hold_at=None):
    """(memory callback, Trainer) of a run saving into ``root/ckpts`` and memory."""
    io = DatastatesCheckpointIO(config(shm_root, keeper_log))
    memory = io.memory_checkpoints(os.path.join(root, "ckpts"))
    files = ModelCheckpoint(
        dirpath=os.path.join(root, "ckpts"), save_last=True, filename="{epoch}-{step}"
    )
    hold = [] if hold_at is None else [HoldAt(hold_at, memory)]
    return memory, trainer(root, [files, memory, *hold], [io])


class HoldAt(pl.Callback):
    """At the start of the batch after step ``k``: report, then block until killed."""

    def __init__(self, k, memory):
        self.k, self.memory = k, memory

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if trainer.global_step == self.k:
            self.memory.wait()  # the memory save of step k is committed,
            self.memory.io.wait()  # and ModelCheckpoint's files of the steps so far
            names = [i.name for i in self.memory._checkpointer().memory.list()]
            print(REPORT + json.dumps({"memory": names, "losses": pl_module.losses}), flush=True)
            sys.stdin.read()  # the test SIGKILLs this process here
            raise AssertionError("not killed")


def main(root, shm_root, keeper_log, k):
    _, run = with_memory(root, shm_root, keeper_log, hold_at=int(k))
    run.fit(Tiny())
    raise AssertionError("training ended before step K")


if __name__ == "__main__":
    main(*sys.argv[1:])

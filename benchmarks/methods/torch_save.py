"""``torch.save`` of the conventional state dict into one file, then ``fsync`` (file and directory).

The caller is blocked for the whole serialization and write: snapshot = commit = blocked.
Load: ``torch.load(mmap=True, weights_only=True)`` and an in-place copy into the live objects.
"""

from __future__ import annotations

import os

import torch

from ..common import fsync_path, now
from ..states import TrainState, copy_into_live, plain_state_dict
from .base import Checkpoint, Method, Pending


class TorchSave(Method):
    name = "torch_save"
    label = "torch.save + fsync"
    kind = "sync"
    scopes = ("full", "model")
    transient_factor = 0.1

    def save(self, state: TrainState, step: int) -> Pending:
        t0 = now()
        path = self.root / f"{state.scope}-step-{step:06d}.pt"
        with open(path, "wb") as f:
            torch.save(plain_state_dict(state), f)
            f.flush()
            os.fsync(f.fileno())
        fsync_path(self.root)
        return Pending(t0, Checkpoint(step, [path]))

    def load_into(self, state: TrainState, ckpt: Checkpoint) -> None:
        sd = torch.load(ckpt.paths[0], map_location="cpu", mmap=True, weights_only=True)
        copy_into_live(state, sd)

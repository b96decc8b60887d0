"""Shared builders for the unit tests."""

from __future__ import annotations

import torch

from datastates.format.codec import tensor_bytes

from benchmarks.gpt import GPT, GPTConfig, synthetic_batch

TINY = GPTConfig(vocab_size=128, block_size=16, n_layer=2, n_head=2, n_embd=32)


class Loader:
    """A stateful data source: its position is part of the training state."""

    def __init__(self, cfg=TINY, seed=1234):
        self.cfg, self.seed, self.position = cfg, seed, 0

    def next(self, batch_size=4):
        g = torch.Generator().manual_seed(self.seed + self.position)
        self.position += 1
        return synthetic_batch(self.cfg, batch_size, g)

    def state_dict(self):
        return {"seed": self.seed, "position": self.position}

    def load_state_dict(self, sd):
        self.seed, self.position = sd["seed"], sd["position"]


def make_training(seed=0, lr=1e-2):
    torch.manual_seed(seed)
    model = GPT(TINY)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched, Loader()


def train_step(model, opt, sched, loader):
    x, y = loader.next()
    loss = model(x, y)
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    sched.step()
    return loss.detach()


def clone_state(obj):
    """A deep copy of nested dicts/lists of tensors (the reference to compare against)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().clone()
    if isinstance(obj, dict):
        return {k: clone_state(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(clone_state(v) for v in obj)
    return obj


def assert_same(a, b, path="state"):
    """Bit-exact equality of nested structures of tensors and values."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), f"{path}: tensor vs {type(b)}"
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{path}: {a.dtype}{a.shape} vs {b.dtype}{b.shape}"
        )
        assert torch.equal(tensor_bytes(a.cpu()), tensor_bytes(b.cpu())), path
        return
    if isinstance(a, dict):
        assert isinstance(b, dict) and list(a.keys()) == list(b.keys()), (
            f"{path}: keys {list(a)} vs {list(b) if isinstance(b, dict) else b}"
        )
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
        return
    if isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), f"{path}: {type(a)} vs {type(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}/{i}")
        return
    assert a == b, f"{path}: {a!r} != {b!r}"

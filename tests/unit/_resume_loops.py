"""Training loops for the resume check (test_resume_check.py): one correct loop and one loop per
classic resume mistake. check_resume runs them in new processes, which import this module by name
(its folder is put on their PYTHONPATH).

Every loop trains a tiny model for ``run.steps`` steps, saves after the even steps (waiting for
the commit, so that which checkpoint a kill leaves is known) and hands everything it trains with
to ``run.step_done`` -- also what its checkpoint leaves out.
"""

from __future__ import annotations

import torch
from torch import nn

import datastates

CFG = datastates.CheckpointConfig(host_cache_bytes=1 << 20, chunk_bytes=1 << 16)


class Batches:
    """A stateful data source: batch ``position`` is a function of the position alone."""

    def __init__(self):
        self.position = 0

    def next(self):
        g = torch.Generator().manual_seed(1000 + self.position)
        self.position += 1
        x = torch.randn(4, 8, generator=g)
        return x, x.sum(1, keepdim=True)

    def state_dict(self):
        return {"position": self.position}

    def load_state_dict(self, state):
        self.position = state["position"]


class NoisyData(torch.utils.data.Dataset):
    """Sample i plus noise drawn from the torch generator of the process that loads it: in a
    loader worker, that generator is seeded from the loader's base seed, not from any state."""

    def __len__(self):
        return 1 << 20

    def __getitem__(self, i):
        x = torch.randn(8, generator=torch.Generator().manual_seed(1000 + i))
        x = x + 0.1 * torch.randn(8)
        return x, x.sum(0, keepdim=True)


def _training(dropout: bool):
    torch.manual_seed(0)
    layers = [nn.Linear(8, 16), nn.ReLU()] + ([nn.Dropout(0.5)] if dropout else [])
    model = nn.Sequential(*layers, nn.Linear(16, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=3, gamma=0.5)
    return {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "loader": Batches(),
        "rng": datastates.RNGState(),
        "progress": {"seen": 0},
    }


def _step(state, x, y):
    loss = nn.functional.mse_loss(state["model"](x), y)
    loss.backward()
    state["optimizer"].step()
    state["optimizer"].zero_grad(set_to_none=True)
    state["scheduler"].step()
    state["progress"]["seen"] += len(x)


def _loop(run, *, dropout=False, leave_out=()):
    """The README's resume loop; ``leave_out``: keys the checkpoint misses."""
    everything = _training(dropout)
    saved = {k: v for k, v in everything.items() if k not in leave_out}
    with datastates.Checkpointer(run.directory, CFG) as ckpt:
        start = ckpt.restore(saved).step + 1 if ckpt.latest() else 0
        for step in range(start, run.steps):
            x, y = everything["loader"].next()
            _step(everything, x, y)
            if step % 2 == 0:
                ckpt.save(saved, step=step).wait()
            run.step_done(step, everything, inputs=x)


def correct(run):
    """Model with dropout, AdamW, scheduler, loader, RNGState and a Python value: all saved."""
    _loop(run, dropout=True)


def elastic_loader(run):
    """The README's loop with the loader it recommends: an ElasticLoader (its DataLoader draws
    its base seed at each pass), dropout and RNGState, everything saved."""
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 8, generator=g)
    state = _training(dropout=True)
    state["loader"] = datastates.ElasticLoader(
        torch.utils.data.TensorDataset(x, x.sum(1, True)), batch_size=4, seed=3
    )
    with datastates.Checkpointer(run.directory, CFG) as ckpt:
        start = ckpt.restore(state).step + 1 if ckpt.latest() else 0
        batches = iter(state["loader"])
        for step in range(start, run.steps):
            x, y = next(batches)
            _step(state, x, y)
            if step % 2 == 0:
                ckpt.save(state, step=step).wait()
            run.step_done(step, state, inputs=x)


def loader_not_in_state(run):
    """The loader's position is not checkpointed: a restart reads the first batches again."""
    _loop(run, leave_out=("loader",))


def rng_not_in_state(run):
    """No RNGState in the checkpoint: after a restart dropout draws other masks."""
    _loop(run, dropout=True, leave_out=("rng",))


def randomness_in_loader_workers(run):
    """Correct but for the noise NoisyData draws inside its loader worker: the loader's position
    comes from the resume step, the workers' base seed from the loader's own generator, but the
    worker's torch generator starts afresh after a restart."""
    state = _training(dropout=False)
    with datastates.Checkpointer(run.directory, CFG) as ckpt:
        start = ckpt.restore(state).step + 1 if ckpt.latest() else 0
        batches = [list(range(4 * s, 4 * s + 4)) for s in range(start, run.steps)]
        loader = torch.utils.data.DataLoader(
            NoisyData(),
            batch_sampler=batches,
            num_workers=1,
            generator=torch.Generator().manual_seed(7),
        )
        for step, (x, y) in zip(range(start, run.steps), loader):
            _step(state, x, y)
            if step % 2 == 0:
                ckpt.save(state, step=step).wait()
            run.step_done(step, state, inputs=x)


def _counter(run, after_saved):
    """A Python counter only: no model, so the process starts quickly."""
    state = {"progress": {"count": 0}}
    with datastates.Checkpointer(run.directory, CFG) as ckpt:
        start = ckpt.restore(state).step + after_saved if ckpt.latest() else 0
        for step in range(start, run.steps):
            state["progress"]["count"] += 1
            if step % 2 == 0:
                ckpt.save(state, step=step, overwrite=True).wait()
            run.step_done(step, state)


def counter(run):
    """The counter, resumed right."""
    _counter(run, after_saved=1)


def resumes_at_saved_step(run):
    """``start = ckpt.restore(state).step``: the checkpoint's own step runs twice (saved again
    with overwrite=True, which a loop making this mistake needs not to fail)."""
    _counter(run, after_saved=0)

"""Child process of the kill-and-resume test (run as a script, never collected by pytest).

    python _resume_child.py DIR MODE N STEPS

A small training job that runs the resume loop documented in docs/format.md ("The resume loop"),
saving every step with ``keep_last=2``, with the kill point MODE/N of ``_crash_child._install``
armed from the start (N counts the events of this process only; ``none`` arms nothing). At the end
it prints ``FINAL <sha256 of the final state>``; killed, it prints nothing more.
"""

from __future__ import annotations

import hashlib
import sys

import torch

import _crash_child


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def train_one_step(state: dict, step: int) -> None:
    """Deterministic: the batch depends only on the step."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g)
    model, opt = state["model"], state["optim"]
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    opt.step()
    # A value with a tuple key is stored as a Python object blob (the commit thread writes it).
    state["extra"] = {(step, "loss"): loss.item()}


def digest(state: dict, values: str = "extra") -> str:
    """sha256 of the model, the optimizer state and the plain values under ``values``."""
    h = hashlib.sha256()
    for t in state["model"].state_dict().values():
        h.update(t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    for st in state["optim"].state_dict()["state"].values():
        for k in sorted(st):
            h.update(st[k].detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    h.update(repr(sorted(state[values].items())).encode())
    return h.hexdigest()


def main() -> None:
    import datastates

    directory, mode, n, steps = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    torch.set_num_threads(1)
    _crash_child._install(mode, n)
    config = datastates.CheckpointConfig(
        host_cache_bytes=64 << 10, chunk_bytes=16 << 10, keep_last=2, writer_threads=2
    )
    model, optim = build()
    with datastates.Checkpointer(directory, config) as ckpt:
        # --- the documented resume loop ---
        state = {"model": model, "optim": optim, "extra": {}}
        start = ckpt.restore(state).step + 1 if ckpt.latest() else 0
        for step in range(start, steps):
            train_one_step(state, step)
            ckpt.save(state, step=step)
        ckpt.wait()
        # ---
    _crash_child.marker(f"FINAL {digest(state)}")


if __name__ == "__main__":
    main()

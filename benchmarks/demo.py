"""The demo: train a small GPT on synthetic data with checkpoints, restore, continue, compare.

It prints a line per checkpoint as training goes, then what it measured: the training stall each
checkpoint caused (save() blocking plus the optimizer step waiting for the snapshot), the bytes,
the persist throughput, the same checkpoint with torch.save for comparison, and whether the
resumed run is bit-identical. The default run is small (about a minute on a 2-core machine);
``--long`` runs the larger model the README's numbers were measured with.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch

from datastates import CheckpointConfig, Checkpointer, RNGState

from .gpt import GPT, GPTConfig, synthetic_batch


class SyntheticLoader:
    """Deterministic batches; its position is checkpointed like a stateful data loader's."""

    def __init__(self, cfg: GPTConfig, batch_size: int, seed: int = 0):
        self.cfg, self.batch_size, self.seed, self.position = cfg, batch_size, seed, 0

    def next(self):
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + self.position)
        self.position += 1
        return synthetic_batch(self.cfg, self.batch_size, g)

    def state_dict(self):
        return {"seed": self.seed, "position": self.position}

    def load_state_dict(self, sd):
        self.seed, self.position = sd["seed"], sd["position"]


def _build(cfg: GPTConfig, batch: int):
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    return {
        "model": model,
        "optimizer": opt,
        "scheduler": sched,
        "loader": SyntheticLoader(cfg, batch),
        "rng": RNGState(),
    }


def _step(state) -> float:
    x, y = state["loader"].next()
    loss = state["model"](x, y)
    loss.backward()
    state["optimizer"].step()
    state["optimizer"].zero_grad(set_to_none=True)
    state["scheduler"].step()
    return loss.item()


#: What each column of the table means, one line each (printed under it).
COLUMNS = (
    (
        "MB",
        "bytes of tensors and objects in the checkpoint (model, optimizer, scheduler, loader, RNG)",
    ),
    ("save() ms", "how long save() blocked the training loop (planning + the eager copies)"),
    ("step wait ms", "how long the next optimizer step waited for the background snapshot"),
    ("captured s", "from save() until every tensor was copied into the host cache"),
    ("committed s", "from save() until the checkpoint was on disk, fsynced and visible"),
    ("persist MB/s", "MB / committed s"),
)

#: ``--long``: the shape the README's demo numbers were measured with (166 MB of state, 45 steps
#: of ~300 ms on an idle 2-core machine; several minutes on a loaded one).
LONG = {
    "steps": 45,
    "every": 10,
    "layers": 6,
    "width": 384,
    "vocab": 8192,
    "batch": 8,
    "cache_mb": 512,
}
#: The default: the same loop on a smaller model (31 MB of state), about a minute on a loaded
#: 2-core machine. The last checkpoint is a few steps before the end, so the resumed run has
#: steps of its own to replay.
SHORT = {
    "steps": 24,
    "every": 5,
    "layers": 4,
    "width": 192,
    "vocab": 4096,
    "batch": 8,
    "cache_mb": 96,
}


def run(
    steps: int, every: int, directory: str, cfg: GPTConfig, batch: int, cache_mb: int = 512
) -> int:
    torch.manual_seed(1234)
    state = _build(cfg, batch)
    n_params = sum(p.numel() for p in state["model"].parameters())
    print(
        f"model: GPT {cfg.n_layer} layers x {cfg.n_embd} wide, {n_params / 1e6:.1f}M parameters; "
        f"{steps} steps, checkpoint every {every}; directory {directory}",
        flush=True,
    )
    config = CheckpointConfig(host_cache_bytes=cache_mb << 20, keep_last=2)
    handles, step_times = [], []
    with Checkpointer(directory, config) as ckpt:
        t_train = time.perf_counter()
        for step in range(1, steps + 1):
            t0 = time.perf_counter()
            loss = _step(state)
            step_times.append(time.perf_counter() - t0)
            if step % every == 0:
                handle = ckpt.save(state, step=step, metadata={"loss": loss})
                handles.append(handle)
                print(
                    f"step {step:>4}/{steps}  loss {loss:.3f}  checkpoint {handle.name}: save() "
                    f"returned in {handle.stats.blocked_s * 1e3:.1f} ms, the rest runs in the "
                    f"background",
                    flush=True,
                )
        ckpt.wait()
        train_s = time.perf_counter() - t_train
        final = {k: v.detach().clone() for k, v in state["model"].state_dict().items()}

        print(f"\ntrained {steps} steps in {train_s:.1f} s (loss {loss:.3f})")
        print(
            f"{'checkpoint':<18}{'MB':>8}{'save() ms':>11}{'step wait ms':>14}"
            f"{'captured s':>12}{'committed s':>13}{'persist MB/s':>14}"
        )
        for h in handles:
            s = h.stats
            print(
                f"{h.name:<18}{s.nbytes / 1e6:>8.1f}{s.blocked_s * 1e3:>11.1f}"
                f"{s.step_wait_s * 1e3:>14.1f}{s.snapshot_s:>12.2f}{s.commit_s:>13.2f}"
                f"{s.nbytes / 1e6 / s.commit_s:>14.0f}"
            )
        for name, meaning in COLUMNS:
            print(f"  {name:<14}{meaning}")
        stalls = [h.stats.blocked_s + h.stats.step_wait_s for h in handles]
        median_step = sorted(step_times)[len(step_times) // 2]
        print(
            f"median training stall per checkpoint (save() + step wait): "
            f"{sorted(stalls)[len(stalls) // 2] * 1e3:.1f} ms"
            f" (a training step takes {median_step * 1e3:.0f} ms)",
            flush=True,
        )

        # The same state with torch.save (synchronous, + fsync) for comparison.
        path = os.path.join(directory, "torch_save.pt")
        t0 = time.perf_counter()
        with open(path, "wb") as f:
            torch.save(
                {
                    k: (v.state_dict() if hasattr(v, "state_dict") else v)
                    for k, v in state.items()
                    if k != "rng"
                },
                f,
            )
            f.flush()
            os.fsync(f.fileno())
        torch_save_s = time.perf_counter() - t0
        os.remove(path)
        print(
            f"torch.save of the same state blocks training for {torch_save_s * 1e3:.0f} ms",
            flush=True,
        )

        # Restore the latest checkpoint into fresh objects and continue.
        latest = ckpt.latest()
        if latest.step >= steps:
            print("note: the latest checkpoint is the last step; resuming checks nothing new")
        fresh = _build(GPTConfig(**cfg.__dict__), batch)
        torch.manual_seed(999)  # a different RNG state: the checkpoint must restore it
        t0 = time.perf_counter()
        report = ckpt.restore(fresh, step=latest.step)
        restore_s = time.perf_counter() - t0
        print(
            f"restored {latest.name} ({report.nbytes / 1e6:.1f} MB) into fresh objects in "
            f"{restore_s:.2f} s ({report.nbytes / 1e6 / restore_s:.0f} MB/s)",
            flush=True,
        )
    # The run above is the uninterrupted reference; continue the restored one to the same step.
    for _ in range(latest.step + 1, steps + 1):
        _step(fresh)
    resumed = fresh["model"].state_dict()
    same = all(torch.equal(final[k], resumed[k]) for k in final)
    print(
        f"resumed from step {latest.step} to {steps}: parameters "
        f"{'bit-identical' if same else 'DIFFER'} to the uninterrupted run"
    )
    return 0 if same else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.demo", description=__doc__)
    parser.add_argument(
        "--long",
        action="store_true",
        help="the larger run the README's numbers come from: "
        + ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in LONG.items()),
    )
    for name, value in SHORT.items():
        parser.add_argument(
            f"--{name.replace('_', '-')}",
            type=int,
            default=None,
            help=f"(default {value}; {LONG[name]} with --long)",
        )
    parser.add_argument("--dir", default=None, help="checkpoint directory (default: a temp dir)")
    args = parser.parse_args(argv)
    preset = LONG if args.long else SHORT
    shape = {
        name: preset[name] if getattr(args, name) is None else getattr(args, name)
        for name in preset
    }
    cfg = GPTConfig(
        vocab_size=shape["vocab"],
        block_size=64,
        n_layer=shape["layers"],
        n_head=6,
        n_embd=shape["width"],
    )
    directory = args.dir or tempfile.mkdtemp(prefix="datastates-demo-", dir=os.getcwd())
    try:
        return run(
            shape["steps"], shape["every"], directory, cfg, shape["batch"], shape["cache_mb"]
        )
    finally:
        if args.dir is None:
            shutil.rmtree(directory, ignore_errors=True)


if __name__ == "__main__":
    raise SystemExit(main())

"""Each installed framework's default checkpointing against the same framework with datastates.

    python -m benchmarks.frameworks [--hidden 1024] [--layers 4] [--steps 24] [--every 6]

For every framework found (torch.distributed.checkpoint, Lightning, Hugging Face Trainer,
DeepSpeed) it trains the same tiny model three times in this process — without checkpoints,
with the framework's default checkpointing, with datastates — and prints:

- ``stall/ckpt``: (training time with checkpoints − without) / number of checkpoints, i.e. what
  one checkpoint costs the training loop, final flush included;
- ``e2e``: wall time of the whole run, including waiting for the last checkpoint to be durable;
- ``vs none``: e2e relative to the run without checkpoints.

Each variant runs ``--repeat`` times, interleaved; the fastest run of each is kept.

Numbers are from one process on one machine; compare rows of one run, not across machines.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import logging
import os
import shutil
import tempfile
import time
import warnings
from typing import Callable

import torch

import datastates

__all__ = ["main"]


def _mlp(hidden: int, layers: int) -> torch.nn.Module:
    torch.manual_seed(0)
    mods: list[torch.nn.Module] = []
    for _ in range(layers):
        mods += [torch.nn.Linear(hidden, hidden), torch.nn.GELU()]
    mods.append(torch.nn.Linear(hidden, 1))
    return torch.nn.Sequential(*mods)


def _batch(step: int, hidden: int, batch: int = 32):
    g = torch.Generator().manual_seed(step)
    return torch.randn(batch, hidden, generator=g), torch.randn(batch, 1, generator=g)


def _config(state_bytes: int) -> "datastates.CheckpointConfig":
    cache = max(64 << 20, min(1 << 30, state_bytes // 2))
    return datastates.CheckpointConfig(host_cache_bytes=cache, chunk_bytes=16 << 20)


def _timed(fn: Callable[[str], None]) -> float:
    root = tempfile.mkdtemp(prefix="ds-bench-")
    try:
        t0 = time.perf_counter()
        fn(root)
        return time.perf_counter() - t0
    finally:
        shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------- frameworks


def bench_dcp(a) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import FileSystemWriter

    from datastates.integrations.dcp import DatastatesWriter

    def run(kind):
        def go(root):
            model = _mlp(a.hidden, a.layers)
            opt = torch.optim.AdamW(model.parameters())
            writer = (
                DatastatesWriter(os.path.join(root, "x"))
                if kind == "async-ds"
                else FileSystemWriter(
                    os.path.join(root, "x"), cache_staged_state_dict=torch.cuda.is_available()
                )
            )
            fut = None
            for step in range(a.steps):
                x, y = _batch(step, a.hidden)
                torch.nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                opt.zero_grad()
                if kind != "none" and (step + 1) % a.every == 0:
                    sd = {"model": model.state_dict(), "optim": opt.state_dict()}
                    path = os.path.join(root, f"step{step + 1}")
                    if kind == "sync-default":
                        dcp.save(sd, checkpoint_id=path, no_dist=True)
                    elif kind == "sync-ds":
                        dcp.save(sd, storage_writer=DatastatesWriter(path), no_dist=True)
                    else:
                        if fut is not None:
                            fut.result()
                        fut = dcp.async_save(
                            sd, storage_writer=writer, checkpoint_id=path, no_dist=True
                        )
            if fut is not None:
                fut.result()

        return go

    return {k: run(k) for k in ("none", "sync-default", "sync-ds", "async-default", "async-ds")}


def bench_lightning(a) -> dict:
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    from datastates.integrations.lightning import DatastatesCheckpointIO

    class Module(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = _mlp(a.hidden, a.layers)

        def training_step(self, batch, _):
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

    def loader():
        xs, ys = zip(*[_batch(s, a.hidden) for s in range(a.steps)])
        data = torch.utils.data.TensorDataset(torch.cat(xs), torch.cat(ys))
        return torch.utils.data.DataLoader(data, batch_size=32)

    def run(kind):
        def go(root):
            plugins, callbacks = [], []
            if kind != "none":
                callbacks.append(
                    ModelCheckpoint(dirpath=root, every_n_train_steps=a.every, save_top_k=-1)
                )
            if kind == "datastates":
                io_ = DatastatesCheckpointIO(_config(a.state_bytes))
                plugins.append(io_)
                callbacks.append(io_.lazy_snapshots())
            trainer = pl.Trainer(
                default_root_dir=root,
                max_steps=a.steps,
                accelerator="cpu",
                devices=1,
                logger=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                enable_checkpointing=kind != "none",
                plugins=plugins,
                callbacks=callbacks,
            )
            trainer.fit(Module(), loader())

        return go

    return {k: run(k) for k in ("none", "default", "datastates")}


def bench_hf(a) -> dict:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import Trainer, TrainingArguments

    from datastates.integrations.hf import DatastatesTrainer

    class Wrapped(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.net = _mlp(a.hidden, a.layers)

        def forward(self, x, labels):
            return {"loss": torch.nn.functional.mse_loss(self.net(x), labels)}

    data = [{"x": x, "labels": y} for s in range(a.steps) for x, y in zip(*_batch(s, a.hidden))]

    def run(kind):
        def go(root):
            args = TrainingArguments(
                output_dir=root,
                max_steps=a.steps,
                per_device_train_batch_size=32,
                report_to=[],
                use_cpu=True,
                save_strategy="no" if kind == "none" else "steps",
                save_steps=a.every,
                logging_strategy="no",
                disable_tqdm=True,
            )
            if kind == "datastates":
                t = DatastatesTrainer(
                    model=Wrapped(),
                    args=args,
                    train_dataset=data,
                    datastates_config=_config(a.state_bytes),
                )
                t.train()
                t.close_checkpointer()
            else:
                Trainer(model=Wrapped(), args=args, train_dataset=data).train()

        return go

    return {k: run(k) for k in ("none", "default", "datastates")}


def bench_deepspeed(a) -> dict:
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    for k, v in (
        ("MASTER_ADDR", "127.0.0.1"),
        ("MASTER_PORT", "29533"),
        ("RANK", "0"),
        ("LOCAL_RANK", "0"),
        ("WORLD_SIZE", "1"),
    ):
        os.environ.setdefault(k, v)
    import deepspeed

    from datastates.integrations.deepspeed import enable_lazy_snapshots

    deepspeed.init_distributed(dist_backend="gloo", auto_mpi_discovery=False)

    def run(kind):
        def go(root):
            model = _mlp(a.hidden, a.layers)
            cfg = {
                "train_batch_size": 32,
                "steps_per_print": 10**9,
                "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
            }
            if kind == "datastates":
                cfg["datastates_ckpt"] = {
                    "host_cache_size": _config(a.state_bytes).host_cache_bytes / (1 << 30)
                }
            eng, _, _, _ = deepspeed.initialize(
                model=model, model_parameters=model.parameters(), config=cfg
            )
            if kind == "datastates":
                enable_lazy_snapshots(eng)
            for step in range(a.steps):
                x, y = _batch(step, a.hidden)
                eng.backward(torch.nn.functional.mse_loss(eng(x), y))
                eng.step()
                if kind != "none" and (step + 1) % a.every == 0:
                    eng.save_checkpoint(root)
            eng.destroy()

        return go

    return {k: run(k) for k in ("none", "default", "datastates")}


FRAMEWORKS = [
    ("torch.distributed.checkpoint", "torch", bench_dcp),
    ("lightning", "lightning", bench_lightning),
    ("transformers Trainer", "transformers", bench_hf),
    ("deepspeed", "deepspeed", bench_deepspeed),
]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--every", type=int, default=6)
    p.add_argument("--repeat", type=int, default=2, help="runs of each variant (min is kept)")
    p.add_argument("--only", nargs="*", help="frameworks to run (module names)")
    a = p.parse_args(argv)
    nparams = sum(x.numel() for x in _mlp(a.hidden, a.layers).parameters())
    a.state_bytes = nparams * 4 * 3  # fp32 weights + AdamW moments
    n_ckpt = a.steps // a.every
    print(
        f"model: {nparams / 1e6:.1f} M parameters, checkpoint ~{a.state_bytes / 2**20:.0f} MiB,"
        f" {a.steps} steps, {n_ckpt} checkpoints, torch {torch.__version__}, "
        f"{os.cpu_count()} CPUs"
    )
    rows = []
    logging.disable(logging.WARNING)
    for label, module, make in FRAMEWORKS:
        if a.only and module not in a.only:
            continue
        if importlib.util.find_spec(module) is None:
            print(f"{label}: not installed, skipped")
            continue
        try:
            runs = make(a)
            _timed(runs["none"])  # warm-up: imports, first-call costs
            times: dict[str, float] = {}
            for _ in range(a.repeat):  # interleaved, so drifts of a shared machine hit all
                for kind, fn in runs.items():
                    with warnings.catch_warnings(), contextlib.redirect_stdout(io.StringIO()):
                        warnings.simplefilter("ignore")
                        t = _timed(fn)
                    times[kind] = min(t, times.get(kind, t))
        except Exception as exc:  # a broken framework install must not hide the others
            print(f"{label}: failed ({type(exc).__name__}: {exc})")
            continue
        base = times.pop("none")
        for kind, t in times.items():
            rows.append((label, kind, (t - base) / max(1, n_ckpt), t, t / base))
    print(
        f"\n{'framework':30} {'checkpointing':15} {'stall/ckpt s':>12} {'e2e s':>8} {'vs none':>8}"
    )
    for label, kind, stall, e2e, ratio in rows:
        print(f"{label:30} {kind:15} {stall:12.3f} {e2e:8.2f} {ratio:7.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

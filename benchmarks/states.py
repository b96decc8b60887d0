"""The training states that the benchmark checkpoints.

Two shapes of the *same kind* of state (parameters + AdamW state + RNG + Python objects):

- ``gpt``: a GPT-2-style decoder from :mod:`benchmarks.gpt` (the default ``gpt2-medium``
  preset is GPT-2 medium's width with 20 layers, ~304M parameters, ~3.65 GB with AdamW state);
- ``fragmented``: the same number of bytes split over thousands of small parameters (a
  ``ParameterList``), the worst case for per-tensor overheads (pickling, per-item files, syscalls).

AdamW state is created by one real optimizer step for small models; for big ones ``exp_avg`` and
``exp_avg_sq`` are filled directly (a forward/backward of a 300M model takes minutes on 2 CPU cores
and would not change a single byte that matters to a checkpoint).

This module also provides the conversions the peer methods need (a plain ``state_dict``, an in-place
copy back into the live objects) and a cheap fingerprint used to verify every load.
"""

from __future__ import annotations

import dataclasses
import math
import pickle
import random
from dataclasses import dataclass, field

import torch
from torch import nn

from benchmarks.gpt import GPT, GPTConfig, synthetic_batch

SENTINEL = 1234.5  # written over the fingerprinted elements before a load
_FP_EDGE = 256  # elements fingerprinted at each end of every tensor


@dataclass
class TrainState:
    """Live training objects plus what the report needs to know about them.

    ``optimizer`` is ``None`` for a model-only view (safetensors-style saves).
    """

    name: str
    model: nn.Module
    optimizer: torch.optim.Optimizer | None
    extra: dict = field(default_factory=dict)
    description: str = ""
    #: The optimizer that trains ``model`` (also set for a model-only view, where ``optimizer`` is
    #: None): a lazy method may guard it.
    live_optimizer: torch.optim.Optimizer | None = None

    def __post_init__(self) -> None:
        if self.live_optimizer is None:
            self.live_optimizer = self.optimizer

    @property
    def scope(self) -> str:
        return "model" if self.optimizer is None else "full"

    def tensors(self) -> list[torch.Tensor]:
        """Every distinct tensor of the state (tied weights once), in a stable order."""
        seen: set[tuple[int, int]] = set()
        out = []

        def add(t: torch.Tensor) -> None:
            key = (t.untyped_storage().data_ptr(), t.storage_offset())
            if key not in seen:
                seen.add(key)
                out.append(t.detach())

        for t in self.model.state_dict(keep_vars=True).values():
            add(t)
        if self.optimizer is not None:
            for per_param in self.optimizer.state.values():
                for v in per_param.values():
                    if isinstance(v, torch.Tensor):
                        add(v)
        return out

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def ntensors(self) -> int:
        return len(self.tensors())

    def model_only(self) -> "TrainState":
        return TrainState(
            self.name,
            self.model,
            None,
            {},
            self.description + " (model only)",
            live_optimizer=self.optimizer,
        )

    def info(self) -> dict:
        params = {p.data_ptr(): p.numel() for p in self.model.parameters()}
        return {
            "name": self.name,
            "scope": self.scope,
            "description": self.description,
            "nbytes": self.nbytes,
            "ntensors": self.ntensors,
            "parameters": int(sum(params.values())),
        }


# ----------------------------------------------------------------------------------- configurations
def gpt_config(preset: str, n_layer: int | None = None) -> GPTConfig:
    """The GPT shape of a preset; ``n_layer`` overrides the depth (used to scale the state)."""
    if preset == "quick":
        cfg = GPTConfig(vocab_size=2048, block_size=64, n_layer=4, n_head=4, n_embd=256)
    elif preset == "small":
        cfg = GPTConfig(vocab_size=8192, block_size=256, n_layer=8, n_head=8, n_embd=512)
    elif preset == "gpt2-medium":
        cfg = dataclasses.replace(GPTConfig.gpt2_medium_like(), n_layer=20)
    else:
        raise ValueError(f"unknown preset {preset!r}; expected quick, small or gpt2-medium")
    if n_layer is not None:
        cfg = dataclasses.replace(cfg, n_layer=max(1, n_layer))
    return cfg


def e2e_config(preset: str) -> tuple[GPTConfig, int]:
    """Model and batch size for the end-to-end loop (small enough to train for real on CPUs)."""
    if preset == "quick":
        return GPTConfig(), 8
    return GPTConfig(vocab_size=8192, block_size=128, n_layer=6, n_head=6, n_embd=384), 4


def param_count(cfg: GPTConfig) -> int:
    with torch.device("meta"):
        model = GPT(cfg)
    return sum(p.numel() for p in model.parameters())


def estimate_state_bytes(cfg: GPTConfig) -> int:
    """fp32 parameters + AdamW exp_avg + exp_avg_sq (the step counters are negligible)."""
    return 3 * 4 * param_count(cfg)


def scale_layers(cfg: GPTConfig, max_bytes: int) -> GPTConfig | None:
    """The deepest version of ``cfg`` (fewer layers only) whose state fits in ``max_bytes``."""
    for n in range(cfg.n_layer, 0, -1):
        c = dataclasses.replace(cfg, n_layer=n)
        if estimate_state_bytes(c) <= max_bytes:
            return c
    return None


# ----------------------------------------------------------------------------------- builders
def _extra_objects(cfg: GPTConfig, kind: str) -> dict:
    """The Python side of a training state: counters, config, history, data-loader position."""
    rng = random.Random(0)
    return {
        "step": 0,
        "epoch": 1,
        "tokens_seen": 123_456_789,
        "kind": kind,
        "config": dataclasses.asdict(cfg),
        "loss_history": [
            round(4.0 * math.exp(-i / 50) + rng.random() * 0.01, 6) for i in range(200)
        ],
        "data_loader": {"shard": 17, "offset": 4_096_000, "seed": 1234},
        "notes": "datastates benchmark state",
    }


def _init_adam_state(
    model: nn.Module, opt: torch.optim.Optimizer, cfg: GPTConfig, real_step: bool
) -> None:
    if real_step:
        gen = torch.Generator().manual_seed(0)
        x, y = synthetic_batch(cfg, 2, gen)
        model(x, y.contiguous()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return
    gen = torch.Generator().manual_seed(1)
    for group in opt.param_groups:
        for p in group["params"]:
            avg = torch.empty_like(p, memory_format=torch.contiguous_format).normal_(
                0, 1e-3, generator=gen
            )
            opt.state[p] = {"step": torch.tensor(1.0), "exp_avg": avg, "exp_avg_sq": avg.square()}


def build_gpt_state(cfg: GPTConfig, real_step: bool | None = None, seed: int = 0) -> TrainState:
    """A GPT model with AdamW state. ``real_step`` defaults to True below ~50M parameters."""
    torch.manual_seed(seed)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    if real_step is None:
        real_step = param_count(cfg) < 50_000_000
    _init_adam_state(model, opt, cfg, real_step)
    n = sum(p.numel() for p in model.parameters())
    desc = (
        f"GPT {cfg.n_layer} layers x {cfg.n_embd}, vocab {cfg.vocab_size}: {n / 1e6:.1f}M params "
        f"+ AdamW + RNG + Python objects"
    )
    return TrainState("gpt", model, opt, _extra_objects(cfg, "gpt"), desc)


class FragmentedModel(nn.Module):
    """The same parameter bytes as a GPT, as a flat list of many small 1-D parameters."""

    def __init__(self, sizes: list[int]):
        super().__init__()
        self.pieces = nn.ParameterList(nn.Parameter(torch.empty(n)) for n in sizes)


def fragment_sizes(cfg: GPTConfig, target_pieces: int) -> list[int]:
    """Split every GPT parameter into pieces of at most ``total / target_pieces`` elements."""
    with torch.device("meta"):
        shapes = [p.numel() for p in GPT(cfg).parameters()]
    limit = max(1, math.ceil(sum(shapes) / target_pieces))
    sizes = []
    for n in shapes:
        while n > limit:
            sizes.append(limit)
            n -= limit
        sizes.append(n)
    return sizes


def build_fragmented_state(cfg: GPTConfig, target_pieces: int = 1500, seed: int = 0) -> TrainState:
    """~``target_pieces`` parameters (x4 tensors with AdamW state) holding the GPT's bytes."""
    sizes = fragment_sizes(cfg, target_pieces)
    model = FragmentedModel(sizes)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=gen)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    _init_adam_state(model, opt, cfg, real_step=False)
    desc = (
        f"{len(sizes)} small parameters (same bytes as the GPT state) + AdamW + RNG + Python "
        f"objects"
    )
    return TrainState("fragmented", model, opt, _extra_objects(cfg, "fragmented"), desc)


# ----------------------------------------------------------------------------------- peer formats
def rng_snapshot() -> dict:
    """RNG state as plain data (a tensor and bytes), loadable with ``weights_only=True``."""
    return {"torch": torch.get_rng_state(), "python": pickle.dumps(random.getstate())}


def plain_state_dict(state: TrainState) -> dict:
    """The conventional nested ``state_dict`` that torch.save, DCP and safetensors users write."""
    sd: dict = {"model": state.model.state_dict()}
    if state.optimizer is not None:
        sd["optimizer"] = state.optimizer.state_dict()
        sd["rng"] = rng_snapshot()
        sd["extra"] = dict(state.extra)
    return sd


def copy_into_live(state: TrainState, sd: dict) -> None:
    """Copy a loaded ``plain_state_dict`` into the live model and optimizer, in place.

    ``Optimizer.load_state_dict`` would *adopt* the loaded tensors (for ``torch.load(mmap=True)``:
    file-backed pages) instead of filling the existing ones; benchmarks load into the live state.
    """
    state.model.load_state_dict(sd["model"], strict=True)
    if state.optimizer is None:
        return
    loaded = sd["optimizer"]
    params = [p for g in state.optimizer.param_groups for p in g["params"]]
    with torch.no_grad():
        for idx, per_param in loaded["state"].items():
            live = state.optimizer.state[params[int(idx)]]
            for k, v in per_param.items():
                if isinstance(v, torch.Tensor) and isinstance(live.get(k), torch.Tensor):
                    live[k].copy_(v)
                else:
                    live[k] = v
    for g, lg in zip(state.optimizer.param_groups, loaded["param_groups"]):
        g.update({k: v for k, v in lg.items() if k != "params"})
    if "extra" in sd:
        state.extra.update(sd["extra"])


# ----------------------------------------------------------------------------------- verification
def fingerprint(state: TrainState) -> list[float]:
    """A cheap content fingerprint: sums of the first and last elements of every tensor."""
    out = []
    with torch.no_grad():
        for t in state.tensors():
            flat = t.reshape(-1)
            for part in (flat[:_FP_EDGE], flat[-_FP_EDGE:]):
                w = torch.arange(1, part.numel() + 1, dtype=torch.float64)
                out.append(float((part.double() * w).sum()))
    return out


def perturb(state: TrainState) -> None:
    """Overwrite the fingerprinted elements, so a load that writes nothing cannot pass."""
    with torch.no_grad():
        for t in state.tensors():
            if not t.is_contiguous() or not t.is_floating_point():
                continue
            flat = t.view(-1)
            flat[:_FP_EDGE].fill_(SENTINEL)
            flat[-_FP_EDGE:].fill_(SENTINEL)

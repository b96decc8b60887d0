"""A small GPT-style decoder used by the demo and the benchmarks.

Nothing in the library depends on it; it exists so that the demo, the benchmarks and the tests train
the same realistic model (embeddings, attention, MLP, LayerNorm, tied output head) on synthetic data.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 512
    block_size: int = 64
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0

    @classmethod
    def gpt2_medium_like(cls) -> "GPTConfig":
        """About 300M parameters (GPT-2 medium's shape with a 50k vocabulary)."""
        return cls(vocab_size=50304, block_size=1024, n_layer=24, n_head=16, n_embd=1024)


class _Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd)
        self.attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.ln_2 = nn.LayerNorm(cfg.n_embd)
        self.fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.fc_out = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
        self.n_head = cfg.n_head
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.attn(self.ln_1(x)).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.dropout(self.proj(y.transpose(1, 2).reshape(b, t, c)))
        return x + self.dropout(self.fc_out(F.gelu(self.fc(self.ln_2(x)))))


class GPT(nn.Module):
    """Decoder-only transformer with a weight-tied output head (shared storage between two keys)."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.block_size, cfg.n_embd)
        self.blocks = nn.ModuleList(_Block(cfg) for _ in range(cfg.n_layer))
        self.ln_f = nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight
        for p in self.parameters():
            if p.dim() >= 2:
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * cfg.n_layer))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.blocks:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))


def synthetic_batch(
    cfg: GPTConfig, batch_size: int, generator: torch.Generator, device: str | torch.device = "cpu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """A deterministic batch of random token ids (inputs, next-token targets)."""
    data = torch.randint(0, cfg.vocab_size, (batch_size, cfg.block_size + 1), generator=generator)
    data = data.to(device)
    return data[:, :-1], data[:, 1:]

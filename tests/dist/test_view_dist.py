"""``save(view=...)`` on 2 real gloo ranks: with the model declared replicated (each tensor
written once, by one rank), the rank files' ``torch.load`` views together hold every key of
the model's state dict exactly once, bit-equal, and leave out what the other file holds. The
Hugging Face index built from the manifest points each key at that file, so
``from_pretrained`` reads a 2-rank checkpoint in place; a model tensor split over the ranks
gets no index (a WARNING names it)."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch

from datastates import CheckpointConfig, Checkpointer, TensorShard
from datastates.format import codec as fmt

from launcher import run_ranks

WORLD = 2
CONFIG = CheckpointConfig(commit_timeout_s=60)


class Tied(torch.nn.Module):
    """An embedding and a head sharing one weight, as language models tie them."""

    def __init__(self):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.emb = torch.nn.Embedding(16, 8)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(8, 8) for _ in range(5))
        self.norm = torch.nn.LayerNorm(8)
        self.head = torch.nn.Linear(8, 16, bias=False)
        self.head.weight = self.emb.weight
        with torch.no_grad():
            for p in self.parameters():
                p.copy_(torch.randn(p.shape, generator=g))


def tiny_gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(
        GPT2Config(n_layer=2, n_head=2, n_embd=32, vocab_size=64, n_positions=16)
    )


def _save(rank, world, root, hf):
    model = tiny_gpt2() if hf else Tied()
    with Checkpointer(root, CONFIG) as ckpt:
        ckpt.save(
            {"model": model, "rank": rank, "mine": torch.full((3,), float(rank))},
            step=1,
            replicated=["model"],
            view="model",
        ).wait()
        if hf:  # a model tensor split over the ranks: one box each
            rows = torch.arange(24, dtype=torch.float32).reshape(4, 6)[2 * rank : 2 * rank + 2]
            ckpt.save(
                {
                    "model": {
                        "a.weight": torch.ones(3),
                        "b.weight": TensorShard(rows, (4, 6), (2 * rank, 0)),
                    }
                },
                step=2,
                view="model",
            ).wait()
    return None


def _bits(t: torch.Tensor) -> bytes:
    return bytes(t.detach().reshape(-1).contiguous().view(torch.uint8).numpy())


def _views(ckpt: str) -> list[dict]:
    return [
        torch.load(os.path.join(ckpt, fmt.shard_file_name(r)), weights_only=True, mmap=True)
        for r in range(WORLD)
    ]


def test_the_rank_files_views_cover_the_model_once(tmp_path):
    root = str(tmp_path / "ckpts")
    run_ranks(WORLD, _save, root, False)
    expected = Tied().state_dict()
    views = _views(os.path.join(root, fmt.step_name(1)))
    seen: dict[str, int] = {}
    for rank, view in enumerate(views):
        assert None not in view.values(), rank  # left out, not None
        for key, value in view.items():
            assert key not in seen, (key, seen.get(key), rank)
            seen[key] = rank
            assert _bits(value) == _bits(expected[key]) and value.shape == expected[key].shape
    assert sorted(seen) == sorted(expected)
    assert sorted(set(seen.values())) == [0, 1]  # both files hold part of the model
    tied = views[seen["emb.weight"]]
    assert seen["head.weight"] == seen["emb.weight"]
    assert tied["head.weight"].data_ptr() == tied["emb.weight"].data_ptr()


def test_from_pretrained_reads_a_two_rank_checkpoint_in_place(tmp_path, caplog):
    pytest.importorskip("transformers")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from transformers import AutoModelForCausalLM

    from datastates.integrations.hf import WEIGHTS_INDEX, weights_index

    root = str(tmp_path / "ckpts")
    run_ranks(WORLD, _save, root, True)
    ckpt = os.path.join(root, fmt.step_name(1))
    model = tiny_gpt2()
    index = weights_index(ckpt)
    assert index is not None
    views = _views(ckpt)
    weight_map = json.loads(index)["weight_map"]
    assert sorted(weight_map) == sorted(model.state_dict())
    for key, name in weight_map.items():
        assert key in views[int(name[len("rank-") : -len(".dsf")])], key
    assert sorted(set(weight_map.values())) == ["rank-00000.dsf", "rank-00001.dsf"]
    with open(os.path.join(ckpt, WEIGHTS_INDEX), "w") as f:
        f.write(index)
    model.config.save_pretrained(ckpt)
    loaded = AutoModelForCausalLM.from_pretrained(ckpt)
    got = loaded.state_dict()
    for key, value in model.state_dict().items():
        assert _bits(got[key]) == _bits(value), key
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()

    split = os.path.join(root, fmt.step_name(2))
    with caplog.at_level(logging.WARNING, logger="datastates.integrations.hf"):
        assert weights_index(split) is None
    assert WEIGHTS_INDEX in caplog.text and "'model/b.weight'" in caplog.text
    assert "split over 2 shard files" in caplog.text

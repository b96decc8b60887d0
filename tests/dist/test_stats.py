"""``SaveStats`` counts what each rank wrote (real processes, gloo): with replicated state written
once, the ranks' ``nbytes`` add up to the checkpoint's tensor and object bytes (not world_size
times them), their ``file_nbytes`` to the shard files on disk, their ``files`` to the files of the
checkpoint folder."""
from __future__ import annotations

import json
import os

import torch
from torch import nn

from datastates import CheckpointConfig, Checkpointer
from datastates.format import codec as fmt

from launcher import run_ranks

SMALL = CheckpointConfig(host_cache_bytes=256 << 10, chunk_bytes=64 << 10, commit_timeout_s=60)


def _state(rank: int) -> dict:
    """The same model on every rank (data parallel), plus one Python object of this rank's."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 16))
    return {"model": model, "notes": {("rank", rank): "a pickled object of this rank"}}


def _save(rank, world, root):
    with Checkpointer(root, SMALL) as ckpt:
        handle = ckpt.save(_state(rank), step=1, replicated=["model"])
        info = handle.wait(60)
        s = handle.stats
        return {"nbytes": s.nbytes, "file_nbytes": s.file_nbytes, "files": s.files,
                "info_nbytes": info.nbytes, "name": info.name}


def _payload_bytes(manifest: dict) -> int:
    """Tensor and object bytes stored in the checkpoint: every region the manifest names once."""
    total = 0
    for entry in manifest["entries"]:
        if entry["kind"] == "tensor":
            total += sum(shard["nbytes"] for shard in entry["shards"])
        else:
            total += entry["nbytes"]
    return total


def test_ranks_stats_add_up_to_the_checkpoint(tmp_path):
    out = run_ranks(2, _save, str(tmp_path))
    ckpt_dir = tmp_path / out[0]["name"]
    manifest = json.loads((ckpt_dir / fmt.MANIFEST).read_text())
    shard_sizes = [os.path.getsize(ckpt_dir / f["name"]) for f in manifest["files"]]
    model_bytes = sum(p.numel() * p.element_size() for p in _state(0)["model"].parameters())

    assert sum(r["nbytes"] for r in out.values()) == _payload_bytes(manifest)
    # each rank wrote some of the replicated model and its own object, none all of the model
    assert all(0 < r["nbytes"] < model_bytes for r in out.values())
    assert [out[r]["file_nbytes"] for r in range(2)] == shard_sizes
    assert sum(shard_sizes) == out[0]["info_nbytes"] == out[1]["info_nbytes"]
    assert [out[r]["files"] for r in range(2)] == [2, 1]  # rank 0 also wrote the manifest
    assert sum(r["files"] for r in out.values()) == len(os.listdir(ckpt_dir))

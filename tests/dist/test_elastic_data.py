"""A data position saved by 4 real ranks (gloo) resumes on 2: the loader's state is global, so the
default rank_policy restores it, and every sample id of the epoch is consumed exactly once apart
from the documented padding (docs/data.md)."""
from __future__ import annotations

import torch

from datastates import CheckpointConfig, Checkpointer, ElasticLoader

from launcher import run_ranks

SMALL = CheckpointConfig(host_cache_bytes=256 << 10, chunk_bytes=64 << 10, commit_timeout_s=60)
N, SEED, STEPS = 29, 5, 2


class Ids(torch.utils.data.Dataset):
    def __len__(self):
        return N

    def __getitem__(self, i):
        return i


def _save(rank, world, root):
    loader = ElasticLoader(Ids(), batch_size=2, seed=SEED)  # world and rank from the group
    batches = iter(loader)
    ids = [i for _ in range(STEPS) for i in next(batches).tolist()]
    with Checkpointer(root, SMALL) as ckpt:
        ckpt.save({"loader": loader}, step=STEPS).wait(60)
    return {"ids": ids, "state": loader.state_dict(), "world": loader.sampler.num_replicas}


def _resume(rank, world, root):
    loader = ElasticLoader(Ids(), batch_size=4, seed=SEED)
    with Checkpointer(root, SMALL) as ckpt:
        ckpt.restore({"loader": loader})  # rank_policy="strict": no ReshardError
    state = loader.state_dict()
    return {"ids": [i for batch in loader for i in batch.tolist()], "state": state,
            "world": loader.sampler.num_replicas}


def test_a_position_saved_on_4_ranks_resumes_on_2(tmp_path):
    root = str(tmp_path / "ck")
    saved = run_ranks(4, _save, root)
    resumed = run_ranks(2, _resume, root)
    order = torch.randperm(N, generator=torch.Generator().manual_seed(SEED)).tolist()
    assert [r["world"] for r in saved.values()] == [4] * 4
    assert [r["world"] for r in resumed.values()] == [2] * 2
    assert [r["state"] for r in saved.values()] == [saved[0]["state"]] * 4  # global
    assert [r["state"] for r in resumed.values()] == [saved[0]["state"]] * 2
    assert saved[0]["state"]["consumed"] == 16
    before = [i for r in saved.values() for i in r["ids"]]
    after = [i for r in resumed.values() for i in r["ids"]]
    assert sorted(before) == sorted(order[:16])
    assert sorted(after) == sorted(order[16:] + order[:1])  # 13 left, padded to 14 for 2 ranks

"""One rank of the torch.distributed.checkpoint tests (see test_dcp.py).

python dcp_worker.py save|load DIR   with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT in the env.
A world of 1 runs without a process group. The model's weights are DTensors sharded on dim 0
when the world is larger than 1, so a load at another world size reshards through DCP.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from datastates.integrations.dcp import DatastatesReader, DatastatesWriter

WORLD = int(os.environ.get("WORLD_SIZE", "1"))
RANK = int(os.environ.get("RANK", "0"))


def full_state(step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    return {
        "w": torch.randn(6, 5, generator=g),
        "b": torch.randn(6, generator=g).bfloat16(),
        "count": torch.tensor(step),
    }


def local_state(full: dict) -> dict:
    """The live state of this rank: weights sharded when distributed."""
    if WORLD == 1:
        return {"model": {k: v.clone() for k, v in full.items()}, "extra": {"step": 0}}
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (WORLD,))
    model = {
        "w": distribute_tensor(full["w"], mesh, [Shard(0)]),
        "b": distribute_tensor(full["b"], mesh, [Shard(0)]),
        "count": distribute_tensor(full["count"], mesh, [Replicate()]),
    }
    return {"model": model, "extra": {"step": 0}}


def gather(state: dict) -> dict:
    out = {}
    for k, v in state["model"].items():
        out[k] = v.full_tensor() if hasattr(v, "full_tensor") else v
    return out


def main(mode: str, root: str) -> None:
    if WORLD > 1:
        dist.init_process_group("gloo")
    if mode == "save":
        state = local_state(full_state(1))
        state["extra"]["step"] = 1
        dcp.save(state, storage_writer=DatastatesWriter(os.path.join(root, "sync")))
        writer = DatastatesWriter(os.path.join(root, "async"))
        for step in (2, 3):  # the writer (and its staging buffers) is reused
            state = local_state(full_state(step))
            state["extra"]["step"] = step
            fut = dcp.async_save(
                state, storage_writer=writer, checkpoint_id=os.path.join(root, "async")
            )
            for t in state["model"].values():  # mutate right away: the save staged a copy
                (t.to_local() if hasattr(t, "to_local") else t).add_(100)
            fut.result()
    else:
        for name, step in (("sync", 1), ("async", 3)):
            state = local_state({k: torch.zeros_like(v) for k, v in full_state(0).items()})
            dcp.load(state, storage_reader=DatastatesReader(os.path.join(root, name)))
            got, want = gather(state), full_state(step)
            for k in want:
                assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), (name, k)
            assert state["extra"]["step"] == step, state["extra"]
    if WORLD > 1:
        dist.barrier()
        dist.destroy_process_group()
    if RANK == 0:
        with open(os.path.join(root, f"{mode}-ok-{WORLD}"), "w") as f:
            f.write("ok")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    # Every check above has passed and the marker file is written. Leave without interpreter
    # teardown: after dcp.async_save on a gloo group, torch 2.13 sometimes aborts at exit
    # ("terminate called without an active exception", about 1 run in 3 here) from a thread of
    # its own async executor; the datastates writer/reader start no thread.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)

"""One rank of test_native_dcp.py: save through DatastatesWriter, load through DCP's stock reader.

python native_dcp_worker.py save|load DIR   with RANK/WORLD_SIZE/MASTER_ADDR/MASTER_PORT in the env.
``load`` calls ``dcp.load(state, checkpoint_id=DIR)`` with no storage reader, so DCP picks its
own ``FileSystemReader``; the weights are DTensors sharded on dim 0 (dcp_worker.py's state).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from dcp_worker import RANK, WORLD, full_state, gather, local_state
from datastates.integrations.dcp import DatastatesWriter


def main(mode: str, root: str) -> None:
    dist.init_process_group("gloo")
    if mode == "save":
        state = local_state(full_state(7))
        state["extra"]["step"] = 7
        dcp.save(state, storage_writer=DatastatesWriter(root))
    else:
        state = local_state({k: torch.zeros_like(v) for k, v in full_state(0).items()})
        dcp.load(state, checkpoint_id=root)
        got, want = gather(state), full_state(7)
        for k in want:
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
        assert state["extra"]["step"] == 7, state["extra"]
    dist.barrier()
    dist.destroy_process_group()
    if RANK == 0:
        with open(os.path.join(os.path.dirname(root), f"{mode}-ok-{WORLD}"), "w") as f:
            f.write("ok")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # as dcp_worker.py: no interpreter teardown after the checks passed

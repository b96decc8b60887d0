"""Coordination between ranks for the commit, off the training process group.

Background threads never call collectives on the training group: they exchange small JSON
messages through a c10d ``Store`` (the TCPStore that ``torch.distributed`` already runs, or one of
our own) with explicit timeouts, so a dead rank produces an error naming it instead of a hang.
"""
from __future__ import annotations

import json
import os
import socket
import time
import uuid
from typing import Any

from .errors import CommitTimeoutError


def new_run_id() -> str:
    """A unique id for one Checkpointer's run that also names its owner (pid and host), so a
    temporary directory left by a dead process is recognised from its name alone."""
    return f"{uuid.uuid4().hex[:8]}@{os.getpid()}@{socket.gethostname()}"


class LocalCommunicator:
    """One process: the coordinator is itself."""

    rank = 0
    world_size = 1

    def __init__(self, run_id: str | None = None):
        self.run_id = run_id or new_run_id()

    def gather(self, seq: int, payload: Any, timeout: float) -> list[Any] | None:
        return [payload]

    def broadcast(self, seq: int, value: Any, timeout: float) -> Any:
        return value

    def close(self) -> None:
        pass


class StoreCommunicator:
    """N ranks sharing a c10d ``Store``. ``gather`` collects every rank's payload on rank 0;
    ``broadcast`` sends rank 0's decision to all. Keys are namespaced by run id and sequence."""

    def __init__(self, store, rank: int, world_size: int, run_id: str):
        self.store = store
        self.rank = rank
        self.world_size = world_size
        self.run_id = run_id

    @classmethod
    def from_process_group(cls, group=None) -> "StoreCommunicator":
        """Built on the training thread (one collective to agree on a run id) from the default
        process group's store."""
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d
        rank, world = dist.get_rank(group), dist.get_world_size(group)
        box = [new_run_id() if rank == 0 else None]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0) if group else 0,
                                   group=group)
        store = dist.PrefixStore(f"datastates/{box[0]}/", c10d._get_default_store())
        return cls(store, rank, world, box[0])

    def _key(self, seq: int, what: str) -> str:
        return f"{seq}/{what}"

    def gather(self, seq: int, payload: Any, timeout: float) -> list[Any] | None:
        self.store.set(self._key(seq, f"r{self.rank}"), json.dumps(payload))
        if self.rank != 0:
            return None
        keys = [self._key(seq, f"r{r}") for r in range(self.world_size)]
        self._wait(keys, timeout, "report its result")
        out = [json.loads(self.store.get(k)) for k in keys]
        for k in keys:
            self.store.delete_key(k)
        return out

    def broadcast(self, seq: int, value: Any, timeout: float) -> Any:
        key = self._key(seq, "result")
        if self.rank == 0:
            self.store.set(key, json.dumps(value))
            return value
        self._wait([key], timeout, "publish the commit decision (rank 0)")
        return json.loads(self.store.get(key))

    def _wait(self, keys: list[str], timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        pending = list(keys)
        while pending:
            pending = [k for k in pending if not self.store.check([k])]
            if not pending:
                return
            if time.monotonic() >= deadline:
                ranks = [k.rsplit("/", 1)[-1] for k in pending]
                raise CommitTimeoutError(
                    f"timed out after {timeout:.0f} s waiting for {', '.join(ranks)} to {what}; "
                    "a rank died or hangs. The checkpoint was not committed",
                    causes={_rank_of(k): "no report (timeout)" for k in pending})
            time.sleep(0.005)  # polling a store key, not synchronizing on time

    def close(self) -> None:
        pass


def _rank_of(key: str) -> int:
    tail = key.rsplit("/", 1)[-1]
    return int(tail[1:]) if tail.startswith("r") and tail[1:].isdigit() else 0

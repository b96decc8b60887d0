"""Run a function on N real processes joined by a gloo process group."""
from __future__ import annotations

import faulthandler
import os
import pickle
import socket
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world, port, fn, args, results, timeout):
    # A hung rank prints every thread's stack and exits, so a hang shows where it is.
    faulthandler.dump_traceback_later(timeout, exit=True)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world))
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world)
        # plain pickle: tensors travel by value, not as shared memory of a process about to exit
        results.put((rank, "ok", pickle.dumps(fn(rank, world, *args))))
    except BaseException as exc:  # reported to the parent, which fails the test
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(world: int, fn, *args, timeout: float = 180.0, allow_dead=()):
    """Run ``fn(rank, world, *args)`` on ``world`` processes; return {rank: result}.

    Raises if a rank raised or did not finish within ``timeout`` (a hang). Ranks in
    ``allow_dead`` may exit without reporting (they kill themselves on purpose)."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, args, results, timeout - 5), daemon=True)
             for r in range(world)]
    for p in procs:
        p.start()
    out, errors = {}, {}
    expected = world - len(allow_dead)
    try:
        while len(out) + len(errors) < expected:
            rank, status, value = results.get(timeout=timeout)
            if status == "ok":
                out[rank] = pickle.loads(value)
            else:
                errors[rank] = value
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(f"rank {r}: {e}" for r, e in sorted(errors.items())))
    return out

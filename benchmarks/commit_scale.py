"""Commit latency against the world size: the protocol, measured with real processes.

    python benchmarks/commit_scale.py [--worlds 1,2,4,8,16,32] [--saves 5] [--tensors 8]
                                      [--out results/commit-scale] [--dir /tmp] [--restart]

Each world size runs that many processes (gloo + the TCPStore of ``torch.distributed``), each
saving a tiny state (``--tensors`` tensors of 64 floats, a per-rank value, an RNG state) so that
what is measured is the commit protocol, not the disk. Per save it records:

- **report → verdict**: from the moment the last rank entered the commit round (its report
  posted) to the moment the last rank had the verdict (wall clock, one machine);
- **store requests per rank**: every call each rank's communicator made on the store during its
  rounds, per save (rank 0 and the mean of the others);
- **manifest bytes** of the committed checkpoint.

``--restart`` measures a restart instead: after one committed save, every rank makes a new
``Checkpointer`` on the same directory, asks ``latest()``, restores it with ``fallback=True``
and closes it; the store requests each rank's communicator made for that (rank 0, the mean and
the largest of the others) are what is recorded (``restart.json``; no latency, no chart).

Writes ``results.json`` and ``commit_scale.png`` (when matplotlib is installed) to ``--out`` and
prints a table. On a machine with fewer cores than ranks the processes share the CPUs, so the
latency at large world sizes includes waiting for a core: the request counts do not.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

if __package__ in (None, ""):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
import datastates  # noqa: E402
from datastates.commit.round import StoreCommunicator, new_run_id  # noqa: E402
from datastates.format.codec import MANIFEST, step_name  # noqa: E402


class CountingStore:
    """Forwards to a c10d store and counts the calls."""

    def __init__(self, inner):
        self.inner, self.calls = inner, 0

    def __getattr__(self, name):
        attr = getattr(self.inner, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            self.calls += 1
            return attr(*args, **kwargs)

        return call


class TimedCommunicator(StoreCommunicator):
    """Records when this rank entered each round and when it had the verdict."""

    def __init__(self, *args):
        super().__init__(*args)
        self.rounds: list[tuple[float, float]] = []

    def agree(self, *args, **kwargs):
        start = time.time()
        verdict = super().agree(*args, **kwargs)
        self.rounds.append((start, time.time()))
        return verdict


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_main(rank: int, world: int, port: int, args, root: str, out_q) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed import distributed_c10d as c10d

    box = [new_run_id() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    store = CountingStore(dist.PrefixStore(f"bench/{box[0]}/", c10d._get_default_store()))
    comm = TimedCommunicator(store, rank, world, box[0])
    torch.manual_seed(0)  # the replicated model is the same on every rank
    state = {
        "model": {f"w{i}": torch.randn(64) for i in range(args.tensors)},
        "mine": torch.full((4,), float(rank)),
        "rng": datastates.RNGState(),
    }
    torch.manual_seed(rank)  # the RNG state is per rank
    config = datastates.CheckpointConfig(keep_last=2, fsync=False, commit_timeout_s=600)
    with datastates.Checkpointer(root, config, communicator=comm) as ckpt:
        ckpt.save(state, step=0, replicated=["model"]).wait()  # warm-up, not counted
        comm.rounds.clear()
        dist.barrier()
        calls0 = store.calls
        for step in range(1, args.saves + 1):
            ckpt.save(state, step=step, replicated=["model"]).wait()
        calls = (store.calls - calls0) / args.saves
        dist.barrier()
        manifest = os.path.getsize(os.path.join(root, step_name(args.saves), MANIFEST))
    out_q.put((rank, json.dumps({"rounds": comm.rounds, "calls": calls, "manifest": manifest})))
    dist.destroy_process_group()


def _restart_main(rank: int, world: int, port: int, args, root: str, out_q) -> None:
    """One committed save, then a restart counted: a new Checkpointer, ``latest()``, a
    fallback restore of it, ``close()``."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    from torch.distributed import distributed_c10d as c10d

    state = {
        "model": {f"w{i}": torch.full((64,), float(i)) for i in range(args.tensors)},
        "mine": torch.full((4,), float(rank)),
    }
    config = datastates.CheckpointConfig(keep_last=2, fsync=False, commit_timeout_s=600)
    with datastates.Checkpointer(root, config) as ckpt:
        ckpt.save(state, step=1, replicated=["model"]).wait()
    box = [new_run_id() if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    store = CountingStore(dist.PrefixStore(f"bench/{box[0]}/", c10d._get_default_store()))
    comm = StoreCommunicator(store, rank, world, box[0])
    blank = {
        "model": {f"w{i}": torch.zeros(64) for i in range(args.tensors)},
        "mine": torch.zeros(4),
    }
    dist.barrier()
    with datastates.Checkpointer(root, config, communicator=comm) as ckpt:
        opened = store.calls
        latest = ckpt.latest()
        listed = store.calls
        report = ckpt.restore(blank, fallback=True)
    assert latest is not None and report.step == 1 and torch.equal(blank["mine"], state["mine"])
    calls = {"open": opened, "latest": listed - opened, "total": store.calls}
    dist.barrier()
    out_q.put((rank, json.dumps({"calls": calls})))
    dist.destroy_process_group()


def run_restart(world: int, args, base: str) -> dict:
    results = _spawn(world, args, os.path.join(base, f"w{world}"), _restart_main)
    others = [results[r]["calls"]["total"] for r in range(1, world)]
    return {
        "world": world,
        "rank0_requests": results[0]["calls"]["total"],
        "other_requests": statistics.mean(others) if others else 0.0,
        "other_max": max(others) if others else 0,
        "rank0_open": results[0]["calls"]["open"],
        "other_open": statistics.mean(results[r]["calls"]["open"] for r in range(1, world))
        if others
        else 0.0,
    }


def _spawn(world: int, args, root: str, main) -> dict:
    """{rank: what ``main`` put on the queue} from ``world`` spawned ranks."""
    ctx = mp.get_context("spawn")
    out_q = ctx.Queue()
    port = _free_port()
    procs = [
        ctx.Process(target=main, args=(r, world, port, args, root, out_q)) for r in range(world)
    ]
    for p in procs:
        p.start()
    results = {}
    for _ in range(world):
        rank, payload = out_q.get(timeout=args.timeout)
        results[rank] = json.loads(payload)
    for p in procs:
        p.join(60)
    shutil.rmtree(root, ignore_errors=True)
    return results


def run_world(world: int, args, base: str) -> dict:
    results = _spawn(world, args, os.path.join(base, f"w{world}"), _rank_main)
    latencies = []
    for i in range(args.saves):
        entered = max(results[r]["rounds"][i][0] for r in range(world))
        verdict = max(results[r]["rounds"][i][1] for r in range(world))
        latencies.append(verdict - entered)
    others = [results[r]["calls"] for r in range(1, world)]
    return {
        "world": world,
        "latency_s": statistics.median(latencies),
        "latency_max_s": max(latencies),
        "rank0_requests": results[0]["calls"],
        "other_requests": statistics.mean(others) if others else 0.0,
        "manifest_bytes": results[0]["manifest"],
    }


def _chart(rows: list[dict], path: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    worlds = [r["world"] for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
    a.plot(worlds, [r["latency_s"] * 1e3 for r in rows], "o-")
    a.set_xscale("log", base=2)
    a.set_xlabel("ranks")
    a.set_ylabel("last report → verdict on every rank (ms)")
    b.plot(worlds, [r["rank0_requests"] for r in rows], "o-", label="rank 0")
    b.plot(worlds, [r["other_requests"] for r in rows], "s-", label="other ranks (mean)")
    b.set_xscale("log", base=2)
    b.set_xlabel("ranks")
    b.set_ylabel("store requests per save")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--worlds", default="1,2,4,8,16,32")
    parser.add_argument("--saves", type=int, default=5)
    parser.add_argument("--tensors", type=int, default=8)
    parser.add_argument("--timeout", type=float, default=600.0)
    parser.add_argument("--out", default="results/commit-scale")
    parser.add_argument("--dir", default=None, help="where the checkpoints go (a temp dir)")
    parser.add_argument(
        "--restart",
        action="store_true",
        help="count the store requests of a restart instead (restart.json)",
    )
    args = parser.parse_args(argv)
    base = tempfile.mkdtemp(prefix="ds-commit-scale-", dir=args.dir)
    if args.restart:
        return _restarts(args, base)
    rows = []
    try:
        for world in (int(w) for w in args.worlds.split(",")):
            rows.append(run_world(world, args, base))
            r = rows[-1]
            print(
                f"{r['world']:>5} ranks  report→verdict {r['latency_s'] * 1e3:8.1f} ms "
                f"(max {r['latency_max_s'] * 1e3:.1f})  requests/save rank 0 "
                f"{r['rank0_requests']:7.1f}  others {r['other_requests']:6.1f}  manifest "
                f"{r['manifest_bytes']:>8} B",
                flush=True,
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "results.json"), "w") as f:
        json.dump(
            {"rows": rows, "saves": args.saves, "tensors": args.tensors, "cpus": os.cpu_count()},
            f,
            indent=1,
        )
    if _chart(rows, os.path.join(args.out, "commit_scale.png")):
        print(f"chart: {os.path.join(args.out, 'commit_scale.png')}")
    return 0


def _restarts(args, base: str) -> int:
    rows = []
    try:
        for world in (int(w) for w in args.worlds.split(",")):
            if world < 2:
                continue
            rows.append(run_restart(world, args, base))
            r = rows[-1]
            print(
                f"{r['world']:>5} ranks  restart store requests: rank 0 "
                f"{r['rank0_requests']:6d} (constructor {r['rank0_open']})  others mean "
                f"{r['other_requests']:6.1f} max {r['other_max']:4d} (constructor "
                f"{r['other_open']:.1f})",
                flush=True,
            )
    finally:
        shutil.rmtree(base, ignore_errors=True)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "restart.json"), "w") as f:
        json.dump({"rows": rows, "tensors": args.tensors, "cpus": os.cpu_count()}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Multi-process benchmark: 2 and 4 ranks (gloo), replicated and DTensor-sharded states,
datastates vs torch.distributed.checkpoint save/async_save/load, in one run. Prints ratios; writes
JSON.

    python benchmarks/distributed.py [--mb 400] [--reps 3] [--worlds 2,4] [--dir .] [--out dist.json]

Per world size and state: the stall of the training loop (``save()`` plus the wait of the next
optimizer step), the time from the save call until the checkpoint is durable (with
``--compute-ms`` of compute in between, as in training), and the load in place at the same world
size from a cold page cache; then the sharded checkpoint loaded by one process (N -> 1).
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

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
import datastates  # noqa: E402


def _state(kind: str, world: int, total_bytes: int):
    """Parameters of ~total_bytes (fp32) as 2-D tensors; replicated or Shard(0)-sharded."""
    n_tensors, cols = 16, 1024
    rows = max(world, total_bytes // 4 // n_tensors // cols)
    torch.manual_seed(0)
    full = [torch.randn(rows, cols) for _ in range(n_tensors)]
    if kind == "sharded":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (world,))
        params = [torch.nn.Parameter(distribute_tensor(t, mesh, [Shard(0)])) for t in full]
    else:
        params = [torch.nn.Parameter(t) for t in full]
    return {f"w{i}": p for i, p in enumerate(params)}


def _evict(root: str) -> None:
    """Drop every file under ``root`` from the page cache: loads are measured cold for everyone
    (datastates writes with O_DIRECT, so its files are never in the cache; DCP's would be)."""
    for base, _, files in os.walk(root):
        for name in files:
            fd = os.open(os.path.join(base, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _compute(ms: float) -> None:
    """Stand-in for forward + backward: matrix products for about ``ms`` milliseconds."""
    a = torch.randn(256, 256)
    end = time.perf_counter() + ms / 1000
    while time.perf_counter() < end:
        a = torch.tanh(a @ a)


def _rank_main(rank, world, port, args, out_q):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import torch.distributed.checkpoint as dcp

    results = {}
    for kind in ("replicated", "sharded"):
        params = _state(kind, world, args.bytes)
        opt = torch.optim.SGD(params.values(), lr=0.01)
        for p in params.values():
            p.grad = torch.full_like(p, 1e-3)
        local_bytes = sum(
            (p.to_local() if hasattr(p, "to_local") else p).numel() * 4 for p in params.values()
        )
        root = os.path.join(args.dir, kind)
        ckpt = datastates.Checkpointer(
            os.path.join(root, "ds"),
            datastates.CheckpointConfig(
                host_cache_bytes=max(64 << 20, local_bytes + (16 << 20)), keep_last=1
            ),
        )
        rep = ["params"] if kind == "replicated" else False
        rows = {"datastates": [], "dcp_save": [], "dcp_async_save": []}
        for r in range(args.reps):
            for method in rows:  # interleaved: every method once per round
                dist.barrier()
                t0 = time.perf_counter()
                if method == "datastates":
                    h = ckpt.save({"params": params, "opt": opt}, step=r, replicated=rep)
                    blocked = time.perf_counter() - t0
                    _compute(args.compute_ms)  # forward + backward
                    t1 = time.perf_counter()
                    opt.step()  # waits only if this rank's capture is still running
                    stall = blocked + time.perf_counter() - t1
                    h.wait()
                elif method == "dcp_save":
                    dcp.save({"params": dict(params)}, checkpoint_id=os.path.join(root, f"dcp{r}"))
                    stall = blocked = time.perf_counter() - t0
                    _compute(args.compute_ms)
                    opt.step()
                else:
                    fut = dcp.async_save(
                        {"params": dict(params)}, checkpoint_id=os.path.join(root, f"adcp{r}")
                    )
                    stall = blocked = time.perf_counter() - t0
                    _compute(args.compute_ms)
                    opt.step()
                    fut.result()
                done = time.perf_counter() - t0
                dist.barrier()
                rows[method].append({"blocked_s": blocked, "stall_s": stall, "commit_s": done})
        # load at the same world size, in place
        loads = {}
        for method in ("datastates", "dcp"):
            dist.barrier()
            if rank == 0:
                _evict(root)
            dist.barrier()
            t0 = time.perf_counter()
            if method == "datastates":
                ckpt.restore({"params": params}, keys=["params"])
            else:
                dcp.load(
                    {"params": dict(params)},
                    checkpoint_id=os.path.join(root, f"dcp{args.reps - 1}"),
                )
            loads[method] = time.perf_counter() - t0
            dist.barrier()
        ckpt.close()
        results[kind] = {"rows": rows, "load_s": loads, "local_bytes": local_bytes}
    dist.destroy_process_group()
    out_q.put((rank, json.dumps(results)))


def _single_process_load(args):
    """World size N -> 1: read the sharded checkpoint back as full tensors."""
    import torch.distributed.checkpoint as dcp

    root = os.path.join(args.dir, "sharded")
    out = {}
    _evict(root)
    t0 = time.perf_counter()
    with datastates.Checkpointer(os.path.join(root, "ds")) as ckpt:
        full = ckpt.load(keys=["params"])["params"]
    out["datastates"] = time.perf_counter() - t0
    _evict(root)
    t0 = time.perf_counter()  # DCP loads into tensors the caller allocates: count that too
    target = {"params": {k: torch.empty_like(v) for k, v in full.items()}}
    dcp.load(target, checkpoint_id=os.path.join(root, f"dcp{args.reps - 1}"), no_dist=True)
    out["dcp"] = time.perf_counter() - t0
    # (values differ: the optimizer stepped between the two methods' saves)
    return out


def _run_world(world: int, args) -> dict:
    """One run at ``world`` ranks: the per-rank results and the N -> 1 load."""
    base = tempfile.mkdtemp(prefix="datastates-dist-bench-", dir=args.base)
    args.dir = base
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        q = ctx.Queue()
        procs = [
            ctx.Process(target=_rank_main, args=(r, world, port, args, q)) for r in range(world)
        ]
        for p in procs:
            p.start()
        per_rank = dict((rank, json.loads(v)) for rank, v in (q.get(timeout=1800) for _ in procs))
        for p in procs:
            p.join()
        one = _single_process_load(args)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    return {"per_rank": per_rank, "load_n_to_1_s": one}


def _print_world(world: int, run: dict, args) -> None:
    per_rank, one = run["per_rank"], run["load_n_to_1_s"]
    print(
        f"\n{world} ranks, {args.mb} MB state, {args.reps} rounds, {args.compute_ms:.0f} ms of "
        "compute between save and optimizer step; medians of the worst rank"
    )
    print(
        f"{'state':<11}{'method':<16}{'stall s':>9}{'committed s':>13}{'commit MB/s':>13}"
        f"{'stall vs ds':>13}{'commit vs ds':>14}"
    )
    for kind in ("replicated", "sharded"):
        med = {}
        for method in ("datastates", "dcp_save", "dcp_async_save"):
            stall = statistics.median(
                max(per_rank[r][kind]["rows"][method][i]["stall_s"] for r in per_rank)
                for i in range(args.reps)
            )
            commit = statistics.median(
                max(per_rank[r][kind]["rows"][method][i]["commit_s"] for r in per_rank)
                for i in range(args.reps)
            )
            med[method] = (stall, commit)
        for method, (stall, commit) in med.items():
            print(
                f"{kind:<11}{method:<16}{stall:>9.3f}{commit:>13.2f}{args.mb / commit:>13.0f}"
                f"{stall / med['datastates'][0]:>12.1f}x{commit / med['datastates'][1]:>13.2f}x"
            )
        loads = {
            m: max(per_rank[r][kind]["load_s"][m] for r in per_rank) for m in ("datastates", "dcp")
        }
        print(
            f"{kind:<11}load in place: datastates {loads['datastates']:.2f} s "
            f"({args.mb / loads['datastates']:.0f} MB/s), dcp {loads['dcp']:.2f} s "
            f"({args.mb / loads['dcp']:.0f} MB/s), dcp / datastates "
            f"{loads['dcp'] / loads['datastates']:.2f}x"
        )
    print(
        f"sharded    load {world} -> 1 process: datastates {args.mb / one['datastates']:.0f} MB/s, "
        f"dcp {args.mb / one['dcp']:.0f} MB/s"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=400, help="total state size in MB")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--worlds", default="2,4", help="world sizes, comma-separated")
    parser.add_argument("--dir", default=os.getcwd())
    parser.add_argument("--out", default="results/distributed.json")
    parser.add_argument(
        "--compute-ms",
        type=float,
        default=300,
        help="compute between save and the optimizer step (forward + backward)",
    )
    args = parser.parse_args()
    args.bytes, args.base = args.mb * 1_000_000, args.dir
    worlds = [int(w) for w in args.worlds.split(",")]
    if not worlds or min(worlds) < 1:
        parser.error(f"--worlds: expected world sizes >= 1, got {args.worlds!r}")
    report = {"mb": args.mb, "reps": args.reps, "compute_ms": args.compute_ms, "per_world": {}}
    for world in worlds:
        report["per_world"][str(world)] = run = _run_world(world, args)
        _print_world(world, run, args)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

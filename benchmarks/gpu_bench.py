"""GPU benchmark: stall per checkpoint of a GPT state on CUDA, datastates (to disk, and to the
memory tier: captured in place into a CUDA-registered mapping) vs torch.save vs DCP async_save,
in one process, and the restore from memory into the live CUDA state. Used by
scripts/gpu_check.sh on a GPU machine; without CUDA it says so and exits 0."""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import torch

_REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
sys.path[:0] = [os.path.join(_REPO, "src"), _REPO]  # datastates, and benchmarks.* as a script
import datastates  # noqa: E402
from benchmarks.gpt import GPT, GPTConfig, synthetic_batch  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", default="gpu_bench.json")
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA: nothing to measure")
        return 0
    cfg = GPTConfig.gpt2_medium_like().__class__(
        vocab_size=50304, block_size=256, n_layer=args.layers, n_head=16, n_embd=1024
    )
    model = GPT(cfg).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(0)

    def step():
        x, y = synthetic_batch(cfg, 8, g, "cuda")
        model(x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()
    torch.cuda.synchronize()
    nbytes = sum(t.numel() * t.element_size() for t in model.state_dict().values()) * 3
    root = tempfile.mkdtemp(prefix="ds-gpu-bench-")
    results = {"state_bytes": nbytes, "device": torch.cuda.get_device_name(), "rows": {}}
    try:
        ckpt = datastates.Checkpointer(
            os.path.join(root, "ds"),
            datastates.CheckpointConfig(
                host_cache_bytes=min(nbytes + (64 << 20), 8 << 30), keep_last=1
            ),
        )
        rows = results["rows"]
        for rep in range(args.reps):
            t0 = time.perf_counter()
            h = ckpt.save({"model": model, "opt": opt}, step=rep)
            blocked = time.perf_counter() - t0
            step()  # the optimizer step waits only for the capture
            torch.cuda.synchronize()
            h.wait()
            s = h.stats
            rows.setdefault("datastates", []).append(
                {
                    "blocked_s": blocked,
                    "step_wait_s": s.step_wait_s,
                    "snapshot_s": s.snapshot_s,
                    "commit_s": s.commit_s,
                }
            )
            path = os.path.join(root, "torch.pt")
            t0 = time.perf_counter()
            with open(path, "wb") as f:
                torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, f)
                os.fsync(f.fileno())
            rows.setdefault("torch_save", []).append({"blocked_s": time.perf_counter() - t0})
            os.remove(path)
            import torch.distributed.checkpoint as dcp

            t0 = time.perf_counter()
            fut = dcp.async_save(
                {"model": model.state_dict(), "opt": opt.state_dict()},
                checkpoint_id=os.path.join(root, f"dcp{rep}"),
                no_dist=True,
            )
            blocked = time.perf_counter() - t0
            fut.result()
            rows.setdefault("dcp_async_save", []).append(
                {"blocked_s": blocked, "commit_s": time.perf_counter() - t0}
            )
            step()
        ckpt.close()
        # The memory tier: captured in place into a CUDA-registered mapping of shared memory.
        shm = tempfile.mkdtemp(
            prefix="ds-gpu-bench-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None
        )
        tier = datastates.MemoryTier(
            root=shm,
            persist_every=None,
            persist_on_exit=False,
            log_path=os.path.join(root, "keeper.log"),
        )
        mem = datastates.Checkpointer(
            os.path.join(root, "mem"),
            datastates.CheckpointConfig(
                host_cache_bytes=min(nbytes + (64 << 20), 8 << 30), memory_tier=tier
            ),
        )
        try:
            for rep in range(args.reps + 2):  # the first two map and register the A/B files
                t0 = time.perf_counter()
                h = mem.save({"model": model, "opt": opt}, step=rep)
                blocked = time.perf_counter() - t0
                step()
                torch.cuda.synchronize()
                h.wait()
                if rep >= 2:
                    s = h.stats
                    rows.setdefault("datastates_memory", []).append(
                        {
                            "blocked_s": blocked,
                            "step_wait_s": s.step_wait_s,
                            "snapshot_s": s.snapshot_s,
                            "commit_s": s.commit_s,
                            "in_place": h._job.in_place,
                        }
                    )
            for _ in range(args.reps):
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                mem.restore({"model": model, "opt": opt})
                torch.cuda.synchronize()
                results.setdefault("restore_memory_s", []).append(time.perf_counter() - t0)
        finally:
            mem.close(stop_keeper=True)
            shutil.rmtree(shm, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    if results.get("restore_memory_s"):
        med = sorted(results["restore_memory_s"])[len(results["restore_memory_s"]) // 2]
        print(
            f"restore from memory into the live CUDA state (median): {med * 1e3:9.1f} ms "
            f"({nbytes / med / 1e9:.1f} GB/s)"
        )
    for name, samples in results["rows"].items():
        med = sorted(r["blocked_s"] + r.get("step_wait_s", 0) for r in samples)[len(samples) // 2]
        print(f"{name:<16} stall per checkpoint (median): {med * 1e3:9.1f} ms")
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

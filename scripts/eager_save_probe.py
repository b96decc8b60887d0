"""How long save() of a plain (unguarded) state dict blocks, against a plain copy of the same
tensors into a preallocated buffer in the same run, and the peak extra RSS of the save.

    PYTHONPATH=src python scripts/eager_save_probe.py --gib 1.5 --rounds 3 DIR

By default the state fits in the host cache, so save() should block for about one memcpy of the
state; with ``--cache-gib`` smaller than the state the rest streams through the cache while
writers free its slots (save() then also waits for the disk).
Peak extra RSS is measured above the state + host cache + reference buffer (all allocated and
touched first), with a sampling thread (psutil) and the kernel's high-water mark.
"""

from __future__ import annotations

import argparse
import ctypes
import resource
import shutil
import statistics
import threading
import time

import psutil
import torch

import datastates


def plain_state(total_bytes: int) -> dict:
    """GPT-like shapes: a few large matrices and many small vectors (float32)."""
    state, made, i = {}, 0, 0
    while made < total_bytes:
        big = min(16 << 20, (total_bytes - made) // 4) or 1
        state[f"layer{i}.weight"] = torch.full((big,), float(i))
        state[f"layer{i}.bias"] = torch.full((1024,), float(i))
        made += big * 4 + 4096
        i += 1
    return state


def reference_copy(state: dict, buf: torch.Tensor) -> float:
    """torch's copy_ of every tensor into the buffer (its own thread pool)."""
    t0, off = time.perf_counter(), 0
    for t in state.values():
        n = t.numel() * t.element_size()
        buf[off : off + n].copy_(t.view(torch.uint8).reshape(-1))
        off += n
    return time.perf_counter() - t0


def reference_memmove(state: dict, buf: torch.Tensor) -> float:
    """One plain memcpy per tensor on this thread."""
    t0, off, base = time.perf_counter(), 0, buf.data_ptr()
    for t in state.values():
        n = t.numel() * t.element_size()
        ctypes.memmove(base + off, t.data_ptr(), n)
        off += n
    return time.perf_counter() - t0


class PeakRSS:
    def __init__(self):
        self.proc, self.peak, self._stop = psutil.Process(), 0, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        while not self._stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss)
            self._stop.wait(0.002)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("dir")
    parser.add_argument("--gib", type=float, default=1.5)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--cache-gib",
        type=float,
        default=None,
        help="host cache size (default: the state plus one unit)",
    )
    args = parser.parse_args()
    total = int(args.gib * (1 << 30))
    state = plain_state(total)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    buf = torch.empty(nbytes, dtype=torch.uint8)
    buf.fill_(0)
    cache = nbytes + (64 << 20) + (1 << 20) * len(state) // 8
    if args.cache_gib is not None:
        cache = int(args.cache_gib * (1 << 30))
    config = datastates.CheckpointConfig(host_cache_bytes=cache, fsync=False)
    shutil.rmtree(args.dir, ignore_errors=True)
    with datastates.Checkpointer(args.dir, config) as ck:
        ck.save({"warm": torch.ones(8)}, step=0).wait()  # the host cache is allocated
        reference_copy(state, buf)  # warm
        proc = psutil.Process()
        blocked, copies, moves, extra, extra_hw = [], [], [], [], []
        for r in range(1, args.rounds + 1):
            copies.append(reference_copy(state, buf))
            moves.append(reference_memmove(state, buf))
            base = proc.memory_info().rss
            base_hw = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            with PeakRSS() as peak:
                t0 = time.perf_counter()
                handle = ck.save(state, step=r, overwrite=True)
                blocked.append(time.perf_counter() - t0)
                handle.wait()
            extra.append(peak.peak - base)
            extra_hw.append(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - base_hw)
            ck.delete(step=r)
        mib = 1 << 20
        print(
            f"state {nbytes / (1 << 30):.2f} GiB in {len(state)} tensors, host cache "
            f"{cache / (1 << 30):.2f} GiB, {torch.get_num_threads()} torch threads"
        )
        print("reference torch copy_ s:", [f"{c:.3f}" for c in copies])
        print("reference memmove s:", [f"{c:.3f}" for c in moves])
        print("save() blocked s:", [f"{b:.3f}" for b in blocked])
        for name, ref in (("torch copy_", copies), ("memmove", moves)):
            print(
                f"median blocked / median {name} = "
                f"{statistics.median(blocked) / statistics.median(ref):.2f}x "
                f"(min/min {min(blocked) / min(ref):.2f}x)"
            )
        print("peak extra RSS during save (sampled) MiB:", [f"{e / mib:.0f}" for e in extra])
        print("high-water RSS growth MiB:", [f"{e / mib:.0f}" for e in extra_hw])


if __name__ == "__main__":
    main()

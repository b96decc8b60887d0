"""Warm paths against memory speed: verify and restore of a checkpoint already in the page cache.

    python benchmarks/bench_warm.py [--gib 1.0] [--reps 3] [--dir /tmp] [--json out.json]

Saves one checkpoint of ``--gib`` GiB (16 fp32 tensors), reads its file once so it is in the page
cache, then measures in the same run, best of ``--reps`` each, alternating:

- ``memcpy``: ``copy_`` of the same number of bytes into a reused buffer (the machine's limit);
- ``read + CRC``: the file read into a reused 8 MiB buffer and CRC-32'd with the checksum backend
  datastates uses, on one thread (what a simple verifier does);
- ``read + CRC, 2 threads``: each half of the file read by its own thread through a reused 1 MiB
  buffer and CRC-32'd (a bare baseline for verify, which reads with ``reader_threads``, 4);
- ``read into tensors + CRC, 2 threads``: the same, each 1 MiB read straight into a flat
  destination tensor and CRC-32'd there (a bare baseline for a verified restore, whose
  destination is memory that is not in the CPU cache);
- ``datastates verify``: ``Reader.verify_all`` (headers, index, every checksum, zero padding);
- ``datastates restore``: ``Checkpointer.restore`` into the live tensors (checksums verified).

Prints GB/s and each row's ratio to ``memcpy``.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import glob
import json
import os
import shutil
import sys
import tempfile
import time

import torch

if __package__ in (None, ""):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
import datastates  # noqa: E402
from datastates.format import checksum  # noqa: E402
from datastates.restore.reader import Reader  # noqa: E402

STEP = 8 << 20
THREAD_STEP = 1 << 20


def _read_crc(path: str, buf: bytearray) -> int:
    view, value = memoryview(buf), 0
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(view)
            if not n:
                return value
            value = checksum.crc32(view[:n], value)


def _read_crc_halves(path: str, nbytes: int, pool, into: memoryview | None = None) -> None:
    """Two threads, each reading one half of the file in ``THREAD_STEP`` pieces (into a reused
    buffer, or into ``into`` at the same offsets) and chaining a CRC-32 over them. Both halves
    end before the file is closed; a short read raises."""
    fd = os.open(path, os.O_RDONLY)

    def half(lo: int, hi: int) -> int:
        scratch = memoryview(bytearray(THREAD_STEP))
        value = 0
        for off in range(lo, hi, THREAD_STEP):
            view = (scratch if into is None else into[off : off + THREAD_STEP])[
                : min(THREAD_STEP, hi - off)
            ]
            n = os.preadv(fd, [view], off)
            if n != view.nbytes:
                raise OSError(f"{path}: read {n} of {view.nbytes} bytes at offset {off}")
            value = checksum.crc32(view, value)
        return value

    try:
        middle = nbytes // 2 // THREAD_STEP * THREAD_STEP
        futures = [pool.submit(half, 0, middle), pool.submit(half, middle, nbytes)]
        concurrent.futures.wait(futures)
        for future in futures:
            future.result()
    finally:
        os.close(fd)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="ds-warm-", dir=args.dir)
    try:
        numel = int(args.gib * (1 << 30)) // 4 // 16
        state = {f"w{i}": torch.randn(numel) for i in range(16)}
        config = datastates.CheckpointConfig(host_cache_bytes=256 << 20)
        with datastates.Checkpointer(root, config) as ckpt:
            ckpt.save(state, step=1).wait()
            path = os.path.join(root, "step-0000000001")
            shard = glob.glob(os.path.join(path, "*.dsf"))[0]
            nbytes = os.path.getsize(shard)
            buf = bytearray(STEP)
            _read_crc(shard, buf)  # into the page cache
            src = torch.empty(nbytes // 4)
            dst = torch.empty_like(src)
            dst.copy_(src)
            live = {k: torch.empty_like(v) for k, v in state.items()}
            flat = torch.empty(nbytes, dtype=torch.uint8)
            into = memoryview(flat.numpy())
            registry = datastates.ProviderRegistry.default()

            def verify():
                with Reader(path, registry=registry) as reader:
                    reader.verify_all()

            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                rows = {
                    "memcpy": lambda: dst.copy_(src),
                    "read + CRC": lambda: _read_crc(shard, buf),
                    "read + CRC, 2 threads": lambda: _read_crc_halves(shard, nbytes, pool),
                    "read into tensors + CRC, 2 threads": lambda: _read_crc_halves(
                        shard, nbytes, pool, into
                    ),
                    "datastates verify": verify,
                    "datastates restore": lambda: ckpt.restore(live),
                }
                best = {name: float("inf") for name in rows}
                for _ in range(args.reps):
                    for name, fn in rows.items():
                        t0 = time.perf_counter()
                        fn()
                        best[name] = min(best[name], time.perf_counter() - t0)
            assert all(torch.equal(live[k], state[k]) for k in state)
            with open(shard, "rb") as f:  # the two-thread rows read every byte where it lies
                assert torch.equal(flat, torch.frombuffer(bytearray(f.read()), dtype=torch.uint8))
    finally:
        shutil.rmtree(root, ignore_errors=True)
    limit = nbytes / best["memcpy"]
    out = {}
    print(f"{nbytes / 2**30:.2f} GiB checkpoint, warm, best of {args.reps}:")
    for name, seconds in best.items():
        rate = nbytes / seconds
        out[name] = {"seconds": seconds, "gb_s": rate / 1e9, "of_memcpy": rate / limit}
        print(f"  {name:<34} {rate / 1e9:6.2f} GB/s  {rate / limit:5.2f}x memcpy")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"nbytes": nbytes, "rows": out}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The memory tier against storage, side by side in one run (docs/memory-tier.md).

    python benchmarks/bench_memory.py [--gib 1.0] [--reps 3] [--dir /tmp] [--snapshots 1000]
                                      [--json out.json]

The state: an MLP of 4096x4096 fp32 layers and its Adam optimizer (``--gib`` GiB in all, the
model a third of it), trained one step so the optimizer has state. Rows, each repetition
alternating memory and disk so drift spreads over both:

- **save**: ``save()`` blocking time, the optimizer step right after it (it waits for the lazy
  capture), and the commit, for a save to memory (``persist=False``: captured in place, straight
  into the mapped shard file), the same save to memory through the host cache
  (``save_memory_cache``: the in-place capture turned off for that save) and to disk (the same
  lazy capture, the same commit protocol, fsync on);
- **restore** into the live model and optimizer: from memory, from memory after a restart (the
  trainer detached, so the keeper checked the newest memory checkpoint and marked it, and a new
  Checkpointer copies it without checksumming again: ``RestoreReport.prechecked``), from disk
  cold (its files dropped from the page cache) and warm; beside them the machine's limits on the same bytes: ``memcpy``
  (``copy_`` into the live tensors from a reused buffer), ``read`` (the memory files read with
  ``pread`` on two threads into one buffer, nothing checked: what the kernel gives a restarted
  process) and ``read + CRC`` of the memory files;
- **snapshots**: ``--snapshots`` memory saves of a 16 MiB state: RSS, open descriptors and the
  files in the memory directory, after the first 50 and after the last.

Prints a table (ratios to ``memcpy`` for the restores) and writes ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

if __package__ in (None, ""):
    _REPO = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    sys.path[:0] = [os.path.join(_REPO, "src"), _REPO]
import datastates  # noqa: E402
from benchmarks.common import drop_from_page_cache  # noqa: E402
from datastates.format import checksum  # noqa: E402
from datastates.memory import place  # noqa: E402

DIM = 4096
LAYER_BYTES = DIM * DIM * 4


def build(gib: float):
    layers = max(1, round(gib * (1 << 30) / 3 / LAYER_BYTES))
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(DIM, DIM, bias=False) for _ in range(layers)])
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    step(model, opt)
    return model, opt


def step(model, opt) -> None:
    model(torch.ones(2, DIM)).sum().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)


def state_bytes(model, opt) -> int:
    n = sum(p.numel() * p.element_size() for p in model.parameters())
    for st in opt.state.values():
        n += sum(t.numel() * t.element_size() for t in st.values() if torch.is_tensor(t))
    return n


def live_tensors(model, opt) -> list[torch.Tensor]:
    out = [p.data for p in model.parameters()]
    for st in opt.state.values():
        out += [t for t in st.values() if torch.is_tensor(t) and t.numel() > 1]
    return out


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def read_crc(paths: list[str], buf: bytearray) -> int:
    view, total = memoryview(buf), 0
    for path in paths:
        value = 0
        with open(path, "rb", buffering=0) as f:
            while True:
                n = f.readinto(view)
                if not n:
                    break
                value = checksum.crc32(view[:n], value)
                total += n
    return total


def timed_read(paths: list[str], into: torch.Tensor, threads: int = 2) -> float:
    """Seconds to ``pread`` the files into ``into`` (a buffer as large as all of them), in
    64 MiB pieces on ``threads`` threads, nothing checked: the fastest the kernel hands a
    restarted process the bytes of a memory checkpoint (the ``read`` row)."""
    view, pieces, at = memoryview(into.numpy()), [], 0
    fds = [os.open(p, os.O_RDONLY) for p in paths]
    try:
        for fd, path in zip(fds, paths):
            size = os.path.getsize(path)
            pieces += [(fd, o, min(64 << 20, size - o), at + o) for o in range(0, size, 64 << 20)]
            at += size

        def run(part):
            for fd, offset, n, where in part:
                os.preadv(fd, [view[where : where + n]], offset)

        t0 = time.perf_counter()
        workers = [threading.Thread(target=run, args=(pieces[i::threads],)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        return time.perf_counter() - t0
    finally:
        for fd in fds:
            os.close(fd)


def timed_copy(live: list[torch.Tensor], source: list[torch.Tensor]) -> float:
    """Seconds to ``copy_`` ``source`` into ``live``: the memcpy row."""
    t0 = time.perf_counter()
    for dst, src in zip(live, source):
        dst.copy_(src)
    return time.perf_counter() - t0


def timed_save(ck, model, opt, s: int, persist: bool) -> dict:
    t0 = time.perf_counter()
    handle = ck.save({"model": model, "opt": opt}, step=s, persist=persist)
    blocked = time.perf_counter() - t0
    step(model, opt)  # waits for the lazy capture
    stepped = time.perf_counter() - t0
    handle.wait()
    return {"blocked_s": blocked, "step_s": stepped - blocked, "commit_s": time.perf_counter() - t0}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", default=tempfile.gettempdir(), help="where the disk tier goes")
    parser.add_argument("--shm", default="/dev/shm", help="the memory tier's root")
    parser.add_argument("--snapshots", type=int, default=1000)
    parser.add_argument("--json")
    args = parser.parse_args(argv)

    work = tempfile.mkdtemp(prefix="bench-memory-", dir=args.dir)
    shm = tempfile.mkdtemp(prefix="bench-memory-", dir=args.shm)
    storage = os.path.join(work, "ckpt")
    model, opt = build(args.gib)
    nbytes = state_bytes(model, opt)
    print(f"state: {len(model)} layers + Adam, {nbytes / 1e9:.2f} GB", flush=True)
    # The disk rows are the trainer's own saves to disk (persist=True), not the keeper's copies.
    tier = datastates.MemoryTier(
        root=shm,
        persist_every=None,
        persist_on_exit=False,
        log_path=os.path.join(work, "keeper.log"),
        storage_writer="trainer",
    )
    config = datastates.CheckpointConfig(
        host_cache_bytes=nbytes + (64 << 20), keep_last=1, memory_tier=tier
    )
    rows: dict[str, list] = {
        k: []
        for k in (
            "save_memory",
            "save_memory_cache",
            "save_disk",
            "restore_memory",
            "restore_memory_restart",
            "restore_disk_cold",
            "restore_disk_warm",
            "memcpy",
            "read_crc",
            "read",
        )
    }
    memdir = place.memory_dir(shm, storage)
    try:
        with datastates.Checkpointer(storage, config) as ck:
            # Warm-up: a disk save sizes the host cache; two memory saves map both shard files
            # of the memory's A/B pair (kept mapped from then on).
            for s, persist in ((0, True), (1, False), (2, False)):
                timed_save(ck, model, opt, s, persist=persist)
            store = ck.memory.store
            for rep in range(args.reps):
                s = 3 * rep + 3  # memory last: its step is the newest, which restore() reads
                rows["save_disk"].append(timed_save(ck, model, opt, s, persist=True))
                store.maps_units = False  # the same save to memory, through the host cache
                rows["save_memory_cache"].append(timed_save(ck, model, opt, s + 1, False))
                del store.maps_units
                rows["save_memory"].append(timed_save(ck, model, opt, s + 2, persist=False))
            live = live_tensors(model, opt)
            source = [torch.empty_like(t) for t in live]
            mem_files = [
                os.path.join(dp, f)
                for dp, _, fs in os.walk(os.path.join(memdir, place.CKPT))
                for f in fs
                if f.endswith(".dsf")
            ]
            buf = bytearray(8 << 20)
            newest_disk = ck.list()[-1].step
            for rep in range(args.reps):
                rows["memcpy"].append(timed_copy(live, source))
                t0 = time.perf_counter()
                read_crc(mem_files, buf)
                rows["read_crc"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                report = ck.restore({"model": model, "opt": opt})
                rows["restore_memory"].append(time.perf_counter() - t0)
                assert report.tier == "memory", report
                drop_from_page_cache([Path(storage)])
                t0 = time.perf_counter()
                ck.restore({"model": model, "opt": opt}, step=newest_disk)
                rows["restore_disk_cold"].append(time.perf_counter() - t0)
                t0 = time.perf_counter()
                ck.restore({"model": model, "opt": opt}, step=newest_disk)
                rows["restore_disk_warm"].append(time.perf_counter() - t0)
            ck.close(stop_keeper=False)  # detached: the keeper checks and marks the newest
            with datastates.Checkpointer(storage, config) as again:  # attached once it is done
                mem_files = [
                    os.path.join(dp, f)
                    for dp, _, fs in os.walk(os.path.join(memdir, place.CKPT))
                    for f in fs
                    if f.endswith(".dsf")
                ]
                into = torch.empty(sum(map(os.path.getsize, mem_files)), dtype=torch.uint8)
                timed_read(mem_files, into)  # warm-up: the buffer's pages
                for rep in range(args.reps):
                    rows["memcpy"].append(timed_copy(live, source))
                    rows["read"].append(timed_read(mem_files, into))
                    t0 = time.perf_counter()
                    report = again.restore({"model": model, "opt": opt})
                    rows["restore_memory_restart"].append(time.perf_counter() - t0)
                    assert report.tier == "memory" and report.prechecked, report
                again.close(stop_keeper=True)
            del source
        snapshots = run_snapshots(work, shm, args.snapshots)
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    result = report_rows(rows, nbytes, snapshots)
    result["args"] = vars(args)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0


def run_snapshots(work: str, shm: str, count: int) -> dict:
    storage = os.path.join(work, "snap")
    tier = datastates.MemoryTier(
        root=shm,
        persist_every=None,
        persist_on_exit=False,
        log_path=os.path.join(work, "keeper-snap.log"),
    )
    state = {"w": torch.zeros(4 << 20), "step": 0}
    memroot = os.path.join(place.memory_dir(shm, storage), place.CKPT)
    seen = {}
    with datastates.Checkpointer(storage, datastates.CheckpointConfig(memory_tier=tier)) as ck:
        for s in range(1, count + 1):
            state["w"].fill_(s)
            state["step"] = s
            ck.save(state, step=s)
            if s in (50, count):
                ck.wait()
                seen[s] = {
                    "rss": rss(),
                    "fds": len(os.listdir("/proc/self/fd")),
                    "memory_entries": sorted(os.listdir(memroot)),
                    "shm_bytes": sum(
                        os.path.getsize(os.path.join(dp, f))
                        for dp, _, fs in os.walk(memroot)
                        for f in fs
                    ),
                }
        ck.close(stop_keeper=True)
    return {"count": count, "at_50": seen.get(50), "at_end": seen.get(count)}


def report_rows(rows: dict, nbytes: int, snapshots: dict) -> dict:
    med = {
        k: statistics.median(v) if v and not isinstance(v[0], dict) else None
        for k, v in rows.items()
    }
    out = {"nbytes": nbytes, "rows": rows, "median_s": med}
    print("\nsave (median)            blocked   opt.step after   committed")
    for k in ("save_memory", "save_memory_cache", "save_disk"):
        b = statistics.median(r["blocked_s"] for r in rows[k]) * 1e3
        st = statistics.median(r["step_s"] for r in rows[k]) * 1e3
        c = statistics.median(r["commit_s"] for r in rows[k])
        out[k] = {"blocked_ms": b, "step_ms": st, "commit_s": c}
        print(f"  {k:<22} {b:7.1f} ms {st:10.1f} ms {c:10.2f} s")
    print("\nrestore (median)          seconds    GB/s   x memcpy")
    for k in (
        "memcpy",
        "read",
        "read_crc",
        "restore_memory",
        "restore_memory_restart",
        "restore_disk_warm",
        "restore_disk_cold",
    ):
        gbps = nbytes / med[k] / 1e9
        print(f"  {k:<22} {med[k]:8.3f} {gbps:7.2f} {med['memcpy'] / med[k]:8.2f}")
        out.setdefault("restore", {})[k] = {
            "s": med[k],
            "gbps": gbps,
            "x_memcpy": med["memcpy"] / med[k],
        }
    a, z = snapshots["at_50"], snapshots["at_end"]
    print(
        f"\nsnapshots: {snapshots['count']} memory saves; after 50 / after all: RSS "
        f"{a['rss'] / 2**20:.0f} / {z['rss'] / 2**20:.0f} MiB, descriptors {a['fds']} / "
        f"{z['fds']}, memory {a['shm_bytes'] / 2**20:.0f} / {z['shm_bytes'] / 2**20:.0f} MiB "
        f"in {z['memory_entries']}"
    )
    out["snapshots"] = snapshots
    return out


if __name__ == "__main__":
    raise SystemExit(main())

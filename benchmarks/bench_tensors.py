#!/usr/bin/env python
"""Many small tensors: the cost per tensor of a save, its commit and a restore.

A state of N tensors of a few floats each (``{"t0": ..., "t1": ...}``, 1k, 10k and 100k of them by
default) saved once and restored in place, by datastates, ``torch.save`` (+ fsync),
``dcp.save`` and ``dcp.async_save`` (``torch.distributed.checkpoint``, ``FileSystemWriter`` with
``sync_files``; ``async_save`` in a one-rank gloo group). Every method writes durably. Reported per
method and count (median of the repetitions):

- ``save_s``: how long the training thread was blocked in the save call;
- ``commit_s``: from the save call until the checkpoint is durable and committed;
- ``restore_s``: a fresh reader (a new ``Checkpointer``, ``torch.load`` + copies, ``dcp.load``)
  filling the live tensors in place, bit-exact (checked).

    python benchmarks/bench_tensors.py                        # 1k, 10k, 100k tensors, 3 reps
    python benchmarks/bench_tensors.py --counts 1000,10000 --methods datastates,torch_save
    python benchmarks/bench_tensors.py --before /path/to/older/src  # datastates of another tree too
    python benchmarks/bench_tensors.py --quick                # 200 and 2000 tensors, one rep

Each measurement runs in a fresh process (its own heap, so the garbage collector sees the same
objects every time), after one untimed warm-up save of the same state (imports, the host cache,
the directory). Repetitions rotate the order of the methods, so slow drift of a shared machine
spreads over all of them. The table goes to stdout, the raw results to ``--json``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

SRC = str(Path(__file__).resolve().parent.parent / "src")
ROOT = str(Path(__file__).resolve().parent.parent)

METHODS = ["datastates", "torch_save", "dcp_save", "dcp_async"]
COUNTS = [1000, 10_000, 100_000]
QUICK_COUNTS = [200, 2000]
METRICS = ("save_s", "commit_s", "restore_s")


def make_state(count: int, numel: int) -> dict:
    """``count`` tensors of ``numel`` float32 each, from a fixed seed."""
    import torch

    g = torch.Generator().manual_seed(count)
    return {f"t{i}": torch.randn(numel, generator=g) for i in range(count)}


def _same(live: dict, state: dict) -> None:
    import torch

    bad = [k for k in state if not torch.equal(live[k], state[k])]
    if bad:
        raise AssertionError(f"restored values differ for {len(bad)} keys, first {bad[0]!r}")


# ---------------------------------------------------------------- one measurement per method


def _datastates(state: dict, root: str) -> dict:
    import datastates

    config = datastates.CheckpointConfig(keep_last=1)
    with datastates.Checkpointer(root, config) as ck:
        ck.save(state, step=0).wait()
        t0 = time.perf_counter()
        handle = ck.save(state, step=1)
        saved = time.perf_counter() - t0
        handle.wait()
        committed = time.perf_counter() - t0
    live = {k: v.new_empty(v.shape) for k, v in state.items()}
    t0 = time.perf_counter()
    with datastates.Checkpointer(root, config) as ck:
        ck.restore(live)
    restored = time.perf_counter() - t0
    _same(live, state)
    return {"save_s": saved, "commit_s": committed, "restore_s": restored}


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _torch_save(state: dict, root: str) -> dict:
    import torch

    def save(step: int) -> str:
        path = os.path.join(root, f"step-{step}.pt")
        with open(path, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(root)
        return path

    os.makedirs(root, exist_ok=True)
    save(0)
    t0 = time.perf_counter()
    path = save(1)
    saved = time.perf_counter() - t0
    live = {k: v.new_empty(v.shape) for k, v in state.items()}
    t0 = time.perf_counter()
    loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    for k, v in loaded.items():
        live[k].copy_(v)
    restored = time.perf_counter() - t0
    _same(live, state)
    return {"save_s": saved, "commit_s": saved, "restore_s": restored}


def _dcp(state: dict, root: str, asynchronous: bool) -> dict:
    import torch.distributed.checkpoint as dcp
    from benchmarks.methods.dcp import ensure_process_group

    def writer(step: int):
        return dcp.FileSystemWriter(
            os.path.join(root, f"step-{step}"), thread_count=2, sync_files=True
        )

    created = ensure_process_group() if asynchronous else False
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            results = _dcp_timed(dcp, state, root, writer, asynchronous)
    finally:
        if created:
            import torch.distributed as dist

            dist.destroy_process_group()
    return results


def _dcp_timed(dcp, state: dict, root: str, writer, asynchronous: bool) -> dict:
    if asynchronous:
        dcp.async_save(state, storage_writer=writer(0)).result()
        t0 = time.perf_counter()
        future = dcp.async_save(state, storage_writer=writer(1))
        saved = time.perf_counter() - t0
        future.result()
        committed = time.perf_counter() - t0
    else:
        dcp.save(state, storage_writer=writer(0), no_dist=True)
        t0 = time.perf_counter()
        dcp.save(state, storage_writer=writer(1), no_dist=True)
        saved = committed = time.perf_counter() - t0
    live = {k: v.new_empty(v.shape) for k, v in state.items()}
    t0 = time.perf_counter()
    dcp.load(live, checkpoint_id=os.path.join(root, "step-1"), no_dist=True)
    restored = time.perf_counter() - t0
    _same(live, state)
    return {"save_s": saved, "commit_s": committed, "restore_s": restored}


def measure(method: str, count: int, numel: int, root: str) -> dict:
    """One measurement of ``method`` on a fresh state of ``count`` tensors, written under the
    (new, empty) directory ``root``."""
    state = make_state(count, numel)
    if method == "datastates":
        return _datastates(state, root)
    if method == "torch_save":
        return _torch_save(state, root)
    if method in ("dcp_save", "dcp_async"):
        return _dcp(state, root, asynchronous=method == "dcp_async")
    raise ValueError(f"unknown method {method!r}; expected one of {METHODS}")


# ---------------------------------------------------------------- the run


def one_in_subprocess(method: str, count: int, numel: int, workdir: str, src: str) -> dict:
    """:func:`measure` in a fresh process importing datastates from ``src``."""
    root = tempfile.mkdtemp(prefix=f"{method}-{count}-", dir=workdir)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, ROOT])}
    try:
        out = subprocess.run(
            [
                sys.executable,
                os.path.abspath(__file__),
                "--one",
                method,
                "--counts",
                str(count),
                "--numel",
                str(numel),
                "--dir",
                root,
            ],
            env=env,
            check=True,
            stdout=subprocess.PIPE,
            text=True,
        ).stdout
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return json.loads(out.strip().splitlines()[-1])


def run(
    runs: list[tuple[str, str, str]],
    counts: list[int],
    numel: int,
    reps: int,
    workdir: str,
    one=one_in_subprocess,
) -> dict:
    """``runs``: (label, method, source tree). Returns every measurement and the medians."""
    raw: dict = {}
    for rep in range(reps):
        for count in counts:
            order = runs[rep % len(runs) :] + runs[: rep % len(runs)]
            for label, method, src in order:
                result = one(method, count, numel, workdir, src)
                raw.setdefault(label, {}).setdefault(str(count), []).append(result)
                print(
                    f"[rep {rep + 1}/{reps}] {label:<20} {count:>7} tensors: "
                    + ", ".join(f"{k} {result[k]:.3f}" for k in METRICS),
                    file=sys.stderr,
                    flush=True,
                )
    return {"numel": numel, "reps": reps, "counts": counts, "raw": raw, "summary": summarize(raw)}


def summarize(raw: dict) -> dict:
    """Median of every metric per label and count, and the same per tensor (microseconds)."""
    out: dict = {}
    for label, by_count in raw.items():
        for count, results in by_count.items():
            row = {m: statistics.median(r[m] for r in results) for m in METRICS}
            row.update({f"{m[:-2]}_us_per_tensor": row[m] / int(count) * 1e6 for m in METRICS})
            out.setdefault(label, {})[count] = row
    return out


def print_table(result: dict) -> None:
    print(
        f"\n{result['numel']} float32 per tensor, median of {result['reps']} repetition(s), "
        "each in a fresh process after one warm-up save; seconds (microseconds per tensor)"
    )
    print("| method | tensors | save() s | commit s | restore s |")
    print("|---|---|---|---|---|")
    for label, by_count in result["summary"].items():
        for count, row in by_count.items():
            cells = " | ".join(
                f"{row[m]:.3f} ({row[m[:-2] + '_us_per_tensor']:.1f})" for m in METRICS
            )
            print(f"| {label} | {int(count):,} | {cells} |")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--counts", default=",".join(map(str, COUNTS)), help="comma-separated numbers of tensors"
    )
    parser.add_argument("--numel", type=int, default=2, help="float32 elements per tensor")
    parser.add_argument(
        "--methods", default=",".join(METHODS), help=f"comma-separated, from {METHODS}"
    )
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--quick", action="store_true", help=f"smoke test: {QUICK_COUNTS} tensors, one repetition"
    )
    parser.add_argument(
        "--before",
        default=None,
        metavar="SRC",
        help="also run datastates imported from SRC (an older source tree), "
        "labelled 'datastates@before'",
    )
    parser.add_argument(
        "--dir",
        default=None,
        help="where checkpoints are written (default: a "
        "temporary directory under the current one; removed at the end)",
    )
    parser.add_argument("--json", default=None, help="write the raw results here")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # one measurement
    args = parser.parse_args(argv)
    counts = QUICK_COUNTS if args.quick else [int(c) for c in args.counts.split(",") if c]
    if args.one:
        print(json.dumps(measure(args.one, counts[0], args.numel, args.dir)))
        return 0
    methods = [m for m in args.methods.split(",") if m]
    unknown = [m for m in methods if m not in METHODS]
    if unknown:
        parser.error(f"unknown method(s) {unknown}; expected some of {METHODS}")
    runs = [(m, m, SRC) for m in methods]
    if args.before and "datastates" in methods:
        runs.append(("datastates@before", "datastates", os.path.abspath(args.before)))
    workdir = tempfile.mkdtemp(prefix="bench-tensors-", dir=args.dir or os.getcwd())
    try:
        result = run(runs, counts, args.numel, 1 if args.quick else args.reps, workdir)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    print_table(result)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

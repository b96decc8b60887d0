#!/usr/bin/env python
"""Opening a directory of many checkpoints: what a restarted job pays before it can restore.

A directory of ``--ckpts`` checkpoints of ``--tensors`` small tensors each (a manifest of a few MB
each at 10,000 tensors) is written once. Then, each in a fresh process (no catalog, no parsed
manifest left over from the writes; the files are in the page cache), median of ``--reps``:

- ``scan``: ``Catalog(root).scan()``, the listing ``latest()``, ``list()``, retention and the next
  commit's number start from (every committed checkpoint, its step, number, size and metrics);
- ``restore``: ``Checkpointer(root).restore(live)`` of the latest, in place (the scan included);
- ``read + CRC``: reading every ``manifest.json`` and its CRC-32, nothing decoded: the least a
  scan that checks every manifest's checksum can cost (the limit row);
- ``parse all``: parsing and validating every manifest whole (``files.read_manifest``).

``--before SRC`` also runs ``scan`` and ``restore`` with datastates imported from another source
tree (an older version), on the same directory, in the same run.

    python benchmarks/bench_scan.py                     # 20 checkpoints x 10,000 tensors, 5 reps
    python benchmarks/bench_scan.py --before /path/to/older/src
    python benchmarks/bench_scan.py --quick             # 4 checkpoints x 500 tensors, one rep
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

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
PHASES = ("scan", "restore", "read_crc", "parse_all")


def write(root: str, ckpts: int, tensors: int) -> None:
    import torch
    import datastates

    state = {f"t{i}": torch.full((2,), float(i)) for i in range(tensors)}
    with datastates.Checkpointer(root) as ck:
        for step in range(1, ckpts + 1):
            ck.save(state, step=step).wait()


def measure(phase: str, root: str, tensors: int) -> float:
    """One timed phase in this (fresh) process."""
    import torch
    import datastates
    from datastates.commit.catalog import Catalog
    from datastates.format import files
    from datastates.format.checksum import crc32

    names = sorted(n for n in os.listdir(root) if n.startswith("step-"))
    live = {f"t{i}": torch.zeros(2) for i in range(tensors)}
    t0 = time.perf_counter()
    if phase == "scan":
        assert len(Catalog(root).scan()) == len(names)
    elif phase == "restore":
        with datastates.Checkpointer(root) as ck:
            assert ck.restore(live).step == len(names)
    elif phase == "read_crc":
        for name in names:
            with open(os.path.join(root, name, "manifest.json"), "rb") as f:
                crc32(f.read())
    else:
        for name in names:
            files.read_manifest(os.path.join(root, name))
    seconds = time.perf_counter() - t0
    if phase == "restore":
        assert all(float(live[f"t{i}"][1]) == float(i) for i in (0, tensors - 1))
    return seconds


def _child(src: str, phase: str, root: str, tensors: int) -> float:
    env = dict(os.environ, PYTHONPATH=src + os.pathsep + os.environ.get("PYTHONPATH", ""))
    out = subprocess.run(
        [
            sys.executable,
            os.path.abspath(__file__),
            "--one",
            phase,
            "--root",
            root,
            "--tensors",
            str(tensors),
        ],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return float(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--ckpts", type=int, default=20)
    parser.add_argument("--tensors", type=int, default=10000)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="4 checkpoints x 500 tensors, 1 rep")
    parser.add_argument(
        "--before",
        default=None,
        metavar="SRC",
        help="also time scan and restore with datastates imported from SRC",
    )
    parser.add_argument(
        "--dir",
        default=None,
        help="where the checkpoints are written (default: "
        "a temporary directory under the current one; removed at the end)",
    )
    parser.add_argument("--json", default=None, help="write the raw results here")
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--root", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.one:
        print(measure(args.one, args.root, args.tensors))
        return 0
    if args.quick:
        args.ckpts, args.tensors, args.reps = 4, 500, 1
    work = tempfile.mkdtemp(prefix="bench-scan-", dir=args.dir or os.getcwd())
    root = os.path.join(work, "ckpt")
    try:
        write(root, args.ckpts, args.tensors)
        rows = [(f"datastates {p}", SRC, p) for p in PHASES]
        if args.before:
            rows += [
                (f"datastates@before {p}", os.path.abspath(args.before), p)
                for p in ("scan", "restore")
            ]
        runs: dict[str, list[float]] = {label: [] for label, _, _ in rows}
        for rep in range(args.reps):  # rotated, so drift of a shared machine spreads over all
            for label, src, phase in rows[rep % len(rows) :] + rows[: rep % len(rows)]:
                runs[label].append(_child(src, phase, root, args.tensors))
        manifest_bytes = sum(
            os.path.getsize(os.path.join(root, n, "manifest.json"))
            for n in os.listdir(root)
            if n.startswith("step-")
        )
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {
        "ckpts": args.ckpts,
        "tensors": args.tensors,
        "reps": args.reps,
        "manifest_bytes": manifest_bytes,
        "median_s": {k: statistics.median(v) for k, v in runs.items()},
        "runs": runs,
    }
    limit = result["median_s"]["datastates read_crc"]
    print(
        f"{args.ckpts} checkpoints x {args.tensors} tensors, manifests {manifest_bytes / 1e6:.1f}"
        f" MB in all, median of {args.reps}"
    )
    print(f"{'':34} {'seconds':>9} {'x read + CRC':>13}")
    for label, seconds in result["median_s"].items():
        print(f"{label:34} {seconds:9.3f} {seconds / limit:13.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())

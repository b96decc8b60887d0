"""The rows of the object-storage benchmark: one :class:`Case` per client and operation.

A case does one PUT/GET/save/load of the benchmark's object through one client, times only that
call (``Bench.timed``, which also records the CPU seconds of client and server), and verifies
the bytes after the clock stops. ``CASE_FACTORIES`` lists the functions that make the cases, so
a new client is one more factory; bench_object_store.py runs them and writes the report.
"""

from __future__ import annotations

import importlib.util
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import numpy as np
import psutil
import torch

MiB = 1 << 20
GiB = 1 << 30
PART = 64 * MiB
MB = 1e6


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
        """(seconds, result) of ``fn()``; appends (client, server) CPU seconds to ``cpu``."""
        client, server = psutil.Process(), psutil.Process(self.server.pid)
        cpu0, srv0, start = client.cpu_times(), server.cpu_times(), time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - start
        cpu1, srv1 = client.cpu_times(), server.cpu_times()
        self.cpu.append(
            (
                cpu1.user + cpu1.system - cpu0.user - cpu0.system,
                srv1.user + srv1.system - srv0.user - srv0.system,
            )
        )
        return seconds, out

    def boto3(self, pool: int = 16):
        from botocore.config import Config

        return self.server.client(
            config=Config(max_pool_connections=pool, s3={"addressing_style": "path"})
        )


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
        got = client.get_object(Bucket=bench.bucket, Key=key, Range=f"bytes={off}-{off + MiB - 1}")[
            "Body"
        ].read()
        if got != bench.source[off : off + MiB]:
            raise AssertionError(f"{key}: bytes at offset {off} differ from the source")


def check_equal(name: str, got, expected) -> None:
    if memoryview(got).cast("B") != memoryview(expected).cast("B"):
        raise AssertionError(f"{name}: bytes read differ from the bytes written")


def scrub(buffer: bytearray) -> None:
    """Zero ``buffer`` in place, so a read that writes nothing cannot pass verification."""
    np.frombuffer(buffer, dtype=np.uint8).fill(0)


# ---------------------------------------------------------------------------------------- boto3
# A seekable file over a memoryview: parts are uploaded without a copy (the backend's own).
from datastates.storage.s3 import ViewReader as MemoryReader  # noqa: E402


def boto3_put(threads: int) -> Callable[[Bench, int], float]:
    def run(bench: Bench, rep: int) -> float:
        client, key = bench.boto3(), bench.key(f"boto3-put-{threads}-{rep}")
        view = memoryview(bench.source)

        def upload(bucket_upload, number_range):
            number, (off, length) = number_range
            return number, client.upload_part(
                Bucket=bench.bucket,
                Key=key,
                UploadId=bucket_upload,
                PartNumber=number,
                Body=MemoryReader(view[off : off + length]),
            )["ETag"]

        def put():
            upload_id = client.create_multipart_upload(Bucket=bench.bucket, Key=key)["UploadId"]
            with ThreadPoolExecutor(threads) as pool:
                etags = dict(
                    pool.map(
                        lambda nr: upload(upload_id, nr),
                        enumerate(part_ranges(bench.size), start=1),
                    )
                )
            client.complete_multipart_upload(
                Bucket=bench.bucket,
                Key=key,
                UploadId=upload_id,
                MultipartUpload={
                    "Parts": [{"PartNumber": n, "ETag": etags[n]} for n in sorted(etags)]
                },
            )

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
            body = client.get_object(
                Bucket=bench.bucket, Key=key, Range=f"bytes={off}-{off + length - 1}"
            )["Body"]
            filled = 0
            while filled < length:
                n = body.readinto(view[off + filled : off + length])
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
    puts = [
        Case(
            "boto3",
            "PUT",
            f"multipart, 64 MiB parts, {n} in flight",
            boto3_put(n),
            missing("boto3"),
        )
        for n in (1, 4, 8)
    ]
    gets = [
        Case(
            "boto3",
            "GET",
            f"ranged GETs of 64 MiB, {n} in flight, readinto one buffer",
            boto3_get(n),
            missing("boto3"),
        )
        for n in (1, 4, 8)
    ]
    return puts + gets


# --------------------------------------------------------------------------------------- obstore
def obstore_store(bench: Bench):
    from obstore.store import S3Store

    opts = bench.server_module.storage_options(bench.server)
    return S3Store(
        bench.bucket,
        endpoint=opts["endpoint_url"],
        access_key_id=opts["aws_access_key_id"],
        secret_access_key=opts["aws_secret_access_key"],
        region=opts["region_name"],
        virtual_hosted_style_request=False,
        client_options={"allow_http": True},
    )


def obstore_put(bench: Bench, rep: int) -> float:
    import obstore

    store, key = obstore_store(bench), bench.key(f"obstore-put-{rep}")
    seconds, _ = bench.timed(
        lambda: obstore.put(
            store,
            key,
            memoryview(bench.source),
            use_multipart=True,
            chunk_size=PART,
            max_concurrency=8,
        )
    )
    check_stored(bench, key)
    bench.server_module.delete_prefix(bench.server, key)
    return seconds


def obstore_get(bench: Bench, rep: int) -> float:
    import obstore

    store, ranges = obstore_store(bench), part_ranges(bench.size)
    seconds, chunks = bench.timed(
        lambda: obstore.get_ranges(
            store,
            bench.key("source"),
            starts=[o for o, _ in ranges],
            lengths=[n for _, n in ranges],
            coalesce=0,
        )
    )
    for (off, length), chunk in zip(ranges, chunks):
        check_equal(f"obstore GET at {off}", chunk, memoryview(bench.source)[off : off + length])
    return seconds


def obstore_cases() -> List[Case]:
    return [
        Case(
            "obstore",
            "PUT",
            "put, multipart 64 MiB chunks, max_concurrency=8",
            obstore_put,
            missing("obstore"),
        ),
        Case(
            "obstore",
            "GET",
            "get_ranges of 64 MiB (at most 10 in flight, its limit)",
            obstore_get,
            missing("obstore"),
        ),
    ]


# ----------------------------------------------------------------------------------------- s3fs
def s3fs_filesystem(bench: Bench):
    import s3fs

    opts = bench.server_module.storage_options(bench.server)
    return s3fs.S3FileSystem(
        key=opts["aws_access_key_id"],
        secret=opts["aws_secret_access_key"],
        endpoint_url=opts["endpoint_url"],
        skip_instance_cache=True,
        client_kwargs={"region_name": opts["region_name"]},
    )


def s3fs_put(bench: Bench, rep: int) -> float:
    fs, key = s3fs_filesystem(bench), bench.key(f"s3fs-put-{rep}")
    seconds, _ = bench.timed(
        lambda: fs.pipe_file(
            f"{bench.bucket}/{key}", bench.source, chunksize=PART, max_concurrency=8
        )
    )
    check_stored(bench, key)
    bench.server_module.delete_prefix(bench.server, key)
    return seconds


def s3fs_get(bench: Bench, rep: int) -> float:
    fs = s3fs_filesystem(bench)
    seconds, data = bench.timed(
        lambda: fs.cat_file(
            f"{bench.bucket}/{bench.key('source')}", chunksize=PART, max_concurrency=8
        )
    )
    check_equal("s3fs GET", data, bench.source)
    return seconds


def s3fs_cases() -> List[Case]:
    return [
        Case(
            "s3fs", "PUT", "pipe_file, 64 MiB parts, max_concurrency=8", s3fs_put, missing("s3fs")
        ),
        Case(
            "s3fs", "GET", "cat_file, 64 MiB ranges, max_concurrency=8", s3fs_get, missing("s3fs")
        ),
    ]


# -------------------------------------------------------------------- torch.distributed.checkpoint
def state_views(buffer: bytearray) -> Dict[str, torch.Tensor]:
    """A state dict of float32 tensors that are views of ``buffer`` (64 MiB each, no copy)."""
    flat = torch.frombuffer(buffer, dtype=torch.float32)
    per = PART // 4
    return {
        f"layer{i:03d}.weight": flat[off : off + per]
        for i, off in enumerate(range(0, flat.numel(), per))
    }


def dcp_kwargs(bench: Bench) -> dict:
    opts = bench.server_module.storage_options(bench.server)
    return {
        "key": opts["aws_access_key_id"],
        "secret": opts["aws_secret_access_key"],
        "endpoint_url": opts["endpoint_url"],
        "skip_instance_cache": True,
        "client_kwargs": {"region_name": opts["region_name"]},
    }


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
    return [
        Case("torch dcp", "save", config, dcp_save, missing("s3fs")),
        Case("torch dcp", "load", config, dcp_load, missing("s3fs")),
    ]


# ------------------------------------------------------------------------------------- datastates
def datastates_checkpointer(bench: Bench):
    """One Checkpointer per benchmark run, reused by every repetition (as a training job does:
    its host cache is allocated by the first save, not by each one)."""
    ckpt = getattr(bench, "_datastates", None)
    if ckpt is None:
        import datastates

        options = bench.server_module.storage_options(bench.server)
        ckpt = datastates.Checkpointer(bench.url("datastates"), storage_options=options)
        ckpt.save(state_views(bench.source), step=10_000).wait()  # warm-up: sizes the cache
        bench._datastates = ckpt
    return ckpt


def datastates_save(bench: Bench, rep: int) -> float:
    state = state_views(bench.source)
    ckpt = datastates_checkpointer(bench)
    seconds, _ = bench.timed(lambda: ckpt.save(state, step=rep).wait())
    return seconds


def datastates_blocked(bench: Bench, rep: int) -> float:
    """How long save() held the caller (the training thread's stall); the save is then waited."""
    ckpt = datastates_checkpointer(bench)
    handle = ckpt.save(state_views(bench.source), step=100 + rep)
    handle.wait()
    return handle.stats.blocked_s


def datastates_restore(bench: Bench, rep: int) -> float:
    scrub(bench.dest)
    state = state_views(bench.dest)
    ckpt = datastates_checkpointer(bench)
    seconds, _ = bench.timed(lambda: ckpt.restore(state, step=rep))
    check_equal("datastates restore", bench.dest, bench.source)
    return seconds


def datastates_cases() -> List[Case]:
    return [
        Case(
            "datastates",
            "save",
            "Checkpointer(s3://...).save(...).wait()",
            datastates_save,
            missing("boto3"),
        ),
        Case(
            "datastates",
            "blocked",
            "time save() blocked the caller (same saves)",
            datastates_blocked,
            missing("boto3"),
        ),
        Case(
            "datastates",
            "load",
            "Checkpointer(s3://...).restore(...)",
            datastates_restore,
            missing("boto3"),
        ),
    ]


CASE_FACTORIES: List[Callable[[], List[Case]]] = [
    boto3_cases,
    obstore_cases,
    s3fs_cases,
    dcp_cases,
    datastates_cases,
]

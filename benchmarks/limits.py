"""Physical limits of this machine and of the target directory's disk, measured in the same run.

Every checkpoint number in the report is also given as a fraction of one of these limits:

- ``write_buffered``: sequential buffered ``write`` of a preallocated buffer + ``fsync`` (what a naive
  writer can reach through the page cache);
- ``write_direct_1t`` / ``write_direct_2t``: the same bytes with ``O_DIRECT`` (1 and 2 writer threads,
  ``pwrite`` releases the GIL), skipped where the file system refuses ``O_DIRECT``;
- ``write``: the best of the above -- the "disk write limit" used for persist throughput;
- ``read_cold``: sequential buffered read after ``fsync`` + ``POSIX_FADV_DONTNEED`` of the file;
- ``read_direct``: the same file read cold with ``O_DIRECT``, 4 threads with one 8 MiB request in
  flight each (a virtio disk needs several requests in flight to reach its bandwidth);
- ``read``: the best of the two cold reads per round -- the "cold read limit" restores are held to;
- ``read_warm``: the same read again, with the file in the page cache;
- ``copy_1t`` / ``copy_nt``: ``Tensor.copy_`` into a preallocated, already touched buffer with one
  thread and with all of torch's threads (the limit for taking a snapshot in host memory);
- ``copy_fresh``: ``empty_like`` + ``copy_`` (fresh pages, so page faults included) -- shown because
  on VMs with free page reporting it is far below ``copy_nt``.

All rates are in GB/s (1e9 bytes per second).
"""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path

import torch

from .common import GB, MiB, drop_from_page_cache, log, now, summarize

CHUNK = 16 * MiB

LIMIT_LABELS = {
    "write_buffered": "buffered write + fsync",
    "write_direct_1t": "O_DIRECT write, 1 thread (+fsync)",
    "write_direct_2t": "O_DIRECT write, 2 threads (+fsync)",
    "read_cold": "cold buffered read (after FADV_DONTNEED)",
    "read_direct": "cold O_DIRECT read, 4 threads x 8 MiB in flight",
    "read_warm": "warm read (page cache)",
    "copy_1t": "copy_ into preallocated buffer, 1 thread",
    "copy_nt": "copy_ into preallocated buffer, all threads",
    "copy_fresh": "empty_like + copy_ (fresh pages)",
}


def _source_chunk() -> mmap.mmap:
    """A page-aligned (hence O_DIRECT-compatible) chunk of incompressible bytes."""
    buf = mmap.mmap(-1, CHUNK)
    buf.write(os.urandom(CHUNK))
    return buf


def _write_buffered(path: Path, nbytes: int, src: mmap.mmap) -> float:
    view = memoryview(src)
    t0 = now()
    with open(path, "wb", buffering=0) as f:
        done = 0
        while done < nbytes:
            n = min(CHUNK, nbytes - done)
            f.write(view[:n])
            done += n
        os.fsync(f.fileno())
    return nbytes / (now() - t0) / GB


def _write_direct(path: Path, nbytes: int, src: mmap.mmap, threads: int) -> float | None:
    """O_DIRECT sequential write with ``threads`` writers on interleaved chunks; None if unsupported."""
    if not hasattr(os, "O_DIRECT"):
        return None
    nbytes -= nbytes % CHUNK
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
    except OSError:
        return None
    errors: list[BaseException] = []

    def writer(first: int) -> None:
        try:
            for off in range(first * CHUNK, nbytes, threads * CHUNK):
                os.pwrite(fd, src, off)
        except BaseException as e:  # noqa: BLE001 - reported after join
            errors.append(e)

    try:
        t0 = now()
        workers = [threading.Thread(target=writer, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        os.fsync(fd)
        dt = now() - t0
    finally:
        os.close(fd)
    if errors:
        if isinstance(errors[0], OSError):
            return None
        raise errors[0]
    return nbytes / dt / GB


def _read(path: Path, cold: bool) -> float:
    if cold:
        drop_from_page_cache([path])
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    total = 0
    t0 = now()
    with open(path, "rb", buffering=0) as f:
        while True:
            n = f.readinto(view)
            if not n:
                break
            total += n
    return total / (now() - t0) / GB


def _read_direct(path: Path, threads: int = 4, chunk: int = 8 * MiB) -> float | None:
    """Cold O_DIRECT read with ``threads`` requests in flight; None where O_DIRECT is refused."""
    if not hasattr(os, "O_DIRECT"):
        return None
    size = path.stat().st_size
    size -= size % chunk
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    except OSError:
        return None
    bufs = [mmap.mmap(-1, chunk) for _ in range(threads)]  # page aligned, touched below
    for b in bufs:
        b.write(bytes(chunk))
    errors: list[BaseException] = []

    def reader(i: int) -> None:
        try:
            for off in range(i * chunk, size, threads * chunk):
                os.preadv(fd, [bufs[i]], off)
        except BaseException as e:  # noqa: BLE001 - reported after join
            errors.append(e)

    try:
        t0 = now()
        workers = [threading.Thread(target=reader, args=(i,)) for i in range(threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        dt = now() - t0
    finally:
        os.close(fd)
        for b in bufs:
            b.close()
    if errors:
        if isinstance(errors[0], OSError):
            return None
        raise errors[0]
    return size / dt / GB


def _best_copy(dst: torch.Tensor, src: torch.Tensor, tries: int = 3) -> float:
    best = 0.0
    for _ in range(tries):
        t0 = now()
        dst.copy_(src)
        best = max(best, src.numel() / (now() - t0) / GB)
    return best


def _copy_rates(nbytes: int) -> dict[str, float]:
    """Copy bandwidths (best of 3 each: a limit is what the machine *can* do)."""
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.zeros(nbytes, dtype=torch.uint8)  # touched: pages already faulted in
    out = {}
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        out["copy_1t"] = _best_copy(dst, src)
    finally:
        torch.set_num_threads(threads)
    out["copy_nt"] = _best_copy(dst, src)
    del dst
    t0 = now()
    fresh = torch.empty_like(src)
    fresh.copy_(src)
    out["copy_fresh"] = nbytes / (now() - t0) / GB
    del fresh, src
    return out


def probe_write(workdir: Path, nbytes: int) -> float | None:
    """One quick disk write measurement (O_DIRECT with 2 threads, else buffered + fsync), run
    between experiments to follow the disk's drift. Returns GB/s; the file is removed."""
    workdir.mkdir(parents=True, exist_ok=True)
    nbytes = max(CHUNK, nbytes - nbytes % CHUNK)
    src = _source_chunk()
    path = workdir / "probe.bin"
    try:
        rate = _write_direct(path, nbytes, src, threads=2)
        if rate is None:
            path.unlink(missing_ok=True)
            rate = _write_buffered(path, nbytes, src)
        return rate
    finally:
        path.unlink(missing_ok=True)
        src.close()


def measure_limits(workdir: Path, nbytes: int, rounds: int) -> dict[str, list[float]]:
    """Measure every limit ``rounds`` times (interleaved) with files of ``nbytes`` in ``workdir``.

    Returns raw samples per limit name; the files are removed before returning.
    """
    workdir.mkdir(parents=True, exist_ok=True)
    nbytes = max(CHUNK, nbytes - nbytes % CHUNK)
    samples: dict[str, list[float]] = {k: [] for k in LIMIT_LABELS}
    src = _source_chunk()
    path = workdir / "limits.bin"
    try:
        for r in range(rounds):
            log(f"limits round {r + 1}/{rounds} ({nbytes / GB:.2f} GB files)")
            samples["write_buffered"].append(_write_buffered(path, nbytes, src))
            samples["read_cold"].append(_read(path, cold=True))
            direct = _read_direct(path)
            if direct is not None:
                samples["read_direct"].append(direct)
            samples["read_warm"].append(_read(path, cold=False))
            path.unlink()
            for t in (1, 2):
                rate = _write_direct(path, nbytes, src, threads=t)
                if rate is not None:
                    samples[f"write_direct_{t}t"].append(rate)
                path.unlink(missing_ok=True)
            for k, v in _copy_rates(min(nbytes, 1 << 30)).items():
                samples[k].append(v)
    finally:
        path.unlink(missing_ok=True)
        src.close()
    return samples


def summarize_limits(samples: dict[str, list[float]]) -> dict[str, dict | None]:
    """Summaries per limit, plus the best-of per round: ``write`` (buffered or O_DIRECT, the disk
    write limit) and ``copy`` (1 thread or all threads, the in-memory copy limit)."""
    out = {k: summarize(v) for k, v in samples.items()}
    for name, parts in (
        ("write", ("write_buffered", "write_direct_1t", "write_direct_2t")),
        ("read", ("read_cold", "read_direct")),
        ("copy", ("copy_1t", "copy_nt")),
    ):
        columns = [samples[k] for k in parts if samples.get(k)]
        out[name] = summarize(max(vals) for vals in zip(*columns)) if columns else None
    return out

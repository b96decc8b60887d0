"""Small helpers shared by the benchmark modules: statistics, file-system walking, page-cache control.

Everything here is pure Python (no torch) so it can be unit-tested in isolation.
"""

from __future__ import annotations

import math
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Sequence

GB = 1e9
MiB = 1 << 20
GiB = 1 << 30

now = time.perf_counter


def log(msg: str) -> None:
    """Progress line on stderr (stdout stays free for a caller that pipes the report)."""
    print(f"[bench {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------- statistics
def summarize(values: Iterable[float | None]) -> dict | None:
    """Median, min, max and count of the finite values; ``None`` when there is none.

    The raw values are kept (``values``) so the JSON can be re-analysed without re-running.
    """
    vals = [float(v) for v in values if v is not None and math.isfinite(float(v))]
    if not vals:
        return None
    return {
        "median": statistics.median(vals),
        "min": min(vals),
        "max": max(vals),
        "n": len(vals),
        "values": vals,
    }


def median_of(summary: dict | None) -> float | None:
    return None if summary is None else summary["median"]


def safe_div(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0 or not math.isfinite(a) or not math.isfinite(b):
        return None
    return a / b


def paired_ratios(rounds: Sequence[dict], key: str, method: str, reference: str) -> list[float]:
    """Ratios ``rounds[i][method][key] / rounds[i][reference][key]``, one per round with both values.

    A round is ``{method_name: {metric: value}}``. Pairing inside a round means that slow drift of
    the machine (page-cache state, a neighbour's load) cancels out instead of favouring one side.
    """
    out = []
    for rnd in rounds:
        a = rnd.get(method, {}).get(key)
        b = rnd.get(reference, {}).get(key)
        r = safe_div(a, b)
        if r is not None:
            out.append(r)
    return out


def rotated(items: Sequence, shift: int) -> list:
    """``items`` rotated left by ``shift``: round r starts with a different method, so no method
    always runs first (cold) or right after the same neighbour."""
    if not items:
        return []
    s = shift % len(items)
    return list(items[s:]) + list(items[:s])


# --------------------------------------------------------------------------------------- file system
@dataclass
class DiskUsage:
    files: int
    nbytes: int


def list_entries(root: Path) -> set[str]:
    """Names of the top-level entries of ``root`` (empty if it does not exist)."""
    try:
        return set(os.listdir(root))
    except FileNotFoundError:
        return set()


def iter_files(paths: Iterable[Path]) -> list[Path]:
    """Every regular file under the given files/directories (symlinks are not followed)."""
    out: list[Path] = []
    for p in paths:
        p = Path(p)
        if p.is_symlink():
            continue
        if p.is_file():
            out.append(p)
        elif p.is_dir():
            for dirpath, _dirs, files in os.walk(p):
                for f in files:
                    fp = Path(dirpath) / f
                    if fp.is_file() and not fp.is_symlink():
                        out.append(fp)
    return out


def disk_usage(paths: Iterable[Path]) -> DiskUsage:
    files = iter_files(paths)
    return DiskUsage(files=len(files), nbytes=sum(f.stat().st_size for f in files))


def fsync_path(path: Path) -> None:
    """fsync a file or a directory (the directory entry makes a new file durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: Path) -> None:
    """fsync every file under ``root`` and the directories holding them (for writers that do not)."""
    dirs = {Path(root)}
    for f in iter_files([root]):
        fsync_path(f)
        dirs.add(f.parent)
    for d in dirs:
        fsync_path(d)


def drop_from_page_cache(paths: Iterable[Path]) -> int:
    """Evict the files from the page cache (fsync first, so no page is dirty; then FADV_DONTNEED).

    Returns the number of files handled. This is what makes a following read "cold" without root
    privileges or dropping the whole machine's cache.
    """
    n = 0
    for f in iter_files(paths):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return n


def read_through(paths: Iterable[Path], chunk: int = 16 * MiB) -> int:
    """Read the files once with buffered I/O so they sit in the page cache ("warm")."""
    total = 0
    buf = bytearray(chunk)
    view = memoryview(buf)
    for f in iter_files(paths):
        with open(f, "rb", buffering=0) as fh:
            while True:
                n = fh.readinto(view)
                if not n:
                    break
                total += n
    return total


def remove_paths(paths: Iterable[Path]) -> None:
    for p in paths:
        p = Path(p)
        if p.is_dir() and not p.is_symlink():
            shutil.rmtree(p, ignore_errors=True)
        else:
            try:
                p.unlink()
            except FileNotFoundError:
                pass


def fmt_bytes(n: float | None) -> str:
    if n is None:
        return "n/a"
    for unit, scale in (("GiB", GiB), ("MiB", MiB), ("KiB", 1024)):
        if abs(n) >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def fmt_rate(gbps: float | None) -> str:
    return "n/a" if gbps is None else f"{gbps:.2f} GB/s"


def fmt_s(s: float | None) -> str:
    if s is None:
        return "n/a"
    if s < 1e-3:
        return f"{s * 1e6:.0f} µs"
    if s < 1:
        return f"{s * 1e3:.1f} ms"
    return f"{s:.2f} s"

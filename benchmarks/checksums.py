#!/usr/bin/env python
"""CRC-32 backends on this machine: GB/s with 1 thread and 2 threads at once, and whether each
releases the GIL (a Python thread keeps running while it checksums).

    python benchmarks/checksums.py            # 256 MiB buffer, best of 3

Every backend must give zlib's values (checked on the buffer first); the one datastates uses is
marked. ``run.py`` includes this table in its report.
"""

from __future__ import annotations

import os
import sys
import threading
import time
import zlib
from pathlib import Path

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GB = 1e9


def _backends() -> tuple[list, str | None]:
    """(backends with ``.name`` and ``.crc32``, the name datastates uses); only zlib where the
    datastates under test has no checksum module (an older version)."""
    try:
        from datastates.format import checksum
    except ImportError:

        class _Zlib:
            name = "zlib"
            crc32 = staticmethod(zlib.crc32)

        return [_Zlib()], None
    return checksum.available(), checksum.BACKEND


def _rate(fn, view: memoryview, threads: int, tries: int = 3) -> float:
    best = 0.0
    for _ in range(tries):
        workers = [threading.Thread(target=fn, args=(view,)) for _ in range(threads)]
        t0 = time.perf_counter()
        for w in workers:
            w.start()
        for w in workers:
            w.join()
        best = max(best, threads * view.nbytes / (time.perf_counter() - t0) / GB)
    return best


def _gil_share(fn, view: memoryview) -> float:
    """Iterations/s of a Python loop while ``fn`` runs on another thread, over the same loop's
    rate alone: near 0 if ``fn`` holds the GIL, near 1 (or more) if it releases it."""

    def spin(seconds: float, stop: threading.Event | None = None) -> float:
        n, t0 = 0, time.perf_counter()
        while (stop is None and time.perf_counter() - t0 < seconds) or (
            stop is not None and not stop.is_set()
        ):
            n += 1
        return n / (time.perf_counter() - t0)

    alone = spin(0.2)
    done = threading.Event()

    def work() -> None:
        for _ in range(4):
            fn(view)
        done.set()

    worker = threading.Thread(target=work)
    worker.start()
    during = spin(0.0, done)
    worker.join()
    return during / alone


def measure(nbytes: int = 256 << 20) -> list[dict]:
    """One row per installed backend: name, 1-thread and 2-thread GB/s, GIL share, in use."""
    data = bytearray(os.urandom(1 << 20)) * (nbytes >> 20)
    view = memoryview(data)
    expected = zlib.crc32(view)
    rows = []
    backends, in_use = _backends()
    for backend in backends:
        if backend.crc32(view) != expected:
            raise AssertionError(f"{backend.name}: CRC-32 differs from zlib's")
        rows.append(
            {
                "backend": backend.name,
                "gbps_1t": _rate(backend.crc32, view, 1),
                "gbps_2t": _rate(backend.crc32, view, 2),
                "gil_share": _gil_share(backend.crc32, view),
                "in_use": backend.name == in_use,
            }
        )
    return rows


def main() -> int:
    print(
        "| backend | 1 thread | 2 threads at once | other Python thread's speed during it | used |"
    )
    print("|---|---|---|---|---|")
    for r in measure():
        print(
            f"| {r['backend']} | {r['gbps_1t']:.2f} GB/s | {r['gbps_2t']:.2f} GB/s | "
            f"{r['gil_share']:.0%} | {'yes' if r['in_use'] else ''} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

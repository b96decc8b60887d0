"""One rank's view of a split manifest at scale, against the whole parse: what a restoring rank
of the job pays to read the manifest (``files.read_manifest`` whole, and with ``view=(rank,
world)`` for rank 1, a middle rank and the last rank), and what a listing of the job pays for
the newest checkpoint (``files.split_summary``: every part read and CRC-checked, none decoded)
against the whole parse a one-process listing makes. The manifests are those of the review
benchmark's reports (200 tensors per rank, tensor parallel 4, benchmarks/scale_inputs.py),
written split at 1,024 and 2,048 ranks.

    PYTHONPATH=. python results/scratch-2026-12-03-view/view_cost.py [WORLDS]

Best of 3 per row, each after a full collection, whole and views taking turns; peak memory of
each read by tracemalloc in a separate pass."""
import dataclasses
import gc
import json
import os
import sys
import tempfile
import time
import tracemalloc

from benchmarks import scale_inputs as si
from datastates.commit.review import build_manifest
from datastates.format import codec, files
from datastates.format.validate import parse_rank_report
from datastates.storage import LOCAL


def main() -> None:
    worlds = [int(w) for w in (sys.argv[1] if len(sys.argv) > 1 else "1024,2048").split(",")]
    base = tempfile.mkdtemp()
    raw = si.capture_reports(16, 200, 4, os.path.join(base, "capture"))
    out = {}
    for world in worlds:
        texts = si.widen(raw, world, 4)
        reports = [parse_rank_report(json.loads(t), f"report {r}") for r, t in enumerate(texts)]
        manifest = dataclasses.replace(build_manifest(reports, name="step-0000000001", step=1,
                                                      metadata={}, save_id="x"), seq=1)
        del texts, reports
        d = os.path.join(base, f"split-{world}")
        os.makedirs(d)
        encoded = files.encode_manifest_record(manifest)
        del manifest
        open(os.path.join(d, codec.MANIFEST), "wb").write(encoded.data)
        for name, part in encoded.parts:
            open(os.path.join(d, name), "wb").write(part)
        sizes = {"head_bytes": len(encoded.data), "parts": [len(p) for _, p in encoded.parts]}
        del encoded
        head = open(os.path.join(d, codec.MANIFEST), "rb").read()
        ranks = {"rank 1": 1, "middle rank": world // 2, "last rank": world - 1}
        runs = {"whole": lambda: files.read_manifest(d),
                "listing check": lambda: files.split_summary(
                    head, "m", d, files.part_reader(d, LOCAL)),
                **{f"view {k}": (lambda r=r: files.read_manifest(d, view=(r, world)))
                   for k, r in ranks.items()}}
        rows = {k: [] for k in runs}
        for _ in range(3):
            for k, run in runs.items():
                gc.collect()
                t = time.perf_counter()
                result = run()
                rows[k].append(time.perf_counter() - t)
                del result
        peak = {}
        for k, run in runs.items():
            gc.collect()
            tracemalloc.start()
            result = run()
            peak[k] = tracemalloc.get_traced_memory()[1]
            tracemalloc.stop()
            if k.startswith("view"):
                peak[k + " entries"] = len(result.entries)
            del result
        out[world] = {"best_s": {k: min(v) for k, v in rows.items()}, "peak_bytes": peak,
                      **sizes}
        print(world, json.dumps(out[world]), flush=True)
    print(json.dumps({"measured": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(),
                      "loadavg": os.getloadavg(), "results": out}, indent=1))


if __name__ == "__main__":
    main()

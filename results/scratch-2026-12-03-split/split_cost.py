"""Split manifests at scale: what rank 0's publish encodes and what a reader parses, one file
against split, for the manifests of the review benchmark's reports (200 tensors per rank, tensor
parallel 4, benchmarks/scale_inputs.py) at 1,024 and 2,048 ranks; and a listing's read of one
checkpoint's head (whole file + CRC for one file; manifest.json alone for split).

    python results/scratch-2026-12-03-split/split_cost.py REPORTS.json [WORLDS]

REPORTS.json: captured reports (``scale_inputs.capture_reports(16, 200, 4, dir)`` as JSON).
Best of 3 per row, each after a full collection, one file and split taking turns."""
import dataclasses
import gc
import json
import os
import sys
import tempfile
import time

from benchmarks import scale_inputs as si
from datastates.commit.review import build_manifest
from datastates.format import codec, files
from datastates.format.validate import parse_rank_report
from datastates.storage import open_store


def main() -> None:
    raw = json.load(open(sys.argv[1]))
    worlds = [int(w) for w in (sys.argv[2] if len(sys.argv) > 2 else "1024,2048").split(",")]
    out = {}
    for world in worlds:
        texts = si.widen(raw, world, 4)
        reports = [parse_rank_report(json.loads(t), f"report {r}") for r, t in enumerate(texts)]
        manifest = dataclasses.replace(build_manifest(reports, name="step-0000000001", step=1,
                                                      metadata={}, save_id="x"), seq=1)
        del texts, reports
        base = tempfile.mkdtemp()
        whole_dir, split_dir = os.path.join(base, "whole"), os.path.join(base, "split")
        rows = {"encode whole": [], "encode split": [], "read whole": [], "read split": [],
                "summary whole": [], "summary split": []}
        for rep in range(3):
            gc.collect()
            t = time.perf_counter()
            data, _ = files.manifest_record_bytes(manifest)
            rows["encode whole"].append(time.perf_counter() - t)
            gc.collect()
            t = time.perf_counter()
            encoded = files.encode_manifest_record(manifest)
            rows["encode split"].append(time.perf_counter() - t)
            if rep == 0:
                os.makedirs(whole_dir), os.makedirs(split_dir)
                open(os.path.join(whole_dir, codec.MANIFEST), "wb").write(data)
                open(os.path.join(split_dir, codec.MANIFEST), "wb").write(encoded.data)
                for name, part in encoded.parts:
                    open(os.path.join(split_dir, name), "wb").write(part)
                sizes = {"whole_bytes": len(data), "head_bytes": len(encoded.data),
                         "parts": [len(p) for _, p in encoded.parts]}
            del data, encoded
            for kind, d in (("whole", whole_dir), ("split", split_dir)):
                gc.collect()
                t = time.perf_counter()
                read = files.read_manifest(d)
                rows[f"read {kind}"].append(time.perf_counter() - t)
                del read
                gc.collect()
                t = time.perf_counter()
                store = open_store(d)
                head = store.read_bytes(os.path.join(d, codec.MANIFEST), codec.MAX_MANIFEST_BYTES)
                assert files.parse_manifest_summary(head, "m", d) is not None
                rows[f"summary {kind}"].append(time.perf_counter() - t)
        out[world] = {"best_s": {k: min(v) for k, v in rows.items()}, **sizes}
        print(world, json.dumps(out[world]), flush=True)
    print(json.dumps({"measured": time.strftime("%Y-%m-%d %H:%M"), "cpus": os.cpu_count(),
                      "loadavg": os.getloadavg(), "results": out}, indent=1))


if __name__ == "__main__":
    main()

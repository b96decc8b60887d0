"""Reading a manifest at scale with and without the garbage collector's pause: rank 0's manifest
for WORLD ranks of 200 tensors each (as manifest_at_scale.py of 2026-12-03 builds it), then its
bytes parsed as a restoring rank reads them (files.parse_manifest_bytes) in a fresh process of
each source tree, the trees taking turns, fastest of REPS; then one young-generation collection
(what the pause defers) inside the timing.

    python parse_paused.py 256,1024,2048 SRC_BEFORE [REPS]
"""
import dataclasses
import gc
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

if len(sys.argv) > 2 and sys.argv[1] == "--read":
    sys.path[:0] = [sys.argv[3]]
    from datastates.format import files
    with open(sys.argv[2], "rb") as f:
        raw = f.read()
    gc.collect()
    t = time.perf_counter()
    manifest = files.parse_manifest_bytes(raw, sys.argv[2])
    gc.collect(0)
    print(time.perf_counter() - t)
    sys.exit(0)

sys.path[:0] = [os.path.join(REPO, "src"), REPO]
from benchmarks import scale_inputs as si  # noqa: E402
from datastates.commit.review import build_manifest  # noqa: E402
from datastates.format.files import manifest_record_bytes  # noqa: E402
from datastates.format.validate import parse_rank_report  # noqa: E402
import json  # noqa: E402

trees = {"paused": os.path.join(REPO, "src"), "before": sys.argv[2]}
reps = int(sys.argv[3]) if len(sys.argv) > 3 else 3
base = tempfile.mkdtemp()
captured = si.capture_reports(64, 200, 4, base)
for world in map(int, sys.argv[1].split(",")):
    raw = si.widen(captured, world, 4)
    reports = [parse_rank_report(json.loads(text), f"report {r}") for r, text in enumerate(raw)]
    manifest = build_manifest(reports, name="step-1", step=1, metadata={},
                              save_id=reports[0].save.nonce)
    data, _ = manifest_record_bytes(dataclasses.replace(manifest, seq=1))
    shards = sum(len(e.shards) for e in manifest.entries if e.kind == "tensor")
    path = os.path.join(base, f"manifest-{world}.json")
    with open(path, "wb") as f:
        f.write(data)
    del raw, reports, manifest
    times = {name: [] for name in trees}
    for _ in range(reps):
        for name, src in trees.items():
            out = subprocess.run([sys.executable, __file__, "--read", path, src], check=True,
                                 capture_output=True, text=True).stdout
            times[name].append(float(out))
    print(f"{world} ranks, {len(data) / 2**20:.1f} MiB, {shards} shards: " + ", ".join(
        f"{name} {min(t):.2f} s ({min(t) / shards * 1e6:.1f} us per shard)"
        for name, t in times.items()), flush=True)

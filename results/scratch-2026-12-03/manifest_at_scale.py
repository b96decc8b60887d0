"""What reading the manifest costs every rank at restore, by world size: rank 0's manifest for
WORLD ranks of 200 tensors each (tensor parallel 4; the reports of 64 real one-process saves,
relabelled as further pipeline stages, as benchmarks/review_cost.py makes them), then, in a fresh
process, its bytes parsed and checked as a restoring rank reads them (files.parse_manifest_bytes),
with the time and the growth of the process's resident memory while the record is held.

    python manifest_at_scale.py 256,1024      # run from the repository root's parent or anywhere
"""
import dataclasses
import gc
import os
import subprocess
import sys
import tempfile
import time

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
sys.path[:0] = [os.path.join(REPO, "src"), REPO]


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


if len(sys.argv) > 2 and sys.argv[1] == "--read":
    from datastates.format import files
    with open(sys.argv[2], "rb") as f:
        raw = f.read()
    gc.collect()
    before, t = rss(), time.perf_counter()
    manifest = files.parse_manifest_bytes(raw, sys.argv[2])
    seconds = time.perf_counter() - t
    shards = sum(len(e.shards) for e in manifest.entries if e.kind == "tensor")
    print(f"  {len(raw) / 2**20:6.1f} MiB, {len(manifest.entries)} entries, {shards} shards: "
          f"parsed in {seconds:.2f} s ({seconds / shards * 1e6:.1f} us per shard), resident "
          f"memory +{(rss() - before) / 2**20:.0f} MiB ({(rss() - before) / shards:.0f} B per shard)")
    sys.exit(0)

from benchmarks import scale_inputs as si  # noqa: E402
from datastates.commit.review import build_manifest  # noqa: E402
from datastates.format.files import manifest_record_bytes  # noqa: E402
from datastates.format.validate import parse_rank_report  # noqa: E402
import json  # noqa: E402

base = tempfile.mkdtemp()
captured = si.capture_reports(64, 200, 4, base)
for world in map(int, sys.argv[1].split(",")):
    raw = si.widen(captured, world, 4)
    reports = [parse_rank_report(json.loads(text), f"report {r}") for r, text in enumerate(raw)]
    manifest = build_manifest(reports, name="step-1", step=1, metadata={},
                              save_id=reports[0].save.nonce)
    data, _ = manifest_record_bytes(dataclasses.replace(manifest, seq=1))
    path = os.path.join(base, f"manifest-{world}.json")
    with open(path, "wb") as f:
        f.write(data)
    del raw, reports, manifest, data
    print(f"{world} ranks:")
    subprocess.run([sys.executable, __file__, "--read", path], check=True)

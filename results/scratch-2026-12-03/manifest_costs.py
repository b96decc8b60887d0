"""Seconds to read (files.read_manifest: decode, parse, check) and to check and encode
(files.manifest_record_bytes, the writer's side) the manifest of a checkpoint of 100k tensors of
2 floats: the reader with the collector on and off, the writer three times with it off.

    python manifest_costs.py SRC     # SRC: the src tree to measure
"""
import gc
import os
import shutil
import sys
import tempfile
import time

sys.path.insert(0, sys.argv[1])
import torch  # noqa: E402

import datastates  # noqa: E402
from datastates.format import files  # noqa: E402

state = {f"t{i}": torch.randn(2) for i in range(100000)}
root = tempfile.mkdtemp()
with datastates.Checkpointer(root) as ck:
    ck.save(state, step=0).wait()
del state
d = os.path.join(root, "step-0000000000")
for collect in (True, False, True, False):
    gc.enable() if collect else gc.disable()
    gc.collect()
    t = time.perf_counter()
    manifest = files.read_manifest(d)
    print(f"read_manifest, collector {'on ' if collect else 'off'} {time.perf_counter() - t:.3f} s")
gc.disable()
for _ in range(3):
    t = time.perf_counter()
    files.manifest_record_bytes(manifest)
    print(f"manifest_record_bytes, collector off {time.perf_counter() - t:.3f} s")
shutil.rmtree(root)

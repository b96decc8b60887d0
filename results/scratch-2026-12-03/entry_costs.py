"""Microseconds per manifest entry of the reader's parse (plain.tensor_entry) and the writer's
check and encoding (plain.tensor_entry_json): 100k entries of a tensor of 2 floats held whole,
then 25k entries of a [4, 2] tensor in four one-row shards (tensor parallel 4), best of 5,
collector off.

    python entry_costs.py SRC        # SRC: the src tree to measure
"""
import gc
import sys
import time

sys.path.insert(0, sys.argv[1])
from datastates.format import codec as fmt, plain  # noqa: E402
from datastates.format.records import FileRef  # noqa: E402

files_ = (FileRef(name=fmt.shard_file_name(0), rank=0, nbytes=1 << 40, index_crc32=0),)
decoded = [{"kind": "tensor", "key": f"t{i}", "dtype": "float32", "shape": [2],
            "shards": [{"file": 0, "offset": 4096 + 64 * i, "nbytes": 8, "global_offset": [0],
                        "shape": [2], "checksums": [[8, 12345]]}]} for i in range(100000)]
gc.disable()


def best(fn, items):
    times = []
    for _ in range(5):
        t = time.perf_counter()
        out = [fn(x) for x in items]
        times.append(time.perf_counter() - t)
    assert all(o is not None for o in out)
    return min(times) / len(items) * 1e6, out


parse_us, records = best(lambda e: plain.tensor_entry(e, files_, 1), decoded)
write_us, _ = best(lambda e: plain.tensor_entry_json(e, files_, 1), records)
print(f"whole:      tensor_entry {parse_us:.2f} us  tensor_entry_json {write_us:.2f} us")
sharded = [{"kind": "tensor", "key": f"t{i}", "dtype": "float32", "shape": [4, 2],
            "shards": [{"file": 0, "offset": 4096 + 256 * i + 64 * r, "nbytes": 8,
                        "global_offset": [r, 0], "shape": [1, 2], "checksums": [[8, 12345]]}
                       for r in range(4)]} for i in range(25000)]
parse_us, records = best(lambda e: plain.tensor_entry(e, files_, 1), sharded)
write_us, _ = best(lambda e: plain.tensor_entry_json(e, files_, 1), records)
print(f"4 shards:   tensor_entry {parse_us:.2f} us  tensor_entry_json {write_us:.2f} us")

"""A shard file's index of 1,000 tensor entries: through dicts and the JSON encoder, and as text
entry by entry; three interleaved timings of 20 encodings each, checked to give the same bytes."""
import os
import sys
import timeit

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))
from datastates.format import codec, plain  # noqa: E402
from datastates.format.records import ReportEntry  # noqa: E402

entries = [ReportEntry(f"t{i}", "tensor", True, 4096 + 64 * i, 8, "float32", (2,),
                       ((8, 12345678),), None, None, None, False) for i in range(1000)]


def through_dicts():
    return codec.encode_index(0, (e.to_json() for e in entries))


def as_text():
    return codec.encode_index_items(0, ",".join([plain.report_entry_json(e)
                                                 for e in entries]).encode())


assert through_dicts() == as_text()
for _ in range(3):
    a = timeit.timeit(through_dicts, number=20) / 20 * 1e3
    b = timeit.timeit(as_text, number=20) / 20 * 1e3
    print(f"dicts + JSON encoder {a:.2f} ms  text {b:.2f} ms per 1000 entries")

# The one-int case of plain._ints: an f-string against the join it replaces.
one = (2,)
fstring = timeit.timeit(lambda: f"{one[0]}", number=200000) / 200000 * 1e6
join = timeit.timeit(lambda: ",".join(map(int.__repr__, one)), number=200000) / 200000 * 1e6
print(f"one int: f-string {fstring:.2f} us  join {join:.2f} us")

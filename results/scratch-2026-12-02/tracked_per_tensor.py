"""Objects the garbage collector still tracks, per tensor, while a save of N small tensors is in
flight: after save() returns and two young collections (which stop tracking plain tuples of
untracked items), the new tracked objects by type. Run with the src tree to measure as argument."""
import collections
import gc
import shutil
import sys
import tempfile

sys.path.insert(0, sys.argv[1])
import torch  # noqa: E402

import datastates  # noqa: E402

N = 20000
state = {f"t{i}": torch.randn(2) for i in range(N)}
root = tempfile.mkdtemp()
with datastates.Checkpointer(root) as ck:
    ck.save(state, step=0).wait()
    gc.collect()
    before = set(map(id, gc.get_objects()))
    handle = ck.save(state, step=1)
    gc.collect(0)
    gc.collect(1)
    new = [o for o in gc.get_objects() if id(o) not in before]
    per = collections.Counter(type(o).__name__ for o in new)
    print(f"{len(new) / N:.2f} tracked objects per tensor during save():",
          ", ".join(f"{k} {v / N:.2f}" for k, v in per.most_common(4)))
    handle.wait()
shutil.rmtree(root)

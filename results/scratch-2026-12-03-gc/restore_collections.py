"""The full collections during a restore in place of N two-float tensors, with the restore's
planning paused as datastates now does it ('pause': a stand-in wrapping the top-level match) or not:
    python restore_collections.py SRC N none|pause   (SRC: a tree with datastates/collector.py)
With the pause in the library itself, 'none' measures the library as it is."""
import gc, sys, time, threading, tempfile
sys.path.insert(0, sys.argv[1])
mode = sys.argv[3]
import torch, datastates
from datastates import collector
from datastates.restore import reader
if mode == "pause":
    orig = reader._Plan.match
    def match(self, *a, **k):
        if a[2] == ():   # the top-level call
            with collector.paused():
                r = orig(self, *a, **k)
                self.check()
                return r
        return orig(self, *a, **k)
    reader._Plan.match = match
n = int(sys.argv[2])
state = {f"t{i}": torch.rand(2) for i in range(n)}
root = tempfile.mkdtemp()
with datastates.Checkpointer(root, datastates.CheckpointConfig(keep_last=1)) as ck:
    ck.save(state, step=0).wait()
live = {k: v.new_empty(v.shape) for k, v in state.items()}
log = []; starts = {}
def cb(phase, info):
    if phase == "start": starts[threading.get_ident()] = time.perf_counter()
    else: log.append((info["generation"], time.perf_counter() - starts[threading.get_ident()]))
gc.collect()
gc.callbacks.append(cb)
t0 = time.perf_counter()
with datastates.Checkpointer(root) as ck:
    ck.restore(live)
total = time.perf_counter() - t0
gc.callbacks.remove(cb)
print(mode, f"restore {total:.2f} s; full collections:", sum(1 for x in log if x[0]==2), round(sum(x[1] for x in log if x[0]==2),3))

"""Which thread makes each of the collector's collections during a warm-up save, a timed save()
and its commit of N two-float tensors: python full_collections.py SRC N (prints the generation-1
and full collections with their thread, duration and time since the start)."""
import gc, sys, time, threading, tempfile
sys.path.insert(0, sys.argv[1])
import torch, datastates
n = int(sys.argv[2])
state = {f"t{i}": torch.rand(2) for i in range(n)}
log = []
starts = {}
def cb(phase, info):
    if phase == "start": starts[threading.get_ident()] = time.perf_counter()
    else: log.append((threading.current_thread().name[:12], info["generation"], round(time.perf_counter()-starts[threading.get_ident()],4), round(time.perf_counter()-T0, 3)))
root = tempfile.mkdtemp()
T0 = time.perf_counter()
gc.callbacks.append(cb)
with datastates.Checkpointer(root, datastates.CheckpointConfig(keep_last=1)) as ck:
    T0 = time.perf_counter()
    ck.save(state, step=0).wait()
    log.append(("--warm done", 0, 0, round(time.perf_counter()-T0,3)))
    t0 = time.perf_counter()
    h = ck.save(state, step=1)
    s = time.perf_counter() - t0
    log.append(("--save done", 0, round(s,3), round(time.perf_counter()-T0,3)))
    h.wait()
    log.append(("--commit done", 0, 0, round(time.perf_counter()-T0,3)))
for l in log:
    if l[1] >= 1 or l[0].startswith("--"): print(l)
print("gen0 total", round(sum(l[2] for l in log if l[1]==0 and not l[0].startswith("--")),3))

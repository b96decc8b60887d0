"""Where the commit of N small tensors spends its time: wall and CPU (thread_time) of the stages
of a save, summed per save over REPS saves after a warm-up save.

    python commit_phases.py N REPS SRC [--nogc]

SRC is the src tree to measure; --nogc disables the garbage collector for the timed saves."""
import functools
import gc
import importlib
import shutil
import sys
import tempfile
import time

sys.path.insert(0, sys.argv[3])
import torch  # noqa: E402

import datastates  # noqa: E402

N, REPS = int(sys.argv[1]), int(sys.argv[2])
STAGES = [("datastates.checkpointer", "Checkpointer._plan_job"),
          ("datastates.save.pipeline", "Pipeline._fill"),
          ("datastates.save.pipeline", "Pipeline._write_unit"),
          ("datastates.save.job", "finish_file"),
          ("datastates.commit.committer", "commit_save"),
          ("datastates.commit.review", "build_manifest"),
          ("datastates.format.files", "manifest_record_bytes"),
          ("datastates.commit.committer", "after_commit")]
T: dict = {}


def timed(name, f):
    @functools.wraps(f)
    def wrapper(*a, **k):
        t, c = time.perf_counter(), time.thread_time()
        try:
            return f(*a, **k)
        finally:
            x = T.setdefault(name, [0.0, 0.0])
            x[0] += time.perf_counter() - t
            x[1] += time.thread_time() - c
    return wrapper


for modname, name in STAGES:
    owner = importlib.import_module(modname)
    *path, attr = name.split(".")
    for part in path:
        owner = getattr(owner, part)
    real = getattr(owner, attr)
    new = timed(name, real)
    setattr(owner, attr, new)
    for mod in list(sys.modules.values()):  # names imported by value
        if mod is not None and mod.__name__.startswith("datastates") and \
                getattr(mod, attr, None) is real:
            setattr(mod, attr, new)

state = {f"t{i}": torch.randn(2) for i in range(N)}
root = tempfile.mkdtemp()
with datastates.Checkpointer(root, datastates.CheckpointConfig(keep_last=1)) as ck:
    ck.save(state, step=0).wait()
    T.clear()
    if "--nogc" in sys.argv:
        gc.disable()
    total = 0.0
    for step in range(1, REPS + 1):
        t0 = time.perf_counter()
        ck.save(state, step=step).wait()
        total += time.perf_counter() - t0
print(f"{N} tensors: save to commit {total / REPS * 1e3:.1f} ms per save")
for name, (wall, cpu) in sorted(T.items(), key=lambda kv: -kv[1][0]):
    print(f"  {name:28s} wall {wall / REPS * 1e3:7.2f} ms  cpu {cpu / REPS * 1e3:7.2f} ms")
shutil.rmtree(root)

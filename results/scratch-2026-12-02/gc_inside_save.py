import gc, sys, time, tempfile, shutil, cProfile, pstats, torch
import os; sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "src"))
import datastates
N=int(sys.argv[1]) if len(sys.argv)>1 else 100000
g=torch.Generator().manual_seed(N)
state={f"t{i}": torch.randn(2, generator=g) for i in range(N)}
root=tempfile.mkdtemp()
gcs=[]
def cb(phase, info):
    if phase=="start": cb.t=time.perf_counter()
    else: gcs.append((info["generation"], time.perf_counter()-cb.t))
gc.callbacks.append(cb)
with datastates.Checkpointer(root) as ck:
    ck.save(state, step=0).wait()
    for step in (1,2,3):
        gcs.clear()
        t=time.perf_counter(); h=ck.save(state, step=step); dt=time.perf_counter()-t
        inside=list(gcs); h.wait()
        print(f"save() {dt:.3f}s  full gc inside: {sum(s for g,s in inside if g==2):.3f}s young: {sum(s for g,s in inside if g<2):.3f}s commit {h.stats.commit_s:.2f}")
    if "--prof" in sys.argv:
        p=cProfile.Profile(); p.enable(); h=ck.save(state, step=9); p.disable(); h.wait()
        pstats.Stats(p).sort_stats("cumtime").print_stats(30)
shutil.rmtree(root)

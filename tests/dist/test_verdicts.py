"""One verdict on every rank, and the same as what is on disk, when a process pauses (SIGSTOP) or
the host of the coordination store is killed (SIGKILL) in the middle of a commit: real gloo
processes and real signals. Each point where a process stops or a store dies is reached by
wrapping a library function in the process concerned (it signals, then calls the original).
"""
from __future__ import annotations

import faulthandler
import os
import pickle
import signal
import threading
import time
import traceback
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import datastates
from datastates import CheckpointConfig, Checkpointer
from datastates.commit import committer
from datastates.format import files

from launcher import free_port, run_ranks
from test_commit_protocol import _model, _verdict
from test_memory_dist import shm_root  # noqa: F401 - the fixture

FAST = CheckpointConfig(host_cache_bytes=256 << 10, chunk_bytes=64 << 10, commit_timeout_s=2)



def _on_disk(root):
    """The committed names of ``root`` and the one a fresh reader takes as the latest."""
    with Checkpointer(root, FAST, communicator=datastates.LocalCommunicator()) as reader:
        latest = reader.latest()
        return [i.name for i in reader.list()], latest.name if latest else None


def _wait_for(path, seconds=60.0):
    """Wait for the file ``path`` (written by another process), with a deadline."""
    deadline = time.monotonic() + seconds
    while not os.path.exists(path):
        assert time.monotonic() < deadline, f"{path} did not appear within {seconds} s"
        time.sleep(0.01)  # polling for a file, not synchronizing on time


# ------------------------------------------------------------------ rank 0 paused after its claim

def _paused_worker(rank, world, store_pid, root):
    model = _model()
    with Checkpointer(root, FAST) as ckpt:
        ckpt.comm.silent_s = 0.0  # rank 0 counts as silent after commit_timeout_s (2 s)
        pids = [None] * world
        dist.all_gather_object(pids, os.getpid())
        first = _verdict(lambda: ckpt.save({"model": model}, step=1))
        dist.barrier()
        if rank == 0:  # stop rank 0 after its claim, while it encodes the manifest
            encode = files.encode_manifest_record

            def paused(manifest, *args, **kw):
                os.kill(os.getpid(), signal.SIGSTOP)  # until rank 1 has its verdict
                return encode(manifest, *args, **kw)
            files.encode_manifest_record = paused
        second = _verdict(lambda: ckpt.save({"model": model}, step=2))
        if rank == 1:
            os.kill(pids[0], signal.SIGCONT)
        dist.barrier()
        latest = ckpt.latest().name
    return {"first": first, "second": second, "latest": latest}


def test_rank0_paused_after_its_claim_commits_nothing_the_others_gave_up_on(tmp_path):
    """Rank 0 stopped (SIGSTOP) after claiming the decision, longer than the heartbeat
    deadline: rank 1 replaces the claim with an abort; rank 0, resumed (SIGCONT), loses the fence
    and renames nothing. Both report that abort, and the disk agrees. The store runs in a process
    of its own, as torchrun's agent hosts it (a store hosted by the stopped rank 0 stops too)."""
    root = str(tmp_path / "ckpt")
    out = _run_with_store_host(2, _paused_worker, root)
    assert out[0]["first"] == out[1]["first"] == ("ok", "step-0000000001")
    assert out[0]["second"] == out[1]["second"], out
    kind, blamed, message = out[1]["second"]
    assert kind == "CommitTimeoutError" and blamed == [0], message
    assert "rank 0 claimed the commit, then fell silent" in message
    assert out[0]["latest"] == out[1]["latest"] == "step-0000000001"
    assert _on_disk(root) == (["step-0000000001"], "step-0000000001")


# ------------------------------------------------------------------ the store host killed

def _store_host(port, world):
    store = dist.TCPStore("127.0.0.1", port, world, is_master=True, wait_for_workers=False)
    threading.Event().wait()  # serve until killed
    del store


def _entry(rank, world, port, fn, args, results):
    faulthandler.dump_traceback_later(100, exit=True)
    try:
        store = dist.TCPStore("127.0.0.1", port, world, is_master=False,
                              timeout=timedelta(seconds=30))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
        results.put((rank, "ok", pickle.dumps(fn(rank, world, *args))))
    except BaseException as exc:  # reported to the parent, which fails the test
        results.put((rank, "error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))


def _run_with_store_host(world, fn, *args, timeout=120.0):
    """``run_ranks`` with the store in a process of its own; ``fn(rank, world, store_pid,
    *args)``."""
    ctx = mp.get_context("spawn")
    port, results = free_port(), ctx.Queue()
    host = ctx.Process(target=_store_host, args=(port, world), daemon=True)
    host.start()
    procs = [ctx.Process(target=_entry, args=(r, world, port, fn, (host.pid,) + args, results),
                         daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    out, errors = {}, {}
    try:
        while len(out) + len(errors) < world:
            rank, status, value = results.get(timeout=timeout)
            if status == "ok":
                out[rank] = pickle.loads(value)
            else:
                errors[rank] = value
    finally:
        for p in procs + [host]:
            p.join(timeout=5 if p is host else 30)
            if p.is_alive():
                p.kill()
    assert not errors, "\n".join(f"rank {r}: {e}" for r, e in sorted(errors.items()))
    return out


def _store_killed_worker(rank, world, store_pid, root, flag):
    model = _model()
    with Checkpointer(root, FAST.replace(commit_timeout_s=20)) as ckpt:
        if rank == 0:  # after the fence, at the rename into place: the store host dies
            rename = os.rename

            def store_dies(src, dst, *args, **kw):
                if os.path.basename(dst) == "step-0000000001":
                    os.kill(store_pid, signal.SIGKILL)
                    _wait_for(flag)  # rank 1 has looked at the disk, without the store
                return rename(src, dst, *args, **kw)
            os.rename = store_dies
        else:
            committed_save = committer.committed_save

            def looked(*args, **kw):
                found = committed_save(*args, **kw)
                open(flag, "a").close()
                return found
            committer.committed_save = looked
        verdict = _verdict(lambda: ckpt.save({"model": model}, step=1))
        names = [i.name for i in ckpt.list()]
    return {"verdict": verdict, "names": names}


def test_a_rank_that_loses_the_store_waits_for_the_verdict_on_disk(tmp_path):
    """The store's host is killed after rank 0 won the fence and before its rename; rank 1 finds
    no manifest at first, and keeps looking until the commit deadline: it reports the commit
    that rank 0 makes, not a failure."""
    root = str(tmp_path / "ckpt")
    out = _run_with_store_host(2, _store_killed_worker, root, str(tmp_path / "looked"))
    assert out[0]["verdict"] == out[1]["verdict"] == ("ok", "step-0000000001"), out
    assert out[1]["names"] == ["step-0000000001"]
    assert _on_disk(root) == (["step-0000000001"], "step-0000000001")


# ------------------------------------------------------------------ memory tier on two nodes

def _node_config(shm_root, tmp, rank):
    node = rank // 2  # ranks 0, 1 on "node" 0 and 2, 3 on node 1: a memory root each
    root = os.path.join(shm_root, f"node{node}")
    os.makedirs(root, exist_ok=True)
    tier = datastates.MemoryTier(root=root, keep_last=1, persist_every=None,
                                 persist_on_exit=False,
                                 log_path=os.path.join(tmp, f"keeper{node}.log"))
    return CheckpointConfig(memory_tier=tier, commit_timeout_s=3)


def _node_killed_worker(rank, world, root, shm_root, tmp):
    with Checkpointer(root, _node_config(shm_root, tmp, rank)) as ck:
        state = {"w": torch.full((256,), float(rank))}
        first = _verdict(lambda: ck.save(state, step=1))
        dist.barrier()
        if rank == 3:  # dies as its memory save of step 2 reaches the commit
            def killed(*args, **kw):
                os.kill(os.getpid(), signal.SIGKILL)
            committer.commit_save = killed
            import datastates.save.pipeline as pipeline
            pipeline.commit_save = killed
        second = _verdict(lambda: ck.save(state, step=2))
        return {"first": first, "second": second,
                "memory": [i.step for i in ck.memory.list()]}


def test_a_memory_step_not_committed_on_every_node_evicts_nothing_and_names_job_ranks(
        shm_root, tmp_path):
    """Memory tier on two nodes, ``keep_last=1``: rank 3 is killed (SIGKILL) during the memory
    save of step 2. Node 1's rank 2 names job rank 3 (not its node-local rank 1); node 0, which
    committed step 2, keeps step 1, the newest step every node holds."""
    root = str(tmp_path / "ckpt")
    out = run_ranks(4, _node_killed_worker, root, shm_root, str(tmp_path), timeout=150,
                    allow_dead=(3,))
    for rank in (0, 1, 2):
        assert out[rank]["first"] == ("ok", "step-0000000001"), out
    assert out[0]["second"] == out[1]["second"] == ("ok", "step-0000000002"), out
    kind, blamed, message = out[2]["second"]
    assert kind == "CommitTimeoutError" and blamed == [3], message
    assert "rank(s) [3] did not report" in message
    assert out[0]["memory"] == out[1]["memory"] == [1, 2], out
    assert out[2]["memory"] == [1], out

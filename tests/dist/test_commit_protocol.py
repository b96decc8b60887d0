"""The distributed commit protocol on real gloo processes: one verdict per save, on every rank.

Each launch runs several scenarios in sequence (a barrier between them), so the next save after
every failure also shows that the protocol stayed in step. Every save is bounded by a 3 s
commit timeout; every launch by the launcher's timeout.
"""
from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from torch import nn

import datastates
from datastates import CheckpointConfig, Checkpointer, TensorShard

from launcher import run_ranks

FAST = CheckpointConfig(host_cache_bytes=256 << 10, chunk_bytes=64 << 10, commit_timeout_s=3)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 8))


def _verdict(start):
    """("ok", name) or (error class, ranks blamed, message) of one save."""
    try:
        return ("ok", start().wait().name)
    except datastates.CommitError as exc:
        return (type(exc).__name__, sorted(exc.causes), str(exc))


def _committed(root):
    """Names listed, the name latest gives, temporaries left, and whether every listed
    checkpoint loads (checksums verified)."""
    hidden = sorted(p for p in os.listdir(root) if p.startswith("."))
    with Checkpointer(root, FAST, communicator=datastates.LocalCommunicator()) as reader:
        names = [i.name for i in reader.list()]
        latest = reader.latest().name if reader.latest() else None
        for name in names:
            reader.load(tag=name, rank_policy="same")
    return names, latest, hidden


# ------------------------------------------------------------------ mismatched calls

def _shards(rank, rows):
    """Row boxes of a 10x2 tensor, one per rank, from ``rows`` = [(start, stop), ...]."""
    start, stop = rows[rank]
    return TensorShard(torch.full((stop - start, 2), float(rank)), (10, 2), (start, 0))


def _mismatch_worker(rank, world, root):
    model = _model()
    out = {}
    with Checkpointer(root, FAST) as ckpt:

        def save(step, state=None, **kw):
            return _verdict(lambda: ckpt.save(state or {"model": model, "rank": rank}, step=step,
                                              replicated=["model"], **kw))

        def scenario(name, fn, ranks=range(world)):
            if rank in ranks:
                out[name] = fn()
            dist.barrier()

        # (c) rank 0 saves step 5, the others step 6
        scenario("c", lambda: save(5 if rank == 0 else 6))
        # (d) a save on one rank only, then a collective one
        scenario("d1", lambda: save(7), ranks=[1])
        scenario("d1_next", lambda: save(8))
        scenario("d0", lambda: save(9), ranks=[0])
        scenario("d0_next", lambda: save(10))
        # (e) save() itself raises on rank 1 only (an unpicklable object)
        odd = {"model": model, "hook": (lambda: 0) if rank == 1 else 0}
        try:
            out["e"] = save(11, odd)
        except datastates.SerializationError as exc:
            out["e"] = ("SerializationError", [rank], str(exc))
        dist.barrier()
        scenario("e_next", lambda: save(12))
        # same name, different step: not one save (each rank waits for the others' report)
        scenario("tag", lambda: _verdict(lambda: ckpt.save({"model": model}, step=13 + rank,
                                                           tag="best")))
        # a tag saved by rank 1 alone, then by every rank at a later step: back in step
        scenario("tag_lone", lambda: _verdict(lambda: ckpt.save({"model": model}, step=20,
                                                                tag="best", overwrite=True)),
                 ranks=[1])
        scenario("tag_next", lambda: _verdict(lambda: ckpt.save({"model": model}, step=21,
                                                                tag="best", overwrite=True)))
        # replicas that diverged on rank 2
        good_bias = model[0].bias.detach().clone()
        with torch.no_grad():
            if rank == 2:
                model[0].bias[3] += 1.0
        scenario("replicas", lambda: save(14))
        with Checkpointer(root + "-unchecked", FAST.replace(replica_check=False)) as unchecked:
            scenario("unchecked", lambda: _verdict(lambda: unchecked.save(
                {"model": model}, step=1, replicated=["model"])))
        with torch.no_grad():
            model[0].bias.copy_(good_bias)
        # shard boxes: an overlap, a gap, and two ranks writing the same box
        boxes = {"overlap": _shards(rank, [(0, 4), (2, 6), (6, 10)]),
                 "gap": _shards(rank, [(0, 3), (3, 6), (7, 10)]),
                 "twice": _shards(rank, [(0, 5), (0, 5), (5, 10)])}
        scenario("tiling", lambda: save(15, {"boxes": boxes}))
        scenario("last", lambda: save(16))
        prefix = f"datastates/{ckpt.comm.run_id}/"
        out["keys_left"] = sorted(k[len(prefix):].lstrip("/") for k in
                                  c10d._get_default_store().list_keys() if k.startswith(prefix))
        dist.barrier()  # before any rank closes (which deletes its announcement)
    return out


def test_mismatched_calls_fail_on_every_rank_and_stay_in_step(tmp_path):
    root = str(tmp_path / "ckpt")
    out = run_ranks(3, _mismatch_worker, root, timeout=150)
    timeout = "CommitTimeoutError"
    # (c): every rank fails; each side names the ranks that did not report *its* save
    assert out[0]["c"][:2] == (timeout, [1, 2]) and "step-0000000006" in out[0]["c"][2]
    for r in (1, 2):
        assert out[r]["c"][:2] == (timeout, [0]) and "step-0000000005" in out[r]["c"][2]
    # (d): the lone save times out naming the absent ranks; the next save commits everywhere
    assert out[1]["d1"][:2] == (timeout, [0, 2])
    assert out[0]["d0"][:2] == (timeout, [1, 2])
    for r in range(3):
        assert out[r]["d1_next"] == ("ok", "step-0000000008")
        assert out[r]["d0_next"] == ("ok", "step-0000000010")
        assert out[r]["e_next"] == ("ok", "step-0000000012")
        assert out[r]["last"] == ("ok", "step-0000000016")
    # (e): rank 1's own error at save(); the others fail the same save naming rank 1
    assert out[1]["e"][0] == "SerializationError"
    assert out[0]["e"] == out[2]["e"] and out[0]["e"][:2] == ("CommitError", [1])
    assert "SerializationError" in out[0]["e"][2] and "hook" in out[0]["e"][2]
    # the same tag with different steps: each rank names the others and what they saved
    for r in range(3):
        assert out[r]["tag"][:2] == (timeout, [o for o in range(3) if o != r]), out[r]["tag"]
        others = [o for o in range(3) if o != r]
        assert all(f"its latest save is 'best' step {13 + o}" in out[r]["tag"][2]
                   for o in others), out[r]["tag"][2]
    # a rank that skipped a save of a tag is back in step at the tag's next save
    assert out[1]["tag_lone"][:2] == (timeout, [0, 2])
    assert all(out[r]["tag_next"] == ("ok", "best") for r in range(3)), out
    # diverged replicas, bad tilings: one error everywhere
    for case in ("replicas", "tiling"):
        assert out[0][case] == out[1][case] == out[2][case], case
        assert out[0][case][0] == "CommitError", out[0][case]
    assert "'model/0.bias' differs across ranks" in out[0]["replicas"][2]
    assert "ranks [2] hold" in out[0]["replicas"][2]
    message = out[0]["tiling"][2]
    assert "'boxes/overlap' boxes [0:4, 0:2] and [2:6, 0:2], which overlap" in message
    assert "'boxes/gap' cover 18 of its 20 elements" in message
    assert "ranks 0 and 1 both wrote 'boxes/twice'" in message
    assert all(out[r]["unchecked"] == ("ok", "step-0000000001") for r in range(3))
    # nothing unrestorable is listed or named by latest; no temporary is left
    names, latest, hidden = _committed(root)
    assert names == ["step-0000000008", "step-0000000010", "step-0000000012", "best",
                     "step-0000000016"]
    assert latest == "step-0000000016" and hidden == []
    # no key of any round is left: only each rank's announcement and the orphan counter
    assert out[0]["keys_left"] == ["announce/r0", "announce/r1", "announce/r2", "orphans/n"]


# ------------------------------------------------------------------ stalls, failures, a kill

def _stall_worker(rank, world, root, flag):
    from datastates.storage import posix
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    out = {}
    real = posix.pwrite_all
    with Checkpointer(root, FAST) as ckpt:
        def save(step):
            return _verdict(lambda: ckpt.save({"model": model, "opt": opt}, step=step,
                                              replicated=True))

        out["first"] = save(1)
        dist.barrier()
        # (f) rank 0 stalls in a write until rank 1 has its verdict (past the deadline)
        if rank == 0:
            def stalled(fd, data, offset):
                while not os.path.exists(flag):  # polls rank 1's verdict, not a timing guess
                    time.sleep(0.01)
                real(fd, data, offset)
            posix.pwrite_all = stalled
        out["stall"] = save(2)
        if rank == 1:
            open(flag, "w").close()
        posix.pwrite_all = real
        dist.barrier()
        out["after_stall"] = save(3)
        dist.barrier()
        # one rank's write fails (disk full)
        if rank == 1:
            def full(fd, data, offset):
                raise OSError(28, "No space left on device (injected)")
            posix.pwrite_all = full
        out["enospc"] = save(4)
        posix.pwrite_all = real
        dist.barrier()
        # rank 2 is killed in the middle of its write
        if rank == 2:
            def killed(fd, data, offset):
                os.kill(os.getpid(), signal.SIGKILL)
            posix.pwrite_all = killed
        out["killed"] = save(5)
        out["back"] = torch.equal(ckpt.load(step=3, keys=["model"])["model"]["0.weight"],
                                  model[0].weight)
    return out


def test_stall_write_failure_and_killed_rank(tmp_path):
    root = str(tmp_path / "ckpt")
    out = run_ranks(3, _stall_worker, root, str(tmp_path / "flag"), timeout=150,
                    allow_dead=(2,))
    for r in (0, 1):
        assert out[r]["first"] == ("ok", "step-0000000001")
        assert out[r]["after_stall"] == ("ok", "step-0000000003")
        # killed rank 2: the survivors name rank 2 (not rank 0)
        assert out[r]["killed"][:2] == ("CommitTimeoutError", [2]), out[r]["killed"]
        assert out[r]["back"]
    assert out[0]["killed"] == out[1]["killed"]
    # (f) the stalled rank 0 does not commit after the others gave up: one verdict
    assert out[0]["stall"] == out[1]["stall"]
    assert out[0]["stall"][:2] == ("CommitTimeoutError", [0])
    # disk full on rank 1: the same CommitError on every rank, naming rank 1 and the cause
    assert out[0]["enospc"] == out[1]["enospc"]
    assert out[0]["enospc"][:2] == ("CommitError", [1]) and "No space left" in out[0]["enospc"][2]
    names, latest, hidden = _committed(root)
    assert names == ["step-0000000001", "step-0000000003"] and latest == "step-0000000003"
    assert hidden == []


# ------------------------------------------------------------------ rank 0 exits after wait()

def _exit_worker(rank, world, root):
    model = _model()
    with Checkpointer(root, FAST) as ckpt:
        if rank == 1:  # take the verdict only once rank 0, which hosts the store, is gone
            comm, wait_for_verdict = ckpt.comm, ckpt.comm._await

            def after_rank0_exits(*args):
                for _ in range(6000):  # polls the store until rank 0's exit closes it
                    try:
                        comm.store.check(["-"])
                    except Exception:
                        break
                    time.sleep(0.01)
                return wait_for_verdict(*args)
            comm._await = after_rank0_exits
        info = ckpt.save({"model": model, "rank": rank}, step=1, replicated=True).wait()
        if rank == 0:
            os._exit(0)  # right after wait(): the store dies with this process
        after = _verdict(lambda: ckpt.save({"model": model}, step=2, replicated=True))
        back = ckpt.load(step=1)
    return {"info": (info.name, info.world_size), "after": after, "rank": back["rank"],
            "model": all(torch.equal(v, model.state_dict()[k]) for k, v in back["model"].items())}


def test_decision_survives_rank0_exit(tmp_path):
    root = str(tmp_path / "ckpt")
    out = run_ranks(2, _exit_worker, root, timeout=90, allow_dead=(0,))
    assert out[1]["info"] == ("step-0000000001", 2)  # committed: read from the manifest on disk
    assert out[1]["rank"] == 1 and out[1]["model"]
    kind, blamed, message = out[1]["after"]
    assert kind == "CommitUnknownError" and blamed == [1], message
    assert "store is unreachable" in message and "probably" not in message
    names, latest, _ = _committed(root)
    assert names == ["step-0000000001"] and latest == "step-0000000001"


def _restore_after_exit_worker(rank, world, root):
    ckpt = Checkpointer(root, FAST)
    ckpt.save({"x": torch.ones(3) * rank}, step=1).wait(60)
    dist.barrier()  # every rank's save is committed before rank 0 exits
    if rank == 0:
        os._exit(0)  # the store dies with this process
    for _ in range(6000):  # wait until rank 0's exit has closed the store
        try:
            ckpt.comm.store.check(["-"])
        except Exception:
            break
        time.sleep(0.01)
    try:
        ckpt.restore({"x": torch.zeros(3)}, fallback=True)
        return "restored"
    except Exception as exc:  # noqa: BLE001 - the result
        return f"{type(exc).__name__}: {exc}"
    finally:
        try:
            ckpt.close()
        except Exception:  # noqa: BLE001 - closing without a store is not what is tested
            pass


def test_a_fallback_restore_without_the_store_is_a_restore_aborted_error(tmp_path):
    """Rank 0, which hosts the coordination store, exited: the other ranks' fallback restore
    raises RestoreAbortedError saying so, not torch's network error."""
    out = run_ranks(3, _restore_after_exit_worker, str(tmp_path / "ckpt"), timeout=90,
                    allow_dead=(0,))
    for rank in (1, 2):
        assert out[rank].startswith("RestoreAbortedError: restore(): the ranks could not agree") \
            and "coordination store is unreachable" in out[rank], out[rank]

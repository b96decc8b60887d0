"""The commit round: what a snapshot waits for, how ranks name a save, how long they wait for
rank 0's publish, and what every rank knows after it.

Real gloo processes where ranks save; threads as ranks over a MemoryStore for the store protocol
(its timing is driven by the store's own reads, not by sleeps).
"""
from __future__ import annotations

import json
import logging
import os
import threading
import time

import pytest
import torch
from torch import nn

import datastates
from datastates import CheckpointConfig, Checkpointer
from datastates.format import checksum
from datastates.commit.catalog import Catalog
from datastates import format as fmt
from datastates.commit.round import MemoryStore, StoreCommunicator
from datastates.format.records import PENDING, FileRef, RankReport, SaveRef, Verdict

from launcher import run_ranks

FAST = CheckpointConfig(host_cache_bytes=256 << 10, chunk_bytes=64 << 10, commit_timeout_s=3)
SLOW = FAST.replace(commit_timeout_s=60)


def _model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 1024), nn.ReLU(), nn.Linear(1024, 256))


def _grads(model, seed):
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(8, 256, generator=g)).square().mean().backward()


def _train(model, opt, seed):
    _grads(model, seed)
    opt.step()
    opt.zero_grad()


def _values(state):
    return {k: v.clone() for k, v in state.items()}


# ------------------------------------------------------------------ replica digests and the step

def _replica_worker(rank, world, root, backend):
    if backend != "default":  # the process computes every CRC-32 with this backend
        checksum._fn = checksum.load(backend).fn
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    _train(model, opt, seed=1)  # same data on every rank: the replicas stay identical
    # an eager tensor larger than every lazy one together: rank 0 writes it and nothing else,
    # and only digests the parameters and moments that rank 1 writes
    ema = torch.randn(3 << 20, generator=torch.Generator().manual_seed(5))
    state = {"model": model, "opt": opt, "ema": ema}
    saved, verdicts = {}, {}
    with Checkpointer(root, SLOW) as ckpt:
        handles = []
        for step in range(1, 6):
            saved[step] = _values(model.state_dict())
            _grads(model, seed=10 + step)
            handles.append(ckpt.save(state, step=step, replicated=True))
            opt.step()  # the guarded step, at once after save()
            opt.zero_grad()
        for step, handle in zip(range(1, 6), handles):
            try:
                verdicts[step] = handle.wait().name
            except datastates.CommitError as exc:
                verdicts[step] = str(exc)
        back = {step: ckpt.load(step=step, keys=["model"])["model"] for step in saved
                if verdicts[step] == datastates.format.codec.step_name(step)}
    exact = {step: all(torch.equal(back[step][k], v) for k, v in saved[step].items())
             for step in back}
    return {"verdicts": verdicts, "exact": exact}


@pytest.mark.parametrize("backend", ["default", "zlib"])
def test_replica_digests_finish_before_the_guarded_step(tmp_path, backend):
    out = run_ranks(2, _replica_worker, str(tmp_path / "ckpt"), backend, timeout=170)
    names = {step: datastates.format.codec.step_name(step) for step in range(1, 6)}
    for rank in (0, 1):
        assert out[rank]["verdicts"] == names, out[rank]["verdicts"]
        assert out[rank]["exact"] == {step: True for step in names}


# ------------------------------------------------------------------ one directory, two spellings

def _spelling_worker(rank, world, roots):
    model = _model()
    out = {}
    with Checkpointer(roots[rank], FAST) as ckpt:
        try:
            out["save"] = ckpt.save({"model": model, "rank": rank}, step=1,
                                    replicated=True).wait().name
        except datastates.CommitError as exc:
            out["save"] = (type(exc).__name__, sorted(exc.causes), str(exc))
    return out


def test_a_directory_reached_through_a_link_is_one_directory(tmp_path):
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "alias")
    roots = [str(tmp_path / "real" / "ckpt"), str(tmp_path / "alias" / "ckpt")]
    out = run_ranks(2, _spelling_worker, roots, timeout=120)
    assert out[0]["save"] == out[1]["save"] == "step-0000000001"
    with Checkpointer(roots[1]) as reader:
        assert [i.world_size for i in reader.list()] == [2]
        assert reader.load(rank_policy="same")["rank"] == 0


def test_same_name_in_different_directories_is_named_not_a_timeout(tmp_path):
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    out = run_ranks(2, _spelling_worker, roots, timeout=120)
    assert out[0]["save"] == out[1]["save"]
    kind, blamed, message = out[0]["save"]
    assert kind == "CommitError" and blamed == [1]
    assert (f"same name, different directory: rank 0 saves to {roots[0]}, rank 1 to {roots[1]}"
            in message)
    for root in roots:  # nothing committed, no temporary left
        assert sorted(os.listdir(root)) == []


# ------------------------------------------------------------------ every rank knows the commit

class RecordingCatalog(Catalog):
    """A catalog that keeps what it was told by commits (and answers like any catalog)."""

    def __init__(self, root):
        super().__init__(root)
        self.recorded = []

    def record(self, info, stamp, manifest=None):
        self.recorded.append(info)
        return super().record(info, stamp, manifest)


def _latest_worker(rank, world, root):
    model = _model()
    out = {"recorded": [], "latest": [], "restored": []}
    with Checkpointer(root, FAST) as ckpt:
        ckpt.storage._catalog = catalog = RecordingCatalog(ckpt.directory)
        ckpt.save({"model": model}, step=1, replicated=True).wait()
        catalog.scan()  # this rank's listing is now older than the commits below
        for step in (2, 3):
            info = ckpt.save({"model": model, "step": step}, step=step, replicated=True).wait()
            out["recorded"].append([(i.name, i.seq) for i in catalog.recorded
                                    if i.name == info.name])
            latest = ckpt.latest()
            out["latest"].append((latest.name, latest.seq, info.seq))
            out["restored"].append(ckpt.load(rank_policy="same")["step"])
    return out


def test_every_rank_records_the_commit_and_agrees_on_latest(tmp_path):
    out = run_ranks(2, _latest_worker, str(tmp_path / "ckpt"), timeout=120)
    for rank in (0, 1):
        assert out[rank]["recorded"] == [[("step-0000000002", 2)], [("step-0000000003", 3)]]
        assert out[rank]["latest"] == [("step-0000000002", 2, 2), ("step-0000000003", 3, 3)]
        assert out[rank]["restored"] == [2, 3]


# ------------------------------------------------------------------ a publish past the deadline

class WatchedStore(MemoryStore):
    """A MemoryStore that sets ``late`` once the thread named ``rank-1`` reads the decision
    key as pending later than ``patience`` after its first such read and after ``deadline``
    (a rank that gave up at its deadline would have stopped by then)."""

    def __init__(self, deadline: float, patience: float):
        super().__init__()
        self.deadline, self.patience = deadline, patience
        self.first_read, self.late = None, threading.Event()

    def compare_set(self, key, expected, desired):
        value = super().compare_set(key, expected, desired)
        if (key.endswith("/decision") and threading.current_thread().name == "rank-1"
                and value == json.dumps(PENDING.to_json(), sort_keys=True).encode()):
            now = time.monotonic()
            self.first_read = self.first_read or now
            if now > max(self.deadline, self.first_read + self.patience):
                self.late.set()
        return value


COMMITTED = Verdict.committed(None)


def _round(comm, sid, deadline, timeout_s, commit, fallback):
    report = RankReport(rank=comm.rank, save=SaveRef(sid.name, sid.step, sid.nonce), root="/d",
                        file=FileRef(name=fmt.shard_file_name(comm.rank), rank=comm.rank,
                                     nbytes=4096, index_crc32=0), tree={"t": "dict", "items": []})
    return comm.agree(sid, report, deadline, timeout_s, check=lambda reports: None,
                      commit=commit, fallback=fallback)


def _two_ranks(store, fns):
    out, threads = {}, []
    for r, fn in fns.items():
        threads.append(threading.Thread(target=lambda r=r, fn=fn: out.__setitem__(r, fn()),
                                        name=f"rank-{r}", daemon=True))
        threads[-1].start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    return out


def test_ranks_wait_for_a_publish_that_outlasts_the_deadline():
    timeout_s = 0.05
    deadline = time.monotonic() + 0.3
    store = WatchedStore(deadline, timeout_s)
    comms = [StoreCommunicator(store, r, 2, "run") for r in range(2)]
    sid = comms[0].save_id("/d", "step-1", 1)
    gave_up = []

    def slow_commit(reports, fence):
        store.late.wait(60)  # publishing until rank 1 has waited past its deadline
        fence()
        return COMMITTED

    def rank1():
        try:
            return _round(comms[1], sid, deadline, timeout_s, None,
                          lambda why: gave_up.append(why) or Verdict.abort("store", why, {}))
        finally:
            store.late.set()  # a rank 1 that stopped waiting lets rank 0 finish

    out = _two_ranks(store, {0: lambda: _round(comms[0], sid, deadline, timeout_s, slow_commit,
                                               None),
                             1: rank1})
    assert out[0] == COMMITTED
    assert out[1] == out[0] and gave_up == []
    assert sorted(store.list_keys()) == ["announce/r0", "announce/r1"]


def test_a_silent_rank0_after_its_claim_is_given_up_on():
    """Rank 1 gives up on a silent rank 0 by replacing its claim with an abort; rank 0, back,
    loses the fence and makes nothing visible: both take that abort (real processes and
    signals: test_verdicts.py)."""
    store = MemoryStore()
    comms = [StoreCommunicator(store, r, 2, "run") for r in range(2)]
    comms[0].beat_s = 3600.0  # rank 0 never beats: it is as good as dead after its claim
    comms[1].silent_s = 0.2
    sid = comms[0].save_id("/d", "step-1", 1)
    rank1_done, gave_up, visible = threading.Event(), [], []

    def stuck_commit(reports, fence):
        rank1_done.wait(60)
        fence()
        visible.append(True)
        return COMMITTED

    def rank1():
        try:
            return _round(comms[1], sid, time.monotonic() + 10, 0.05, None,
                          lambda why: gave_up.append(why) or Verdict.abort("store", why, {}))
        finally:
            rank1_done.set()

    out = _two_ranks(store, {0: lambda: _round(comms[0], sid, time.monotonic() + 10, 0.05,
                                               stuck_commit, None),
                             1: rank1})
    assert gave_up == [] and visible == []
    assert out[1].ok is False and out[0] == out[1] and out[1].kind == "timeout"
    assert "fell silent" in out[1].message and "rank 1 gave up" in out[1].message


# ------------------------------------------------------------------ exchanges and subgroups

def _as_threads(calls: dict) -> dict:
    """Run each rank's call on a thread of its own; {rank: result}."""
    out, threads = {}, []
    for rank, call in calls.items():
        t = threading.Thread(target=lambda r=rank, c=call: out.__setitem__(r, c()))
        threads.append(t)
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads), "an exchange did not end"
    return out


def test_an_exchange_of_none_and_of_subgroups_ends_with_every_value():
    """None is a value like any other (it was once taken for a missing answer, and the
    exchange waited for it forever), and two subgroups exchanging the same topic at once keep
    their values apart, under keys that are gone afterwards."""
    store = MemoryStore()
    comms = [StoreCommunicator(store, r, 4, "run") for r in range(4)]
    out = _as_threads({r: lambda c=comms[r]: c.exchange("t", None if c.rank % 2 else c.rank, 10)
                       for r in range(4)})
    assert all(out[r] == {0: 0, 1: None, 2: 2, 3: None} for r in range(4)), out
    groups = [[0, 1], [2, 3]]
    subs = [comms[r].subgroup(str(r // 2), groups[r // 2]) for r in range(4)]
    assert [(s.rank, s.world_size, s.run_id) for s in subs] == \
        [(0, 2, "run"), (1, 2, "run"), (0, 2, "run"), (1, 2, "run")]
    out = _as_threads({r: lambda s=subs[r], r=r: s.exchange("t", f"rank {r}", 10)
                       for r in range(4)})
    assert out[0] == out[1] == {0: "rank 0", 1: "rank 1"}, out
    assert out[2] == out[3] == {0: "rank 2", 1: "rank 3"}, out
    assert store.list_keys() == []


class _Recorded:
    """One rank's view of a shared store, recording ``(method, key)`` of every request."""

    def __init__(self, store):
        self.store, self.calls = store, []

    def __getattr__(self, name):
        method = getattr(self.store, name)

        def call(key, *args):
            self.calls.append((name, key if isinstance(key, str) else tuple(key)))
            return method(key, *args)
        return call


@pytest.mark.parametrize("world", [2, 8, 16])
def test_rank_0_gathers_an_exchange_and_the_others_read_one_key(world):
    """Rank 0 reads every other rank's value once and publishes them in one key; every other
    rank writes its own value, counts itself in and polls that one key: a few requests besides
    its polls, whatever the world size, and no other rank's key."""
    store = MemoryStore()
    views = [_Recorded(store) for _ in range(world)]
    comms = [StoreCommunicator(views[r], r, world, "run") for r in range(world)]
    out = _as_threads({r: lambda c=comms[r]: c.exchange("t", {"rank": c.rank}, 30)
                       for r in range(world)})
    assert all(out[r] == {k: {"rank": k} for k in range(world)} for r in range(world)), out
    assert store.list_keys() == []
    p = "x/t/0/"
    rank0 = views[0].calls
    for r in range(1, world):
        assert rank0.count(("compare_set", f"{p}r{r}")) == 1, rank0  # one read of each value
        calls = views[r].calls
        polls = calls.count(("compare_set", f"{p}decision"))
        assert polls >= 1
        rest = [c for c in calls if c != ("compare_set", f"{p}decision")]
        assert rest[:4] == [("set", f"{p}r{r}"), ("add", f"{p}n"), ("delete_key", f"{p}r{r}"),
                            ("add", f"{p}done")], calls
        assert set(rest[4:]) <= {("delete_key", f"{p}{k}") for k in ("n", "decision", "done")}
    assert ("compare_set", f"{p}decision") in rank0  # its claim of the values
    assert {key for _, key in rank0 if key.startswith(f"{p}r")} == \
        {f"{p}r{r}" for r in range(world)}  # its own, and one read of each other's


def test_an_exchange_a_rank_missed_aborts_for_the_others_and_the_next_one_meets_it():
    """Ranks 0 and 1 exchange without rank 2: both raise TimeoutError naming it at their
    deadline. Rank 2's next call finds that exchange ended without it (a WARNING) and meets the
    others at the next one; the aborted exchange leaves its counter and decision only."""
    store = MemoryStore()
    comms = [StoreCommunicator(store, r, 3, "run") for r in range(3)]

    def alone(c):
        try:
            return c.exchange("t", c.rank, 1)
        except TimeoutError as exc:
            return str(exc)
    out = _as_threads({r: lambda c=comms[r]: alone(c) for r in (0, 1)})
    for r in (0, 1):
        assert out[r].startswith("rank(s) [2] did not answer the exchange 't' #0 within 1 s"), \
            out[r]
    assert sorted(store.list_keys()) == ["x/t/0/decision", "x/t/0/n"]
    messages = []

    class Keep(logging.Handler):
        def emit(self, record):
            messages.append(record.getMessage())
    keep = Keep(logging.WARNING)
    logging.getLogger("datastates").addHandler(keep)
    try:
        out = _as_threads({r: lambda c=comms[r]: c.exchange("t", c.rank * 10, 30)
                           for r in range(3)})
    finally:
        logging.getLogger("datastates").removeHandler(keep)
    assert all(out[r] == {0: 0, 1: 10, 2: 20} for r in range(3)), out
    assert any("the exchange 't' #0 had ended without rank 2" in m for m in messages), messages
    assert sorted(store.list_keys()) == ["x/t/0/decision", "x/t/0/n"]


class _HeldRank0(MemoryStore):
    """Rank 0's polls of an exchange's counter wait until its decision key is claimed."""

    def __init__(self):
        super().__init__()
        self.claimed = threading.Event()

    def compare_set(self, key, expected, desired):
        value = super().compare_set(key, expected, desired)
        if key.endswith("/decision") and expected == "":
            self.claimed.set()
        return value


def test_a_rank_at_its_deadline_takes_the_values_when_all_are_there():
    """Rank 0 is slow (its polls held until another rank claims the decision): rank 1, at its
    deadline, finds every value posted and claims them for all instead of an abort."""
    store, posted = _HeldRank0(), threading.Event()

    class Rank0View(_Recorded):
        def add(self, key, amount):
            if amount == 0:
                assert store.claimed.wait(30)
            value = store.add(key, amount)
            posted.set()
            return value
    comms = [StoreCommunicator(Rank0View(store), 0, 2, "run"),
             StoreCommunicator(store, 1, 2, "run")]

    def rank1():
        assert posted.wait(30)  # its deadline runs from when rank 0's value is there
        return comms[1].exchange("t", "one", 0.2)
    out = _as_threads({0: lambda: comms[0].exchange("t", "zero", 30), 1: rank1})
    assert out[0] == out[1] == {0: "zero", 1: "one"}, out
    assert store.list_keys() == []


class _Decisions(MemoryStore):
    """Keeps every decision claimed."""

    def __init__(self):
        super().__init__()
        self.claimed = []

    def compare_set(self, key, expected, desired):
        value = super().compare_set(key, expected, desired)
        if key.endswith("/decision") and expected == "" and value == desired.encode():
            self.claimed.append(json.loads(value))
        return value


def test_equal_values_are_published_once_whatever_the_world_size():
    """The decision key holds runs of equal values: 16 ranks sending one value and two others
    publish three runs, and every rank reads every value back in rank order."""
    store = _Decisions()
    comms = [StoreCommunicator(store, r, 16, "run") for r in range(16)]
    value = {"name": "step-0000000001", "seq": 1}
    sent = {r: (value if r not in (5, 6) else {"name": None, "seq": -1}) for r in range(16)}
    out = _as_threads({r: lambda c=comms[r]: c.exchange("t", sent[c.rank], 30)
                       for r in range(16)})
    assert all(out[r] == sent for r in range(16)), out
    assert [d["runs"] for d in store.claimed] == [[[value, 5], [sent[5], 2], [value, 9]]]

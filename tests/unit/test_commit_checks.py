"""The commit protocol in one process: the pure checks rank 0 runs before a rename, the per-rank
state diff used when resharding, and the store protocol with threads standing in for ranks."""

from __future__ import annotations

import dataclasses
import threading
import time

import pytest
import torch
import torch.distributed as dist

import datastates
from datastates import Checkpointer, TensorShard
from datastates.commit import catalog, review
from datastates import format as fmt
from datastates.commit.round import MemoryStore, StoreCommunicator
from datastates.commit.review import check_replicas, check_same_save, check_tiling
from datastates.format import validate
from datastates.format.records import (
    FileRef,
    Manifest,
    RankReport,
    SaveRef,
    ShardRef,
    TensorEntry,
    Verdict,
)
from datastates.restore.ranks import per_rank_keys
from testkit import MEDIUM


# ------------------------------------------------------------------ tiling


def _manifest(shape, boxes):
    """One tensor of ``shape`` whose shards are ``boxes`` = [(rank, offset, box shape)]."""
    files = tuple(
        FileRef(name=fmt.shard_file_name(r), rank=r, nbytes=0, index_crc32=0) for r in range(4)
    )
    shards = tuple(
        ShardRef(
            file=r, offset=0, nbytes=0, global_offset=tuple(off), shape=tuple(box), checksums=()
        )
        for r, off, box in boxes
    )
    entry = TensorEntry(key="w", dtype="float32", shape=tuple(shape), shards=shards)
    return Manifest(
        version=2,
        name="step-1",
        step=1,
        seq=1,
        created_unix=0.0,
        world_size=4,
        metadata={},
        files=files,
        entries={0: entry},
        ranks=(),
    )


def _scalars_report(rank: int, keys: list[str]) -> RankReport:
    """A valid report of ``rank`` holding one float32 scalar per key, in a dict tree (parsed
    from its JSON form, as rank 0 receives the reports of the other ranks)."""
    entries = [
        {
            "key": k,
            "kind": "tensor",
            "dtype": "float32",
            "shape": [],
            "offset": 4096 * (i + 1),
            "nbytes": 4,
            "checksums": [[4, 7]],
        }
        for i, k in enumerate(keys)
    ]
    tree = {"t": "dict", "items": [[k, {"t": "tensor", "e": i}] for i, k in enumerate(keys)]}
    return validate.parse_rank_report(
        {
            "rank": rank,
            "save": {"name": "step-0000000001", "step": 1, "nonce": "n"},
            "root": "/d",
            "entries": entries,
            "tree": tree,
            "file": {
                "name": fmt.shard_file_name(rank),
                "nbytes": 4096 * (len(keys) + 1),
                "index_crc32": 1,
            },
        },
        f"rank {rank}",
    )


def test_merged_trees_index_the_global_entries():
    """Rank 0's tree indexes the global entries as it is (kept, not copied); another rank's tree
    is rewritten to the global indices, which follow rank 0's entries. The merged manifest is
    one a reader accepts, and its JSON form parses back into an equal record."""
    reports = [_scalars_report(0, ["a", "b"]), _scalars_report(1, ["c"])]
    manifest = review.build_manifest(reports, name="step-0000000001", step=1, metadata={})
    assert [e.key for e in manifest.entries.values()] == ["a", "b", "c"]
    assert manifest.ranks[0].tree is reports[0].tree
    assert manifest.ranks[1].tree == {"t": "dict", "items": [["c", {"t": "tensor", "e": 2}]]}
    assert reports[1].tree["items"][0][1]["e"] == 0  # the report itself is not modified
    numbered = dataclasses.replace(manifest, seq=1)
    assert manifest.seq == 0  # publishing numbers a copy
    data, written = fmt.manifest_record_bytes(numbered)
    parsed = fmt.parse_manifest_bytes(data, "m.json")
    assert written == parsed
    assert parsed == numbered and parsed.by_file == numbered.by_file


def test_a_tensor_no_rank_stored_fails_the_save_and_keeps_the_checkpoints(tmp_path):
    """Every rank declaring its (empty) copy a replica leaves the tensor with no stored shard: the
    review refuses the save, nothing is committed, and retention deletes nothing."""
    config = MEDIUM.replace(keep_last=1)
    with Checkpointer(tmp_path, config) as ckpt:
        ckpt.save({"x": torch.arange(4)}, step=1).wait()
        empty = TensorShard(torch.ones(0, 2), (0, 2), (0, 0), primary=False)
        with pytest.raises(datastates.CommitError, match="'w' was written by no rank"):
            ckpt.save({"w": empty}, step=2).wait()
        assert [i.name for i in ckpt.list()] == ["step-0000000001"]
    assert [i.name for i in catalog.list_checkpoints(str(tmp_path))] == ["step-0000000001"]


def test_a_report_under_another_ranks_key_aborts_the_round(new_store):
    """Rank 0 takes each report for the rank whose key it was read from: one that says another
    rank aborts the round as invalid, naming the rank."""
    comms, _ = _ranks(2, new_store())
    sid = comms[0].save_id("/d", "step-1", 1)
    liar = RankReport(
        rank=0,
        save=SaveRef(sid.name, sid.step, sid.nonce),
        root="/d",
        file=FileRef(name=fmt.shard_file_name(0), rank=0, nbytes=4096, index_crc32=0),
        tree={"t": "dict", "items": []},
    )
    commits = []
    deadline = time.monotonic() + 10
    out = _in_threads(
        {
            0: lambda: _agree(comms[0], sid, deadline, commits),
            1: lambda: _agree(comms[1], sid, deadline, commits, report=liar),
        }
    )
    assert out[0] == out[1] and out[0].kind == "invalid" and list(out[0].causes) == [1]
    assert "says rank 0" in out[0].message and commits == []


def test_rank_report_json_round_trips():
    report = _scalars_report(1, ["a", "b"])
    assert validate.parse_rank_report(report.to_json(), "again") == report
    failed = RankReport(
        rank=2, save=SaveRef("s", None, "n", True), root="/d", error="E: x", expired=True
    )
    assert validate.parse_rank_report(failed.to_json(), "failed") == failed


def test_verdict_json_round_trips_and_is_validated():
    info = datastates.CheckpointInfo(
        name="a",
        path="/d/a",
        step=3,
        created_unix=1.5,
        world_size=2,
        nbytes=9,
        metadata={"k": [1]},
        seq=4,
    )
    for verdict in (
        Verdict.committed(info),
        Verdict.committed(None),
        Verdict.abort("timeout", "late", {1: "no report", 0: "x"}),
    ):
        assert validate.parse_verdict(verdict.to_json(), "v") == verdict
    with pytest.raises(datastates.CorruptCheckpointError, match="kind"):
        validate.parse_verdict({"ok": False, "kind": "maybe", "message": "", "causes": {}}, "v")
    with pytest.raises(datastates.CorruptCheckpointError, match="causes"):
        validate.parse_verdict(
            {"ok": False, "kind": "store", "message": "", "causes": {"r1": "x"}}, "v"
        )


@pytest.mark.parametrize(
    "shape,boxes",
    [
        ((10, 4), [(0, (0, 0), (5, 4)), (1, (5, 0), (5, 4))]),  # rows
        ((10, 4), [(0, (0, 0), (10, 2)), (1, (0, 2), (10, 1)), (2, (0, 3), (10, 1))]),  # columns
        ((4, 4), [(r, (r // 2 * 2, r % 2 * 2), (2, 2)) for r in range(4)]),  # 2x2 blocks
        ((), [(0, (), ())]),  # a scalar
        ((0, 3), [(0, (0, 0), (0, 3)), (1, (0, 0), (0, 3))]),  # empty
    ],
)
def test_exact_tilings_pass(shape, boxes):
    assert check_tiling(_manifest(shape, boxes)) == []


def test_overlap_gap_duplicate_and_outside_are_named_with_ranks():
    overlap = check_tiling(_manifest((10, 4), [(0, (0, 0), (6, 4)), (1, (5, 0), (5, 4))]))
    assert overlap == [
        (
            [0, 1],
            "ranks 0 and 1 both wrote 'w' boxes [0:6, 0:4] and [5:10, 0:4], "
            "which overlap (declare replicas with primary=False or "
            "replicated=...)",
        )
    ]
    gap = check_tiling(_manifest((10, 4), [(0, (0, 0), (4, 4)), (2, (5, 0), (5, 4))]))
    assert gap == [
        ([0, 2], "the boxes written for 'w' cover 36 of its 40 elements (shape [10, 4]): a gap")
    ]
    twice = check_tiling(_manifest((4,), [(1, (0,), (4,)), (3, (0,), (4,))]))
    assert [p[0] for p in twice] == [[1, 3]] and "both wrote" in twice[0][1]
    outside = check_tiling(_manifest((4, 4), [(2, (2, 0), (4, 4))]))
    assert outside == [([2], "box [2:6, 0:4] of 'w' lies outside its global shape [4, 4]")]
    scalar = check_tiling(_manifest((), [(0, (), ()), (1, (), ())]))
    assert [p[0] for p in scalar] == [[0, 1]]


def test_many_row_shards_are_checked_quickly():
    boxes = [(0, (i, 0), (1, 8)) for i in range(20000)]
    assert check_tiling(_manifest((20000, 8), boxes)) == []
    boxes[7] = (0, (6, 0), (2, 8))
    problems = check_tiling(_manifest((20000, 8), boxes))
    assert len(problems) == 1 and "[6:7, 0:8] and [6:8, 0:8]" in problems[0][1]


def _slab_boxes(rng, shape):
    """Boxes of ``shape`` cut into slabs along one dimension, then perhaps spoiled: a slab
    moved, resized, repeated, dropped, given another number of dimensions."""
    dim = rng.randrange(len(shape))
    cuts = sorted(rng.randint(0, shape[dim]) for _ in range(rng.randint(0, 3)))
    bounds = [0] + cuts + [shape[dim]]
    boxes = []
    for r, (a, b) in enumerate(zip(bounds, bounds[1:])):
        off, box = [0] * len(shape), list(shape)
        off[dim], box[dim] = a, b - a
        boxes.append([r % 4, off, box])
    rng.shuffle(boxes)
    for _ in range(rng.choice([0, 0, 1, 2])):
        victim = rng.choice(boxes)
        what = rng.randrange(6)
        if what == 0:
            victim[1][rng.randrange(len(shape))] += rng.choice([-1, 1])
        elif what == 1:
            victim[2][rng.randrange(len(shape))] += rng.choice([-1, 1, 2])
        elif what == 2:
            boxes.append([rng.randrange(4), list(victim[1]), list(victim[2])])
        elif what == 3 and len(boxes) > 1:
            boxes.remove(victim)
        elif what == 4:
            victim[1].append(0)
            victim[2].append(1)
        else:
            victim[1][rng.randrange(len(shape))] = rng.randint(-2, 6)
    return boxes


def test_tiling_fast_path_finds_what_the_general_check_finds(monkeypatch):
    """Slabs along one dimension, exact or spoiled: the problems found are those of the general
    check alone (the fast path only ever says "tiled" where the general check finds nothing)."""
    import random

    rng = random.Random(9)
    cases, fast = [], 0
    odd = [
        ((4,), [(0, (0,), (6,)), (1, (6,), (-2,))]),  # end to end, past the end
        ((4, 2), [(0, (0, 0), (4, 2)), (1, (4, 0), (0, 2))]),
    ]  # an empty slab after it
    for i in range(3000):
        shape = tuple(rng.randint(0, 5) for _ in range(rng.randint(1, 3)))
        shape, boxes = odd[i] if i < len(odd) else (shape, _slab_boxes(rng, shape))
        manifest = _manifest(shape, boxes)
        cases.append((manifest, check_tiling(manifest)))
        fast += review._slabs(shape, manifest.entries[0].shards)
    monkeypatch.setattr(review, "_slabs", lambda shape, shards: False)
    assert [problems for _, problems in cases] == [check_tiling(m) for m, _ in cases]
    assert fast > 500 and sum(bool(p) for _, p in cases) > 500


def test_regions_by_file_are_those_of_the_entries_of_each_copy():
    """``Manifest.by_file`` is made from the manifest's own entries when first asked: a copy
    with other entries (``dataclasses.replace``) has the regions of those."""
    manifest = _manifest((10, 4), [(0, (0, 0), (5, 4)), (1, (5, 0), (5, 4))])
    entry = manifest.entries[0]
    assert manifest.by_file == (
        ((0, 0, entry, entry.shards[0]),),
        ((0, 0, entry, entry.shards[1]),),
        (),
        (),
    )
    emptied = dataclasses.replace(manifest, entries={})
    assert emptied.by_file == ((), (), (), ()) and emptied != manifest


def test_remapped_tree_is_that_of_map_leaves():
    """The merge's copy of a rank's tree is what ``tree.map_leaves`` makes of it."""
    from datastates.format import tree

    node = {
        "t": "odict",
        "items": [
            ["a", {"t": "tensor", "e": 1, "param": True}],
            ["b", {"t": "value", "v": 3}],
            ["c", {"t": "list", "items": [{"t": "object", "e": 0}, {"t": "tuple", "items": []}]}],
            [
                "d",
                {
                    "t": "provider",
                    "name": "rng",
                    "state": {"t": "dict", "items": [["s", {"t": "tensor", "e": 2, "np": True}]]},
                },
            ],
        ],
    }
    table = [7, 5, 6]
    expected = tree.map_leaves(
        node, lambda _path, n: {**n, "e": table[n["e"]]} if n["t"] in tree.ENTRY_LEAVES else n
    )
    assert review._remap(node, table) == expected
    assert node["items"][0][1]["e"] == 1  # not modified


# ------------------------------------------------------------------ identity and replicas


def _report(rank, name="step-1", step=1, nonce="n", replicas=None, overwrite=False):
    return RankReport(
        rank=rank, save=SaveRef(name, step, nonce, overwrite), root="/d", replicas=replicas or {}
    )


def test_reports_of_another_save_are_named():
    same = {r: _report(r) for r in range(3)}
    assert check_same_save(same) == []
    mixed = {0: _report(0), 1: _report(1, step=2), 2: _report(2, overwrite=True)}
    problems = check_same_save(mixed)
    assert [p[0] for p in problems] == [[1], [2]]
    assert "reported save 'step-1' step 2" in problems[0][1]


def test_diverged_replicas_name_key_and_ranks():
    ok = {r: _report(r, replicas={"m/w": "16:aa"}) for r in range(3)}
    assert check_replicas(ok) == []
    bad = {
        0: _report(0, replicas={"m/w": "16:aa", "m/b": "4:01"}),
        1: _report(1, replicas={"m/w": "16:bb", "m/b": "4:01"}),
        2: _report(2, replicas={"m/w": "16:aa", "m/b": "4:01"}),
    }
    assert check_replicas(bad) == [
        (
            [0, 1, 2],
            "replicated tensor 'm/w' differs across ranks (ranks [0, 2] hold digest "
            "16:aa; ranks [1] hold digest 16:bb)",
        )
    ]


# ------------------------------------------------------------------ per-rank state


def _value(v):
    return {"t": "value", "v": v}


def _tree(**items):
    return {"t": "dict", "items": [[k, v] for k, v in items.items()]}


def test_per_rank_keys_are_the_values_that_differ():
    from datastates.format.records import ObjectEntry, TensorEntry

    entries = [
        ObjectEntry(key="o", file=0, offset=0, nbytes=3, crc32=1),
        ObjectEntry(key="o", file=0, offset=0, nbytes=3, crc32=2),
        TensorEntry(key="w", dtype="float32", shape=(2,), shards=()),
    ]
    t0 = _tree(
        pos=_value(0),
        epoch=_value(3),
        obj={"t": "object", "e": 0},
        w={"t": "tensor", "e": 2},
        seq={"t": "list", "items": [_value(1), _value(2)]},
        flag=_value(1),
    )
    t1 = _tree(
        pos=_value(10),
        epoch=_value(3),
        obj={"t": "object", "e": 1},
        w={"t": "tensor", "e": 2},
        seq={"t": "list", "items": [_value(1), _value(5)]},
        flag=_value(True),
        extra=_value(0),
    )
    assert per_rank_keys([t0, t1], entries, None) == ["pos", "obj", "seq", "flag", "extra"]
    assert per_rank_keys([t0, t1], entries, ["epoch", "w"]) == []
    assert per_rank_keys([t0, t1], entries, ["seq/1"]) == ["seq/1"]
    assert per_rank_keys([t0, t0], entries, None) == []


# ------------------------------------------------------------------ one process, end to end


def test_unknown_rank_policy_is_a_config_error_before_anything(tmp_path):
    with Checkpointer(tmp_path / "nothing-here", MEDIUM) as ckpt:
        with pytest.raises(datastates.ConfigError, match="'everyone'"):
            ckpt.load(rank_policy="everyone")  # raised before looking for a checkpoint
        with pytest.raises(datastates.ConfigError):
            ckpt.restore({}, rank_policy=None)


def test_manifest_records_the_save_id(tmp_path):
    with Checkpointer(tmp_path, MEDIUM) as ckpt:
        first = ckpt.save({"x": torch.arange(4)}, step=1)
        first.wait()
        again = ckpt.save({"x": torch.arange(4)}, step=1, overwrite=True)
        again.wait()
    assert first.save_id != again.save_id  # saving a name again is another save
    assert fmt.read_manifest(str(tmp_path / "step-0000000001")).save_id == again.save_id
    assert catalog.committed_save(str(tmp_path), "step-0000000001", again.save_id) is not None
    assert catalog.committed_save(str(tmp_path), "step-0000000001", first.save_id) is None


def test_shards_leaving_a_gap_fail_the_save(tmp_path):
    piece = TensorShard(torch.ones(3, 2), (4, 2), (0, 0))
    with Checkpointer(tmp_path, MEDIUM) as ckpt:
        with pytest.raises(datastates.CommitError, match="cover 6 of its 8 elements"):
            ckpt.save({"w": piece}, step=1).wait()
        assert ckpt.list() == []
    assert [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")] == []


# ------------------------------------------------------------------ the store protocol


@pytest.fixture(params=["memory", "hash"])
def new_store(request):
    """The in-process store, and torch's HashStore (the same semantics as a TCPStore)."""
    return MemoryStore if request.param == "memory" else dist.HashStore


def _ranks(world, store):
    return [StoreCommunicator(store, r, world, "run") for r in range(world)], store


COMMITTED = Verdict.committed(None)


def _agree(comm, sid, deadline, commits, report=None, fallback=None):
    report = report or RankReport(
        rank=comm.rank,
        save=SaveRef(sid.name, sid.step, sid.nonce),
        root="/d",
        file=FileRef(
            name=fmt.shard_file_name(comm.rank), rank=comm.rank, nbytes=4096, index_crc32=0
        ),
        tree={"t": "dict", "items": []},
    )
    return comm.agree(
        sid,
        report,
        deadline,
        0.5,
        check=lambda reports: None,
        commit=lambda reports, fence: (fence(), commits.append(sorted(reports))) and COMMITTED,
        fallback=fallback or (lambda why, until: Verdict.abort("store", why, {})),
    )


def _in_threads(fns):
    out, threads = {}, []
    for r, fn in fns.items():
        threads.append(threading.Thread(target=lambda r=r, fn=fn: out.__setitem__(r, fn())))
        threads[-1].start()
    for t in threads:
        t.join(30)
    return out


def test_round_commits_once_and_leaves_no_key(new_store):
    comms, store = _ranks(3, new_store())
    sids = [c.save_id("/d", "step-1", 1) for c in comms]
    assert len({s.nonce for s in sids}) == 1  # derived independently, identical
    commits = []
    deadline = time.monotonic() + 10
    out = _in_threads(
        {r: (lambda r=r: _agree(comms[r], sids[r], deadline, commits)) for r in range(3)}
    )
    assert out == {0: COMMITTED, 1: COMMITTED, 2: COMMITTED}
    assert commits == [[0, 1, 2]]
    assert sorted(store.list_keys()) == ["announce/r0", "announce/r1", "announce/r2"]


def test_missing_rank_is_named_and_the_round_cleaned_after_a_commit(new_store):
    comms, store = _ranks(3, new_store())
    sid = comms[0].save_id("/d", "step-1", 1)
    commits = []
    deadline = time.monotonic() + 0.3
    out = _in_threads({r: (lambda r=r: _agree(comms[r], sid, deadline, commits)) for r in (0, 1)})
    assert out[0] == out[1] and out[0].kind == "timeout" and list(out[0].causes) == [2]
    assert commits == []
    # the next save commits and rank 0 deletes what the orphaned round left
    sid2 = comms[0].save_id("/d", "step-2", 2)
    out = _in_threads(
        {r: (lambda r=r: _agree(comms[r], sid2, time.monotonic() + 10, commits)) for r in range(3)}
    )
    assert all(v == COMMITTED for v in out.values())
    assert not any(k.startswith(sid.nonce) for k in store.list_keys())


def test_an_abort_claimed_first_wins_over_a_late_rank0(new_store):
    comms, store = _ranks(2, new_store())
    sid = comms[0].save_id("/d", "step-1", 1)
    commits = []
    # rank 1's deadline passes before rank 0 reports: it claims the abort
    late = _agree(comms[1], sid, time.monotonic(), commits)
    assert late.kind == "timeout" and list(late.causes) == [0]
    # rank 0 arrives with everything ready: it must not commit
    assert _agree(comms[0], sid, time.monotonic() + 10, commits) == late
    assert commits == []


def test_lost_store_falls_back_to_the_verdict_on_disk():
    class Broken:
        def __getattr__(self, name):
            raise RuntimeError("Broken pipe")

    comm = StoreCommunicator(Broken(), 1, 2, "run")
    sid = StoreCommunicator(MemoryStore(), 1, 2, "run").save_id("/d", "step-1", 1)
    seen = []
    verdict = _agree(
        comm,
        sid,
        time.monotonic() + 10,
        [],
        fallback=lambda why, until: seen.append(why) or COMMITTED,
    )
    assert verdict == COMMITTED and "unreachable" in seen[0]


class _CountingStore(MemoryStore):
    """A MemoryStore that counts the report-key reads and lets a test wait for polls."""

    def __init__(self):
        super().__init__()
        self.report_reads, self.polls = 0, 0
        self.polled = threading.Condition()

    def compare_set(self, key, expected, desired):
        if "/r" in key and key.rsplit("/", 1)[-1].startswith("r"):
            self.report_reads += 1
        return super().compare_set(key, expected, desired)

    def add(self, key, amount):
        value = super().add(key, amount)
        if key.endswith("/n") and amount == 0:
            with self.polled:
                self.polls += 1
                self.polled.notify_all()
        return value


def test_rank0_reads_each_report_once_however_long_the_others_take():
    """O(ranks) store requests per round, not per poll: rank 0 polls a counter while the
    reports arrive one by one, and reads each report key once, when all are there."""
    world = 12
    store = _CountingStore()
    comms, _ = _ranks(world, store)
    sid = comms[0].save_id("/d", "step-1", 1)
    commits = []
    result = {}
    thread = threading.Thread(
        target=lambda: result.update(v=_agree(comms[0], sid, time.monotonic() + 60, commits))
    )
    thread.start()
    others = []
    for r in range(1, world):
        with store.polled:  # rank 0 has polled again since the previous report
            seen = store.polls
            store.polled.wait_for(lambda: store.polls > seen + 1, timeout=30)
        others.append(
            threading.Thread(target=_agree, args=(comms[r], sid, time.monotonic() + 60, commits))
        )
        others[-1].start()
    thread.join(60)
    for t in others:
        t.join(60)
    assert result["v"] == COMMITTED and commits == [list(range(world))]
    assert store.polls >= 2 * (world - 1)  # it did poll while the reports came in
    assert store.report_reads == world  # and read each report once (its own included)


def test_a_manifest_larger_than_a_reader_accepts_is_never_committed(tmp_path, monkeypatch):
    """The writer holds itself to the reader's size limit: past it the save fails, nothing is
    committed (the limit is lowered here to what a few tensors take)."""
    from datastates.format import files

    monkeypatch.setattr(files, "MAX_MANIFEST_BYTES", 2000)
    with Checkpointer(tmp_path, MEDIUM) as ckpt:
        with pytest.raises(datastates.CorruptCheckpointError, match="more than the 2000 a reader"):
            ckpt.save({f"w{i}": torch.ones(2) for i in range(40)}, step=1).wait()
        ckpt.save({"w": torch.ones(2)}, step=2).wait()  # a small one still commits
        assert [i.step for i in ckpt.list()] == [2]


def test_waiting_ranks_poll_the_store_less_often_as_the_world_grows():
    """At 8,192 ranks a waiting rank polls at most every 0.41 s: all of them together send the
    store at most 20,000 polls a second; small jobs keep the 50 ms bound."""
    for world, bound in ((2, 0.05), (1000, 0.05), (8192, 8192 * 50e-6)):
        comm = StoreCommunicator(MemoryStore(), 0, world, "run")
        assert comm._max_poll == pytest.approx(bound)
        assert world / comm._max_poll <= 20_000 or comm._max_poll == 0.05


def test_a_key_sharded_on_one_rank_and_whole_on_another_is_named(tmp_path):
    """Rank 0 saves ``w`` as a TensorShard of a 4x3 tensor, rank 1 as a plain 2x3 tensor of its
    own: the commit fails on every rank naming rank 1's plain tensor, not only "a gap"."""
    from thread_ranks import in_thread_ranks

    def save(ck, rank):
        w = TensorShard(torch.ones(2, 3), (4, 3), (0, 0)) if rank == 0 else torch.ones(2, 3)
        return ck.save({"w": w}, step=1).wait(60)

    out = in_thread_ranks(str(tmp_path), 2, save, config=MEDIUM)
    for rank in (0, 1):
        assert isinstance(out[rank], datastates.CommitError), out[rank]
        assert "rank(s) [1] saved 'w' as a tensor of their own, not a TensorShard" in str(
            out[rank]
        ), out[rank]

"""Split manifests (format version 4) with real gloo processes: a manifest past ``SPLIT_BYTES``
is written as a head and parts, each part the trees of a run of ranks and the entries they
brought; every rank restores from it bit-exactly, a listing reads the head alone, and the
logical manifest is the one a single file would hold.

One launch of 4 ranks saves two checkpoints with ``SPLIT_BYTES`` lowered in every process (so
that a few kilobytes of manifest make parts of about one rank each): sharded tensors (one entry
with a shard from every rank), per-rank tensors, a replicated model written once, objects and
plain values."""
from __future__ import annotations

import bisect
import dataclasses
import json
import os
import shutil

import pytest
import torch
import torch.distributed as dist

import datastates
from datastates import CheckpointConfig, Checkpointer, TensorShard
from datastates.commit import catalog
from datastates.format import codec as fmt
from datastates.format import files, tree
from datastates.tools.cli import main as cli_main

from launcher import run_ranks

WORLD = 4
SPLIT = 1500  # bytes: a part holds about one rank here
CONFIG = CheckpointConfig(commit_timeout_s=60)


def _state(rank: int, step: int) -> dict:
    g = torch.Generator().manual_seed(step)
    model = {f"layer{i}": torch.randn(64, generator=g) for i in range(4)}  # the same everywhere
    rows = torch.arange(8 * 6, dtype=torch.float64).reshape(8, 6)[2 * rank:2 * rank + 2] + step
    return {"model": model,
            "rows": TensorShard(rows.clone(), (8, 6), (2 * rank, 0)),
            "mine": [torch.full((rank + 3,), float(10 * step + rank)) for _ in range(5)],
            "extra": {"rank": rank, "step": step, "note": f"rank {rank}", "obj": {rank, step}}}


def _blank(rank: int) -> dict:
    state = _state(rank, 0)
    return {"model": {k: torch.zeros_like(v) for k, v in state["model"].items()},
            "rows": TensorShard(torch.zeros(2, 6, dtype=torch.float64), (8, 6), (2 * rank, 0)),
            "mine": [torch.zeros_like(t) for t in state["mine"]],
            "extra": {"rank": -1, "step": -1, "note": "", "obj": None}}


def _same(live: dict, saved: dict) -> bool:
    return (all(torch.equal(live["model"][k], saved["model"][k]) for k in saved["model"]) and
            torch.equal(live["rows"].local, saved["rows"].local) and
            all(torch.equal(a, b) for a, b in zip(live["mine"], saved["mine"])) and
            live["extra"] == saved["extra"])


def _save_and_restore(rank, world, root):
    fmt.SPLIT_BYTES = SPLIT
    with Checkpointer(root, CONFIG) as ckpt:
        for step in (1, 2):
            ckpt.save(_state(rank, step), step=step, replicated=["model"]).wait()
        dist.barrier()
        live = _blank(rank)
        decoded, decode, trees = [], files._Parts.decode, files._Parts.trees

        def counting(self, i, raw, convert=None):
            decoded.append(i)
            return decode(self, i, raw, convert)

        def counting_trees(self, i, raw):
            decoded.append(i)
            return trees(self, i, raw)
        files._Parts.decode, files._Parts.trees = counting, counting_trees
        report = ckpt.restore(live)
        exact = _same(live, _state(rank, 2))
        restored = list(decoded)
        decoded.clear()
        again = _blank(rank)
        fallback = ckpt.restore(again, fallback=True)
        files._Parts.decode, files._Parts.trees = decode, trees
        older = _blank(rank)
        ckpt.restore(older, step=1)
        return {"step": report.step, "exact": exact, "older": _same(older, _state(rank, 1)),
                "fallback": (fallback.step, _same(again, _state(rank, 2))),
                "listed": [(i.step, i.seq) for i in ckpt.list()],
                "decoded": restored, "decoded by fallback": list(decoded)}


@pytest.fixture(scope="module")
def launched(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("split") / "ckpts")
    return root, run_ranks(WORLD, _save_and_restore, root)


def test_every_rank_restores_a_split_manifest_bit_exactly(launched):
    root, results = launched
    for rank in range(WORLD):
        assert {k: v for k, v in results[rank].items() if not k.startswith("decoded")} == {
            "step": 2, "exact": True, "older": True, "fallback": (2, True),
            "listed": [(1, 1), (2, 2)]}, (rank, results[rank])
    ckpt = os.path.join(root, fmt.step_name(2))
    head = json.loads(open(os.path.join(ckpt, fmt.MANIFEST), "rb").read())
    # each rank's restore, and its fallback restore, decoded the parts of its view only (the
    # view is exactly that rank's slice: tests/faults/test_split_view.py); rank 0 restores from
    # the manifest it committed, kept by its listing, and decodes none
    whole = files.read_manifest(ckpt)
    for how in ("decoded", "decoded by fallback"):
        assert results[0][how] == []
        for rank in range(1, WORLD):
            decoded = results[rank][how]
            assert sorted(set(decoded)) == sorted(_needed(head, rank, whole.ranks[rank].tree)), \
                (how, rank, decoded, head["parts"])
    assert min(len(set(results[r]["decoded"])) for r in range(1, WORLD)) < len(head["parts"])
    assert head["version"] == fmt.SPLIT_VERSION and "entries" not in head
    names = sorted(n for n in os.listdir(ckpt) if n.startswith("manifest-"))
    assert names == [p["name"] for p in head["parts"]] and len(names) >= 2, names
    assert sum(p["rank_count"] for p in head["parts"]) == WORLD


def _needed(head: dict, rank: int, node: dict) -> set[int]:
    """The parts holding the trees of rank 0 and ``rank`` and the entries ``node`` refers to."""
    parts = head["parts"]
    firsts = [p["first_rank"] for p in parts]
    starts = [p["first_entry"] for p in parts]
    entries = {n["e"] for _, n in tree.leaves(node) if n["t"] in tree.ENTRY_LEAVES}
    return {bisect.bisect_right(firsts, r) - 1 for r in (0, rank)} | {
        bisect.bisect_right(starts, e) - 1 for e in entries}


def test_the_split_manifest_holds_what_one_file_would(launched):
    """Parsed, the split manifest is the record a one-file manifest of the same checkpoint
    gives (only the version differs), and every byte of the checkpoint verifies."""
    root, _ = launched
    ckpt = os.path.join(root, fmt.step_name(2))
    split = files.read_manifest(ckpt)
    data, whole = files.manifest_record_bytes(split)
    assert whole.version == fmt.MANIFEST_VERSION and split.version == fmt.SPLIT_VERSION
    assert dataclasses.replace(whole, version=split.version) == split
    assert files.parse_manifest_bytes(data, "whole") == whole
    rows = [e for e in split.entries.values() if e.key == "rows"]
    assert len(rows) == 1 and len(rows[0].shards) == WORLD  # one entry, a shard from each rank
    assert cli_main(["verify", root]) == 0
    # one process loads the global state of the four ranks' checkpoint: "rows" whole
    with Checkpointer(root, CONFIG) as ckpt_root:
        loaded = ckpt_root.load(step=2, keys=["rows", "model"])
    assert torch.equal(loaded["rows"],
                       torch.arange(8 * 6, dtype=torch.float64).reshape(8, 6) + 2)
    assert all(torch.equal(loaded["model"][k], v) for k, v in _state(0, 2)["model"].items())


def test_a_listing_reads_the_parts_of_the_newest_only(launched, tmp_path):
    """An older checkpoint's description comes from its head alone: with its parts gone the
    listing shows it as it was. The newest is parsed whole (so that damage to it is known
    before a resume relies on it): with its parts gone it is listed as damaged, naming the
    missing part, and the older one is the latest."""
    root, _ = launched
    before = [(i.name, i.step, i.seq, i.nbytes) for i in catalog.list_checkpoints(root)]

    def without_parts(step: int) -> tuple[str, list[str]]:
        copy = str(tmp_path / f"without-{step}")
        shutil.copytree(root, copy)
        ckpt = os.path.join(copy, fmt.step_name(step))
        parts = sorted(n for n in os.listdir(ckpt) if n.startswith("manifest-"))
        for name in parts:
            os.remove(os.path.join(ckpt, name))
        return copy, parts

    copy, parts = without_parts(1)
    assert [(i.name, i.step, i.seq, i.nbytes) for i in catalog.list_checkpoints(copy)] == before
    with pytest.raises(datastates.CorruptCheckpointError, match=parts[0].replace(".", r"\.")):
        files.read_manifest(os.path.join(copy, fmt.step_name(1)))
    copy, parts = without_parts(2)
    cat = catalog.Catalog(copy)
    assert [i.step for i in cat.scan()] == [1]
    (damaged,) = cat.damaged()
    assert damaged.name == fmt.step_name(2) and parts[0] in damaged.reason, damaged

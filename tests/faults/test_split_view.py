"""One rank's view of a split manifest (docs/format.md, "A rank's view"): a rank restoring one
saved rank's state (at the saved world size, or under the rank policies 'rank0' and 'same')
reads only the parts holding that rank's tree, rank 0's tree and the entries the tree refers
to, each checked by its size and CRC-32, and validates only those entries; the job's listing
checks every part, so every rank finds the same damage in the newest checkpoint. What a view
returns is exactly its slice of the whole manifest.

The checkpoint is saved by four ranks in threads of this process (``test_split_hostile._save``),
with ``SPLIT_BYTES`` lowered so that its manifest splits into several parts."""

from __future__ import annotations

import bisect
import dataclasses
import json
import os

import pytest

import datastates
from datastates.commit.catalog import Catalog
from datastates.format import codec, files, tree
from datastates.providers import ProviderRegistry
from datastates.restore.reader import Reader

from thread_ranks import in_thread_ranks
from test_split_hostile import STEP, WORLD, _head, _parts, _write_head, ckpt  # noqa: F401


def _saved(rank: int):
    """The ``files.View`` of a reader restoring saved rank ``rank``'s state."""
    return lambda saved_world: rank


def _refs(node: dict) -> set[int]:
    """The entries a state tree refers to."""
    return {n["e"] for _, n in tree.leaves(node) if n["t"] in tree.ENTRY_LEAVES}


@pytest.fixture
def counted(monkeypatch):
    """Which parts were read, whose trees were taken alone and which were decoded (their
    entries: every one, or some kept), in order, while the test runs."""
    seen = {"read": [], "trees": [], "decoded": []}
    read, trees, decode = files._Parts.read, files._Parts.trees, files._Parts.decode

    def counting_read(self, i):
        seen["read"].append(i)
        return read(self, i)

    def counting_trees(self, i, raw):
        seen["trees"].append(i)
        return trees(self, i, raw)

    def counting_decode(self, i, raw, convert=None):
        seen["decoded"].append(i)
        return decode(self, i, raw, convert)

    monkeypatch.setattr(files._Parts, "read", counting_read)
    monkeypatch.setattr(files._Parts, "trees", counting_trees)
    monkeypatch.setattr(files._Parts, "decode", counting_decode)
    return seen


def _needed(head: dict, rank: int, entries: set[int]) -> tuple[set[int], set[int]]:
    """The parts a view of ``rank`` takes trees from (rank 0's and its own), and those whose
    entries it decodes (those its tree refers to)."""
    parts = head["parts"]
    firsts = [p["first_rank"] for p in parts]
    starts = [p["first_entry"] for p in parts]
    return (
        {bisect.bisect_right(firsts, r) - 1 for r in (0, rank)},
        {bisect.bisect_right(starts, e) - 1 for e in entries},
    )


def test_each_view_is_that_ranks_slice_of_the_whole_manifest(ckpt, counted):
    whole = files.read_manifest(ckpt)
    head = _head(ckpt)
    nparts = len(head["parts"])
    assert counted["decoded"] == list(range(nparts))
    decoded_by_rank = []
    for rank in range(WORLD):
        for seen in counted.values():
            seen.clear()
        view = files.read_manifest(ckpt, view=_saved(rank))
        mine = _refs(whole.ranks[rank].tree)
        assert view.view == rank and view.ranks == (whole.ranks[rank],)
        assert view.entries == {e: whole.entries[e] for e in mine}
        assert dataclasses_equal_but(view, whole, "entries", "ranks", "view")
        # the needed parts read once each (their CRC checked); trees taken from the parts of
        # rank 0 and this rank without decoding their entries; the entries of the parts
        # holding this rank's decoded
        trees, entries = _needed(head, rank, mine)
        assert sorted(counted["read"]) == sorted(trees | entries), (rank, counted)
        assert sorted(counted["trees"]) == sorted(trees), (rank, counted)
        assert sorted(counted["decoded"]) == sorted(entries), (rank, counted)
        decoded_by_rank.append(len(entries))
    # ranks past the first decode the entries of fewer parts than there are
    assert max(decoded_by_rank[1:]) < nparts, decoded_by_rank


def dataclasses_equal_but(a, b, *fields: str) -> bool:
    """Whether the dataclasses ``a`` and ``b`` hold the same values but for ``fields``."""
    return all(
        getattr(a, f.name) == getattr(b, f.name)
        for f in dataclasses.fields(a)
        if f.name not in fields
    )


def test_parts_with_their_entries_first_read_back_the_same(ckpt, counted):
    """A part whose entries come before its trees (the order of the first writers of version 4)
    reads back as the same manifest, whole and as every rank's view: a view then decodes the
    part whole to take its trees."""
    whole = files.read_manifest(ckpt)
    views = [files.read_manifest(ckpt, view=_saved(r)) for r in range(WORLD)]
    for i in range(len(_parts(ckpt))):
        _forge_part(
            ckpt,
            i,
            lambda obj: obj.update(
                {k: obj.pop(k) for k in ("format", "version", "entries", "ranks")}
            ),
        )
    data = open(os.path.join(ckpt, _parts(ckpt)[0]), "rb").read()
    assert data.index(b'"entries"') < data.index(b'"ranks"')
    assert files.read_manifest(ckpt) == whole
    for seen in counted.values():
        seen.clear()
    assert [files.read_manifest(ckpt, view=_saved(r)) for r in range(WORLD)] == views
    assert counted["trees"] and set(counted["trees"]) <= set(counted["decoded"])


def test_a_reader_needing_every_tree_reads_the_whole_manifest(ckpt):
    whole = files.read_manifest(ckpt)
    assert files.read_manifest(ckpt, view=lambda saved_world: None) == whole


@pytest.mark.parametrize(
    "world, rank, policy, saved_rank",
    [
        (2, 1, "same", 1),
        (2, 1, "rank0", 0),
        (8, 6, "same", 0),
        (1, 0, "rank0", 0),
        (1, 0, "same", 0),
        (2, 1, "strict", None),
        (1, 0, "strict", None),
    ],
)
def test_a_reader_at_another_world_size_reads_the_view_of_the_rank_its_policy_takes(
    ckpt, world, rank, policy, saved_rank
):
    """Restoring at another world size, ``rank_policy`` 'rank0' and 'same' take one saved
    rank's state: its view is read, and loads what a whole read loads; 'strict' compares every
    saved rank's tree: the whole manifest is read."""
    keys = ["rows"] if policy == "strict" else ["mine", "rank", "rows"]  # strict: global only

    def opened(view: bool) -> Reader:
        return Reader(
            ckpt,
            registry=ProviderRegistry.default(),
            rank=rank,
            world_size=world,
            rank_policy=policy,
            view=view,
        )

    with opened(True) as reader:
        assert reader.manifest.view == saved_rank
        if saved_rank is None:
            assert reader.manifest == files.read_manifest(ckpt)
        loaded = reader.load(keys=keys)
    with opened(False) as reader:
        expected = reader.load(keys=keys)
    assert loaded["rows"].equal(expected["rows"]) and loaded["rows"].shape == (WORLD, 3)
    if policy != "strict":
        assert loaded["rank"] == expected["rank"] == saved_rank
        assert all(a.equal(b) for a, b in zip(loaded["mine"], expected["mine"]))
        assert [len(t) for t in loaded["mine"]] == [saved_rank + 2] * 3


def test_a_reader_restores_bit_exactly_from_its_view(ckpt):
    """A Reader of rank r at the saved world size reads through its view and restores what rank
    r saved; handed the view of another rank, it refuses it."""
    import torch
    from test_split_hostile import _state

    for rank in range(WORLD):
        live = _state(rank)
        live["mine"] = [torch.zeros_like(t) for t in live["mine"]]
        live["rows"].local.zero_()
        live["rank"] = -1
        with Reader(
            ckpt, registry=ProviderRegistry.default(), rank=rank, world_size=WORLD, view=True
        ) as reader:
            assert reader.manifest.view == rank
            reader.restore_into(live)
            view = reader.manifest
        saved = _state(rank)
        assert live["rank"] == rank
        assert all(t.equal(s) for t, s in zip(live["mine"], saved["mine"]))
        assert live["rows"].local.equal(saved["rows"].local)
        with pytest.raises(ValueError, match=f"view of saved rank {rank}"):
            Reader(
                ckpt,
                registry=ProviderRegistry.default(),
                rank=(rank + 1) % WORLD,
                world_size=WORLD,
                manifest=view,
            )


def test_views_are_asked_for_and_of_a_rank_of_the_job(ckpt):
    """A Reader reads the whole manifest unless asked for a view (``verify``, a copy to storage
    and the memory keeper's check read through one at the saved world size); a view cannot be
    verified whole nor written; a view of a rank outside the job is a ValueError."""
    with Reader(ckpt, registry=ProviderRegistry.default(), world_size=WORLD) as reader:
        assert reader.manifest == files.read_manifest(ckpt)
        assert reader.verify_all() > 0
    with Reader(ckpt, registry=ProviderRegistry.default(), world_size=WORLD, view=True) as reader:
        with pytest.raises(ValueError, match="whole manifest"):
            reader.verify_all()
        with pytest.raises(ValueError, match="cannot be written"):
            files.encode_manifest_record(reader.manifest)
    for rank in (-1, WORLD):
        with pytest.raises(ValueError, match=f"no view of rank {rank}"):
            files.read_manifest(ckpt, view=_saved(rank))


def test_verify_and_a_copy_to_storage_check_every_ranks_entries(ckpt, tmp_path, capsys):
    """A sealed forgery in an entry rank 0 does not refer to is found by ``datastates verify``
    of that checkpoint (not only when it is the newest) and refused by the copy of a memory
    checkpoint to storage: both read the whole manifest."""
    from datastates import CheckpointConfig
    from datastates.commit.catalog import list_checkpoints
    from datastates.commit.round import new_run_id
    from datastates.memory.persist import copy_commit
    from datastates.tools.cli import main as cli_main

    head = _head(ckpt)
    whole = files.read_manifest(ckpt)
    last = len(head["parts"]) - 1
    first = head["parts"][last]["first_entry"]
    place = (
        next(e for e in range(first, len(whole.entries)) if e not in _refs(whole.ranks[0].tree))
        - first
    )
    (info,) = list_checkpoints(os.path.dirname(ckpt))

    def change(obj):
        obj["entries"][place]["key"] += "x"

    _forge_part(ckpt, last, change)
    assert cli_main(["verify", ckpt]) != 0
    shown = capsys.readouterr()
    assert f"entry '{whole.entries[first + place].key}x' is not referenced" in shown.err, shown
    with pytest.raises(datastates.CorruptCheckpointError):
        copy_commit(info, str(tmp_path / "copy"), CheckpointConfig(), new_run_id())


def test_damage_to_a_part_fails_the_views_that_read_it_and_every_listing(ckpt):
    """A flipped byte in a part fails the view of every rank that reads that part, naming it,
    and no other (as damage to another rank's shard file: a rank does not read it); the
    listing of the job, which every rank makes, checks every part, so all ranks find the newest
    checkpoint damaged alike."""
    head = _head(ckpt)
    whole = files.read_manifest(ckpt)
    readers = {r: set.union(*_needed(head, r, _refs(whole.ranks[r].tree))) for r in range(WORLD)}
    for i, name in enumerate(_parts(ckpt)):
        path = os.path.join(ckpt, name)
        data = bytearray(open(path, "rb").read())
        data[len(data) // 2] ^= 0x20
        open(path, "wb").write(bytes(data))
        for rank in range(WORLD):
            if i in readers[rank]:
                with pytest.raises(datastates.CorruptCheckpointError, match=name):
                    files.read_manifest(ckpt, view=_saved(rank))
            else:
                assert files.read_manifest(ckpt, view=_saved(rank)).ranks == (whole.ranks[rank],)
        job = Catalog(os.path.dirname(ckpt), world_size=WORLD)
        assert job.scan() == [] and name in job.damaged()[0].reason
        data[len(data) // 2] ^= 0x20
        open(path, "wb").write(bytes(data))
    assert any(len(parts) < len(_parts(ckpt)) for parts in readers.values()), readers


def _forge_part(ckpt: str, i: int, change) -> None:
    """Change part ``i`` (``change(obj)``) and record its new size and CRC in a sealed head."""
    head = _head(ckpt)
    name = head["parts"][i]["name"]
    path = os.path.join(ckpt, name)
    obj = json.loads(open(path, "rb").read())
    change(obj)
    data = codec.encode_json(obj)
    open(path, "wb").write(data)
    head["parts"][i].update(nbytes=len(data), crc32=codec.crc32(data))
    _write_head(ckpt, head)


def _leaf(node, e: int) -> dict:
    """The leaf of a state tree as written (``same`` markers and all) that refers to ``e``."""
    if isinstance(node, dict):
        if node.get("e") == e:
            return node
        children = node.get("items", []) + [node.get("state")]
    else:
        children = node if isinstance(node, list) else []
    for child in children:
        found = _leaf(child, e) if isinstance(child, (dict, list)) else None
        if found is not None:
            return found
    return None


@pytest.mark.parametrize(
    "forgery", ["entry size", "entry key", "entry overlap", "tree kind", "tree index"]
)
def test_a_sealed_forgery_fails_the_views_that_decode_it(ckpt, forgery):
    """A part whose size and CRC the head records but whose content is wrong (a faulty or
    hostile writer): every view that validates what is wrong raises CorruptCheckpointError, as
    the whole parse does; every other view is its slice of the manifest as before."""
    head = _head(ckpt)
    whole = files.read_manifest(ckpt)
    part = 1
    p = head["parts"][part]
    owner = p["first_rank"]  # the rank whose tree the part holds
    target = (
        p["first_entry"]
        if forgery.startswith("entry")
        else min(_refs(whole.ranks[owner].tree) - _refs(whole.ranks[0].tree))
    )
    assert p["entry_count"] and whole.entries[target].kind == "tensor"

    def change(obj):
        if forgery == "entry overlap":  # its bytes and checksums are another entry's of rank 0
            # (in the same file, of the same size)
            shard = next(
                whole.entries[e].shards[0]
                for e in sorted(_refs(whole.ranks[0].tree))
                if e != target
                and whole.entries[e].kind == "tensor"
                and whole.entries[e].shards[0].file == whole.entries[target].shards[0].file
                and whole.entries[e].shards[0].nbytes == whole.entries[target].shards[0].nbytes
            )
            obj["entries"][0]["shards"][0].update(
                offset=shard.offset, checksums=[list(c) for c in shard.checksums]
            )
        elif forgery == "entry size":
            obj["entries"][0]["shape"] = [n * 2 for n in obj["entries"][0]["shape"]]
        elif forgery == "entry key":
            obj["entries"][0]["key"] += "x"
        elif forgery == "tree kind":
            _leaf(obj["ranks"][0]["tree"], target)["t"] = "object"
        else:
            _leaf(obj["ranks"][0]["tree"], target)["e"] = 10**6

    _forge_part(ckpt, part, change)
    with pytest.raises(datastates.CorruptCheckpointError):
        files.read_manifest(ckpt)
    refused = (
        {r for r in range(WORLD) if target in _refs(whole.ranks[r].tree)}
        if forgery.startswith("entry")
        else {owner}
    )
    assert 0 < len(refused) < WORLD, refused
    for rank in range(WORLD):
        if rank in refused:
            with pytest.raises(datastates.CorruptCheckpointError):
                files.read_manifest(ckpt, view=_saved(rank))
        else:
            assert files.read_manifest(ckpt, view=_saved(rank)).ranks == (whole.ranks[rank],)


def _in_ranks(root: str, action) -> dict:
    """Rank -> what ``action(checkpointer, rank)`` returned (or raised) in each rank of a job of
    four ranks (tests/thread_ranks.py)."""
    return in_thread_ranks(root, WORLD, action)


def _stepped(rank: int, step: int) -> dict:
    """Rank ``rank``'s state at ``step`` (test_split_hostile's, its values changed by step)."""
    from test_split_hostile import _state

    state = _state(rank)
    state["mine"] = [t + 100 * step for t in state["mine"]]
    return state


def _restored(step: int | None = None, saved_as=_stepped, **kwargs):
    """The action restoring ``step`` (None: the latest): the step restored if rank r got what
    it saved then (``saved_as(r, step)``), else what it got."""
    import torch

    def action(ck, r: int):
        live = saved_as(r, 0)
        live["mine"] = [torch.zeros_like(t) for t in live["mine"]]
        report = ck.restore(live, step=step, **kwargs)
        saved = saved_as(r, report.step)
        same = all(a.equal(b) for a, b in zip(live["mine"], saved["mine"]))
        return report.step if same else live

    return action


def _restore_all(root: str, step: int) -> dict:
    """Rank -> ``restore(step=...)``'s outcome: True if rank r restored what it saved, else the
    exception."""
    from test_split_hostile import _state

    out = _in_ranks(root, _restored(step, saved_as=lambda r, _: _state(r)))
    return {r: found == step or found for r, found in out.items()}


def test_a_sealed_forgery_in_the_newest_fails_its_ranks_alone_unless_they_fall_back(tmp_path):
    """A part of the newest checkpoint whose checksum holds but whose content does not validate
    (a tree node of another kind, in rank 1's tree): the job's listing takes it for intact, and
    a restore of the latest fails on rank 1 only, the others restoring it; with
    ``fallback=True`` every rank passes it over and restores the older one together."""
    root = str(tmp_path / "ckpts")
    codec_saved = codec.SPLIT_BYTES
    codec.SPLIT_BYTES = 600
    try:
        saved = _in_ranks(
            root, lambda ck, r: [ck.save(_stepped(r, s), step=s).wait(60) and s for s in (1, 2)]
        )
    finally:
        codec.SPLIT_BYTES = codec_saved
    assert all(not isinstance(v, Exception) for v in saved.values()), saved
    newest = os.path.join(root, codec.step_name(2))
    whole = files.read_manifest(newest)
    head = _head(newest)
    part = next(
        i
        for i, p in enumerate(head["parts"])
        if p["first_rank"] <= 1 < p["first_rank"] + p["rank_count"]
    )
    target = min(_refs(whole.ranks[1].tree) - _refs(whole.ranks[0].tree))

    def change(obj):
        _leaf(obj["ranks"][1 - head["parts"][part]["first_rank"]]["tree"], target)["t"] = "object"

    _forge_part(newest, part, change)
    plain = _in_ranks(root, _restored())
    assert isinstance(plain[1], datastates.CorruptCheckpointError), plain
    assert {r: plain[r] for r in (0, 2, 3)} == {0: 2, 2: 2, 3: 2}, plain
    together = _in_ranks(root, _restored(fallback=True))
    assert together == {r: 1 for r in range(WORLD)}, together


def test_a_named_restore_reads_the_parts_of_each_view_only(ckpt):
    """``restore(step=...)`` finds the checkpoint by its head and reads each rank's view: a
    flipped byte in a part fails the ranks whose view reads it, naming it, and no other (the
    listing did not check a checkpoint named by step)."""
    head = _head(ckpt)
    whole = files.read_manifest(ckpt)
    readers = {r: set.union(*_needed(head, r, _refs(whole.ranks[r].tree))) for r in range(WORLD)}
    part = next(
        i
        for i in range(len(head["parts"]))
        if 0 < sum(i in readers[r] for r in range(WORLD)) < WORLD
    )
    name = head["parts"][part]["name"]
    path = os.path.join(ckpt, name)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 2] ^= 0x20
    open(path, "wb").write(bytes(data))
    results = _restore_all(os.path.dirname(ckpt), 1)
    for rank in range(WORLD):
        if part in readers[rank]:
            assert isinstance(results[rank], datastates.CorruptCheckpointError), results
            assert name in str(results[rank])
        else:
            assert results[rank] is True, results


def test_a_listing_of_the_job_checks_every_part_and_decodes_none(ckpt, counted):
    """The listing of a job of several ranks describes the newest split checkpoint from its head
    once every part's size and CRC check, decoding no part and keeping no manifest (each rank's
    reader reads its view, or the whole); a damaged part makes it damaged there as in a listing
    of one process, which decodes every part."""
    root = os.path.dirname(ckpt)
    whole = Catalog(root)
    assert [i.name for i in whole.scan()] == [STEP]
    assert counted["decoded"] == counted["read"] == list(range(len(_parts(ckpt))))
    counted["read"].clear()
    counted["decoded"].clear()
    for world in (WORLD, 2):  # a job at the saved world size, and one at another
        counted["read"].clear()
        job = Catalog(root, world_size=world)
        (info,) = job.scan()
        assert info == whole.scan()[0]
        assert sorted(counted["read"]) == list(range(len(_parts(ckpt))))
        assert counted["decoded"] == counted["trees"] == []
        assert job.manifest(info) is None and whole.manifest(info) is not None
    path = os.path.join(ckpt, _parts(ckpt)[-1])
    data = bytearray(open(path, "rb").read())
    data[5] ^= 1
    open(path, "wb").write(bytes(data))
    for catalog in (Catalog(root), Catalog(root, world_size=WORLD)):
        assert catalog.scan() == []
        (damaged,) = catalog.damaged()
        assert _parts(ckpt)[-1] in damaged.reason, damaged

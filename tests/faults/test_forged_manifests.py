"""Sealed manifests only a faulty or hostile writer makes, which every reader must judge the
same way (docs/format.md, "What a reader validates" and "The head"):

- the shards of a tensor tile it exactly. Boxes that overlap, or leave elements no box covers,
  are refused by every reader (``Reader``, ``load``, ``restore``, ``datastates verify``, a
  rank's view of a split manifest) before a byte is read: otherwise ``load`` returned
  uninitialized memory for the uncovered rows and ``restore`` left them as they were. Every
  layout a writer commits (one shard, slabs, a grid of boxes, bricks, replicas, boxes of no
  element) still loads bit-exactly, and the writer's review and the readers decide by the same
  code;
- whether a manifest is damaged never depends on the caller's stack: a document nested deeper
  than ``MAX_JSON_DEPTH`` is damage from any caller, a caller too deep to decode one within the
  bound gets ``RecursionError`` (never ``CorruptCheckpointError``), and ``metadata`` nests at
  most ``MAX_METADATA_DEPTH`` levels and holds finite numbers only.

The sharded checkpoints are saved by four ranks in threads of this process
(tests/thread_ranks.py), once in one manifest file and once split into parts."""

from __future__ import annotations

import json
import os
import random
import re
import sys

import pytest
import torch

import datastates
from datastates import CorruptCheckpointError, TensorShard
from datastates.commit.review import check_tiling
from datastates.format import codec, files, plain, validate
from datastates.format.checks import MAX_METADATA_DEPTH, MAX_TREE_DEPTH, _At
from datastates.format.tiling import (
    grid as _grid,
    slabs as _slabs,
    tiled as _tiled,
    tiling_fault as _tiling_fault,
)
from datastates.format.records import FileRef, Manifest, ShardRef, TensorEntry
from datastates.providers import ProviderRegistry
from datastates.restore.reader import Reader
from datastates.tools.cli import main as cli_main

from _integrity_helpers import manifest_json, write_sealed
from test_split_hostile import _save
from test_split_view import _forge_part, _head
from thread_ranks import in_thread_ranks

WORLD = 4
STEP = codec.step_name(1)
G = torch.arange(24, dtype=torch.float32).reshape(4, 6)
B = G[:2, :4] + 50
BRICKS = [(0, 1), (1, 3), (0, 3), (3, 1)]  # (first column, columns) of each rank's box: row 0
# cut after column 1, row 1 after column 3 -- an exact tiling that is neither slabs nor a grid


def _state(rank: int) -> dict:
    """Rank ``rank``'s state: a tensor of its own, and every layout of a global tensor a writer
    commits -- rows and columns (slabs), a 2x2 grid of boxes, two boxes each held by two ranks
    (one writes it, the other declares its copy a replica), bricks (rows cut at different
    columns), boxes of no element, and a tensor every rank holds replicated."""
    r0, c0 = rank // 2 * 2, rank % 2 * 3
    b0, width = BRICKS[rank]
    return {
        "mine": torch.full((rank + 2,), float(rank)),
        "rows": TensorShard(G[rank : rank + 1].clone(), (4, 6), (rank, 0)),
        "cols": TensorShard(G[:, rank : rank + 1] * 2, (4, 4), (0, rank)),
        "grid": TensorShard(G[r0 : r0 + 2, c0 : c0 + 3] + 100, (4, 6), (r0, c0)),
        "pairs": TensorShard(G[r0 : r0 + 2] - 5, (4, 6), (r0, 0), primary=rank % 2 == 0),
        "bricks": TensorShard(
            B[rank // 2 : rank // 2 + 1, b0 : b0 + width], (2, 4), (rank // 2, b0)
        ),
        "empty": TensorShard(torch.zeros(0, 3), (0, 3), (0, 0)),
        "rep": torch.arange(5.0),
    }


GLOBAL = {
    "rows": G,
    "cols": G[:, :4] * 2,
    "grid": G + 100,
    "pairs": G - 5,
    "bricks": B,
    "empty": torch.zeros(0, 3),
    "rep": torch.arange(5.0),
}


def _save_ranks(root: str) -> None:
    results = in_thread_ranks(
        root, WORLD, lambda ck, r: ck.save(_state(r), step=1, replicated=["rep"]).wait(60)
    )
    errors = {r: found for r, found in results.items() if isinstance(found, BaseException)}
    assert not errors, errors


def _save_split(root: str) -> None:
    _save(root, 600, _state_replicated_none)


def _state_replicated_none(rank: int) -> dict:
    """:func:`_state` for ``test_split_hostile._save`` (which declares no replicas): the
    replicated tensor left out."""
    state = _state(rank)
    del state["rep"]
    return state


def _copy(pristine, private_copy, build) -> tuple[str, str]:
    """(root, checkpoint) of a private copy of what ``build`` saved."""
    root = private_copy(pristine(build)[0])
    return root, os.path.join(root, STEP)


@pytest.fixture
def ck(pristine, private_copy):
    return _copy(pristine, private_copy, _save_ranks)


@pytest.fixture
def ck_split(pristine, private_copy):
    return _copy(pristine, private_copy, _save_split)


def _checkpointer(root: str) -> datastates.Checkpointer:
    return datastates.Checkpointer(root, communicator=datastates.LocalCommunicator())


def _reader(ckpt: str, **kwargs) -> Reader:
    return Reader(ckpt, registry=ProviderRegistry.default(), **kwargs)


def _assert_global(loaded: dict, keys) -> None:
    for key in keys:
        assert loaded[key].dtype == GLOBAL[key].dtype and loaded[key].shape == GLOBAL[key].shape
        assert torch.equal(loaded[key], GLOBAL[key]), key


def _zeroed(state: dict) -> dict:
    """``state`` with every tensor's values -7 (what a restore must overwrite)."""
    out = dict(state)
    for key, value in state.items():
        if isinstance(value, TensorShard):
            out[key] = TensorShard(
                torch.full_like(value.local, -7.0),
                value.global_shape,
                value.global_offset,
                value.primary,
            )
        elif isinstance(value, torch.Tensor):
            out[key] = torch.full_like(value, -7.0)
    return out


def _assert_restored(live: dict, saved: dict) -> None:
    assert live.keys() == saved.keys()
    for key, value in saved.items():
        got = live[key].local if isinstance(value, TensorShard) else live[key]
        want = value.local if isinstance(value, TensorShard) else value
        assert got.dtype == want.dtype and torch.equal(got, want), key


# ---------------------------------------------------------------- what a writer commits reads


def test_every_layout_a_writer_commits_reads_back_bit_exactly(ck, capsys):
    root, ckpt = ck
    layouts = {
        e.key: [(s.global_offset, s.shape) for s in e.shards]
        for e in files.read_manifest(ckpt).entries.values()
    }
    assert layouts["grid"] == [
        ((0, 0), (2, 3)),
        ((0, 3), (2, 3)),
        ((2, 0), (2, 3)),
        ((2, 3), (2, 3)),
    ]
    assert layouts["pairs"] == [((0, 0), (2, 6)), ((2, 0), (2, 6))]  # the replicas unwritten
    bricks = [
        (e.shape, e.shards) for e in files.read_manifest(ckpt).entries.values() if e.key == "bricks"
    ][0]
    assert not _slabs(*bricks) and not _grid(*bricks)  # the general check's to judge
    assert layouts["rep"] == [((0,), (5,))] and len(layouts["empty"]) == WORLD
    with _checkpointer(root) as ckpt_:
        _assert_global(ckpt_.load(step=1, keys=list(GLOBAL)), GLOBAL)
    for rank in range(WORLD):
        live = _zeroed(_state(rank))
        with _reader(ckpt, rank=rank, world_size=WORLD) as reader:
            reader.restore_into(live)
        _assert_restored(live, _state(rank))
    assert cli_main(["verify", root]) == 0


def test_every_view_of_a_split_manifest_restores_bit_exactly(ck_split):
    root, ckpt = ck_split
    assert "parts" in _head(ckpt)
    whole = files.read_manifest(ckpt)
    for rank in range(WORLD):
        view = files.read_manifest(ckpt, view=lambda saved_world, r=rank: r)
        assert view.view == rank and set(view.entries.values()) <= set(whole.entries.values())
    results = in_thread_ranks(root, WORLD, lambda ck_, r: _restore_rank(ck_, r))
    for rank in range(WORLD):
        assert not isinstance(results[rank], BaseException), results[rank]
        _assert_restored(results[rank], _state_replicated_none(rank))


def _restore_rank(checkpointer, rank: int) -> dict:
    live = _zeroed(_state_replicated_none(rank))
    checkpointer.restore(live, step=1)
    return live


# ---------------------------------------------------------------- boxes that do not tile


def _forge(key: str, forgery: str):
    """A change to the JSON entry of tensor ``key`` (its shards): what ``forgery`` names."""

    def change(entry: dict) -> None:
        shards = entry["shards"]
        if forgery == "overlap":  # the last row's box grown over the row before (in the
            last = shards[-1]  # slack of its 64-byte slot: no region overlaps another)
            last["global_offset"][0] -= 1
            last["shape"][0] += 1
            last["nbytes"] *= 2
            last["checksums"] = [[last["nbytes"], 0]]
        elif forgery == "gap":  # the reproducer: the last row's box moved onto the row before
            shards[-1]["global_offset"] = [2, 0]
        elif forgery == "grid":  # a box of the grid moved left by one column
            shards[-1]["global_offset"] = [2, 2]
        else:  # "twice": the second pair's box written at the first one's place
            shards[1]["global_offset"] = [0, 0]

    return change


FORGERIES = [("rows", "overlap"), ("rows", "gap"), ("grid", "grid"), ("pairs", "twice")]


def _forge_manifest(ckpt: str, key: str, forgery: str) -> None:
    obj = manifest_json(ckpt)
    _forge(key, forgery)(next(e for e in obj["entries"] if e["key"] == key))
    write_sealed(ckpt, obj)


@pytest.mark.parametrize("key, forgery", FORGERIES)
def test_boxes_that_do_not_tile_are_refused_by_every_reader(ck, key, forgery, capsys):
    root, ckpt = ck
    _forge_manifest(ckpt, key, forgery)
    message = f"shards of tensor {key!r} do not tile its shape"
    with pytest.raises(CorruptCheckpointError, match=message) as caught:
        files.read_manifest(ckpt)
    assert "manifest.json: entries[" in str(caught.value) and " overlap" in str(caught.value)
    for opened in (lambda: _reader(ckpt), lambda: _reader(ckpt, rank=1, world_size=WORLD)):
        with pytest.raises(CorruptCheckpointError, match=message):
            opened()
    with _checkpointer(root) as checkpointer:
        assert checkpointer.latest() is None
        assert [d.name for d in checkpointer.damaged()] == [STEP]
        with pytest.raises(CorruptCheckpointError, match=message):
            checkpointer.load(step=1, keys=[key])
        live = {key: torch.full(tuple(GLOBAL[key].shape), -7.0)}
        with pytest.raises(CorruptCheckpointError, match=message):
            checkpointer.restore(live, step=1, keys=[key])
        assert torch.equal(live[key], torch.full(tuple(GLOBAL[key].shape), -7.0))
    capsys.readouterr()
    assert cli_main(["verify", root]) == 1
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("key, forgery", FORGERIES)
def test_boxes_that_do_not_tile_fail_every_view_that_holds_them(ck_split, key, forgery):
    """Each rank's tree refers to every sharded tensor: the whole parse, every rank's view and
    every rank's restore refuse the forged entry."""
    root, ckpt = ck_split
    head = _head(ckpt)
    for i, part in enumerate(head["parts"]):
        entries = json.loads(open(os.path.join(ckpt, part["name"]), "rb").read())["entries"]
        if any(e["key"] == key for e in entries):
            break
    else:
        raise AssertionError(f"no part holds {key!r}")

    def change(obj: dict) -> None:
        _forge(key, forgery)(next(e for e in obj["entries"] if e["key"] == key))

    _forge_part(ckpt, i, change)
    message = f"shards of tensor {key!r} do not tile its shape"
    with pytest.raises(CorruptCheckpointError, match=message):
        files.read_manifest(ckpt)
    for rank in range(WORLD):
        with pytest.raises(CorruptCheckpointError, match=message):
            files.read_manifest(ckpt, view=lambda saved_world, r=rank: r)
    results = in_thread_ranks(root, WORLD, lambda ck_, r: _restore_rank(ck_, r))
    assert all(
        type(found) is CorruptCheckpointError and message in str(found)
        for found in results.values()
    ), results


def _manifest(shape: tuple, boxes: list) -> Manifest:
    """One tensor of float32 ``shape`` whose shards are ``boxes`` [(origin, shape)], each its
    own region of file 0."""
    shards, offset = [], codec.HEADER_BYTES
    for origin, box in boxes:
        nbytes = 4 * _volume(box)
        shards.append(
            ShardRef(0, offset, nbytes, tuple(origin), tuple(box), ((nbytes, 0),) if nbytes else ())
        )
        offset += codec.align_up(max(nbytes, 1), codec.DATA_ALIGN)
    entry = TensorEntry("w", "float32", tuple(shape), tuple(shards), False, None)
    return Manifest(
        version=3,
        name="a",
        step=1,
        seq=1,
        created_unix=0.0,
        world_size=1,
        metadata={},
        files=(FileRef(codec.shard_file_name(0), 0, offset, 0),),
        entries={0: entry},
        ranks=(),
    )


def _volume(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _layouts(rng: random.Random):
    """Boxes inside a shape cut into a grid (one to three dimensions, some cut), then perhaps
    spoiled inside the shape: a box moved, shrunk, repeated or dropped."""
    for _ in range(3000):
        shape = [rng.randint(0, 5) for _ in range(rng.randint(1, 3))]
        cuts = [
            sorted({0, n, *(rng.randint(0, n) for _ in range(rng.randint(0, 2)))}) for n in shape
        ]
        boxes = [([], [])]
        for bounds in cuts:
            spans = list(zip(bounds, bounds[1:])) or [(0, 0)]
            boxes = [(o + [a], b + [z - a]) for o, b in boxes for a, z in spans]
        rng.shuffle(boxes)
        for _ in range(rng.choice([0, 0, 1, 2])):
            origin, box = rng.choice(boxes)
            d = rng.randrange(len(shape))
            what = rng.randrange(4)
            if what == 0 and origin[d] + box[d] < shape[d]:
                boxes.append((origin[:d] + [origin[d] + 1] + origin[d + 1 :], box))
                boxes.remove((origin, box))
            elif what == 1 and box[d]:
                boxes.append((origin, box[:d] + [box[d] - 1] + box[d + 1 :]))
                boxes.remove((origin, box))
            elif what == 2:
                boxes.append((origin, box))
            elif len(boxes) > 1:
                boxes.remove((origin, box))
        yield tuple(shape), boxes


def test_the_review_and_every_reader_judge_a_layout_by_the_same_rule():
    """Boxes inside a tensor, exact grids or spoiled: the writer's review finds no problem
    exactly where the format's check says they tile, and the readers' two parsers (the general
    one and the one-function one) accept exactly those; the fast paths (slabs, the cells of a
    grid) say "tiled" only where the general check finds no fault."""
    tiled = spoiled = 0
    fast = [0, 0]
    for shape, boxes in _layouts(random.Random(5)):
        manifest = _manifest(shape, boxes)
        entry = manifest.entries[0]
        ok = _tiled(entry.shape, entry.shards)
        assert (check_tiling(manifest) == []) == ok, (shape, boxes)
        assert ok == (_tiling_fault(entry.shape, entry.shards) is None), (shape, boxes)
        fast[0] += _slabs(entry.shape, entry.shards)  # the fast paths say "tiled" only where
        fast[1] += _grid(entry.shape, entry.shards)  # the general check finds no fault
        assert ok or not (_slabs(entry.shape, entry.shards) or _grid(entry.shape, entry.shards))
        value = entry.to_json()
        assert (plain.tensor_entry(value, manifest.files, 1) == entry) == ok, (shape, boxes)
        try:
            assert validate._entry(value, _At("m"), manifest.files, 1) == entry
        except CorruptCheckpointError:
            assert not ok, (shape, boxes)
        else:
            assert ok, (shape, boxes)
        tiled, spoiled = tiled + ok, spoiled + (not ok)
    assert tiled > 1000 and spoiled > 500 and fast[0] > 300 and fast[1] > 500, (tiled, fast)


# ---------------------------------------------------------------- nesting and metadata


def _save_one(root: str) -> None:
    with datastates.Checkpointer(root) as checkpointer:
        checkpointer.save({"w": torch.arange(3.0)}, step=1).wait(60)


@pytest.fixture
def one(pristine, private_copy):
    return _copy(pristine, private_copy, _save_one)


def _with_metadata(ckpt: str, text: bytes) -> None:
    """The sealed manifest of ``ckpt`` with ``text`` (JSON) as its metadata."""
    path = os.path.join(ckpt, codec.MANIFEST)
    body = open(path, "rb").read()[: -codec.TRAILER_BYTES] + b"}"
    assert body.count(b'"metadata":{}') == 1
    open(path, "wb").write(
        codec.seal_manifest(body.replace(b'"metadata":{}', b'"metadata":' + text))
    )


def _deep(levels: int) -> bytes:
    """Metadata nested ``levels`` levels: an object holding lists in lists."""
    return b'{"x":' + b"[" * (levels - 1) + b"]" * (levels - 1) + b"}"


def _deep_value(levels: int) -> dict:
    value: list = []
    for _ in range(levels - 2):
        value = [value]
    return {"x": value}


def _with_frames_left(frames: int, call):
    """``call()`` made from a stack ``frames`` frames short of the recursion limit."""
    depth, frame = 0, sys._getframe()
    while frame is not None:
        depth, frame = depth + 1, frame.f_back

    def down(n: int):
        return call() if n <= 0 else down(n - 1)

    return down(sys.getrecursionlimit() - depth - frames)


READS = {"whole": files.read_manifest, "listing": files.read_info}


@pytest.mark.parametrize("levels", [codec.MAX_JSON_DEPTH, 985, 5000])
def test_json_nested_past_the_bound_is_damage_whatever_the_callers_stack(one, levels):
    """The document nests ``levels`` + 1 deep, past the bound: damage from a shallow stack
    (where the decoder may reach the end, and the metadata's bound refuses it) and from deep
    ones (where the decoder gives up and the document's depth is counted)."""
    root, ckpt = one
    _with_metadata(ckpt, _deep(levels))
    assert codec.nesting_depth(open(os.path.join(ckpt, codec.MANIFEST), "rb").read()) == levels + 1
    for name, read in READS.items():
        for frames in (None, 400, 150, 60):
            with pytest.raises(CorruptCheckpointError, match="metadata|nests") as caught:
                if frames is None:
                    read(ckpt)
                else:
                    _with_frames_left(frames, lambda: read(ckpt))
            assert "manifest.json" in str(caught.value), (name, frames)
    with datastates.Checkpointer(root) as checkpointer:
        assert checkpointer.latest() is None
        assert [d.name for d in checkpointer.damaged()] == [STEP]


def test_metadata_at_its_bound_reads_back(one):
    root, ckpt = one
    _with_metadata(ckpt, _deep(MAX_METADATA_DEPTH))
    for read in READS.values():
        assert read(ckpt).metadata == _deep_value(MAX_METADATA_DEPTH)
    with datastates.Checkpointer(root) as checkpointer:
        assert checkpointer.latest().metadata == _deep_value(MAX_METADATA_DEPTH)


def test_metadata_one_level_past_its_bound_is_damage(one):
    root, ckpt = one
    _with_metadata(ckpt, _deep(MAX_METADATA_DEPTH + 1))
    for read in READS.values():
        with pytest.raises(
            CorruptCheckpointError,
            match=f"metadata: arrays and objects nested deeper than {MAX_METADATA_DEPTH} levels",
        ):
            read(ckpt)
    with datastates.Checkpointer(root) as checkpointer:
        assert [d.name for d in checkpointer.damaged()] == [STEP]


@pytest.mark.parametrize("levels", [MAX_METADATA_DEPTH, 700])
def test_a_caller_too_deep_to_decode_is_told_so_and_nothing_is_damaged(one, levels):
    """A document within the bound that the caller's stack cannot decode: RecursionError saying
    so, never CorruptCheckpointError; read from a shallow stack, the valid one reads back and
    the one whose metadata is too deep is damage."""
    root, ckpt = one
    _with_metadata(ckpt, _deep(levels))
    for read in READS.values():
        try:
            found = _with_frames_left(150, lambda: read(ckpt))
        except RecursionError as exc:
            assert not isinstance(exc, CorruptCheckpointError)
            assert "the caller's stack is too deep" in str(exc) and "no damage" in str(exc)
        else:  # an interpreter whose decoder does not share the stack of Python frames
            assert sys.version_info >= (3, 12), found
        if levels <= MAX_METADATA_DEPTH:
            assert read(ckpt).metadata == _deep_value(levels)
        else:
            with pytest.raises(CorruptCheckpointError, match="metadata"):
                read(ckpt)


@pytest.mark.parametrize(
    "text, where",
    [(b'{"lr":1e400}', "metadata.lr"), (b'{"a":[1,{"b":-1e400}]}', "metadata.a[1].b")],
)
def test_a_number_too_large_for_a_double_in_metadata_is_damage(one, text, where):
    root, ckpt = one
    _with_metadata(ckpt, text)
    for read in READS.values():
        with pytest.raises(
            CorruptCheckpointError,
            match=re.escape(where) + ": expected a finite number, found float -?inf",
        ):
            read(ckpt)
    with datastates.Checkpointer(root) as checkpointer:
        assert [d.name for d in checkpointer.damaged()] == [STEP]


def test_finite_metadata_reads_back(one):
    root, ckpt = one
    _with_metadata(ckpt, b'{"lr":1e300,"big":100000000000000000000000000000,"s":"[{"}')
    assert files.read_manifest(ckpt).metadata == {"lr": 1e300, "big": 10**29, "s": "[{"}


def test_save_refuses_metadata_a_reader_refuses(tmp_path):
    with datastates.Checkpointer(str(tmp_path)) as checkpointer:
        with pytest.raises(datastates.ConfigError, match="metadata nests deeper"):
            checkpointer.save(
                {"w": torch.ones(1)}, step=1, metadata=_deep_value(MAX_METADATA_DEPTH + 1)
            )
        with pytest.raises(ValueError, match="Out of range float"):
            checkpointer.save({"w": torch.ones(1)}, step=1, metadata={"lr": float("inf")})
        checkpointer.save(
            {"w": torch.ones(1)}, step=1, metadata=_deep_value(MAX_METADATA_DEPTH)
        ).wait(60)
        assert checkpointer.latest().metadata == _deep_value(MAX_METADATA_DEPTH)
        assert checkpointer.list() and not checkpointer.damaged()


def test_the_bound_holds_the_deepest_valid_manifest(tmp_path):
    """A state tree at its depth bound (dicts in dicts, the deepest JSON per level) nests its
    manifest 770 levels deep, within the bound, and reads back."""
    state: dict = {}
    for _ in range(MAX_TREE_DEPTH - 1):
        state = {"k": state}
    with datastates.Checkpointer(str(tmp_path)) as checkpointer:
        checkpointer.save(state, step=1).wait(60)
        assert checkpointer.load(step=1) == state
    raw = open(os.path.join(str(tmp_path), STEP, codec.MANIFEST), "rb").read()
    assert codec.nesting_depth(raw) == 3 * MAX_TREE_DEPTH + 2 <= codec.MAX_JSON_DEPTH


@pytest.mark.parametrize(
    "text, depth",
    [
        (b"{}", 1),
        (b"[]", 1),
        (b"1", 0),
        (b'{"a":[[1],{"b":[]}]}', 4),
        (b'{"a":"[[[{{{","b":"\\"[[","c":[["]]]"]]}', 3),
        (b'"[[["', 0),
        ('{"\u00e9[":[1]}'.encode("utf-16"), 2),
        (b"[[[", 3),
    ],
)
def test_nesting_depth_counts_the_brackets_outside_strings(text, depth):
    assert codec.nesting_depth(text) == depth


def test_the_bound_of_nesting_has_room_for_every_valid_document():
    # a tree level nests at most three JSON levels (node, items, [key, node]); rank 0's tree
    # sits three levels inside a manifest, and its deepest node may hold an empty list
    assert 3 * MAX_TREE_DEPTH + 2 < codec.MAX_JSON_DEPTH
    assert MAX_METADATA_DEPTH + 1 < codec.MAX_JSON_DEPTH

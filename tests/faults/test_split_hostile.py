"""Split manifests (format version 4) as input from someone else: every damage to the head or to
a part is ``CorruptCheckpointError`` (never another manifest), the table of parts is checked
before a part is read, a part is read with the size the head records as its bound, and a part
that is a link, a FIFO or a directory is refused without blocking.

The checkpoint is saved by four ranks in threads of this process (tests/thread_ranks.py), with ``SPLIT_BYTES`` lowered so that its manifest splits into several parts."""

from __future__ import annotations

import json
import os
import random

import pytest
import torch

import datastates
from datastates import TensorShard
from datastates.commit.catalog import Catalog
from datastates.format import codec, files

from test_hostile_files import KINDS, assert_refused, bounded, plant
from thread_ranks import in_thread_ranks

WORLD = 4
SPLIT = 600  # bytes: the manifest of the state below splits into a part per rank or two
STEP = codec.step_name(1)


def _state(rank: int) -> dict:
    return {
        "mine": [torch.full((rank + 2,), float(rank)) for _ in range(3)],
        "rank": rank,
        "rows": TensorShard(torch.full((1, 3), float(rank)), (WORLD, 3), (rank, 0)),
    }


def _sharded(rank: int) -> dict:
    """Every tensor sharded over the ranks (FSDP-like): each one entry, rank 0's tree first."""
    return {
        f"p{i}": TensorShard(torch.full((1, 4), float(i + rank)), (WORLD, 4), (rank, 0))
        for i in range(40)
    }


def _save(root: str, split: int, state=_state) -> None:
    saved = codec.SPLIT_BYTES
    codec.SPLIT_BYTES = split
    try:
        results = in_thread_ranks(root, WORLD, lambda ck, r: ck.save(state(r), step=1).wait(60))
    finally:
        codec.SPLIT_BYTES = saved
    errors = [(r, found) for r, found in results.items() if isinstance(found, BaseException)]
    assert not errors, errors


def _split(root: str) -> None:
    _save(root, SPLIT)


@pytest.fixture
def ckpt(pristine, private_copy):
    return os.path.join(private_copy(pristine(_split)[0]), STEP)


def _parts(ckpt: str) -> list[str]:
    return sorted(n for n in os.listdir(ckpt) if n.startswith("manifest-"))


def _head(ckpt: str) -> dict:
    with open(os.path.join(ckpt, codec.MANIFEST), "rb") as f:
        obj = json.loads(f.read())
    del obj["manifest_crc32"]
    return obj


def _write_head(ckpt: str, obj: dict) -> None:
    with open(os.path.join(ckpt, codec.MANIFEST), "wb") as f:
        f.write(codec.seal_manifest(codec.encode_json(obj)))


def test_the_checkpoint_splits_and_reads_back(ckpt):
    head = _head(ckpt)
    assert head["version"] == codec.SPLIT_VERSION and len(head["parts"]) >= 3
    assert _parts(ckpt) == [p["name"] for p in head["parts"]]
    manifest = files.read_manifest(ckpt)
    assert manifest.world_size == WORLD and [r.rank for r in manifest.ranks] == [0, 1, 2, 3]


def test_a_small_manifest_is_not_split(tmp_path):
    _save(str(tmp_path), codec.SPLIT_BYTES)
    ckpt = os.path.join(str(tmp_path), STEP)
    assert _parts(ckpt) == [] and "entries" in _head(ckpt)
    assert _head(ckpt)["version"] == codec.MANIFEST_VERSION


def test_sharded_entries_spread_over_the_parts(tmp_path):
    """Sharded tensors all come with rank 0's tree: they go on into the next parts once one is
    full, so no part holds much more than the threshold, and they read back as saved."""
    root = str(tmp_path)
    _save(root, 5000, _sharded)
    ckpt = os.path.join(root, STEP)
    head = _head(ckpt)
    sizes = [p["nbytes"] for p in head["parts"]]
    assert [p["rank_count"] for p in head["parts"]] == [1] * WORLD, head["parts"]
    assert all(p["entry_count"] for p in head["parts"]), head["parts"]
    # each part closed at the threshold; the last takes the rest, far from all of it
    assert max(sizes[:-1]) < 5000 and sizes[-1] < sum(sizes) / 2, sizes
    with datastates.Checkpointer(root, communicator=datastates.LocalCommunicator()) as ck:
        loaded = ck.load(keys=["p0", "p39"])
    assert torch.equal(
        loaded["p39"], torch.arange(WORLD, dtype=torch.float32)[:, None].expand(WORLD, 4) + 39
    )


def test_export_leaves_the_parts_out_of_a_model_folder(ckpt, tmp_path):
    """``export --to hf`` copies a checkpoint's config files, never the format's own files."""
    from datastates.tools.export import _copy_model_files

    with open(os.path.join(ckpt, "config.json"), "w") as f:
        f.write('{"model_type": "gpt2"}')
    dest = tmp_path / "hf"
    dest.mkdir()
    _copy_model_files(ckpt, str(dest))
    assert _parts(ckpt) and os.listdir(dest) == ["config.json"]


def test_every_flipped_byte_of_every_part_is_refused(ckpt):
    """A part's bytes are tied to the head by their CRC-32: a flipped bit anywhere is damage."""
    rng = random.Random(5)
    for name in _parts(ckpt):
        path = os.path.join(ckpt, name)
        with open(path, "rb") as f:
            good = f.read()
        for pos in sorted(rng.sample(range(len(good)), min(40, len(good)))):
            bad = bytearray(good)
            bad[pos] ^= 1 << rng.randrange(8)
            with open(path, "wb") as f:
                f.write(bad)
            with pytest.raises(datastates.CorruptCheckpointError, match="CRC-32"):
                files.read_manifest(ckpt)
        with open(path, "wb") as f:
            f.write(good)
    files.read_manifest(ckpt)


@pytest.mark.slow
def test_every_flipped_byte_of_the_head_is_refused(ckpt):
    path = os.path.join(ckpt, codec.MANIFEST)
    with open(path, "rb") as f:
        good = f.read()
    for pos in range(len(good)):
        bad = bytearray(good)
        bad[pos] ^= 0x04
        with open(path, "wb") as f:
            f.write(bad)
        with pytest.raises(datastates.CorruptCheckpointError):
            files.read_manifest(ckpt)


class _Counting:
    """A part reader that counts what it is asked to read."""

    def __init__(self, ckpt: str):
        self.read, self.calls = files.part_reader(ckpt, datastates.storage.open_store(ckpt)), []

    def __call__(self, name: str, nbytes: int) -> bytes:
        self.calls.append(name)
        return self.read(name, nbytes)


FORGED_TABLES = {
    "no parts": lambda h: h.update(parts=[]),
    "parts not a list": lambda h: h.update(parts={"0": h["parts"][0]}),
    "a wrong name": lambda h: h["parts"][1].update(name="manifest-00007.json"),
    "a name outside": lambda h: h["parts"][0].update(name="../manifest-00000.json"),
    "a field too many": lambda h: h["parts"][0].update(extra=1),
    "a field missing": lambda h: h["parts"][0].pop("crc32"),
    "a rank gap": lambda h: h["parts"][1].update(first_rank=h["parts"][1]["first_rank"] + 1),
    "ranks short of the world": lambda h: (
        h["parts"][-1].update(rank_count=h["parts"][-1]["rank_count"] - 1)
        if h["parts"][-1]["rank_count"] > 1
        else h["parts"].pop()
    ),
    "an entry gap": lambda h: h["parts"][1].update(first_entry=h["parts"][1]["first_entry"] + 1),
    "a part over the format's limit": lambda h: h["parts"][0].update(
        nbytes=codec.MAX_MANIFEST_BYTES + 1
    ),
    "a boolean size": lambda h: h["parts"][0].update(nbytes=True),
    "a negative crc": lambda h: h["parts"][0].update(crc32=-1),
    "entries beside the parts": lambda h: h.update(entries=[]),
    "version 3 with parts": lambda h: h.update(version=3),
    "more parts than ranks": lambda h: h["parts"].extend(h["parts"][:1] * WORLD),
}


@pytest.mark.parametrize("forgery", list(FORGED_TABLES))
def test_a_forged_table_of_parts_is_refused_before_a_part_is_read(ckpt, forgery):
    head = _head(ckpt)
    FORGED_TABLES[forgery](head)
    _write_head(ckpt, head)
    raw = open(os.path.join(ckpt, codec.MANIFEST), "rb").read()
    reader = _Counting(ckpt)
    with pytest.raises(datastates.CorruptCheckpointError):
        files.parse_manifest_bytes(raw, "manifest.json", reader)
    assert reader.calls == []
    try:  # a listing's check of the head: refused, or left to the whole parse
        assert files.parse_manifest_summary(raw, "manifest.json", ckpt) is None
    except datastates.CorruptCheckpointError:
        pass


def test_parts_over_the_total_limit_are_refused_before_a_part_is_read(ckpt, monkeypatch):
    sizes = [p["nbytes"] for p in _head(ckpt)["parts"]]
    monkeypatch.setattr(codec, "MAX_SPLIT_BYTES", sum(sizes) - 1)
    raw = open(os.path.join(ckpt, codec.MANIFEST), "rb").read()
    reader = _Counting(ckpt)
    with pytest.raises(datastates.CorruptCheckpointError, match="parts hold more than"):
        files.parse_manifest_bytes(raw, "manifest.json", reader)
    assert reader.calls == []


def test_a_version_4_manifest_without_parts_is_refused(ckpt):
    whole = files.manifest_record_bytes(files.read_manifest(ckpt))[0]
    obj = json.loads(whole)
    del obj["manifest_crc32"]
    obj["version"] = codec.SPLIT_VERSION
    _write_head(ckpt, obj)
    with pytest.raises(datastates.CorruptCheckpointError):
        files.read_manifest(ckpt)


def _rewrite_part(ckpt: str, index: int, change) -> None:
    """Change part ``index``'s JSON and record its new size and CRC in a resealed head: a
    forgery the checksums cannot see, left to the validation."""
    head = _head(ckpt)
    ref = head["parts"][index]
    path = os.path.join(ckpt, ref["name"])
    obj = json.loads(open(path, "rb").read())
    change(obj)
    data = codec.encode_json(obj)
    with open(path, "wb") as f:
        f.write(data)
    ref.update(nbytes=len(data), crc32=codec.crc32(data))
    _write_head(ckpt, head)


FORGED_PARTS = {
    "another format": lambda p: p.update(format="datastates-checkpoint"),
    "version 3": lambda p: p.update(version=3),
    "a field too many": lambda p: p.update(extra=[]),
    "an entry too many": lambda p: p["entries"].append(p["entries"][0]),
    "a tree too few": lambda p: p["ranks"].pop(),
    "a tree of another rank": lambda p: p["ranks"][0].update(rank=p["ranks"][0]["rank"] + 1),
    "an entry in no file": lambda p: (
        p["entries"][0].update(file=WORLD)
        if "file" in p["entries"][0]
        else p["entries"][0]["shards"][0].update(file=WORLD)
    ),
    "a tree naming an entry of no part": lambda p: p["ranks"][0].update(
        tree={"t": "tensor", "e": 10**6}
    ),
}


@pytest.mark.parametrize("forgery", list(FORGED_PARTS))
def test_a_forged_part_with_matching_checksums_is_refused(ckpt, forgery):
    _rewrite_part(ckpt, 1, FORGED_PARTS[forgery])
    with pytest.raises(datastates.CorruptCheckpointError):
        files.read_manifest(ckpt)


def test_a_longer_part_is_refused_before_it_is_read_whole(ckpt):
    """The head's size bounds the read: a part grown to the format's limit is refused from
    its size alone (a sparse file: no byte of it is read)."""
    name = _parts(ckpt)[0]
    with open(os.path.join(ckpt, name), "r+b") as f:
        f.truncate(codec.MAX_MANIFEST_BYTES)
    box = bounded(files.read_manifest, ckpt)
    assert_refused(box, name)


@pytest.mark.parametrize("kind", [*KINDS, "directory", "missing"])
def test_a_special_or_missing_part_is_refused_by_every_reader(ckpt, tmp_path, kind):
    path = os.path.join(ckpt, _parts(ckpt)[1])
    assert _head(ckpt)["parts"][1]["first_rank"] == 1
    if kind == "directory":
        os.remove(path)
        os.mkdir(path)
    elif kind == "missing":
        os.remove(path)
    else:
        plant(path, kind, tmp_path)
    fifos = [path] if kind == "fifo" else []
    assert_refused(bounded(files.read_manifest, ckpt, fifos=fifos), path)
    # rank 1's view reads this part (it holds rank 1's tree): refused as well
    assert_refused(bounded(files.read_manifest, ckpt, view=lambda saved: 1, fifos=fifos), path)
    root = os.path.dirname(ckpt)
    with datastates.Checkpointer(root, communicator=datastates.LocalCommunicator()) as ck:
        assert bounded(ck.list, fifos=fifos)["value"] == []  # the newest, read whole: damaged
        (damaged,) = ck.damaged()
        assert path in damaged.reason
    job = Catalog(root, world_size=WORLD)  # the listing of a job of 4: checks every part
    assert bounded(job.scan, fifos=fifos)["value"] == []
    assert path in job.damaged()[0].reason


def test_the_writer_refuses_parts_a_reader_would_refuse(pristine, monkeypatch):
    root, _ = pristine(_split)
    manifest = files.read_manifest(os.path.join(root, STEP))
    monkeypatch.setattr(codec, "SPLIT_BYTES", SPLIT)
    encoded = files.encode_manifest_record(manifest)
    assert len(encoded.parts) >= 3
    monkeypatch.setattr(codec, "MAX_SPLIT_BYTES", sum(len(d) for _, d in encoded.parts) - 1)
    with pytest.raises(datastates.CorruptCheckpointError, match="parts hold more than"):
        files.encode_manifest_record(manifest)
    monkeypatch.setattr(codec, "MAX_SPLIT_BYTES", 1 << 30)
    monkeypatch.setattr(files, "MAX_MANIFEST_BYTES", max(len(d) for _, d in encoded.parts) - 1)
    with pytest.raises(datastates.CorruptCheckpointError, match="a reader accepts"):
        files.encode_manifest_record(manifest)

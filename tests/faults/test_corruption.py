"""Damaged checkpoints: every kind of damage is detected and reported with the exact error type,
naming what is damaged (key, file); damage to one checkpoint never hides the others."""

from __future__ import annotations

import json
import os
import shutil
import struct
import zlib

import pytest
import torch

import datastates
from datastates import CheckpointNotFoundError, CorruptCheckpointError, UnsupportedFormatError

from _faults_helpers import assert_bit_exact, shard_path, tensors_of, zeros_like_state
from testkit import SMALL

STEP1, STEP2 = "step-0000000001", "step-0000000002"


def make_state(seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "weights": {
            "w": torch.randn(64, 1000, generator=g),
            "b": torch.randn(33, generator=g).to(torch.bfloat16),
        },
        "counts": torch.randint(0, 99, (3000,), generator=g),
        "meta": {("tuple", "key"): f"object {seed}"},
    }


def _two_steps(root) -> None:
    with datastates.Checkpointer(root, SMALL) as ck:
        ck.save(make_state(1), step=1).wait(60)
        ck.save(make_state(2), step=2).wait(60)


@pytest.fixture
def root(pristine, private_copy):
    """A private copy of two committed checkpoints (step 1 and step 2) to damage."""
    return private_copy(pristine(_two_steps)[0])


def step2(root) -> str:
    return os.path.join(root, STEP2)


def manifest_of(root) -> dict:
    """The JSON of step 2's manifest, without its checksum field."""
    with open(os.path.join(step2(root), "manifest.json")) as f:
        manifest = json.load(f)
    del manifest["manifest_crc32"]
    return manifest


def write_manifest(root, manifest: dict, seal: bool = True) -> None:
    """Replace step 2's manifest; ``seal`` appends a valid checksum, so that what is tested is the
    validation of the fields, not the checksum."""
    raw = json.dumps(manifest, separators=(",", ":")).encode()
    with open(os.path.join(step2(root), "manifest.json"), "wb") as f:
        f.write(datastates.format.codec.seal_manifest(raw) if seal else raw)


def entry(manifest: dict, key: str) -> dict:
    return next(e for e in manifest["entries"] if e["key"] == key)


def patch_bytes(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def flip_byte(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        (b,) = f.read(1)
        f.seek(offset)
        f.write(bytes([b ^ 0xFF]))


def set_header(path: str, fmt: str, offset: int, value, fix_crc: bool) -> None:
    """Set a header field (``offset`` from the header's start); with ``fix_crc`` recompute the
    header CRC (of bytes 0-35 at 36; of a version-3 file, whose header starts at 64 after a ZIP
    local header, of its 60 bytes at 60)."""
    with open(path, "r+b") as f:
        v3 = f.read(4) == b"PK\x03\x04"
        at, used = (64, 60) if v3 else (0, 36)
        f.seek(at)
        head = bytearray(f.read(used + 4))
        struct.pack_into(fmt, head, offset, value)
        if fix_crc:
            struct.pack_into("<I", head, used, zlib.crc32(bytes(head[:used])) & 0xFFFFFFFF)
        f.seek(at)
        f.write(head)


def load_step2(root, **kwargs):
    with datastates.Checkpointer(root, SMALL) as ck:
        return ck.load(step=2, **kwargs)


def restore_step2(root, **kwargs):
    live = zeros_like_state(make_state(2))
    with datastates.Checkpointer(root, SMALL) as ck:
        ck.restore(live, step=2, **kwargs)
    return live


def assert_others_intact(root) -> None:
    """Step 1 still loads bit-exactly next to the damaged step 2."""
    with datastates.Checkpointer(root, SMALL) as ck:
        assert_bit_exact(ck.load(step=1, trusted=True), make_state(1), STEP1)


def test_pristine_copy_round_trips(root):
    assert_bit_exact(load_step2(root, trusted=True), make_state(2), STEP2)


# ---------------------------------------------------------------- tensor and object bytes


@pytest.mark.parametrize(
    "key,where", [("weights/w", 0), ("weights/w", -1), ("counts", 0.5), ("weights/b", 0.5)]
)
def test_flipped_tensor_byte_is_detected(root, key, where):
    m = manifest_of(root)
    shard = entry(m, key)["shards"][0]
    pos = shard["offset"] + (int(shard["nbytes"] * where) if where != -1 else shard["nbytes"] - 1)
    path = os.path.join(step2(root), m["files"][shard["file"]]["name"])
    flip_byte(path, pos)

    for action in (load_step2, restore_step2):
        with pytest.raises(CorruptCheckpointError) as info:
            action(root)
        assert info.type is CorruptCheckpointError
        assert repr(key) in str(info.value) and path in str(info.value)
        assert "checksum" in str(info.value)

    # verify=False reads it anyway: exactly the flipped byte differs, everything else is intact.
    loaded = load_step2(root, verify=False, trusted=True)
    expected = make_state(2)
    got, want = tensors_of(loaded)[key], tensors_of(expected)[key]
    diff = (got.reshape(-1).view(torch.uint8) != want.reshape(-1).view(torch.uint8)).nonzero()
    assert diff.reshape(-1).tolist() == [pos - shard["offset"]]
    for other, tensor in tensors_of(expected).items():
        if other != key:
            assert_bit_exact(tensors_of(loaded)[other], tensor, other)
    assert_others_intact(root)


def test_flipped_object_byte_is_detected(root):
    m = manifest_of(root)
    e = entry(m, "meta")
    path = os.path.join(step2(root), m["files"][e["file"]]["name"])
    flip_byte(path, e["offset"] + e["nbytes"] // 2)
    with pytest.raises(CorruptCheckpointError) as info:
        load_step2(root, trusted=True)
    assert info.type is CorruptCheckpointError
    assert "'meta'" in str(info.value) and path in str(info.value)
    assert_others_intact(root)


# ---------------------------------------------------------------- the shard file


@pytest.mark.parametrize("size", ["half", "index", "header-only", "10-bytes", "empty"])
def test_truncated_shard_is_detected(root, size):
    path = shard_path(step2(root))
    m = manifest_of(root)
    cut = {
        "half": os.path.getsize(path) // 2,
        "index": os.path.getsize(path) - 1,
        "header-only": 4096,
        "10-bytes": 10,
        "empty": 0,
    }[size]
    os.truncate(path, cut)
    with pytest.raises(CorruptCheckpointError) as info:
        load_step2(root, trusted=True)
    assert info.type is CorruptCheckpointError
    assert path in str(info.value)
    assert m["files"][0]["nbytes"] > cut
    assert_others_intact(root)


def test_zeroed_tensor_data_is_detected(root):
    """A hole of zeros under a tensor (what a lost write leaves) with header and index intact."""
    m = manifest_of(root)
    shard = entry(m, "weights/w")["shards"][0]
    path = shard_path(step2(root))
    patch_bytes(path, shard["offset"], bytes(shard["nbytes"]))
    with pytest.raises(CorruptCheckpointError, match="weights/w"):
        load_step2(root, trusted=True)


def test_wrong_magic(root):
    path = shard_path(step2(root))
    patch_bytes(path, 0, b"NOTADSF\x01")
    with pytest.raises(CorruptCheckpointError, match="magic") as info:
        load_step2(root, trusted=True)
    assert info.type is CorruptCheckpointError and path in str(info.value)


def test_header_version_99_is_unsupported(root):
    path = shard_path(step2(root))
    set_header(path, "<I", 8, 99, fix_crc=True)
    with pytest.raises(UnsupportedFormatError, match="99") as info:
        load_step2(root, trusted=True)
    assert path in str(info.value)
    assert isinstance(info.value, CorruptCheckpointError)  # documented subclass
    assert_others_intact(root)


def test_header_change_without_crc_is_corrupt(root):
    path = shard_path(step2(root))
    set_header(path, "<I", 8, 99, fix_crc=False)
    with pytest.raises(CorruptCheckpointError, match="header checksum") as info:
        load_step2(root, trusted=True)
    assert info.type is CorruptCheckpointError


def test_index_beyond_end_of_file(root):
    path = shard_path(step2(root))
    set_header(path, "<Q", 16, os.path.getsize(path) + 4096, fix_crc=True)
    with pytest.raises(CorruptCheckpointError, match="outside") as info:
        load_step2(root, trusted=True)
    assert info.type is CorruptCheckpointError


def test_shard_file_replaced_by_another_checkpoints(root):
    """A shard file from another checkpoint (valid on its own) is caught by the index CRC the
    manifest records."""
    shutil.copyfile(shard_path(os.path.join(root, STEP1)), shard_path(step2(root)))
    with pytest.raises(CorruptCheckpointError, match="manifest") as info:
        load_step2(root, trusted=True)
    assert info.type is CorruptCheckpointError


# ---------------------------------------------------------------- the manifest


def test_manifest_version_99_is_unsupported(root):
    m = manifest_of(root)
    m["version"] = 99
    write_manifest(root, m)
    for action in (load_step2, restore_step2):
        with pytest.raises(UnsupportedFormatError, match="99"):
            action(root)
    assert_others_intact(root)


@pytest.mark.parametrize("seal", [True, False])
def test_manifest_edited_without_its_checksum_is_corrupt(root, seal):
    """Any change to the bytes of a sealed manifest fails its checksum; an unsealed version-2
    manifest is refused (it would otherwise be read unchecked)."""
    with open(os.path.join(step2(root), "manifest.json"), "rb") as f:
        raw = f.read()
    if seal:
        at = raw.index(b'"step":2')
        raw = raw[:at] + b'"step":3' + raw[at + 8 :]
        with open(os.path.join(step2(root), "manifest.json"), "wb") as f:
            f.write(raw)
    else:
        write_manifest(root, manifest_of(root), seal=False)
    for action in (load_step2, restore_step2):
        with pytest.raises(CorruptCheckpointError, match="checksum") as info:
            action(root)
        assert info.type is CorruptCheckpointError
    with datastates.Checkpointer(root, SMALL) as ck:
        assert [i.name for i in ck.list()] == [STEP1]
    assert_others_intact(root)


def test_manifest_unknown_fields_are_ignored(root):
    m = manifest_of(root)
    m["future_field"] = {"x": 1}
    m["entries"][0]["future_field"] = [1, 2]
    write_manifest(root, m)
    assert_bit_exact(load_step2(root, trusted=True), make_state(2), STEP2)


def test_missing_shard_file(root):
    os.remove(shard_path(step2(root)))
    missing = shard_path(step2(root))
    with pytest.raises(CheckpointNotFoundError) as info:
        load_step2(root, trusted=True)
    assert missing in str(info.value)
    assert isinstance(info.value, FileNotFoundError)
    assert_others_intact(root)


@pytest.mark.parametrize(
    "name", ["rank-00042.dsf", "../step-0000000001/rank-00000.dsf", "/etc/passwd", "rank-0.dsf", ""]
)
def test_manifest_file_name_must_be_the_ranks(root, name):
    m = manifest_of(root)
    m["files"][0]["name"] = name
    write_manifest(root, m)
    with pytest.raises(CorruptCheckpointError, match="file name") as info:
        load_step2(root, trusted=True)
    assert info.type is CorruptCheckpointError
    assert_others_intact(root)


def test_manifest_entry_past_the_data(root):
    m = manifest_of(root)
    shard = entry(m, "counts")["shards"][0]
    shard["offset"] = m["files"][0]["nbytes"] + 4096
    write_manifest(root, m)
    with pytest.raises(CorruptCheckpointError, match="offset") as info:
        load_step2(root, trusted=True)
    assert info.type is CorruptCheckpointError


def test_manifest_shape_inconsistent_with_bytes(root):
    m = manifest_of(root)
    e = entry(m, "counts")
    e["shape"] = [3001]
    e["shards"][0]["shape"] = [3001]
    write_manifest(root, m)
    with pytest.raises(CorruptCheckpointError, match="shape"):
        load_step2(root, trusted=True)


@pytest.mark.parametrize(
    "garbage",
    [
        b"{not json",
        b"",
        b"\xff\xfe\x00",
        b"[1, 2]",
        b'{"format": "something-else", "version": 1}',
        b'{"format": "datastates-checkpoint", "version": 1}',
    ],
)
def test_garbage_manifest_is_not_a_checkpoint(root, garbage):
    with open(os.path.join(step2(root), "manifest.json"), "wb") as f:
        f.write(garbage)
    with datastates.Checkpointer(root, SMALL) as ck:
        assert [i.name for i in ck.list()] == [STEP1]
        # latest names step 2, which is no checkpoint any more: fall back to step 1.
        with open(os.path.join(root, "latest")) as f:
            assert f.read() == STEP2
        assert ck.latest().name == STEP1
        assert_bit_exact(ck.load(trusted=True), make_state(1), STEP1)
        with pytest.raises(CorruptCheckpointError) as info:
            ck.load(step=2)
        assert info.type is CorruptCheckpointError


@pytest.mark.parametrize(
    "content",
    [
        b"step-0000000099",
        b"",
        b"../elsewhere",
        b".tmp.x",
        b"\xff\xfe",
        b"latest",
        b"step-0000000001\n",
    ],
)
def test_latest_file_is_only_a_hint(root, content):
    """Whatever the ``latest`` file says, the newest committed checkpoint is the latest."""
    with open(os.path.join(root, "latest"), "wb") as f:
        f.write(content)
    with datastates.Checkpointer(root, SMALL) as ck:
        assert ck.latest().name == STEP2
        live = zeros_like_state(make_state(2))
        assert ck.restore(live).name == STEP2
        want = make_state(2)
        for key, tensor in tensors_of(want).items():
            assert_bit_exact(tensors_of(live)[key], tensor, key)


def test_latest_missing_falls_back(root):
    os.remove(os.path.join(root, "latest"))
    with datastates.Checkpointer(root, SMALL) as ck:
        assert ck.latest().name == STEP2
        assert_bit_exact(ck.load(trusted=True), make_state(2), STEP2)


def test_a_directory_without_manifest_is_ignored(root):
    """A checkpoint-looking directory (say, copied half-way by hand) without manifest.json."""
    os.makedirs(os.path.join(root, "step-0000000003"))
    shutil.copyfile(shard_path(step2(root)), shard_path(os.path.join(root, "step-0000000003")))
    with datastates.Checkpointer(root, SMALL) as ck:
        assert [i.name for i in ck.list()] == [STEP1, STEP2]
        with pytest.raises(CheckpointNotFoundError, match="step-0000000003"):
            ck.load(step=3)

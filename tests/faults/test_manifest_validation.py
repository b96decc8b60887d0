"""The manifest is verified, validated, and only then trusted (docs/format.md, "The manifest
checksum" and "What a reader validates"): each damage or forgery found by hand gives a typed
error from load, restore and verify, and verify re-reads every byte it claims to."""

from __future__ import annotations

import json
import os
import re

import pytest

import datastates
from datastates import CorruptCheckpointError
from datastates.commit import catalog
from datastates.tools.cli import main as cli_main

from _integrity_helpers import (
    NAME,
    STEP,
    assert_same_view,
    bounded_memory,
    index_of,
    load,
    manifest_json,
    manifest_path,
    read_bytes,
    restore,
    save_pristine,
    shard_file,
    verify,
    with_index,
    write_bytes,
    write_sealed,
)

PREVIOUS = "step-0000000006"


@pytest.fixture
def saved(pristine):
    """The view of the state saved at step 7."""
    return pristine(save_pristine)[1][0]


@pytest.fixture
def ckpt(pristine, private_copy):
    """A private copy of the pristine directory; returns the path of step 7."""
    return os.path.join(private_copy(pristine(save_pristine)[0]), NAME)


def assert_all_refuse(ckpt_dir: str, match: str | None = None) -> None:
    """load, restore and verify raise exactly CorruptCheckpointError; nothing big is allocated;
    the directory lists and resumes from the previous checkpoint."""
    with bounded_memory():
        for action in (load, restore, verify):
            with pytest.raises(CorruptCheckpointError, match=match) as info:
                action(ckpt_dir)
            assert info.type is CorruptCheckpointError, info.value
    root = os.path.dirname(ckpt_dir)
    assert [i.name for i in catalog.list_checkpoints(root)] == [PREVIOUS]
    assert catalog.latest(root).name == PREVIOUS
    assert cli_main(["verify", root, "--step", str(STEP)]) == 1


def test_pristine_copy_loads_restores_and_verifies(saved, ckpt, capsys):
    assert_same_view(restore(ckpt), saved)
    size = os.path.getsize(shard_file(ckpt))
    assert verify(ckpt) == size  # every byte of the file
    assert cli_main(["verify", os.path.dirname(ckpt)]) == 0
    assert f"{size} bytes verified" in capsys.readouterr().out


# ---------------------------------------------------------------- damage: the checksum


def flip(ckpt_dir: str, pattern: bytes, bit: int = 0) -> None:
    """Flip one bit of the last byte of the single match of ``pattern`` in the manifest."""
    raw = bytearray(read_bytes(manifest_path(ckpt_dir)))
    found = [m.end() - 1 for m in re.finditer(re.escape(pattern), raw)]
    assert len(found) == 1, (pattern, len(found))
    raw[found[0]] ^= 1 << bit
    write_bytes(manifest_path(ckpt_dir), bytes(raw))


def tree_node_of(ckpt_dir: str, key_suffix: str) -> bytes:
    """The bytes of the tree node referring to the entry whose key ends with ``key_suffix``."""
    m = manifest_json(ckpt_dir)
    index = next(i for i, e in enumerate(m["entries"]) if e["key"].endswith(key_suffix))
    return b'"e":%d,' % index  # "e" is a field of tree nodes only; "param" follows it


@pytest.mark.parametrize("key", ["optim/state/0/exp_avg_sq", "model/0.weight", "model/2.bias"])
def test_one_bit_flip_of_a_tree_index(ckpt, key):
    flip(ckpt, tree_node_of(ckpt, key)[:-1])
    assert_all_refuse(ckpt, "checksum")


@pytest.mark.parametrize(
    "pattern", [b'["epoch",{"t":"value","v":3', b'["lr",{"t":"value","v":0.0025', b'"step":7']
)
def test_one_digit_flip_of_a_value(ckpt, pattern):
    flip(ckpt, pattern)
    assert_all_refuse(ckpt, "checksum")


def test_lr_of_the_optimizer_is_covered(ckpt):
    raw = read_bytes(manifest_path(ckpt))
    at = raw.index(b'"v":0.001', raw.index(b'"param_groups"'))
    write_bytes(manifest_path(ckpt), raw[:at] + b'"v":0.002' + raw[at + 9 :])
    assert_all_refuse(ckpt, "checksum")


def test_damaged_trailer(ckpt):
    raw = bytearray(read_bytes(manifest_path(ckpt)))
    raw[-5] = ord("z")  # a hex digit that is not one: the file is still valid JSON
    write_bytes(manifest_path(ckpt), bytes(raw))
    assert_all_refuse(ckpt, "checksum")


# ---------------------------------------------------------------- forged fields: the validation


def entry(m: dict, suffix: str) -> dict:
    return next(e for e in m["entries"] if e["key"].endswith(suffix))


def forge(ckpt_dir: str, change) -> None:
    m = manifest_json(ckpt_dir)
    change(m)
    write_sealed(ckpt_dir, m)


def test_object_of_20_gb_is_refused_before_any_allocation(ckpt):
    forge(ckpt, lambda m: entry(m, "extra/obj").update(nbytes=20_000_000_000))
    assert_all_refuse(ckpt, "nbytes")


def test_negative_offset(ckpt):
    forge(ckpt, lambda m: entry(m, "model/0.weight")["shards"][0].update(offset=-4096))
    assert_all_refuse(ckpt, "offset")


@pytest.mark.parametrize("shape", [[1e15], [10**15], [-1, 64], [2**64], [True], ["5"], [1] * 65])
def test_impossible_shapes(ckpt, shape):
    def change(m):
        e = entry(m, "extra/b")
        e["shape"] = e["shards"][0]["shape"] = shape
        e["shards"][0]["global_offset"] = [0] * len(shape)

    forge(ckpt, change)
    assert_all_refuse(ckpt, "shape|dimensions|integer")


def test_global_shape_larger_than_stored_bytes(ckpt):
    forge(ckpt, lambda m: entry(m, "extra/b").update(shape=[10**12]))
    assert_all_refuse(ckpt, "exceeds|larger")


def test_swapped_tree_indices_of_equal_shapes(ckpt):
    """exp_avg <-> exp_avg_sq under a valid checksum: each entry must be referenced at its key."""
    raw = read_bytes(manifest_path(ckpt))[: -len(b',"manifest_crc32":"00000000"}')] + b"}"
    a = tree_node_of(ckpt, "state/0/exp_avg")
    b = tree_node_of(ckpt, "state/0/exp_avg_sq")
    raw = raw.replace(a, b"\0").replace(b, a).replace(b"\0", b)
    write_sealed(ckpt, raw)
    assert_all_refuse(ckpt, "referenced")


@pytest.mark.parametrize(
    "change,match",
    [
        (lambda m: m["ranks"][0]["tree"]["items"][0][1].update(t="mystery"), "node type"),
        (lambda m: m["ranks"][0].update(tree={"t": "tensor", "e": 999}), "integer in"),
        (
            lambda m: m["entries"][0].update(kind="object", file=0, offset=4096, nbytes=0, crc32=0),
            "refers to entry|crc|overlap",
        ),
        (lambda m: m.update(step=-1), "step"),
        (lambda m: m.update(step=True), "step"),
        (lambda m: m.update(seq=0), "seq"),
        (lambda m: m.update(world_size=2), "one file per rank"),
        (lambda m: m.update(metadata=[1]), "metadata"),
        (lambda m: m["files"][0].update(name="../rank-00000.dsf"), "file name"),
        (lambda m: entry(m, "model/0.weight")["shards"][0]["checksums"].append([4, 0]), "cover"),
        (
            lambda m: entry(m, "model/0.weight")["shards"][0].update(
                offset=entry(m, "model/0.bias")["shards"][0]["offset"]
            ),
            "overlap",
        ),
        (lambda m: entry(m, "model/0.weight").update(dtype="float128"), "dtype"),
        (lambda m: m["entries"].clear(), "integer in|entries|none"),
    ],
)
def test_forged_fields(ckpt, change, match):
    forge(ckpt, change)
    assert_all_refuse(ckpt, match)


def test_deep_nesting_and_nan(ckpt):
    pristine = manifest_json(ckpt)
    sealed_body = json.dumps(pristine, separators=(",", ":")).encode()
    m = json.loads(sealed_body)
    m["ranks"][0]["tree"] = json.loads(
        b'{"t":"list","items":[' * 300 + b'{"t":"value","v":1}' + b"]}" * 300
    )
    write_sealed(ckpt, m)
    assert_all_refuse(ckpt, "deeper")
    deep = b'{"t":"list","items":[' * 5000 + b"]}" * 5000
    write_sealed(ckpt, sealed_body[:-1] + b',"deep":' + deep + b"}")
    assert_all_refuse(ckpt, "JSON")  # deeper than the JSON decoder's recursion limit
    write_sealed(ckpt, sealed_body.replace(b'"v":3', b'"v":NaN', 1))
    assert_all_refuse(ckpt, "JSON")
    write_sealed(ckpt, sealed_body.replace(b'"v":3', b'"v":1e400', 1))
    assert_all_refuse(ckpt, "finite")


def test_shard_file_size_differs_from_the_manifest(ckpt):
    """Found when the checkpoint is opened, before anything is allocated from its sizes (listing
    reads manifests only, so the checkpoint is still listed)."""
    forge(ckpt, lambda m: m["files"][0].update(nbytes=m["files"][0]["nbytes"] + 4096))
    with bounded_memory():
        for action in (load, restore, verify):
            with pytest.raises(CorruptCheckpointError, match="the manifest records") as info:
                action(ckpt)
            assert info.type is CorruptCheckpointError


# ---------------------------------------------------------------- verify re-reads every byte


def patch(path: str, offset: int, data: bytes) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_verify_finds_a_nonzero_padding_byte(saved, ckpt):
    """A byte between regions is no data: load does not need it, verify reports it."""
    m = manifest_json(ckpt)
    ends = sorted(
        s["offset"] + s["nbytes"]
        for e in m["entries"]
        if e["kind"] == "tensor"
        for s in e["shards"]
    )
    starts = {s["offset"] for e in m["entries"] if e["kind"] == "tensor" for s in e["shards"]}
    gap = next(end for end in ends if end not in starts and end % 64)
    patch(shard_file(ckpt), gap, b"\x01")
    assert_same_view(restore(ckpt), saved)
    with pytest.raises(CorruptCheckpointError, match=f"offset {gap} between regions"):
        verify(ckpt)
    assert cli_main(["verify", os.path.dirname(ckpt)]) == 1


def test_verify_finds_a_nonzero_byte_before_the_index(ckpt):
    offset, _ = index_of(read_bytes(shard_file(ckpt)))
    patch(shard_file(ckpt), offset - 1, b"\x07")  # version 3: the index record's ZIP header
    with pytest.raises(CorruptCheckpointError, match="between regions|ZIP local header"):
        verify(ckpt)


# 4031: the last reserved byte of the header block (its last 64 bytes hold the first tensor's ZIP
# record header in a version 3 file, which verify checks against the index)
@pytest.mark.parametrize("offset,value", [(12, b"\x01"), (100, b"\x01"), (4031, b"\xff")])
def test_header_flags_and_reserved_bytes(ckpt, offset, value):
    import struct
    import zlib

    patch(shard_file(ckpt), offset, value)
    if offset < 36:  # keep the header CRC valid: the flags themselves must be refused
        head = read_bytes(shard_file(ckpt))[:36]
        patch(shard_file(ckpt), 36, struct.pack("<I", zlib.crc32(head)))
    with bounded_memory():
        for action in (load, restore, verify):
            with pytest.raises(CorruptCheckpointError, match="flags|reserved"):
                action(ckpt)


def test_verify_checks_the_index_against_the_manifest(ckpt):
    """An index that is valid and checksummed but says another dtype than the manifest."""
    shard = read_bytes(shard_file(ckpt))
    _, index = index_of(shard)
    obj = json.loads(index)
    e = next(e for e in obj["entries"] if e["key"] == "model/0.weight")
    e["dtype"] = "int32"  # same size as float32: the index alone is consistent
    new_index = json.dumps(obj, separators=(",", ":")).encode()
    write_bytes(shard_file(ckpt), with_index(shard, new_index))
    forge(
        ckpt,
        lambda m: m["files"][0].update(
            index_crc32=datastates.format.codec.crc32(new_index),
            nbytes=os.path.getsize(shard_file(ckpt)),
        ),
    )
    assert load(ckpt)  # the manifest is the authority for loading ...
    with pytest.raises(CorruptCheckpointError, match="disagree on its dtype"):
        verify(ckpt)  # ... and verify checks that the index agrees with it

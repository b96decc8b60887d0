"""Golden bytes pin the on-disk format of docs/format.md; the typed model accepts exactly what
the writer writes."""

from __future__ import annotations

import json
import os
import re
import struct
import zlib

import pytest
import torch

from datastates import Checkpointer, CorruptCheckpointError, UnsupportedFormatError
from datastates import format as fmt
from datastates.format import records, validate


def test_header_golden_bytes():
    index = b'{"format":"datastates-shard","version":2,"rank":0,"entries":[]}'
    head = fmt.pack_header(8192, index)
    assert len(head) == 4096
    assert head[:8] == bytes.fromhex("4453544154455301")
    assert struct.unpack_from("<IIQQI", head, 8) == (2, 0, 8192, len(index), zlib.crc32(index))
    assert struct.unpack_from("<I", head, 36)[0] == zlib.crc32(head[:36])
    assert head[40:] == bytes(4056)


def test_shard_file_matches_the_spec(tmp_path):
    """An independent reader built from the spec alone finds the bytes of every tensor."""
    t = torch.arange(10, dtype=torch.int32)
    b = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save({"t": t, "b": b, "obj": {1, 2}}, step=7).wait()
    cdir = tmp_path / "step-0000000007"
    raw_manifest = (cdir / "manifest.json").read_bytes()
    manifest = json.loads(raw_manifest)
    assert manifest["format"] == "datastates-checkpoint" and manifest["version"] == 3
    assert manifest["step"] == 7 and manifest["world_size"] == 1 and manifest["seq"] == 1
    # The checksum trailer: the last field, CRC-32 of every byte before ',"manifest_crc32"'.
    trailer = re.fullmatch(rb'(.*),"manifest_crc32":"([0-9a-f]{8})"\}', raw_manifest, re.S)
    assert trailer and int(trailer.group(2), 16) == zlib.crc32(trailer.group(1))
    assert list(manifest)[-1] == "manifest_crc32"
    raw = (cdir / manifest["files"][0]["name"]).read_bytes()
    # Version 3: an empty ZIP record's local header at 0, the header at 64, the tail last.
    assert raw[:4] == b"PK\x03\x04"
    (magic, version, flags, ioff, ilen, icrc, toff, tlen, tcrc, first) = struct.unpack_from(
        "<8sIIQQIQQII", raw, 64
    )
    assert magic == b"DSTATES\x01" and version == 3 and flags == 0 and first == 64
    assert struct.unpack_from("<I", raw, 124)[0] == zlib.crc32(raw[64:124])
    assert raw[128:4032] == bytes(3904) and raw[4032:4036] == b"PK\x03\x04"
    assert ioff % 4096 == 0
    assert toff == -(-(ioff + ilen) // 64) * 64 and toff + tlen == len(raw)
    assert zlib.crc32(raw[toff:]) == tcrc
    assert zlib.crc32(raw[ioff : ioff + ilen]) == icrc == manifest["files"][0]["index_crc32"]
    index = json.loads(raw[ioff : ioff + ilen])
    by_key = {e["key"]: e for e in index["entries"]}
    e = by_key["t"]
    assert e["dtype"] == "int32" and e["shape"] == [10] and e["offset"] == 4096
    assert raw[e["offset"] : e["offset"] + e["nbytes"]] == t.numpy().tobytes()
    assert e["checksums"] == [[40, zlib.crc32(t.numpy().tobytes())]]
    e = by_key["b"]
    assert raw[e["offset"] : e["offset"] + 4] == bytes(b.view(torch.int16).numpy().tobytes())
    assert by_key["obj"]["kind"] == "object"
    tree = manifest["ranks"][0]["tree"]
    assert tree["t"] == "dict" and [k for k, _ in tree["items"]] == ["t", "b", "obj"]
    assert (tmp_path / "latest").read_text() == "step-0000000007"
    assert sorted(os.listdir(cdir)) == ["manifest.json", "rank-00000.dsf"]


# ---------------------------------------------------------------- manifest checksum and versions


def test_seal_manifest_golden_bytes():
    body = b'{"a":1}'
    sealed = fmt.seal_manifest(body)
    assert sealed == b'{"a":1,"manifest_crc32":"%08x"}' % zlib.crc32(b'{"a":1')
    assert json.loads(sealed) == {"a": 1, "manifest_crc32": "%08x" % zlib.crc32(b'{"a":1')}


def saved_manifest(tmp_path) -> tuple[str, dict]:
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save({"t": torch.arange(4), "o": {1}}, step=3).wait()
    cdir = str(tmp_path / "step-0000000003")
    with open(os.path.join(cdir, "manifest.json"), "rb") as f:
        obj = json.loads(f.read())
    obj.pop("manifest_crc32")
    return cdir, obj


def write(cdir: str, raw: bytes) -> None:
    with open(os.path.join(cdir, "manifest.json"), "wb") as f:
        f.write(raw)


def test_read_manifest_is_typed(tmp_path):
    cdir, obj = saved_manifest(tmp_path)
    m = fmt.read_manifest(cdir)
    assert isinstance(m, records.Manifest) and m.version == 3 and m.seq == 1 and m.step == 3
    assert m.files == (
        records.FileRef(
            "rank-00000.dsf", 0, obj["files"][0]["nbytes"], obj["files"][0]["index_crc32"]
        ),
    )
    kinds = {e.key: type(e) for e in m.entries.values()}
    assert kinds == {"t": records.TensorEntry, "o": records.ObjectEntry}
    t = next(e for e in m.entries.values() if e.key == "t")
    assert t.shape == (4,) and t.torch_dtype == torch.int64 and t.shards[0].nbytes == 32
    index = fmt.read_index(os.path.join(cdir, "rank-00000.dsf"))
    assert isinstance(index, records.ShardIndex) and {e.key for e in index.entries} == {"t", "o"}


def test_manifest_entries_map_each_index_from_zero_to_its_entry(tmp_path):
    """``Manifest.entries`` is one shape: index -> entry (a rank's view holds some indexes, a
    whole manifest every one from 0, in the order of the JSON list). A writer handed entries
    with an index missing refuses them, naming the place."""
    import dataclasses

    cdir, obj = saved_manifest(tmp_path)
    m = fmt.read_manifest(cdir)
    assert list(m.entries) == list(range(len(obj["entries"])))
    assert [e.to_json() for e in m.entries.values()] == obj["entries"]
    assert m.to_json()["entries"] == obj["entries"]
    gap = dataclasses.replace(m, entries={i + 1: e for i, e in m.entries.items()})
    with pytest.raises(CorruptCheckpointError, match=r"entries\[0\]: .*entry 0 is missing"):
        fmt.manifest_record_bytes(gap)


def test_unsealed_version_2_manifest_is_corrupt(tmp_path):
    """Without its trailer a version-2 manifest is never read unchecked."""
    cdir, obj = saved_manifest(tmp_path)
    write(cdir, fmt.encode_json(obj))
    with pytest.raises(CorruptCheckpointError, match="checksum") as info:
        fmt.read_manifest(cdir)
    assert info.type is CorruptCheckpointError


def test_version_1_with_a_trailer_is_corrupt(tmp_path):
    """A bit flip of the version digit 2 -> 1 (0x32 -> 0x31) cannot reach the legacy path."""
    cdir, obj = saved_manifest(tmp_path)
    obj["version"] = 1
    write(cdir, fmt.seal_manifest(fmt.encode_json(obj)))
    with pytest.raises(CorruptCheckpointError, match="version"):
        fmt.read_manifest(cdir)


def test_legacy_version_1_loads_with_a_warning(tmp_path):
    """A version-1 manifest (no checksum, no seq) is read, validated, with a warning."""
    cdir, obj = saved_manifest(tmp_path)
    obj["version"] = 1
    del obj["seq"]
    write(cdir, json.dumps(obj).encode())
    with pytest.warns(RuntimeWarning, match="no checksum"):
        m = fmt.read_manifest(cdir)
    assert m.version == 1 and m.seq == 0
    with pytest.warns(RuntimeWarning), Checkpointer(tmp_path) as ckpt:
        assert torch.equal(ckpt.load(step=3, trusted=True)["t"], torch.arange(4))
    obj["seq"] = 5  # version 1 never had a seq: a mix is damage
    write(cdir, json.dumps(obj).encode())
    with pytest.raises(CorruptCheckpointError):
        fmt.read_manifest(cdir)


def test_legacy_version_1_with_parts_is_corrupt(tmp_path):
    """Parts belong to split manifests (version 4): an unsealed version-1 manifest naming
    parts is damage, never read with the parts ignored."""
    cdir, obj = saved_manifest(tmp_path)
    obj["version"] = 1
    del obj["seq"]
    obj["parts"] = []
    write(cdir, json.dumps(obj).encode())
    with pytest.raises(CorruptCheckpointError, match="checksum") as info:
        fmt.read_manifest(cdir)
    assert info.type is CorruptCheckpointError


@pytest.mark.parametrize(
    "version,error",
    [
        (5, UnsupportedFormatError),
        (4, CorruptCheckpointError),  # 4 is split: no entries
        (0, CorruptCheckpointError),
        (True, CorruptCheckpointError),
        ("2", CorruptCheckpointError),
    ],
)
def test_manifest_version_checks(tmp_path, version, error):
    cdir, obj = saved_manifest(tmp_path)
    obj["version"] = version
    write(cdir, fmt.seal_manifest(fmt.encode_json(obj)))
    with pytest.raises(error) as info:
        fmt.read_manifest(cdir)
    assert info.type is error


def test_encode_manifest_refuses_what_a_reader_would_refuse(tmp_path):
    _, obj = saved_manifest(tmp_path)
    obj["entries"][0]["shape"] = [-1]
    with pytest.raises(CorruptCheckpointError, match="shape"):
        fmt.encode_manifest(obj)


@pytest.mark.parametrize("where", ["shape", "checksums", "tree pair", "created_unix"])
def test_encode_manifest_refuses_what_json_would_change(tmp_path, where):
    """The writer validates the manifest dict itself (no decoded copy): anything the JSON round
    trip would turn into something else -- a tuple, an int or float subclass -- is refused."""
    import enum

    class Small(enum.IntEnum):
        ONE = 1

    class Time(float):
        pass

    _, obj = saved_manifest(tmp_path)
    if where == "shape":
        obj["entries"][0]["shape"] = tuple(obj["entries"][0]["shape"])
    elif where == "checksums":
        obj["entries"][0]["shards"][0]["checksums"][0][0] = Small.ONE
    elif where == "tree pair":
        tree = obj["ranks"][0]["tree"]
        tree["items"][0] = tuple(tree["items"][0])
    else:
        obj["created_unix"] = Time(obj["created_unix"])
    with pytest.raises(CorruptCheckpointError, match="manifest being written"):
        fmt.encode_manifest(obj)


def test_encode_manifest_returns_what_a_reader_parses(tmp_path):
    cdir, obj = saved_manifest(tmp_path)
    data, parsed = fmt.encode_manifest_checked(obj)
    assert fmt.parse_manifest_bytes(data, "again") == parsed


def test_save_records_metadata_as_json_decodes_it(tmp_path):
    """What save() records is what a reader finds, also in the writer's kept manifest."""
    import enum

    class Level(enum.IntEnum):
        HIGH = 2

    with Checkpointer(tmp_path) as ckpt:
        info = ckpt.save({"t": torch.ones(2)}, step=1, metadata={"level": Level.HIGH}).wait()
        kept = ckpt.latest()
    with Checkpointer(tmp_path) as other:
        fresh = other.latest()
    for found in (info.metadata, kept.metadata, fresh.metadata):
        assert found == {"level": 2} and type(found["level"]) is int


def test_parse_rank_report_validates(tmp_path):
    report = {
        "rank": 1,
        "save": {"name": "step-1", "step": 1, "nonce": "n", "overwrite": False},
        "root": "/d",
        "replicas": {"x": "8:7"},
        "file": {"name": "rank-00001.dsf", "nbytes": 8192, "index_crc32": 5},
        "entries": [
            {
                "key": "x",
                "kind": "tensor",
                "dtype": "float32",
                "shape": [2],
                "offset": 4096,
                "nbytes": 8,
                "checksums": [[8, 7]],
            }
        ],
        "tree": {"t": "dict", "items": [["x", {"t": "tensor", "e": 0}]]},
    }
    parsed = validate.parse_rank_report(report, "rank 1")
    assert parsed.rank == 1 and parsed.entries[0].checksums == ((8, 7),)
    assert parsed.save.nonce == "n" and parsed.replicas == {"x": "8:7"} and not parsed.failed
    assert validate.parse_rank_report(parsed.to_json(), "again") == parsed
    for mutate in (
        lambda r: r["file"].update(name="../x"),
        lambda r: r["entries"][0].update(nbytes=12),
        lambda r: r["tree"]["items"][0][1].update(e=1),
        lambda r: r["tree"]["items"][0][1].update(t="object"),
        lambda r: r.update(rank=True),
        lambda r: r["save"].update(step=-1),
        lambda r: r["save"].pop("nonce"),
        lambda r: r.update(root=None),
        lambda r: r["replicas"].update(x=3),
        lambda r: r.update(expired="yes"),
        lambda r: r["entries"][0].update(written=False),
    ):  # neither replica nor shard
        bad = json.loads(json.dumps(report))
        mutate(bad)
        with pytest.raises(CorruptCheckpointError):
            validate.parse_rank_report(bad, "rank 1")


def _tensor_entry(m: dict) -> tuple[int, dict]:
    return next((i, e) for i, e in enumerate(m["entries"]) if e["key"] == "t")


def _tree_items(m: dict) -> list:
    return m["ranks"][0]["tree"]["items"]


@pytest.mark.parametrize(
    "change,where",
    [
        (lambda m, i, e: e["shards"][0].update(offset=True), "entries[{i}].shards[0].offset"),
        (lambda m, i, e: e["shards"][0].update(nbytes=10**30), "entries[{i}].shards[0].nbytes"),
        (
            lambda m, i, e: e["shards"][0].pop("file"),
            "entries[{i}].shards[0]: required field 'file'",
        ),
        (lambda m, i, e: e["shards"][0]["shape"].append(-1), "entries[{i}].shards[0].shape[1]"),
        (
            lambda m, i, e: e["shards"][0].update(global_offset="0"),
            "entries[{i}].shards[0].global_offset",
        ),
        (
            lambda m, i, e: e["shards"][0]["checksums"][0].__setitem__(1, 1 << 40),
            "entries[{i}].shards[0].checksums[0][1]",
        ),
        (
            lambda m, i, e: e["shards"][0]["checksums"][0].__setitem__(0, False),
            "entries[{i}].shards[0].checksums[0][0]",
        ),
        (lambda m, i, e: e.update(key=7), "entries[{i}].key"),
        (lambda m, i, e: e.update(shape=[4.0]), "entries[{i}].shape[0]"),
        (lambda m, i, e: e.update(replicated=1), "entries[{i}].replicated"),
        (lambda m, i, e: e.update(rank=1), "entries[{i}].rank"),
        (
            lambda m, i, e: _tree_items(m)[0][1].update(param="yes"),
            "ranks[0].tree.items[0][1].param",
        ),
        (lambda m, i, e: _tree_items(m)[0][1].update(e=True), "ranks[0].tree.items[0][1].e"),
        (
            lambda m, i, e: _tree_items(m)[0].__setitem__(0, float("nan")),
            "ranks[0].tree.items[0][0]",
        ),
    ],
)
def test_manifest_errors_name_the_field(tmp_path, change, where):
    """Each field check has a fast path for valid values; a bad value is still rejected with
    the JSON path of the field that holds it."""
    cdir, obj = saved_manifest(tmp_path)
    i, e = _tensor_entry(obj)
    change(obj, i, e)
    with pytest.raises(CorruptCheckpointError) as info:
        validate.parse_manifest(obj, "m.json")
    assert f"m.json: {where.format(i=i)}" in str(info.value)


# ---------------------------------------------------------------- the json module's public API


def test_the_streamed_parsers_need_raw_decode_with_a_start_index():
    """codec's streamed parsers call ``JSONDecoder.raw_decode(text, idx)``: a value starting at
    ``idx`` exactly (no whitespace skipped), and the index just after it."""
    decode = json.JSONDecoder().raw_decode
    assert decode('  [1] {"a": "b"} x', 6) == ({"a": "b"}, 16)
    assert decode('{"k":"v"}', 5) == ("v", 8)
    with pytest.raises(ValueError):
        decode(" 1", 0)


@pytest.mark.parametrize("text", ['{"a": "\u00e9\U0001f600"}', "[]", "1", "12", ""])
@pytest.mark.parametrize(
    "encoding",
    ["utf-8", "utf-8-sig", "utf-16", "utf-16-le", "utf-16-be", "utf-32", "utf-32-le", "utf-32-be"],
)
def test_json_text_is_decoded_as_json_loads_decodes_it(text, encoding):
    raw = text.encode(encoding)
    assert fmt.codec.text_of(raw) == raw.decode(json.detect_encoding(raw), "surrogatepass")
    if text:
        obj = fmt.codec.parse_json_streamed(
            b'{"x": %s, "e": [%s]}' % (text.encode() or b"0", text.encode() or b"0"),
            "e",
            lambda _: None,
        )
        assert obj == json.loads('{"x": %s, "e": [%s]}' % (text, text))

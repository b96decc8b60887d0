"""Golden bytes pin the on-disk format of docs/format.md."""
from __future__ import annotations

import json
import os
import struct
import zlib

import torch

from datastates import Checkpointer
from datastates import format as fmt


def test_header_golden_bytes():
    index = b'{"format":"datastates-shard","version":1,"rank":0,"entries":[]}'
    head = fmt.pack_header(8192, index)
    assert len(head) == 4096
    assert head[:8] == bytes.fromhex("4453544154455301")
    assert struct.unpack_from("<IIQQI", head, 8) == (1, 0, 8192, len(index), zlib.crc32(index))
    assert struct.unpack_from("<I", head, 36)[0] == zlib.crc32(head[:36])
    assert head[40:] == bytes(4056)


def test_shard_file_matches_the_spec(tmp_path):
    """An independent reader built from the spec alone finds the bytes of every tensor."""
    t = torch.arange(10, dtype=torch.int32)
    b = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save({"t": t, "b": b, "obj": {1, 2}}, step=7).wait()
    cdir = tmp_path / "step-0000000007"
    manifest = json.loads((cdir / "manifest.json").read_text())
    assert manifest["format"] == "datastates-checkpoint" and manifest["version"] == 1
    assert manifest["step"] == 7 and manifest["world_size"] == 1
    raw = (cdir / manifest["files"][0]["name"]).read_bytes()
    magic, version, flags, ioff, ilen, icrc = struct.unpack_from("<8sIIQQI", raw, 0)
    assert magic == b"DSTATES\x01" and version == 1 and flags == 0
    assert zlib.crc32(raw[ioff:ioff + ilen]) == icrc == manifest["files"][0]["index_crc32"]
    index = json.loads(raw[ioff:ioff + ilen])
    by_key = {e["key"]: e for e in index["entries"]}
    e = by_key["t"]
    assert e["dtype"] == "int32" and e["shape"] == [10] and e["offset"] % 64 == 0
    assert raw[e["offset"]:e["offset"] + e["nbytes"]] == t.numpy().tobytes()
    assert e["checksums"] == [[40, zlib.crc32(t.numpy().tobytes())]]
    e = by_key["b"]
    assert raw[e["offset"]:e["offset"] + 4] == bytes(b.view(torch.int16).numpy().tobytes())
    assert by_key["obj"]["kind"] == "object"
    tree = manifest["ranks"][0]["tree"]
    assert tree["t"] == "dict" and [k for k, _ in tree["items"]] == ["t", "b", "obj"]
    assert (tmp_path / "latest").read_text() == "step-0000000007"
    assert sorted(os.listdir(cdir)) == ["manifest.json", "rank-00000.dsf"]

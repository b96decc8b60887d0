"""torch.distributed.checkpoint through DatastatesWriter/DatastatesReader: real dcp.save,
dcp.async_save and dcp.load on 1 and 2 gloo ranks (real processes), loads at another world size
(resharding by DCP), the files are datastates shard files, corruption is detected."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("torch.distributed.checkpoint")

import datastates  # noqa: E402
from datastates.integrations.dcp import DatastatesReader, DatastatesWriter  # noqa: E402

from integration_helpers import HERE, free_port, subprocess_env  # noqa: E402

# slow: DCP saves and loads across world sizes in worker processes
pytestmark = pytest.mark.slow


def run(mode: str, root, world: int) -> None:
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.join(HERE, "dcp_worker.py"), mode, str(root)],
            env=subprocess_env(
                RANK=r, WORLD_SIZE=world, LOCAL_RANK=r, MASTER_ADDR="127.0.0.1", MASTER_PORT=port
            ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    outs = [p.communicate(timeout=240)[0] for p in procs]
    for p, out in zip(procs, outs):
        assert p.returncode == 0, out[-4000:]
    assert os.path.exists(os.path.join(root, f"{mode}-ok-{world}"))


@pytest.mark.parametrize("save_world,load_world", [(2, 2), (2, 1), (1, 2)])
def test_dcp_save_load_across_world_sizes(tmp_path, save_world, load_world):
    run("save", tmp_path, save_world)
    for name in ("sync", "async"):
        files = sorted(os.listdir(tmp_path / name))
        shards = [f for f in files if f.endswith(".dsf")]
        assert len(shards) == save_world  # one coalesced file per rank
        for f in shards:  # each is a valid datastates shard file with a checksummed index
            assert datastates.format.read_index(str(tmp_path / name / f)).entries
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temporaries left
    run("load", tmp_path, load_world)


def test_dcp_detects_corruption(tmp_path):
    import torch.distributed.checkpoint as dcp

    state = {"w": torch.arange(4096, dtype=torch.float32)}
    dcp.save(state, storage_writer=DatastatesWriter(tmp_path / "c"), no_dist=True)
    shard = tmp_path / "c" / datastates.format.codec.shard_file_name(0)
    with open(shard, "r+b") as f:
        f.seek(datastates.format.codec.HEADER_BYTES + 100)
        f.write(b"\xff\xff")
    with pytest.raises(BaseException) as info:  # CheckpointException is a BaseException
        dcp.load(
            {"w": torch.zeros(4096)}, storage_reader=DatastatesReader(tmp_path / "c"), no_dist=True
        )
    causes = getattr(info.value, "failures", {0: info.value})  # DCP wraps it per rank
    causes = [c[0] if isinstance(c, tuple) else c for c in causes.values()]  # (exc, traceback)
    assert any(
        isinstance(c, datastates.CorruptCheckpointError) and "checksum" in str(c) for c in causes
    ), causes


def test_dcp_metadata_is_json_and_round_trips(tmp_path):
    """datastates' own metadata is JSON (the ``.metadata`` pickle beside it is for DCP's stock
    reader and never unpickled by datastates), and what the reader rebuilds from it is the
    Metadata DCP planned (sizes, chunks, dtypes, the flattening map, where each item is)."""
    import torch.distributed.checkpoint as dcp
    from datastates.dcp import metadata as dcp_metadata

    state = {"m": {"w": torch.ones(3, 2, dtype=torch.bfloat16)}, "n": [4, {"k": "v"}]}
    dcp.save(state, storage_writer=DatastatesWriter(tmp_path / "m"), no_dist=True)
    assert sorted(os.listdir(tmp_path / "m")) == [
        ".metadata",
        "dcp_manifest.json",
        "dcp_metadata.json",
        "rank-00000.dsf",
    ]
    raw = (tmp_path / "m" / "dcp_metadata.json").read_bytes()
    doc = json.loads(raw)
    assert doc["planner_data"] == [["m.w", ["m", "w"]], ["n.0", ["n", 0]], ["n.1.k", ["n", 1, "k"]]]
    meta = DatastatesReader(tmp_path / "m").read_metadata()
    w = meta.state_dict_metadata["m.w"]
    assert w.size == torch.Size([3, 2]) and w.properties.dtype == torch.bfloat16
    assert [(c.offsets, c.sizes) for c in w.chunks] == [(torch.Size([0, 0]), torch.Size([3, 2]))]
    assert meta.planner_data == {"m.w": ("m", "w"), "n.0": ("n", 0), "n.1.k": ("n", 1, "k")}
    again = dcp_metadata.encode(dcp_metadata.decode(raw, "m", ["rank-00000.dsf"]))
    assert json.loads(again) == doc


@pytest.mark.parametrize(
    "field,value,match",
    [
        (("state_dict", 0, 1, "size"), [-1, 2], "non-negative"),
        (("state_dict", 0, 1, "chunks", 0, "sizes"), [9, 2], "not inside the tensor"),
        (("state_dict", 0, 1, "dtype"), "object", "unknown dtype"),
        (("storage_data", 0, 1, "file"), "../../etc/passwd", "not one of the checkpoint's shard"),
        (("storage_data", 0, 1, "length"), 5, "expected 24"),
        (("planner_data", 0, 1), [{"__reduce__": 1}], "path of strings"),
        (("storage_data", 0, 1, "frame", "offset"), 100, "not a frame around"),
        (("storage_data", 0, 1, "frame", "length"), 30, "not a frame around"),
        (("storage_data", 0, 1, "frame", "crc32"), 1 << 32, "not a frame around"),
        (("storage_data", 0, 1, "frame", "more"), 1, "the fields"),
    ],
)
def test_dcp_metadata_fields_are_checked(tmp_path, field, value, match):
    """A forged field of the JSON metadata (with the manifest's checksum made to match) is a
    CorruptCheckpointError naming the file, before DCP uses any of it."""
    import torch.distributed.checkpoint as dcp

    dcp.save(
        {"m": {"w": torch.ones(3, 2)}},
        storage_writer=DatastatesWriter(tmp_path / "m"),
        no_dist=True,
    )
    doc = json.loads((tmp_path / "m" / "dcp_metadata.json").read_bytes())
    node = doc
    for step in field[:-1]:
        node = node[step]
    node[field[-1]] = value
    plant_metadata(tmp_path / "m", json.dumps(doc).encode())
    with pytest.raises(datastates.CorruptCheckpointError, match=match) as info:
        DatastatesReader(tmp_path / "m").read_metadata()
    assert "dcp_metadata.json" in str(info.value)


def plant_metadata(folder, blob: bytes, name: str = "dcp_metadata.json", version: int = 2):
    """Replace the metadata file of a DatastatesWriter folder by ``blob`` and make the manifest
    agree with it (its size and CRC-32), as someone forging the folder would."""
    (folder / name).write_bytes(blob)
    manifest = json.loads((folder / "dcp_manifest.json").read_bytes())
    manifest.update(
        version=version,
        metadata_bytes=len(blob),
        metadata_crc32=datastates.format.codec.crc32(blob),
    )
    (folder / "dcp_manifest.json").write_text(json.dumps(manifest))


def test_dcp_overwrite_is_atomic_swap(tmp_path):
    import torch.distributed.checkpoint as dcp

    for v in (1.0, 2.0):
        dcp.save(
            {"w": torch.full((8,), v)},
            storage_writer=DatastatesWriter(tmp_path / "o"),
            no_dist=True,
        )
    out = {"w": torch.zeros(8)}
    dcp.load(out, storage_reader=DatastatesReader(tmp_path / "o"), no_dist=True)
    assert torch.equal(out["w"], torch.full((8,), 2.0))
    assert sorted(os.listdir(tmp_path)) == ["o"]


def test_export_and_inspect_of_a_dcp_folder(tmp_path):
    """`datastates export --to torch` does for our DCP folders what dcp_to_torch_save does."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from datastates.integrations.dcp import DatastatesWriter

    state = {"model": {"w": torch.randn(6, 4), "b": torch.arange(4.0)}, "step": 7}
    dcp.save(state, storage_writer=DatastatesWriter(str(tmp_path / "ours")), no_dist=True)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(str(tmp_path / "stock")), no_dist=True)
    report = datastates.export(tmp_path / "ours", tmp_path / "ours.pt", "torch")
    dcp_to_torch_save(str(tmp_path / "stock"), str(tmp_path / "stock.pt"))
    want = torch.load(tmp_path / "stock.pt", weights_only=True)
    got = torch.load(tmp_path / "ours.pt", weights_only=True)
    assert want["step"] == got["step"] == 7 and report.tensors == 2
    assert sorted(want["model"]) == sorted(got["model"]) == ["b", "w"]
    for k in want["model"]:
        assert torch.equal(want["model"][k], got["model"][k]), k
    summary = datastates.inspect(tmp_path / "ours")
    assert {t["key"]: t["shape"] for t in summary["tensors"]} == {"model.w": [6, 4], "model.b": [4]}


def test_dcp_writer_exposes_last_save_stats(tmp_path):
    import torch.distributed.checkpoint as dcp
    from integration_helpers import assert_stats_of

    writer = DatastatesWriter(tmp_path / "s")
    assert writer.last_save_stats is None
    state = {"w": torch.randn(64, 32), "b": torch.arange(16.0)}
    dcp.save(state, storage_writer=writer, no_dist=True)
    assert_stats_of(writer.last_save_stats, tmp_path / "s")
    assert writer.last_save_stats.nbytes == (64 * 32 + 16) * 4
    dcp.save(
        {"w": torch.ones(8)}, storage_writer=writer, checkpoint_id=tmp_path / "t", no_dist=True
    )
    assert writer.last_save_stats.nbytes == 32  # the last save's, not a running total
    assert_stats_of(writer.last_save_stats, tmp_path / "t")

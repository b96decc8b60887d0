"""Export reads the shard bytes through restore's Reader: it finds the files where the manifest
says (its data directory), checks each file as a restore does, and verifies the same checksums."""

from __future__ import annotations

import json
import os

import pytest
import torch

import datastates
from datastates import CheckpointConfig, Checkpointer, ConfigError, CorruptCheckpointError
from datastates.format import MANIFEST, encode_manifest, read_manifest
from datastates.providers import ProviderRegistry
from datastates.restore.reader import Reader
from datastates.storage.store import LocalStore, ReadFile

CFG = CheckpointConfig(host_cache_bytes=8 << 20, chunk_bytes=64 << 10)
DATA_DIR = ".data.test-0"


def _saved(root) -> tuple[str, dict]:
    g = torch.Generator().manual_seed(5)
    state = {
        "model": {"w": torch.randn(300, 70, generator=g), "b": torch.arange(70, dtype=torch.int32)},
        "tied": {"a": torch.ones(4), "b": None},
        "epoch": 4,
        "note": "run",
    }
    state["tied"]["b"] = state["tied"]["a"]
    with Checkpointer(root, CFG) as ck:
        info = ck.save(state, step=1).wait()
    return info.path, state


def _move_to_data_dir(ckpt: str) -> None:
    """What an object store holds: the shard files in a data directory the manifest names."""
    m = json.loads(open(os.path.join(ckpt, MANIFEST), "rb").read())
    del m["manifest_crc32"]
    m["data_dir"] = DATA_DIR
    os.mkdir(os.path.join(ckpt, DATA_DIR))
    for f in m["files"]:
        os.rename(os.path.join(ckpt, f["name"]), os.path.join(ckpt, DATA_DIR, f["name"]))
    with open(os.path.join(ckpt, MANIFEST), "wb") as out:
        out.write(encode_manifest(m))


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0x01]))


def _first_region(ckpt: str) -> tuple[str, int]:
    """(file name, offset) of the first tensor region of the checkpoint."""
    m = read_manifest(ckpt)
    shard = next(e for e in m.entries.values() if e.kind == "tensor").shards[0]
    return m.files[shard.file].name, shard.offset


def test_export_reads_the_shard_files_from_the_data_dir(tmp_path):
    pytest.importorskip("safetensors")
    ckpt, state = _saved(tmp_path / "ck")
    before = tmp_path / "before.safetensors"
    datastates.export(ckpt, before, "safetensors")
    planned = datastates.tools.export.planned_bytes(ckpt, "torch")
    _move_to_data_dir(ckpt)
    assert read_manifest(ckpt).data_dir == DATA_DIR
    assert not [n for n in os.listdir(ckpt) if n.endswith(".dsf")]
    after = tmp_path / "after.safetensors"
    report = datastates.export(ckpt, after, "safetensors")
    assert after.read_bytes() == before.read_bytes()
    assert report.aliases == {"tied/b": "tied/a"}
    out = tmp_path / "after.pt"
    report = datastates.export(ckpt, out, "torch")
    got = torch.load(out, weights_only=True)
    assert report.nbytes == planned
    assert torch.equal(got["model"]["w"], state["model"]["w"])
    assert torch.equal(got["model"]["b"], state["model"]["b"])
    assert got["tied"]["a"].data_ptr() == got["tied"]["b"].data_ptr()
    assert (got["epoch"], got["note"]) == (4, "run")


def test_a_decoy_next_to_the_data_dir_is_not_read(tmp_path):
    """A damaged copy of a shard file at the checkpoint's top level is not what is read."""
    ckpt, state = _saved(tmp_path / "ck")
    _move_to_data_dir(ckpt)
    name, offset = _first_region(ckpt)
    decoy = os.path.join(ckpt, name)
    with open(os.path.join(ckpt, DATA_DIR, name), "rb") as src, open(decoy, "wb") as dst:
        dst.write(src.read())
    _flip(decoy, offset)
    datastates.export(ckpt, tmp_path / "w.pt", "torch")
    got = torch.load(tmp_path / "w.pt", weights_only=True)
    assert torch.equal(got["model"]["w"], state["model"]["w"])


def test_damage_inside_the_data_dir_is_caught(tmp_path):
    ckpt, _ = _saved(tmp_path / "ck")
    _move_to_data_dir(ckpt)
    name, offset = _first_region(ckpt)
    _flip(os.path.join(ckpt, DATA_DIR, name), offset + 7)
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch"):
        datastates.export(ckpt, tmp_path / "w.pt", "torch")
    assert not (tmp_path / "w.pt").exists()


def test_export_checks_each_file_header_as_a_restore_does(tmp_path):
    """A shard file whose header is damaged is refused before anything is written, by export as
    by load, though every data region is intact."""
    ckpt, _ = _saved(tmp_path / "ck")
    path = os.path.join(ckpt, read_manifest(ckpt).files[0].name)
    _flip(path, 64 + 20)  # a field of the header (after the ZIP record header) its CRC covers
    with pytest.raises(CorruptCheckpointError, match="header checksum mismatch"):
        Checkpointer(tmp_path / "ck").load()
    for to in ("torch", "safetensors"):
        with pytest.raises(CorruptCheckpointError, match="header checksum mismatch"):
            datastates.export(ckpt, tmp_path / f"w.{to}", to)
    assert sorted(os.listdir(tmp_path)) == ["ck"]


class _UnmappableFile(ReadFile):
    """A file read by positional reads only, as from an object store."""

    def __init__(self, inner: ReadFile):
        self.inner, self.path, self.size = inner, inner.path, inner.size

    def read_into(self, views, offset):
        self.inner.read_into(views, offset)

    def close(self):
        self.inner.close()


class _UnmappableStore(LocalStore):
    def open_read(self, path):
        return _UnmappableFile(super().open_read(path))


def test_only_a_local_file_is_mapped(tmp_path):
    ckpt, state = _saved(tmp_path / "ck")
    with Reader(ckpt, registry=ProviderRegistry.default(), store=_UnmappableStore()) as reader:
        entry = next(
            e for e in reader.entries.values() if e.kind == "tensor" and e.key == "model/w"
        )
        shard = entry.shards[0]
        with pytest.raises(ConfigError, match="local disk"):
            reader.checkpoint.mapped(
                shard.file, shard.offset, shard.nbytes, shard.checksums, entry.key
            )
        assert torch.equal(reader.load()["model"]["w"], state["model"]["w"])  # reads still work

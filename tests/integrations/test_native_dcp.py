"""DCP's own tools read a folder DatastatesWriter wrote, as it is (docs/format.md, "DCP folders",
"Version 3"): stock ``dcp.load(state, checkpoint_id=dir)`` with the default FileSystemReader and
``dcp_to_torch_save``, on 1 and 2 gloo ranks (real processes); each tensor is stored once, inside
a ``torch.save`` frame; a damaged byte is still a typed error for datastates' own readers."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
import torch

pytest.importorskip("torch.distributed.checkpoint")

import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save  # noqa: E402

import datastates  # noqa: E402
from datastates.dcp.folders import verify_folder  # noqa: E402
from datastates.format import codec as fmt  # noqa: E402
from datastates.integrations.dcp import DatastatesReader, DatastatesWriter  # noqa: E402

from integration_helpers import HERE, free_port, subprocess_env  # noqa: E402


def state() -> dict:
    g = torch.Generator().manual_seed(3)
    return {
        "model": {
            "w": torch.randn(33, 17, generator=g),
            "b": torch.randn(9, generator=g).bfloat16(),
            "i": torch.randint(-100, 100, (5, 4), generator=g, dtype=torch.int64),
            "flag": torch.tensor([True, False, True]),
            "scalar": torch.tensor(2.5, dtype=torch.float64),
            "empty": torch.empty(0, 3),
        },
        "extra": {"step": 11, "name": "run"},
    }


def zeros_like(s: dict) -> dict:
    return {
        "model": {k: torch.zeros_like(v) for k, v in s["model"].items()},
        "extra": {"step": 0, "name": ""},
    }


def assert_bits(got: torch.Tensor, want: torch.Tensor, key: str) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, key
    assert got.contiguous().view(-1).view(torch.uint8).tolist() == (
        want.contiguous().view(-1).view(torch.uint8).tolist()
    ), key


def save(path) -> dict:
    s = state()
    dcp.save(s, storage_writer=DatastatesWriter(path), no_dist=True)
    return s


def test_stock_load_single_rank(tmp_path):
    saved = save(tmp_path / "c")
    fresh = zeros_like(saved)
    dcp.load(fresh, checkpoint_id=str(tmp_path / "c"), no_dist=True)  # DCP picks FileSystemReader
    for k, v in saved["model"].items():
        assert_bits(fresh["model"][k], v, k)
    assert fresh["extra"] == saved["extra"]
    assert verify_folder(tmp_path / "c") > 0  # and datastates still verifies every byte


def test_dcp_to_torch_save(tmp_path):
    saved = save(tmp_path / "c")
    dcp_to_torch_save(tmp_path / "c", tmp_path / "out.pt")
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    assert sorted(out) == ["extra", "model"] and out["extra"] == saved["extra"]
    for k, v in saved["model"].items():
        assert_bits(out["model"][k], v, k)


def _frames(path) -> tuple[dict, list]:
    """(the stock metadata's storage_data, the datastates metadata's (index, info) pairs)."""
    with open(path / ".metadata", "rb") as f:
        stock = pickle.load(f)  # the test's own folder: unpickling it is safe here
    ours = DatastatesReader(path).read_metadata().storage_data
    return stock.storage_data, list(ours.items())


def test_each_tensor_stored_once_inside_its_frame(tmp_path):
    saved = save(tmp_path / "c")
    stock, ours = _frames(tmp_path / "c")
    shard = (tmp_path / "c" / fmt.shard_file_name(0)).read_bytes()
    spans = []
    for index, info in ours:
        where = stock[index]
        assert where.relative_path == info["file"]
        if info["kind"] == "tensor":
            a, n = info["frame"]["offset"], info["frame"]["length"]
            assert (where.offset, where.length) == (a, n)
            assert a + 64 == info["offset"] and info["offset"] + info["length"] <= a + n
            assert shard[a : a + 4] == b"PK\x03\x04"  # a torch.save archive on its own
            want = saved["model"][index.fqn.split(".", 1)[1]]
            raw = (
                want.contiguous().view(-1).view(torch.uint8).numpy().tobytes()
                if want.numel()
                else b""
            )
            assert shard[info["offset"] : info["offset"] + info["length"]] == raw
        else:  # an object: its torch.save bytes, pointed at directly
            assert (where.offset, where.length) == (info["offset"], info["length"])
            a, n = info["offset"], info["length"]
        spans.append((a, a + n))
    spans.sort()
    assert spans[0][0] >= fmt.HEADER_BYTES
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))  # disjoint
    total = sum(v.numel() * v.element_size() for v in saved["model"].values())
    assert total == sum(i["length"] for _, i in ours if i["kind"] == "tensor")


def _flip(path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def _causes(exc: BaseException) -> list:
    causes = getattr(exc, "failures", {0: exc})  # DCP wraps each rank's failure
    return [c[0] if isinstance(c, tuple) else c for c in causes.values()]


def test_flipped_tensor_byte(tmp_path):
    """datastates' reader and verify: CorruptCheckpointError. DCP's stock reader has no checksum
    (torch.load does not check a stored record's CRC-32): it loads the damaged value."""
    saved = save(tmp_path / "c")
    _, ours = _frames(tmp_path / "c")
    info = next(i for x, i in ours if x.fqn == "model.w")
    _flip(tmp_path / "c" / info["file"], info["offset"] + 8)
    with pytest.raises(BaseException) as caught:
        dcp.load(zeros_like(saved), storage_reader=DatastatesReader(tmp_path / "c"), no_dist=True)
    assert any(
        isinstance(c, datastates.CorruptCheckpointError) and "checksum" in str(c)
        for c in _causes(caught.value)
    )
    with pytest.raises(datastates.CorruptCheckpointError, match="checksum"):
        verify_folder(tmp_path / "c")
    fresh = zeros_like(saved)
    dcp.load(fresh, checkpoint_id=str(tmp_path / "c"), no_dist=True)
    assert not torch.equal(fresh["model"]["w"], saved["model"]["w"])  # documented: no check


@pytest.mark.parametrize("where", ["head", "tail"])
def test_damaged_frame(tmp_path, where):
    """A byte of a frame outside the tensor: verify names it; datastates' reader, which reads the
    tensor region only, still loads the saved values."""
    saved = save(tmp_path / "c")
    _, ours = _frames(tmp_path / "c")
    info = next(i for x, i in ours if x.fqn == "model.w")
    frame = info["frame"]
    at = frame["offset"] + 20 if where == "head" else frame["offset"] + frame["length"] - 30
    _flip(tmp_path / "c" / info["file"], at)
    with pytest.raises(datastates.CorruptCheckpointError, match="frame"):
        verify_folder(tmp_path / "c")
    fresh = zeros_like(saved)
    dcp.load(fresh, storage_reader=DatastatesReader(tmp_path / "c"), no_dist=True)
    assert_bits(fresh["model"]["w"], saved["model"]["w"], "w")


def test_damaged_stock_metadata(tmp_path):
    save(tmp_path / "c")
    _flip(tmp_path / "c" / ".metadata", 40)
    with pytest.raises(datastates.CorruptCheckpointError, match=r"\.metadata"):
        verify_folder(tmp_path / "c")
    os.remove(tmp_path / "c" / ".metadata")
    with pytest.raises(datastates.CorruptCheckpointError, match="missing"):
        verify_folder(tmp_path / "c")


def run(mode: str, root, world: int) -> None:
    port = free_port()
    procs = [
        subprocess.Popen(
            [sys.executable, os.path.join(HERE, "native_dcp_worker.py"), mode, str(root)],
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
    assert os.path.exists(os.path.join(os.path.dirname(root), f"{mode}-ok-{world}"))


@pytest.mark.slow
def test_stock_load_two_ranks(tmp_path):
    """2 gloo ranks save DTensor shards through DatastatesWriter; 2 ranks load them with stock
    dcp.load(checkpoint_id=...); dcp_to_torch_save gives the full tensors."""
    sys.path.insert(0, HERE)
    from dcp_worker import full_state

    root = tmp_path / "c"
    run("save", root, 2)
    assert sorted(f for f in os.listdir(root) if f.endswith(".dsf")) == [
        fmt.shard_file_name(0),
        fmt.shard_file_name(1),
    ]
    run("load", root, 2)
    verify_folder(root)
    dcp_to_torch_save(root, tmp_path / "out.pt")
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    for k, v in full_state(7).items():
        assert_bits(out["model"][k], v, k)
    assert out["extra"] == {"step": 7}


GOLDEN = os.path.join(HERE, os.pardir, "data", "golden")


def _golden_state() -> dict:
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "make_golden_dcp", os.path.join(GOLDEN, "make_golden_dcp.py")
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.golden_dcp_state()


@pytest.mark.parametrize("version", [2, 3])
def test_golden_folders_read_by_datastates(version):
    """A folder of each version DatastatesWriter wrote (tests/data/golden/dcp-vN): datastates'
    reader loads it bit-exactly and verify accepts it."""
    path = os.path.join(GOLDEN, f"dcp-v{version}")
    want = _golden_state()
    fresh = zeros_like(want)
    dcp.load(fresh, storage_reader=DatastatesReader(path), no_dist=True)
    for k, v in want["model"].items():
        assert_bits(fresh["model"][k], v, k)
    assert fresh["extra"] == want["extra"]
    assert verify_folder(path) == os.path.getsize(os.path.join(path, fmt.shard_file_name(0)))


def test_golden_v3_read_by_stock_dcp(tmp_path):
    want = _golden_state()
    path = os.path.join(GOLDEN, "dcp-v3")
    fresh = zeros_like(want)
    dcp.load(fresh, checkpoint_id=path, no_dist=True)
    for k, v in want["model"].items():
        assert_bits(fresh["model"][k], v, k)
    dcp_to_torch_save(path, tmp_path / "out.pt")
    out = torch.load(tmp_path / "out.pt", weights_only=True)
    for k, v in want["model"].items():
        assert_bits(out["model"][k], v, k)
    assert out["extra"] == want["extra"]

"""The restore read path: stepped, vectored reads straight into the destinations, every byte
verified as it lands; damage anywhere (across step and checksum-piece boundaries) is caught."""

from __future__ import annotations

import json
import os

import pytest
import torch

import datastates
from datastates import CorruptCheckpointError
from datastates.restore import reads
from datastates.restore.reads import Checker, coalesce, group_limit, steps
from datastates.restore.plan import Read
from datastates.storage.store import LOCAL, ReadFile
from testkit import SMALL

# The SMALL cache's 16 KiB units: a tensor spans several checksum pieces, and pieces span
# several read steps.


def make_state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "big": torch.randn(40_000, generator=g),  # 160 KB: 10+ pieces
        "many": [torch.randn(3, generator=g) for _ in range(1500)],  # > _MAX_IOV buffers
        "ints": torch.randint(-9, 9, (7, 333), generator=g),
        "half": torch.randn(1001, generator=g).to(torch.bfloat16),
    }


def zeros_like(state: dict) -> dict:
    return {
        "big": torch.zeros(40_000),
        "many": [torch.zeros(3) for _ in range(1500)],
        "ints": torch.zeros(7, 333, dtype=torch.int64),
        "half": torch.zeros(1001, dtype=torch.bfloat16),
    }


def assert_equal(a: dict, b: dict) -> None:
    assert torch.equal(a["big"], b["big"]) and torch.equal(a["ints"], b["ints"])
    assert torch.equal(a["half"].view(torch.int16), b["half"].view(torch.int16))
    assert all(torch.equal(x, y) for x, y in zip(a["many"], b["many"]))


SMALL_STEP = 4096 * 3 + 77


@pytest.fixture
def small_steps(monkeypatch):
    """Read steps of an odd size, so steps cut through tensors and checksum pieces."""
    monkeypatch.setattr(ReadFile, "step_bytes", SMALL_STEP)
    monkeypatch.setattr(reads, "MAX_IOV", 64)


@pytest.fixture
def saved(tmp_path):
    state = make_state(3)
    with datastates.Checkpointer(tmp_path, SMALL) as ck:
        ck.save(state, step=1).wait(60)
    return tmp_path, state


@pytest.mark.parametrize("threads", [1, 4])
def test_round_trip_with_small_steps(saved, small_steps, threads):
    root, state = saved
    live = zeros_like(state)
    cfg = SMALL.replace(reader_threads=threads)
    with datastates.Checkpointer(root, cfg) as ck:
        report = ck.restore(live, step=1)
        loaded = ck.load(step=1)
    assert_equal(live, state)
    assert_equal(loaded, state)
    assert report.nbytes == sum(
        t.numel() * t.element_size()
        for t in [state["big"], state["ints"], state["half"], *state["many"]]
    )


def test_round_trip_default_steps_subset_of_keys(saved):
    root, state = saved
    live = zeros_like(state)
    with datastates.Checkpointer(root, SMALL) as ck:
        ck.restore(live, step=1, keys=["big", "half"], strict=False)
    assert torch.equal(live["big"], state["big"])
    assert torch.equal(live["half"].view(torch.int16), state["half"].view(torch.int16))
    assert not live["ints"].any() and not any(t.any() for t in live["many"])


def _tensor_entry(root, key: str) -> tuple[str, dict]:
    ckpt = os.path.join(root, "step-0000000001")
    with open(os.path.join(ckpt, "manifest.json")) as f:
        manifest = json.load(f)
    entry = next(e for e in manifest["entries"] if e["key"] == key)
    return os.path.join(ckpt, manifest["files"][entry["shards"][0]["file"]]["name"]), entry


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize("where", ["first", "last", "piece-edge", "step-edge", "middle"])
def test_a_flipped_byte_anywhere_is_caught(saved, small_steps, where):
    root, state = saved
    path, entry = _tensor_entry(root, "big")
    shard = entry["shards"][0]
    first_piece = shard["checksums"][0][0]
    pos = {
        "first": 0,
        "last": shard["nbytes"] - 1,
        "piece-edge": first_piece,
        "step-edge": SMALL_STEP - 1,
        "middle": shard["nbytes"] // 2,
    }[where]
    _flip(path, shard["offset"] + pos)
    live = zeros_like(state)
    with datastates.Checkpointer(root, SMALL) as ck:
        with pytest.raises(CorruptCheckpointError, match=r"checksum mismatch for 'big'") as exc:
            ck.restore(live, step=1)
        assert path in str(exc.value)
        # verify=False reads what is there: the damaged byte, and nothing else differs
        ck.restore(live, step=1, verify=False)
    diff = (live["big"].view(torch.uint8) != state["big"].view(torch.uint8)).nonzero()
    assert diff.flatten().tolist() == [pos]


def test_truncated_file_is_corrupt_not_short(saved, small_steps):
    root, state = saved
    path, entry = _tensor_entry(root, "big")
    shard = entry["shards"][0]
    # Keep the header readable but cut the file inside the tensor's bytes.
    os.truncate(path, shard["offset"] + shard["nbytes"] // 2)
    with datastates.Checkpointer(root, SMALL) as ck:
        with pytest.raises(CorruptCheckpointError):
            ck.restore(zeros_like(state), step=1)


def _read(nbytes: int, checksums, offset: int = 0, key: str = "k") -> Read:
    return Read(0, offset, nbytes, torch.zeros(nbytes, dtype=torch.uint8), checksums, key)


def test_checker_refuses_pieces_that_do_not_cover_the_region():
    data = memoryview(bytes(range(100)))
    crc = datastates.format.codec.crc32(data[:60])
    short = Checker(_read(100, [[60, crc]]), "f")
    with pytest.raises(CorruptCheckpointError, match="cover 60 of 100 bytes"):
        short.feed(data)
    long = Checker(_read(60, [[60, crc], [5, 0]]), "f")
    long.feed(data[:60])
    with pytest.raises(CorruptCheckpointError, match="cover 65 of 60 bytes"):
        long.finish()
    with pytest.raises(CorruptCheckpointError, match="invalid checksum piece"):
        Checker(_read(60, [[-60, crc]]), "f")


def test_checker_accepts_any_split_of_the_bytes():
    data = memoryview(bytes(range(256)) * 40)
    pieces = [
        [1000, datastates.format.codec.crc32(data[:1000])],
        [0, 0],
        [9240, datastates.format.codec.crc32(data[1000:])],
    ]
    for cut in (1, 999, 1000, 1001, 5000, 10_239):
        check = Checker(_read(10_240, pieces), "f")
        check.feed(data[:cut])
        check.feed(data[cut:])
        check.finish()


def test_steps_cover_the_group_in_order_with_gaps():
    group = [_read(700, [], 0), _read(1500, [], 800), _read(10, [], 2400)]
    covered, expect_offset = [], 0
    for offset, segments in steps(group, 1000):
        assert offset == expect_offset
        size = sum(v.nbytes for _, v in segments)
        assert size <= 1000
        covered += [(i, v.nbytes) for i, v in segments]
        expect_offset += size
    assert expect_offset == 2410
    merged: dict = {}
    for i, n in covered:
        merged[i] = merged.get(i, 0) + n
    assert merged == {0: 700, 1: 1500, 2: 10, -1: 100 + 100}


def test_group_limit_gives_every_thread_work():
    regions = [_read(1 << 20, [], i << 20) for i in range(64)]  # 64 MiB in all
    limit = group_limit(regions, threads=4)
    assert len(coalesce(regions, limit)) >= 4
    huge = Read(0, 0, 1 << 30, torch.zeros(1, dtype=torch.uint8), [], "k")  # only nbytes used
    assert group_limit([huge], threads=4) == reads.MAX_RUN


def test_cli_verify_reads_every_byte_and_names_a_damaged_one(saved, small_steps, capsys):
    from datastates.tools import cli

    root, state = saved
    assert cli.main(["verify", str(root)]) == 0
    # verify re-reads every byte of every shard file (header, data, padding, index)
    total = sum(p.stat().st_size for p in root.rglob("*.dsf"))
    assert total > sum(
        t.numel() * t.element_size()
        for t in [state["big"], state["ints"], state["half"], *state["many"]]
    )
    assert f"{total} bytes verified" in capsys.readouterr().out
    path, entry = _tensor_entry(root, "ints")
    _flip(path, entry["shards"][0]["offset"] + 100)
    assert cli.main(["verify", str(root)]) == 1
    assert "checksum mismatch for 'ints'" in capsys.readouterr().err


def test_local_reads_step_by_one_mib_and_object_reads_by_eight():
    """A local step stays in the CPU cache while it is checksummed; a ranged GET is a round trip,
    so object-store reads take larger steps."""
    from datastates.storage.s3 import S3ReadFile

    local = LOCAL.open_read(__file__)
    try:
        assert local.step_bytes == 1 << 20
    finally:
        local.close()
    assert S3ReadFile.step_bytes == 8 << 20


def test_a_large_region_is_cut_at_its_checksum_pieces():
    """A region larger than a run is cut into parts of whole pieces: each part views the same
    destination bytes, carries its own pieces and says where it starts in the tensor."""
    data = torch.arange(250, dtype=torch.float32)
    raw = data.view(torch.uint8)
    pieces = [
        [100, datastates.format.codec.crc32(raw[i : i + 100].numpy())] for i in range(0, 1000, 100)
    ]
    region = Read(3, 5000, 1000, data, pieces, "w")
    parts = reads.split_at_pieces([region], 250)
    assert [(p.offset, p.nbytes, p.base) for p in parts] == [
        (5000 + i, 200, i) for i in range(0, 1000, 200)
    ]
    assert [p.checksums for p in parts] == [pieces[i : i + 2] for i in range(0, 10, 2)]
    assert all(
        p.dest.data_ptr() == data.data_ptr() + p.base and p.file == 3 and p.key == "w"
        for p in parts
    )
    for p in parts:  # each part checks against its own pieces
        check = Checker(p, "f")
        check.feed(memoryview(raw[p.base : p.base + p.nbytes].numpy()))
        check.finish()
    # left whole: small enough, one piece, pieces not covering it, a non-contiguous destination
    assert reads.split_at_pieces([region], 1000) == [region]
    one = Read(0, 0, 1000, data, [[1000, 0]], "w")
    bad = Read(0, 0, 1000, data, pieces[:-1], "w")
    strided = Read(0, 0, 1000, torch.zeros(500)[::2], pieces, "w")
    assert reads.split_at_pieces([one, bad, strided], 250) == [one, bad, strided]


@pytest.fixture
def small_runs(monkeypatch):
    """Runs of 40 KiB: "big" (160 KB in 16 KiB pieces) is read as several parts."""
    monkeypatch.setattr(reads, "MIN_RUN", 40 << 10)
    monkeypatch.setattr(reads, "MAX_RUN", 40 << 10)


@pytest.mark.parametrize("threads", [1, 4])
def test_a_tensor_read_in_parts_round_trips_and_names_the_damaged_bytes(
    saved, small_steps, small_runs, monkeypatch, threads
):
    root, state = saved
    cfg = SMALL.replace(reader_threads=threads)
    live = zeros_like(state)
    split, parts = reads.split_at_pieces, []

    def recording(regions, limit):
        out = split(regions, limit)
        parts.extend(out)
        return out

    monkeypatch.setattr(reads, "split_at_pieces", recording)
    with datastates.Checkpointer(root, cfg) as ck:
        ck.restore(live, step=1)
    assert_equal(live, state)
    assert len([p for p in parts if p.key == "big"]) >= 4  # read as parts of whole pieces
    path, entry = _tensor_entry(root, "big")
    shard = entry["shards"][0]
    piece = shard["checksums"][0][0]
    assert len(shard["checksums"]) >= 8 and shard["nbytes"] > 2 * (40 << 10)
    pos = 5 * piece + 7  # inside the sixth piece, in the second or third part
    _flip(path, shard["offset"] + pos)
    with datastates.Checkpointer(root, cfg) as ck:
        with pytest.raises(CorruptCheckpointError) as exc:
            ck.restore(zeros_like(state), step=1)
    assert (
        f"checksum mismatch for 'big' in bytes [{5 * piece}, {6 * piece}) of the tensor "
        f"(file offset {shard['offset'] + 5 * piece})" in str(exc.value)
    )


@pytest.mark.parametrize("threads", [1, 4])
@pytest.mark.parametrize("where", ["first", "piece-edge", "middle", "last"])
def test_verify_in_spans_finds_a_flipped_byte_anywhere(
    saved, small_steps, monkeypatch, threads, where
):
    """verify_all reads the pieces in spans, several at once, through one small buffer per
    thread: a flipped byte anywhere is named with its tensor bytes and file offset."""
    from datastates.restore import verify as verify_mod
    from datastates.restore.reader import Reader

    monkeypatch.setattr(verify_mod, "SPAN_BYTES", 40 << 10)
    root, _ = saved
    path, entry = _tensor_entry(root, "big")
    shard = entry["shards"][0]
    piece = shard["checksums"][0][0]
    ckpt = os.path.join(root, "step-0000000001")
    with Reader(ckpt, registry=datastates.ProviderRegistry.default(), threads=threads) as r:
        assert r.verify_all() == os.path.getsize(path)
    pos = {
        "first": 0,
        "piece-edge": piece,
        "middle": shard["nbytes"] // 2,
        "last": shard["nbytes"] - 1,
    }[where]
    start = pos // piece * piece
    _flip(path, shard["offset"] + pos)
    with Reader(ckpt, registry=datastates.ProviderRegistry.default(), threads=threads) as r:
        with pytest.raises(CorruptCheckpointError) as exc:
            r.verify_all()
    assert f"checksum mismatch for 'big' in bytes [{start}, " in str(exc.value)
    assert f"(file offset {shard['offset'] + start})" in str(exc.value)


def test_verify_of_a_truncated_file_is_corrupt(saved):
    from datastates.restore.reader import Reader

    root, _ = saved
    path, entry = _tensor_entry(root, "big")
    with open(path, "rb") as f:
        data = f.read()
    ckpt = os.path.join(root, "step-0000000001")
    shard = entry["shards"][0]
    with open(path, "wb") as f:  # the tail (index and all) moved inside the tensor's bytes
        f.write(data[: shard["offset"] + 100] + data[-4096:])
    with Reader(ckpt, registry=datastates.ProviderRegistry.default()) as r:
        with pytest.raises(CorruptCheckpointError):
            r.verify_all()

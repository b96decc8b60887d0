"""Restores that read part of a saved shard, or write into live tensors torch cannot view as bytes.

The format bounds checksum pieces in bytes only (docs/format.md: pieces of length >= 1 summing to
the region's bytes), so a spec-valid checkpoint may split a tensor's bytes inside an element; a
restore reading some rows of such a shard must still land them bit-exact. A contiguous live tensor
may carry any stride in a dimension of size 1, which ``Tensor.view(torch.uint8)`` refuses: a restore
into one (a ``TensorShard`` box of a checkpoint saved at another world size) fills it all the same.
"""

from __future__ import annotations

import json
import os
import pathlib
import struct
import threading

import pytest
import torch

import datastates
from datastates import Checkpointer, CheckpointConfig, TensorShard
from datastates.format import codec as fmt
from datastates.format import zipframe
from datastates.commit.round import MemoryStore, StoreCommunicator
from datastates.providers import ProviderRegistry
from datastates.restore.reader import Reader

NAME = "step-0000000001"


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(
            a.contiguous().reshape(-1).view(torch.uint8),
            b.contiguous().reshape(-1).view(torch.uint8),
        )
    )


# ---------------------------------------------------------------- forged checksum pieces


def _read(path: str) -> bytes:
    return pathlib.Path(path).read_bytes()


def _write(path: str, data: bytes) -> None:
    pathlib.Path(path).write_bytes(data)


def _split_pieces(ckpt_dir: str, key: str, cuts: list[int]) -> list[list[int]]:
    """Rewrite the checksum pieces of ``key`` (one shard, in file 0) so that they end at the byte
    positions ``cuts`` (then at the end), with correct CRCs, in the shard file's index and in the
    manifest alike, header, index CRC and manifest checksum made valid: what a writer with other
    piece boundaries would have written. Returns the new pieces."""
    manifest_path = os.path.join(ckpt_dir, fmt.MANIFEST)
    manifest = json.loads(_read(manifest_path))
    del manifest["manifest_crc32"]
    entry = next(e for e in manifest["entries"] if e["key"] == key)
    shard = entry["shards"][0]
    shard_path = os.path.join(ckpt_dir, manifest["files"][shard["file"]]["name"])
    data = _read(shard_path)
    region = data[shard["offset"] : shard["offset"] + shard["nbytes"]]
    bounds = [0, *cuts, len(region)]
    pieces = [[end - start, fmt.crc32(region[start:end])] for start, end in zip(bounds, bounds[1:])]
    shard["checksums"] = pieces
    v3 = data.startswith(b"PK\x03\x04")  # version 3: the header at 64, a tail after the index
    index_offset, index_length = struct.unpack_from("<QQ", data, 64 * v3 + 16)
    index = json.loads(data[index_offset : index_offset + index_length])
    next(e for e in index["entries"] if e["key"] == key)["checksums"] = pieces
    raw_index = fmt.encode_json(index)
    body = data[fmt.HEADER_BYTES : index_offset] + raw_index
    if v3:  # the index record's local header, before the index, names its length and CRC
        body = (
            body[: index_offset - 64 - fmt.HEADER_BYTES]
            + zipframe.local_header(zipframe.INDEX_RECORD, len(raw_index), 64, fmt.crc32(raw_index))
            + body[index_offset - fmt.HEADER_BYTES :]
        )
        tail = data[fmt.align_up(index_offset + index_length, 64) :]
        tail_at = fmt.align_up(index_offset + len(raw_index), 64)
        first = struct.unpack_from("<I", data, 120)[0]  # tensor 0's local header ends the block
        data = (
            fmt.pack_header_v3(
                index_offset,
                raw_index,
                tail_at,
                tail,
                data[fmt.HEADER_BYTES - first : fmt.HEADER_BYTES],
            )
            + body
            + bytes(tail_at - index_offset - len(raw_index))
            + tail
        )
    else:
        data = fmt.pack_header(index_offset, raw_index) + body
    _write(shard_path, data)
    manifest["files"][shard["file"]].update(nbytes=len(data), index_crc32=fmt.crc32(raw_index))
    _write(manifest_path, fmt.seal_manifest(fmt.encode_json(manifest)))
    return pieces


def _reader(ckpt_dir: str) -> Reader:
    return Reader(ckpt_dir, registry=ProviderRegistry.default(), threads=2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.int64])
def test_rows_of_a_shard_split_inside_elements_restore_bit_exact(tmp_path, dtype):
    """Pieces ending at bytes 5 and 35 (inside elements): a TensorShard of rows 1-3 reads the pieces
    covering them and gets exactly those rows; the whole tensor loads bit-exact; verify passes."""
    saved = (torch.arange(24, dtype=torch.float64) * 1.25 - 7).to(dtype).reshape(6, 4)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save({"w": saved}, step=1).wait(60)
    ckpt_dir = str(tmp_path / NAME)
    pieces = _split_pieces(ckpt_dir, "w", [5, 35])
    assert [length for length, _ in pieces] == [5, 30, saved.numel() * saved.element_size() - 35]
    with _reader(ckpt_dir) as r:
        assert r.verify_all() == sum(f.nbytes for f in r.manifest.files)
        assert _same_bits(r.load()["w"], saved)
        local = torch.zeros(3, 4, dtype=dtype)
        report = r.restore_into({"w": TensorShard(local, (6, 4), (1, 0))})
    assert report.restored == ["w"]
    assert _same_bits(local, saved[1:4])


def test_a_damaged_piece_of_split_rows_is_still_found(tmp_path):
    """The widened read is verified: a flipped byte inside the piece that holds the rows (but
    outside the rows restored) raises CorruptCheckpointError, and names the key."""
    saved = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save({"w": saved}, step=1).wait(60)
    ckpt_dir = str(tmp_path / NAME)
    _split_pieces(ckpt_dir, "w", [5, 35])
    offset = json.loads(_read(os.path.join(ckpt_dir, fmt.MANIFEST)))["entries"][0]["shards"][0][
        "offset"
    ]
    shard_path = os.path.join(ckpt_dir, fmt.shard_file_name(0))
    data = bytearray(_read(shard_path))
    data[offset + 6] ^= 0xFF  # byte 6: in the piece [5, 35), before row 1 (byte 16)
    _write(shard_path, bytes(data))
    local = torch.zeros(3, 4)
    with _reader(ckpt_dir) as r:
        with pytest.raises(datastates.CorruptCheckpointError, match="'w'"):
            r.restore_into({"w": TensorShard(local, (6, 4), (1, 0))})


# ---------------------------------------------------------------- live tensors of odd strides


def _save_two_ranks(root: str, full: torch.Tensor) -> None:
    """Two ranks (threads joined by one in-process store) save the rows of ``full`` as
    TensorShards, one row each."""
    store, errors = MemoryStore(), []

    def rank(r: int) -> None:
        try:
            comm = StoreCommunicator(store, r, 2, "run")
            with Checkpointer(root, CheckpointConfig(), communicator=comm) as ckpt:
                row = full[r : r + 1].clone()
                ckpt.save({"w": TensorShard(row, tuple(full.shape), (r, 0))}, step=1).wait(60)
        except BaseException as exc:  # reported by the test
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.int64])
def test_box_with_odd_strides_restored_from_another_world_size(tmp_path, dtype):
    """Saved by 2 ranks (one row each), restored by one process into TensorShard boxes whose
    local tensors are contiguous views of size 1 with a stride of 4 in their last dimension
    (``base.t()[i:i+1, :1]``), which ``view(torch.uint8)`` refuses: each box gets its row, in
    the live memory, bit-exact, and nothing else of ``base`` changes."""
    full = torch.tensor([[1.5], [-2.25]]).to(dtype)
    _save_two_ranks(str(tmp_path), full)
    base = torch.zeros(2, 4, dtype=dtype)
    boxes = {f"row{r}": base.t()[r + 1 : r + 2, :1] for r in range(2)}
    assert all(b.is_contiguous() and b.stride() == (1, 4) for b in boxes.values())
    with Checkpointer(tmp_path) as ckpt:
        for r, (key, box) in enumerate(boxes.items()):
            report = ckpt.restore({"w": TensorShard(box, (2, 1), (r, 0))})
            assert report.restored == ["w"], key
    expected = torch.zeros(2, 4, dtype=dtype)
    expected[0, 1], expected[0, 2] = full[0, 0], full[1, 0]
    assert _same_bits(base, expected)


def test_plain_tensor_with_odd_strides_restored_in_place(tmp_path):
    """The same holds without resharding: a one-element fp16 live tensor of stride 4."""
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save({"w": torch.tensor([[3.5]], dtype=torch.float16)}, step=1).wait(60)
        base = torch.zeros(2, 4, dtype=torch.float16)
        live = base.t()[3:4, :1]
        ckpt.restore({"w": live})
    assert live.data_ptr() == base[0, 3:].data_ptr()
    assert base[0, 3].item() == 3.5 and int((base != 0).sum()) == 1


def test_a_damaged_row_read_names_the_bytes_of_the_tensor(tmp_path):
    """A resharded read of some rows starts at a checksum piece inside the tensor: a mismatch
    names that piece's bytes of the tensor (not bytes counted from the read) and its offset in
    the file."""
    saved = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    with Checkpointer(tmp_path) as ckpt:
        ckpt.save({"w": saved}, step=1).wait(60)
    d = str(tmp_path / NAME)
    _split_pieces(d, "w", [5, 35])  # pieces [0, 5), [5, 35), [35, 96)
    with open(os.path.join(d, fmt.MANIFEST)) as f:
        offset = json.load(f)["entries"][0]["shards"][0]["offset"]
    path = os.path.join(d, fmt.shard_file_name(0))
    with open(path, "r+b") as f:
        f.seek(offset + 6)
        byte = f.read(1)
        f.seek(offset + 6)
        f.write(bytes([byte[0] ^ 0xFF]))
    with _reader(d) as reader:  # rows 1..3 (bytes [16, 64)) need the pieces from byte 5 on
        with pytest.raises(datastates.CorruptCheckpointError) as exc:
            reader.restore_into({"w": TensorShard(torch.zeros(3, 4), (6, 4), (1, 0))})
    assert f"in bytes [5, 35) of the tensor (file offset {offset + 5})" in str(exc.value)

"""A rank's shard file is also a ``torch.save`` archive (docs/format.md, "Shard file version 3"):
``torch.load(shard, weights_only=True, mmap=True)`` returns the rank's state, tensors
bit-equal, while datastates' own readers keep every check."""

from __future__ import annotations

import argparse
import collections
import enum
import os
import pickle
import re
import zipfile

import pytest
import torch

import datastates
from datastates import Checkpointer, CheckpointConfig, CorruptCheckpointError
from datastates.restore.reader import Reader


def _state():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 6), torch.nn.LayerNorm(6))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(3, 8)).sum().backward()
    opt.step()
    extra = {
        "u16": torch.arange(7).to(torch.uint16),
        "bf": torch.randn(5).to(torch.bfloat16),
        "f8": torch.randn(4).to(torch.float8_e4m3fn),
        "empty": torch.empty(0, 3),
        "big": torch.randn(3000),
        "c": torch.randn(2, 2, dtype=torch.complex64),
        "od": collections.OrderedDict(a=torch.ones(2)),
        "tup": (1, "x", torch.zeros(1)),
        "obj": {1, 2},
        "n": 3,
        "s": "text",
        "f": 0.5,
        "none": None,
    }
    return model, opt, {"model": model, "optimizer": opt, "extra": extra}


def _shard(tmp_path, state, **config) -> str:
    with Checkpointer(tmp_path, CheckpointConfig(**config)) as ckpt:
        ckpt.save(state, step=1).wait()
    return os.path.join(tmp_path, "step-0000000001", "rank-00000.dsf")


def _equal(a, b) -> bool:
    """Bit-equal tensors (NaN-safe), by bytes."""
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and bytes(a.reshape(-1).contiguous().view(torch.uint8).numpy())
        == bytes(b.reshape(-1).contiguous().view(torch.uint8).numpy())
    )


@pytest.mark.parametrize("mmap", [True, False])
def test_torch_load_reads_a_shard_file_as_the_rank_state(tmp_path, mmap):
    model, opt, state = _state()
    # small units: tensors cross unit boundaries, slots lie in other units than their data
    path = _shard(tmp_path, state, host_cache_bytes=16384, chunk_bytes=4096)
    got = torch.load(path, weights_only=True, mmap=mmap)
    assert set(got) == {"model", "optimizer", "extra"}
    for key, value in model.state_dict().items():
        assert _equal(got["model"][key], value), key
    for p, s in opt.state_dict()["state"].items():
        for name, value in s.items():
            assert _equal(got["optimizer"]["state"][p][name], value), (p, name)
    assert got["optimizer"]["param_groups"][0]["lr"] == opt.param_groups[0]["lr"]
    extra = got["extra"]
    for key in ("u16", "bf", "f8", "empty", "big", "c"):
        assert _equal(extra[key], state["extra"][key]), key
    assert type(extra["od"]) is collections.OrderedDict and _equal(extra["od"]["a"], torch.ones(2))
    assert extra["tup"][:2] == (1, "x") and _equal(extra["tup"][2], torch.zeros(1))
    assert (extra["n"], extra["s"], extra["f"], extra["none"]) == (3, "text", 0.5, None)
    assert extra["obj"] == {1, 2}  # an object: as torch.save pickles it


class _Stage(enum.IntEnum):
    TWO = 2


def test_objects_are_pickled_as_torch_save_pickles_them(tmp_path):
    """An object leaf loads as it would from ``torch.save`` of the same state: a class the
    weights-only loader allows as its value, another refused by that loader naming its class
    (and loaded once allowed, or with ``weights_only=False``)."""
    args = argparse.Namespace(lr=0.1, name="run")
    state = {"shape": torch.Size([3, 4]), "stage": _Stage.TWO, "args": args, "t": torch.ones(2)}
    path = _shard(tmp_path, state, allow_unsafe_objects=True)
    with pytest.raises(pickle.UnpicklingError, match="Unsupported global") as ours:
        torch.load(path, weights_only=True)
    got = torch.load(path, weights_only=False, mmap=True)
    assert type(got["shape"]) is torch.Size and got["shape"] == torch.Size([3, 4])
    assert type(got["stage"]) is _Stage and got["stage"] == 2
    assert got["args"] == args and _equal(got["t"], torch.ones(2))
    with torch.serialization.safe_globals([argparse.Namespace, _Stage]):
        allowed = torch.load(path, weights_only=True)
    assert allowed["args"] == args and allowed["stage"] is _Stage.TWO
    torch.save(state, stock := os.path.join(tmp_path, "stock.pt"))
    with pytest.raises(pickle.UnpicklingError, match="Unsupported global") as theirs:
        torch.load(stock, weights_only=True)
    refused = re.compile(r"Unsupported global: GLOBAL (\S+)")
    found = refused.search(str(ours.value))
    assert found and found.group(1) == refused.search(str(theirs.value)).group(1)  # the same class


def _explode():
    raise RuntimeError("this object cannot be rebuilt")


class _Unloadable:
    def __reduce__(self):
        return (_explode, ())


def test_an_object_is_never_rebuilt_by_the_save_and_loads_as_from_torch_save(tmp_path):
    """The writer puts the object's pickle into the view as ``torch.save`` wrote it, without
    unpickling it: an object whose rebuilding fails (or does anything else) is not rebuilt by
    the save, and ``torch.load`` of the shard does what it does with a ``torch.save`` file."""
    state = {"bad": _Unloadable(), "t": torch.ones(3)}
    path = _shard(tmp_path, state, allow_unsafe_objects=True)  # the save commits
    torch.save(state, stock := os.path.join(tmp_path, "stock.pt"))
    for f in (path, stock):
        with pytest.raises(RuntimeError, match="cannot be rebuilt"):
            torch.load(f, weights_only=False)
        with pytest.raises(pickle.UnpicklingError, match="_explode"):
            torch.load(f, weights_only=True)


def test_an_object_holding_tensors_is_none_in_the_view_and_the_file_stays_weights_only(
    tmp_path, caplog
):
    """Pickled again, an object's tensors would carry their bytes inside the pickle through a
    function the weights-only loader refuses, and the whole file would be refused."""
    state = {"w": torch.ones(3), "obj": {(1, 2): torch.arange(4.0)}, "ok": {5, 6}}
    path = _shard(tmp_path, state, allow_unsafe_objects=True)
    got = torch.load(path, weights_only=True)
    assert got["obj"] is None and got["ok"] == {5, 6} and _equal(got["w"], torch.ones(3))
    assert "gives None for 'obj'" in caplog.text and "holds tensors" in caplog.text


def test_an_object_that_does_not_pickle_again_leaves_the_other_objects_in_the_view(
    tmp_path, caplog
):
    cyclic: list = []
    cyclic.append((cyclic,))  # a cycle through a tuple, inside a dict saved as an object
    deep: dict = {}
    inner = deep
    for _ in range(400):  # deeper than the pickler of plain trees goes
        inner[0] = {}
        inner = inner[0]
    state = {"cyc": {(1,): cyclic}, "deep": {(2,): deep}, "ok": {7}, "t": torch.ones(2)}
    path = _shard(tmp_path, state, allow_unsafe_objects=True)
    got = torch.load(path, weights_only=False)
    assert got["ok"] == {7} and _equal(got["t"], torch.ones(2))
    assert got["cyc"][(1,)][0][0] is got["cyc"][(1,)]  # the cycle kept
    assert "gives None for every object" not in caplog.text


def test_the_shard_file_is_a_valid_zip_archive_with_every_crc(tmp_path):
    _, _, state = _state()
    path = _shard(tmp_path, state, host_cache_bytes=16384, chunk_bytes=4096)
    with zipfile.ZipFile(path) as z:
        assert z.testzip() is None  # every record's CRC-32 in the central directory holds
        names = z.namelist()
        assert names[0] == "archive/.datastates/shard" and "archive/data.pkl" in names
        index = z.read("archive/.datastates/index")
        assert datastates.format.read_index(path).rank == 0 and index.startswith(b'{"format"')
    for info in zipfile.ZipFile(path).infolist():
        assert info.compress_type == zipfile.ZIP_STORED
        if info.filename.startswith("archive/data/"):
            with open(path, "rb") as f:  # the record's data is the tensor region itself
                f.seek(info.header_offset + 26)
                n, m = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
                assert (info.header_offset + 30 + n + m) % 64 == 0


def test_datastates_reads_and_verifies_version_3(tmp_path):
    model, _, state = _state()
    path = _shard(tmp_path, state, host_cache_bytes=16384, chunk_bytes=4096)
    with Checkpointer(tmp_path) as ckpt:
        loaded = ckpt.load()
    for key, value in model.state_dict().items():
        assert _equal(loaded["model"][key], value), key
    assert loaded["extra"]["obj"] == {1, 2}
    ckpt_dir = os.path.dirname(path)
    with Reader(ckpt_dir, registry=datastates.ProviderRegistry.default()) as r:
        assert r.verify_all() == os.path.getsize(path)


def _flip(path: str, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x40]))


@pytest.mark.parametrize("where", ["first_record", "header", "slot", "index_slot", "tail"])
def test_a_damaged_framing_byte_is_a_typed_error(tmp_path, where):
    """Bytes datastates' reading does not use (the local header slots) are still checked by
    ``verify``; the header, its first record and the tail by every reader."""
    _, _, state = _state()
    path = _shard(tmp_path, state)
    with zipfile.ZipFile(path) as z:
        infos = {i.filename: i for i in z.infolist()}
    offset = {
        "first_record": 10,
        "header": 90,
        "slot": infos["archive/data/1"].header_offset + 40,
        "index_slot": infos["archive/.datastates/index"].header_offset + 5,
        "tail": os.path.getsize(path) - 30,
    }[where]
    _flip(path, offset)
    ckpt_dir = os.path.dirname(path)
    with pytest.raises(CorruptCheckpointError):
        with Reader(ckpt_dir, registry=datastates.ProviderRegistry.default()) as r:
            r.verify_all()


def test_the_crc_of_pieces_is_the_crc_of_the_whole():
    import zlib

    from datastates.format import zipframe

    data = bytes(range(256)) * 300
    for cuts in ([], [1], [4096, 8192], [100, 101, 60000]):
        bounds = [0, *cuts, len(data)]
        pieces = [(b - a, zlib.crc32(data[a:b])) for a, b in zip(bounds, bounds[1:])]
        assert zipframe.crc_of_pieces(pieces) == zlib.crc32(data)
        crc = pieces[0][1]
        for length, piece in pieces[1:]:  # the Python fallback agrees
            crc = zipframe.crc32_combine(crc, piece, length)
        assert crc == zlib.crc32(data)


def test_objects_after_many_memo_entries_keep_their_shared_parts(tmp_path):
    """Each object's pickle goes in with its memo indexes moved past the enclosing pickle's
    (past 256: the long forms): shared parts inside an object stay shared, objects stay apart."""
    shared = [1, 2]
    state: dict = {f"k{i}": torch.full((2,), float(i)) for i in range(300)}
    state["a"] = {(1,): shared, (2,): shared}  # non-str keys: saved as an object
    state["b"] = {(3,): [shared, shared]}
    state["c"] = {"n": torch.Size([4, 5])}
    got = torch.load(_shard(tmp_path, state, allow_unsafe_objects=True), weights_only=False)
    assert got["a"][(1,)] is got["a"][(2,)] and got["a"][(1,)] == [1, 2]
    assert got["b"][(3,)][0] is got["b"][(3,)][1] and got["b"][(3,)][0] is not got["a"][(1,)]
    assert got["c"]["n"] == torch.Size([4, 5])
    for i in range(300):
        assert _equal(got[f"k{i}"], torch.full((2,), float(i)))

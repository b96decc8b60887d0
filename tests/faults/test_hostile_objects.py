"""A Python object region is a torch.save zip written by someone else. One with an intact CRC but
forged contents (a zip bomb, a tensor outside its storage, a storage record of the wrong size, an
allocation larger than the blob) is refused as CorruptCheckpointError naming the key, before the
loader does work out of proportion to the region: restore, load and export alike.

The blobs are built with ``zipfile`` and written into a real checkpoint's object region with
every checksum made valid (region CRC, index CRC, manifest seal), so only the object checks can
catch them."""

from __future__ import annotations

import io
import json
import os
import pickle
import sys
import zipfile

import pytest
import torch

import datastates
from datastates.format import codec as fmt
from datastates.format import serialization

from _integrity_helpers import (
    index_of,
    manifest_json,
    read_bytes,
    shard_file,
    with_index,
    write_bytes,
    write_sealed,
)
import zygote

# slow: forged pickles loaded under a memory bound (the zip bombs inflate to 512 MiB)
pytestmark = pytest.mark.slow

CONFIG = datastates.CheckpointConfig(host_cache_bytes=4 << 20, chunk_bytes=1 << 20)
REGION_PAD = 1 << 20  # the object region is a little over 1 MiB
BOMB_BYTES = 512 << 20  # what the bomb's data.pkl inflates to
NAME = fmt.step_name(1)


def fresh_state() -> dict:
    return {"w": torch.zeros(8), "obj": None}


def _one_object(root) -> None:
    state = {"w": torch.arange(8.0), "obj": bytes(REGION_PAD)}
    with datastates.Checkpointer(root, CONFIG) as ck:
        ck.save(state, step=1).wait(60)


@pytest.fixture
def ckpt(pristine, private_copy):
    return os.path.join(private_copy(pristine(_one_object)[0]), NAME)


# ---------------------------------------------------------------- forging a region


def object_entry(manifest: dict) -> dict:
    (entry,) = [e for e in manifest["entries"] if e["kind"] == "object"]
    return entry


def replace_object(ckpt: str, blob: bytes) -> str:
    """Write ``blob`` over the checkpoint's object region (same size) and make every checksum
    valid again; return the object's key."""
    manifest = manifest_json(ckpt)
    entry = object_entry(manifest)
    assert len(blob) == entry["nbytes"], (len(blob), entry["nbytes"])
    shard = bytearray(read_bytes(shard_file(ckpt)))
    shard[entry["offset"] : entry["offset"] + len(blob)] = blob
    _, raw_index = index_of(bytes(shard))
    index = json.loads(raw_index)
    for e in index["entries"]:
        if e["key"] == entry["key"]:
            e["crc32"] = fmt.crc32(blob)
    new_index = fmt.encode_json(index)
    new_shard = with_index(bytes(shard), new_index)
    write_bytes(shard_file(ckpt), new_shard)
    entry["crc32"] = fmt.crc32(blob)
    manifest["files"][0].update(nbytes=len(new_shard), index_crc32=fmt.crc32(new_index))
    write_sealed(ckpt, manifest)
    return entry["key"]


def region_size(ckpt: str) -> int:
    return object_entry(manifest_json(ckpt))["nbytes"]


def padded(blob: bytes, size: int) -> bytes:
    """``blob`` (a zip) grown to exactly ``size`` bytes by one more stored member."""
    name = "archive/pad"
    overhead = 30 + 46 + 2 * len(name)  # its local header and central directory entry
    out = io.BytesIO(blob)
    with zipfile.ZipFile(out, "a") as z:
        z.writestr(name, bytes(size - len(blob) - overhead))
    assert len(out.getvalue()) == size
    return out.getvalue()


def torch_archive(obj, patch=lambda pkl: pkl, method=zipfile.ZIP_STORED) -> bytes:
    """torch.save's archive of ``obj`` rewritten member by member, data.pkl through ``patch``."""
    source = zipfile.ZipFile(io.BytesIO(serialization.dumps(obj, "forge")))
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        for info in source.infolist():
            data = source.read(info.filename)
            is_pickle = info.filename.endswith("/data.pkl")
            z.writestr(
                info.filename,
                patch(data) if is_pickle else data,
                compress_type=method if is_pickle else zipfile.ZIP_STORED,
            )
    return out.getvalue()


def zip_bomb() -> bytes:
    """An archive whose deflated data.pkl inflates to BOMB_BYTES (about 1/1000 of that stored)."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        z.writestr("archive/version", "3\n", compress_type=zipfile.ZIP_STORED)
        zeros = bytes(16 << 20)
        with z.open("archive/data.pkl", "w", force_zip64=True) as f:
            f.write(b"\x80\x02")
            for _ in range(BOMB_BYTES // len(zeros)):
                f.write(zeros)
    return out.getvalue()


def set_byte(pkl: bytes, opcode_at: int, value: int) -> bytes:
    """The pickle with the one-byte operand of the opcode at ``opcode_at`` set to ``value``."""
    assert pkl[opcode_at : opcode_at + 1] == b"K"  # BININT1
    return pkl[: opcode_at + 1] + bytes([value]) + pkl[opcode_at + 2 :]


def operand_positions(pkl: bytes) -> list[int]:
    """Positions of the BININT1 opcodes of ``{"t": torch.arange(4)}``'s pickle, in order:
    storage numel, storage offset, size, stride."""
    import pickletools

    return [pos for op, _, pos in pickletools.genops(pkl) if op.name == "BININT1"]


def forged_tensor(which: str) -> bytes:
    """``{"t": torch.arange(4)}`` with one of its rebuild arguments forged."""

    def patch(pkl: bytes) -> bytes:
        numel, offset, size, stride = operand_positions(pkl)
        return {
            "size": lambda: set_byte(pkl, size, 200),
            "offset": lambda: set_byte(pkl, offset, 3),
            "numel": lambda: set_byte(pkl, numel, 200),
            "stride": lambda: set_byte(pkl, stride, 2),
        }[which]()

    return torch_archive({"t": torch.arange(4)}, patch)


def allocation(count: int) -> bytes:
    """An archive whose pickle calls bytearray(count) (allowed by torch's safe loader)."""

    class Alloc:
        def __reduce__(self):
            return (bytearray, (count,))

    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps(Alloc(), protocol=2))
        z.writestr("archive/version", "3\n")
    return out.getvalue()


# ---------------------------------------------------------------- readers, in a fresh process

_CHILD = r"""
import json, os, resource, sys
import torch, datastates
root, ckpt, out, trusted = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4] == "1"
def vm():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
hard = resource.getrlimit(resource.RLIMIT_AS)[1]
resource.setrlimit(resource.RLIMIT_AS, (vm() + (3 << 30), hard))  # a bound, for the old code
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
result = {}
def attempt(name, fn):
    try:
        fn()
        result[name] = ["ok", ""]
    except BaseException as exc:
        result[name] = [type(exc).__name__, str(exc)]
with datastates.Checkpointer(root) as ck:
    attempt("restore", lambda: ck.restore({"w": torch.zeros(8), "obj": None}, trusted=trusted))
    attempt("load", lambda: ck.load(trusted=trusted))
attempt("export", lambda: datastates.export(ckpt, out, to="torch", trusted=trusted))
result["rss_growth"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 - before
result["exported"] = os.path.exists(out)
print(json.dumps(result))
"""


def run_readers(ckpt: str, tmp_path, trusted: bool) -> dict:
    out = os.path.join(str(tmp_path), "export.pt")
    # a process of its own, forked from the session's zygote (tests/zygote.py): torch is
    # already imported; its memory growth is measured from its own start, as in a fresh one
    proc = zygote.run(
        [sys.executable, "-c", _CHILD, os.path.dirname(ckpt), ckpt, out, "1" if trusted else "0"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def assert_refused_everywhere(result: dict, key: str, *words: str) -> None:
    for reader in ("restore", "load", "export"):
        kind, message = result[reader]
        assert kind == "CorruptCheckpointError", (reader, kind, message)
        assert repr(key) in message, (reader, message)
        for word in words:
            assert word in message, (reader, message)
    assert not result["exported"]


@pytest.mark.parametrize("trusted", [False, True])
def test_zip_bomb_is_refused_with_bounded_memory(ckpt, tmp_path, trusted):
    key = replace_object(ckpt, padded(zip_bomb(), region_size(ckpt)))
    result = run_readers(ckpt, tmp_path, trusted)
    assert_refused_everywhere(result, key, "compressed")
    assert result["rss_growth"] < BOMB_BYTES // 8, result["rss_growth"]


@pytest.mark.parametrize(
    "which, words",
    [
        ("size", ["size (200,)", "needs 1600 bytes"]),
        ("offset", ["offset 3", "needs 56 bytes"]),
        ("stride", ["stride (2,)", "needs 56 bytes"]),
        ("numel", ["200 torch.LongStorage elements"]),
    ],
)
@pytest.mark.parametrize("trusted", [False, True])
def test_forged_tensor_rebuild_is_refused(ckpt, tmp_path, which, words, trusted):
    key = replace_object(ckpt, padded(forged_tensor(which), region_size(ckpt)))
    assert_refused_everywhere(run_readers(ckpt, tmp_path, trusted), key, *words)


def test_small_compressed_member_is_refused(ckpt, tmp_path):
    blob = torch_archive({"t": torch.arange(4)}, method=zipfile.ZIP_DEFLATED)
    key = replace_object(ckpt, padded(blob, region_size(ckpt)))
    assert_refused_everywhere(run_readers(ckpt, tmp_path, False), key, "compressed")


def test_allocation_larger_than_the_blob_is_refused(ckpt, tmp_path):
    key = replace_object(ckpt, padded(allocation(1 << 40), region_size(ckpt)))
    assert_refused_everywhere(run_readers(ckpt, tmp_path, False), key, "builtins.bytearray")


def test_an_honest_archive_rebuilt_by_hand_passes_and_loads(ckpt, tmp_path):
    """The forging itself is sound: an unforged tensor archive rebuilt the same way passes the
    checks and loads through every reader."""
    blob = padded(torch_archive({"t": torch.arange(4)}), region_size(ckpt))
    serialization.check_archive(blob, "obj")
    replace_object(ckpt, blob)
    result = run_readers(ckpt, tmp_path, False)
    assert [result[r][0] for r in ("restore", "load", "export")] == ["ok", "ok", "ok"], result


# ---------------------------------------------------------------- the checks on blobs alone


class _Sub(torch.Tensor):
    pass


@pytest.mark.parametrize(
    "obj",
    [
        [torch.arange(24.0).reshape(4, 6)[1:, 2:], torch.arange(24.0).reshape(4, 6).t()],
        torch.arange(10)[::3],
        torch.zeros(0, 5),
        torch.ones(3).expand(4, 3),
        torch.nn.Parameter(torch.ones(3)),
        torch.ones(5, dtype=torch.uint16)[2:],
        torch.ones(3, dtype=torch.float8_e4m3fn)[1:],
        torch.ones(2, dtype=torch.complex128),
        {("a", 1): "blob", "b": bytearray(b"xyz"), "s": torch.Size([3, 4])},
    ],
    ids=["views", "step", "empty", "expanded", "parameter", "uint16", "float8", "complex", "plain"],
)
def test_what_torch_save_writes_passes_the_checks(obj):
    blob = serialization.dumps(obj, "k")
    serialization.check_archive(blob, "k")
    back = serialization.loads(blob, "k")
    if isinstance(obj, torch.Tensor):
        assert back.dtype == obj.dtype and back.shape == obj.shape
        assert torch.equal(back.contiguous().view(torch.uint8), obj.contiguous().view(torch.uint8))
    elif isinstance(obj, list):
        assert all(torch.equal(a, b) for a, b in zip(back, obj))
    else:
        assert back == obj


def test_a_tensor_subclass_archive_passes_the_checks():
    blob = serialization.dumps(torch.arange(4.0).as_subclass(_Sub), "k")
    serialization.check_archive(blob, "k")
    assert torch.equal(serialization.loads(blob, "k", trusted=True), torch.arange(4.0))


@pytest.mark.parametrize(
    "blob, words",
    [
        (b"\x80\x02K\x01.", "not the zip archive"),
        (b"PK\x05\x06" + bytes(18), "expected one data.pkl"),
    ],
)
def test_blobs_that_are_not_torch_archives_are_refused(blob, words):
    with pytest.raises(datastates.CorruptCheckpointError, match=words):
        serialization.loads(blob, "extra/obj")

"""Helpers of the manifest/index integrity tests (imported by name): a small training state saved
once, the three readers (load, restore in place, verify) run on a damaged copy, a bound on the
address space so that a huge allocation fails the test instead of the machine."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import struct

import torch

import datastates
from datastates.format import codec as fmt
from datastates.format import zipframe
from datastates.providers import ProviderRegistry
from datastates.restore.reader import Reader

from _faults_helpers import assert_bit_exact

STEP = 7
NAME = "step-0000000007"


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 6))


def make_train_state() -> dict:
    """Model + AdamW after one step (exp_avg and exp_avg_sq of equal shapes), plain values such as
    epoch and lr, a bfloat16 tensor and a Python object (a blob)."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.001)
    model(torch.ones(2, 6)).sum().backward()
    opt.step()
    return {
        "model": model,
        "optim": opt,
        "extra": {
            "epoch": 3,
            "lr": 0.0025,
            "b": torch.arange(9).to(torch.bfloat16),
            "obj": {("a", 1): "blob"},
        },
    }


def fresh_train_state() -> dict:
    """A live state of the same structure to restore into (other values)."""
    model = make_model()
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()
    opt = torch.optim.AdamW(model.parameters(), lr=0.5)
    return {
        "model": model,
        "optim": opt,
        "extra": {"epoch": 0, "lr": 0.0, "b": torch.zeros(9, dtype=torch.bfloat16), "obj": None},
    }


def saved_view(state: dict) -> dict:
    """What a restore must reproduce, as plain comparable values."""
    return {
        "model": {k: v.detach().clone() for k, v in state["model"].state_dict().items()},
        "optim": _opt_tensors(state["optim"]),
        "lr": [g["lr"] for g in state["optim"].param_groups],
        "extra": dict(state["extra"]),
    }


def _opt_tensors(opt) -> dict:
    return {
        f"{i}/{k}": v.detach().clone() if isinstance(v, torch.Tensor) else v
        for i, st in opt.state_dict()["state"].items()
        for k, v in st.items()
    }


def save_pristine(root) -> tuple[dict, dict]:
    """Save step 6 and step 7 of the state; return (saved view, result of a pristine load)."""
    state = make_train_state()
    with datastates.Checkpointer(
        root, datastates.CheckpointConfig(host_cache_bytes=64 << 10, chunk_bytes=16 << 10)
    ) as ck:
        ck.save(state, step=STEP - 1).wait(60)
        ck.save(state, step=STEP).wait(60)
    return saved_view(state), load(os.path.join(root, NAME))


def reader(ckpt_dir: str, **kwargs) -> Reader:
    return Reader(ckpt_dir, registry=ProviderRegistry.default(), threads=2, **kwargs)


def load(ckpt_dir: str):
    with reader(ckpt_dir, trusted=True) as r:
        return r.load()


def restore(ckpt_dir: str) -> dict:
    """Restore into a fresh live state; return its view."""
    return saved_view(restore_live(ckpt_dir))


def restore_live(ckpt_dir: str) -> dict:
    live = fresh_train_state()
    with reader(ckpt_dir, trusted=True) as r:
        r.restore_into(live)
    return live


def verify(ckpt_dir: str) -> int:
    with reader(ckpt_dir, rank=0, world_size=1) as r:
        return r.verify_all()


def assert_same_view(actual: dict, expected: dict) -> None:
    assert_bit_exact(actual["model"], expected["model"], "model")
    assert_bit_exact(actual["optim"], expected["optim"], "optim")
    assert actual["lr"] == expected["lr"] and actual["extra"].keys() == expected["extra"].keys()
    for k, v in expected["extra"].items():
        assert_bit_exact(actual["extra"][k], v, f"extra/{k}")


# ---------------------------------------------------------------- bytes of a checkpoint


def manifest_path(ckpt_dir: str) -> str:
    return os.path.join(ckpt_dir, fmt.MANIFEST)


def shard_file(ckpt_dir: str) -> str:
    return os.path.join(ckpt_dir, fmt.shard_file_name(0))


def read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def write_bytes(path: str, data: bytes) -> None:
    with open(path, "wb") as f:
        f.write(data)


def manifest_json(ckpt_dir: str) -> dict:
    obj = json.loads(read_bytes(manifest_path(ckpt_dir)))
    del obj["manifest_crc32"]
    return obj


def write_sealed(ckpt_dir: str, obj) -> None:
    """Write a manifest with a valid checksum (a forged or buggy writer: what is tested is the
    validation of the fields, not the checksum)."""
    raw = json.dumps(obj, separators=(",", ":")).encode() if not isinstance(obj, bytes) else obj
    write_bytes(manifest_path(ckpt_dir), fmt.seal_manifest(raw))


def index_of(shard: bytes) -> tuple[int, bytes]:
    at = 64 if shard.startswith(b"PK\x03\x04") else 0  # a version-3 file's header is at 64
    offset, length = struct.unpack_from("<QQ", shard, at + 16)
    return offset, shard[offset : offset + length]


def with_index(shard: bytes, index: bytes) -> bytes:
    """The shard file with its index replaced and the header (index length, CRCs) made valid
    (of a version-3 file, its tail moved after the new index and its CRC made valid)."""
    offset, old = index_of(shard)
    if not shard.startswith(b"PK\x03\x04"):
        return fmt.pack_header(offset, index) + shard[fmt.HEADER_BYTES : offset] + index
    tail = shard[fmt.align_up(offset + len(old), 64) :]
    tail_at = fmt.align_up(offset + len(index), 64)
    first = struct.unpack_from("<I", shard, 120)[0]  # tensor 0's local header ends the block
    slot = zipframe.local_header(zipframe.INDEX_RECORD, len(index), 64, fmt.crc32(index))
    return (
        fmt.pack_header_v3(
            offset, index, tail_at, tail, shard[fmt.HEADER_BYTES - first : fmt.HEADER_BYTES]
        )
        + shard[fmt.HEADER_BYTES : offset - 64]
        + slot
        + index
        + bytes(tail_at - offset - len(index))
        + tail
    )


# ---------------------------------------------------------------- bounded memory


def _vm_bytes() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmSize in /proc/self/status")


@contextlib.contextmanager
def bounded_memory(extra: int = 2 << 30):
    """Limit the address space to what is mapped now plus ``extra``: an allocation sized by a
    damaged field (gigabytes) then fails loudly (MemoryError/RuntimeError) instead of passing."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = _vm_bytes() + extra
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))

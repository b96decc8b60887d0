"""Every shard file and manifest version datastates wrote is still read bit-exactly: one
golden checkpoint per version in tests/data/golden/ (written by ``make_golden.py`` with the
datastates of that version), read by today's reader."""

from __future__ import annotations

import importlib.util
import os
import shutil

import pytest
import torch

import datastates
from datastates.restore.reader import Reader

GOLDEN = os.path.join(os.path.dirname(__file__), os.pardir, "data", "golden")
#: folder -> (shard file version, manifest version)
VERSIONS = {"shard-v2": (2, 3), "shard-v2-split": (2, 4), "shard-v3": (3, 3)}


def _golden_state() -> dict:
    spec = importlib.util.spec_from_file_location(
        "make_golden", os.path.join(GOLDEN, "make_golden.py")
    )
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.golden_state()


def _same(a, b) -> None:
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
        assert bytes(a.reshape(-1).view(torch.uint8).numpy()) == bytes(
            b.reshape(-1).contiguous().view(torch.uint8).numpy()
        )
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b)
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("folder", sorted(VERSIONS))
def test_each_golden_version_loads_bit_exactly(tmp_path, folder):
    shard_version, manifest_version = VERSIONS[folder]
    ckpt = tmp_path / "step-0000000005"
    shutil.copytree(os.path.join(GOLDEN, folder), ckpt)
    shard = str(ckpt / "rank-00000.dsf")
    with open(shard, "rb") as f:
        head = f.read(4096)
    at = 64 if shard_version == 3 else 0
    assert head[at : at + 8] == datastates.format.MAGIC
    assert int.from_bytes(head[at + 8 : at + 12], "little") == shard_version
    assert datastates.format.read_manifest(str(ckpt)).version == manifest_version
    with datastates.Checkpointer(tmp_path) as c:
        loaded = c.load(step=5)
    _same(_golden_state(), loaded)
    with Reader(str(ckpt), registry=datastates.ProviderRegistry.default()) as r:
        assert r.verify_all() == os.path.getsize(shard)


def test_the_version_3_golden_file_is_a_torch_archive():
    got = torch.load(
        os.path.join(GOLDEN, "shard-v3", "rank-00000.dsf"), weights_only=True, mmap=True
    )
    expected = _golden_state()
    expected["obj"]["a set"] = None  # a pickled object: weights_only does not load it
    _same(expected, got)

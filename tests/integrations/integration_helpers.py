"""Helpers shared by the framework integration tests (each test skips only when its framework
is not installed)."""

from __future__ import annotations

import os
import socket

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(os.path.dirname(os.path.dirname(HERE)), "src")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subprocess_env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = SRC + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def assert_same(a, b, path: str = "") -> None:
    """Same nested structure, same types, bit-identical tensors."""
    assert type(a) is type(b), f"{path}: {type(a).__name__} != {type(b).__name__}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{path}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        )
        assert torch.equal(a, b), f"{path}: values differ"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{path}: keys {list(a)} != {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def stored_bytes(path) -> int:
    """Tensor plus object bytes of the checkpoint at ``path``, as ``datastates.inspect`` lists
    them (what ``SaveStats.nbytes`` counts for a one-rank save)."""
    import datastates

    summary = datastates.inspect(path)
    return sum(t["nbytes"] for t in summary["tensors"]) + sum(
        o["nbytes"] for o in summary["objects"]
    )


def assert_stats_of(stats, path) -> None:
    """``stats`` (a SaveStats) describes the committed checkpoint at ``path``."""
    assert stats is not None
    assert stats.nbytes > 0 and stats.nbytes == stored_bytes(path)
    assert stats.blocked_s >= 0 and stats.commit_s >= stats.snapshot_s >= 0

"""Helpers of the fault-injection tests (imported by name: ``from _faults_helpers import ...``):
the crash child, bit-exact comparison, directory checks."""

from __future__ import annotations

import importlib.util
import os
import socket
import subprocess
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
CHILD = os.path.join(HERE, "_crash_child.py")

_spec = importlib.util.spec_from_file_location("_datastates_crash_child", CHILD)
crash_child = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(crash_child)

#: Every wait in these tests is bounded, so a hang fails the test instead of the whole run.
WAIT_S = 120


def child_command(root, mode: str, n: int = 0, keep_last: int | None = None) -> list[str]:
    return [sys.executable, CHILD, os.fspath(root), mode, str(n), str(keep_last or 0)]


def run_child(
    root, mode: str, n: int = 0, keep_last: int | None = None
) -> subprocess.CompletedProcess:
    """Run the child to its injected SIGKILL (or to its end), in a process forked from the
    session's zygote (torch already imported)."""
    import zygote  # here, not at the top: child processes import this module too, without tests/

    return zygote.run(
        child_command(root, mode, n, keep_last),
        capture_output=True,
        text=True,
        timeout=WAIT_S,
        cwd=HERE,
    )


def bytes_of(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bit_exact(actual, expected, where: str = "") -> None:
    """Same structure, same Python values, tensors with the same dtype, shape and bytes."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: expected a tensor, got {type(actual)}"
        assert actual.dtype == expected.dtype, f"{where}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, f"{where}: shape {actual.shape} != {expected.shape}"
        assert torch.equal(bytes_of(actual), bytes_of(expected)), f"{where}: bytes differ"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{where}: expected a dict, got {type(actual)}"
        assert list(actual) == list(expected), f"{where}: keys {list(actual)} != {list(expected)}"
        for k in expected:
            assert_bit_exact(actual[k], expected[k], f"{where}/{k}")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected)):
            assert_bit_exact(a, e, f"{where}/{i}")
    else:
        assert type(actual) is type(expected) and actual == expected, (
            f"{where}: {actual!r} != {expected!r}"
        )


def zeros_like_state(state):
    """The same structure with every tensor zeroed: a live state to restore into."""
    if isinstance(state, torch.Tensor):
        return torch.zeros_like(state)
    if isinstance(state, dict):
        return {k: zeros_like_state(v) for k, v in state.items()}
    return state


def tensors_of(state, prefix=""):
    """{key: tensor} of a nested state (dicts only)."""
    out = {}
    if isinstance(state, torch.Tensor):
        out[prefix] = state
    elif isinstance(state, dict):
        for k, v in state.items():
            out.update(tensors_of(v, f"{prefix}/{k}" if prefix else str(k)))
    return out


def tmp_of(entry: str, name: str) -> bool:
    """Whether the entry name ``entry`` is the temporary directory of a save of ``name``
    (``.tmp.<run>-<serial>.<key of name>``, docs/format.md)."""
    from datastates.storage.temporaries import name_key

    return entry.startswith(".tmp.") and entry.endswith("." + name_key(name))


def hidden_entries(root) -> list[str]:
    """Temporaries of the commit protocol left in ``root``."""
    return sorted(n for n in os.listdir(root) if n.startswith((".tmp.", ".old.", ".trash.")))


def visible_entries(root) -> list[str]:
    """What a reader could take for a checkpoint: every non-reserved name but ``latest`` and the
    temporaries of ``latest`` (``latest.tmp`` or ``latest.tmp.<pid>.<uid>``, plain files)."""
    return sorted(
        n
        for n in os.listdir(root)
        if not n.startswith(".") and n != "latest" and not n.startswith("latest.tmp")
    )


def latest_temporaries(root) -> list[str]:
    return sorted(n for n in os.listdir(root) if n.startswith("latest.tmp"))


def shard_path(ckpt_dir, rank: int = 0) -> str:
    return os.path.join(ckpt_dir, f"rank-{rank:05d}.dsf")


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a process group's store)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

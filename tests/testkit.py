"""Builders shared by the test directories: cache configurations and small states.

Test modules import it by name (``from testkit import SMALL, random_tensors``): ``tests/`` is on
``sys.path`` because ``tests/conftest.py`` lives there. The fixtures that go with it (``pristine``,
``private_copy``) are in ``tests/conftest.py``.

The configurations are named by what the cache holds, so a test says which pipeline it exercises;
one that needs another field takes ``SMALL.replace(keep_last=1)``.
"""

from __future__ import annotations

import torch

from datastates import CheckpointConfig

#: Two 16 KiB units: the smallest cache a save runs with; nearly every tensor waits for a unit.
TWO_UNITS = CheckpointConfig(host_cache_bytes=32 << 10, chunk_bytes=16 << 10)
#: Four 16 KiB units: a state of a few hundred KiB cycles through the cache (backpressure, reuse).
SMALL = CheckpointConfig(host_cache_bytes=64 << 10, chunk_bytes=16 << 10)
#: Four 64 KiB units.
MEDIUM = CheckpointConfig(host_cache_bytes=256 << 10, chunk_bytes=64 << 10)
#: 1 MiB in 16 KiB units: most test states fit, still in many units.
ROOMY = CheckpointConfig(host_cache_bytes=1 << 20, chunk_bytes=16 << 10)
#: 8 MiB in 1 MiB units: the command-line tools' tests, whose states are a few MiB.
LARGE = CheckpointConfig(host_cache_bytes=8 << 20, chunk_bytes=1 << 20)
#: 1 MiB in 256 KiB units and one writer thread: the framework integrations' tests.
ONE_WRITER = CheckpointConfig(host_cache_bytes=1 << 20, chunk_bytes=1 << 18, writer_threads=1)


def random_tensors(seed: int, **shapes) -> dict:
    """``{name: torch.randn(shape)}`` for each keyword, in order, drawn from one generator seeded
    with ``seed`` (the global RNG is left alone): the same seed gives the same bytes."""
    g = torch.Generator().manual_seed(seed)
    return {name: torch.randn(shape, generator=g) for name, shape in shapes.items()}


def filled_tensors(value: float, **shapes) -> dict:
    """``{name: torch.full(shape, value)}`` for each keyword, in order."""
    return {
        name: torch.full(shape if isinstance(shape, tuple) else (shape,), float(value))
        for name, shape in shapes.items()
    }


def step_state(step: int) -> dict:
    """A small state that differs at every step: two random tensors and a Python object."""
    return {**random_tensors(step, w=3000, b=7), "meta": {"step": step, "name": f"s{step}"}}

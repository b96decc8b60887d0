"""Fixtures of the fault-injection tests; the helpers live in _faults_helpers.py."""
from __future__ import annotations

import pytest

import datastates


@pytest.fixture
def small_config():
    """A small cache with several units, so saves go through the whole pipeline."""
    return datastates.CheckpointConfig(host_cache_bytes=64 << 10, chunk_bytes=16 << 10,
                                       writer_threads=2)

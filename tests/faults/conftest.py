"""Fixtures of the fault-injection tests; the helpers live in _faults_helpers.py."""

from __future__ import annotations

import pytest

from testkit import SMALL


@pytest.fixture
def small_config():
    """A small cache with several units, so saves go through the whole pipeline."""
    return SMALL.replace(writer_threads=2)

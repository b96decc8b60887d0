"""pytest plug-in of ``scripts/run_upstream_tests.py``: makes a framework's own test suite run
with datastates in place of the framework's default checkpoint writer.

Loaded with ``-p upstream_swap`` (``scripts/`` on ``PYTHONPATH``); ``DATASTATES_SWAP`` says what
to swap, and when it is unset or ``stock`` nothing is changed (the stock run):

- ``lightning``: every Lightning strategy whose ``checkpoint_io`` was not given gets a
  ``DatastatesCheckpointIO`` instead of a ``TorchCheckpointIO`` (the name the strategy module
  constructs its default from);
- ``dcp``: ``torch.distributed.checkpoint.FileSystemWriter`` / ``FileSystemReader`` are
  ``DatastatesWriter`` / ``DatastatesReader`` for test modules imported afterwards.

This replacement of a framework's names happens in this test harness only: the library itself
plugs in through the frameworks' documented extension points and patches nothing.
"""

from __future__ import annotations

import os


def pytest_configure(config) -> None:
    swap = os.environ.get("DATASTATES_SWAP", "stock")
    if swap == "lightning":
        import lightning.pytorch.strategies.strategy as strategy
        from datastates.integrations.lightning import DatastatesCheckpointIO

        strategy.TorchCheckpointIO = DatastatesCheckpointIO
    elif swap == "dcp":
        import torch.distributed.checkpoint as dcp
        import torch.distributed.checkpoint.filesystem as filesystem
        from datastates.integrations.dcp import DatastatesReader, DatastatesWriter

        for module in (dcp, filesystem):
            module.FileSystemWriter = DatastatesWriter
            module.FileSystemReader = DatastatesReader
    elif swap != "stock":
        raise ValueError(f"DATASTATES_SWAP: expected stock, lightning or dcp, found {swap!r}")

"""Writes the golden DCP folder of one ``datastates-dcp`` version into tests/data/golden/<name>/
through ``DatastatesWriter``, with the datastates on PYTHONPATH (the version that writes it):

    PYTHONPATH=<checkout>/src python tests/data/golden/make_golden_dcp.py <name>

The state is built from ``golden_dcp_state()`` alone (no RNG), so a reader test rebuilds it."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile

import torch


def golden_dcp_state() -> dict:
    return {
        "model": {
            "w": torch.arange(24, dtype=torch.float32).reshape(4, 6) / 7,
            "half": (torch.arange(8, dtype=torch.float32) / 3).to(torch.bfloat16),
            "ints": torch.arange(10, dtype=torch.int64) * 3,
            "empty": torch.empty(0, 2),
        },
        "extra": {"step": 5, "name": "golden"},
    }


def main() -> None:
    import torch.distributed.checkpoint as dcp

    from datastates.integrations.dcp import DatastatesWriter

    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), sys.argv[1])
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "ckpt")
        dcp.save(golden_dcp_state(), storage_writer=DatastatesWriter(path), no_dist=True)
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(path, out)


if __name__ == "__main__":
    main()

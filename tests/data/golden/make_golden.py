"""Writes the golden checkpoint of one format version into tests/data/golden/<name>/, with the
datastates on PYTHONPATH (the version that writes that format):

    PYTHONPATH=<checkout>/src python tests/data/golden/make_golden.py <name> [--split]

``--split`` makes the manifest a split one (version 4) by lowering the split threshold. The
state is built from ``golden_state()`` alone (no RNG), so a reader test rebuilds it exactly."""

from __future__ import annotations

import collections
import os
import shutil
import sys
import tempfile

import torch


def golden_state() -> dict:
    return {
        "model": collections.OrderedDict(
            w=torch.arange(24, dtype=torch.float32).reshape(4, 6) / 7,
            b=torch.arange(6, dtype=torch.float32) - 2.5,
        ),
        "ints": torch.arange(10, dtype=torch.int64) * 3,
        "half": (torch.arange(8, dtype=torch.float32) / 3).to(torch.bfloat16),
        "flags": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 2),
        "list": [torch.ones(3), 2, "two", None],
        "tuple": (1.5, torch.full((2,), 7, dtype=torch.int32)),
        "step": 5,
        "obj": {"a set": {1, 2, 3}},
    }


def main() -> None:
    name = sys.argv[1]
    import datastates
    from datastates.format import codec

    if "--split" in sys.argv[2:]:
        codec.SPLIT_BYTES = 64
    out = os.path.join(os.path.dirname(os.path.abspath(__file__)), name)
    with tempfile.TemporaryDirectory() as root:
        with datastates.Checkpointer(root) as ckpt:
            ckpt.save(golden_state(), step=5).wait()
        shutil.rmtree(out, ignore_errors=True)
        shutil.copytree(os.path.join(root, "step-0000000005"), out)


if __name__ == "__main__":
    main()

"""DeepSpeed 0.19 end to end on the CPU: its built-in "datastates_ckpt" key drives our engine.

Each scenario runs in a subprocess (DeepSpeed initializes torch.distributed and an accelerator
for the whole process): train, save_checkpoint, keep training at once, destroy, compare each
file with what DeepSpeed's own torch.save engine wrote at the same point, resume from `latest`
in a fresh engine, continue, and compare with the uninterrupted run bit for bit.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("deepspeed")

from integration_helpers import HERE, free_port, subprocess_env  # noqa: E402

# slow: DeepSpeed engines trained in processes of their own
pytestmark = pytest.mark.slow


def run_worker(tmp_path, mode: str) -> dict:
    proc = subprocess.run(
        [sys.executable, os.path.join(HERE, "ds_worker.py"), str(tmp_path), mode],
        env=subprocess_env(MASTER_PORT=free_port(), DS_ACCELERATOR="cpu"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert "Exception ignored" not in proc.stderr, proc.stderr[-3000:]
    with open(tmp_path / "result.json") as f:
        return json.load(f)


@pytest.mark.parametrize("mode", ["zero1-lazy", "zero2-lazy", "fp32-default"])
def test_deepspeed_save_resume_bit_exact(tmp_path, mode):
    r = run_worker(tmp_path, mode)
    assert r["same_trajectory"], "saving changed the training trajectory"
    # Every file DeepSpeed asked for is a file, the shard of a committed datastates checkpoint;
    # the tag folder lists as stock DeepSpeed's of the same run, plus the hidden folder only.
    assert "mp_rank_00_model_states.pt" in r["files"]
    assert r["files"] == sorted([*r["torch_files"], ".datastates"])
    if mode != "fp32-default":
        assert "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt" in r["files"]
        # The capture rule: the bf16 parameters (written by ZeRO's step after the guarded inner
        # step) and the fp32 partitions + moments of the inner optimizer are lazy.
        assert r["lazy_bytes"]["mp_rank_00_model_states.pt"] >= r["trainable_bytes"]
        assert r["lazy_bytes"]["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt"] > 0
    else:  # no guard: every tensor is copied into the host cache inside save()
        assert set(r["lazy_bytes"].values()) == {0}
    assert r["files_are_checkpoints"]
    # DeepSpeed itself never writes `latest` for this engine; we do, once the tag is committed.
    assert r["latest"] == "global_step3"
    # load() returns what torch.load returned for DeepSpeed's own file at the same step.
    assert r["torch_equivalent_mismatches"] == []
    assert r["exported"] == sorted(n for n in r["files"] if n.endswith(".pt"))
    if mode != "fp32-default":
        assert r["zero_to_fp32_same"]
        # DeepSpeed's zero_to_fp32 on the tag folder as saved: the optimizer's fp32 weights
        for key in ("zero_to_fp32_in_place", "recovery_script_in_place"):
            assert r[key] and all(r[key].values()), (key, r[key])
    assert r["loaded"] and r["global_steps"] == 3
    assert r["resumed_bit_exact"] and all(r["resumed_bit_exact"].values()), r["resumed_bit_exact"]


def test_deepspeed_latest_written_without_wait_and_save_latest_honoured(tmp_path):
    """Default mode: `latest` appears once the tag is committed and training went on, with no
    later save, wait or destroy (a crash then resumes); save_latest=False leaves it alone."""
    r = run_worker(tmp_path, "latest")
    assert r["files_saved"] == 1
    assert r["latest_after_commit"] == "global_step3"
    assert r["loaded"] and r["global_steps"] == 3
    assert r["resumed_bit_exact"] and all(r["resumed_bit_exact"].values()), r["resumed_bit_exact"]
    assert r["eval_snapshot_files"] == ["mp_rank_00_model_states.pt"]
    assert r["latest_after_save_latest_false"] == "global_step3"
    assert r["latest_after_final"] == "final"


def test_deepspeed_engine_exposes_last_save_stats(tmp_path):
    """The engine DeepSpeed drives, called as DeepSpeed calls it (save per file, then wait)."""
    import argparse

    import torch

    from datastates.integrations.deepspeed import CheckpointEngine
    from integration_helpers import assert_stats_of

    engine = CheckpointEngine({"host_cache_size": 0.002}, rank=0)
    assert engine.last_save_stats is None
    tag = tmp_path / "global_step1"
    engine.save(
        {
            "module": {"w": torch.randn(32, 16)},
            "step": 1,
            "args": argparse.Namespace(lr=0.1),
        },  # DeepSpeed saves its own objects too
        str(tag / "mp_rank_00_model_states.pt"),
    )
    engine.save(
        {"optimizer": {"m": torch.zeros(512)}},
        str(tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt"),
    )
    engine.wait(persist=True)
    assert_stats_of(
        engine.last_save_stats, tag / ".datastates" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    )
    assert engine.last_save_stats.nbytes == 512 * 4
    engine.close()


def test_export_torch_files_reads_both_layouts(tmp_path):
    """export_torch_files writes every file of a tag folder, whether its checkpoints are those
    behind the files (``tag/.datastates/<file>/``, this version) or directories at the files'
    paths (earlier versions)."""
    import torch

    import datastates
    from datastates.integrations.deepspeed import CheckpointEngine, export_torch_files

    names = ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    engine = CheckpointEngine({"host_cache_size": 0.002}, rank=0)
    for i, name in enumerate(names):
        engine.save(
            {"w": torch.full((8,), float(i))}, str(tmp_path / "new" / "global_step1" / name)
        )
    engine.close()
    assert sorted(os.listdir(tmp_path / "new" / "global_step1")) == [".datastates", *names]
    with datastates.Checkpointer(tmp_path / "old" / "global_step1") as ckpt:
        for i, name in enumerate(names):
            ckpt.save({"w": torch.full((8,), float(i))}, tag=name).wait()
    for layout in ("new", "old"):
        out = tmp_path / f"{layout}-torch"
        written = export_torch_files(str(tmp_path / layout / "global_step1"), str(out))
        assert [os.path.basename(p) for p in written] == list(names)
        for i, name in enumerate(names):
            got = torch.load(out / "global_step1" / name, weights_only=True)
            assert torch.equal(got["w"], torch.full((8,), float(i)))
        assert (out / "latest").read_text() == "global_step1"

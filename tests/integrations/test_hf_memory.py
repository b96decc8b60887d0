"""Hugging Face Trainer with the memory tier (a real keeper process, /dev/shm): a memory save
after every optimizer step beside the checkpoint-N folders; a trainer SIGKILLed after step k
(a real subprocess) resumes with resume_from_checkpoint=True from memory, bit-identical to an
uninterrupted run (parameters and the logged loss sequence, dropout on); a tie goes to memory;
a damaged memory checkpoint is raised, removed, and the next resume takes checkpoint-N; the
configs the adapter cannot honour are refused."""

from __future__ import annotations

import glob
import json
import os
import signal
import subprocess
import sys
import tempfile

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("accelerate")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from transformers import TrainerCallback  # noqa: E402

import datastates  # noqa: E402
from datastates.integrations.hf import DatastatesTrainer  # noqa: E402
from datastates.memory import place  # noqa: E402

from hf_memory_worker import REPORT, STEPS, args, config, dataset, losses, tiny_model  # noqa: E402
from integration_helpers import HERE, assert_same, subprocess_env  # noqa: E402

# slow: Hugging Face Trainer runs with memory-tier keepers
pytestmark = pytest.mark.slow


def params(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def trainer(out, cfg, **kw):
    return DatastatesTrainer(
        model=tiny_model(), args=args(out), train_dataset=dataset(), datastates_config=cfg, **kw
    )


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run never interrupted, without a memory tier: final parameters and losses."""
    out = tmp_path_factory.mktemp("full")
    t = trainer(out, datastates.CheckpointConfig(host_cache_bytes=1 << 20, writer_threads=1))
    t.train()
    t.close_checkpointer()
    return params(t.model), losses(t.state)


def test_a_killed_trainer_resumes_from_memory_bit_exact(uninterrupted, shm_root, tmp_path):
    out, k = tmp_path / "run", 6
    child = subprocess.Popen(
        [
            sys.executable,
            os.path.join(HERE, "hf_memory_worker.py"),
            str(out),
            shm_root,
            str(tmp_path / "keeper.log"),
            str(k),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # the same intra-op threads as this process, which runs the other two: the same sums
        cwd=HERE,
        env=subprocess_env(OMP_NUM_THREADS=torch.get_num_threads()),
    )
    for line in child.stdout:
        if line.startswith(REPORT):
            break
    else:
        child.wait()
        pytest.fail(f"the training process ended early:\n{child.stderr.read()[-4000:]}")
    report = json.loads(line[len(REPORT) :])
    os.kill(child.pid, signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL
    child.stdin.close()
    child.stdout.close()
    child.stderr.close()
    assert report["memory"] == [f"step-{k:010d}"]  # keep_last=1: the newest
    assert report["losses"] == uninterrupted[1][:k]
    # Storage holds the Trainer's checkpoint-4 only; nothing else appeared in output_dir.
    assert sorted(n for n in os.listdir(out) if not n.startswith(".")) == ["checkpoint-4"]

    started = StartedAt()
    resumed = trainer(out, config(shm_root, tmp_path / "keeper.log"), callbacks=[started])
    try:
        memdir = place.memory_dir(shm_root, str(out))
        newest = resumed.latest_checkpoint()
        assert newest == os.path.join(memdir, "ckpt", f"step-{k:010d}")
        with torch.no_grad():
            for p in resumed.model.parameters():
                p.mul_(0.5)  # the restore must overwrite everything
        folders = set(glob.glob(os.path.join(tempfile.gettempdir(), "datastates-resume-*")))
        resumed.train(resume_from_checkpoint=True)
        assert started.step == k and resumed.state.global_step == STEPS
        assert_same(uninterrupted[0], params(resumed.model))
        assert losses(resumed.state) == uninterrupted[1]  # 1..k from memory's trainer state
        # the folder that held trainer_state.json for Trainer is gone
        assert set(glob.glob(os.path.join(tempfile.gettempdir(), "datastates-resume-*"))) == folders
        # The last step is in memory and in checkpoint-8: a tie goes to memory.
        assert resumed.latest_checkpoint() == os.path.join(memdir, "ckpt", f"step-{STEPS:010d}")
        assert sorted(n for n in os.listdir(out) if not n.startswith(".")) == [
            "checkpoint-4",
            "checkpoint-8",
        ]
    finally:
        resumed.close_checkpointer(stop_keeper=True)


class StartedAt(TrainerCallback):
    """The global step a run started from (after loading its checkpoint)."""

    step = None

    def on_train_begin(self, args, state, control, **kw):
        self.step = state.global_step


class StopAfter(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            control.should_training_stop = True
        return control


def test_a_damaged_memory_checkpoint_is_removed_and_the_next_resume_takes_storage(
    uninterrupted, shm_root, tmp_path
):
    out, cfg = tmp_path / "run", config(shm_root, tmp_path / "keeper.log")
    first = trainer(out, cfg, callbacks=[StopAfter(6)])
    try:
        first.train()
    finally:
        first.close_checkpointer()  # detached; the keeper keeps the memory
    memdir = place.memory_dir(shm_root, str(out))
    (shard,) = glob.glob(os.path.join(memdir, "ckpt", f"step-{6:010d}", "*.dsf"))
    needle = first.model.transformer.wte.weight.detach().contiguous().view(torch.uint8)
    with open(shard, "r+b") as f:
        data = f.read()
        at = data.find(needle[:256].numpy().tobytes())
        assert at >= 0, "the embedding's bytes are not in the memory shard"
        f.seek(at + 100)
        f.write(bytes([data[at + 100] ^ 0xFF]))

    damaged = trainer(out, cfg)
    try:
        with pytest.raises(datastates.CorruptCheckpointError):
            damaged.train(resume_from_checkpoint=True)
    finally:
        damaged.close_checkpointer()
    assert not os.path.exists(os.path.dirname(shard))  # removed

    started = StartedAt()
    again = trainer(out, cfg, callbacks=[started])
    try:
        assert again.latest_checkpoint() == str(out / "checkpoint-4")
        again.train(resume_from_checkpoint=True)
        assert started.step == 4
        assert_same(uninterrupted[0], params(again.model))
        assert losses(again.state) == uninterrupted[1]
    finally:
        again.close_checkpointer(stop_keeper=True)


def test_a_resume_from_an_older_checkpoint_n_saves_over_newer_memory_steps(
    uninterrupted, shm_root, tmp_path
):
    out, cfg = tmp_path / "run", config(shm_root, tmp_path / "keeper.log", keep_last=2)
    first = trainer(out, cfg, callbacks=[StopAfter(6)])
    try:
        first.train()
        assert [i.step for i in first._ds.memory.list()] == [5, 6]
    finally:
        first.close_checkpointer()
    started = StartedAt()
    again = trainer(out, cfg, callbacks=[started])
    try:  # an explicit path: checkpoint-4, though memory holds 5 and 6 (saved again below)
        again.train(resume_from_checkpoint=str(out / "checkpoint-4"))
        assert started.step == 4
        assert_same(uninterrupted[0], params(again.model))
        assert [i.step for i in again._ds.memory.list()] == [7, 8]
    finally:
        again.close_checkpointer(stop_keeper=True)


def test_configs_the_adapter_cannot_honour_are_refused(shm_root, tmp_path):
    for tier, match in (
        (datastates.MemoryTier(root=shm_root, persist_on_exit=False), "persist_every=10"),
        (datastates.MemoryTier(root=shm_root, persist_every=None), "persist_on_exit=True"),
    ):
        with pytest.raises(datastates.ConfigError, match=match):
            trainer(tmp_path / "a", datastates.CheckpointConfig(memory_tier=tier))
    with pytest.raises(datastates.ConfigError, match="memory_every"):
        trainer(tmp_path / "b", config(shm_root, tmp_path / "keeper.log"), memory_every=0)
    assert os.listdir(shm_root) == []  # no keeper was started

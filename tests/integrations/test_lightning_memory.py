"""Lightning with the memory tier (a real keeper process, /dev/shm): the memory callback saves
the full checkpoint dict after every optimizer step beside ModelCheckpoint's files; a trainer
SIGKILLed after step k (a real subprocess; mid-epoch and at an epoch's end) resumes with
fit(ckpt_path=memory.resume_path()) from memory, bit-identical to an uninterrupted run
(parameters, buffers and the loss sequence); a tie goes to memory, and without memory the
newest ModelCheckpoint file is taken; the configs the adapter cannot honour are refused."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest
import torch

pytest.importorskip("lightning")
pytest.importorskip("torchdata")

import datastates  # noqa: E402
from datastates.integrations.lightning import (
    DatastatesCheckpointIO,  # noqa: E402
    DatastatesMemoryCheckpoint,
)
from datastates.memory import place  # noqa: E402

from integration_helpers import HERE, assert_same, subprocess_env  # noqa: E402
from lightning_memory_worker import (
    BATCHES,
    EPOCHS,
    REPORT,
    Tiny,
    config,  # noqa: E402
    trainer,
    with_memory,
)

# slow: Lightning Trainer runs with memory-tier keepers
pytestmark = pytest.mark.slow

STEPS = EPOCHS * BATCHES


def params(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory):
    """The run never interrupted, without checkpoints: final parameters and buffers, losses."""
    module = Tiny()
    trainer(tmp_path_factory.mktemp("full"), []).fit(module)
    return params(module), module.losses


def _killed_after(k, root, shm_root, keeper_log) -> dict:
    child = subprocess.Popen(
        [
            sys.executable,
            os.path.join(HERE, "lightning_memory_worker.py"),
            str(root),
            shm_root,
            str(keeper_log),
            str(k),
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        # the same intra-op threads as this process, which runs the other runs: the same sums
        cwd=HERE,
        env=subprocess_env(OMP_NUM_THREADS=torch.get_num_threads()),
    )
    for line in child.stdout:
        if line.startswith(REPORT):
            break
    else:
        child.wait()
        pytest.fail(f"the training process ended early:\n{child.stderr.read()[-4000:]}")
    os.kill(child.pid, signal.SIGKILL)
    assert child.wait() == -signal.SIGKILL
    for stream in (child.stdin, child.stdout, child.stderr):
        stream.close()
    return json.loads(line[len(REPORT) :])


@pytest.mark.parametrize("k", [6, 8])  # mid-epoch; an epoch's last step
def test_a_killed_trainer_resumes_from_memory_bit_exact(uninterrupted, shm_root, tmp_path, k):
    root, log = tmp_path / "run", tmp_path / "keeper.log"
    report = _killed_after(k, root, shm_root, log)
    assert report["memory"] == [f"step-{k:010d}"]  # keep_last=1: the newest
    assert report["losses"] == uninterrupted[1][:k]
    stored = sorted(n for n in os.listdir(root / "ckpts") if not n.startswith("."))
    epochs = k // BATCHES  # ModelCheckpoint keeps the newest epoch's file, and last.ckpt
    kept = [f"epoch={epochs - 1}-step={epochs * BATCHES}.ckpt", "last.ckpt"]
    assert stored == kept
    behind = os.listdir(root / "ckpts" / ".datastates")
    assert sorted(n for n in behind if not n.startswith(".") and n != "latest") == kept

    memory, resumed_run = with_memory(root, shm_root, log)
    try:
        memdir = place.memory_dir(shm_root, str(root / "ckpts"))
        path = memory.resume_path()
        assert path == os.path.join(memdir, "ckpt", f"step-{k:010d}")
        resumed = Tiny()
        with torch.no_grad():
            for p in resumed.parameters():
                p.add_(1.0)  # the restore must overwrite everything
        resumed_run.fit(resumed, ckpt_path=path)
        assert resumed_run.global_step == STEPS
        assert_same(uninterrupted[0], params(resumed))
        assert report["losses"] + resumed.losses == uninterrupted[1]
        # The last step is in memory and in ModelCheckpoint's files: a tie goes to memory.
        assert memory.resume_path() == os.path.join(memdir, "ckpt", f"step-{STEPS:010d}")
    finally:
        memory.close(stop_keeper=True)


def test_without_memory_the_newest_file_is_resumed(shm_root, tmp_path):
    root, log = tmp_path / "run", tmp_path / "keeper.log"
    memory, run = with_memory(root, shm_root, log)
    try:
        run.fit(Tiny())
    finally:
        memory.close(stop_keeper=True)  # the job is over: the memory is gone
    # ModelCheckpoint's files record Lightning's global step, which resume_path() compares
    with datastates.Checkpointer(root / "ckpts" / ".datastates") as files:
        assert sorted((i.name, i.step) for i in files.list()) == [
            (f"epoch={EPOCHS - 1}-step={STEPS}.ckpt", STEPS),
            ("last.ckpt", STEPS),
        ]
    again, _ = with_memory(root, shm_root, log)
    try:
        newest = again.resume_path()
        assert newest == str(root / "ckpts" / "last.ckpt")  # the same step, committed last
        loaded = DatastatesCheckpointIO().load_checkpoint(newest)
        assert loaded["global_step"] == STEPS
    finally:
        again.close(stop_keeper=True)


def test_configs_the_adapter_cannot_honour_are_refused(shm_root, tmp_path):
    for tier, match in (
        (datastates.MemoryTier(root=shm_root, persist_on_exit=False), "persist_every=10"),
        (datastates.MemoryTier(root=shm_root, persist_every=None), "persist_on_exit=True"),
    ):
        with pytest.raises(datastates.ConfigError, match=match):
            DatastatesCheckpointIO(datastates.CheckpointConfig(memory_tier=tier))
    with pytest.raises(datastates.ConfigError, match="no memory tier"):
        DatastatesCheckpointIO().memory_checkpoints(tmp_path)
    io = DatastatesCheckpointIO(config(shm_root, tmp_path / "keeper.log"))
    with pytest.raises(datastates.ConfigError, match="every_n_steps"):
        DatastatesMemoryCheckpoint(io, tmp_path, every_n_steps=0)
    # a memory tier with no memory callback in the Trainer is not ignored
    with pytest.raises(datastates.ConfigError, match="memory_checkpoints"):
        trainer(tmp_path, [], [io]).fit(Tiny())
    assert os.listdir(shm_root) == []  # no keeper was started


def test_a_stopped_keeper_leaves_lightning_on_its_own_files(shm_root, tmp_path, caplog):
    """The keeper of a finished run is stopped (SIGSTOP): a new run's io does without the memory
    tier (WARNING), resume_path() names the newest ModelCheckpoint file, and a fit saves
    ModelCheckpoint's files only (no memory save goes to storage instead)."""
    import dataclasses
    import logging

    from datastates.tools.keeper import ask

    root, log = tmp_path / "run", tmp_path / "keeper.log"
    memory, first = with_memory(root, shm_root, log)
    first.fit(Tiny())
    memory.close()
    files = sorted(os.listdir(root / "ckpts"))
    keeper = ask(place.memory_dir(shm_root, str(root / "ckpts")), "status")["pid"]
    os.kill(keeper, signal.SIGSTOP)
    try:
        cfg = config(shm_root, log)
        cfg = dataclasses.replace(
            cfg, memory_tier=dataclasses.replace(cfg.memory_tier, start_timeout_s=2)
        )
        io = DatastatesCheckpointIO(cfg)
        again = io.memory_checkpoints(os.path.join(root, "ckpts"))
        with caplog.at_level(logging.WARNING, logger="datastates"):
            path = again.resume_path()
        assert "the memory tier is not used" in caplog.text
        assert path == os.path.join(root, "ckpts", "last.ckpt")
        assert not again.holds(path)
        trainer(tmp_path / "second", [again], [io]).fit(Tiny())
        again.close()
        assert sorted(os.listdir(root / "ckpts")) == files
    finally:
        os.kill(keeper, signal.SIGCONT)

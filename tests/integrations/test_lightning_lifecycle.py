"""DatastatesCheckpointIO as Lightning handles its plug-ins: pickled (``ddp_spawn`` sends it to
another process, ``torch.save(trainer)``), wrapped by ``AsyncCheckpointIO``, called outside ``fit``, given URLs.
After ``fit()`` returns, ``dirpath`` lists only Lightning's checkpoints and no datastates thread
is left running."""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import threading

import pytest
import torch

from testkit import ONE_WRITER

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.demos.boring_classes import BoringModel  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402

import datastates  # noqa: E402
from datastates.integrations.lightning import DatastatesCheckpointIO  # noqa: E402

from integration_helpers import assert_same, subprocess_env  # noqa: E402

# slow: Lightning Trainer runs, some in processes of their own
pytestmark = pytest.mark.slow


@pytest.fixture
def ours():
    """The datastates threads started since the test began (not those of other tests)."""
    before = set(threading.enumerate())
    return lambda: sorted(
        t.name for t in threading.enumerate() if t.name.startswith("datastates") and t not in before
    )


def trainer(root, plugin, epochs=2, callbacks=(), **kwargs):
    mc = ModelCheckpoint(
        dirpath=str(root), save_top_k=-1, monitor="epoch", mode="max", save_last=True
    )
    return pl.Trainer(
        default_root_dir=str(root),
        max_epochs=epochs,
        limit_train_batches=2,
        limit_val_batches=1,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=[plugin],
        callbacks=[mc, *callbacks],
        **kwargs,
    )


NAMES = ["epoch=0-step=2.ckpt", "epoch=1-step=4.ckpt", "last.ckpt"]


@pytest.mark.parametrize(
    "wrap,lazy",
    [(False, False), (False, True), (True, False)],
    ids=["plain", "lazy_snapshots", "AsyncCheckpointIO"],
)
def test_fit_leaves_only_lightning_names_and_no_thread(tmp_path, wrap, lazy, ours):
    io = DatastatesCheckpointIO(ONE_WRITER)
    assert not ours()
    t = trainer(
        tmp_path,
        AsyncCheckpointIO(io) if wrap else io,
        callbacks=[io.lazy_snapshots()] if lazy else [],
    )
    t.fit(BoringModel())
    assert sorted(os.listdir(tmp_path)) == [".datastates", *NAMES]
    # the checkpoints behind them, the core's hint at most: no `.owner.*`, `.tmp.*`
    assert sorted(os.listdir(tmp_path / ".datastates")) in (NAMES, sorted([*NAMES, "latest"]))
    assert not ours()
    loaded = io.load_checkpoint(tmp_path / "last.ckpt")
    assert loaded["global_step"] == 4


def test_save_outside_fit_ends_its_threads_once_committed(tmp_path, ours):
    model = BoringModel()
    io = DatastatesCheckpointIO(ONE_WRITER)
    t = trainer(tmp_path, io, epochs=1)
    t.fit(model)
    t.save_checkpoint(tmp_path / "after.ckpt")  # no teardown will follow
    io.wait()
    assert not ours()
    assert "after.ckpt" in os.listdir(tmp_path) and "latest" not in os.listdir(tmp_path)
    assert not [n for n in os.listdir(tmp_path / ".datastates") if n.startswith(".")]
    assert_same(io.load_checkpoint(tmp_path / "after.ckpt")["state_dict"], model.state_dict())
    assert not ours()


def test_pickle_round_trip_saves_and_loads(tmp_path, ours):
    io = DatastatesCheckpointIO(ONE_WRITER)
    state = {"w": torch.arange(6.0), "epoch": 3}
    io.save_checkpoint(state, tmp_path / "a.ckpt")  # a save in flight stays with `io`
    copy = pickle.loads(pickle.dumps(io))
    assert copy._paths.config == io._paths.config and copy.in_flight == 0
    copy.save_checkpoint({"w": torch.ones(4), "epoch": 4}, tmp_path / "b.ckpt")
    io.wait()
    copy.wait()
    assert_same(copy.load_checkpoint(tmp_path / "a.ckpt"), state)
    assert_same(io.load_checkpoint(tmp_path / "b.ckpt"), {"w": torch.ones(4), "epoch": 4})
    assert not ours()


def test_torch_save_of_a_trainer_with_the_plugin(tmp_path):
    io = DatastatesCheckpointIO(ONE_WRITER)
    t = trainer(tmp_path / "ckpt", io, epochs=1, callbacks=[io.lazy_snapshots()])
    t.fit(BoringModel())
    torch.save(t, tmp_path / "trainer.pt")
    again = torch.load(tmp_path / "trainer.pt", weights_only=False)
    assert isinstance(again.strategy.checkpoint_io, DatastatesCheckpointIO)


def test_unpickled_plugin_saves_and_loads_in_another_process(tmp_path):
    """What ``ddp_spawn`` does with the plug-in (a full 2-process fit takes a minute on a
    small machine): the pickled io is used by a fresh process, and its checkpoint is read here."""
    io = DatastatesCheckpointIO(ONE_WRITER)
    io.save_checkpoint({"w": torch.zeros(2)}, tmp_path / "parent.ckpt")  # threads running
    (tmp_path / "io.pkl").write_bytes(pickle.dumps(io))
    code = (
        "import pickle, sys, torch; io = pickle.load(open(sys.argv[1], 'rb')); "
        "io.save_checkpoint({'w': torch.arange(5.0), 'step': 7}, sys.argv[2]); "
        "assert io.load_checkpoint(sys.argv[2])['step'] == 7; io.teardown()"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "io.pkl"), str(tmp_path / "child.ckpt")],
        env=subprocess_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    io.wait()
    assert_same(io.load_checkpoint(tmp_path / "child.ckpt"), {"w": torch.arange(5.0), "step": 7})


def test_url_is_saved_by_lightnings_own_io_with_a_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(tmp_path)
    io = DatastatesCheckpointIO(ONE_WRITER)
    state = {"w": torch.arange(3.0)}
    with caplog.at_level(logging.WARNING, logger="datastates.integrations"):
        io.save_checkpoint(state, "memory://dsdir/x.ckpt")
    assert "memory://" in caplog.text and "TorchCheckpointIO" in caplog.text
    assert os.listdir(tmp_path) == []  # not a local folder ./memory:/dsdir/x.ckpt
    assert_same(io.load_checkpoint("memory://dsdir/x.ckpt"), state)
    io.remove_checkpoint("memory://dsdir/x.ckpt")
    import fsspec

    assert not fsspec.filesystem("memory").exists("/dsdir/x.ckpt")
    with pytest.raises(datastates.ConfigError, match="memory://dsdir"):
        io.last_path("memory://dsdir")
    io.save_checkpoint(state, f"file://{tmp_path}/y.ckpt")  # a local path, written here
    io.wait()
    assert os.path.isfile(tmp_path / ".datastates" / "y.ckpt" / "manifest.json")
    assert_same(torch.load(tmp_path / "y.ckpt", weights_only=True), state)

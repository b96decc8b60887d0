"""Lightning 2.x end to end: DatastatesCheckpointIO under ModelCheckpoint (top-k, last.ckpt),
resume with fit(ckpt_path=...), bit-exact against an uninterrupted run and against the
checkpoint Lightning's own TorchCheckpointIO writes at the same point."""

from __future__ import annotations

import os

import pytest
import torch

from testkit import ONE_WRITER

pytest.importorskip("lightning")

import lightning.pytorch as pl  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

import datastates  # noqa: E402
from datastates.integrations.lightning import DatastatesCheckpointIO  # noqa: E402

from integration_helpers import assert_same  # noqa: E402

# slow: Lightning Trainer runs
pytestmark = pytest.mark.slow


class Tiny(pl.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = torch.nn.Sequential(
            torch.nn.Linear(8, 16),
            torch.nn.BatchNorm1d(16),
            torch.nn.ReLU(),
            torch.nn.Linear(16, 1),
        )

    def training_step(self, batch, _):
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 2)}

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(
            torch.randn(32, 8, generator=g), torch.randn(32, 1, generator=g)
        )
        return torch.utils.data.DataLoader(data, batch_size=8, shuffle=False)


def trainer(root, epochs, plugins=(), callbacks=()):
    return pl.Trainer(
        default_root_dir=str(root),
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        plugins=list(plugins),
        callbacks=list(callbacks),
        deterministic=True,
    )


def params(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def _clean(ckpt: dict) -> dict:
    ckpt = dict(ckpt)
    ckpt.pop("callbacks", None)  # ModelCheckpoint state holds this run's own paths
    return ckpt


@pytest.mark.parametrize("lazy", [True, False])
def test_lightning_fit_resume_bit_exact(tmp_path, lazy):
    # Uninterrupted run: 4 epochs; its epoch-2 checkpoint written by TorchCheckpointIO.
    ref_ckpt = ModelCheckpoint(dirpath=tmp_path / "ref", save_top_k=-1, filename="{epoch}-{step}")
    ref = Tiny()
    trainer(tmp_path, 4, callbacks=[ref_ckpt]).fit(ref)
    continuous = params(ref)

    # Interrupted run: 2 epochs through datastates, keeping the best 2 by step, plus last.
    io = DatastatesCheckpointIO(ONE_WRITER)
    extra = [io.lazy_snapshots()] if lazy else []
    ckpt_cb = ModelCheckpoint(
        dirpath=tmp_path / "ds",
        monitor="step",
        mode="max",
        save_top_k=1,
        save_last=True,
        filename="{epoch}-{step}",
    )
    first = Tiny()
    trainer(tmp_path, 2, plugins=[io], callbacks=[ckpt_cb, *extra]).fit(first)
    names = sorted(os.listdir(tmp_path / "ds"))
    assert names == [".datastates", "epoch=1-step=8.ckpt", "last.ckpt"]
    # top-k removed it through remove_checkpoint: the file and the checkpoint behind it
    assert not os.path.exists(tmp_path / "ds" / ".datastates" / "epoch=0-step=4.ckpt")
    for n in ("last.ckpt", "epoch=1-step=8.ckpt"):
        assert os.path.isfile(tmp_path / "ds" / ".datastates" / n / "manifest.json")
        assert os.path.isfile(tmp_path / "ds" / n)

    # load_checkpoint returns what TorchCheckpointIO's torch.load returned at the same step.
    want = torch.load(tmp_path / "ref" / "epoch=1-step=8.ckpt", weights_only=False)
    got = io.load_checkpoint(tmp_path / "ds" / "epoch=1-step=8.ckpt")
    assert_same(_clean(want), _clean(got))

    # Resume from last.ckpt in a fresh module and Trainer; finish the 4 epochs.
    io2 = DatastatesCheckpointIO(ONE_WRITER)
    resumed = Tiny()
    with torch.no_grad():
        for p in resumed.parameters():
            p.add_(1.0)  # the restore must overwrite everything
    extra2 = [io2.lazy_snapshots()] if lazy else []
    trainer(
        tmp_path, 4, plugins=[io2], callbacks=[ModelCheckpoint(dirpath=tmp_path / "ds2"), *extra2]
    ).fit(resumed, ckpt_path=str(tmp_path / "ds" / "last.ckpt"))
    assert_same(continuous, params(resumed))
    assert os.path.isfile(
        tmp_path / "ds2" / ".datastates" / "epoch=3-step=16.ckpt" / "manifest.json"
    )


def test_lightning_background_error_surfaces_at_next_save(tmp_path, monkeypatch):
    import datastates.format.codec as codec

    io = DatastatesCheckpointIO(ONE_WRITER)
    monkeypatch.setattr(
        codec,
        "encode_index_items",  # fails in the background commit thread
        lambda *a: (_ for _ in ()).throw(KeyError("injected background failure")),
    )
    handle = io._paths.save({"t": torch.ones(4)}, tmp_path / "bad.ckpt", snapshot=False)
    with pytest.raises(KeyError, match="injected"):
        handle.wait()
    monkeypatch.undo()
    with pytest.raises(KeyError, match="injected"):
        io.save_checkpoint({"x": torch.ones(2)}, tmp_path / "next.ckpt")
    io.teardown()
    assert not os.path.exists(tmp_path / "bad.ckpt")


class WithHparams(Tiny):
    def __init__(self, width: int = 16, note: str = "a"):
        super().__init__()
        self.save_hyperparameters()


def test_load_from_checkpoint_helper_and_export(tmp_path):
    from datastates.integrations.lightning import load_from_checkpoint

    io = DatastatesCheckpointIO(ONE_WRITER)
    model = WithHparams(width=16, note="b")
    t = trainer(tmp_path, 2, plugins=[io])
    t.fit(model)
    path = tmp_path / "final.ckpt"
    t.save_checkpoint(path)
    io.wait()
    assert os.path.isfile(tmp_path / ".datastates" / "final.ckpt" / "manifest.json")
    loaded = load_from_checkpoint(WithHparams, path)
    assert loaded.hparams.note == "b" and loaded.hparams.width == 16
    assert_same(params(model), params(loaded))
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".datastates-export-")]
    # the documented one-off export, of the checkpoint behind the path
    datastates.export(tmp_path / ".datastates" / "final.ckpt", tmp_path / "plain.ckpt", "torch")
    assert_same(params(model), params(WithHparams.load_from_checkpoint(tmp_path / "plain.ckpt")))


def test_lightning_checkpoint_io_exposes_last_save_stats(tmp_path):
    from integration_helpers import assert_stats_of

    io = DatastatesCheckpointIO(ONE_WRITER)
    assert io.last_save_stats is None
    model = WithHparams(width=16, note="c")  # hyper-parameters: a framework object is saved
    t = trainer(tmp_path, 1, plugins=[io])
    t.fit(model)
    path = tmp_path / "final.ckpt"
    t.save_checkpoint(path)
    io.wait()
    assert_stats_of(io.last_save_stats, tmp_path / ".datastates" / "final.ckpt")
    io.teardown()


def _continuous(tmp_path, epochs):
    """The parameters of an uninterrupted run of ``epochs`` epochs (no checkpoints)."""
    module = Tiny()
    pl.Trainer(
        default_root_dir=str(tmp_path / "cont"),
        max_epochs=epochs,
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        deterministic=True,
    ).fit(module)
    return params(module)


def _resume(tmp_path, ckpt_path, epochs):
    io = DatastatesCheckpointIO(ONE_WRITER)
    resumed = Tiny()
    with torch.no_grad():
        for p in resumed.parameters():
            p.add_(1.0)  # the restore must overwrite everything
    trainer(tmp_path, epochs, plugins=[io]).fit(resumed, ckpt_path=ckpt_path)
    return params(resumed)


def test_resume_after_interrupted_replacement_of_last(tmp_path):
    from test_paths import interrupt_replacement

    io = DatastatesCheckpointIO(ONE_WRITER)
    folder = tmp_path / "ds"
    trainer(
        tmp_path,
        2,
        plugins=[io],
        callbacks=[ModelCheckpoint(dirpath=folder, save_top_k=0, save_last=True)],
    ).fit(Tiny())
    want = io.load_checkpoint(folder / "last.ckpt")
    # a crash while last.ckpt was replaced, before the link was made
    interrupt_replacement(folder / ".datastates", "last.ckpt")
    os.remove(folder / "last.ckpt")

    io2 = DatastatesCheckpointIO(ONE_WRITER)  # the restarted job: the lookup repairs the directory
    assert io2.last_path(folder) == str(folder / "last.ckpt")
    assert_same(_clean(want), _clean(io2.load_checkpoint(folder / "last.ckpt")))
    io2.teardown()
    assert_same(_continuous(tmp_path, 3), _resume(tmp_path, str(folder / "last.ckpt"), 3))


def test_save_last_link_resumes_through_the_link(tmp_path):
    io = DatastatesCheckpointIO(ONE_WRITER)
    folder = tmp_path / "ds"
    trainer(
        tmp_path,
        2,
        plugins=[io],
        callbacks=[
            ModelCheckpoint(
                dirpath=folder, save_top_k=-1, save_last="link", filename="{epoch}-{step}"
            )
        ],
    ).fit(Tiny())
    link = folder / "last.ckpt"
    assert os.path.islink(link) and os.readlink(link) == "epoch=1-step=8.ckpt"
    assert not os.path.exists(folder / ".datastates" / "last.ckpt")  # never a save of its own
    assert_same(io.load_checkpoint(folder / "epoch=1-step=8.ckpt"), io.load_checkpoint(link))
    assert io.last_path(folder) == str(link)
    assert_same(_continuous(tmp_path, 3), _resume(tmp_path, str(link), 3))

    outside = tmp_path / "elsewhere"
    outside.mkdir()
    os.rename(folder / "epoch=0-step=4.ckpt", outside / "epoch=0-step=4.ckpt")
    os.symlink(outside / "epoch=0-step=4.ckpt", folder / "out.ckpt")
    with pytest.raises(
        datastates.CorruptCheckpointError,
        match=r"out\.ckpt is a symbolic link to .*elsewhere.*outside",
    ):
        io.load_checkpoint(folder / "out.ckpt")
    io.remove_checkpoint(folder / "out.ckpt")  # the link goes, never its target
    assert not os.path.lexists(folder / "out.ckpt")
    assert os.path.isfile(outside / "epoch=0-step=4.ckpt")
    io.teardown()


class Scalable(Tiny):
    def __init__(self):
        super().__init__()
        self.batch_size = 4
        self.lr = 1e-2

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=self.lr)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(1)
        data = torch.utils.data.TensorDataset(
            torch.randn(64, 8, generator=g), torch.randn(64, 1, generator=g)
        )
        return torch.utils.data.DataLoader(data, batch_size=self.batch_size, shuffle=False)


def test_tuner_runs_with_the_plugin(tmp_path):
    """The Tuner saves and restores the trainer through a hidden ``.lr_find_<uuid>.ckpt``
    (``TorchCheckpointIO``'s): it restores the initial weights bit-exactly and leaves none."""
    from lightning.pytorch.tuner import Tuner

    io = DatastatesCheckpointIO(ONE_WRITER)
    module = Scalable()
    before = params(module)
    tuner = Tuner(trainer(tmp_path, 1, plugins=[io], callbacks=[io.lazy_snapshots()]))
    found = tuner.lr_find(module, num_training=6, update_attr=False)
    assert len(found.results["lr"]) == 6
    assert_same(before, params(module))
    size = tuner.scale_batch_size(module, mode="power", steps_per_trial=1, max_trials=2)
    assert size == module.batch_size >= 4
    assert_same(before, params(module))
    assert not [n for n in os.listdir(tmp_path) if n.endswith(".ckpt")]
    io.teardown()


class _Gate:
    """Holds each commit of the core until released (the library's own publish, wrapped by the
    test): a save stays in flight for as long as the test wants, with no timing involved."""

    def __init__(self, monkeypatch):
        import threading
        from datastates.commit.publish import RenamePublisher

        self.permits = threading.Semaphore(0)
        real = RenamePublisher.publish

        def publish(publisher, *args, **kwargs):
            if not self.permits.acquire(timeout=30):
                raise AssertionError("a commit was held for 30 s: the test never released it")
            return real(publisher, *args, **kwargs)

        monkeypatch.setattr(RenamePublisher, "publish", publish)

    def release(self, n: int = 1) -> None:
        self.permits.release(n)


class _ReleaseOnNextSave(pl.Callback):
    """Lets the commit of the previous save go once Lightning has named the next one (and at
    the end of training): ModelCheckpoint decides on each name while the save before is still
    in flight."""

    def __init__(self, gate: _Gate):
        self.gate, self.saves = gate, 0

    def on_save_checkpoint(self, trainer, pl_module, checkpoint) -> None:
        self.saves += 1
        if self.saves > 1:
            self.gate.release()

    def on_train_end(self, trainer, pl_module) -> None:
        self.gate.release()


def test_model_checkpoint_versions_a_name_whose_save_is_in_flight(tmp_path, monkeypatch):
    """ModelCheckpoint(filename="fixed", save_top_k=-1, monitor=...) saves every step under one
    name and needs fixed-v1..v3 for the later ones: it asks whether the name exists while the
    previous save is still in flight (held). All four are kept, distinct and loadable."""
    gate = _Gate(monkeypatch)
    io = DatastatesCheckpointIO(ONE_WRITER)
    mc = ModelCheckpoint(
        dirpath=tmp_path / "ds",
        filename="fixed",
        save_top_k=-1,
        monitor="step",
        mode="max",
        every_n_train_steps=1,
        save_on_train_epoch_end=False,
    )
    trainer(tmp_path, 1, plugins=[io], callbacks=[mc, _ReleaseOnNextSave(gate)]).fit(Tiny())
    names = sorted(n for n in os.listdir(tmp_path / "ds") if n.endswith(".ckpt"))
    assert names == ["fixed-v1.ckpt", "fixed-v2.ckpt", "fixed-v3.ckpt", "fixed.ckpt"]
    steps = [io.load_checkpoint(tmp_path / "ds" / n)["global_step"] for n in names]
    assert sorted(steps) == [1, 2, 3, 4]
    io.teardown()


def test_a_name_whose_save_is_in_flight_exists_for_lightning(tmp_path, monkeypatch):
    """Lightning's own check (ModelCheckpoint.file_exists, fsspec's exists) finds the path of a
    save still in flight; a failed save leaves nothing at its path."""
    gate = _Gate(monkeypatch)
    io = DatastatesCheckpointIO(ONE_WRITER)
    t = trainer(tmp_path, 1, plugins=[io])
    path = str(tmp_path / "a.ckpt")
    io.save_checkpoint({"x": torch.arange(4.0)}, path)
    assert io.in_flight == 1
    assert ModelCheckpoint(dirpath=tmp_path).file_exists(path, t)
    gate.release()
    io.wait()
    assert torch.equal(io.load_checkpoint(path)["x"], torch.arange(4.0))
    io.teardown()


def test_hpc_resume_lookup_while_a_save_is_in_flight(tmp_path, monkeypatch):
    """Lightning's SLURM auto-resume lists the names containing 'hpc_ckpt_' and reads their
    digits. A save held in flight leaves no temporary it would read: before the first commit
    it finds nothing; afterwards the newest committed number (the core's saves); through the
    plug-in, the name of the save in flight, whose load waits for its commit."""
    import datastates.commit.publish  # noqa: F401

    gate = _Gate(monkeypatch)
    root = tmp_path / "run"
    root.mkdir()
    lookup = trainer(root, 1)._checkpoint_connector
    with datastates.Checkpointer(root, ONE_WRITER) as ck:
        first = ck.save({"x": torch.ones(2)}, tag="hpc_ckpt_1.ckpt")
        assert any(n.startswith(".tmp.") for n in os.listdir(root))
        assert lookup._hpc_resume_path is None
        gate.release()
        first.wait()
        second = ck.save({"x": torch.ones(2)}, tag="hpc_ckpt_12.ckpt")
        assert lookup._hpc_resume_path == str(root / "hpc_ckpt_1.ckpt")
        gate.release()
        second.wait()
        assert lookup._hpc_resume_path == str(root / "hpc_ckpt_12.ckpt")
    io = DatastatesCheckpointIO(ONE_WRITER)
    io.save_checkpoint({"x": torch.full((2,), 3.0)}, root / "hpc_ckpt_13.ckpt")
    assert any(n.startswith(".tmp.") for n in os.listdir(root / ".datastates"))
    assert lookup._hpc_resume_path == str(root / "hpc_ckpt_13.ckpt")
    gate.release()
    assert torch.equal(io.load_checkpoint(lookup._hpc_resume_path)["x"], torch.full((2,), 3.0))
    io.teardown()


def test_storage_options_none_is_taken_anything_else_refused(tmp_path):
    io = DatastatesCheckpointIO(ONE_WRITER)
    io.save_checkpoint({"x": torch.ones(2)}, tmp_path / "a.ckpt", storage_options=None)
    with pytest.raises(
        datastates.ConfigError,
        match=r"expected storage_options=None, found "
        r"dict \{'compress': True\}",
    ):
        io.save_checkpoint(
            {"x": torch.ones(2)}, tmp_path / "b.ckpt", storage_options={"compress": True}
        )
    io.teardown()
    assert torch.equal(io.load_checkpoint(tmp_path / "a.ckpt")["x"], torch.ones(2))
    assert not os.path.exists(tmp_path / "b.ckpt")


class Described(Tiny):
    def __init__(self, width: int = 16, note: str = "a", lr: float = 1e-2):
        super().__init__()
        self.save_hyperparameters()


def test_lightning_own_loaders_read_the_checkpoints_in_place(tmp_path):
    """torch.load(weights_only=True) and Model.load_from_checkpoint, stock calls, read the paths
    ModelCheckpoint saved through the plug-in: equal tensors, the step and the hparams."""
    io = DatastatesCheckpointIO(ONE_WRITER)
    cb = ModelCheckpoint(
        dirpath=tmp_path / "ds",
        monitor="train_loss",
        save_top_k=2,
        save_last=True,
        filename="{epoch}-{step}",
    )
    model = Described(width=16, note="in place", lr=0.5)
    trainer(tmp_path, 3, plugins=[io], callbacks=[cb]).fit(model)
    kept = sorted(n for n in os.listdir(tmp_path / "ds") if n.endswith(".ckpt"))
    assert len(kept) == 3 and "last.ckpt" in kept  # top 2 and last, each a file

    last = torch.load(cb.last_model_path, weights_only=True)
    assert isinstance(last, dict)
    assert_same(params(model), dict(last["state_dict"]))
    assert (last["epoch"], last["global_step"]) == (2, 12)
    assert dict(last["hyper_parameters"]) == {"width": 16, "note": "in place", "lr": 0.5}

    best = Described.load_from_checkpoint(cb.best_model_path)
    want = io.load_checkpoint(cb.best_model_path)["state_dict"]  # verified, through datastates
    assert_same(dict(want), params(best))
    assert (best.hparams.width, best.hparams.note, best.hparams.lr) == (16, "in place", 0.5)
    io.teardown()


def test_model_checkpoint_s_folder_lists_as_with_stock_lightning(tmp_path):
    """After the same run, ModelCheckpoint's dirpath holds the names stock Lightning's
    TorchCheckpointIO leaves there (top 2 and last.ckpt), plus the hidden folder only."""

    def run(folder, plugins):
        cb = ModelCheckpoint(
            dirpath=folder,
            monitor="train_loss",
            save_top_k=2,
            save_last=True,
            filename="{epoch}-{step}",
        )
        trainer(tmp_path, 4, plugins=plugins, callbacks=[cb]).fit(Tiny())

    run(tmp_path / "stock", [])
    io = DatastatesCheckpointIO(ONE_WRITER)
    run(tmp_path / "ds", [io])
    stock = sorted(os.listdir(tmp_path / "stock"))
    assert len(stock) == 3 and "last.ckpt" in stock
    assert sorted(os.listdir(tmp_path / "ds")) == sorted([*stock, ".datastates"])
    behind = os.listdir(tmp_path / "ds" / ".datastates")
    assert sorted(n for n in behind if n[0] != "." and n != "latest") == stock


def test_fit_ckpt_path_last_finds_the_file(tmp_path):
    """Lightning resolves ckpt_path="last" from its own listing of last*.ckpt files: it finds
    the file (the checkpoint behind it is in the hidden .datastates folder), and resumes
    bit-exact."""
    folder = tmp_path / "ds"

    def run(epochs, module, **fit):
        io = DatastatesCheckpointIO(ONE_WRITER)
        cb = ModelCheckpoint(dirpath=folder, save_top_k=0, save_last=True)
        trainer(tmp_path, epochs, plugins=[io], callbacks=[cb]).fit(module, **fit)
        return cb

    cb = run(2, Tiny())
    assert sorted(os.listdir(folder)) == [".datastates", "last.ckpt"]
    assert cb._find_last_checkpoints(None) == {str(folder / "last.ckpt")}
    resumed = Tiny()
    with torch.no_grad():
        for p in resumed.parameters():
            p.add_(1.0)  # the restore must overwrite everything
    run(3, resumed, ckpt_path="last")
    assert_same(_continuous(tmp_path, 3), params(resumed))


class _Weight(pl.LightningModule):
    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1, bias=False)


def _weight_checkpoint(value: float) -> dict:
    module = _Weight()
    torch.nn.init.constant_(module.layer.weight, value)
    return {
        "state_dict": module.state_dict(),
        "pytorch-lightning_version": pl.__version__,
        "global_step": int(value),
        "epoch": 0,
    }


def test_load_from_checkpoint_reads_what_another_engine_wrote_at_the_path_later(tmp_path):
    """A stock save to the path after the datastates one (a file renamed over it): every load,
    datastates' ``load_from_checkpoint`` included, reads the newer file."""
    from datastates.integrations.lightning import load_from_checkpoint

    path = str(tmp_path / "best.ckpt")
    io = DatastatesCheckpointIO(ONE_WRITER)
    io.save_checkpoint(_weight_checkpoint(1.0), path)
    io.teardown()
    torch.save(_weight_checkpoint(2.0), tmp := str(tmp_path / "stock.tmp"))
    os.replace(tmp, path)
    expected = torch.full((1, 2), 2.0)
    assert torch.equal(io.load_checkpoint(path)["state_dict"]["layer.weight"], expected)
    assert torch.equal(_Weight.load_from_checkpoint(path).layer.weight.data, expected)
    assert torch.equal(load_from_checkpoint(_Weight, path).layer.weight.data, expected)
    io.teardown()

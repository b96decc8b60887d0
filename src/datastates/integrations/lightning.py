"""Lightning: a ``CheckpointIO`` plug-in that writes datastates checkpoints asynchronously.

Usage::

    io = DatastatesCheckpointIO()                        # or DatastatesCheckpointIO(config)
    trainer = Trainer(plugins=[io], callbacks=[io.lazy_snapshots(), ModelCheckpoint(...)])

Lightning calls, on global rank 0 only (``Strategy.save_checkpoint`` / ``remove_checkpoint``):
``save_checkpoint(checkpoint, path)`` from ``trainer.save_checkpoint`` (ModelCheckpoint,
``last.ckpt``, user code), ``remove_checkpoint(path)`` for top-k rotation, and on every rank
``load_checkpoint(path, map_location, weights_only)`` for ``fit(ckpt_path=...)`` and
``teardown()`` at the end of ``fit``/``validate``/``test``.

Compared with Lightning's ``AsyncCheckpointIO``:

- no clone of the state on the device: tensors are copied once, into the bounded host cache
  that is reused by every save; with lazy snapshots on, the core's capture rule copies inside
  ``save_checkpoint`` only what the trainer's optimizers do not own (buffers, which forward
  changes, frozen parameters, EMA copies), the rest in the background;
- lazy: with the :meth:`DatastatesCheckpointIO.lazy_snapshots` callback, ``save_checkpoint``
  returns after planning, forward and backward overlap the copy, and Lightning's
  ``on_before_optimizer_step`` (after the closure ran backward, before the weights change) waits
  for it. Without the callback ``save_checkpoint`` returns once the state is in the host cache;
  writing, fsync and commit still run in the background;
- a failure in the background is raised by the next ``save_checkpoint`` at the latest (and by
  ``teardown``), never swallowed;
- each path is a datastates checkpoint directory that appears atomically; a crash never leaves
  a partial ``.ckpt`` visible, and ``last.ckpt`` is replaced atomically.

``Model.load_from_checkpoint(path)`` reads one ``torch.load`` file and has no plug-in point: use
:func:`load_from_checkpoint` (``load_from_checkpoint(Model, path)``), or export the checkpoint once
with ``datastates export PATH --to torch model.ckpt``.
"""
from __future__ import annotations

from typing import Any, Optional

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.pytorch.callbacks import Callback

from ._paths import PathCheckpoints

__all__ = ["DatastatesCheckpointIO", "DatastatesSnapshotCallback", "load_from_checkpoint"]


class DatastatesCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` writing datastates checkpoints (see module docstring).

    ``config`` is a :class:`datastates.CheckpointConfig` (host cache size, writer threads, ...).
    One instance may serve several ``Trainer`` runs in sequence.
    """

    def __init__(self, config: Any = None, *, max_open: int = 2):
        self._paths = PathCheckpoints(config, max_open=max_open, trusted=False)
        self._guard: Optional["DatastatesSnapshotCallback"] = None

    # ------------------------------------------------------------ CheckpointIO
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any,
                        storage_options: Optional[Any] = None) -> None:
        """Start saving; see the module docstring for when it returns. Raises an earlier
        background failure."""
        if storage_options is not None:
            raise TypeError(f"{type(self).__name__} does not take storage_options; configure "
                            "it through its datastates.CheckpointConfig")
        guard = self._guard
        if guard is not None and guard.active:
            self._paths.save(checkpoint, path, snapshot=False, optimizers=guard.optimizers(),
                             metadata={"framework": "lightning"})
        else:
            self._paths.save(checkpoint, path, snapshot=True, metadata={"framework": "lightning"})

    def load_checkpoint(self, path: Any, map_location: Optional[Any] = None,
                        weights_only: Optional[bool] = None) -> dict[str, Any]:
        """The checkpoint dict, as ``torch.load`` returned it for ``TorchCheckpointIO``.

        ``weights_only`` keeps its ``torch.load`` meaning: unless it is ``False``, Python objects
        of classes outside PyTorch's safe list are refused."""
        if not self._paths.exists(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        if callable(map_location) or isinstance(map_location, dict):
            map_location = None  # Lightning's default `lambda storage, loc: storage`
        return self._paths.load(path, map_location=map_location, trusted=weights_only is False)

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint (after its save, if still in flight, has finished)."""
        self._paths.remove(path)

    def teardown(self) -> None:
        """Wait until every checkpoint is committed; raise the first failure."""
        self._paths.close()

    # ------------------------------------------------------------ extras
    def lazy_snapshots(self) -> "DatastatesSnapshotCallback":
        """The callback that makes saves lazy (add it to ``Trainer(callbacks=[...])``)."""
        return DatastatesSnapshotCallback(self)

    def wait(self) -> None:
        """Block until every checkpoint is committed; raise the first failure."""
        self._paths.wait()

    @property
    def in_flight(self) -> int:
        """Saves started and not yet committed."""
        return self._paths.in_flight

    @property
    def last_save_stats(self):
        """For the most recent ``save_checkpoint``: the :class:`datastates.SaveStats` of the most recent save (None before the first).
        ``blocked_s`` and ``nbytes`` are final once the save call returned; ``snapshot_s`` and
        ``commit_s`` are filled in when the capture and the commit happen (after ``wait()``)."""
        return self._paths.last_save_stats


class DatastatesSnapshotCallback(Callback):
    """Makes :class:`DatastatesCheckpointIO` saves lazy: the parameters and state of the
    trainer's optimizers are captured in the background while the next forward/backward runs,
    and ``on_before_optimizer_step`` waits until the capture is complete."""

    def __init__(self, io: DatastatesCheckpointIO):
        self.io = io
        self._trainer = None

    @property
    def active(self) -> bool:
        return self._trainer is not None

    def optimizers(self) -> list:
        return list(self._trainer.optimizers) if self._trainer is not None else []

    def setup(self, trainer, pl_module, stage: str) -> None:
        if trainer.strategy.checkpoint_io is not self.io:
            raise ValueError("DatastatesSnapshotCallback: the Trainer does not use its "
                             "DatastatesCheckpointIO; pass it in Trainer(plugins=[io])")
        self._trainer = trainer
        self.io._guard = self

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.io._paths.wait_snapshots()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.io._paths.wait_snapshots()
        if self.io._guard is self:
            self.io._guard = None
        self._trainer = None


def load_from_checkpoint(module_class: Any, path: Any, *, trusted: bool = False,
                         **kwargs: Any) -> Any:
    """``module_class.load_from_checkpoint(path)`` for a checkpoint written by
    :class:`DatastatesCheckpointIO` (Lightning's classmethod reads one ``torch.load`` file).

    The checkpoint is exported (streamed, verified) to a temporary ``torch.save`` file next to it,
    which Lightning's own loader then reads, so hyper-parameters, ``on_load_checkpoint`` hooks and
    ``strict``/``map_location``/hparams overrides in ``kwargs`` behave exactly as for a ``.ckpt``
    file; the temporary file is removed before this returns. Python objects in the checkpoint
    load only through PyTorch's safe list unless ``trusted=True``.
    """
    import os
    import tempfile

    import datastates
    folder = os.path.dirname(os.path.abspath(os.fspath(path)))
    with tempfile.TemporaryDirectory(prefix=".datastates-export-", dir=folder) as tmp:
        exported = os.path.join(tmp, "checkpoint.ckpt")
        datastates.export(path, exported, "torch", trusted=trusted)
        return module_class.load_from_checkpoint(exported, weights_only=not trusted, **kwargs)

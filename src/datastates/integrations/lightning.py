"""Lightning: a ``CheckpointIO`` plug-in that writes datastates checkpoints asynchronously.

Usage::

    io = DatastatesCheckpointIO()                        # or DatastatesCheckpointIO(config)
    trainer = Trainer(plugins=[io], callbacks=[io.lazy_snapshots(), ModelCheckpoint(...)])

Lightning calls, on global rank 0 only (``Strategy.save_checkpoint`` / ``remove_checkpoint``):
``save_checkpoint(checkpoint, path)`` from ``trainer.save_checkpoint`` (ModelCheckpoint,
``last.ckpt``, user code), ``remove_checkpoint(path)`` for top-k rotation, and on every rank
``load_checkpoint(path, map_location, weights_only)`` for ``fit(ckpt_path=...)`` and
``teardown()`` at the end of ``fit``/``validate``/``test``.

The checkpoint of ``dirpath/name`` is the datastates checkpoint ``dirpath/.datastates/name/``,
committed atomically; once committed, ``dirpath/name`` is a hard link to its shard file, a
``torch.save`` archive, so ``Model.load_from_checkpoint(path)`` and ``torch.load(path)`` read it
in place, and a listing of ``dirpath`` shows Lightning's names plus ``.datastates`` (``_paths``).
A background failure is raised by the next ``save_checkpoint`` at the latest, and by
``teardown``. With the :meth:`DatastatesCheckpointIO.lazy_snapshots` callback
``save_checkpoint`` returns after planning and the next ``optimizer.step()`` waits for the
copy; without it, once the state is in the host cache. The memory tier:
:class:`DatastatesMemoryCheckpoint` (``io.memory_checkpoints(dirpath)``).

The files on disk, the comparison with ``AsyncCheckpointIO``, the paths Lightning names itself
(hidden Tuner files, ``save_last="link"``, ``ckpt_path="last"``) and the memory tier:
docs/lightning.md.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from typing import Any, Optional

from lightning.fabric.plugins.io.checkpoint_io import CheckpointIO
from lightning.fabric.plugins.io.torch_io import TorchCheckpointIO
from lightning.pytorch.callbacks import Callback

from ._memory import MemorySaves, check_every, framework_memory_tier, memory_wins
from ._layout import ASIDE_PREFIX, checkpoint_dir, hidden_root
from ._paths import PathCheckpoints

log = logging.getLogger("datastates.integrations")

__all__ = [
    "DatastatesCheckpointIO",
    "DatastatesMemoryCheckpoint",
    "DatastatesSnapshotCallback",
    "load_from_checkpoint",
]


class DatastatesCheckpointIO(CheckpointIO):
    """Lightning ``CheckpointIO`` writing datastates checkpoints (see module docstring).

    ``config`` is a :class:`datastates.CheckpointConfig` (host cache size, writer threads, ...).
    One instance may serve several ``Trainer`` runs in sequence. A ``config.memory_tier`` is the
    tier of :meth:`memory_checkpoints`, which the Trainer must then have among its callbacks
    (ConfigError at the first save or load otherwise); the files Lightning names always go to
    storage.
    """

    def __init__(self, config: Any = None, *, max_open: int = 2):
        self._config = config
        self._tier = (
            None if config is None else framework_memory_tier(config, "DatastatesCheckpointIO")
        )
        if self._tier is not None:
            config = config.replace(memory_tier=None)
        self._paths = PathCheckpoints(config, max_open=max_open, trusted=False, idle_close=True)
        self._stock = TorchCheckpointIO()  # hidden names and URLs, see the module docstring
        self._guard: Optional["DatastatesSnapshotCallback"] = None
        self._memory: Optional["DatastatesMemoryCheckpoint"] = None
        self._warned: set[str] = set()  # the URL schemes already reported

    def __getstate__(self) -> dict:
        """Picklable (``ddp_spawn`` sends the Trainer to its processes, ``torch.save(trainer)``):
        the copy has the configuration and no Checkpointer, thread or save in flight (those
        stay with this object), and no callback attached (a run attaches them at ``setup``)."""
        state = dict(self.__dict__)
        state["_guard"] = state["_memory"] = None
        return state

    # ------------------------------------------------------------ the callbacks attached
    def attach_guard(self, callback: Optional["DatastatesSnapshotCallback"]) -> None:
        """Called by :class:`DatastatesSnapshotCallback` at ``setup`` (``callback``) and
        ``teardown`` (None): while attached, saves are lazy snapshots guarded by the run's
        optimizers and the run's teardown closes this io."""
        self._guard = callback
        self._paths.attended = callback is not None

    def guarded_by(self, callback: "DatastatesSnapshotCallback") -> bool:
        """Whether ``callback`` is the one attached."""
        return self._guard is callback

    def attach_memory(self, callback: "DatastatesMemoryCheckpoint") -> None:
        """Called by :class:`DatastatesMemoryCheckpoint` at ``setup``: loads ask it first."""
        self._memory = callback

    def wait_snapshots(self) -> None:
        """Return once every save in flight has captured its state."""
        self._paths.wait_snapshots()

    # ------------------------------------------------------------ CheckpointIO
    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Optional[Any] = None
    ) -> None:
        """Start saving; see the module docstring for when it returns. Raises an earlier
        background failure. ``storage_options`` must be None (ConfigError otherwise): the
        storage is configured through the io's datastates.CheckpointConfig."""
        if storage_options is not None:
            import datastates

            raise datastates.ConfigError(
                f"{type(self).__name__}.save_checkpoint({os.fspath(path)!r}): expected "
                f"storage_options=None, found {type(storage_options).__name__} "
                f"{storage_options!r}; configure the storage through its "
                "datastates.CheckpointConfig"
            )
        orig_path = path
        path = self._local(path)
        if path is None or _hidden(path):
            return self._stock.save_checkpoint(checkpoint, orig_path)
        self._check_memory()
        step = checkpoint.get("global_step") if isinstance(checkpoint, dict) else None
        step = step if type(step) is int and step >= 0 else None
        guard = self._guard
        if guard is not None and guard.active:
            self._paths.save(
                checkpoint,
                path,
                snapshot=False,
                optimizers=guard.optimizers(),
                metadata={"framework": "lightning"},
                step=step,
            )
        elif threading.current_thread() is not threading.main_thread():
            # Another thread saves for the training loop (AsyncCheckpointIO's): commit here,
            # so that its wait (its teardown) covers the commit, nothing stays running after
            # fit() and a failure reaches it; this io's own teardown is not called then.
            self._paths.save(
                checkpoint, path, snapshot=True, metadata={"framework": "lightning"}, step=step
            )
            self._paths.close()
        else:
            self._paths.save(
                checkpoint, path, snapshot=True, metadata={"framework": "lightning"}, step=step
            )

    def load_checkpoint(
        self, path: Any, map_location: Optional[Any] = None, weights_only: Optional[bool] = None
    ) -> dict[str, Any]:
        """The checkpoint dict, as ``torch.load`` returned it for ``TorchCheckpointIO``.

        ``weights_only`` keeps its ``torch.load`` meaning: unless it is ``False``, Python objects
        of classes outside PyTorch's safe list are refused. A path
        :meth:`DatastatesMemoryCheckpoint.resume_path` gave is read from the memory tier; a
        hidden name with ``TorchCheckpointIO``; a link as its target in the same directory."""
        local = self._local(path)
        if local is None or _hidden(local):
            return self._stock.load_checkpoint(
                path, map_location=map_location, weights_only=weights_only
            )
        path = local
        self._check_memory()
        if callable(map_location) or isinstance(map_location, dict):
            map_location = None  # Lightning's default `lambda storage, loc: storage`
        memory = self._memory
        if memory is not None and memory.holds(path):
            return memory.load(path, map_location=map_location, trusted=weights_only is False)
        try:
            path = _resolve_link(path)
            if not self._paths.exists(path):
                raise FileNotFoundError(f"Checkpoint file not found: {path}")
            return self._paths.load(path, map_location=map_location, trusted=weights_only is False)
        finally:
            self._paths.close_if_idle()

    def remove_checkpoint(self, path: Any) -> None:
        """Delete the checkpoint (after its save, if still in flight, has finished); a link
        is removed itself, never its target."""
        local = self._local(path)
        if local is None or _hidden(local):
            return self._stock.remove_checkpoint(path)
        try:
            self._paths.remove(local)
        finally:
            self._paths.close_if_idle()

    def last_path(self, dirpath: Any) -> Optional[str]:
        """``ckpt_path`` for ``fit`` in place of ``"last"``: the newest ``last.ckpt`` (or
        ``last-v<n>.ckpt``) in ModelCheckpoint's ``dirpath``, None if there is none.

        Lightning resolves ``"last"`` from its own listing of files named ``last*.ckpt``
        before calling the plug-in, so it cannot see a ``last.ckpt`` that is not there: a
        crash between the commit and the link, a file system refusing hard links, a checkpoint
        a crash left moved aside (an interrupted replacement). Here the core first repairs
        ``dirpath``, and a checkpoint ``.datastates/last.ckpt`` counts for ``last.ckpt``, as
        does a plain ``last.ckpt`` an earlier version kept aside (see ``load_checkpoint``)."""
        local = self._local(dirpath, report=False)
        if local is None:
            import datastates

            raise datastates.ConfigError(
                f"DatastatesCheckpointIO.last_path: expected a local directory, found the URL "
                f"{dirpath!r} (checkpoints at URLs are Lightning's own files: use "
                "ckpt_path='last')"
            )
        folder = os.path.abspath(local)
        if not os.path.isdir(folder):
            return None
        try:
            self._paths.repair(folder)
            names = {_path_name(n) for n in os.listdir(folder)}
            if os.path.isdir(hidden_root(folder)):
                names.update(os.listdir(hidden_root(folder)))
            found = {}
            for name in names:
                path = os.path.join(folder, name)
                if _LAST.fullmatch(name) and self._paths.exists(_resolve_link(path)):
                    stamps = (path, checkpoint_dir(path), os.path.join(folder, ASIDE_PREFIX + name))
                    found[path] = max(os.stat(p).st_mtime for p in stamps if os.path.exists(p))
            return max(found, key=lambda p: found[p], default=None)
        finally:
            self._paths.close_if_idle()

    def teardown(self) -> None:
        """Wait until every checkpoint is committed, end the threads; raise the first failure.
        (Lightning calls it at the end of ``fit``/``validate``/``test``.)"""
        self._paths.close()

    def _local(self, path: Any, report: bool = True) -> Optional[str]:
        """``path`` as a local path (``file://`` URLs included), or None for a URL of another
        scheme, which Lightning's ``TorchCheckpointIO`` handles (a WARNING, once per scheme)."""
        text = os.fspath(path)
        if not isinstance(text, str):
            text = os.fsdecode(text)
        found = _URL.match(text)
        if found is None:
            return text
        scheme = found.group(1).lower()
        if scheme == "file":
            return text[len(found.group(0)) :]
        if report and scheme not in self._warned:
            self._warned.add(scheme)
            log.warning(
                "DatastatesCheckpointIO writes local paths only; %s is a %s:// URL, so "
                "it and every other %s:// path are saved, loaded and removed by "
                "Lightning's TorchCheckpointIO (one torch.save file, written "
                "synchronously)",
                text,
                scheme,
                scheme,
            )
        return None

    # ------------------------------------------------------------ extras
    def lazy_snapshots(self) -> "DatastatesSnapshotCallback":
        """The callback that makes saves lazy (add it to ``Trainer(callbacks=[...])``)."""
        return DatastatesSnapshotCallback(self)

    def memory_checkpoints(
        self, dirpath: Any, every_n_steps: int = 1
    ) -> "DatastatesMemoryCheckpoint":
        """The callback saving into this config's memory tier (add it to
        ``Trainer(callbacks=[...])``); ``dirpath`` is ModelCheckpoint's directory, on which the
        memory is keyed."""
        return DatastatesMemoryCheckpoint(self, dirpath, every_n_steps=every_n_steps)

    def _check_memory(self) -> None:
        if self._tier is not None and self._memory is None:
            import datastates

            raise datastates.ConfigError(
                "DatastatesCheckpointIO: its config has a memory tier, which only "
                "io.memory_checkpoints(dirpath) uses; add that callback to "
                "Trainer(callbacks=[...]), or drop memory_tier from the config"
            )

    def wait(self) -> None:
        """Block until every checkpoint is committed; raise the first failure. Outside a run
        with the :meth:`lazy_snapshots` callback, the threads end too (a later save starts
        them again)."""
        if self._paths.attended:
            self._paths.wait()
        else:
            self._paths.close()

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


#: ModelCheckpoint's names of ``save_last`` checkpoints.
_LAST = re.compile(r"last(-v\d+)?\.ckpt")
#: A URL's scheme (fsspec's spelling: ``memory://``, ``s3://``, ``file://``).
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")


def _path_name(name: str) -> str:
    """The checkpoint path an entry of ModelCheckpoint's directory stands for."""
    return name[len(ASIDE_PREFIX) :] if name.startswith(ASIDE_PREFIX) else name


def _hidden(path: Any) -> bool:
    """Whether ``path`` is a hidden name (Lightning's temporaries, e.g. the Tuner's)."""
    return os.path.basename(os.fspath(path).rstrip(os.sep)).startswith(".")


def _resolve_link(path: Any) -> Any:
    """``path``, or for a symbolic link the checkpoint it points to, which must lie in the
    link's own directory (``ModelCheckpoint(save_last="link")``); CorruptCheckpointError for a
    link leading out of it (never followed there)."""
    spelled = os.path.abspath(os.fspath(path))
    if not os.path.islink(spelled):
        return path
    folder = os.path.dirname(spelled)
    target = os.path.realpath(spelled)
    if os.path.dirname(target) != os.path.realpath(folder):
        import datastates

        raise datastates.CorruptCheckpointError(
            f"{spelled} is a symbolic link to {target}, outside its directory {folder}; only "
            "a link to a checkpoint in the same directory is followed (as "
            "ModelCheckpoint(save_last='link') makes them)"
        )
    return os.path.join(folder, os.path.basename(target))


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
            raise ValueError(
                "DatastatesSnapshotCallback: the Trainer does not use its "
                "DatastatesCheckpointIO; pass it in Trainer(plugins=[io])"
            )
        self._trainer = trainer
        self.io.attach_guard(self)  # the run's teardown closes the io

    def on_before_optimizer_step(self, trainer, pl_module, optimizer) -> None:
        self.io.wait_snapshots()

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.io.wait_snapshots()
        if self.io.guarded_by(self):
            self.io.attach_guard(None)
        self._trainer = None


def load_from_checkpoint(
    module_class: Any, path: Any, *, trusted: bool = False, **kwargs: Any
) -> Any:
    """``module_class.load_from_checkpoint(path)`` for a checkpoint written by
    :class:`DatastatesCheckpointIO`, every checksum checked first. The stock call reads a
    checkpoint of this version as it is (``path`` is its shard file); this one reads those, a
    checkpoint whose path has no file (a file system without hard links) and the checkpoint
    directories of earlier versions. What another engine wrote at ``path`` after the checkpoint
    (the file is newer) is read by the stock call, as every load here reads it.

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
        kind, source = PathCheckpoints.source(os.path.abspath(os.fspath(path)))
        if kind == "plain":  # another engine's file (written after the checkpoint behind it)
            return module_class.load_from_checkpoint(source, weights_only=not trusted, **kwargs)
        datastates.export(source or path, exported, "torch", trusted=trusted)
        return module_class.load_from_checkpoint(exported, weights_only=not trusted, **kwargs)


class DatastatesMemoryCheckpoint(Callback):
    """Saves the full Lightning checkpoint (what ModelCheckpoint saves) into the memory tier of
    ``io``'s config every ``every_n_steps`` optimizer steps; :meth:`resume_path` is the newest
    of memory and the datastates checkpoints in ``dirpath`` (ModelCheckpoint's directory, on
    which the memory is keyed).

    When a step is saved: at ``on_train_batch_end``, or at ``on_train_epoch_end`` for the
    epoch's last batch, where Lightning resumes from exactly (a dict taken at the last batch's
    end makes a stateful data loader skip the next epoch on resume). Like ModelCheckpoint's
    saves, the dict is taken on the training thread; tensors on the bytes of the trainer's
    optimizers are captured lazily (the optimizer's next step waits for the capture, through
    the core's step pre-hook, which Lightning runs before the closure), every other tensor
    inside the save. Global rank 0 only: one process (ConfigError at ``setup`` otherwise).

    A failed memory save is raised by the next one, at the end of ``fit`` (``teardown``), or
    by :meth:`wait`. The callback holds its own Checkpointer (its own host cache, of the
    config's ``host_cache_bytes``); :meth:`close` releases it and detaches from the keeper
    (``stop_keeper=True``: the job is over, the keeper ends and frees the memory).
    """

    def __init__(self, io: DatastatesCheckpointIO, dirpath: Any, every_n_steps: int = 1):
        import datastates

        if not isinstance(io, DatastatesCheckpointIO):
            raise TypeError(
                f"DatastatesMemoryCheckpoint: expected a DatastatesCheckpointIO, "
                f"found {type(io).__qualname__}"
            )
        if io._tier is None:
            raise datastates.ConfigError(
                "DatastatesMemoryCheckpoint: the DatastatesCheckpointIO's config has no memory "
                "tier; pass CheckpointConfig(memory_tier=MemoryTier(persist_every=None, "
                "persist_on_exit=False)) to it"
            )
        self.io = io
        self.dirpath = os.path.abspath(os.fspath(dirpath))
        self.every_n_steps = check_every(
            every_n_steps, "DatastatesMemoryCheckpoint(every_n_steps=)"
        )
        self._config = io._config.replace(allow_unsafe_objects=True)
        self._ckpt = None
        self._saves = MemorySaves()
        self._last_step: int | None = None

    # ------------------------------------------------------------ Lightning hooks
    def setup(self, trainer, pl_module, stage: str) -> None:
        import datastates

        if trainer.strategy.checkpoint_io is not self.io:
            raise ValueError(
                "DatastatesMemoryCheckpoint: the Trainer does not use its "
                "DatastatesCheckpointIO; pass it in Trainer(plugins=[io])"
            )
        if trainer.world_size != 1:
            raise datastates.ConfigError(
                f"DatastatesMemoryCheckpoint: one process only (found world_size="
                f"{trainer.world_size}); Lightning saves on global rank 0 and loads on every "
                "rank, and the memory tier would then be opened by every rank on its own"
            )
        self.io.attach_memory(self)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if not trainer.fit_loop.epoch_loop.batch_progress.is_last_batch:
            self._save(trainer)

    def on_train_epoch_end(self, trainer, pl_module) -> None:
        self._save(trainer)

    def teardown(self, trainer, pl_module, stage: str) -> None:
        self.wait()

    # ------------------------------------------------------------ resuming
    def resume_path(self) -> str | None:
        """``ckpt_path`` for ``fit``: the memory checkpoint's directory when its step is at
        least that of the newest datastates checkpoint in ``dirpath`` (memory on a tie), else
        that checkpoint's path; None when there is neither. The io reads either path."""
        ckpt = self._checkpointer()
        memory = ckpt.memory.latest() if ckpt.memory is not None else None
        try:
            found = self.io._paths.committed(self.dirpath)  # ModelCheckpoint's, oldest first
        finally:
            self.io._paths.close_if_idle()
        storage = max(found, key=lambda i: (-1 if i.step is None else i.step, i.seq), default=None)
        storage_step = None if storage is None else -1 if storage.step is None else storage.step
        if memory is not None and memory_wins(memory.step, storage_step):
            return memory.path
        if storage is None:
            return None
        return os.path.join(self.dirpath, storage.name)

    def holds(self, path: Any) -> bool:
        """Whether ``path`` is a checkpoint of this memory tier."""
        path = os.path.realpath(os.fspath(path))
        memory = self._checkpointer().memory
        return memory is not None and os.path.dirname(path) == os.path.realpath(memory.directory)

    def load(self, path: Any, *, map_location: Any = None, trusted: bool) -> dict[str, Any]:
        """The checkpoint dict saved at the memory checkpoint ``path`` (read from memory,
        every checksum checked)."""
        import datastates

        ckpt = self._checkpointer()
        name = os.path.basename(os.path.realpath(os.fspath(path)))
        info = next((i for i in ckpt.memory.list() if i.name == name), None)
        if info is None:
            raise datastates.CheckpointNotFoundError(f"{path}: no such memory checkpoint")
        return ckpt.load(step=info.step, map_location=map_location, trusted=trusted)

    # ------------------------------------------------------------ lifecycle
    def wait(self) -> None:
        """Block until every memory save is committed; raise the first failure."""
        self._saves.wait()

    def close(self, stop_keeper: bool = False) -> None:
        """Wait for the memory saves, release the Checkpointer and detach from the keeper
        (``stop_keeper=True`` ends it and frees the memory). Reusable: a later save or
        :meth:`resume_path` opens it again."""
        try:
            self.wait()
        finally:
            ckpt, self._ckpt = self._ckpt, None
            if ckpt is not None:
                ckpt.close(stop_keeper=stop_keeper)

    # ------------------------------------------------------------ internals
    def _save(self, trainer) -> None:
        step = trainer.global_step
        if (
            step == 0
            or step % self.every_n_steps
            or step == self._last_step
            or trainer.sanity_checking
            or not trainer.is_global_zero
        ):
            return
        self._saves.raise_failed()
        ckpt = self._checkpointer()
        if ckpt.memory is None:  # the keeper did not answer: no tier (WARNING at construction)
            return
        checkpoint = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        handle = ckpt.save(
            checkpoint,
            step=step,
            persist=False,
            optimizers=list(trainer.optimizers),
            overwrite=True,  # a step run again (after a resume) replaces it
            metadata={"framework": "lightning", "global_step": step},
        )
        self._saves.add(handle)
        self._last_step = step

    def _checkpointer(self):
        if self._ckpt is None:
            import datastates

            self._ckpt = datastates.Checkpointer(
                self.dirpath, self._config, communicator=datastates.LocalCommunicator()
            )
        return self._ckpt

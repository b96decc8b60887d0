"""Hugging Face ``transformers.Trainer`` whose checkpoints are datastates checkpoints.

Usage (replace ``Trainer`` by ``DatastatesTrainer``; everything else stays)::

    trainer = DatastatesTrainer(model=model, args=TrainingArguments(output_dir="out",
                                save_steps=100, save_total_limit=3), train_dataset=ds)
    trainer.train()                               # checkpoints: out/checkpoint-<step>/
    trainer.train(resume_from_checkpoint=True)    # newest *committed* checkpoint

The extension points are the ones ``Trainer`` documents for overriding: ``_save_checkpoint`` and
the ``_load_*`` methods; ``train`` is wrapped to pick the checkpoint to resume from and to wait for
in-flight saves at the end. No Trainer code is patched. ``checkpoint-N`` is written
asynchronously and appears atomically; ``save_total_limit`` applies after the commit. Resuming
from a checkpoint without this Trainer's keys raises :class:`datastates.StateMismatchError`
before anything is loaded.

What is saved, rotation, export, the memory tier and the limits: docs/huggingface.md.
"""

from __future__ import annotations

import copy
import logging
import os
import re
import shutil
import tempfile
import threading
from typing import TYPE_CHECKING, Any, cast

import torch
from transformers import Trainer
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from datastates.storage import LOCAL
from ._memory import MemorySaves, check_every, framework_memory_tier, memory_wins
from ._paths import base_optimizer, drop_latest, is_checkpoint_dir

if TYPE_CHECKING:
    from datastates import Checkpointer, SaveHandle

log = logging.getLogger("datastates.integrations.hf")

__all__ = ["DatastatesTrainer", "weights_index"]

TRAINER_STATE = "trainer_state.json"
#: The index of a sharded ``.bin`` checkpoint (transformers' ``WEIGHTS_INDEX_NAME``): it names the
#: rank files whose ``torch.load`` view is the model's state dict, so ``from_pretrained`` reads
#: ``checkpoint-N`` in place.
WEIGHTS_INDEX = "pytorch_model.bin.index.json"
#: The key of the model in the saved state, and the view every rank file gives ``torch.load``.
MODEL_KEY = "model"
#: The keys every datastates ``checkpoint-N`` of this Trainer holds (``save_only_model`` too).
TRAINER_KEYS = ("model", "trainer_state")
_STEP = re.compile(rf"^{PREFIX_CHECKPOINT_DIR}-(\d+)$")


class DatastatesTrainer(Trainer):
    """``transformers.Trainer`` with asynchronous, atomic datastates checkpoints.

    ``datastates_config`` is a :class:`datastates.CheckpointConfig`; all other arguments are
    Trainer's. Save and load run on the training thread of each rank; with several ranks every
    rank calls the core's collective ``save`` with the same name (replicated model and optimizer
    tensors are written once, the RNG state per rank).

    With ``datastates_config.memory_tier`` (``persist_every=None, persist_on_exit=False``, else
    ConfigError: storage is ``checkpoint-N``), every ``memory_every``-th optimizer step is also
    saved into the memory tier of ``output_dir``; ``latest_checkpoint()`` and
    ``resume_from_checkpoint=True`` take the newest of memory and ``checkpoint-N``.
    """

    def __init__(self, *args, datastates_config: Any = None, memory_every: int = 1, **kwargs):
        super().__init__(*args, **kwargs)
        import datastates

        self.datastates_config = datastates_config or datastates.CheckpointConfig()
        self._ds_tier = framework_memory_tier(self.datastates_config, "DatastatesTrainer")
        self._ds_memory_every = check_every(memory_every, "DatastatesTrainer(memory_every=)")
        if self._ds_tier is not None and self._ds_unsupported():
            raise datastates.ConfigError(
                "DatastatesTrainer: DeepSpeed and FSDP runs keep Trainer's own checkpointing, "
                "so the memory tier cannot be used with them; drop memory_tier from "
                'datastates_config (for DeepSpeed, see its "datastates_ckpt" key)'
            )
        self._ds_memory = MemorySaves()
        self._ds_memory_step: int | None = None
        self._ds_resume: tuple[str, int] | None = None  # (folder given to Trainer, memory step)
        self._ds: Checkpointer | None = None
        self._ds_root: str | None = None
        self._ds_threads: list[threading.Thread] = []
        self._ds_errors: list[BaseException] = []
        self._ds_lock = threading.Lock()
        self._ds_last_handle: SaveHandle | None = None

    # ------------------------------------------------------------ saving
    def _save_checkpoint(self, model, trial) -> None:
        if self._ds_unsupported():
            return super()._save_checkpoint(model, trial)
        self._ds_raise()
        name = f"{PREFIX_CHECKPOINT_DIR}-{self.state.global_step}"
        if self.hp_search_backend is None and trial is None:
            self.store_flos()
        run_dir = self._get_output_dir(trial=trial)
        ckpt = self._datastates(run_dir)
        if self.state.best_global_step:
            best = os.path.join(run_dir, f"{PREFIX_CHECKPOINT_DIR}-{self.state.best_global_step}")
            if os.path.exists(best) or self.state.best_global_step == self.state.global_step:
                self.state.best_model_checkpoint = best
        self._update_stateful_callbacks()
        handle = ckpt.save(
            self._ds_state(),
            step=self.state.global_step,
            tag=name,
            overwrite=True,
            replicated=self._ds_replicated(),
            metadata={"framework": "transformers", "global_step": self.state.global_step},
            view=MODEL_KEY,
        )
        self._ds_last_handle = handle
        thread = threading.Thread(
            target=self._ds_after_commit,
            name="datastates-hf-commit",
            args=(
                handle,
                run_dir,
                _state_json(self.state),
                self.state.best_model_checkpoint,
                self._ds_model_files(),
            ),
            daemon=True,
        )
        thread.start()
        self._ds_threads.append(thread)
        if self.args.push_to_hub:
            log.warning(
                "push_to_hub of intermediate checkpoints is not supported; "
                "the final model is pushed by save_model()/push_to_hub() as usual"
            )

    def _maybe_log_save_evaluate(self, *args, **kwargs) -> None:
        """Trainer's, then the memory save of this step when one is due: after the step's
        logging, evaluation and ``checkpoint-N``, so it holds the same trainer state."""
        super()._maybe_log_save_evaluate(*args, **kwargs)
        step = self.state.global_step
        if (
            self._ds_tier is not None
            and step > 0
            and step % self._ds_memory_every == 0
            and step != self._ds_memory_step
        ):
            self._ds_save_memory(step)

    def _ds_save_memory(self, step: int) -> None:
        """Save the state ``checkpoint-N`` holds into the memory tier, as step ``step``: the
        full state whatever ``save_only_model`` says (it is for resuming), the trainer state
        with the callbacks' state of now. Lazy as ``checkpoint-N``: the next optimizer step
        waits for the capture. Raises the failure of an earlier memory save."""
        self._ds_memory.raise_failed()
        self.store_flos()
        ckpt = self._datastates(self._ds_output_dir())
        if ckpt.memory is None:  # the keeper did not answer: no tier (WARNING at construction)
            return
        handle = ckpt.save(
            self._ds_state(full=True, state_json=self._ds_state_json()),
            step=step,
            persist=False,
            replicated=self._ds_replicated(),
            overwrite=True,  # a step run again (after a resume) replaces it
            metadata={"framework": "transformers", "global_step": step},
            view=MODEL_KEY,
        )
        self._ds_memory.add(handle)
        self._ds_memory_step = step

    def _ds_state_json(self) -> str:
        """``trainer_state.json`` of now, with the state of every stateful callback, leaving
        ``self.state`` as it is."""
        from transformers.trainer_callback import ExportableState

        found: dict[str, list] = {}
        for cb in self.callback_handler.callbacks + [self.control]:
            if isinstance(cb, ExportableState):
                found.setdefault(type(cb).__name__, []).append(cb.state())
        snapshot = copy.copy(self.state)
        # transformers annotates it as a list of callbacks; it holds name -> state(s)
        snapshot.stateful_callbacks = cast(
            Any, {k: v[0] if len(v) == 1 else v for k, v in found.items()}
        )
        return _state_json(snapshot)

    def _ds_state(
        self, for_restore: bool = False, full: bool = False, state_json: str | None = None
    ) -> dict:
        import datastates

        state: dict[str, Any] = {"model": self.model}
        if not self.args.save_only_model or for_restore or full:
            opt = base_optimizer(self.optimizer)
            if opt is not None:
                state["optimizer"] = opt
            if self.lr_scheduler is not None:
                state["scheduler"] = self.lr_scheduler
            scaler = getattr(self.accelerator, "scaler", None)
            if scaler is not None:
                state["scaler"] = scaler
            state["rng"] = datastates.RNGState()
        if not for_restore:
            state["trainer_state"] = (
                state_json if state_json is not None else _state_json(self.state)
            )
        return state

    def _ds_replicated(self):
        if self.args.world_size <= 1:
            return False
        return ["model", "optimizer"]  # plain DDP: identical on every rank

    def _ds_model_files(self) -> dict[str, str]:
        """The model's ``config.json`` (and ``generation_config.json``), taken on the training
        thread, so that ``datastates export checkpoint-N --to hf OUT`` gives a folder that
        ``from_pretrained`` loads."""
        files = {}
        config = getattr(self.model, "config", None)
        if config is not None and hasattr(config, "to_json_string"):
            files["config.json"] = config.to_json_string()
        generation = getattr(self.model, "generation_config", None)
        if generation is not None and hasattr(generation, "to_json_string"):
            files["generation_config.json"] = generation.to_json_string()
        return files

    def _ds_after_commit(
        self, handle, run_dir: str, state_json: str, best: str | None, model_files: dict[str, str]
    ) -> None:
        """Own thread: after the commit, write trainer_state.json, the model's config files,
        the weights index that makes the rank files the model's weights (:func:`weights_index`)
        and the tokenizer/processor files (as stock checkpoints hold them), then apply
        save_total_limit."""
        try:
            info = handle.wait()
            drop_latest(info.path)  # output_dir holds what Trainer writes there, no hint
            with self._ds_lock:
                if self.args.should_save:
                    for name, text in model_files.items():
                        _write_atomic(os.path.join(info.path, name), text)
                    index = weights_index(info.path)
                    if index is not None:
                        _write_atomic(os.path.join(info.path, WEIGHTS_INDEX), index)
                    if self.processing_class is not None:
                        self.processing_class.save_pretrained(info.path)
                    _write_atomic(os.path.join(info.path, TRAINER_STATE), state_json)
                    self._ds_rotate(run_dir, best, os.path.basename(info.path))
        except BaseException as exc:
            with self._ds_lock:
                self._ds_errors.append(exc)

    def _ds_rotate(self, run_dir: str, best: str | None, newest: str) -> None:
        """Apply ``save_total_limit`` as Trainer's ``rotate_checkpoints`` does, over every
        ``checkpoint-N`` of ``run_dir`` that a resume could pick (:func:`_resumable`): the
        datastates ones (deleted through the Checkpointer) and the stock ones (a
        ``trainer_state.json``; removed with ``shutil.rmtree``, as Trainer removes them).
        Oldest step first; never the highest step, ``newest`` (the checkpoint just committed)
        or the best one. A ``checkpoint-N`` that is neither (a partial stock checkpoint) is
        neither counted nor deleted."""
        limit = self.args.save_total_limit
        if limit is None or limit <= 0:
            return
        found = _resumable(run_dir)
        protected = {newest}
        if found:
            protected.add(os.path.basename(found[-1][1]))
        if best:
            protected.add(os.path.basename(best.rstrip(os.sep)))
        remaining, keep = len(found), max(limit, len(protected))
        for _, path, ours in found:
            if remaining <= keep:
                break
            name = os.path.basename(path)
            if name in protected:
                continue
            if ours:
                if self._ds is None:
                    raise RuntimeError(f"no Checkpointer of {run_dir} is open to delete {name}")
                self._ds.delete(tag=name)
            else:
                shutil.rmtree(path, ignore_errors=True)
            remaining -= 1

    def _update_stateful_callbacks(self) -> None:
        from transformers.trainer_callback import ExportableState

        # transformers annotates it as a list of callbacks; it holds name -> state(s)
        states = cast("dict[str, Any]", self.state.stateful_callbacks)
        for cb in [
            cb
            for cb in self.callback_handler.callbacks + [self.control]
            if isinstance(cb, ExportableState)
        ]:
            name = cb.__class__.__name__
            if isinstance(states.get(name), list):
                states[name].append(cb.state())
            else:
                states[name] = cb.state()

    # ------------------------------------------------------------ resuming
    def train(self, resume_from_checkpoint=None, trial=None, ignore_keys_for_eval=None, **kwargs):
        """Trainer.train; ``resume_from_checkpoint=True`` picks the newest committed
        checkpoint (:meth:`latest_checkpoint`), and in-flight saves are committed before this
        returns."""
        self._ds_memory_step = None
        if self._ds_tier is not None and trial is not None:
            import datastates

            raise datastates.ConfigError(
                "DatastatesTrainer: the memory tier is kept for one "
                "run's output_dir; it cannot be used with a "
                "hyper-parameter search"
            )
        if resume_from_checkpoint is True and not self._ds_unsupported():
            resume_from_checkpoint = self.latest_checkpoint()
            if resume_from_checkpoint is None:
                raise ValueError(
                    f"No valid checkpoint found in output directory ({self.args.output_dir})"
                )
        if isinstance(resume_from_checkpoint, (str, os.PathLike)):
            memory = self._ds_memory_info(os.fspath(resume_from_checkpoint))
            if memory is not None:
                resume_from_checkpoint = self._ds_resume_folder(memory)
            elif is_checkpoint_dir(resume_from_checkpoint):
                self._ds_materialize_state(os.fspath(resume_from_checkpoint))
        try:
            return super().train(
                resume_from_checkpoint=resume_from_checkpoint,
                trial=trial,
                ignore_keys_for_eval=ignore_keys_for_eval,
                **kwargs,
            )
        finally:
            if self._ds_resume is not None:
                shutil.rmtree(self._ds_resume[0], ignore_errors=True)
                self._ds_resume = None
            if self._ds_tier is None:
                self.close_checkpointer()  # no thread or lease file left; a save reopens it
            else:
                self.wait_for_checkpoints()  # attached to its keeper until close_checkpointer

    def latest_checkpoint(self) -> str | None:
        """The checkpoint ``resume_from_checkpoint=True`` resumes from: the committed
        ``checkpoint-N`` with the highest N in ``output_dir`` (datastates or stock; partial
        checkpoints are never considered), or, with a memory tier, the memory checkpoint's
        directory when its step is at least N (the newest of both; memory on a tie). A path
        given to ``train(resume_from_checkpoint=...)`` either way."""
        storage = self._ds_storage_latest()
        if self._ds_tier is None:
            return storage[1] if storage else None
        tier = self._datastates(self._ds_output_dir()).memory
        memory = tier.latest() if tier is not None else None
        if memory is not None and memory_wins(memory.step, storage[0] if storage else None):
            return memory.path
        return storage[1] if storage else None

    def _ds_storage_latest(self) -> tuple[int, str] | None:
        found = _resumable(self._ds_output_dir())
        return found[-1][:2] if found else None

    @property
    def last_save_stats(self):
        """For the most recent datastates ``checkpoint-N`` of this rank: the :class:`datastates.SaveStats` of the most recent save (None before the first).
        ``blocked_s`` and ``nbytes`` are final once the save call returned; ``snapshot_s`` and
        ``commit_s`` are filled in when the capture and the commit happen (after ``wait()``)
        (``wait_for_checkpoints()``). Stock checkpoints (DeepSpeed, FSDP runs) leave it None."""
        handle = self._ds_last_handle
        return None if handle is None else handle.stats

    def wait_for_checkpoints(self) -> None:
        """Block until every checkpoint started so far (``checkpoint-N`` and memory) is
        committed; raise the first failure."""
        for thread in list(self._ds_threads):
            thread.join()
        self._ds_threads.clear()
        self._ds_memory.wait()
        self._ds_raise()

    def _ds_memory_info(self, path: str):
        """The memory checkpoint at ``path`` (a directory :meth:`latest_checkpoint` gave), or
        None when ``path`` is not in this run's memory tier."""
        if self._ds_tier is None:
            return None
        memory = self._datastates(self._ds_output_dir()).memory
        if memory is None:  # the keeper did not answer: no tier
            return None
        path = os.path.realpath(path)
        if os.path.dirname(path) != os.path.realpath(memory.directory):
            return None
        for info in memory.list():
            if info.name == os.path.basename(path):
                return info
        import datastates

        raise datastates.CheckpointNotFoundError(
            f"{path}: no such memory checkpoint (memory holds "
            f"{[i.name for i in memory.list()] or 'none'})"
        )

    def _ds_resume_folder(self, memory) -> str:
        """A folder holding the memory checkpoint's ``trainer_state.json``, given to Trainer
        as ``resume_from_checkpoint`` (Trainer reads that file itself); the ``_load_*``
        methods read everything else from memory. Removed when ``train()`` returns."""
        ckpt = self._datastates(self._ds_output_dir())
        loaded = ckpt.load(step=memory.step, keys="trainer_state")
        if not isinstance(loaded.get("trainer_state"), str):
            _not_a_trainer_checkpoint(
                f"the memory checkpoint {memory.path} (step {memory.step})",
                "trainer_state is missing",
                memory.metadata,
            )
        state_json = loaded["trainer_state"]
        folder = tempfile.mkdtemp(prefix=f"datastates-resume-{memory.name}-")
        _write_atomic(os.path.join(folder, TRAINER_STATE), state_json)
        self._ds_resume = (os.path.realpath(folder), memory.step)
        log.info(
            "resuming from the memory checkpoint %s (global step %d)", memory.path, memory.step
        )
        return folder

    def _ds_materialize_state(self, path: str) -> None:
        """Check that the datastates checkpoint ``path`` is this Trainer's
        (:func:`_require_trainer_keys`), then rewrite its ``trainer_state.json`` from the
        checkpoint if a crash lost it."""
        _require_trainer_keys(path)
        target = os.path.join(path, TRAINER_STATE)
        if os.path.isfile(target):
            return
        root, name = os.path.split(os.path.abspath(path))
        state_json = self._datastates(root).load(tag=name, keys="trainer_state")["trainer_state"]
        _write_atomic(target, state_json)

    def _ds_ours(self, checkpoint) -> bool:
        """Whether ``checkpoint`` is read here: a datastates ``checkpoint-N``, or the folder
        standing for a memory checkpoint (:meth:`_ds_resume_folder`)."""
        if checkpoint is None:
            return False
        return self._ds_memory_step_of(checkpoint) is not None or is_checkpoint_dir(checkpoint)

    def _ds_memory_step_of(self, checkpoint) -> int | None:
        """The memory step ``checkpoint`` stands for, if it is :meth:`_ds_resume_folder`'s."""
        resume = self._ds_resume
        if resume is None or os.path.realpath(os.fspath(checkpoint)) != resume[0]:
            return None
        return resume[1]

    def _ds_restore(self, checkpoint: str, state: dict) -> None:
        """Restore ``state`` (a part of :meth:`_ds_state`) from ``checkpoint``. A damaged
        memory checkpoint is removed before the error is raised, so that the next resume
        takes the newest one left (memory or ``checkpoint-N``)."""
        import datastates

        step = self._ds_memory_step_of(checkpoint)
        if step is not None:
            ckpt = self._datastates(self._ds_output_dir())
            try:
                ckpt.restore(state, step=step, keys=list(state))
            except datastates.CorruptCheckpointError:
                log.error(
                    "the memory checkpoint of step %d is damaged; removing it (resume "
                    "again: the newest checkpoint left is used)",
                    step,
                )
                if ckpt.memory is not None:  # it read the step from there
                    ckpt.memory.delete(step=step)
                raise
            return
        root, name = os.path.split(os.path.abspath(checkpoint))
        self._datastates(root).restore(state, tag=name, keys=list(state))

    def _ds_restore_keys(self, checkpoint: str, keys: list[str]) -> None:
        full = self._ds_state(for_restore=True)
        self._ds_restore(checkpoint, {k: v for k, v in full.items() if k in keys})

    def _load_from_checkpoint(self, resume_from_checkpoint, model=None):
        if not self._ds_ours(resume_from_checkpoint):
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        target = model if model is not None else self.model
        self._ds_restore(resume_from_checkpoint, {"model": target})

    def _load_optimizer_and_scheduler(self, checkpoint):
        if not self._ds_ours(checkpoint):
            return super()._load_optimizer_and_scheduler(checkpoint)
        self._ds_restore_keys(checkpoint, ["optimizer", "scheduler"])

    def _load_scaler(self, checkpoint):
        if not self._ds_ours(checkpoint):
            return super()._load_scaler(checkpoint)
        if getattr(self.accelerator, "scaler", None) is not None:
            self._ds_restore_keys(checkpoint, ["scaler"])

    def _load_rng_state(self, checkpoint):
        if not self._ds_ours(checkpoint):
            return super()._load_rng_state(checkpoint)
        self._ds_restore_keys(checkpoint, ["rng"])

    def _load_best_model(self):
        best = self.state.best_model_checkpoint
        if best is None or not is_checkpoint_dir(best):
            return super()._load_best_model()
        self.wait_for_checkpoints()
        self._load_from_checkpoint(best)

    # ------------------------------------------------------------ internals
    def _ds_output_dir(self) -> str:
        """``args.output_dir`` (TrainingArguments gives it a default: never None here)."""
        out = self.args.output_dir
        if out is None:
            raise ValueError(
                "DatastatesTrainer: TrainingArguments.output_dir is None; the "
                "checkpoints need a folder"
            )
        return out

    def _datastates(self, root: str) -> Checkpointer:
        """The Checkpointer of ``root``; the one of ``output_dir`` has the memory tier (its
        memory is keyed on ``output_dir``), any other one none."""
        import datastates

        root = os.path.abspath(root)
        if self._ds is not None and self._ds_root != root:
            self.wait_for_checkpoints()
            self._ds.close()
            self._ds = None
        if self._ds is None:
            config = self.datastates_config
            if root != os.path.abspath(self._ds_output_dir()):
                config = config.replace(memory_tier=None)
            self._ds = datastates.Checkpointer(root, config)
            self._ds_root = root
        return self._ds

    def _ds_unsupported(self) -> bool:
        return bool(self.is_deepspeed_enabled or self.is_fsdp_enabled)

    def _ds_raise(self) -> None:
        with self._ds_lock:
            if not self._ds_errors:
                return
            first = self._ds_errors[0]
            self._ds_errors.clear()
        raise first

    def close_checkpointer(self, stop_keeper: bool = False) -> None:
        """Wait for in-flight checkpoints and release the host cache and threads. With a
        memory tier this detaches from its keeper, which keeps the memory for a trainer that
        attaches within ``idle_timeout_s``; ``stop_keeper=True`` (the job is over) ends the
        keeper and frees the memory now."""
        self.wait_for_checkpoints()
        if self._ds is not None:
            self._ds.close(stop_keeper=stop_keeper)
            self._ds = None


def _resumable(root: str) -> list[tuple[int, str, bool]]:
    """``(N, path, is datastates)`` for every ``checkpoint-N`` directory of ``root`` that a
    resume may pick, by N: a committed datastates checkpoint, or a stock one (it holds
    ``trainer_state.json``, which stock Trainer writes last)."""
    if not os.path.isdir(root):
        return []
    found = []
    for entry in os.listdir(root):
        m = _STEP.match(entry)
        path = os.path.join(root, entry)
        if m is None or not os.path.isdir(path):
            continue
        if is_checkpoint_dir(path):
            found.append((int(m.group(1)), path, True))
        elif os.path.isfile(os.path.join(path, TRAINER_STATE)):
            found.append((int(m.group(1)), path, False))
    return sorted(found)


def _require_trainer_keys(path: str) -> None:
    """:class:`datastates.StateMismatchError` unless the datastates checkpoint at ``path`` holds
    :data:`TRAINER_KEYS` (one written by the Lightning or DeepSpeed integration does not). Reads
    the manifest only."""
    import datastates

    summary = datastates.inspect(path)
    entries = summary["tensors"] + summary["objects"]
    found = sorted(
        {e["key"].split("/")[0] for e in entries} | {k.split("/")[0] for k in summary["values"]}
    )
    missing = [k for k in TRAINER_KEYS if k not in found]
    if missing:
        _not_a_trainer_checkpoint(
            f"the checkpoint {path}", f"it holds the top-level keys {found}", summary["metadata"]
        )


def _not_a_trainer_checkpoint(where: str, found: str, metadata: dict) -> None:
    import datastates

    raise datastates.StateMismatchError(
        f"DatastatesTrainer cannot resume from {where}: expected a checkpoint written by "
        f"DatastatesTrainer, holding the keys {list(TRAINER_KEYS)}, but {found} (written by "
        f"framework {metadata.get('framework', 'unknown')!r}). Resume from another checkpoint-N, "
        "or move this one out of output_dir"
    )


def weights_index(path: str) -> str | None:
    """The text of ``pytorch_model.bin.index.json`` for the committed checkpoint ``path``, saved
    with ``view="model"``: each key of the model's state dict mapped to the rank file whose view
    holds it whole (a tied weight to the file of the tensor it shares), from the manifest
    (:func:`datastates.inspect`). None, with a WARNING naming the key, when a model tensor is
    split over several files: ``from_pretrained`` cannot read it in place (``datastates export
    --to hf`` can). docs/huggingface.md, "Reading checkpoint-N with from_pretrained"."""
    import json

    import datastates

    summary = datastates.inspect(path, keys=[MODEL_KEY])
    prefix = MODEL_KEY + "/"
    files = {f["rank"]: f["name"] for f in summary["files"]}
    weight_map: dict[str, str] = {}
    total, dtypes = 0, []
    for t in summary["tensors"]:
        if not t["key"].startswith(prefix):
            continue
        if t["shards"] != 1:
            _no_index(path, t["key"], f"it is split over {t['shards']} shard files")
            return None
        weight_map[t["key"][len(prefix) :]] = files[t["ranks"][0]]
        total += t["nbytes"]
        dtypes.append(t["dtype"])
    for o in summary["objects"]:  # a module's extra state: in the view as torch.save has it
        if o["key"].startswith(prefix):
            weight_map[o["key"][len(prefix) :]] = files[o["rank"]]
    if not weight_map:
        return None
    metadata: dict[str, Any] = {"total_size": total}
    # from_pretrained(dtype="auto") takes the dtype from here instead of opening a rank file on
    # the meta device
    floating = [d for d in dtypes if getattr(getattr(torch, d, None), "is_floating_point", False)]
    metadata["dtype"] = (floating or dtypes)[0]  # as transformers' get_state_dict_dtype
    index = {"metadata": metadata, "weight_map": dict(sorted(weight_map.items()))}
    return json.dumps(index, indent=2) + "\n"


def _no_index(path: str, key: str, reason: str) -> None:
    log.warning(
        "%s: no %s written, so from_pretrained cannot read this checkpoint in place: the "
        "model entry %r cannot be served from one rank file (%s); use `datastates export "
        "%s --to hf DIR` for a folder from_pretrained loads",
        path,
        WEIGHTS_INDEX,
        key,
        reason,
        path,
    )


def _state_json(state) -> str:
    """``trainer_state.json`` exactly as ``TrainerState.save_to_json`` writes it."""
    import dataclasses
    import json

    return json.dumps(dataclasses.asdict(state), indent=2, sort_keys=True) + "\n"


def _write_atomic(path: str, text: str) -> None:
    LOCAL.write_atomic(path, text.encode(), fsync=True)

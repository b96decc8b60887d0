"""DeepSpeed: the engine behind DeepSpeed's built-in ``"datastates_ckpt"`` config key.

DeepSpeed 0.19 ships ``DataStatesCheckpointEngine``; when the config holds
``"datastates_ckpt": {...}`` it does ``from datastates import CheckpointEngine`` and calls, on
every rank (``deepspeed/runtime/checkpoint_engine/datastates_checkpoint_engine.py``)::

    CheckpointEngine(deepspeed_config, rank)   # once, in DeepSpeedEngine.__init__
    save(state_dict, path)                    # per file of a tag, inside save_checkpoint()
    load(path, map_location)                  # per file, inside load_checkpoint()
    wait(persist=True)                        # from its commit() and cleanup()

``datastates.CheckpointEngine`` is :class:`CheckpointEngine` (alias
:data:`DeepSpeedCheckpointEngine`). Every ``save(path)`` commits on its own in the background
(atomic per path) and returns once its state is in the host cache; :func:`enable_lazy_snapshots`
makes it return after planning, the optimizer step waiting for the copy. Global rank 0 writes
``save_dir/latest`` once a tag is complete (DeepSpeed does not for this engine). A "file"
DeepSpeed names, ``tag/<file>``, is the datastates checkpoint ``tag/.datastates/<file>/``; once
it is committed ``tag/<file>`` is a hard link to its shard file, a ``torch.save`` archive, so
DeepSpeed's offline tools (``zero_to_fp32.py``) read the tag folder as it is, and a listing of
the tag folder shows DeepSpeed's file names plus ``.datastates``. Checkpoints of
earlier versions (a directory at the file's path) need :func:`export_torch_files` first.

Config keys (all optional): ``host_cache_size`` (GB, default 1), ``parser_threads`` (alias of
``writer_threads``), ``update_latest`` (default true), ``trusted_load`` (default true), and any
:class:`datastates.CheckpointConfig` field by name except ``memory_tier`` (ConfigError,
:data:`MEMORY_TIER_REFUSED` says why).

When a tag is complete, when ``latest`` moves, and why DeepSpeed's own commit path does not
wait: docs/deepspeed.md.
"""

from __future__ import annotations

import atexit
import dataclasses
import inspect
import logging
import os
import threading
import weakref
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from datastates import add_step_waiter
from datastates.storage import LOCAL
from ._paths import PathCheckpoints, base_optimizer

log = logging.getLogger("datastates.integrations.deepspeed")

__all__ = [
    "CheckpointEngine",
    "DeepSpeedCheckpointEngine",
    "config_from_deepspeed",
    "enable_lazy_snapshots",
    "export_torch_files",
    "low_precision_params",
    "wait_for_checkpoints",
]

_GB = 1 << 30

#: Why ``"datastates_ckpt": {"memory_tier": ...}`` is refused, and what to use instead.
MEMORY_TIER_REFUSED = (
    "datastates_ckpt: memory_tier is not supported with DeepSpeed. A DeepSpeed checkpoint is "
    "a tag folder of files that DeepSpeed names and saves one by one (model states, and with "
    "ZeRO one optimizer-state file per rank), and load_checkpoint() finds them in that folder "
    "itself (a glob of mp_rank_*_model_states.pt, os.path.exists of each "
    "*_optim_states.pt), with no call at the end of save_checkpoint(); a memory checkpoint is "
    "one commit per step, in a directory DeepSpeed never lists. Keep DeepSpeed's checkpoints in "
    'storage with "datastates_ckpt" (no memory_tier); for a checkpoint every step in memory, '
    "use the Hugging Face or Lightning integration, or a datastates.Checkpointer with "
    "CheckpointConfig(memory_tier=...) in a plain PyTorch loop (docs/integrations.md)"
)


def config_from_deepspeed(deepspeed_config: Any):
    """Build a :class:`datastates.CheckpointConfig` and the adapter options from what DeepSpeed
    passes: its ``DeepSpeedConfig`` (``.datastates_config.config``), or a plain dict."""
    import datastates

    raw = deepspeed_config
    if hasattr(raw, "datastates_config"):
        raw = raw.datastates_config.config
    if raw is None or raw is True:
        raw = {}
    if not isinstance(raw, dict):
        raise TypeError(f"datastates_ckpt: expected a dict of options, found {type(raw).__name__}")
    raw = dict(raw)
    if raw.get("memory_tier") is not None:
        raise datastates.ConfigError(MEMORY_TIER_REFUSED)
    options = {
        "update_latest": bool(raw.pop("update_latest", True)),
        "trusted_load": bool(raw.pop("trusted_load", True)),
    }
    fields = {f.name for f in dataclasses.fields(datastates.CheckpointConfig)}
    kwargs: dict[str, Any] = {}
    if "host_cache_size" in raw:
        kwargs["host_cache_bytes"] = int(float(raw.pop("host_cache_size")) * _GB)
    if "parser_threads" in raw:
        kwargs["writer_threads"] = int(raw.pop("parser_threads"))
    for key in ("pin_host_cache", "fast_cache_init", "engine_type", "profile_engine"):
        raw.pop(key, None)  # prototype keys with no meaning here
    for key in list(raw):
        if key in fields:
            kwargs[key] = raw.pop(key)
    if raw:
        raise ValueError(
            f"datastates_ckpt: unknown option(s) {sorted(raw)}; known: "
            f"host_cache_size, parser_threads, update_latest, trusted_load, "
            f"{', '.join(sorted(fields))}"
        )
    return datastates.CheckpointConfig(**kwargs), options


class _Tag:
    """The saves of one tag folder (``save_dir/tag``) on this rank, for ``latest``."""

    __slots__ = ("seq", "handles", "save_latest", "sealed", "failed")

    def __init__(self) -> None:
        self.seq = 0  # order in which tags were opened; `latest` never goes back
        self.handles: list = []  # one SaveHandle per file of the tag
        self.save_latest = True  # DeepSpeed's save_checkpoint(save_latest=...)
        self.sealed = False  # no more save() will come for it
        self.failed = False  # a save() of one of its files raised


class CheckpointEngine:
    """``datastates.CheckpointEngine``: what DeepSpeed's ``DataStatesCheckpointEngine`` drives.

    All methods run on the training thread of one rank; each rank has its own instance and
    writes only the files DeepSpeed gives it (no collective is called here). ``latest`` is
    written by global rank 0 as the module docstring says: once the tag is complete (the first
    optimizer step on the saving thread, a save of another tag, ``wait()``, ``close()``) and all
    of its files of the tag are committed, never for a tag saved with ``save_latest=False`` or
    with a failed file, and never naming an older tag than one it already named.
    """

    def __init__(self, config_params: Any = None, rank: int = 0):
        config, options = config_from_deepspeed(config_params)
        self.rank = int(rank)
        self.update_latest = options["update_latest"]
        self._paths = PathCheckpoints(  # DeepSpeed's load globs the files it saved
            config,
            max_open=2,
            trusted=options["trusted_load"],
            on_commit=self._committed,
            mark_unlinked=True,
        )
        self._guard_optimizers: list = []  # as given (wrappers): the core unwraps them
        self._hooks: list = []
        self._tags: dict[str, _Tag] = {}  # tag dir -> its saves, until `latest` is decided
        self._open_tag: str | None = None  # tag dir whose save() calls may still come
        self._tag_seq = 0
        self._save_thread: int | None = None  # the thread that called save() last
        self._tag_lock = threading.Lock()
        self._latest_lock = threading.RLock()  # held over deciding and writing `latest` (taken
        # before _tag_lock): one write at a time, in tag order
        self._latest_seq: dict[str, int] = {}  # save dir -> seq of the tag its `latest` names
        self._closed = False
        # DeepSpeed calls nothing at the end of save_checkpoint(): the next optimizer step
        # (any torch optimizer, on the saving thread) ends the tag (_at_step).
        self._step_hook = register_optimizer_step_pre_hook(_step_hook(weakref.ref(self)))
        atexit.register(_wait_at_exit, weakref.ref(self))
        _ignore_deepspeed_double_cleanup()

    # ------------------------------------------------------------ DeepSpeed's calls
    def save(self, state_dict: dict, path: str) -> bool:
        """Checkpoint ``state_dict`` to ``path`` (a new datastates checkpoint of that name).

        Returns once the state is captured (default) or planned (after
        :func:`enable_lazy_snapshots`); raises a failure of an earlier save. Called by
        DeepSpeed's wrapper inside ``save_checkpoint()``, it honours that call's
        ``save_latest`` (:meth:`_save_latest_of`)."""
        tag_dir = os.path.dirname(os.path.abspath(path))
        frame = inspect.currentframe()  # None on a Python without stack frames
        caller = frame.f_back if frame is not None else None
        try:
            save_latest = self._save_latest_of(caller, tag_dir)
        finally:
            del caller
        self._seal_if_new(tag_dir)
        state = state_dict
        if self._guard_optimizers:
            import datastates

            updated = [t for opt in self._guard_optimizers for t in low_precision_params(opt)]
            state = datastates.mark_lazy(state_dict, updated)
        with self._tag_lock:
            tag = self._tags.setdefault(tag_dir, _Tag())
            if self._open_tag != tag_dir:  # (re)opened: it is now the newest tag
                self._tag_seq += 1
                tag.seq = self._tag_seq
            tag.sealed = False
            tag.save_latest = save_latest
            self._open_tag = tag_dir
            self._save_thread = threading.get_ident()
        try:
            handle = self._paths.save(
                state,
                path,
                snapshot=not self._guard_optimizers,
                optimizers=self._guard_optimizers,
                metadata={"framework": "deepspeed", "rank": self.rank},
            )
        except BaseException:
            with self._tag_lock:
                tag.failed = True  # the tag misses a file: never named by `latest`
            raise
        with self._tag_lock:
            tag.handles.append(handle)
        return True

    def load(self, path: str, map_location: Any = None) -> Any:
        """What ``torch.load(path, map_location)`` returned for the state saved to ``path``."""
        if callable(map_location) or isinstance(map_location, dict):
            map_location = None  # DeepSpeed's `lambda storage, loc: storage`: stay on the CPU
        return self._paths.load(path, map_location=map_location)

    def wait(self, persist: bool = True) -> None:
        """``persist=False``: until every save is captured; ``True``: until every save is
        committed (and ``latest`` written). Raises the first background failure."""
        if persist:
            self._seal_if_new(None)
            self._paths.wait()
            self._poll_latest()
        else:
            self._paths.wait_snapshots()
            self._paths.raise_errors()

    def commit(self, tag: Any = None) -> bool:
        """The prototype's ``commit(tag)``: everything saved so far is durable."""
        self.wait(persist=True)
        return True

    def close(self) -> None:
        """Wait for every save, release the host cache and threads, remove the step guards."""
        if self._closed:
            return
        self._closed = True
        for remove in self._hooks:
            remove()
        self._hooks.clear()
        self._step_hook.remove()
        self._seal_if_new(None)
        try:
            self._paths.close()
        finally:
            self._poll_latest()

    shutdown = close

    @property
    def last_save_stats(self):
        """For the most recent ``save()`` of this rank (one DeepSpeed file): the :class:`datastates.SaveStats` of the most recent save (None before the first).
        ``blocked_s`` and ``nbytes`` are final once the save call returned; ``snapshot_s`` and
        ``commit_s`` are filled in when the capture and the commit happen (after ``wait()``)."""
        return self._paths.last_save_stats

    # ------------------------------------------------------------ lazy snapshots
    def guard(self, optimizer: Any) -> None:
        """Make saves lazy: ``optimizer.step()`` (a torch optimizer, or a DeepSpeed wrapper
        exposing ``.optimizer``) waits until every in-flight save has captured its state.
        Following the core's capture rule, tensors on the bytes of the torch optimizer's
        parameters and state, and of the low-precision parameters a DeepSpeed wrapper writes in
        its step after the inner step (:func:`low_precision_params`), are then captured in the
        background; any other tensor (buffers, frozen parameters, client state) is copied into
        the host cache inside ``save()``."""
        opt = base_optimizer(optimizer)
        if opt is None:
            raise TypeError(
                f"guard(): {type(optimizer).__qualname__} is not a torch optimizer "
                "and has no .optimizer attribute that is one"
            )
        self._guard_optimizers.append(optimizer)
        self._hooks.append(add_step_waiter(opt, self._before_step))

    def _before_step(self, *_args) -> None:
        self._seal_if_new(None)
        self._paths.wait_snapshots()

    # ------------------------------------------------------------ latest
    def _save_latest_of(self, caller: Any, tag_dir: str) -> bool:
        """``save_checkpoint(save_latest=...)`` of the DeepSpeed call saving ``tag_dir``.

        DeepSpeed 0.19 gives it only to its wrapper: ``DataStatesCheckpointEngine.create(info)``
        at the start of ``save_checkpoint()`` keeps the ``CheckpointCommitInfo`` as
        ``commit_info``, then the wrapper's ``save()`` calls ours. ``caller`` is the frame that
        called :meth:`save`; True (DeepSpeed's default) when it is not that wrapper's or its
        info names another tag folder."""
        wrapper = caller.f_locals.get("self") if caller is not None else None
        if wrapper is None or getattr(wrapper, "ckpt_engine", None) is not self:
            return True
        info = getattr(wrapper, "commit_info", None)
        if info is None or not hasattr(info, "save_latest"):
            return True
        if os.path.join(os.path.abspath(info.save_dir), str(info.tag)) != tag_dir:
            return True
        return bool(info.save_latest)

    def _at_step(self) -> None:
        """An optimizer step begins: on the saving thread it ends the open tag, and any tag
        whose files are all committed by now gets its ``latest``."""
        if threading.get_ident() != self._save_thread:
            return
        self._seal_if_new(None)
        self._poll_latest()

    def _seal_if_new(self, tag_dir: str | None) -> None:
        """No more save() will come for the open tag (a new tag started, a step or wait came):
        its ``latest`` may be written once its files are committed."""
        with self._tag_lock:
            open_tag = self._open_tag
            if open_tag is None or open_tag == tag_dir:
                return
            self._open_tag = None
            if open_tag in self._tags:
                self._tags[open_tag].sealed = True
        self._write_latest_if_ready(open_tag)

    def _poll_latest(self) -> None:
        """Decide ``latest`` for every sealed tag whose saves all finished; returns once a
        write another thread is doing is done too."""
        with self._latest_lock:
            with self._tag_lock:
                sealed = [d for d, tag in self._tags.items() if tag.sealed]
            for tag_dir in sealed:
                self._write_latest_if_ready(tag_dir)

    def _committed(self, path: str, info: Any) -> None:
        """The finisher thread: the file at ``path`` is committed."""
        self._write_latest_if_ready(os.path.dirname(path))

    def _write_latest_if_ready(self, tag_dir: str) -> None:
        """Decide ``latest`` for ``tag_dir`` once it is sealed and every save of it finished:
        write it (rank 0, all committed, wanted), else drop the tag. Any thread; a caller
        finding the tag decided by another thread returns only once that one's write is done."""
        with self._latest_lock:
            with self._tag_lock:
                tag = self._tags.get(tag_dir)
                if tag is None or not tag.sealed or not all(h.done() for h in tag.handles):
                    return
                del self._tags[tag_dir]
                committed = (
                    bool(tag.handles)
                    and not tag.failed
                    and all(h.exception() is None for h in tag.handles)
                )
            if not (committed and tag.save_latest and self.update_latest and self.rank == 0):
                return
            save_dir, name = os.path.split(tag_dir)
            if tag.seq < self._latest_seq.get(save_dir, 0):
                return  # `latest` already names a tag opened after this one
            LOCAL.write_atomic(os.path.join(save_dir, "latest"), name.encode(), fsync=True)
            self._latest_seq[save_dir] = tag.seq


def _step_hook(ref):
    """A global optimizer step pre-hook calling ``_at_step`` of the engine behind ``ref``
    (a weak reference: the hook does not keep the engine alive)."""

    def hook(_optimizer, _args, _kwargs) -> None:
        engine = ref()
        if engine is not None:
            engine._at_step()

    return hook


#: The same class under a descriptive name.
DeepSpeedCheckpointEngine = CheckpointEngine


def enable_lazy_snapshots(engine: Any) -> "CheckpointEngine":
    """Make the datastates saves of a ``DeepSpeedEngine`` fully lazy.

    ``save_checkpoint()`` then returns after planning; forward and backward overlap the copy
    into the host cache, and the engine's optimizer step waits for it (a step pre-hook on the
    torch optimizer inside ``engine.optimizer``: ZeRO 1/2, bf16/fp16 wrappers and plain
    optimizers all update parameters and state through it). Returns the datastates engine.
    """
    ours = _engine_of(engine, "enable_lazy_snapshots")
    if engine.optimizer is None:
        raise ValueError("enable_lazy_snapshots(): the engine has no optimizer")
    ours.guard(engine.optimizer)
    return ours


def wait_for_checkpoints(engine: Any) -> None:
    """Block until every checkpoint ``engine.save_checkpoint()`` started is committed and
    ``save_dir/latest`` names the newest tag; re-raises the first background failure.

    DeepSpeed waits only at ``engine.destroy()``; a ``load_checkpoint()`` in the same process
    before that may find no ``latest`` yet (DeepSpeed then warns and returns ``(None, None)``).
    Called on the training thread; idempotent."""
    _engine_of(engine, "wait_for_checkpoints").wait(persist=True)


def _engine_of(engine: Any, caller: str) -> "CheckpointEngine":
    """The datastates engine inside a ``DeepSpeedEngine`` (TypeError if it has none)."""
    wrapper = getattr(engine, "checkpoint_engine", None)
    ours = getattr(wrapper, "ckpt_engine", wrapper)
    if not isinstance(ours, CheckpointEngine):
        raise TypeError(
            f"{caller}(): this DeepSpeed engine does not checkpoint through "
            'datastates; add "datastates_ckpt": {...} to its config'
        )
    return ours


def low_precision_params(optimizer: Any) -> list[torch.Tensor]:
    """The bf16/fp16 parameters a DeepSpeed wrapper writes inside its ``step()``, after the step
    of its inner torch optimizer (whose pre-hook is the guard), so they change only behind the
    guard: ZeRO-1/2 ``bit16_groups``, ``BF16_Optimizer.bf16_groups``, FP16 ``fp16_groups``.
    None for ZeRO-3 (parameters are gathered and released during forward) or a torch optimizer.
    """
    if any(c.__name__ == "DeepSpeedZeroOptimizer_Stage3" for c in type(optimizer).__mro__):
        return []
    if isinstance(optimizer, torch.optim.Optimizer):
        return []
    out: list[torch.Tensor] = []
    for attr in ("bit16_groups", "bf16_groups", "fp16_groups"):
        for group in getattr(optimizer, attr, None) or ():
            out.extend(t for t in group if isinstance(t, torch.Tensor))
    return out


def export_torch_files(tag_dir: str, out_root: str | None = None) -> list[str]:
    """Write every datastates "file" of a DeepSpeed tag folder as a plain ``torch.save`` file, in
    the layout DeepSpeed's offline tools read: ``out_root/<tag>/<file>`` plus ``out_root/latest``
    naming the tag. For tag folders of earlier versions, whose files are directories: those of
    this version are read in place. ``out_root`` defaults to the save folder's path + ``"-torch"``. Then::

        python -m deepspeed.utils.zero_to_fp32 SAVE_DIR-torch OUTPUT_DIR

    consolidates the fp32 weights exactly as for DeepSpeed's own files (no ``--tag`` needed). Each
    file is streamed from the checkpoint (verified) and written atomically; returns their paths.
    A file's checkpoint is the directory at its path (earlier versions) or the one behind it in
    ``tag/.datastates/``; where both are there, the one behind it (saved later).
    """
    import datastates
    from ._layout import checkpoint_dir, hidden_root, is_checkpoint_dir

    tag_dir = os.path.abspath(tag_dir).rstrip(os.sep)
    save_dir, tag = os.path.split(tag_dir)
    out_root = os.path.abspath(out_root or save_dir + "-torch")
    os.makedirs(os.path.join(out_root, tag), exist_ok=True)
    names = set(os.listdir(tag_dir))
    if os.path.isdir(hidden_root(tag_dir)):
        names.update(os.listdir(hidden_root(tag_dir)))
    written = []
    for name in sorted(n for n in names if not n.startswith(".")):
        src = checkpoint_dir(os.path.join(tag_dir, name))
        if not is_checkpoint_dir(src):
            src = os.path.join(tag_dir, name)
        if is_checkpoint_dir(src):
            dst = os.path.join(out_root, tag, name)
            datastates.export(src, dst, "torch", trusted=True)  # DeepSpeed's files hold objects
            written.append(dst)
    LOCAL.write_atomic(os.path.join(out_root, "latest"), tag.encode(), fsync=True)
    return written


#: The hooks ``_ignore_deepspeed_double_cleanup`` installed (one per process).
_FILTERS: set = set()


def _ignore_deepspeed_double_cleanup() -> None:
    """DeepSpeed 0.19's ``DataStatesCheckpointEngine.cleanup()`` deletes its ``ckpt_engine``
    attribute and its ``__del__`` then calls ``cleanup()`` again, which raises AttributeError
    inside ``__del__``; Python prints it as "Exception ignored ..." at exit. That one harmless
    report (the engine was already waited for and released) is dropped through Python's
    documented ``sys.unraisablehook`` chain; every other unraisable exception reaches the hook
    that was installed before. Installed once per process."""
    import sys

    previous = sys.unraisablehook
    if previous in _FILTERS:
        return

    def hook(unraisable) -> None:
        where = getattr(unraisable.object, "__qualname__", "")
        if (
            unraisable.exc_type is AttributeError
            and where.startswith("DataStatesCheckpointEngine")
            and "ckpt_engine" in str(unraisable.exc_value)
        ):
            return
        previous(unraisable)

    _FILTERS.add(hook)
    sys.unraisablehook = hook


def _wait_at_exit(ref) -> None:
    engine = ref()
    if engine is None or engine._closed:
        return
    try:
        engine.close()
    except BaseException as exc:  # at exit: report, never raise
        log.error("a DeepSpeed checkpoint failed before exit: %r", exc)

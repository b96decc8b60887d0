"""Path-addressed checkpoints: what the frameworks that think in files (DeepSpeed, Lightning) need.

A framework asks to save a state "to the file ``dir/name``". Here that becomes the datastates
checkpoint ``name`` of the hidden directory ``dir/.datastates`` (one rank: one shard file, a
``torch.save`` archive), committed atomically by the core; right after the commit ``dir/name``
becomes a hard link to that shard file (a link made under a temporary name, then renamed over
the path), so the framework's own loader and ``torch.load`` read the path in place, no tensor
byte is written twice, and a listing of ``dir`` shows the framework's names plus
``.datastates`` only. Until then the path keeps what it held (the previous checkpoint,
another engine's file, or an empty placeholder file). Where the file system refuses hard links
there is no file at the path, and the checkpoint is read through :meth:`PathCheckpoints.load`
(one WARNING per directory). Layout, crash cases and older layouts: docs/lightning.md,
"Files on disk".

Threads and ownership:
- every public method runs on the caller's (training) thread; the link is made on the
  finisher thread, after the commit and before ``on_commit``;
- one :class:`datastates.Checkpointer` per directory (``dir/.datastates``; ``dir`` itself only
  for the checkpoint directories earlier versions wrote at the paths), created on first use
  and owned here; the
  first one owns the host cache and threads and every other one shares them
  (``Checkpointer(share=...)``), so a new directory (a new DeepSpeed tag) allocates nothing;
  at most ``max_open`` stay open (the least recently used sharer is closed once its saves are
  done);
- a background failure is kept and raised by the next :meth:`PathCheckpoints.save`,
  :meth:`PathCheckpoints.wait` or :meth:`PathCheckpoints.close` (never lost, never a crash of
  the training process).

A framework's checkpoint holds the framework's own Python objects (DeepSpeed's argparse
namespace, Lightning's hyper-parameters), which ``torch.save`` writes whatever they are: saves
here accept them (``CheckpointConfig.allow_unsafe_objects``), and the framework's load call
decides whether they are trusted when read (``trusted``, Lightning's ``weights_only``).
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
from collections import OrderedDict
from typing import Any, Callable, Iterable

import torch

from ._layout import (
    FOLDER,
    LINK_REFUSED_ERRNOS,
    aside_path,
    checkpoint_dir,
    drop_aside,
    drop_placeholder,
    drop_stale_links,
    file_at,
    file_is_newer,
    hidden_root,
    is_checkpoint_dir,
    link_into_place,
    make_placeholder,
    vacant,
)

log = logging.getLogger("datastates.integrations")


def _core():
    import datastates  # the public API only; imported late so the module loads without it

    return datastates


def split_path(path) -> tuple[str, str]:
    """``"dir/name"`` → (absolute dir, name)."""
    path = os.path.abspath(os.fspath(path))
    root, name = os.path.split(path.rstrip(os.sep))
    if not name or name.startswith(".") or name == "latest":
        raise ValueError(
            f"cannot checkpoint to {path!r}: the last path component must not be "
            "empty, start with '.', or be 'latest'"
        )
    return root, name


def refuse_memory_tier(config, who: str) -> None:
    """ConfigError for a config with a memory tier where the checkpoints are the framework's named
    files (a path, a DeepSpeed tag's files): a named save always goes to storage
    (docs/memory-tier.md). The memory tier is added beside them by the Hugging Face and
    Lightning adapters (docs/integrations.md)."""
    if config.memory_tier is not None:
        raise _core().ConfigError(
            f"{who}: CheckpointConfig(memory_tier=...) is not supported here; each checkpoint "
            "is a named file, and named checkpoints go to storage. For checkpoints in memory "
            "use DatastatesTrainer(datastates_config=...) (Hugging Face), "
            "DatastatesCheckpointIO(config).memory_checkpoints(dirpath) (Lightning), or a "
            "Checkpointer saving steps in the training loop"
        )


def base_optimizer(opt: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer inside framework wrappers (accelerate's ``AcceleratedOptimizer``,
    DeepSpeed's ZeRO wrappers, ``LightningOptimizer``): the core's unwrapping rule."""
    return _core().torch_optimizer(opt)


def drop_latest(path: str, info: Any = None) -> None:
    """After the commit of ``path``: remove the core's ``latest`` hint beside it if it names
    that checkpoint. A framework lists that directory itself (Hugging Face's ``output_dir``)
    and reads no such hint; loads here never read it either. (The checkpoints behind a
    framework's paths keep their hint in the hidden folder, where no one lists it; a checkpoint
    directory an earlier version wrote at a path has its hint beside it.)"""
    latest = os.path.join(os.path.dirname(path), "latest")
    name = os.path.basename(path)
    try:
        with open(latest, "rb") as f:
            named = f.read(4096)
        if named == name.encode():
            os.remove(latest)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning("could not remove the hint %s: %r", latest, exc)


class _Pending:
    __slots__ = ("handle", "path", "done", "reported", "placeholder")

    def __init__(self, handle, path: str, placeholder: tuple[int, int] | None):
        self.handle, self.path, self.placeholder = handle, path, placeholder
        self.done = threading.Event()
        self.reported = False


class PathCheckpoints:
    """Saves, loads and removes checkpoints addressed by file-like paths (see module docstring)."""

    def __init__(
        self,
        config=None,
        *,
        max_open: int = 2,
        trusted: bool = True,
        on_commit: Callable[[str, Any], None] | None = None,
        idle_close: bool = False,
        mark_unlinked: bool = False,
    ):
        ds = _core()
        config = config if config is not None else ds.CheckpointConfig()
        refuse_memory_tier(config, "a framework's checkpoint paths")
        # The core's capture rule decides each tensor; the snapshot waits are ours (save()).
        self.config = config.replace(lazy="always", allow_unsafe_objects=True)
        self.max_open = max(1, int(max_open))
        self.trusted = trusted
        self.on_commit = on_commit
        #: Where the file system refuses hard links: leave an empty file at the path (a
        #: framework that lists or tests the names it saved, DeepSpeed's load_checkpoint, then
        #: finds it and asks :meth:`load`), instead of no file.
        self.mark_unlinked = mark_unlinked
        #: Close every Checkpointer (its threads, its lease) once no save is in flight, unless
        #: :attr:`attended` (see :meth:`_idle`).
        self.idle_close = idle_close
        #: Set by the owner while a run that will call :meth:`close` is using this object.
        self.attended = False
        self._start()

    def _start(self) -> None:
        """The runtime state: nothing here survives a pickle (:meth:`__getstate__`)."""
        self._ckpts: OrderedDict[str, Any] = OrderedDict()
        self._base = None  # the Checkpointer owning the shared host cache and threads
        self._pending: dict[str, _Pending] = {}
        self._starting = 0  # saves between their start and their entry in _pending
        self._last_handle = None
        self._errors: list[BaseException] = []
        self._unlinked: set[str] = set()  # directories whose file system refused a hard link
        self._lock = threading.RLock()
        self._finisher = _Finisher(self)

    def __getstate__(self) -> dict:
        """The configuration only: a copy (a pickle sent to a spawned process, ``torch.save``
        of a Trainer) starts with no Checkpointer, thread or save in flight; the saves in
        flight stay with this object and are committed and reported by it."""
        return {
            "config": self.config,
            "max_open": self.max_open,
            "trusted": self.trusted,
            "on_commit": self.on_commit,
            "idle_close": self.idle_close,
            "mark_unlinked": self.mark_unlinked,
        }

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.attended = False
        self._start()

    # ------------------------------------------------------------ save / load / remove
    def save(
        self,
        state: Any,
        path,
        *,
        snapshot: bool,
        metadata: dict | None = None,
        optimizers: Iterable[Any] = (),
        step: int | None = None,
    ):
        """Start saving ``state`` to ``path``; return its handle. ``step`` (the framework's
        global step, if it has one) is recorded as the checkpoint's step. ``path`` exists from
        here on (what it held, or an empty file, until the link made after the commit
        replaces it: :func:`make_placeholder`, :func:`link_into_place`). The checkpoint of an
        earlier save superseded by a symbolic link at its path is deleted first
        (:meth:`_drop_superseded`).

        ``optimizers`` are the optimizers whose parameters and state ``state`` holds (as state
        dicts): tensors on their bytes may be captured lazily (the core's rule), every other
        tensor is copied into the host cache before this returns. ``snapshot=True`` returns only
        after the whole state is captured (nothing the caller does afterwards can change the
        checkpoint); ``False`` leaves lazy tensors to be captured in the background, so the
        caller must hold a step guard (:meth:`wait_snapshots`).
        """
        self.raise_errors()
        root, name = split_path(path)
        full = os.path.join(root, name)
        self._wait_path(full)
        self._drop_superseded(root)
        with self._lock:
            self._starting += 1  # no idle close of the Checkpointer this save is given
        try:
            os.makedirs(root, exist_ok=True)
            made = make_placeholder(full)
            try:
                ckpt = self._checkpointer(hidden_root(root))  # the first save creates it
                handle = ckpt.save(
                    state,
                    step,
                    tag=name,
                    metadata=metadata or {},
                    overwrite=True,
                    optimizers=optimizers,
                )
            except BaseException:
                drop_placeholder(full, made)
                raise
            pending = _Pending(handle, full, made)
            with self._lock:
                self._pending[full] = pending
                self._last_handle = handle
        finally:
            with self._lock:
                self._starting -= 1
        self._finisher.submit(pending)
        if snapshot:
            handle.wait_snapshot()
        return handle

    def load(self, path, map_location=None, *, trusted: bool | None = None):
        """What ``torch.load(path)`` would return for the state saved to ``path``, after the
        directory is repaired (:meth:`repair`). Read, in this order (:meth:`source`): a file
        written at the path after the checkpoint ``dir/.datastates/name`` behind it committed
        (another engine's, with ``torch.load``); that checkpoint (every checksum checked); a
        checkpoint
        directory at ``path`` itself (the layout of earlier versions); a plain file at the
        path, or one an earlier version set aside. CheckpointNotFoundError if none is there."""
        root, name = split_path(path)
        full = os.path.join(root, name)
        self._wait_path(full)
        self.repair(root)
        trusted = self.trusted if trusted is None else trusted
        kind, where = self.source(full)
        if kind == "plain":
            return torch.load(where, map_location=map_location, weights_only=not trusted)
        if kind == "datastates":
            ckpt = self._checkpointer(os.path.dirname(where))
            return ckpt.load(
                tag=os.path.basename(where), map_location=map_location, trusted=trusted
            )
        raise _core().CheckpointNotFoundError(
            f"no checkpoint at {full}: expected a file there, the checkpoint directory "
            f"{checkpoint_dir(full)}, or a checkpoint directory at the path itself"
        )

    def exists(self, path) -> bool:
        """Whether :meth:`load` finds a checkpoint at ``path`` (a save of it in flight counts);
        the directory is repaired first (:meth:`repair`)."""
        root, name = split_path(path)
        full = os.path.join(root, name)
        with self._lock:
            if full in self._pending:
                return True
        self.repair(root)
        return self.source(full)[0] is not None

    @staticmethod
    def source(full: str) -> tuple[str | None, str]:
        """Where :meth:`load` reads ``full``: ("plain", file), ("datastates", checkpoint
        directory) or (None, ""). A symbolic link at ``full`` (Lightning's ``save_last="link"``)
        is read as its target is, never as a checkpoint saved at ``full`` before it."""
        if os.path.islink(full):
            target = os.path.realpath(full)
            return (None, "") if os.path.islink(target) else PathCheckpoints.source(target)
        behind = checkpoint_dir(full)
        if is_checkpoint_dir(behind):
            if file_at(full) and file_is_newer(full):
                return "plain", full
            return "datastates", behind
        if is_checkpoint_dir(full):
            return "datastates", full  # written at the path by an earlier version
        if file_at(full):
            return "plain", full
        if vacant(full) and os.path.isfile(aside_path(full)):
            return "plain", aside_path(full)  # an earlier version's save, interrupted
        return None, ""

    def repair(self, root) -> None:
        """Let the core repair what dead writers left in the directory ``root`` before it is
        looked at: opening the Checkpointer of ``root/.datastates`` (once per directory)
        removes their temporaries and puts back a checkpoint whose replacement a crash
        interrupted between the core's two renames (on file systems without an atomic
        exchange); the temporary links of dead processes in ``root`` go too
        (:func:`drop_stale_links`). Nothing is created: a missing ``root`` or
        ``root/.datastates`` is left alone."""
        root = os.path.abspath(os.fspath(root))
        if os.path.isdir(hidden_root(root)):
            self._checkpointer(hidden_root(root))
        if os.path.isdir(root):
            drop_stale_links(root)

    def committed(self, root) -> list:
        """The :class:`datastates.CheckpointInfo` of every checkpoint behind a path in the
        directory ``root`` (oldest first; each one's ``name`` is the path's file name); empty
        before the first save there."""
        hidden = hidden_root(os.path.abspath(os.fspath(root)))
        return self._checkpointer(hidden).list() if os.path.isdir(hidden) else []

    def remove(self, path) -> None:
        """Delete what is at ``path`` (waiting first for a save of it still in flight): the
        file (or link) at the path, the checkpoint ``dir/.datastates/name`` behind it (through
        the core's delete), a checkpoint directory an earlier version wrote at the path, and a
        plain file an earlier version set aside; then the checkpoints of the directory
        superseded by a symbolic link (:meth:`_drop_superseded`)."""
        root, name = split_path(path)
        full = os.path.join(root, name)
        self._wait_path(full)
        drop_aside(full)
        if os.path.islink(full) or os.path.isfile(full):
            os.remove(full)
        elif is_checkpoint_dir(full):
            self._checkpointer(root).delete(tag=name)
        elif os.path.isdir(full):
            shutil.rmtree(full, ignore_errors=True)
        if is_checkpoint_dir(checkpoint_dir(full)):
            self._checkpointer(hidden_root(root)).delete(tag=name)
        self._drop_superseded(root)

    def _drop_superseded(self, root: str) -> None:
        """Caller's thread: delete each checkpoint of ``root/.datastates`` whose path is now a
        symbolic link (``ModelCheckpoint(save_last="link")`` removes ``last.ckpt`` and links
        it to another checkpoint: the checkpoint of the earlier real save behind it is read by
        no one). A path with a save in flight is left alone."""
        hidden = hidden_root(root)
        try:
            names = os.listdir(hidden)
        except OSError:
            return
        for name in names:
            full = os.path.join(root, name)
            if name.startswith(".") or not os.path.islink(full):
                continue
            with self._lock:
                if full in self._pending:
                    continue
            if is_checkpoint_dir(os.path.join(hidden, name)):
                self._checkpointer(hidden).delete(tag=name)

    # ------------------------------------------------------------ synchronization
    def wait_snapshots(self) -> None:
        """Block until every in-flight save has captured its state (the step guard)."""
        with self._lock:
            pending = list(self._pending.values())
        for p in pending:
            p.handle.wait_snapshot()

    def wait(self) -> None:
        """Block until every save is committed (or failed); raise the first failure."""
        with self._lock:
            pending = list(self._pending.values())
        for p in pending:
            p.done.wait()
        self.raise_errors()

    def raise_errors(self) -> None:
        """Raise (once) the first background failure of a save that has finished by now."""
        with self._lock:
            for p in self._pending.values():
                if not p.reported and p.handle.done() and p.handle.exception() is not None:
                    p.reported = True
                    self._errors.append(p.handle.exception())
            if not self._errors:
                return
            first, rest = self._errors[0], self._errors[1:]
            self._errors.clear()
        for other in rest:
            log.error("another checkpoint also failed: %r", other)
        raise first

    @property
    def in_flight(self) -> int:
        with self._lock:
            return len(self._pending)

    @property
    def last_save_stats(self):
        """the :class:`datastates.SaveStats` of the most recent save (None before the first).
        ``blocked_s`` and ``nbytes`` are final once the save call returned; ``snapshot_s`` and
        ``commit_s`` are filled in when the capture and the commit happen (after ``wait()``)."""
        with self._lock:
            return None if self._last_handle is None else self._last_handle.stats

    def close(self) -> None:
        """Wait for every save, close every Checkpointer, raise the first failure. Reusable:
        a later save opens what it needs again."""
        try:
            self.wait()
        finally:
            self._close_checkpointers()
            self._finisher.stop()

    def _close_checkpointers(self) -> None:
        with self._lock:
            taken = self._take_checkpointers()
        self._close_taken(*taken)

    def _take_checkpointers(self) -> tuple[list, Any]:
        """With the lock held: every Checkpointer, out of reach of later saves."""
        ckpts = list(self._ckpts.values())
        self._ckpts.clear()
        base, self._base = self._base, None
        return ckpts, base

    @staticmethod
    def _close_taken(ckpts: list, base: Any) -> None:
        for ckpt in ckpts:  # the sharers first, then the owner of the pipeline
            if ckpt is not base:
                ckpt.close()
        if base is not None:
            base.close()

    def close_if_idle(self) -> None:
        """Caller's thread, after a load or removal: with ``idle_close``, close every
        Checkpointer (threads, lease) if no save is in flight and no run is :attr:`attended`."""
        with self._lock:
            if not self._idle():
                return
            taken = self._take_checkpointers()
        self._close_taken(*taken)

    def _idle(self) -> bool:
        """Finisher thread, with the lock held: whether to close every Checkpointer now. Only
        with ``idle_close``, when no save is in flight or starting and no run that will call
        :meth:`close` is :attr:`attended` (a save outside a run: nothing else would end the
        threads, release the lease or report a failure). The next save opens them again."""
        return self.idle_close and not self.attended and not self._pending and not self._starting

    # ------------------------------------------------------------ internals
    def _wait_path(self, full: str) -> None:
        with self._lock:
            pending = self._pending.get(full)
        if pending is not None:
            pending.done.wait()

    def _link(self, pending: _Pending) -> None:
        """Finisher thread, after the commit of ``pending``: its path becomes a hard link to
        the checkpoint's shard file (:func:`link_into_place`). A checkpoint directory an
        earlier version wrote at the path is deleted first (the new checkpoint is committed),
        with the ``latest`` hint beside it if it names it.
        Where the file system refuses hard links, the path is left without a file (its
        placeholder, or the file of an older save, is removed), or with an empty one
        (:attr:`mark_unlinked`), and one WARNING per directory says so."""
        full = pending.path
        root, name = os.path.split(full)
        if is_checkpoint_dir(full):
            self._checkpointer(root).delete(tag=name)
            drop_latest(full)  # the hint of that earlier version's checkpoint, if it names it
        elif os.path.isdir(full) and not os.path.islink(full) and vacant(full):
            os.rmdir(full)  # an earlier version's placeholder
        try:
            link_into_place(full)
        except OSError as exc:
            if exc.errno not in LINK_REFUSED_ERRNOS:
                raise
            if (os.path.isfile(full) or os.path.islink(full)) and not (
                self.mark_unlinked and vacant(full)
            ):
                os.remove(full)  # older than the checkpoint just committed
            if self.mark_unlinked:
                make_placeholder(full)
            with self._lock:
                first = root not in self._unlinked
                self._unlinked.add(root)
            if first:
                log.warning(
                    "the file system of %s refused a hard link (%s): the checkpoints saved "
                    "to paths there are the directories %s/<name>, with no file (or an empty "
                    "one) at the path itself; they load through datastates (the adapter's load, "
                    "datastates.load), not through the framework's own loader or torch.load "
                    '(docs/lightning.md, "Files on disk")',
                    root,
                    exc.strerror or exc,
                    FOLDER,
                )

    def _checkpointer(self, root: str):
        with self._lock:
            ckpt = self._ckpts.get(root)
            if ckpt is not None:
                self._ckpts.move_to_end(root)
                return ckpt
            if self._base is None or self._base._closed:
                # The first Checkpointer owns the host cache and threads; the Checkpointers of
                # every other directory share them, so a new directory allocates nothing.
                core = _core()  # each path: one writer process
                ckpt = core.Checkpointer(root, self.config, communicator=core.LocalCommunicator())
                self._base = ckpt
            else:
                ckpt = _core().Checkpointer(root, share=self._base)
            self._ckpts[root] = ckpt
            evict: list[tuple[str, Any]] = []
            for old_root in list(self._ckpts):
                if len(self._ckpts) - len(evict) <= self.max_open:
                    break
                if self._ckpts[old_root] is not self._base:
                    evict.append((old_root, self._ckpts[old_root]))
            for old_root, _ in evict:
                del self._ckpts[old_root]
        for old_root, old in evict:
            self._finisher.close_later(old_root, old)
        return ckpt

    def _finished(self, pending: _Pending, error: BaseException | None, info: Any) -> None:
        if error is None:
            try:
                self._link(pending)
            except BaseException as exc:  # committed, but the path could not be given its file
                error = exc
            drop_aside(pending.path)
        else:
            drop_placeholder(pending.path, pending.placeholder)
        if error is None and self.on_commit is not None:
            try:
                self.on_commit(pending.path, info)
            except BaseException as exc:  # a post-commit action failing is a failure too
                error = exc
        with self._lock:
            if error is not None and not pending.reported:
                pending.reported = True
                self._errors.append(error)
            if self._pending.get(pending.path) is pending:
                del self._pending[pending.path]
        pending.done.set()


class _Finisher:
    """One daemon thread that waits for handles in order, runs post-commit actions and closes
    evicted Checkpointers once their saves are over."""

    def __init__(self, owner: PathCheckpoints):
        import queue

        self._owner = owner
        self._q: "queue.Queue" = queue.Queue()
        self._thread: threading.Thread | None = None
        self._retiring: threading.Thread | None = None
        self._lock = threading.Lock()

    def _ensure(self) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(
                    target=self._run, name="datastates-finisher", daemon=True
                )
                self._thread.start()

    def submit(self, pending: _Pending) -> None:
        self._ensure()
        self._q.put(("wait", pending))

    def close_later(self, root: str, ckpt) -> None:
        self._ensure()
        self._q.put(("close", (root, ckpt)))

    def _retire(self) -> tuple[list, Any] | None:
        """This thread, after a save finished: if the owner is idle
        (:meth:`PathCheckpoints._idle`) and no work is queued, this thread stops being the
        finisher and takes the owner's Checkpointers to close them (returned); else None."""
        with self._owner._lock, self._lock:
            if self._q.empty() and self._owner._idle():
                self._retiring, self._thread = self._thread, None
                return self._owner._take_checkpointers()
        return None

    def stop(self) -> None:
        """End the thread (after the work queued) and a retired one still closing."""
        with self._lock:
            thread, self._thread = self._thread, None
            retiring, self._retiring = self._retiring, None
        if thread is not None:
            self._q.put(None)
            thread.join()
        if retiring is not None and retiring is not threading.current_thread():
            retiring.join()

    def _run(self) -> None:
        while (work := self._q.get()) is not None:
            kind, arg = work
            if kind == "wait":
                error, info = None, None
                try:
                    info = arg.handle.wait()
                except BaseException as exc:
                    error = exc
                self._owner._finished(arg, error, info)
                taken = self._retire()
                if taken is not None:
                    try:
                        self._owner._close_taken(*taken)
                    except BaseException as exc:
                        log.error("closing the idle checkpointers failed: %r", exc)
                    return
            else:
                root, ckpt = arg
                try:
                    ckpt.close()
                except BaseException as exc:
                    log.error("closing the checkpointer of %s failed: %r", root, exc)

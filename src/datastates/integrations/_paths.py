"""Path-addressed checkpoints: what the frameworks that think in files (DeepSpeed, Lightning) need.

A framework asks to save a state "to the file ``dir/name``". Here that becomes the datastates
checkpoint ``name`` in the directory ``dir``: a directory ``dir/name/`` that appears atomically
(temp dir + fsync + rename, done by the core), so a crash never leaves a partial checkpoint at
that path. A later save to the same path replaces it through the core's overwrite commit.

Threads and ownership:
- every public method runs on the caller's (training) thread;
- one :class:`datastates.Checkpointer` per directory, created on first use and owned here; the
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


def is_checkpoint_dir(path) -> bool:
    """True if ``path`` is a committed datastates checkpoint."""
    return os.path.isfile(os.path.join(os.fspath(path), "manifest.json"))


def base_optimizer(opt: Any) -> torch.optim.Optimizer | None:
    """The torch optimizer inside framework wrappers (accelerate's ``AcceleratedOptimizer``,
    DeepSpeed's ZeRO wrappers, ``LightningOptimizer``): the core's unwrapping rule."""
    return _core().torch_optimizer(opt)


#: The prefix of the name a plain file (another engine's checkpoint) is kept under while the
#: datastates checkpoint replacing it is saved: ``dir/.plain.<name>``.
ASIDE_PREFIX = ".plain."


def aside_path(full: str) -> str:
    """Where the plain file ``full`` is kept while its replacement is saved."""
    root, name = os.path.split(full)
    return os.path.join(root, ASIDE_PREFIX + name)


# Replacing another engine's plain file (a stock Lightning ``last.ckpt`` when a run switches to
# datastates). The core publishes a checkpoint directory only where nothing but a checkpoint
# is, and it cannot exchange a file with a directory, so the file cannot stay at its path while
# the new checkpoint is written in the background. Decision: the file is renamed (atomically)
# to ``.plain.<name>`` before the save, removed once the new checkpoint is committed, and put
# back if the save fails. A crash in between leaves no ``<name>`` but the old file aside, and
# load()/exists() of ``<name>`` read it: the path stays loadable through this layer at every
# moment (plain before the commit, datastates after).


def set_aside(full: str) -> None:
    """Move the plain file ``full`` aside (see above)."""
    os.replace(full, aside_path(full))


def put_back(full: str) -> None:
    """After a failed save: the file set aside goes back to ``full`` if that is still free."""
    aside = aside_path(full)
    if os.path.isfile(aside) and not os.path.lexists(full):
        try:
            os.rename(aside, full)
        except OSError as exc:
            log.warning("could not put %s back as %s: %r", aside, full, exc)


def drop_aside(full: str) -> None:
    """After the commit of ``full``: remove the file it replaced, if one was set aside."""
    try:
        os.remove(aside_path(full))
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning(
            "could not remove %s, replaced by the checkpoint %s: %r", aside_path(full), full, exc
        )


# The name of a save in flight exists (a framework decides on a new name, ModelCheckpoint's
# ``-v<n>``, by asking whether the path exists): ``save`` makes an empty directory at the path
# before the save starts, unless something is there already, and the core's commit renames the
# checkpoint over it in one atomic step (an empty directory at a checkpoint's name is free to
# take: docs/format.md, "Commit protocol"). A failed save removes the placeholder it made if it
# is still that empty directory. Readers here take an empty directory for no checkpoint
# (:func:`vacant`); a crash during the save leaves it, and the next save of the name takes it.


def make_placeholder(full: str) -> tuple[int, int] | None:
    """Make the empty directory ``full``; its (device, inode), or None if ``full`` exists."""
    try:
        os.mkdir(full)
        st = os.lstat(full)
    except FileExistsError:
        return None
    return st.st_dev, st.st_ino


def drop_placeholder(full: str, made: tuple[int, int] | None) -> None:
    """After a failed save: remove the placeholder ``made`` at ``full`` if it is still that
    empty directory (anything else there is left alone)."""
    if made is None:
        return
    try:
        st = os.lstat(full)
        if (st.st_dev, st.st_ino) == made:
            os.rmdir(full)  # refused if anything was put into it
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.warning(
            "could not remove %s, the placeholder of a failed save (expected an empty "
            "directory): %r",
            full,
            exc,
        )


def vacant(full: str) -> bool:
    """Whether no checkpoint and no file is at ``full``: missing, or an empty directory."""
    try:
        return os.path.isdir(full) and not os.path.islink(full) and not os.listdir(full)
    except FileNotFoundError:
        return True
    except NotADirectoryError:
        return False


def drop_latest(path: str, info: Any = None) -> None:
    """After the commit of ``path``: remove the core's ``latest`` hint beside it if it names
    that checkpoint. A framework lists that directory itself (Lightning's ``dirpath``, Hugging
    Face's ``output_dir``) and reads no such hint; loads here never read it either."""
    latest = os.path.join(os.path.dirname(path), "latest")
    try:
        with open(latest, "rb") as f:
            named = f.read(4096)
        if named == os.path.basename(path).encode():
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
    ):
        ds = _core()
        config = config if config is not None else ds.CheckpointConfig()
        refuse_memory_tier(config, "a framework's checkpoint paths")
        # The core's capture rule decides each tensor; the snapshot waits are ours (save()).
        self.config = config.replace(lazy="always", allow_unsafe_objects=True)
        self.max_open = max(1, int(max_open))
        self.trusted = trusted
        self.on_commit = on_commit
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
        here on (an empty directory until the commit, :func:`make_placeholder`).

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
        with self._lock:
            self._starting += 1  # no idle close of the Checkpointer this save is given
        try:
            if os.path.islink(full):
                os.remove(full)  # a framework's link (save_last="link"): the link goes
            elif os.path.isfile(full):
                set_aside(full)  # another engine's file: removed once the new one is committed
            os.makedirs(root, exist_ok=True)
            made = make_placeholder(full)
            try:
                ckpt = self._checkpointer(root)
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
                put_back(full)
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
        """What ``torch.load(path)`` would return for the state saved to ``path``; a plain file
        (written by the framework's default engine, also one set aside by a save that a crash
        interrupted) is read with ``torch.load``. The directory is repaired first
        (:meth:`repair`)."""
        root, name = split_path(path)
        full = os.path.join(root, name)
        self._wait_path(full)
        self.repair(root)
        trusted = self.trusted if trusted is None else trusted
        plain = full if os.path.isfile(full) else None
        if plain is None and vacant(full) and os.path.isfile(aside_path(full)):
            plain = aside_path(full)  # a crash came before the checkpoint replacing it committed
        if plain is not None:
            return torch.load(plain, map_location=map_location, weights_only=not trusted)
        ckpt = self._checkpointer(root)
        return ckpt.load(tag=name, map_location=map_location, trusted=trusted)

    def exists(self, path) -> bool:
        """Whether :meth:`load` finds a checkpoint at ``path`` (a save of it in flight counts);
        the directory is repaired first (:meth:`repair`)."""
        root, name = split_path(path)
        full = os.path.join(root, name)
        with self._lock:
            if full in self._pending:
                return True
        self.repair(root)
        return (
            os.path.isfile(full)
            or is_checkpoint_dir(full)
            or (vacant(full) and os.path.isfile(aside_path(full)))
        )

    def repair(self, root) -> None:
        """Let the core repair what dead writers left in the directory ``root`` before it is
        looked at: opening its Checkpointer (once per directory) removes their temporaries and
        puts back a checkpoint whose replacement a crash interrupted between the core's two
        renames (on file systems without an atomic exchange). A missing ``root`` is left alone."""
        root = os.path.abspath(os.fspath(root))
        if os.path.isdir(root):
            self._checkpointer(root)

    def remove(self, path) -> None:
        """Delete the checkpoint at ``path`` (waiting first for a save of it still in flight),
        and a plain file of that name set aside by a save a crash interrupted (which
        :meth:`load` would still read)."""
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
            drop_aside(pending.path)
        else:
            drop_placeholder(pending.path, pending.placeholder)
            put_back(pending.path)
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

"""``torch.distributed.checkpoint``: synchronous save, ``async_save`` with the writer's own staging,
and ``async_save`` with a persistent ``DefaultStager`` reused across saves.

All variants write through ``FileSystemWriter(thread_count=N)`` (fsync on, one checkpoint directory
per save) so they differ only in staging. ``async_save`` needs a process group with a CPU backend:
the benchmark initialises a one-rank gloo group (see :func:`ensure_process_group`). The synchronous
save uses ``no_dist=True``. Pinned memory does not exist in a CPU-only torch build, so the stager
runs with ``use_pinned_memory=False`` (and no shared memory: the writer is a thread).

Load (one adapter is enough: every variant writes the same format): ``dcp.load`` in place into the
live tensors of the conventional state dict.
"""

from __future__ import annotations

import warnings

from ..common import now
from ..states import TrainState, plain_state_dict
from .base import Checkpoint, Method, Pending


def ensure_process_group() -> bool:
    """Initialise a one-rank gloo group over an in-process store if none exists.

    Returns True if this call created it (the caller then destroys it at the end of the run).
    """
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this torch build")
    if dist.is_initialized():
        return False
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return True


def _apply_param_groups(state: TrainState, loaded: dict) -> None:
    for g, lg in zip(state.optimizer.param_groups, loaded["param_groups"]):
        g.update({k: v for k, v in lg.items() if k != "params"})


class _DcpBase(Method):
    scopes = ("full",)
    needs_process_group = False

    def __init__(self, options: dict | None = None):
        super().__init__(options)
        self.threads = int(self.options.get("dcp_threads", 2))

    def unavailable(self) -> str | None:
        try:
            import torch.distributed as dist
            import torch.distributed.checkpoint  # noqa: F401
        except Exception as e:  # noqa: BLE001
            return f"torch.distributed.checkpoint not importable: {e}"
        if not dist.is_available():
            return "torch.distributed is not available in this torch build"
        return None

    def _writer(self, path):
        from torch.distributed.checkpoint import FileSystemWriter

        return FileSystemWriter(str(path), thread_count=self.threads, sync_files=True)

    def _path(self, state: TrainState, step: int):
        return self.root / f"{state.scope}-step-{step:06d}"

    def load_into(self, state: TrainState, ckpt: Checkpoint) -> None:
        import torch.distributed.checkpoint as dcp

        sd = plain_state_dict(state)  # live tensors: dcp.load fills them in place
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(sd, checkpoint_id=str(ckpt.paths[0]), no_dist=True)
        _apply_param_groups(state, sd["optimizer"])
        state.extra.update(sd["extra"])


class DcpSave(_DcpBase):
    name = "dcp_save"
    label = "dcp.save (no_dist)"
    kind = "sync"
    transient_factor = 0.25

    def save(self, state: TrainState, step: int) -> Pending:
        import torch.distributed.checkpoint as dcp

        t0 = now()
        path = self._path(state, step)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            dcp.save(plain_state_dict(state), storage_writer=self._writer(path), no_dist=True)
        return Pending(t0, Checkpoint(step, [path]))


class DcpAsync(_DcpBase):
    """``dcp.async_save`` as most users call it: the FileSystemWriter stages (deep-copies) the state
    on the caller's thread into fresh CPU memory, then a thread writes it."""

    name = "dcp_async"
    label = "dcp.async_save (default staging)"
    kind = "async"
    needs_process_group = True
    supports_load = False  # same format as dcp_save, loaded once there
    transient_factor = 1.1

    def save(self, state: TrainState, step: int) -> Pending:
        import torch.distributed.checkpoint as dcp

        t0 = now()
        path = self._path(state, step)
        fut = dcp.async_save(plain_state_dict(state), storage_writer=self._writer(path))
        return Pending(t0, Checkpoint(step, [path]), commit_fn=fut.result)


class DcpAsyncStager(_DcpBase):
    """``dcp.async_save`` with one ``DefaultStager`` kept for the whole run: its CPU copies are
    cached by source storage and refilled with ``copy_`` on later saves (the "zero-overhead" path).

    ``background=False``: staging runs on the caller (blocked = one copy into reused buffers).
    ``background=True``: staging runs on the stager's thread; the training loop must wait for it
    before the optimizer step (``before_update``), exactly what DCP's docs ask of users.
    """

    name = "dcp_async_stager"
    label = "dcp.async_save + persistent DefaultStager"
    kind = "async"
    needs_process_group = True
    supports_load = False  # same format as dcp_save, loaded once there
    held_factor = 1.0
    transient_factor = 0.1
    background = False

    def __init__(self, options: dict | None = None):
        super().__init__(options)
        self.stager = None

    def setup(self, root, state) -> None:
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        super().setup(root, state)
        self.close()
        self.stager = DefaultStager(
            StagingOptions(
                use_pinned_memory=False,
                use_shared_memory=False,
                use_async_staging=self.background,
                use_non_blocking_copy=False,
            )
        )

    def save(self, state: TrainState, step: int) -> Pending:
        import torch.distributed.checkpoint as dcp

        t0 = now()
        path = self._path(state, step)
        res = dcp.async_save(
            plain_state_dict(state), storage_writer=self._writer(path), async_stager=self.stager
        )
        if hasattr(res, "staging_completion"):  # AsyncSaveResponse (background staging)
            return Pending(
                t0,
                Checkpoint(step, [path]),
                snapshot_fn=res.staging_completion.result,
                guard_fn=res.staging_completion.result,
                commit_fn=res.upload_completion.result,
            )
        return Pending(t0, Checkpoint(step, [path]), commit_fn=res.result)

    def close(self) -> None:
        if self.stager is not None:
            self.stager.close()
            self.stager = None


class DcpAsyncStagerBackground(DcpAsyncStager):
    name = "dcp_async_stager_bg"
    label = "dcp.async_save + persistent DefaultStager, background staging"
    background = True

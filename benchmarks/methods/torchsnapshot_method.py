"""torchsnapshot 0.1.0: ``Snapshot.take`` (synchronous) and ``Snapshot.async_take`` (returns once the
write requests are staged in host memory; a thread performs the I/O).

torchsnapshot saves ``Stateful`` objects, so the app state is the live model and optimizer, its own
``RNGState`` and a ``StateDict`` of the Python objects. Its file-system plugin does not fsync, so
the benchmark fsyncs every file of the snapshot after it completes (as it does after torch.save):
the commit time is "written, manifest published and durable", comparable with the other methods.
Load: ``Snapshot.restore`` into the same live objects.
"""

from __future__ import annotations

from ..common import fsync_tree, now
from ..states import TrainState
from .base import Checkpoint, Method, Pending


def _app_state(state: TrainState) -> dict:
    from torchsnapshot import RNGState, StateDict

    app = {"model": state.model}
    if state.optimizer is not None:
        app.update(optimizer=state.optimizer, rng=RNGState(), extra=StateDict(**state.extra))
    return app


class _SnapshotBase(Method):
    scopes = ("full",)

    def unavailable(self) -> str | None:
        try:
            import torchsnapshot  # noqa: F401
        except Exception as e:  # noqa: BLE001 - install or import failure
            return f"torchsnapshot not importable: {type(e).__name__}: {e}"
        return None

    def _path(self, state: TrainState, step: int):
        return self.root / f"{state.scope}-step-{step:06d}"

    def load_into(self, state: TrainState, ckpt: Checkpoint) -> None:
        from torchsnapshot import Snapshot

        Snapshot(str(ckpt.paths[0])).restore(_app_state(state))


class SnapshotTake(_SnapshotBase):
    name = "tsnap_take"
    label = "torchsnapshot take + fsync"
    kind = "sync"
    transient_factor = 0.7

    def save(self, state: TrainState, step: int) -> Pending:
        from torchsnapshot import Snapshot

        t0 = now()
        path = self._path(state, step)
        Snapshot.take(str(path), _app_state(state))
        fsync_tree(path)
        return Pending(t0, Checkpoint(step, [path]))


class SnapshotAsyncTake(_SnapshotBase):
    name = "tsnap_async"
    label = "torchsnapshot async_take + fsync"
    kind = "async"
    supports_load = False  # same format as tsnap_take, loaded once there
    transient_factor = 1.1

    def save(self, state: TrainState, step: int) -> Pending:
        from torchsnapshot import Snapshot

        t0 = now()
        path = self._path(state, step)
        pending = Snapshot.async_take(str(path), _app_state(state))

        def commit() -> None:
            pending.wait()
            fsync_tree(path)

        return Pending(t0, Checkpoint(step, [path]), commit_fn=commit)

"""datastates: lazy asynchronous checkpointing through one long-lived ``Checkpointer``.

The Checkpointer (and so its host cache and writer threads) is created once per state in
``setup`` and reused by every save, which is how the library is meant to be used. ``guard`` installs
the optimizer pre-hook, so a training loop needs no explicit wait before ``optimizer.step()``.

Timings: ``save()`` returns after planning (blocked); ``wait_snapshot()`` returns once the state is in
the host cache; ``wait()`` once it is durable and committed. The library's own ``SaveStats`` are kept
beside the benchmark's measurements.
"""

from __future__ import annotations

import dataclasses
import inspect

from ..common import GiB, list_entries, now, remove_paths
from ..states import TrainState, rng_snapshot
from .base import Checkpoint, Method, Pending


class Datastates(Method):
    name = "datastates"
    label = "datastates"
    kind = "lazy"
    scopes = ("full", "model")
    max_in_flight = None  # the library applies backpressure through its host cache
    transient_factor = 0.1

    def __init__(self, options: dict | None = None):
        super().__init__(options)
        self.host_cache = self.options.get("host_cache")  # bytes, or None for the default
        self.writer_threads = int(self.options.get("writer_threads", 2))
        self.ckpt = None
        self._entries: dict[int, list] = {}

    # ------------------------------------------------------------------ availability and memory
    def unavailable(self) -> str | None:
        try:
            import datastates
        except Exception as e:  # noqa: BLE001
            return f"datastates not importable: {type(e).__name__}: {e}"
        missing = [
            n
            for n in ("Checkpointer", "CheckpointConfig", "RNGState")
            if not hasattr(datastates, n)
        ]
        if missing:
            return f"datastates has no {', '.join(missing)} yet (core library not installed)"
        return None

    def cache_bytes(self, state_bytes: int) -> int:
        if self.host_cache:
            return int(self.host_cache)
        # the whole state plus one 64 MiB unit (its tensors are 64-byte aligned in the stream)
        return int(min(state_bytes + 64 * 2**20, 4 * GiB))

    def memory_factors(self, state_bytes: int) -> tuple[float, float]:
        return self.cache_bytes(state_bytes) / max(1, state_bytes), self.transient_factor

    # ------------------------------------------------------------------ lifecycle
    def setup(self, root, state: TrainState) -> None:
        import datastates

        super().setup(root, state)
        self.close()
        cfg = datastates.CheckpointConfig(
            host_cache_bytes=self.cache_bytes(state.nbytes), writer_threads=self.writer_threads
        )
        self.ckpt = datastates.Checkpointer(str(self.root), cfg)
        # Guard the training optimizer even for model-only saves: the model is captured lazily and
        # the next optimizer step waits for that capture, as in a real training loop.
        if state.live_optimizer is not None:
            self.ckpt.guard(state.live_optimizer)

    def close(self) -> None:
        if self.ckpt is not None:
            ckpt, self.ckpt = self.ckpt, None
            ckpt.close()

    @staticmethod
    def _tree(state: TrainState) -> dict:
        import datastates

        if state.optimizer is None:
            return {"model": state.model}
        return {
            "model": state.model,
            "optimizer": state.optimizer,
            "rng": datastates.RNGState(),
            "extra": state.extra,
        }

    # ------------------------------------------------------------------ operations
    def _save_kwargs(self, state: TrainState) -> dict:
        return {}

    def save(self, state: TrainState, step: int) -> Pending:
        before = list_entries(self.root)
        t0 = now()
        h = self.ckpt.save(self._tree(state), step=step, **self._save_kwargs(state))
        ckpt = Checkpoint(step)

        def commit() -> None:
            h.wait()
            # The checkpoint's files are the entries that appeared in the root with this save
            # (a moving "latest" pointer existed before and is left alone).
            ckpt.paths = [self.root / e for e in sorted(list_entries(self.root) - before)]

        def stats() -> dict | None:
            s = getattr(h, "stats", None)
            if s is None:
                return None
            return dataclasses.asdict(s) if dataclasses.is_dataclass(s) else dict(vars(s))

        return Pending(t0, ckpt, snapshot_fn=h.wait_snapshot, commit_fn=commit, stats_fn=stats)

    def load_into(self, state: TrainState, ckpt: Checkpoint) -> None:
        self.ckpt.restore(self._tree(state), step=ckpt.step)

    def discard(self, ckpt: Checkpoint) -> None:
        delete = getattr(self.ckpt, "delete", None)
        if callable(delete):
            try:
                delete(ckpt.step)
                return
            except Exception:  # noqa: BLE001 - fall back to removing the files it wrote
                pass
        remove_paths(ckpt.paths)


class DatastatesFallback(Datastates):
    """``datastates`` restored as the README's resume loop does, ``restore(fallback=True)``:
    the files of the restore are re-read and checked before the live state is touched, so
    this row's restore minus ``datastates``'s is the cost of the check. Saves are the same."""

    name = "datastates_fallback"
    label = "datastates, restore(fallback=True): files checked before the live state is touched"

    def load_into(self, state: TrainState, ckpt: Checkpoint) -> None:
        report = self.ckpt.restore(self._tree(state), fallback=True)
        if report.step != ckpt.step or report.skipped:
            raise RuntimeError(
                f"restore(fallback=True) restored step {report.step} "
                f"(expected {ckpt.step}); skipped {report.skipped}"
            )


class DatastatesStateDict(Datastates):
    """The plain state dict that DeepSpeed, Lightning, torchtitan and most loops pass:
    ``model.state_dict()`` + ``optimizer.state_dict()`` tensors + RNG as a tensor + Python objects,
    no optimizer object anywhere and none guarded, so every tensor is captured eagerly inside
    ``save()``. Restored in place into the same form (the live tensors), param groups applied."""

    name = "datastates_sd"
    label = "datastates, plain state dict (no optimizer object)"
    scopes = ("full",)

    def setup(self, root, state: TrainState) -> None:
        import datastates

        Method.setup(self, root, state)
        self.close()
        cfg = datastates.CheckpointConfig(
            host_cache_bytes=self.cache_bytes(state.nbytes), writer_threads=self.writer_threads
        )
        self.ckpt = datastates.Checkpointer(str(self.root), cfg)

    @staticmethod
    def _tree(state: TrainState) -> dict:
        return {
            "model": state.model.state_dict(),
            "optimizer": state.optimizer.state_dict(),
            "rng": rng_snapshot(),
            "extra": state.extra,
        }

    def load_into(self, state: TrainState, ckpt: Checkpoint) -> None:
        tree = self._tree(state)
        self.ckpt.restore(tree, step=ckpt.step)
        for group, loaded in zip(state.optimizer.param_groups, tree["optimizer"]["param_groups"]):
            group.update({k: v for k, v in loaded.items() if k != "params"})


class DatastatesGuardedStateDict(DatastatesStateDict):
    """The same state dict, with the optimizer passed to the save (``save(..., optimizers=[opt])``
    where the library has it, else ``guard(opt)``): tensors on the bytes of its parameters and
    state may be captured lazily, and its next ``step()`` waits for that capture."""

    name = "datastates_sd_guarded"
    label = "datastates, state dict + its optimizer passed to save()"

    def setup(self, root, state: TrainState) -> None:
        super().setup(root, state)
        if not self._takes_optimizers():
            self.ckpt.guard(state.optimizer)

    def _takes_optimizers(self) -> bool:
        return "optimizers" in inspect.signature(self.ckpt.save).parameters

    def _save_kwargs(self, state: TrainState) -> dict:
        return {"optimizers": [state.optimizer]} if self._takes_optimizers() else {}

"""safetensors for model-only saves: ``safetensors.torch.save_model`` (handles tied weights) + fsync.

safetensors stores tensors only, so it is measured on the model-only view of the state, beside
datastates and torch.save saving the same model.
"""

from __future__ import annotations

from ..common import fsync_path, now
from ..states import TrainState
from .base import Checkpoint, Method, Pending


class Safetensors(Method):
    name = "safetensors"
    label = "safetensors save_model + fsync"
    kind = "sync"
    scopes = ("model",)
    transient_factor = 1.0  # save_file builds the whole file in memory first

    def unavailable(self) -> str | None:
        try:
            import safetensors.torch  # noqa: F401
        except Exception as e:  # noqa: BLE001 - any import failure means "not available"
            return f"safetensors not importable: {type(e).__name__}: {e}"
        return None

    def save(self, state: TrainState, step: int) -> Pending:
        from safetensors.torch import save_model

        t0 = now()
        path = self.root / f"model-step-{step:06d}.safetensors"
        save_model(state.model, str(path))
        fsync_path(path)
        fsync_path(self.root)
        return Pending(t0, Checkpoint(step, [path]))

    def load_into(self, state: TrainState, ckpt: Checkpoint) -> None:
        from safetensors.torch import load_model

        missing, unexpected = load_model(state.model, str(ckpt.paths[0]), strict=True)
        if unexpected:
            raise RuntimeError(f"safetensors load: unexpected keys {unexpected[:5]}")

"""The memory tier beside a framework's own checkpoints (Hugging Face, Lightning).

The framework keeps naming its checkpoints (``checkpoint-N``, ModelCheckpoint's files), which
stay the storage tier, written as before. An adapter adds a step save into the memory tier every
``memory_every`` optimizer steps (``Checkpointer.save(step=..., persist=False)``), and a resume
takes the newest of the two: the higher global step, memory on a tie (docs/memory-tier.md).

What is shared here: which memory tiers an adapter can honour, and the bookkeeping of the memory
saves in flight (a failed one is raised by the next memory save, or by :meth:`MemorySaves.wait`,
never lost). Everything runs on the training thread.
"""

from __future__ import annotations

from typing import Any


def _core():
    import datastates  # the public API only, imported late

    return datastates


def framework_memory_tier(config, who: str):
    """The memory tier of ``config`` if an adapter can honour it beside the framework's own
    checkpoints, else ConfigError; None without one.

    The framework's named checkpoints are the storage tier, at the framework's cadence, and the
    tier must send nothing to storage itself, so that no folder the framework does not know
    appears among its checkpoints: ``persist_every=None`` (storage is the framework's
    ``save_steps`` / ModelCheckpoint) and ``persist_on_exit=False`` (no keeper writes a
    ``step-N`` folder into the framework's directory)."""
    tier = config.memory_tier
    if tier is None:
        return None
    wrong = []
    if tier.persist_every is not None:
        wrong.append(
            f"persist_every={tier.persist_every!r} (storage is the framework's own "
            "checkpoints, at its own cadence)"
        )
    if tier.persist_on_exit:
        wrong.append(
            "persist_on_exit=True (the keeper would write a step folder the "
            "framework does not know into its checkpoint directory)"
        )
    if wrong:
        raise _core().ConfigError(
            f"{who}: the memory tier here keeps checkpoints in memory only, beside the "
            f"framework's own checkpoints in storage; found {'; '.join(wrong)}. Use "
            "MemoryTier(persist_every=None, persist_on_exit=False, ...)"
        )
    return tier


def check_every(value: Any, name: str) -> int:
    """``value`` as a step interval (an int >= 1), else ConfigError."""
    if type(value) is not int or value < 1:
        raise _core().ConfigError(f"{name}: expected an int >= 1, found {value!r}")
    return value


def memory_wins(memory_step: int | None, storage_step: int | None) -> bool:
    """Whether a resume reads the memory checkpoint of ``memory_step`` rather than the
    framework's newest checkpoint, of ``storage_step`` (None: there is none): the higher global
    step, memory on a tie."""
    if memory_step is None:
        return False
    return storage_step is None or memory_step >= storage_step


class MemorySaves:
    """The memory saves started and not yet known to have succeeded (their handles)."""

    def __init__(self) -> None:
        self._handles: list = []

    def add(self, handle) -> None:
        self._handles.append(handle)

    def raise_failed(self) -> None:
        """Forget the saves that finished; raise the first failure among them (once)."""
        pending, failed = [], []
        for handle in self._handles:
            if not handle.done():
                pending.append(handle)
            elif handle.exception() is not None:
                failed.append(handle.exception())
        self._handles = pending
        if failed:
            raise failed[0]

    def wait(self) -> None:
        """Until every memory save is committed; raise the first failure."""
        handles, self._handles = self._handles, []
        failed = []
        for handle in handles:
            try:
                handle.wait()
            except BaseException as exc:  # every handle is waited for; the first is raised
                failed.append(exc)
        if failed:
            raise failed[0]

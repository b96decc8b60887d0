"""The verdict of the resume check: an uninterrupted and an interrupted run, compared step by step.

:func:`compare` is a pure function of what the processes recorded (``resumecheck`` runs them):
each step's fingerprint (``fingerprint``) against the uninterrupted run's at the same step, and the
sequence of steps (a restart begins at the step after the newest committed checkpoint). The first
difference becomes a :class:`Difference` with a hint at its usual cause, inside the
:class:`ResumeReport` that ``check_resume`` returns.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

from .fingerprint import KINDS

__all__ = ["Difference", "Kill", "ProcessRun", "Record", "ResumeReport", "compare"]


@dataclass(frozen=True)
class Record:
    """One ``step_done`` call: the step and its fingerprint (key -> (kind, digest, shown))."""

    step: int
    keys: dict


@dataclass(frozen=True)
class ProcessRun:
    """One process of a run: its records in order, its exit status (``returncode`` None: it ran
    past the timeout), the step it was to kill itself at, the step of the newest checkpoint
    committed when it ended (None: none) and the last lines of its output."""

    records: tuple
    returncode: int | None
    kill_at: int | None = None
    checkpoint: int | None = None
    log: str = ""

    @property
    def killed(self) -> bool:
        """It killed itself at its kill step (not an OOM kill or a crash)."""
        return (
            self.returncode == -signal.SIGKILL
            and self.kill_at is not None
            and bool(self.records)
            and self.records[-1].step == self.kill_at
        )


@dataclass(frozen=True)
class Difference:
    """The first thing that differs: at ``step`` (None: before any step), under ``key`` (a state
    path such as ``model/fc.weight``, ``rng:torch``, ``inputs``; ``step`` for a wrong sequence
    of steps; ``process`` for a run that failed), ``what`` differs, what that usually means
    (``hint``), and every key differing at that step (``keys``, first one first)."""

    step: int | None
    key: str
    what: str
    hint: str = ""
    keys: tuple = ()


@dataclass(frozen=True)
class Kill:
    """One kill of the interrupted run: at step ``at``, the newest committed checkpoint was that
    of step ``checkpoint`` (None: none, so the restart tested nothing), and the restarted
    process began at step ``resumed_at`` (None: it ran no step)."""

    at: int
    checkpoint: int | None
    resumed_at: int | None


@dataclass(frozen=True)
class ResumeReport:
    """The verdict of :func:`check_resume`. ``ok``: every step of the interrupted run is
    bit-identical to the uninterrupted run, in the right sequence, and at least one kill resumed
    from a checkpoint. ``first``: the first difference (None when there is none). ``compared``:
    how many steps of the interrupted run were compared. ``str(report)`` is a readable summary."""

    ok: bool
    steps: int
    kills: tuple
    first: Difference | None
    compared: int

    @property
    def tested(self) -> bool:
        """Some kill resumed from a committed checkpoint (else resuming was never exercised)."""
        return any(k.checkpoint is not None for k in self.kills)

    def __str__(self) -> str:
        kills = "; ".join(_kill_text(k) for k in self.kills) or "none"
        if self.first is not None:
            f = self.first
            where = "before any step" if f.step is None else f"at step {f.step}"
            lines = [f"resume check FAILED: {where}, key {f.key!r}", f"  what: {f.what}"]
            lines += [f"  hint: {f.hint}"] if f.hint else []
            if len(f.keys) > 1:
                shown = ", ".join(f.keys[1:6]) + (
                    f" (and {len(f.keys) - 6} more)" if len(f.keys) > 6 else ""
                )
                lines.append(f"  also differing at step {f.step}: {shown}")
        elif not self.tested:
            lines = [
                "resume check: NOTHING TESTED: no checkpoint was committed before any kill, "
                "so every restart began at step 0; kill later, or save earlier"
            ]
        else:
            lines = [
                f"resume check OK: all {self.compared} steps of the interrupted run are "
                f"bit-identical to the uninterrupted run ({self.steps} steps)"
            ]
        return "\n".join(lines + [f"  kills: {kills}"])


def _kill_text(k: Kill) -> str:
    saved = "no checkpoint" if k.checkpoint is None else f"checkpoint of step {k.checkpoint}"
    began = "ran no step" if k.resumed_at is None else f"began at step {k.resumed_at}"
    return f"step {k.at} ({saved}; the restart {began})"


_HINTS = {
    "rng": "a random generator differs: it is not restored (put datastates.RNGState() in the "
    "checkpointed state, and every torch.Generator you draw from), or the resumed run "
    "draws from it differently (iter(DataLoader) without generator= draws the workers' "
    "seed from the torch generator)",
    "state": "an object's state_dict() differs: it is not restored (is it in the checkpointed "
    "state?)",
    "value": "a Python value differs: it is not restored (is it in the checkpointed state? "
    "restore() fills the state's own dicts and lists; a variable outside it is not)",
    "input": "the data of this step differs while every generator and loader state handed to "
    "step_done is equal: randomness inside data loader workers (a Dataset drawing random "
    "numbers in a worker process, seeded from the loader's base seed, not from any "
    "checkpoint), or a loader whose position is not handed to step_done",
    "tensor": "a tensor differs while every generator, loader state and value handed to "
    "step_done is equal: something the step depends on is not in the checkpoint (hand "
    "the loader, sampler, scheduler and generators to step_done to find which; the batch "
    "as inputs=, to see randomness in loader workers)",
}
_NOT_DETERMINISTIC = (
    "the interrupted run differs from the uninterrupted one before its first "
    "kill: the loop is not deterministic (seed torch, random and numpy at its "
    "start; torch.use_deterministic_algorithms(True); no time- or "
    "process-dependent values in the state)"
)


def compare(reference: ProcessRun, runs: list, steps: int) -> ResumeReport:
    """The verdict on an interrupted run (its processes in order) against the uninterrupted
    ``reference``. Pure: no I/O. Each step is compared with the reference's step of the same
    number; a restart must begin at the step after the newest committed checkpoint (step 0 when
    none was), every other step follow the one before, and the last process end after step
    ``steps - 1``."""
    kills = tuple(
        Kill(r.kill_at, r.checkpoint, _first_step(runs, i + 1))
        for i, r in enumerate(runs)
        if r.killed
    )
    first = _check_reference(reference, steps)
    compared = 0
    if first is None:
        ref = {r.step: r.keys for r in reference.records}
        first, compared = _check_interrupted(ref, runs, steps)
    return ResumeReport(
        ok=first is None and any(k.checkpoint is not None for k in kills),
        steps=steps,
        kills=kills,
        first=first,
        compared=compared,
    )


def _first_step(runs: list, i: int) -> int | None:
    return runs[i].records[0].step if i < len(runs) and runs[i].records else None


def _check_reference(reference: ProcessRun, steps: int) -> Difference | None:
    if reference.returncode != 0:
        return _failed(reference, "the uninterrupted run", 0)
    seen = [r.step for r in reference.records]
    if seen != list(range(steps)):
        return Difference(
            None,
            "step",
            f"the uninterrupted run called step_done for steps "
            f"{_ranges(seen)}, expected 0-{steps - 1}",
            "call run.step_done(step, state) once after every step, in order",
        )
    return None


def _check_interrupted(ref: dict, runs: list, steps: int) -> tuple:
    expected, compared = 0, 0
    for i, run in enumerate(runs):
        name = (
            "the interrupted run"
            if i == 0
            else f"restart {i} (after the kill at step {runs[i - 1].kill_at})"
        )
        for j, record in enumerate(run.records):
            if record.step != expected:
                return _sequence(runs, i, j, expected), compared
            found = _differences(ref[record.step], record.keys, record.step, name, i == 0)
            if found is not None:
                return found, compared
            compared, expected = compared + 1, expected + 1
        if run.killed:
            expected = 0 if run.checkpoint is None else run.checkpoint + 1
        elif run.returncode != 0:
            return _failed(run, name, expected), compared
        elif expected != steps:
            return Difference(
                expected,
                "step",
                f"{name} ended before step {expected}: it ran "
                f"steps {_ranges([r.step for r in run.records]) or 'none'}",
                "the loop must run to step run.steps - 1",
            ), compared
    return None, compared


def _sequence(runs: list, i: int, j: int, expected: int) -> Difference:
    step = runs[i].records[j].step
    if j == 0 and i > 0:
        before = runs[i - 1]
        saved = (
            "no checkpoint"
            if before.checkpoint is None
            else f"the checkpoint of step {before.checkpoint}"
        )
        where = f"restart {i} resumed from {saved} and began at step {step}, expected {expected}"
        if step < expected:
            return Difference(
                step,
                "step",
                f"{where}: step {step} ran again",
                "a checkpoint saved after step s holds the state after step s: "
                "resume at s + 1 (start = ckpt.restore(state).step + 1)",
            )
        return Difference(
            step,
            "step",
            f"{where}: steps {expected}-{step - 1} never ran",
            "resume at the step after the checkpoint's step",
        )
    previous = runs[i].records[j - 1].step if j else None
    return Difference(
        step,
        "step",
        f"step_done for step {step} after step {previous}, expected step {expected}",
        "call run.step_done(step, state) once after every step",
    )


def _differences(ref: dict, got: dict, step: int, name: str, before_kill: bool):
    order = {k: n for n, k in enumerate(ref)}
    rank = {kind: n for n, kind in enumerate(KINDS)}
    keys = [k for k in ref if k not in got or got[k][1] != ref[k][1]]
    keys += [k for k in got if k not in ref]

    def kind(k):
        return (ref.get(k) or got[k])[0]

    keys.sort(key=lambda k: (rank.get(kind(k), len(KINDS)), order.get(k, len(order))))
    if not keys:
        return None
    key = keys[0]
    hint = _NOT_DETERMINISTIC if before_kill else _HINTS.get(kind(key), "")
    return Difference(step, key, _what(name, ref.get(key), got.get(key)), hint, tuple(keys))


def _what(name: str, ref, got) -> str:
    if got is None:
        return f"{name} has no such key; the uninterrupted run has {ref[2]}"
    if ref is None:
        return f"only {name} has this key ({got[2]})"
    if ref[0] == "rng":
        return f"{name} has another generator state than the uninterrupted run"
    if ref[2] == got[2]:
        return f"{name} has other bytes ({ref[2]} in both runs)"
    return f"{name} has {got[2]}, the uninterrupted run {ref[2]}"


def _failed(run: ProcessRun, name: str, step: int) -> Difference:
    why = (
        "did not finish within the timeout"
        if run.returncode is None
        else f"exited with code {run.returncode}"
    )
    return Difference(
        step,
        "process",
        f"{name} {why}; its last output:\n{run.log}",
        "the loop raised, or a restart could not restore its checkpoint",
    )


def _ranges(steps: list) -> str:
    return ", ".join(str(s) for s in steps[:12]) + (", ..." if len(steps) > 12 else "")

"""The experiments: saves and loads of one state, and the end-to-end training loop.

Every experiment runs in *rounds*: each round runs every method once, in an order rotated from round
to round, so that drift of the machine (page cache, a neighbour's load, free page reporting) hits all
methods alike, and ratios can be computed pair by pair inside a round (see :mod:`benchmarks.analysis`).

Raw samples are returned; the analysis (medians, ratios, fractions of limits) is done elsewhere.
A method that fails is recorded with its error and skipped for the rest of the phase; the others go on.
"""

from __future__ import annotations

import dataclasses
import shutil
import traceback
from pathlib import Path
from typing import Callable

import torch

from .common import disk_usage, drop_from_page_cache, list_entries, log, now, read_through, rotated
from .memory import RssSampler, settle
from .methods import Method, Pending
from .states import TrainState, build_gpt_state, e2e_config, fingerprint, perturb
from benchmarks.gpt import synthetic_batch


def _error_text(e: BaseException) -> str:
    tb = traceback.extract_tb(e.__traceback__)
    where = f" at {Path(tb[-1].filename).name}:{tb[-1].lineno}" if tb else ""
    return f"{type(e).__name__}: {e}{where}"


class _Steps:
    """Monotonic step numbers per method (checkpointers may refuse to reuse a step)."""

    def __init__(self):
        self._next: dict[str, int] = {}

    def __call__(self, name: str) -> int:
        self._next[name] = self._next.get(name, 0) + 1
        return self._next[name]


STEPS = _Steps()


# ------------------------------------------------------------------------------------- saving
def _save_once(m: Method, state: TrainState) -> tuple[dict, Pending]:
    """One save, waited for snapshot then commit, with the RSS peak above the pre-save level."""
    settle()
    before = list_entries(m.root)
    with RssSampler() as rss:
        p = m.save(state, STEPS(m.name))
        p.wait_snapshot()
        p.wait()
    if not p.checkpoint.paths:
        p.checkpoint.paths = [m.root / e for e in sorted(list_entries(m.root) - before)]
    usage = disk_usage(p.checkpoint.paths)
    sample = {
        "blocked_s": p.blocked_s,
        "snapshot_s": p.snapshot_s,
        "commit_s": p.commit_s,
        "transient_rss": rss.extra,
        "files": usage.files,
        "disk_bytes": usage.nbytes,
    }
    lib = p.library_stats()
    if lib:
        sample["library_stats"] = {
            k: v for k, v in lib.items() if isinstance(v, (int, float, str, bool)) or v is None
        }
    return sample, p


def _setup_with_warmup(m: Method, root: Path, state: TrainState) -> dict:
    """setup() + one untimed save: measures the memory the method keeps between saves."""
    settle()
    rss = RssSampler()
    rss0 = rss.rss()
    t0 = now()
    m.setup(root, state)
    setup_s = now() - t0
    sample, p = _save_once(m, state)
    m.discard(p.checkpoint)
    settle()
    return {"setup_s": setup_s, "held_rss": max(0, rss.rss() - rss0), "first_save": sample}


def run_state_phase(
    state: TrainState,
    methods: list[Method],
    root: Path,
    reps: int,
    do_load: bool,
    write_probe: Callable[[], float | None] | None = None,
) -> dict:
    """Interleaved save rounds of ``state`` for every method, then (optionally) load rounds.

    ``write_probe`` (GB/s of a plain sequential write to the same disk) runs at the start of every
    round, so each save can be compared with the disk's speed at that moment, not only with the
    limits measured at the start of the run. Files live under ``root/<method>``; all of them are
    removed before returning.
    """
    label = f"{state.name}/{state.scope}"
    out: dict = {
        "state": state.info(),
        "methods": [m.name for m in methods],
        "setup": {},
        "rounds": [],
        "round_write_gbps": [],
        "load_rounds": [],
        "errors": {},
    }
    live: list[Method] = []
    kept: dict[str, Pending] = {}
    try:
        for m in methods:
            log(f"[{label}] setup + warm-up save: {m.name}")
            try:
                out["setup"][m.name] = _setup_with_warmup(m, root / m.name, state)
                live.append(m)
            except Exception as e:  # noqa: BLE001 - recorded, the other methods go on
                out["errors"][m.name] = f"setup/warm-up: {_error_text(e)}"
                log(f"[{label}] {m.name} failed: {out['errors'][m.name]}")
                _close_quietly(m)
        for r in range(reps):
            rnd: dict = {}
            if write_probe is not None:
                out["round_write_gbps"].append(write_probe())
            for m in rotated([m for m in live if m.name not in out["errors"]], r):
                log(f"[{label}] save round {r + 1}/{reps}: {m.name}")
                try:
                    sample, p = _save_once(m, state)
                except Exception as e:  # noqa: BLE001
                    out["errors"][m.name] = f"save: {_error_text(e)}"
                    log(f"[{label}] {m.name} failed: {out['errors'][m.name]}")
                    continue
                rnd[m.name] = sample
                if m.name in kept:
                    m.discard(kept[m.name].checkpoint)
                kept[m.name] = p
            out["rounds"].append(rnd)
        if do_load:
            loadable = [
                m
                for m in live
                if m.supports_load and m.name in kept and m.name not in out["errors"]
            ]
            out["load_rounds"] = _load_rounds(state, loadable, kept, reps, out["errors"], label)
    finally:
        for m in live:
            if m.name in kept:
                try:
                    m.discard(kept[m.name].checkpoint)
                except Exception:  # noqa: BLE001 - the directory is removed below anyway
                    pass
            _close_quietly(m)
        shutil.rmtree(root, ignore_errors=True)
    return out


def _close_quietly(m: Method) -> None:
    try:
        m.close()
    except Exception as e:  # noqa: BLE001
        log(f"closing {m.name} failed: {_error_text(e)}")


# ------------------------------------------------------------------------------------- loading
def _load_once(m: Method, state: TrainState, p: Pending, cold: bool, expected: list[float]) -> dict:
    paths = p.checkpoint.paths
    if cold:
        drop_from_page_cache(paths)
    else:
        read_through(paths)
    perturb(state)
    settle()
    with RssSampler() as rss:
        t0 = now()
        m.load_into(state, p.checkpoint)
        dt = now() - t0
    return {"s": dt, "verified": fingerprint(state) == expected, "rss_extra": rss.extra}


def _load_rounds(
    state: TrainState,
    methods: list[Method],
    kept: dict[str, Pending],
    reps: int,
    errors: dict,
    label: str,
) -> list[dict]:
    expected = fingerprint(state)  # the state has not changed since the saves
    rounds = []
    for r in range(reps):
        rnd: dict = {}
        for m in rotated([m for m in methods if m.name not in errors], r):
            log(f"[{label}] load round {r + 1}/{reps}: {m.name} (cold, warm)")
            try:
                cold = _load_once(m, state, kept[m.name], True, expected)
                warm = _load_once(m, state, kept[m.name], False, expected)
            except Exception as e:  # noqa: BLE001
                errors[m.name] = f"load: {_error_text(e)}"
                log(f"[{label}] {m.name} load failed: {errors[m.name]}")
                continue
            rnd[m.name] = {
                "cold_s": cold["s"],
                "warm_s": warm["s"],
                "verified": cold["verified"] and warm["verified"],
                "cold_rss_extra": cold["rss_extra"],
                "warm_rss_extra": warm["rss_extra"],
            }
        rounds.append(rnd)
    return rounds


# ------------------------------------------------------------------------------------- end to end
def _train_loop(state: TrainState, batches: list, m: Method | None, k: int) -> dict:
    """Train ``len(batches)`` steps, checkpointing after every ``k``-th optimizer step.

    The optimizer step after each save is part of the loop, so lazy methods pay for it where they
    really would; every save is drained (durable) before the clock stops.
    """
    model, opt = state.model, state.optimizer
    pendings: list[Pending] = []
    save_calls, update_after, update_other = [], [], []
    last_loss = None
    settle()
    t_start = now()
    for i, (x, y) in enumerate(batches):
        loss = model(x, y)
        loss.backward()
        fresh = m is not None and i > 0 and i % k == 0  # first update after a save
        if pendings:
            pendings[-1].before_update()
        t = now()
        opt.step()
        (update_after if fresh else update_other).append(now() - t)
        opt.zero_grad(set_to_none=True)
        state.extra["step"] = state.extra.get("step", 0) + 1
        if m is not None and (i + 1) % k == 0:
            t = now()  # waiting for an earlier save is part of the stall
            if m.max_in_flight is not None:
                inflight = [p for p in pendings if not p.committed]
                while len(inflight) >= m.max_in_flight:
                    inflight.pop(0).wait()
            pendings.append(m.save(state, STEPS(m.name)))
            save_calls.append(now() - t)
        last_loss = loss.item()
    for p in pendings:
        p.wait()
    total = now() - t_start
    for p in pendings:
        m.discard(p.checkpoint)
    return {
        "total_s": total,
        "n_ckpt": len(pendings),
        "save_call_s": save_calls,
        "update_after_ckpt_s": update_after,
        "update_other_s": update_other,
        "final_loss": last_loss,
    }


def run_e2e(
    methods: list[Method],
    root: Path,
    preset: str,
    steps: int,
    ks: list[int],
    rounds: int,
    n_layer: int | None = None,
) -> dict:
    """The same training loop with no checkpoint and with each method every k steps, on the
    end-to-end model of ``preset`` (with ``n_layer`` layers, if given)."""
    cfg, batch_size = e2e_config(preset)
    if n_layer is not None:
        cfg = dataclasses.replace(cfg, n_layer=max(1, n_layer))
    state = build_gpt_state(cfg, real_step=True)
    gen = torch.Generator().manual_seed(42)
    batches = []
    for _ in range(steps):
        x, y = synthetic_batch(cfg, batch_size, gen)
        batches.append((x, y.contiguous()))
    out: dict = {
        "methods": [m.name for m in methods],
        "config": {
            "model": state.description,
            "state_bytes": state.nbytes,
            "batch_size": batch_size,
            "block_size": cfg.block_size,
            "steps": steps,
            "ks": ks,
            "rounds": rounds,
        },
        "rounds": [],
        "errors": {},
    }
    live: list[Method] = []
    try:
        for m in methods:
            log(f"[e2e] setup + warm-up save: {m.name}")
            try:
                _setup_with_warmup(m, root / m.name, state)
                live.append(m)
            except Exception as e:  # noqa: BLE001
                out["errors"][m.name] = f"setup/warm-up: {_error_text(e)}"
                _close_quietly(m)
        _train_loop(state, batches[:2], None, 1)  # warm up the kernels
        for r in range(rounds):
            rnd: dict = {}
            for m in rotated(live, r):
                # A loop without checkpoints right before each method's loops: the slowdown is
                # computed against this adjacent baseline, so slow drift cancels out.
                for key, meth, k in [(f"baseline:{m.name}", None, steps + 1)] + [
                    (f"{m.name}@{k}", m, k) for k in ks
                ]:
                    if m.name in out["errors"]:
                        break
                    log(f"[e2e] round {r + 1}/{rounds}: {key}")
                    try:
                        rnd[key] = _train_loop(state, batches, meth, k)
                    except Exception as e:  # noqa: BLE001
                        out["errors"][m.name] = f"training loop: {_error_text(e)}"
                        log(f"[e2e] {m.name} failed: {out['errors'][m.name]}")
            out["rounds"].append(rnd)
    finally:
        for m in live:
            _close_quietly(m)
        shutil.rmtree(root, ignore_errors=True)
    return out

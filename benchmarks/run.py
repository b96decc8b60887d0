#!/usr/bin/env python
"""Benchmark datastates and its peers on the same training state, disk and run.

    python benchmarks/run.py                      # gpt2-medium preset (~3.65 GB state), ~20-30 min
    python benchmarks/run.py --quick              # tiny state, 2 rounds: a couple of minutes
    python benchmarks/run.py --preset smoke       # every phase and method once, ~a minute
    python benchmarks/run.py --preset small --methods datastates,torch_save,dcp_async_stager_bg

Writes ``report.md``, ``results.json`` and PNG charts to ``--out`` (default
``results/bench-<timestamp>``). Every file written under ``--dir`` is removed at the end, also on
Ctrl-C. See docs/benchmarks.md for what is measured and how to read it.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import shlex
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

import psutil  # noqa: E402
import torch  # noqa: E402

from benchmarks import analysis, charts, checksums, limits, phases, report, states  # noqa: E402
from benchmarks.common import GiB, MiB, fmt_bytes, log  # noqa: E402
from benchmarks.memory import InsufficientMemory, MemoryPlan, available_bytes  # noqa: E402
from benchmarks.methods import (
    DEFAULT_METHODS,
    REFERENCE,
    REGISTRY,  # noqa: E402
    ensure_process_group,
    make_methods,
)


@dataclass(frozen=True)
class Preset:
    reps: int
    limit_bytes: int
    e2e_steps: int
    e2e_rounds: int
    fragments: int
    #: The GPT shapes (``states.gpt_config`` / ``e2e_config``) of another preset, by its name
    #: (default: this preset's own), with ``n_layer`` layers (default: that shape's).
    shape: str | None = None
    n_layer: int | None = None
    e2e_ks: str = "1,5,10"
    #: Measure the disk limits once more at the end of the run.
    limits_at_end: bool = True
    #: Right before the first state is built, move every object then alive (the modules that
    #: torch, the peers and matplotlib imported: ~300k objects) out of the garbage collector's
    #: reach (``gc.freeze``): the full collection before every measurement (``memory.settle``,
    #: ~190 per run) then walks only what the run made, milliseconds instead of ~0.2 s each on
    #: 2 cores. Off for the presets that measure, which keep the collector as their published
    #: numbers had it.
    freeze_imports: bool = False


PRESETS = {
    # A check that every phase and every method runs and reports, not a measurement: one round,
    # the quick shapes with a one-layer GPT, few fragments, a 2-step end-to-end loop.
    "smoke": Preset(
        reps=1,
        limit_bytes=32 * MiB,
        e2e_steps=2,
        e2e_rounds=1,
        fragments=100,
        shape="quick",
        n_layer=1,
        e2e_ks="1,2",
        limits_at_end=False,
        freeze_imports=True,
    ),
    "quick": Preset(
        reps=2,
        limit_bytes=128 * MiB,
        e2e_steps=10,
        e2e_rounds=2,
        fragments=1000,
        limits_at_end=False,
    ),
    "small": Preset(reps=3, limit_bytes=512 * MiB, e2e_steps=20, e2e_rounds=2, fragments=1500),
    "gpt2-medium": Preset(reps=3, limit_bytes=2 * GiB, e2e_steps=20, e2e_rounds=2, fragments=1500),
}


def parse_bytes(text: str) -> int:
    """'4GiB', '512MiB', '3.5GB', '1000000' -> bytes."""
    t = text.strip().lower().replace(" ", "")
    for suffix, scale in (
        ("gib", GiB),
        ("mib", MiB),
        ("kib", 1024),
        ("gb", 10**9),
        ("mb", 10**6),
        ("kb", 10**3),
        ("g", GiB),
        ("m", MiB),
        ("k", 1024),
        ("b", 1),
    ):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * scale)
    return int(float(t))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument(
        "--dir",
        type=Path,
        default=Path.cwd(),
        help="directory on the disk to measure; a temporary folder is made inside it "
        "and removed at the end (default: the current directory)",
    )
    p.add_argument(
        "--preset",
        choices=sorted(PRESETS),
        default="gpt2-medium",
        help="state size and repetitions (default gpt2-medium, ~3.65 GB)",
    )
    p.add_argument(
        "--quick",
        action="store_const",
        dest="preset",
        const="quick",
        help="same as --preset quick: tiny state, 2 rounds, short e2e loop",
    )
    p.add_argument("--reps", type=int, help="rounds per experiment (default from the preset)")
    p.add_argument(
        "--methods",
        default=",".join(DEFAULT_METHODS),
        help=f"comma-separated subset of: {', '.join(REGISTRY)}\n"
        f"(default: all but dcp_async_stager, which holds one more copy)",
    )
    p.add_argument("--out", type=Path, help="results directory (default results/bench-<time>)")
    p.add_argument("--skip-e2e", action="store_true", help="no end-to-end training loops")
    p.add_argument("--skip-load", action="store_true", help="no load measurements")
    p.add_argument("--skip-fragmented", action="store_true", help="no fragmented-state phase")
    p.add_argument("--skip-model-only", action="store_true", help="no model-only phase")
    p.add_argument("--n-layer", type=int, help="override the GPT depth of the preset")
    p.add_argument(
        "--host-cache",
        type=parse_bytes,
        help="datastates host cache size (default min(state size, 4 GiB))",
    )
    p.add_argument("--writer-threads", type=int, default=2, help="datastates writer threads")
    p.add_argument("--dcp-threads", type=int, default=2, help="FileSystemWriter thread_count")
    p.add_argument("--e2e-steps", type=int, help="training steps per end-to-end loop")
    p.add_argument("--e2e-ks", help="checkpoint intervals (steps; default 1,5,10, smoke 1,2)")
    p.add_argument("--e2e-rounds", type=int, help="rounds of end-to-end loops")
    p.add_argument("--limit-bytes", type=parse_bytes, help="file size for the disk limits")
    p.add_argument(
        "--strict-memory",
        action="store_true",
        help="refuse instead of scaling the state down when memory is short",
    )
    return p


# ----------------------------------------------------------------------------------- helpers
def _filesystem(path: Path) -> str:
    best = ("", "?")
    for part in psutil.disk_partitions(all=True):
        mp = part.mountpoint
        if str(path).startswith(mp) and len(mp) > len(best[0]):
            best = (mp, f"{part.fstype} on {part.device}, mounted at {mp}")
    return best[1]


def _datastates_version() -> str:
    try:
        import datastates

        return getattr(datastates, "__version__", "unknown")
    except Exception as e:  # noqa: BLE001
        return f"not importable ({type(e).__name__})"


def plan_state(cfg, methods, strict: bool, notes: list[str]):
    """Fit the GPT state into the available memory: scale its depth down, or refuse."""
    est = states.estimate_state_bytes(cfg)
    factors = [m.memory_factors(est) for m in methods if "full" in m.scopes] or [(0.0, 0.1)]
    plan = MemoryPlan(est, sum(h for h, _ in factors), max(t for _, t in factors))
    avail = available_bytes()
    log(f"memory: need ~{plan.describe()}; available {fmt_bytes(avail)}")
    if plan.need_bytes <= avail * 0.85:
        return cfg
    fit = plan.max_state_bytes(avail)
    scaled = None if strict else states.scale_layers(cfg, fit)
    if scaled is None:
        raise InsufficientMemory(
            f"not enough memory: the selected methods need ~{plan.describe()}, but only "
            f"{fmt_bytes(avail)} is available. Use a smaller --preset or --n-layer, fewer "
            f"--methods, or free memory" + ("" if strict else " (even one layer does not fit)")
        )
    note = (
        f"State scaled down from {cfg.n_layer} to {scaled.n_layer} layers "
        f"({fmt_bytes(est)} -> {fmt_bytes(states.estimate_state_bytes(scaled))}) to fit "
        f"{fmt_bytes(avail)} of available memory."
    )
    notes.append(note)
    log(note)
    return scaled


def _remove_tree(path: Path) -> None:
    """Remove the work directory; retried briefly because an interrupted background writer may
    still be creating files in it."""
    for _ in range(5):
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            return
        time.sleep(0.5)
    log(f"could not remove {path} completely")


# ----------------------------------------------------------------------------------- main
def run(args: argparse.Namespace) -> dict:
    preset = PRESETS[args.preset]
    reps = args.reps or preset.reps
    shape = preset.shape or args.preset
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    t_start = time.perf_counter()
    out = args.out or Path("results") / f"bench-{time.strftime('%Y%m%d-%H%M%S')}"
    args.dir.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="datastates-bench-", dir=args.dir))

    names = [n.strip() for n in args.methods.split(",") if n.strip()]
    options = {
        "host_cache": args.host_cache,
        "writer_threads": args.writer_threads,
        "dcp_threads": args.dcp_threads,
    }
    methods = make_methods(names, options)
    results: dict = {
        "schema": report.SCHEMA,
        "reference": REFERENCE,
        "interrupted": False,
        "notes": [],
        "skipped": [],
        "phases": {},
        "e2e": None,
        "charts": {},
        "meta": {
            "started": started,
            "command": " ".join(shlex.quote(a) for a in sys.argv),
            "preset": args.preset,
            "reps": reps,
            "dir": str(args.dir.resolve()),
            "filesystem": _filesystem(args.dir.resolve()),
            "cpus": os.cpu_count(),
            "mem_total": psutil.virtual_memory().total,
            "mem_available_start": available_bytes(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "datastates": _datastates_version(),
            "platform": platform.platform(),
            "torch_threads": torch.get_num_threads(),
        },
        "methods": {},
    }
    live = []
    for m in methods:
        reason = m.unavailable()
        results["methods"][m.name] = {**m.describe(), "available": reason is None, "reason": reason}
        if reason is None:
            live.append(m)
        else:
            results["skipped"].append(f"{m.name}: {reason}")
            log(f"skipping {m.name}: {reason}")
    if REFERENCE not in [m.name for m in live]:
        results["notes"].append(f"The reference method `{REFERENCE}` did not run: ratios are n/a.")
    own_pg = False
    limit_samples: dict = {}
    try:
        cfg = plan_state(
            states.gpt_config(shape, args.n_layer or preset.n_layer),
            live,
            args.strict_memory,
            results["notes"],
        )
        if any(getattr(m, "needs_process_group", False) for m in live):
            own_pg = ensure_process_group()
        limit_bytes = args.limit_bytes or min(
            preset.limit_bytes, max(64 * MiB, states.estimate_state_bytes(cfg))
        )
        results["limits"] = {"file_bytes": limit_bytes, "labels": limits.LIMIT_LABELS}
        limit_samples = limits.measure_limits(work / "limits", limit_bytes, rounds=max(2, reps))
        results["limits"]["samples"] = limit_samples
        results["limits"]["summary"] = limits.summarize_limits(limit_samples)
        log("CRC-32 backends")
        results["checksums"] = checksums.measure(min(limit_bytes, 256 * MiB) >> 20 << 20)

        full = [m for m in live if "full" in m.scopes]
        model_only = [m for m in live if "model" in m.scopes]
        if preset.freeze_imports:
            gc.collect()
            gc.freeze()
        log(f"building the GPT state ({fmt_bytes(states.estimate_state_bytes(cfg))})")
        state = states.build_gpt_state(cfg)
        _run_phase(results, "gpt/full", state, full, work / "gpt", reps, not args.skip_load)
        if args.skip_model_only or not model_only:
            results["skipped"].append("model-only phase")
        else:
            _run_phase(
                results,
                "gpt/model",
                state.model_only(),
                model_only,
                work / "gpt-model",
                reps,
                not args.skip_load,
            )
        del state
        gc.collect()
        if args.skip_fragmented:
            results["skipped"].append("fragmented phase")
        else:
            log("building the fragmented state")
            state = states.build_fragmented_state(cfg, preset.fragments)
            _run_phase(
                results,
                "fragmented/full",
                state,
                full,
                work / "fragmented",
                reps,
                not args.skip_load,
            )
            del state
            gc.collect()
        if args.skip_e2e:
            results["skipped"].append("end-to-end phase")
        else:
            ks = [int(k) for k in (args.e2e_ks or preset.e2e_ks).split(",") if k.strip()]
            raw = phases.run_e2e(
                full,
                work / "e2e",
                shape,
                args.e2e_steps or preset.e2e_steps,
                ks,
                args.e2e_rounds or preset.e2e_rounds,
                n_layer=preset.n_layer,
            )
            results["e2e"] = {"raw": raw, "summary": analysis.analyze_e2e(raw, REFERENCE)}
        if preset.limits_at_end:  # once more at the end: drift shows as spread
            more = limits.measure_limits(work / "limits", limit_bytes, rounds=1)
            for k, v in more.items():
                limit_samples.setdefault(k, []).extend(v)
            results["limits"]["summary"] = limits.summarize_limits(limit_samples)
    except KeyboardInterrupt:
        results["interrupted"] = True
        log("interrupted: writing partial results and cleaning up")
    finally:
        for m in methods:
            try:
                m.close()
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
        _remove_tree(work)
        if own_pg:
            import torch.distributed as dist

            dist.destroy_process_group()
    _reanalyze(results)
    results["meta"]["duration_s"] = time.perf_counter() - t_start
    out.mkdir(parents=True, exist_ok=True)
    try:
        results["charts"] = {"files": charts.draw_all(results, out), "skipped": None}
    except charts.ChartsUnavailable as e:
        results["charts"] = {"files": [], "skipped": str(e)}
        log(f"charts skipped: {e}")
    report.write_json(results, out / "results.json")
    report.write_markdown(results, out / "report.md")
    log(f"report: {out / 'report.md'}")
    return results


def _run_phase(results, key, state, methods, root, reps, do_load) -> None:
    if not methods:
        results["skipped"].append(f"{key}: no method selected for this scope")
        return
    probe_bytes = min(results["limits"]["file_bytes"], 1 << 30)

    def probe():
        return limits.probe_write(root / "probe", probe_bytes)

    raw = phases.run_state_phase(state, methods, root, reps, do_load, write_probe=probe)
    results["phases"][key] = {"raw": raw}
    _reanalyze(results)


def _reanalyze(results: dict) -> None:
    lim = results.get("limits", {}).get("summary", {})
    for phase in results["phases"].values():
        phase["save"] = analysis.analyze_save(phase["raw"], lim, REFERENCE)
        phase["load"] = analysis.analyze_load(phase["raw"], lim, REFERENCE)


def _terminate(_signum, _frame) -> None:
    raise KeyboardInterrupt("SIGTERM")


def main(argv: list[str] | None = None) -> int:
    signal.signal(signal.SIGTERM, _terminate)  # clean up and report on kill, as on Ctrl-C
    parser = build_parser()
    args = parser.parse_args(argv)
    unknown = [n for n in args.methods.split(",") if n.strip() and n.strip() not in REGISTRY]
    if unknown:
        parser.error(f"unknown method(s) {unknown}; choose from {', '.join(REGISTRY)}")
    try:
        run(args)
    except InsufficientMemory as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python
"""End to end with a checkpoint at EVERY step: the demo's model trained N steps with no checkpoint,
with the machine's limit for this workload (``limit``: the tensors copied into a reused buffer on
the training thread, then written with O_DIRECT by one thread -- no metadata, no checksums), with
datastates (module form and state-dict form, keep_last=3 and keep_last=None; ``ds_mem_p10``: the
memory tier, every step into shared memory and every 10th to the directory, copied there by the
keeper; ``ds_mem_p10_trainer``: the same, written to the directory by the trainer), with
``torch.save`` + fsync and with ``dcp.async_save``, each reported as a ratio to the no-checkpoint
loop of the same repetition (median over interleaved repetitions).

    python benchmarks/bench_e2e.py                       # 20 steps, 3 repetitions
    python benchmarks/bench_e2e.py --steps 40 --modes none,ds_module_k3 --reps 5
    python benchmarks/bench_e2e.py --before /path/to/older/src   # also the datastates modes
                                                                 # of another source tree
    python benchmarks/bench_e2e.py --profile ds_module_k3  # cProfile of the training thread
    python benchmarks/bench_e2e.py --modes ds_module_k3,ds_module_k3+gcfreeze  # gc.freeze()
                                                            # after the model is built, or not

Each timed loop runs in a fresh process: the state is built (fixed seeds) and one warm-up save is
made before the clock starts (it sizes the host cache, imports, creates the directory); the clock
stops once every save is durable and committed. Repetitions rotate the order of the loops, so slow
drift of a shared machine spreads over all of them; only ratios within a repetition are compared.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import cProfile
import gc
import json
import mmap
import os
import pstats
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

SRC = str(Path(__file__).resolve().parent.parent / "src")
if __package__ in (None, ""):  # run as a script: the repository's root, for ``benchmarks.*``
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
if __package__ in (None, "") and not os.environ.get("BENCH_E2E_SRC"):
    sys.path.insert(0, SRC)
elif os.environ.get("BENCH_E2E_SRC"):
    sys.path.insert(0, os.environ["BENCH_E2E_SRC"])

import datastates  # noqa: E402
from benchmarks.demo import SyntheticLoader  # noqa: E402
from benchmarks.gpt import GPT, GPTConfig  # noqa: E402

MODES = [
    "none",
    "limit",
    "ds_module_k3",
    "ds_module_all",
    "ds_sd_k3",
    "ds_sd_all",
    "ds_mem_p10",
    "ds_mem_p10_trainer",
    "torch_save",
    "dcp_async",
]


def demo_config() -> tuple[GPTConfig, int]:
    """The shape ``python -m benchmarks.demo --long`` trains (the README's demo numbers), and its
    batch size."""
    return GPTConfig(vocab_size=8192, block_size=64, n_layer=6, n_head=6, n_embd=384), 8


def build(cfg: GPTConfig, batch: int) -> dict:
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    return {"model": model, "opt": opt, "sched": sched, "loader": SyntheticLoader(cfg, batch)}


def train_step(s: dict) -> None:
    x, y = s["loader"].next()
    s["model"](x, y).backward()
    s["opt"].step()
    s["opt"].zero_grad(set_to_none=True)
    s["sched"].step()


def state_dicts(s: dict) -> dict:
    return {
        "model": s["model"].state_dict(),
        "opt": s["opt"].state_dict(),
        "sched": s["sched"].state_dict(),
        "loader": s["loader"].state_dict(),
    }


# ------------------------------------------------------------------------------------ the savers
class NoSaver:
    def save(self, s: dict, step: int) -> None:
        pass

    def finish(self) -> dict:
        return {}


class DatastatesSaver:
    """``form`` "module": the objects; "sd": their state dicts with ``optimizers=[opt]``.
    ``persist_every``: the memory tier (shared memory, a keeper process), every save into memory
    and every ``persist_every``-th to the directory instead."""

    def __init__(
        self,
        root: str,
        form: str,
        keep_last: int | None,
        persist_every: int | None = None,
        writer: str = "keeper",
    ):
        tier = (
            None
            if persist_every is None
            else datastates.MemoryTier(
                persist_every=persist_every,
                log_path=os.path.join(root, "..", "keeper.log"),
                storage_writer=writer,
            )
        )
        config = datastates.CheckpointConfig(
            host_cache_bytes=512 << 20, keep_last=keep_last, memory_tier=tier
        )
        self.ckpt = datastates.Checkpointer(root, config)
        self.form, self.handles = form, []

    def save(self, s: dict, step: int) -> None:
        if self.form == "module":
            state = {
                "model": s["model"],
                "opt": s["opt"],
                "sched": s["sched"],
                "loader": s["loader"],
                "rng": datastates.RNGState(),
            }
            self.handles.append(self.ckpt.save(state, step=step))
        else:
            self.handles.append(self.ckpt.save(state_dicts(s), step=step, optimizers=[s["opt"]]))

    def finish(self) -> dict:
        self.ckpt.wait()
        stats = [h.stats for h in self.handles[1:]]  # not the warm-up save
        self.handles = []
        if not stats:
            return {}
        return {
            "blocked_ms": statistics.median(x.blocked_s for x in stats) * 1e3,
            "step_wait_ms": statistics.median(x.step_wait_s for x in stats) * 1e3,
            "commit_s": statistics.median(x.commit_s for x in stats),
        }

    def close(self) -> None:
        self.ckpt.close(stop_keeper=True)


class TorchSaver:
    """``torch.save`` of the state dicts + fsync, on the training thread; keeps the last 3."""

    def __init__(self, root: str):
        self.root, self.paths = root, []
        os.makedirs(root, exist_ok=True)

    def save(self, s: dict, step: int) -> None:
        path = os.path.join(self.root, f"step-{step}.pt")
        with open(path, "wb") as f:
            torch.save(state_dicts(s), f)
            f.flush()
            os.fsync(f.fileno())
        self.paths.append(path)
        while len(self.paths) > 3:
            os.remove(self.paths.pop(0))

    def finish(self) -> dict:
        return {}

    def close(self) -> None:
        pass


class DcpAsyncSaver:
    """``dcp.async_save`` (default staging on the caller's thread, a thread writes); the previous
    save is awaited before the next one starts, as DCP asks; keeps the last 3."""

    def __init__(self, root: str):
        import torch.distributed as dist

        if not dist.is_initialized():
            dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        self.root, self.paths, self.future = root, [], None

    def save(self, s: dict, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        self._await()
        path = os.path.join(self.root, f"step-{step}")
        self.future = dcp.async_save(state_dicts(s), checkpoint_id=path)
        self.paths.append(path)
        while len(self.paths) > 4:  # the newest may still be in flight
            shutil.rmtree(self.paths.pop(0), ignore_errors=True)

    def _await(self) -> None:
        if self.future is not None:
            self.future.result()
            self.future = None

    def finish(self) -> dict:
        self._await()
        return {}

    def close(self) -> None:
        self._await()


class LimitSaver:
    """The machine's limit for this workload: the state dicts' tensors copied into one of two
    reused page-aligned buffers on the training thread (the only blocking part), then written
    with ``O_DIRECT`` + fsync + rename by one background thread; keeps the last 3. No metadata,
    no checksum, no Python objects: what any checkpoint of these tensors has to cost at least."""

    CHUNK = 8 << 20

    def __init__(self, root: str):
        self.root, self.paths = root, []
        self.pool = concurrent.futures.ThreadPoolExecutor(1)
        self.buffers: list = []
        self.futures: list = [None, None]
        self.turn = 0
        os.makedirs(root, exist_ok=True)

    def _tensors(self, s: dict) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []

        def walk(x) -> None:
            if isinstance(x, torch.Tensor):
                out.append(x)
            elif isinstance(x, dict):
                for v in x.values():
                    walk(v)
            elif isinstance(x, (list, tuple)):
                for v in x:
                    walk(v)

        walk(state_dicts(s))
        return out

    def save(self, s: dict, step: int) -> None:
        tensors = self._tensors(s)
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        size = -(-nbytes // self.CHUNK) * self.CHUNK
        if not self.buffers:
            self.buffers = [mmap.mmap(-1, size) for _ in range(2)]
        slot = self.turn % 2
        self.turn += 1
        if self.futures[slot] is not None:
            self.futures[slot].result()  # backpressure: that buffer is still being written
        flat = torch.frombuffer(self.buffers[slot], dtype=torch.uint8)
        off = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            flat[off : off + n].view(t.dtype).view(t.shape).copy_(t)
            off += n
        self.futures[slot] = self.pool.submit(self._write, self.buffers[slot], size, step)

    def _write(self, buf, size: int, step: int) -> None:
        path = os.path.join(self.root, f"step-{step}.bin")
        fd = os.open(path + ".tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644)
        try:
            view = memoryview(buf)
            for off in range(0, size, self.CHUNK):
                os.pwrite(fd, view[off : off + self.CHUNK], off)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(path + ".tmp", path)
        self.paths.append(path)
        while len(self.paths) > 3:
            os.remove(self.paths.pop(0))

    def finish(self) -> dict:
        for f in self.futures:
            if f is not None:
                f.result()
        return {}

    def close(self) -> None:
        self.finish()
        self.pool.shutdown()


#: Mode suffix: call ``gc.freeze()`` once the model and optimizer are built, so that full
#: garbage collections skip every object that existed before training (docs/benchmarks.md).
FREEZE = "+gcfreeze"


def make_saver(mode: str, root: str):
    mode = mode.removesuffix(FREEZE)
    if mode not in MODES:
        raise ValueError(f"unknown mode {mode!r}; expected one of {MODES}")
    if mode == "none":
        return NoSaver()
    if mode.startswith("ds_mem_p10"):
        return DatastatesSaver(
            root,
            "module",
            3,
            persist_every=10,
            writer="trainer" if mode.endswith("_trainer") else "keeper",
        )
    if mode.startswith("ds_"):
        _, form, keep = mode.split("_")
        return DatastatesSaver(root, form, 3 if keep == "k3" else None)
    if mode == "torch_save":
        return TorchSaver(root)
    if mode == "limit":
        return LimitSaver(root)
    return DcpAsyncSaver(root)


# ------------------------------------------------------------------------------------ one loop
def timed_loop(
    mode: str, steps: int, workdir: str, profile: cProfile.Profile | None = None
) -> dict:
    """Train ``steps`` steps saving after every one (none for "none"); seconds until all saves
    are committed."""
    cfg, batch = demo_config()
    s = build(cfg, batch)
    if mode.endswith(FREEZE):
        gc.collect()
        gc.freeze()
    root = tempfile.mkdtemp(prefix=f"{mode}-", dir=workdir)
    saver = make_saver(mode, root)
    try:
        train_step(s)
        saver.save(s, 0)  # warm-up save, outside the clock
        if hasattr(saver, "finish"):
            saver.finish()
        if profile is not None:
            profile.enable()
        cpu0, t0 = _cpu_s(), time.perf_counter()
        with GcPauses() as pauses:
            for step in range(1, steps + 1):
                train_step(s)
                saver.save(s, step)
            extra = saver.finish()
        total, cpu = time.perf_counter() - t0, _cpu_s() - cpu0
        if profile is not None:
            profile.disable()
    finally:
        if hasattr(saver, "close"):
            saver.close()
        shutil.rmtree(root, ignore_errors=True)
    return {
        "total_s": total,
        "cpu_s": cpu,
        "gc_ms": pauses.seconds * 1e3,
        "full_gcs": pauses.full,
        "young_gcs": pauses.young,
        "promoted_per_step": pauses.promoted / steps,
        **extra,
    }


class GcPauses:
    """Time spent in Python's garbage collector while active, any thread (a collection holds
    the GIL, so it pauses the training thread's Python too); ``full``: how many were full
    (generation 2) collections; ``young``: how many were not; ``promoted``: objects moved into
    the oldest generation (what makes full collections come: one runs once they add up to a
    quarter of what is there), counted at each generation-1 collection outside the timing."""

    def __init__(self):
        self.seconds, self.full, self.young, self.promoted = 0.0, 0, 0, 0
        self._start, self._gen1 = {}, 0

    def _callback(self, phase: str, info: dict) -> None:
        generation = info["generation"]
        if phase == "start":
            if generation == 1:
                self._gen1 = len(gc.get_objects(1))
            self._start[generation] = time.perf_counter()
        elif generation in self._start:
            self.seconds += time.perf_counter() - self._start.pop(generation)
            self.full += generation == 2
            self.young += generation < 2
            if generation == 1:
                self.promoted += max(0, self._gen1 - info["collected"])

    def __enter__(self) -> "GcPauses":
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self._callback)


def _cpu_s() -> float:
    """CPU seconds of this process, every thread (user + system)."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def loop_in_subprocess(mode: str, steps: int, workdir: str, src: str) -> dict:
    """One timed loop in a fresh process importing datastates from ``src``."""
    env = {**os.environ, "BENCH_E2E_SRC": src}
    out = subprocess.run(
        [
            sys.executable,
            os.path.abspath(__file__),
            "--one",
            mode,
            "--steps",
            str(steps),
            "--dir",
            workdir,
        ],
        env=env,
        check=True,
        stdout=subprocess.PIPE,
        text=True,
    ).stdout
    return json.loads(out.strip().splitlines()[-1])


def run(loops: list[tuple[str, str, str]], steps: int, reps: int, workdir: str) -> dict:
    """``loops``: (label, mode, source tree) of each checkpointing loop of a repetition. A loop
    without checkpoints runs before every two of them and at the end; each loop is compared with
    the mean of the two no-checkpoint loops around it (the load of a shared machine drifts within
    minutes)."""
    rounds = []
    for r in range(reps):
        order = loops[r % len(loops) :] + loops[: r % len(loops)]
        rnd, last_none, waiting = {}, None, []
        for i, (label, mode, src) in enumerate(order + [("none", "none", SRC)]):
            if i % 2 == 0 or i == len(order):
                none = loop_in_subprocess("none", steps, workdir, SRC)
                rnd.setdefault("none", []).append(none)
                _log(r, reps, "none", none)
                for entry in waiting:  # compared with the baselines before and after
                    _pair(entry, [b for b in (last_none, none) if b is not None])
                last_none, waiting = none, []
            if i == len(order):
                break
            rnd[label] = loop_in_subprocess(mode, steps, workdir, src)
            _log(r, reps, label, rnd[label])
            waiting.append(rnd[label])
        rounds.append(rnd)
    labels = [label for label, _, _ in loops]
    return {"steps": steps, "reps": reps, "rounds": rounds, "summary": summarize(rounds, labels)}


def _pair(entry: dict, baselines: list[dict]) -> None:
    for key in ("total_s", "cpu_s"):
        entry[f"base_{key}"] = statistics.mean(b[key] for b in baselines)


def _log(r: int, reps: int, label: str, result: dict) -> None:
    print(
        f"[rep {r + 1}/{reps}] {label:<22} {result['total_s']:7.2f} s wall "
        f"{result['cpu_s']:7.2f} s cpu",
        file=sys.stderr,
        flush=True,
    )


def summarize(rounds: list[dict], labels: list[str]) -> dict:
    nones = [n for rnd in rounds for n in rnd["none"]]
    out = {
        "none": {
            "ratio": 1.0,
            "ratios": [],
            "cpu_ratio": 1.0,
            "total_s": statistics.median(n["total_s"] for n in nones),
            "range_s": [min(n["total_s"] for n in nones), max(n["total_s"] for n in nones)],
            "gc_ms": statistics.median(n.get("gc_ms", 0.0) for n in nones),
            "full_gcs": statistics.median(n.get("full_gcs", 0) for n in nones),
        }
    }
    for mode in labels:
        ratios = [rnd[mode]["total_s"] / rnd[mode]["base_total_s"] for rnd in rounds]
        cpu = [rnd[mode]["cpu_s"] / rnd[mode]["base_cpu_s"] for rnd in rounds]
        row = {
            "ratio": statistics.median(ratios),
            "ratios": ratios,
            "cpu_ratio": statistics.median(cpu),
            "total_s": statistics.median(rnd[mode]["total_s"] for rnd in rounds),
        }
        for key in (
            "blocked_ms",
            "step_wait_ms",
            "commit_s",
            "gc_ms",
            "full_gcs",
            "young_gcs",
            "promoted_per_step",
        ):
            vals = [rnd[mode][key] for rnd in rounds if key in rnd[mode]]
            if vals:
                row[key] = statistics.median(vals)
        out[mode] = row
    return out


def print_table(result: dict) -> None:
    none = result["summary"]["none"]
    print(
        f"\ncheckpoint every step, {result['steps']} steps, median of {result['reps']} "
        "interleaved repetitions; ratio = wall time / mean of the no-checkpoint loops run just "
        "before and after; cpu ratio = the same for the process's CPU time (all threads). "
        f"No-checkpoint loop: median {none['total_s']:.2f} s, range {none['range_s'][0]:.2f}-"
        f"{none['range_s'][1]:.2f} s, gc {none['gc_ms']:.0f} ms ({none['full_gcs']:g} full). "
        "gc ms: time in Python's garbage collector during the loop (it holds the GIL), "
        "(full): how many full collections; young: the other collections; promoted: objects "
        "moved into the oldest generation per step"
    )
    print(
        f"| {'loop':<22} | time s | ratio | ratios per repetition | cpu ratio | save() ms "
        "| step wait ms | gc ms (full) | young gcs | promoted |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for label, row in result["summary"].items():
        if label == "none":
            continue
        ratios = " ".join(f"{x:.2f}" for x in row["ratios"])
        blocked = f"{row['blocked_ms']:.1f}" if "blocked_ms" in row else "-"
        wait = f"{row['step_wait_ms']:.1f}" if "step_wait_ms" in row else "-"
        gcs = f"{row['gc_ms']:.0f} ({row['full_gcs']:g})" if "gc_ms" in row else "-"
        young = f"{row['young_gcs']:g}" if "young_gcs" in row else "-"
        promoted = f"{row['promoted_per_step']:.0f}" if "promoted_per_step" in row else "-"
        print(
            f"| {label:<22} | {row['total_s']:.2f} | {row['ratio']:.2f}x | {ratios} | "
            f"{row['cpu_ratio']:.2f}x | {blocked} | {wait} | {gcs} | {young} | {promoted} |"
        )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument(
        "--modes",
        default=",".join(MODES),
        help=f"comma-separated, from {MODES} ('none' is always included); "
        f"a mode ending in {FREEZE!r} calls gc.freeze() after building the model",
    )
    parser.add_argument(
        "--dir",
        default=None,
        help="where checkpoints are written (default: a temporary directory under the current one)",
    )
    parser.add_argument("--json", default=None, help="write the raw results here")
    parser.add_argument(
        "--profile",
        default=None,
        metavar="MODE",
        help="profile one loop of MODE (training thread) instead",
    )
    parser.add_argument(
        "--before",
        default=None,
        metavar="SRC",
        help="also run the datastates modes with datastates imported from SRC "
        "(an older source tree), labelled '<mode>@before'",
    )
    parser.add_argument("--one", default=None, help=argparse.SUPPRESS)  # one loop, JSON out
    args = parser.parse_args(argv)
    if args.one:
        print(json.dumps(timed_loop(args.one, args.steps, args.dir)))
        return 0
    workdir = tempfile.mkdtemp(prefix="bench-e2e-", dir=args.dir or os.getcwd())
    try:
        if args.profile:
            prof = cProfile.Profile()
            total = timed_loop(args.profile, args.steps, workdir, prof)["total_s"]
            print(f"{args.profile}: {total:.2f} s")
            pstats.Stats(prof).sort_stats("cumulative").print_stats(40)
            return 0
        modes = [m for m in args.modes.split(",") if m and m != "none"]
        for m in modes:
            if m.removesuffix(FREEZE) not in MODES:
                parser.error(
                    f"unknown mode {m!r}; expected some of {MODES}, each optionally with {FREEZE!r}"
                )
        loops = [(m, m, SRC) for m in modes]  # each also runs beside no-checkpoint loops
        if args.before:
            loops += [
                (f"{m}@before", m, os.path.abspath(args.before))
                for m in modes
                if m.startswith("ds_")
            ]
        result = run(loops, args.steps, args.reps, workdir)
        print_table(result)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

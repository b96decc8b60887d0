"""The memory tier under ``kill -9``: random instants, and the time back to training.

    python benchmarks/memory_kill.py [--trials 200] [--gib 1.0] [--reps 3] [--json out.json]

**Trials.** A trainer process saves a 32 MiB state into memory at every step (a step's tensors
are a pattern of the step number, so any step's exact bytes are known) and prints ``SAVING s``
before each ``save()`` and ``SEALED s`` once it is committed. After a random delay (uniform in
0.2-2.5 s after it started saving, so the kill lands anywhere: in the capture, the shard writes,
the commit, the retention, between saves) it gets SIGKILL. A new Checkpointer then restores into
a live state: the step must be at least the last one seen sealed and at most the last one being
saved, its bytes exact, and it must come from memory. Every trial shares one keeper; the trainers
are forked from one process that imported torch once, so a trial costs no interpreter start.

**Back to training.** The same kill of a trainer of ``--gib`` GiB (an MLP and its Adam state,
memory every step and disk every 5th), then a restarted trainer in a new process, timed from
its ``Popen`` to its first completed training step: start (to the first line of the script),
import (torch and datastates), attach (the Checkpointer: keeper and ranks), agree and copy
(``restore``: choosing the tier and the checkpoint, reading into the live tensors), step. Run
against the same restart reading storage, cold (its files dropped from the page cache) and warm
(read once before the restart: the O_DIRECT writes of a save leave nothing in the page cache).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "..", "src")
sys.path.insert(0, os.path.join(HERE, ".."))
from benchmarks.common import drop_from_page_cache, read_through  # noqa: E402

FLOATS = 8 << 20  # 32 MiB


def pattern(step: int):
    import torch

    base = torch.arange(FLOATS, dtype=torch.float32)
    return {"w": base + step, "v": torch.full((1000,), float(step)), "step": step}


def _tier(shm: str, log: str, persist_every):
    import datastates

    return datastates.MemoryTier(
        root=shm,
        persist_every=persist_every,
        persist_on_exit=False,
        log_path=log,
        idle_timeout_s=600,
    )


# ---------------------------------------------------------------- the children
def child_trials(storage: str, shm: str, log: str) -> None:
    import threading
    import datastates

    ck = datastates.Checkpointer(
        storage, datastates.CheckpointConfig(memory_tier=_tier(shm, log, None))
    )
    newest = ck.latest()  # the resume loop: continue after the newest checkpoint
    first = newest.step + 1 if newest is not None else 1
    state = pattern(first - 1)
    for s in range(first, first + 1_000_000):
        state["w"].add_(1.0)
        state["v"].fill_(float(s))
        state["step"] = s
        os.write(1, f"SAVING {s}\n".encode())
        handle = ck.save(state, step=s)
        threading.Thread(
            target=lambda h=handle, s=s: (h.wait(), os.write(1, f"SEALED {s}\n".encode())),
            daemon=True,
        ).start()
        handle.wait_snapshot()  # the loop's next change of the tensors waits for the capture


def child_train(storage: str, shm: str, log: str, gib: float, memory: bool, steps: int) -> None:
    t_first_line = time.time()
    import torch  # noqa: F401
    import datastates

    sys.path.insert(0, HERE)
    from bench_memory import build, step

    t_import = time.time()
    model, opt = build(gib)
    t_built = time.time()
    config = datastates.CheckpointConfig(
        host_cache_bytes=3 << 30, keep_last=2, memory_tier=_tier(shm, log, 5) if memory else None
    )
    ck = datastates.Checkpointer(storage, config)
    t_attach = time.time()
    first = 0
    if ck.latest() is not None:
        report = ck.restore({"model": model, "opt": opt})
        first = report.step + 1
        tier = report.tier
    else:
        tier = None
    t_restore = time.time()
    step(model, opt)
    t_step = time.time()
    print(
        json.dumps(
            {
                "first_line": t_first_line,
                "import": t_import,
                "built": t_built,
                "attach": t_attach,
                "restore": t_restore,
                "step": t_step,
                "tier": tier,
                "resumed_at": first,
            }
        ),
        flush=True,
    )
    for s in range(first, first + steps):
        ck.save({"model": model, "opt": opt}, step=s)
        os.write(1, f"SAVING {s}\n".encode())
        step(model, opt)
    ck.wait()
    os.write(1, b"SAVED\n")
    time.sleep(3600)  # killed by the parent


# ---------------------------------------------------------------- trials
def _env() -> dict:
    return dict(os.environ, PYTHONPATH=os.pathsep.join([SRC, os.environ.get("PYTHONPATH", "")]))


def _spawn(*args) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--child", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        env=_env(),
    )


def forker(storage: str, shm: str, log: str) -> None:
    """Imports torch and datastates once, then forks one trainer per line read on stdin and
    reports ``PID p`` for it and ``EXIT p`` once it ended (a trial then costs no interpreter
    start). It starts no thread: its forks are safe."""
    import datastates  # noqa: F401
    import torch  # noqa: F401

    for _ in sys.stdin:
        pid = os.fork()
        if pid == 0:
            code = 0
            try:
                child_trials(storage, shm, log)
            except BaseException:
                import traceback

                traceback.print_exc()
                sys.stderr.flush()
                code = 1
            os._exit(code)
        os.write(1, f"PID {pid}\n".encode())
        os.waitpid(pid, 0)
        os.write(1, f"EXIT {pid}\n".encode())


def trials(count: int, work: str, shm: str, seed: int) -> dict:
    import datastates
    import torch

    rng = random.Random(seed)
    storage, log = os.path.join(work, "trials"), os.path.join(work, "keeper-trials.log")
    config = datastates.CheckpointConfig(memory_tier=_tier(shm, log, None))
    outcomes, failures = [], []
    errors = open(os.path.join(work, "trainers.err"), "wb")
    server = subprocess.Popen(
        [sys.executable, os.path.abspath(__file__), "--child", "forker", storage, shm, log],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=errors,
        env=_env(),
    )
    lines = _Lines(server.stdout)
    try:
        for trial in range(count):
            server.stdin.write(b"go\n")
            server.stdin.flush()
            pid = int(lines.next_with("PID").split()[1])
            saving, sealed, t0 = 0, 0, None
            delay = rng.uniform(0.2, 2.5)
            while True:  # follow the trainer's markers until its kill time
                line = lines.next(timeout=0.005)
                if line is not None:
                    kind, _, value = line.partition(" ")
                    if kind == "SAVING":
                        saving = int(value)
                        t0 = t0 or time.monotonic()
                    elif kind == "SEALED":
                        sealed = max(sealed, int(value))
                if t0 is not None and time.monotonic() - t0 >= delay:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:  # it ended by itself: a failure, with its stderr
                        errors.flush()
                        with open(errors.name, "rb") as f:
                            raise RuntimeError(
                                "a trainer ended before its kill:\n"
                                + f.read()[-4000:].decode(errors="replace")
                            )
                    break
            while True:  # the lines it wrote before it died, up to the forker's EXIT
                kind, _, value = lines.next_with("").partition(" ")
                if kind == "EXIT":
                    break
                if kind == "SEALED":
                    sealed = max(sealed, int(value))
                elif kind == "SAVING":
                    saving = max(saving, int(value))
            with datastates.Checkpointer(storage, config) as ck:
                live = {"w": torch.zeros(FLOATS), "v": torch.zeros(1000), "step": -1}
                report = ck.restore(live)
                want = pattern(report.step)
                exact = (
                    torch.equal(live["w"], want["w"])
                    and torch.equal(live["v"], want["v"])
                    and live["step"] == report.step
                )
            ok = exact and report.tier == "memory" and sealed <= report.step <= saving
            outcomes.append(
                {
                    "trial": trial,
                    "delay_s": delay,
                    "saving": saving,
                    "sealed": sealed,
                    "restored": report.step,
                    "tier": report.tier,
                    "exact": exact,
                    "ok": ok,
                }
            )
            if not ok:
                failures.append(outcomes[-1])
            print(
                f"trial {trial + 1}/{count}: killed saving {saving} (sealed {sealed}), "
                f"restored {report.step} from {report.tier}, exact {exact}",
                flush=True,
            )
    finally:
        server.stdin.close()
        server.wait()
        errors.close()
    newer = sum(1 for o in outcomes if o["restored"] > o["sealed"])
    return {
        "trials": count,
        "ok": count - len(failures),
        "failures": failures,
        "restored_the_last_seen_sealed": count - newer,
        "restored_one_sealed_after_its_last_marker": newer,
        "outcomes": outcomes,
    }


class _Lines:
    """Lines of a child's stdout, read without blocking past a timeout."""

    def __init__(self, stream):
        self.fd, self.buffer, self.ready = stream.fileno(), b"", []
        os.set_blocking(self.fd, False)

    def next(self, timeout: float) -> str | None:
        import select

        while not self.ready:
            if not select.select([self.fd], [], [], timeout)[0]:
                return None
            chunk = os.read(self.fd, 1 << 16)
            if not chunk:
                raise RuntimeError("the trial process ended")
            self.buffer += chunk
            *done, self.buffer = self.buffer.split(b"\n")
            self.ready += [d.decode() for d in done]
        return self.ready.pop(0)

    def next_with(self, prefix: str) -> str:
        while True:
            line = self.next(timeout=60.0)
            if line is None:
                raise RuntimeError(f"no line starting with {prefix!r} within 60 s")
            if line.startswith(prefix):
                return line


# ---------------------------------------------------------------- back to training
def back_to_training(work: str, shm: str, gib: float, reps: int) -> dict:
    rows = {"memory": [], "disk_cold": [], "disk_warm": []}
    for rep in range(reps):
        for kind in ("memory", "disk_cold", "disk_warm"):
            storage = os.path.join(work, f"train-{rep}-{kind}")
            log = os.path.join(work, f"keeper-{rep}-{kind}.log")
            memory = kind == "memory"
            first = _spawn("train", storage, shm, log, str(gib), str(int(memory)), "7")
            _read_until(first, b"SAVED")
            first.send_signal(signal.SIGKILL)
            first.wait()
            if kind == "disk_cold":
                drop_from_page_cache([Path(storage)])
            elif kind == "disk_warm":  # O_DIRECT writes left nothing in the page cache
                read_through([Path(storage)])
            t_spawn = time.time()
            again = _spawn("train", storage, shm, log, str(gib), str(int(memory)), "0")
            times = json.loads(_read_until(again, b"{"))
            again.send_signal(signal.SIGKILL)
            again.wait()
            rows[kind].append(
                {
                    "start_s": times["first_line"] - t_spawn,
                    "import_s": times["import"] - times["first_line"],
                    "build_s": times["built"] - times["import"],
                    "attach_s": times["attach"] - times["built"],
                    "agree_copy_s": times["restore"] - times["attach"],
                    "step_s": times["step"] - times["restore"],
                    "total_s": times["step"] - t_spawn,
                    "tier": times["tier"],
                    "resumed_at": times["resumed_at"],
                }
            )
            if memory:
                _stop_keepers(shm)
            shutil.rmtree(storage, ignore_errors=True)
            print(f"{kind}: {rows[kind][-1]}", flush=True)
    return rows


def _read_until(proc: subprocess.Popen, start: bytes) -> str:
    while True:
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the child ended before printing {start!r}")
        if line.startswith(start):
            return line.decode()


def _stop_keepers(shm: str) -> None:
    from datastates.errors import KeeperError
    from datastates.tools.keeper import ask

    for entry in os.listdir(shm):
        try:
            ask(os.path.join(shm, entry), "stop", timeout=120)
        except KeeperError:
            pass


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "--child":
        sys.path.insert(0, SRC)
        if argv[1] == "forker":
            forker(*argv[2:5])
        else:
            child_train(argv[2], argv[3], argv[4], float(argv[5]), argv[6] == "1", int(argv[7]))
        return 0
    sys.path.insert(0, SRC)
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dir", default=tempfile.gettempdir())
    parser.add_argument("--shm", default="/dev/shm")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    work = tempfile.mkdtemp(prefix="memory-kill-", dir=args.dir)
    shm = tempfile.mkdtemp(prefix="memory-kill-", dir=args.shm)
    try:
        result = {"args": vars(args)}
        if args.trials:
            result["trials"] = trials(args.trials, work, shm, args.seed)
            _stop_keepers(shm)
            t = result["trials"]
            print(
                f"\n{t['ok']}/{t['trials']} trials restored a sealed step from memory, "
                f"bit-exact ({t['restored_the_last_seen_sealed']} the last step seen sealed, "
                f"{t['restored_one_sealed_after_its_last_marker']} a step sealed after the "
                "last marker the trainer could print)"
            )
        if args.reps:
            rows = back_to_training(work, shm, args.gib, args.reps)
            result["back_to_training"] = rows
            print(
                "\nkill -9 -> first training step (median s): start, import, build, attach, "
                "agree+copy, step, total"
            )
            for kind, entries in rows.items():
                med = {
                    k: statistics.median(e[k] for e in entries)
                    for k in (
                        "start_s",
                        "import_s",
                        "build_s",
                        "attach_s",
                        "agree_copy_s",
                        "step_s",
                        "total_s",
                    )
                }
                print(f"  {kind:<10} " + "  ".join(f"{v:6.2f}" for v in med.values()))
                result.setdefault("median", {})[kind] = med
    finally:
        _stop_keepers(shm)
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if not result.get("trials") or not result["trials"]["failures"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

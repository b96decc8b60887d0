"""Worker of the elastic-restart tests (run by torchrun, never collected by pytest).

    python -m torch.distributed.run --standalone --nproc-per-node W --max-restarts 2 \\
        _elastic_child.py DIR STEPS [--kill ATTEMPT:RANK:STEP:MODE:N ...] [--uninterrupted DIR2]

A small data-parallel job on gloo: every rank holds the same tiny model and AdamW, trains on
batches that depend only on the step and the rank, and averages the gradients with all_reduce, so
the model stays identical on every rank while a per-rank value (``seen``, the sum of this rank's
losses) differs. It runs the README's resume loop and saves every step (model and optimizer
declared replicated, ``keep_last=2``). With ``--uninterrupted DIR2``, the attempt that ends the
job then runs it once more from step 0 in the empty DIR2, on the same process group and with no
kill point: the reference, computed and saved as by a run that was never interrupted (every
operation of the job is deterministic, and its objects are built anew: nothing of the first run
carries over).

``--kill ATTEMPT:RANK:STEP:MODE:N``: in the attempt ATTEMPT of the job (torchrun's
``TORCHELASTIC_RESTART_COUNT``, 0 for the first), rank RANK waits for its earlier saves to be
decided, then arms the kill point MODE/N right before its save of STEP, so that N counts the
events of that save (and of the later ones) only. MODE is one of ``_crash_child._install``'s, or
``reported``: SIGKILL in the n-th commit round of this rank once its report is in the store,
before it takes a verdict. A kill is armed in its own attempt only: the attempt after the last
one runs free.

Markers on stdout, one line each, written in one ``write(2)``: ``ELASTIC <kind> key=<json> ...``.
``start`` (every rank, first: its pid); ``run`` (rank 0: this attempt's run id); ``temporaries``
(rank 0, from the second attempt on: the temporaries and lease files in DIR before and after its
Checkpointer was built, and whether the store holds a key of the previous attempt's run);
``armed``; ``resume`` (every rank: the step it resumes at); ``store`` (rank 0, at the end of the
job: whether the probe finds this run's own key, which shows the probe works); ``final`` (every
rank: the sha256 of its final state). ``resume`` and ``final`` name their ``run``: ``job`` or
``uninterrupted``.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os

import torch
import torch.distributed as dist

import _crash_child
import _resume_child

#: A worker still running after this long prints every thread's stack and exits, so that a hang
#: shows where it is (the test's own bound on the whole run is longer).
HANG_S = 150
#: The temporaries a dead attempt may leave in DIR, and the lease files naming their owners.
TEMPORARY_PREFIXES = (".tmp.", ".old.", ".trash.", "latest.tmp", ".owner.")


def emit(kind: str, **fields) -> None:
    text = " ".join(f"{k}={json.dumps(v, separators=(',', ':'))}" for k, v in fields.items())
    _crash_child.marker(f"ELASTIC {kind} {text}")


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def train_one_step(state: dict, step: int, rank: int, world: int) -> None:
    """Deterministic: the batch depends only on the step and the rank; gloo sums the gradients
    in the same order in every run, then they are averaged."""
    g = torch.Generator().manual_seed(1000 * step + rank)
    x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
    model, opt = state["model"], state["optim"]
    loss = torch.nn.functional.mse_loss(model(x), y)
    opt.zero_grad()
    loss.backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
        p.grad /= world
    opt.step()
    # Per-rank, and a dict with a tuple key: an object blob, written by the commit thread.
    total = state["seen"].get((rank, "loss"), 0.0)
    state["seen"] = {(rank, "loss"): total + loss.item()}


def digest(state: dict) -> str:
    return _resume_child.digest(state, "seen")


def config():
    import datastates

    # A long commit timeout: under torchrun no rank waits that long for a dead one (the agent
    # stops the whole group), and the test's bound on the whole run is far shorter.
    return datastates.CheckpointConfig(
        host_cache_bytes=64 << 10,
        chunk_bytes=16 << 10,
        keep_last=2,
        writer_threads=2,
        commit_timeout_s=600.0,
    )


# ---------------------------------------------------------------- kill points


def die_after_report(n: int) -> None:
    """SIGKILL in the n-th commit round of this rank, once its report is in the store and before
    it takes a verdict (rank 0: before it gathers the reports; another rank: before it waits)."""
    from datastates.commit.round import StoreCommunicator

    count = [0]

    def armed(real):
        def call(self, *args, **kwargs):
            count[0] += 1  # one commit thread per process: no lock needed
            if count[0] == n:
                _crash_child._die()
            return real(self, *args, **kwargs)

        return call

    StoreCommunicator._coordinate = armed(StoreCommunicator._coordinate)
    StoreCommunicator._await = armed(StoreCommunicator._await)


def arm(mode: str, n: int) -> None:
    if mode == "reported":
        die_after_report(n)
    else:
        _crash_child._install(mode, n)


def kills_of(specs: list[str], attempt: int, rank: int) -> dict[int, tuple[str, int]]:
    """{step: (mode, n)} of the kill points armed in this attempt on this rank."""
    out = {}
    for spec in specs:
        a, r, step, mode, n = spec.split(":")
        if int(a) == attempt and int(r) == rank:
            out[int(step)] = (mode, int(n))
    return out


# ---------------------------------------------------------------- what an attempt finds


def temporaries(directory: str) -> list[str]:
    if not os.path.isdir(directory):
        return []
    return sorted(n for n in os.listdir(directory) if n.startswith(TEMPORARY_PREFIXES))


def run_id_file(directory: str, attempt: int) -> str:
    """Where rank 0 records the run id of an attempt: beside DIR, never in it."""
    return os.path.join(os.path.dirname(os.path.abspath(directory)), f"run-{attempt}")


def store_holds_run(run_id: str) -> bool:
    """Whether the store of this process group holds rank 0's announcement under ``run_id``
    (set at its first save, deleted when its Checkpointer closes)."""
    from torch.distributed import distributed_c10d as c10d

    # the store as the Checkpointer's communicator sees it (StoreCommunicator.from_process_group)
    store = dist.PrefixStore(f"datastates/{run_id}/", c10d._get_default_store())
    return store.check(["announce/r0"])


def record_attempt(ckpt, directory: str, attempt: int, before: list[str]) -> None:
    """Rank 0, its Checkpointer just built: the markers ``run`` and ``temporaries``."""
    with open(run_id_file(directory, attempt), "w") as f:
        f.write(ckpt.comm.run_id)
    emit("run", attempt=attempt, run_id=ckpt.comm.run_id)
    if attempt > 0:
        with open(run_id_file(directory, attempt - 1)) as f:
            previous = f.read()
        emit(
            "temporaries",
            attempt=attempt,
            before=before,
            after=temporaries(directory),
            old_keys=store_holds_run(previous),
        )


# ---------------------------------------------------------------- the job


def train(ckpt, steps: int, attempt: int, kills: dict[int, tuple[str, int]], run: str) -> dict:
    """The job (``run``: "job" or "uninterrupted", named in the markers)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model, optim = build()
    # --- the README's resume loop ---
    state = {"model": model, "optim": optim, "seen": {}}
    start = ckpt.restore(state, fallback=True).step + 1 if ckpt.latest() else 0
    emit("resume", run=run, attempt=attempt, rank=rank, start=start)
    for step in range(start, steps):
        train_one_step(state, step, rank, world)
        if step in kills:
            ckpt.wait()  # the kill point counts the events of this save on
            arm(*kills[step])
            emit("armed", attempt=attempt, rank=rank, step=step, mode=kills[step][0])
        ckpt.save(state, step=step, replicated=["model", "optim"])
    ckpt.wait()
    # ---
    return state


def run_job(args, attempt: int) -> dict:
    """The job in DIR, resumed from what the earlier attempts committed; returns its state."""
    import datastates

    rank = dist.get_rank()
    before = temporaries(args.directory) if rank == 0 else []
    with datastates.Checkpointer(args.directory, config()) as ckpt:
        if rank == 0:
            record_attempt(ckpt, args.directory, attempt, before)
        state = train(ckpt, args.steps, attempt, kills_of(args.kill, attempt, rank), "job")
        if rank == 0:
            emit("store", attempt=attempt, own_key=store_holds_run(ckpt.comm.run_id))
    return state


def run_uninterrupted(directory: str, steps: int, attempt: int) -> dict:
    """The same job from step 0 in an empty ``directory``, with no kill point: what a run that
    was never interrupted computes and saves, on this process group."""
    import datastates

    with datastates.Checkpointer(directory, config()) as ckpt:
        return train(ckpt, steps, attempt, {}, "uninterrupted")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("directory")
    parser.add_argument("steps", type=int)
    parser.add_argument("--kill", action="append", default=[])
    parser.add_argument(
        "--uninterrupted", help="where to run the job again, uninterrupted, once it has ended"
    )
    args = parser.parse_args()
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    torch.set_num_threads(1)
    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    emit("start", attempt=attempt, rank=int(os.environ["RANK"]), pid=os.getpid())
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    state = run_job(args, attempt)
    emit("final", run="job", attempt=attempt, rank=rank, sha=digest(state))
    if args.uninterrupted:
        state = run_uninterrupted(args.uninterrupted, args.steps, attempt)
        emit("final", run="uninterrupted", attempt=attempt, rank=rank, sha=digest(state))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

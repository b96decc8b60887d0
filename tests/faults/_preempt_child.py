"""Child process of the preemption tests (run as a script, never collected by pytest).

    python _preempt_child.py DIR [--steps N] [--every K] [--final] [--grace S] [--sync]
                             [--previous] [--hold STEP --hold-fd FD] [--twice]

A small deterministic training loop with a ``datastates.Preemption``: it saves every K steps,
asks ``requested(step)`` at the safe point of each step (after ``opt.step()``) and then, with
``--final``, saves that step unless it just did, and calls ``exit()``. The test paces it and
sends the signals; it reports on stdout, one flushed line each (a process ended by a signal
flushes nothing):

    step <s>              the middle of step s; the child then waits for one line on stdin
    saved <s> <sha256>    save() is called for step s; the sha256 of the state it saves
    held <s>              (--hold) the commit of step s waits for one byte on FD, on the
                          commit thread, so the save is in flight until the test sends it
    stop <s>              requested(s) was True
    previous <signum>     (--previous) the handler installed before the Preemption was called;
                          it raises SystemExit(3)
    passed <signum>       (--twice) the handler installed before the first Preemption was
                          called; it returns, so exit() returns and the loop goes on with a
                          second Preemption on the same Checkpointer (SIGTERM's default action
                          restored first), for N more steps
    closed                (--twice) the second Preemption's close() returned

``--sync`` waits for each save to commit before the next step. Several ranks: ``RANK``,
``WORLD_SIZE``, ``MASTER_ADDR`` and ``MASTER_PORT`` in the environment (gloo, whose TCPStore rank
0 hosts); every step all-reduces the gradients, so the ranks stay within one step.
"""

from __future__ import annotations

import argparse
import faulthandler
import hashlib
import os
import signal
import sys

import torch

#: A child that hangs prints its threads' stacks and ends, so the test reading it never hangs.
HANG_S = 100


def say(*words) -> None:
    """One line in one write (the commit thread reports too), flushed."""
    sys.stdout.write(" ".join(map(str, words)) + "\n")
    sys.stdout.flush()


def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=0.01)


def train_one_step(model, opt, step: int, world: int) -> None:
    """Deterministic: the batch depends on the step only; gradients averaged over the ranks."""
    g = torch.Generator().manual_seed(1000 + step)
    x, y = torch.randn(64, 16, generator=g), torch.randn(64, 4, generator=g)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    if world > 1:
        import torch.distributed as dist

        for p in model.parameters():
            dist.all_reduce(p.grad)
            p.grad /= world
    opt.step()


def digest(model, opt) -> str:
    """sha256 of every parameter and optimizer state tensor, in a fixed order."""
    h = hashlib.sha256()
    for key, t in model.state_dict().items():
        data = t.detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
        h.update(key.encode() + data)
    for index, st in sorted(opt.state_dict()["state"].items()):
        for key in sorted(st):
            data = st[key].detach().contiguous().view(-1).view(torch.uint8).numpy().tobytes()
            h.update(f"{index}/{key}".encode() + data)
    return h.hexdigest()


def held_communicator(step: int, fd: int, world: int):
    """The communicator of this rank, whose commit round of ``step`` first waits for a byte on
    ``fd`` (on the commit thread: the save stays in flight until then)."""
    import datastates

    base = datastates.StoreCommunicator if world > 1 else datastates.LocalCommunicator

    class Held(base):
        def agree(self, sid, *args, **kwargs):
            if sid.step == step:
                say("held", step)
                os.read(fd, 1)
            return super().agree(sid, *args, **kwargs)

    return Held.from_process_group() if world > 1 else Held()


def previous_handler(signum, frame) -> None:
    say("previous", signum)
    raise SystemExit(3)


def passed_handler(signum, frame) -> None:
    say("passed", signum)


def parse() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("directory")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--every", type=int, default=2)
    p.add_argument("--final", action="store_true")
    p.add_argument("--grace", type=float, default=60.0)
    p.add_argument("--sync", action="store_true")
    p.add_argument("--previous", action="store_true")
    p.add_argument("--hold", type=int, default=None)
    p.add_argument("--hold-fd", type=int, default=None)
    p.add_argument("--twice", action="store_true")
    return p.parse_args()


def main() -> None:
    import datastates

    args = parse()
    faulthandler.dump_traceback_later(HANG_S, exit=True)
    torch.set_num_threads(1)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1:
        import torch.distributed as dist

        dist.init_process_group("gloo")
    if args.previous:
        signal.signal(signal.SIGTERM, previous_handler)
    if args.twice:
        signal.signal(signal.SIGTERM, passed_handler)
    comm = held_communicator(args.hold, args.hold_fd, world) if args.hold is not None else None
    config = datastates.CheckpointConfig(host_cache_bytes=1 << 20, writer_threads=2)
    model, opt = build()
    state = {"model": model, "optim": opt}
    with datastates.Checkpointer(args.directory, config, communicator=comm) as ckpt:

        def save(step: int) -> None:
            say("saved", step, digest(model, opt))
            handle = ckpt.save(state, step=step)
            if args.sync:
                handle.wait()

        def train(stop, steps) -> int | None:
            """The loop; with --twice it ends at the first stop whose exit() returns."""
            for step in steps:
                say("step", step)
                sys.stdin.readline()
                train_one_step(model, opt, step, world)
                if step % args.every == 0:
                    save(step)
                if stop.requested(step):  # the safe point
                    say("stop", step)
                    if args.final and step % args.every != 0:
                        save(step)
                    stop.exit()
                    if args.twice:
                        return step
            return None

        stop = datastates.Preemption(ckpt, grace_s=args.grace)
        last = train(stop, range(args.steps))
        stop.close()
        if args.twice and last is not None:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            with datastates.Preemption(ckpt, grace_s=args.grace) as again:
                train(again, range(last + 1, last + 1 + args.steps))
            say("closed")


if __name__ == "__main__":
    main()

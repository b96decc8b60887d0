"""Elastic restarts: a rank SIGKILLed in the middle of a save under ``torchrun --max-restarts``,
the agent restarting the whole group, and the README's resume loop taking every rank back to the
same committed checkpoint, until the job ends bit-identical to a run never interrupted.

Each test runs ``_elastic_child.py`` (a small data-parallel job on gloo, a save every step,
``keep_last=2``) under ``python -m torch.distributed.run --standalone`` with one kill point per
attempt: on 2 ranks, three in one run (each after the first lands in a job that already
recovered), on 4 ranks one. The kill points: a non-zero rank in the write of its shard (rank 3
of 4), or once its report is in the store and before the verdict (rank 1 of 2); rank 0 while it
publishes (the manifest written, the directory not renamed), or after the commit and before
``latest`` (2 ranks). The attempt that ends the job then runs it again from step 0 in an empty
directory, uninterrupted, on the same process group: the reference. What is checked after each
run: the final state of every rank (against the reference's), the checkpoints left in the
directory (bit-exact against the reference's, rank by rank), the step every rank resumed at in
each attempt, a new run id per attempt, the dead attempt's temporaries present before the new
rank 0 built its Checkpointer and gone after, and nothing left at the end.

The last test: after a writer died between the two renames of an overwrite, rank 0's
Checkpointer puts the replaced checkpoint back; no rank lists the directory before that
(``Checkpointer._opened_together``), so every rank resumes from the same step.

torch 2.13's default under torchrun shares the agent's TCPStore with the workers across
restarts, and on it ``init_process_group("gloo")`` fails in the restarted workers ("Gloo
connectFullMesh failed ... Connection refused"); ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1`` gives
each attempt a store of its own, hosted by its rank 0 (docs/elastic.md).

docs/elastic.md states what these tests prove. Every run is bounded (``RUN_TIMEOUT_S``); on a
hang the test stops torchrun (which stops its workers), kills any worker left by its pid, and
fails with the output.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
from dataclasses import dataclass

import pytest

from datastates.commit import catalog
from datastates.providers import ProviderRegistry
from datastates.restore.reader import Reader
from datastates.storage.temporaries import LEASE_PREFIX, name_key, owner_token, parse_temporary

from _faults_helpers import HERE, assert_bit_exact

# slow: torchrun jobs killed and restarted at every world size
pytestmark = pytest.mark.slow

CHILD = os.path.join(HERE, "_elastic_child.py")
STEPS = 6
#: The bound on one torchrun run (a run takes 15 to 90 s on 2 cores; a worker hung for the
#: child's HANG_S prints its stacks and exits first).
RUN_TIMEOUT_S = 300
MARKER = re.compile(r"ELASTIC (\w+) (.*)$")


@dataclass(frozen=True)
class Kill:
    """A kill point of one attempt: rank ``rank`` arms MODE/N right before its save of ``step``;
    the next attempt must resume every rank at one of ``resumes_at``. ``leaves``: the save's
    temporary directory is left for the next attempt to clean (the other kills may leave
    nothing: a survivor that gets an error from gloo before the agent stops it closes its
    Checkpointer, which removes the run's lease file when no temporary of the run is left)."""

    attempt: int
    rank: int
    step: int
    mode: str
    n: int
    resumes_at: tuple[int, ...]
    leaves: bool

    def spec(self) -> str:
        return f"{self.attempt}:{self.rank}:{self.step}:{self.mode}:{self.n}"


# Each chain: (world size, kills), one torchrun run (every attempt starts its workers anew, which
# costs seconds: the kills share runs, and each kill point runs once). A save whose kill came
# before its rank's report is never committed (resume at its step); once the directory rename is
# done it is (resume after it); a rank killed after its report leaves the verdict to rank 0,
# which may commit before the agent stops it (either). Each kill's step is one its attempt
# reaches whichever start the previous kill allowed.
CHAINS = {
    "w2-publish-reported-before-latest": (
        2,
        (
            Kill(0, 0, 2, "rename-before", 1, (2,), True),  # rank 0, manifest written, not renamed
            Kill(1, 1, 3, "reported", 1, (3, 4), False),  # rank 1 reported step 3, no verdict yet
            Kill(2, 0, 4, "set-latest", 1, (5,), False),  # rank 0 committed step 4, latest not
            # updated
        ),
    ),
    "w4-shard-write": (
        4,
        (
            Kill(0, 3, 2, "pwrite", 1, (2,), True),  # rank 3 of 4, its first write of step 2
        ),
    ),
}


# ---------------------------------------------------------------- running torchrun


@dataclass
class Run:
    """One torchrun run: its exit status, its output, and the markers its workers printed."""

    returncode: int
    output: str
    markers: list[tuple[str, dict]]

    def of(self, kind: str, **match) -> list[dict]:
        return [
            f
            for k, f in self.markers
            if k == kind and all(f.get(key) == v for key, v in match.items())
        ]

    def tail(self, n: int = 6000) -> str:
        return self.output[-n:]


def parse_markers(output: str) -> list[tuple[str, dict]]:
    found = []
    for line in output.splitlines():
        m = MARKER.search(line)
        if m:
            fields = dict(item.split("=", 1) for item in m[2].split(" "))
            found.append((m[1], {k: json.loads(v) for k, v in fields.items()}))
    return found


def torchrun(root: str, world: int, kills=()) -> Run:
    """Run the job in ``root/ckpt`` on ``world`` ranks, then (in the attempt that ended it) once
    more from scratch in ``root/uninterrupted``; fail the test, with the output, if it does not
    end within RUN_TIMEOUT_S. One restart per kill: a death no kill planned ends the job."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        f"--max-restarts={len(kills)}",
        "--monitor-interval=0.1",
        CHILD,
        os.path.join(root, "ckpt"),
        str(STEPS),
        "--uninterrupted",
        os.path.join(root, "uninterrupted"),
    ]
    for kill in kills:
        cmd += ["--kill", kill.spec()]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PET_", "TORCHELASTIC_"))}
    env.update(TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=HERE, env=env
    )
    try:
        output, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        output = stop(proc)
        pytest.fail(
            f"torchrun did not end within {RUN_TIMEOUT_S} s (a hang); its output:\n{output[-8000:]}"
        )
    return Run(proc.returncode, output, parse_markers(output))


def stop(proc: subprocess.Popen) -> str:
    """Stop a hung torchrun: SIGTERM (it stops its workers), then SIGKILL; then SIGKILL each
    worker it started that still runs (by the pid the worker printed). Returns the output."""
    proc.send_signal(signal.SIGTERM)
    try:
        output, _ = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        output, _ = proc.communicate(timeout=60)
    for _, fields in (m for m in parse_markers(output) if m[0] == "start"):
        if _is_our_worker(fields["pid"]):
            os.kill(fields["pid"], signal.SIGKILL)
    return output


def _is_our_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return CHILD.encode() in f.read()
    except OSError:
        return False


# ---------------------------------------------------------------- what a run left


def final_digests(run: Run, world: int, attempt: int, of: str) -> dict[int, str]:
    """{rank: sha256 of its final state} of the ``of`` run ("job" or "uninterrupted"), which
    must have ended in ``attempt``."""
    assert run.returncode == 0, f"the job failed (rc {run.returncode}):\n{run.tail()}"
    finals = run.of("final", run=of)
    assert [f["attempt"] for f in finals] == [attempt] * world, run.tail()
    return {f["rank"]: f["sha"] for f in finals}


def rank_views(ckpt_dir: str, world: int) -> list:
    """What each saved rank restores from ``ckpt_dir``: the replicated model and optimizer, and
    its own per-rank value."""
    registry = ProviderRegistry.default()
    views = []
    for rank in range(world):
        with Reader(
            ckpt_dir, registry=registry, rank=rank, world_size=world, trusted=True
        ) as reader:
            views.append(reader.load())
    return views


def leftovers(root: str) -> list[str]:
    """Every temporary and lease file in ``root``."""
    return sorted(
        n for n in os.listdir(root) if parse_temporary(n) is not None or n.startswith(LEASE_PREFIX)
    )


# ---------------------------------------------------------------- the tests


@pytest.mark.parametrize("chain", list(CHAINS))
def test_restarted_job_ends_bit_identical_to_the_uninterrupted_one(tmp_path, chain):
    world, kills = CHAINS[chain]
    run = torchrun(str(tmp_path), world, kills)
    for kill in kills:
        assert run.of("armed", attempt=kill.attempt, rank=kill.rank, step=kill.step), (
            f"the kill point {kill} was never armed:\n{run.tail()}"
        )
    last = len(kills)
    assert final_digests(run, world, last, "job") == final_digests(
        run, world, last, "uninterrupted"
    )
    assert run.of("resume", run="uninterrupted", start=0)
    check_resumes(run, world, kills)
    check_attempts(run, kills)
    check_directory(os.path.join(tmp_path, "ckpt"), os.path.join(tmp_path, "uninterrupted"), world)


def check_resumes(run: Run, world: int, kills) -> None:
    """Every rank of each restarted attempt resumed at the same step, one the kill allows."""
    for kill in kills:
        starts = {
            f["rank"]: f["start"] for f in run.of("resume", run="job", attempt=kill.attempt + 1)
        }
        assert sorted(starts) == list(range(world)), run.tail()
        assert len(set(starts.values())) == 1, f"ranks resumed at different steps: {starts}"
        assert starts[0] in kill.resumes_at, f"after {kill}: resumed at {starts[0]}"


def check_attempts(run: Run, kills) -> None:
    """A new run id per attempt; the new rank 0's Checkpointer removed the dead attempt's
    temporaries when it was built (and no earlier attempt's was left for it); the store of the
    new attempt holds no key of the dead one's run, while the probe finds the live run's."""
    runs = {f["attempt"]: f["run_id"] for f in run.of("run")}
    assert sorted(runs) == list(range(len(kills) + 1))
    assert len(set(runs.values())) == len(runs)
    for kill in kills:
        (seen,) = run.of("temporaries", attempt=kill.attempt + 1)
        dead = owner_token(runs[kill.attempt])
        if kill.leaves:
            assert any(
                n.startswith(f".tmp.{dead}-")
                and n.endswith("." + name_key(f"step-{kill.step:010d}"))
                for n in seen["before"]
            ), seen
            assert LEASE_PREFIX + dead in seen["before"], seen
        older = {owner_token(runs[a]) for a in range(kill.attempt)}
        assert not [n for n in seen["before"] if any(t in n for t in older)], seen
        assert seen["after"] == [], f"after {kill}: left by the cleanup: {seen}"
        assert seen["old_keys"] is False
    (probe,) = run.of("store", attempt=len(kills))
    assert probe["own_key"] is True, "the store probe finds no key even of its own run"


def check_directory(ckpt_dir: str, ref_dir: str, world: int) -> None:
    """The uninterrupted run's checkpoints, bit-exact on every rank; nothing else."""
    names = [i.name for i in catalog.list_checkpoints(ckpt_dir)]
    assert (
        names
        == [i.name for i in catalog.list_checkpoints(ref_dir)]
        == [f"step-{STEPS - 2:010d}", f"step-{STEPS - 1:010d}"]
    )
    for name in names:
        got, want = (rank_views(os.path.join(d, name), world) for d in (ckpt_dir, ref_dir))
        for rank in range(world):
            assert_bit_exact(got[rank], want[rank], f"{name} rank {rank}")
    assert leftovers(ckpt_dir) == []
    assert sorted(os.listdir(ckpt_dir)) == sorted(names + ["latest"])


# ---------------------------------------------------------------- an overwrite cut short


class RanksDisagree(Exception):
    """The ranks of one job found different latest checkpoints in one directory."""


#: How long rank 0 holds its cleanup back at most, for rank 1 to list the directory first or
#: show that it cannot (it waits in the Checkpointer's "open" exchange, which needs rank 0's
#: value, sent after the cleanup). Reached only if rank 1 does neither: it would list with
#: nothing holding it back within milliseconds.
LISTED_WAIT_S = 20


def interrupted_overwrite(root: str) -> None:
    """``root`` as a writer killed between the two renames of ``save(step=1, overwrite=True)``
    leaves it (test_crash.py::test_kill_while_overwriting, rename-before 2): the committed step 1
    moved aside to an ``.old.`` temporary whose owner is dead, no ``step-0000000001``."""
    import torch
    import datastates

    with datastates.Checkpointer(root) as ckpt:
        ckpt.save({"w": torch.arange(8.0)}, step=1).wait()
    token = "0123456789abcdef"
    open(os.path.join(root, LEASE_PREFIX + token), "w").close()  # a lease nobody holds
    os.rename(
        os.path.join(root, "step-0000000001"),
        os.path.join(root, f".old.step-0000000001.{token}.89abcdef"),
    )


def _latest_on_each_rank(rank: int, world: int, root: str):
    """A restarted rank: build the Checkpointer, ask ``latest()`` as the resume loop does. Rank 0
    cleans only once rank 1 has listed or waits in the "open" exchange of its Checkpointer (so
    cannot list before that cleanup), or after LISTED_WAIT_S."""
    from datetime import timedelta

    from torch.distributed import distributed_c10d as c10d

    import datastates
    from datastates.commit.publish import RenamePublisher
    from datastates.commit.round import StoreCommunicator

    store = c10d._get_default_store()
    if rank == 1:
        real_exchange = StoreCommunicator.exchange

        def exchange(self, topic, *args, **kwargs):
            if topic == "open":
                store.set("listed-or-held", "1")  # no listing before rank 0 joins it
            return real_exchange(self, topic, *args, **kwargs)

        StoreCommunicator.exchange = exchange
    if rank == 0:
        real = RenamePublisher.clean_stale

        def clean_stale(self, *args, **kwargs):
            try:
                store.wait(["listed-or-held"], timedelta(seconds=LISTED_WAIT_S))
            except RuntimeError:  # DistStoreError: rank 1 did neither
                pass
            return real(self, *args, **kwargs)

        RenamePublisher.clean_stale = clean_stale
    with datastates.Checkpointer(root) as ckpt:
        found = ckpt.latest()
        if rank == 1:
            store.set("listed-or-held", "1")
        return None if found is None else found.name


def test_every_rank_resumes_from_the_same_checkpoint_after_an_interrupted_overwrite(tmp_path):
    launcher = _load_launcher()
    root = str(tmp_path / "ckpt")
    interrupted_overwrite(root)
    found = launcher.run_ranks(2, _latest_on_each_rank, root, timeout=120)
    assert found[0] == "step-0000000001", found  # rank 0 put it back, and resumes from it
    if found[1] != found[0]:
        raise RanksDisagree(f"rank 0 resumes from {found[0]}, rank 1 from {found[1]}")


def _load_launcher():
    """tests/dist/launcher.py, imported by its name (the processes it spawns import it too: they
    get this process's sys.path)."""
    dist_tests = os.path.join(os.path.dirname(HERE), "dist")
    if dist_tests not in sys.path:
        sys.path.append(dist_tests)
    import launcher

    return launcher

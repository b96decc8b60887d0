"""The resume check (datastates.tools.resumecheck): on real loops killed with SIGKILL and started
again (_resume_loops.py), a correct loop is bit-identical and each classic mistake is reported at
its first step under a key naming it; the comparison itself, on recorded fingerprints; the
fingerprints; the argument checks; the ``check-resume`` command.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import types
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

import datastates
from datastates.errors import ConfigError
from datastates.tools.cli import EXIT_ERROR, EXIT_OK, main
from datastates.tools.fingerprint import fingerprint
from datastates.tools.resumecheck import (
    Kill,
    ProcessRun,
    Record,
    ResumeReport,
    check_resume,
    compare,
)

import _resume_loops as loops

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 6  # the loops save after steps 0, 2, 4: a kill at 3 resumes from step 2's checkpoint


# ---------------------------------------------------------------- real loops, real kills

#: The checks on real processes: name -> (loop, kill steps), and the ``check-resume`` command
#: (run as ``python -m datastates``). Each check runs its processes one after the other (the
#: uninterrupted run alongside the first), which keeps one core busy: the checks run two at a
#: time, all started when the first test asks for its result.
COMMAND = ["check-resume", "_resume_loops:counter", "--steps", str(STEPS), "--kill-at", "1,3"]
CHECKS = {
    "correct": (loops.correct, (1, 4)),
    "elastic_loader": (loops.elastic_loader, 3),
    "resumes_at_saved_step": (loops.resumes_at_saved_step, 3),
    "loader_not_in_state": (loops.loader_not_in_state, 3),
    "rng_not_in_state": (loops.rng_not_in_state, 3),
    "randomness_in_loader_workers": (loops.randomness_in_loader_workers, 3),
}


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    """``checked(name)``: the ResumeReport of ``CHECKS[name]`` and its workdir; ``"command"``:
    the command's CompletedProcess."""
    root = tmp_path_factory.mktemp("resume-checks")
    pool = ThreadPoolExecutor(max_workers=2)
    try:
        # in this folder: the command imports MODULE:FUNCTION from the current directory
        futures = {
            "command": pool.submit(
                subprocess.run,
                [sys.executable, "-m", "datastates", *COMMAND],
                cwd=HERE,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=1800,
            )
        }
        futures.update(
            {
                name: pool.submit(
                    check_resume, fn, steps=STEPS, kill_at=kill_at, workdir=root / name
                )
                for name, (fn, kill_at) in CHECKS.items()
            }
        )
        yield lambda name: (futures[name].result(), root / name)
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def test_a_correct_loop_resumes_bit_identical(checked):
    report, workdir = checked("correct")
    assert report.ok and report.first is None, str(report)
    assert report.kills == (Kill(1, 0, 1), Kill(4, 4, 5))
    assert report.compared == 2 + 4 + 1  # steps 0-1, then 1-4 (1 again), then 5
    assert str(report).startswith("resume check OK: all 7 steps")
    assert sorted(os.listdir(workdir)) == [
        "interrupted",
        "reference",
        "reference.jsonl",
        "reference.out",
        "run-0.jsonl",
        "run-0.out",
        "run-1.jsonl",
        "run-1.out",
        "run-2.jsonl",
        "run-2.out",
    ]


def test_the_recommended_loader_with_dropout_resumes_bit_identical(checked):
    """ElasticLoader draws nothing from the global generator: the restored RNGState is the
    stream the uninterrupted run had, so dropout draws the same masks after the restart."""
    report, _ = checked("elastic_loader")
    assert report.ok and report.first is None, str(report)
    assert report.kills == (Kill(3, 2, 3),)


def test_resuming_at_the_saved_step_reports_the_step_run_again(checked):
    report, _ = checked("resumes_at_saved_step")
    assert not report.ok and report.kills == (Kill(3, 2, 2),)
    first = report.first
    assert (first.step, first.key) == (2, "step")
    assert "began at step 2, expected 3: step 2 ran again" in first.what
    assert "restore(state).step + 1" in first.hint
    assert report.compared == 4  # steps 0-3 of the first process matched
    assert str(report).startswith("resume check FAILED: at step 2, key 'step'\n")


def test_a_loader_left_out_of_the_checkpoint_is_named(checked):
    report, _ = checked("loader_not_in_state")
    first = report.first
    assert (first.step, first.key) == (3, "loader/position")
    assert first.what == ("restart 1 (after the kill at step 3) has 1, the uninterrupted run 4")
    assert "inputs" in first.keys and "model/0.weight" in first.keys
    assert not report.ok and report.kills == (Kill(3, 2, 3),)


def test_an_rng_left_out_of_the_checkpoint_is_named_before_the_dropout_weights(checked):
    report, _ = checked("rng_not_in_state")
    first = report.first
    assert (first.step, first.key) == (3, "rng:torch")
    assert "RNGState()" in first.hint
    assert "model/0.weight" in first.keys and "rng:python" not in first.keys
    assert not report.ok


def test_randomness_in_loader_workers_shows_as_the_inputs_with_every_generator_equal(checked):
    report, _ = checked("randomness_in_loader_workers")
    first = report.first
    assert (first.step, first.key) == (3, "inputs")
    assert first.what == (
        "restart 1 (after the kill at step 3) has other bytes (float32 [4, 8] in both runs)"
    )
    assert "workers" in first.hint
    assert not any(k.startswith("rng:") for k in first.keys)


def test_the_command_checks_a_loop_named_module_function(checked):
    proc, _ = checked("command")
    assert proc.returncode == EXIT_OK, proc.stdout + proc.stderr[-3000:]
    assert proc.stdout == (
        "resume check OK: all 8 steps of the interrupted run are bit-identical to the "
        "uninterrupted run (6 steps)\n  kills: step 1 (checkpoint of step 0; the restart began "
        "at step 1); step 3 (checkpoint of step 2; the restart began at step 3)\n"
    )


def test_the_command_refuses_bad_kill_steps(capsys):
    with pytest.raises(SystemExit) as usage:
        main(["check-resume", "m:f", "--steps", "4", "--kill-at", "2,x"])
    assert usage.value.code == 2 and "expected steps such as 3,7" in capsys.readouterr().err
    assert main(["check-resume", "m:f", "--steps", "4", "--kill-at", "4"]) == EXIT_ERROR
    assert capsys.readouterr().err.startswith("error: check_resume: expected kill_at as ")


def test_the_command_refuses_a_loop_that_does_not_import_before_starting_anything(tmp_path):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "datastates",
            "check-resume",
            "nosuchmod:fn",
            "--steps",
            "4",
            "--kill-at",
            "2",
            "--workdir",
            str(tmp_path / "w"),
        ],
        cwd=tmp_path,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert (proc.returncode, proc.stdout) == (EXIT_ERROR, "")
    assert proc.stderr == (
        f"error: check_resume: expected an importable module 'nosuchmod' "
        f"(from {tmp_path} or PYTHONPATH), found that importing it raises "
        "ModuleNotFoundError: No module named 'nosuchmod'\n"
    )
    assert not (tmp_path / "w").exists()  # no run began


# ---------------------------------------------------------------- the comparison, on records


def _fp(**values):
    """A fingerprint: the torch generator plus ``values`` as Python values."""
    out = {"rng:torch": ("rng", "g", "torch"), "w": ("tensor", "w0", "float32 [2]")}
    out.update({k: ("value", repr(v), repr(v)) for k, v in values.items()})
    return out


def _records(*steps, **values):
    return tuple(Record(s, _fp(**values)) for s in steps)


REFERENCE = ProcessRun(_records(0, 1, 2, 3), returncode=0)


def _killed(steps, at, checkpoint):
    return ProcessRun(_records(*steps), returncode=-9, kill_at=at, checkpoint=checkpoint)


def test_a_run_that_repeats_nothing_and_skips_nothing_is_ok():
    runs = [_killed((0, 1, 2), 2, 1), ProcessRun(_records(2, 3), 0)]
    report = compare(REFERENCE, runs, 4)
    assert report.ok and report.kills == (Kill(2, 1, 2),) and report.compared == 5


def test_a_restart_that_skips_steps_is_reported():
    report = compare(REFERENCE, [_killed((0, 1), 1, 0), ProcessRun(_records(3), 0)], 4)
    assert (report.first.step, report.first.key) == (3, "step")
    assert "steps 1-2 never ran" in report.first.what


def test_a_difference_before_the_first_kill_means_the_loop_is_not_deterministic():
    runs = [ProcessRun(_records(0, 1, pid=7), returncode=-9, kill_at=1, checkpoint=0)]
    report = compare(ProcessRun(_records(0, 1, 2, 3, pid=6), 0), runs, 4)
    assert (report.first.step, report.first.key) == (0, "pid")
    assert "not deterministic" in report.first.hint
    assert report.first.what == "the interrupted run has 7, the uninterrupted run 6"


def test_kills_before_any_checkpoint_test_nothing():
    runs = [_killed((0, 1), 1, None), ProcessRun(_records(0, 1, 2, 3), 0)]
    report = compare(REFERENCE, runs, 4)
    assert report.first is None and not report.tested and not report.ok
    assert "NOTHING TESTED" in str(report)


def test_a_restart_that_fails_is_reported_with_its_output():
    runs = [_killed((0, 1), 1, 0), ProcessRun((), returncode=1, log="StateMismatchError: x")]
    report = compare(REFERENCE, runs, 4)
    assert (report.first.step, report.first.key) == (1, "process")
    assert "exited with code 1" in report.first.what and "StateMismatchError" in report.first.what
    assert report.kills == (Kill(1, 0, None),)


def test_a_process_past_its_timeout_and_a_run_ending_early_are_reported():
    report = compare(ProcessRun(_records(0), returncode=None), [], 4)
    assert report.first.key == "process" and "timeout" in report.first.what
    report = compare(REFERENCE, [ProcessRun(_records(0, 1), 0)], 4)
    assert (report.first.step, report.first.key) == (2, "step")
    report = compare(ProcessRun(_records(0, 2), 0), [], 4)
    assert str(report).startswith(
        "resume check FAILED: before any step, key 'step'\n  what: "
        "the uninterrupted run called step_done for steps 0, 2, "
        "expected 0-3"
    )


def test_a_key_only_one_run_has_is_a_difference():
    runs = [_killed((0, 1), 1, 0), ProcessRun(_records(1, 2, 3, extra=1), 0)]
    report = compare(REFERENCE, runs, 4)
    assert (report.first.step, report.first.key) == (1, "extra")
    assert report.first.what == "only restart 1 (after the kill at step 1) has this key (1)"


def test_the_report_is_a_frozen_value():
    report = compare(REFERENCE, [_killed((0, 1), 1, 0), ProcessRun(_records(1, 2, 3), 0)], 4)
    assert isinstance(report, ResumeReport)
    with pytest.raises(AttributeError):
        report.ok = False


# ---------------------------------------------------------------- fingerprints


def _state(seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.AdamW(model.parameters())
    return {
        "model": model,
        "optimizer": opt,
        "loader": loops.Batches(),
        "rng": datastates.RNGState(),
        "gen": torch.Generator().manual_seed(seed),
        "np": np.random.default_rng(seed),
        "epoch": 2,
        "t": torch.arange(4),
    }


def test_a_fingerprint_has_a_kind_per_key_and_reads_without_drawing():
    state = _state()
    torch_rng, py_rng = torch.get_rng_state(), random.getstate()
    fp = fingerprint(state, inputs=torch.ones(2))
    assert torch.equal(torch_rng, torch.get_rng_state()) and py_rng == random.getstate()
    kinds = {k: v[0] for k, v in fp.items()}
    assert kinds == {
        "rng:torch": "rng",
        "rng:python": "rng",
        "rng:numpy": "rng",
        "model/weight": "tensor",
        "model/bias": "tensor",
        "optimizer/param_groups/0/lr": "tensor",
        **{k: "tensor" for k in fp if k.startswith("optimizer/")},
        "loader/position": "state",
        "gen": "rng",
        "np": "rng",
        "epoch": "value",
        "t": "tensor",
        "inputs": "input",
    }
    assert fp["loader/position"][2] == "0" and fp["t"][2] == "int64 [4]"
    assert fingerprint(_state(), inputs=torch.ones(2)) == fp


def test_one_flipped_bit_changes_a_tensor_digest():
    a, b = torch.zeros(8), torch.zeros(8)
    b.view(torch.int32)[5] ^= 1
    assert fingerprint({"t": a})["t"][1] != fingerprint({"t": b})["t"][1]
    assert fingerprint({"t": a})["t"][1] != fingerprint({"t": a.view(2, 4)})["t"][1]


# ---------------------------------------------------------------- arguments


def _in_main():
    fn = types.FunctionType(loops.correct.__code__, {}, "correct")
    fn.__module__, fn.__qualname__ = "__main__", "correct"
    return fn


@pytest.mark.parametrize(
    "train_fn, steps, kill_at, match",
    [
        (lambda run: None, 4, 1, "module-level function"),
        (_in_main(), 4, 1, "__main__"),
        ("no_colon", 4, 1, "module:function"),
        ("no_such_module_here:train", 4, 1, "expected an importable module 'no_such_module_here'"),
        ("_resume_loops:no_such_loop", 4, 1, "expected a function 'no_such_loop'"),
        ("_resume_loops:CFG", 4, 1, "found CheckpointConfig"),
        (loops.correct, 0, 0, "steps >= 1"),
        (loops.correct, 4, 4, r"in \[0, 4\)"),
        (loops.correct, 4, (2, 1), "increasing"),
        (loops.correct, 4, (), "increasing"),
        (loops.correct, 4, True, "increasing"),
    ],
)
def test_bad_arguments_are_refused_before_any_process_starts(train_fn, steps, kill_at, match):
    with pytest.raises(ConfigError, match=match):
        check_resume(train_fn, steps, kill_at)


def test_a_workdir_holding_files_is_refused(tmp_path):
    (tmp_path / "old.txt").write_text("x")
    with pytest.raises(ConfigError, match="new or empty workdir"):
        check_resume(loops.correct, 4, 1, workdir=tmp_path)
    assert os.listdir(tmp_path) == ["old.txt"]

"""Rank 0's review of the rank reports, alone: its cost per report and per tensor, here and in an
older source tree on the same reports.

    python benchmarks/review_cost.py [--before SRC] [--worlds 16,64,256,1024] [--captured 64]
                                     [--tensors 10,200] [--reps 3] [--update-inputs FILE]

The rank-0 probe of benchmarks/scale_inputs.py without the rest: reports captured from real saves
of ``TensorShard`` states (tensor parallel 4, an ``RNGState``, one object; ``--captured`` ranks
saved, relabelled copies up to each world size), then what rank 0 does with them in a commit
round (parse and validate each report, merge them into a manifest, check the tiling and the
replicas, encode and check the manifest). The reports are captured once, by this tree; each
measurement runs in a fresh process (``--src``: the tree it imports), this tree's and the
``--before`` tree's taking turns, one repetition each at a time, so that both see the same load
on a shared machine; each phase is the fastest of ``--reps``, each run after a full garbage
collection (scale_inputs.py's ``_review_run``). Prints, per tree, the fixed cost
per report and the cost per tensor (least-squares fits as in scale_inputs.py), and whether both
trees write the same manifest bytes for the same reports (``created_unix`` set to 0).

``--update-inputs FILE`` replaces the ``rank0`` field of scale_inputs.py's JSON with this tree's
measurement (noting when and how it was made), so that benchmarks/scale_model.py uses it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TP = 4


def _child(args) -> int:
    """One repetition in this process: the review's phases for every tensor count and world
    size of the reports in ``args.reports``, and the manifest bytes' digest; JSON on stdout."""
    from benchmarks import scale_inputs as si

    with open(args.reports) as f:
        captured = json.load(f)
    out = {}
    for tensors, raw in captured.items():
        si._review_once(si.widen(raw, TP, TP))  # warm-up: the first call's imports and caches
        out[tensors] = [si._review_run(si.widen(raw, w, TP), 1) for w in _ints(args.worlds)]
        out[tensors + "/digest"] = _manifest_digest(si.widen(raw, 8, TP))
    json.dump(out, sys.stdout)
    return 0


def _manifest_digest(raw: list[str]) -> str:
    """SHA-256 of the manifest bytes rank 0 writes for these reports (created_unix 0)."""
    import dataclasses
    from datastates.commit.review import build_manifest
    from datastates.format.files import manifest_record_bytes
    from datastates.format.validate import parse_rank_report

    reports = [parse_rank_report(json.loads(text), f"report {r}") for r, text in enumerate(raw)]
    manifest = build_manifest(
        reports, name="step-1", step=1, metadata={}, save_id=reports[0].save.nonce
    )
    data, _ = manifest_record_bytes(dataclasses.replace(manifest, seq=1, created_unix=0.0))
    return hashlib.sha256(data).hexdigest()


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def _run_child(src: str, reports: str, worlds: str) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([src, REPO]))
    done = subprocess.run(
        [
            sys.executable,
            os.path.abspath(__file__),
            "--child",
            "--src",
            src,
            "--reports",
            reports,
            "--worlds",
            worlds,
        ],
        env=env,
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(done.stdout)


def _fastest(reps: list[dict]) -> dict:
    """Per tensor count and world size, each phase the fastest of the repetitions."""
    best = json.loads(json.dumps(reps[0]))
    for rep in reps[1:]:
        for tensors, runs in rep.items():
            if tensors.endswith("/digest"):
                continue
            for mine, other in zip(best[tensors], runs):
                for key in ("parse_s", "merge_check_s", "encode_s"):
                    mine[key] = min(mine[key], other[key])
    return best


def _costs(best: dict) -> dict:
    from benchmarks import scale_inputs as si

    a, b = (
        si.per_rank_costs(int(t), runs) for t, runs in best.items() if not t.endswith("/digest")
    )
    return si.rank0_fit(a, b, TP)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--before",
        default=None,
        metavar="SRC",
        help="an older source tree (its src/ directory) measured the same way",
    )
    parser.add_argument("--worlds", default="16,64,256,1024")
    parser.add_argument("--captured", type=int, default=64)
    parser.add_argument("--tensors", default="10,200")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--update-inputs", default=None, metavar="FILE")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--src", default=os.path.join(REPO, "src"), help=argparse.SUPPRESS)
    parser.add_argument("--reports", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    sys.path[:0] = [os.path.abspath(args.src), REPO]
    if args.child:
        return _child(args)
    from benchmarks import scale_inputs as si

    base = tempfile.mkdtemp(prefix="ds-review-cost-")
    trees = {"this tree": os.path.abspath(args.src)}
    if args.before:
        trees["before"] = os.path.abspath(args.before)
    try:
        reports = os.path.join(base, "reports.json")
        with open(reports, "w") as f:
            json.dump(
                {
                    str(t): si.capture_reports(args.captured, t, TP, base)
                    for t in _ints(args.tensors)
                },
                f,
            )
        load = [os.getloadavg()]
        reps = {name: [] for name in trees}
        for _ in range(args.reps):
            for name, src in trees.items():
                reps[name].append(_run_child(src, reports, args.worlds))
        load.append(os.getloadavg())
    finally:
        shutil.rmtree(base, ignore_errors=True)
    out = {
        "measured": time.strftime("%Y-%m-%d %H:%M"),
        "cpus": os.cpu_count(),
        "loadavg_before": load[0],
        "loadavg_after": load[1],
        "command": " ".join(["python benchmarks/review_cost.py"] + (argv or sys.argv[1:])),
    }
    for name in trees:
        best = _fastest(reps[name])
        out[name] = {
            "rank0": _costs(best),
            "manifest_sha256": {t: best[t] for t in best if t.endswith("/digest")},
        }
        r0 = out[name]["rank0"]
        print(
            f"{name}: {r0['per_rank_fixed_s'] * 1e3:.3f} ms per report + "
            f"{r0['per_entry_s'] * 1e6:.1f} us per tensor"
        )
    if args.before:
        same = out["this tree"]["manifest_sha256"] == out["before"]["manifest_sha256"]
        print(f"same manifest bytes for the same reports: {'yes' if same else 'NO'}")
    print(json.dumps(out, indent=1))
    if args.update_inputs:
        _update_inputs(args.update_inputs, out)
    return 0


def _update_inputs(path: str, out: dict) -> None:
    """Put this tree's rank-0 costs into scale_inputs.py's JSON (its other fields kept)."""
    with open(path) as f:
        inputs = json.load(f)
    inputs["rank0"] = dict(
        out["this tree"]["rank0"],
        measured=out["measured"],
        command=out["command"],
        loadavg=[out["loadavg_before"], out["loadavg_after"]],
    )
    with open(path, "w") as f:
        json.dump(inputs, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())

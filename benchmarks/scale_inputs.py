"""The inputs of the scale model (benchmarks/scale_model.py) that this machine can measure.

    python benchmarks/scale_inputs.py [--out results/scale-model/inputs.json] [--quick] [--dir D]

The model predicts stall, persist and commit times at hundreds to thousands of ranks from a few
costs per tensor, per store request and per rank report. Those costs are CPU work of this library
and of the TCPStore, so one machine measures them; the bandwidths of the target hardware are
published numbers, kept in the model itself. Three probes, each small:

- **per tensor**: one process saves (and restores in place) a state of ``n`` two-element tensors
  for two values of ``n``: the slope is the cost of one tensor in ``save()`` (the call), in the
  background until committed, and in ``restore``; the intercept is the fixed cost. Also the
  manifest bytes per tensor.
- **store**: a ``torch.distributed.TCPStore`` served by this process, clients in other
  processes making the calls the commit round makes (``compare_set`` reads, ``add``): the round
  trip seen by one client, the rate at which it reads 1 MiB values, and the server's CPU time
  per request with several clients.
- **rank 0**: reports captured from real saves of ``TensorShard`` states (tensor parallel 4;
  10 and 200 tensors per rank, an ``RNGState``, one object; 256 ranks saved, copies of them
  relabelled as further pipeline stages up to 1,024), then what rank 0 does with them in a
  commit round for 16, 64, 256 and 1,024 ranks: parse and validate each report, merge them
  into a manifest, check the tiling, encode and validate the manifest. Its cost per report
  (least-squares slope over the world sizes) as a fixed part plus a part per tensor, and the
  report and manifest bytes the same way.

Writes one JSON object (schema ``datastates-scale-inputs/1``, described in docs/scale.md,
"Inputs") and prints it. On a 2-core machine the store probe shares the cores with its
clients: the server's CPU time per request is the number to read, not the throughput.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import gc
import json
import logging
import os
import shutil
import socket
import statistics
import sys
import tempfile
import time

import torch
import torch.multiprocessing as mp

if __package__ in (None, ""):
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
import datastates  # noqa: E402
from datastates.commit.review import build_manifest, check_replicas, check_tiling  # noqa: E402
from datastates.commit.round import LocalCommunicator  # noqa: E402
from datastates.errors import CommitError  # noqa: E402
from datastates.format import codec as fmt  # noqa: E402
from datastates.format.files import manifest_record_bytes  # noqa: E402
from datastates.format.records import Verdict  # noqa: E402
from datastates.format.validate import parse_rank_report  # noqa: E402

try:  # how the commit round decodes a report (benchmarks/review_cost.py measures older trees)
    from datastates.format.validate import decode_rank_report as _decode_rank_report
except ImportError:
    _decode_rank_report = None
try:  # an older tree with the garbage collector's pause runs rank 0's review under it, as its round did
    from datastates.collector import paused as _paused  # noqa: E402
except ImportError:
    _paused = contextlib.nullcontext

SCHEMA = "datastates-scale-inputs/1"
_ABSENT = "\x00absent"  # the never-blocking read of the commit round (round.py)
_VALUE_BYTES, _VALUE_READS = 1 << 20, 64  # reads of a 1 MiB value: the store's bytes per second


# ---------------------------------------------------------------- per tensor


def _tensor_run(n: int, reps: int, base: str) -> dict:
    root = os.path.join(base, f"t{n}")
    state = {f"t{i}": torch.randn(2) for i in range(n)}
    config = datastates.CheckpointConfig(keep_last=2, fsync=False)
    runs = []
    with datastates.Checkpointer(root, config) as ckpt:
        ckpt.save(state, step=0).wait()  # warm-up: sizes the host cache
        for step in range(1, reps + 1):
            t0 = time.perf_counter()
            handle = ckpt.save(state, step=step)
            t1 = time.perf_counter()
            handle.wait()
            t2 = time.perf_counter()
            ckpt.restore({k: torch.empty(2) for k in state})
            runs.append((t1 - t0, t2 - t1, time.perf_counter() - t2))
        manifest = os.path.getsize(os.path.join(root, fmt.step_name(reps), fmt.MANIFEST))
    shutil.rmtree(root, ignore_errors=True)
    med = [statistics.median(r[i] for r in runs) for i in range(3)]
    return {
        "n": n,
        "save_s": med[0],
        "commit_s": med[1],
        "restore_s": med[2],
        "manifest_bytes": manifest,
    }


def tensor_costs(sizes: tuple[int, int], reps: int, base: str) -> dict:
    """Slope (per tensor) and intercept (fixed) of save(), commit and restore, from two sizes."""
    lo, hi = (_tensor_run(n, reps, base) for n in sizes)
    dn = hi["n"] - lo["n"]
    per = {k: (hi[f"{k}_s"] - lo[f"{k}_s"]) / dn for k in ("save", "commit", "restore")}
    fixed = {k: max(0.0, lo[f"{k}_s"] - per[k] * lo["n"]) for k in per}
    return {
        "per_tensor_s": per,
        "fixed_s": fixed,
        "manifest_bytes_per_tensor": (hi["manifest_bytes"] - lo["manifest_bytes"]) / dn,
        "runs": [lo, hi],
    }


# ---------------------------------------------------------------- store


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _client(port: int, cid: int, requests: int, value_reads: int, out_q) -> None:
    store = torch.distributed.TCPStore(
        "127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60)
    )
    store.add(f"ready/{cid}", 1)
    store.wait(["go"])
    t0 = time.perf_counter()
    for i in range(requests // 2):
        store.compare_set(f"k/{cid}/{i % 64}", _ABSENT, _ABSENT)  # a read of an absent key
        store.add(f"n/{cid}", 1)
    per_request = (time.perf_counter() - t0) / (2 * (requests // 2))
    t0 = time.perf_counter()
    for _ in range(value_reads):
        store.get("value")  # a large value: rank 0 reads each rank's report once
    out_q.put((cid, per_request, value_reads * _VALUE_BYTES / (time.perf_counter() - t0)))


def _store_run(clients: int, requests: int, value_reads: int) -> dict:
    port = _free_port()
    server = torch.distributed.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    server.set("value", b"x" * _VALUE_BYTES)
    ctx = mp.get_context("spawn")
    out_q = ctx.Queue()
    procs = [
        ctx.Process(target=_client, args=(port, c, requests, value_reads, out_q))
        for c in range(clients)
    ]
    for p in procs:
        p.start()
    server.wait([f"ready/{c}" for c in range(clients)])
    cpu0, wall0 = time.process_time(), time.perf_counter()
    server.set("go", "1")
    answers = [out_q.get(timeout=300) for _ in procs]
    wall, cpu = time.perf_counter() - wall0, time.process_time() - cpu0
    per_request = [a[1] for a in answers]
    for p in procs:
        p.join(60)
    served = clients * 2 * (requests // 2)
    return {
        "clients": clients,
        "requests": served,
        "round_trip_s": statistics.median(per_request),
        "server_cpu_s_per_request": cpu / (served + clients * value_reads),
        "value_gbps": statistics.median(a[2] for a in answers) / 1e9,
        "wall_s": wall,
    }


def store_costs(requests: int) -> dict:
    one, several = _store_run(1, requests, _VALUE_READS), _store_run(4, requests, 0)
    return {
        "round_trip_s": one["round_trip_s"],
        "server_cpu_s_per_request": several["server_cpu_s_per_request"],
        "value_gbps": one["value_gbps"],
        "runs": [one, several],
    }


# ---------------------------------------------------------------- rank 0


class _Capture(LocalCommunicator):
    """A one-process communicator that keeps the report it was given and ends the round there
    (one rank's shards alone do not tile their tensors: the save is aborted, as intended)."""

    def __init__(self):
        super().__init__(run_id="scale-inputs")
        self.report: dict | None = None

    def agree(self, sid, report, *args, **kwargs):
        self.report = report.to_json()
        return Verdict.abort("invalid", "report captured for the scale inputs", {})


def _rank_state(rank: int, tensors: int, tp: int) -> dict:
    """Rank ``rank``'s state: ``tensors`` tensor-parallel shards of its stage, its RNG state and
    one small object (what every rank of a training job holds besides its tensors)."""
    stage, part = divmod(rank, tp)
    layer = {
        f"p{i}": datastates.TensorShard(torch.randn(2), (2 * tp,), (2 * part,))
        for i in range(tensors)
    }
    return {"stage": {str(stage): layer}, "rng": datastates.RNGState(), "info": {"rank": rank}}


def capture_reports(world: int, tensors: int, tp: int, base: str) -> list[str]:
    """The JSON report of each of ``world`` ranks, each from a real one-process save, relabelled
    as that rank's (its rank, its file's name, one shared directory)."""
    config = datastates.CheckpointConfig(keep_last=1, fsync=False)
    out = []
    quiet = logging.getLogger("datastates")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # each save's intended abort would log a warning
    try:
        for rank in range(world):
            out.append(_capture_one(rank, tensors, tp, config, os.path.join(base, "r")))
    finally:
        quiet.setLevel(level)
    return out


def _capture_one(rank: int, tensors: int, tp: int, config, root: str) -> str:
    comm = _Capture()
    with datastates.Checkpointer(root, config, communicator=comm) as ckpt:
        try:
            ckpt.save(_rank_state(rank, tensors, tp), step=1).wait()
        except CommitError:
            pass  # the probe's own abort, once the report was captured
    shutil.rmtree(root, ignore_errors=True)
    report = comm.report
    report["rank"] = rank
    report["file"] = dict(report["file"], rank=rank, name=fmt.shard_file_name(rank))
    return json.dumps(report)


def relabel(raw: str, rank: int, stage_shift: int) -> str:
    """A captured report as that of ``rank``, its stage moved by ``stage_shift`` (so that more
    ranks than were saved hold distinct tensors; their bytes and checksums stay the same)."""
    report = json.loads(raw)
    stages = report["tree"]["items"][0][1]["items"]
    old = stages[0][0]
    new = str(int(old) + stage_shift)
    stages[0][0] = new
    for e in report["entries"]:
        if e["key"].startswith(f"stage/{old}/"):
            e["key"] = f"stage/{new}/" + e["key"][len(f"stage/{old}/") :]
    report["rank"] = rank
    report["file"] = dict(report["file"], rank=rank, name=fmt.shard_file_name(rank))
    return json.dumps(report)


def widen(raw: list[str], world: int, tp: int) -> list[str]:
    """``world`` reports from the captured ones, repeated with their stages shifted."""
    out = list(raw[:world])
    while len(out) < world:
        r = len(out)
        out.append(relabel(raw[r % len(raw)], r, (r // len(raw)) * (len(raw) // tp)))
    return out


def _parse_report(text: str, where: str):
    """A report as the commit round parses the bytes it reads (``decode_rank_report``; a tree
    without it: ``json.loads``)."""
    if _decode_rank_report is None:
        return parse_rank_report(json.loads(text), where)
    obj, checked = _decode_rank_report(text.encode())
    return parse_rank_report(obj, where, checked=checked)


def _review_once(raw: list[str]) -> dict:
    """Rank 0's work on the reports ``raw``, phase by phase, with the garbage collector paused
    where the tree pauses it: reading and checking the reports (the commit round's pause), and
    encoding the manifest (its own). What a pause's end collects counts in the phase it ends,
    and the young generation's collection after the last, in either tree, in the last phase."""
    t0 = time.perf_counter()
    with _paused():
        reports = {r: _parse_report(text, f"report {r}") for r, text in enumerate(raw)}
        t1 = time.perf_counter()
        manifest = build_manifest(
            [reports[r] for r in sorted(reports)],
            name="step-1",
            step=1,
            metadata={},
            save_id=reports[0].save.nonce,
        )
        problems = check_tiling(manifest) + check_replicas(reports)
    t2 = time.perf_counter()
    data, _ = manifest_record_bytes(dataclasses.replace(manifest, seq=1))  # as published
    gc.collect(0)
    t3 = time.perf_counter()
    if problems:
        raise RuntimeError(f"the probe's reports do not tile: {problems[:3]}")
    return {
        "world": len(raw),
        "parse_s": t1 - t0,
        "merge_check_s": t2 - t1,
        "encode_s": t3 - t2,
        "report_bytes": sum(len(x) for x in raw),
        "manifest_bytes": len(data),
    }


def _review_run(raw: list[str], reps: int) -> dict:
    """Rank 0's work on ``raw``, each phase the fastest of ``reps`` (CPU cost: other load on a
    shared machine only ever adds to it). Each repetition starts after a full collection, so
    that it pays for the collections its own objects cause, not for those of the objects left
    before it."""
    runs = []
    for _ in range(reps):
        gc.collect()
        runs.append(_review_once(raw))
    best = dict(runs[0])
    for key in ("parse_s", "merge_check_s", "encode_s"):
        best[key] = min(r[key] for r in runs)
    return best


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)


def _per_rank(
    worlds: list[int], captured: int, tensors: int, tp: int, base: str, reps: int
) -> dict:
    """Rank 0's cost per rank report (least-squares slope over ``worlds``) for ``tensors`` per
    rank; ``captured`` reports come from real saves, the rest are relabelled copies."""
    raw = capture_reports(captured, tensors, tp, base)
    return per_rank_costs(tensors, [_review_run(widen(raw, w, tp), reps) for w in worlds])


def per_rank_costs(tensors: int, runs: list[dict]) -> dict:
    """The slopes over the world sizes of ``runs`` (``_review_run``'s, one per world size, at
    ``tensors`` per rank): rank 0's time, report bytes and manifest bytes per rank report."""
    xs = [r["world"] for r in runs]
    for r in runs:
        r["total_s"] = r["parse_s"] + r["merge_check_s"] + r["encode_s"]
    return {
        "tensors": tensors,
        "per_rank_s": _slope(xs, [r["total_s"] for r in runs]),
        "report_bytes_per_rank": _slope(xs, [r["report_bytes"] for r in runs]),
        "manifest_bytes_per_rank": _slope(xs, [r["manifest_bytes"] for r in runs]),
        "runs": runs,
    }


def rank0_costs(
    worlds: list[int], captured: int, tensor_counts: tuple[int, int], tp: int, base: str, reps: int
) -> dict:
    """Rank 0's cost per report as ``fixed + per_entry x tensors``, from two tensor counts."""
    return rank0_fit(*(_per_rank(worlds, captured, t, tp, base, reps) for t in tensor_counts), tp)


def rank0_fit(a: dict, b: dict, tp: int) -> dict:
    """``fixed + per_entry x tensors`` through the costs per rank (``per_rank_costs``) at two
    tensor counts."""
    dt = b["tensors"] - a["tensors"]

    def fit(key):
        per = (b[key] - a[key]) / dt
        return max(0.0, a[key] - per * a["tensors"]), per

    fixed, per_entry = fit("per_rank_s")
    report_fixed, report_per = fit("report_bytes_per_rank")
    manifest_fixed, manifest_per = fit("manifest_bytes_per_rank")
    return {
        "tp": tp,
        "per_rank_fixed_s": fixed,
        "per_entry_s": per_entry,
        "report_bytes": {"per_rank": report_fixed, "per_entry": report_per},
        "manifest_bytes": {"per_rank": manifest_fixed, "per_entry": manifest_per},
        "by_tensors": [a, b],
    }


# ---------------------------------------------------------------- main


def measure(quick: bool, base: str) -> dict:
    """Every probe, with the machine's load before and after (a shared machine's load inflates
    CPU costs: compare runs made under a similar load)."""
    worlds, captured, reps = ([4, 8, 16], 8, 1) if quick else ([16, 64, 256, 1024], 256, 3)
    out = {
        "schema": SCHEMA,
        "measured": time.strftime("%Y-%m-%d %H:%M"),
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        "loadavg_before": os.getloadavg(),
    }
    out["tensors"] = tensor_costs((20, 200) if quick else (200, 2000), reps, base)
    out["store"] = store_costs(200 if quick else 4000)
    out["rank0"] = rank0_costs(worlds, captured, (10, 50) if quick else (10, 200), 4, base, reps)
    out["loadavg_after"] = os.getloadavg()
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="results/scale-model/inputs.json")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (a smoke run)")
    parser.add_argument("--dir", default=None, help="where the probe checkpoints go (a temp dir)")
    args = parser.parse_args(argv)
    base = tempfile.mkdtemp(prefix="ds-scale-inputs-", dir=args.dir)
    try:
        result = measure(args.quick, base)
    finally:
        shutil.rmtree(base, ignore_errors=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    print(json.dumps({k: v for k, v in result.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

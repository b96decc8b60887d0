"""A model of checkpointing at scale: stall, persist, commit and end-to-end overhead per world size.

    python benchmarks/scale_model.py [--inputs results/scale-model/inputs.json]
                                     [--tensors-json FILE] [--commit-scale FILE]
                                     [--validate | --sweep [--dp 4,8,...]] [--every 1,10]
                                     [--out DIR]
                                     [--host-cache-gib G] [--cpu-factor F] [--store-server-us US]
                                     [--tensors-per-rank N] [--no-replica-check]

No machine of this project has hundreds of GPUs, so the behaviour at the paper's scale (70B
parameters on 256 A100-40GB) and beyond is computed, not measured. The model is deliberately
small: each output is a sum or a minimum of a few terms, and each term is one input times a count.
Inputs come from three places, and every table says which:

- **measured here** (benchmarks/scale_inputs.py → ``--inputs``): CPU costs of this library per
  tensor (``save()``, the background commit, restore), rank 0's cost per rank report, report and
  manifest bytes, the TCPStore's round trip and its server time per request;
- **measured here, at 1-32 ranks** (benchmarks/commit_scale.py → ``--commit-scale``): store
  requests per save on rank 0 and on the others, and the commit latency the validation compares;
- **published** for the target machine (ALCF Polaris, NERSC Perlmutter's scratch file system,
  the HPDC'24 paper), or **assumed** where nothing was found: benchmarks/scale_settings.py
  and docs/scale.md, "Inputs".

``--tensors-json`` overrides the per-tensor costs with any JSON object holding
``{"per_tensor_s": {"save": s, "commit": s, "restore": s}}`` (seconds per tensor; other fields
ignored), e.g. the output of a later per-tensor benchmark. Without ``--inputs`` the constants of
:data:`MEASURED` are used (one run of scale_inputs.py on the 2-core development VM).

``--validate`` runs the model for the commit-latency measurements (this machine, 1-32 processes)
and prints model and measurement side by side; ``--sweep`` evaluates the 70B job from 256 to
8,192 ranks; with neither, the four settings of docs/scale.md (256, 512, 1,024 and 8,192 ranks).
``--out`` writes the rows as JSON.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
from dataclasses import dataclass

if __package__ in (None, ""):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import scale_report  # noqa: E402
from benchmarks.scale_settings import (  # noqa: E402
    DEV_VM,
    GB,
    SETTINGS,
    SWEEP_DP,
    GiB,
    Machine,
    Setting,
    sweep,
)

#: Poll schedule of a rank waiting in the commit round (datastates/commit/round.py): the first
#: poll after ``POLL_S``, each next one 1.5x later, at most ``max_poll(ranks)`` apart:
#: ``MAX_POLL_S`` or ``POLL_PER_RANK_S`` x ranks, whichever is longer.
POLL_S, POLL_GROWTH, MAX_POLL_S, POLL_PER_RANK_S = 0.002, 1.5, 0.05, 50e-6


def max_poll(ranks: int) -> float:
    """The longest interval between two polls of one waiting rank at this world size."""
    return max(MAX_POLL_S, POLL_PER_RANK_S * ranks)


@dataclass(frozen=True)
class Costs:
    """CPU costs of this library and of the TCPStore, measured on the development VM."""

    save_per_tensor_s: float  #: save() on the training thread, per tensor
    commit_per_tensor_s: float  #: background work until committed, per tensor (one process)
    restore_per_tensor_s: float  #: restore in place, per tensor
    rank0_fixed_s: float  #: rank 0: parse + merge + check + encode, per rank report...
    rank0_per_entry_s: float  #: ... plus this per tensor of the report
    report_bytes_fixed: float  #: bytes of one rank report in the store: fixed ...
    report_bytes_per_entry: float  #: ... plus per tensor
    manifest_bytes_fixed: float  #: manifest bytes per rank: fixed ...
    manifest_bytes_per_entry: float  #: ... plus per tensor
    store_rtt_s: float  #: one request, client to reply, loopback, one client
    store_server_s: float  #: server CPU per request (its service time)
    store_value_gbps: float  #: bytes per second of large values read from the store
    crc_gbps: float  #: CRC-32 (ISA-L), one thread, results/bench-gpt-full
    torch_save_gbps: (
        float  #: torch.save + fsync of a GPT state, docs/benchmarks.md "Current numbers"
    )
    fresh_copy_gbps: float  #: copy into freshly allocated host memory, same run


#: results/scale-model/inputs.json (benchmarks/scale_inputs.py on the 2-core VM, 2026-12-01
#: 18:55, load average 2.7-4.3; rank 0's review by benchmarks/review_cost.py, 2026-12-02 07:50,
#: load average 1.2-4.4), and the CRC-32, torch.save and fresh-copy rates of
#: results/bench-gpt-full (2026-11-30). Used when no ``--inputs`` file is found; the file, when
#: present, replaces all but the last three.
MEASURED = Costs(
    save_per_tensor_s=45.5e-6,
    commit_per_tensor_s=138e-6,
    restore_per_tensor_s=52e-6,
    rank0_fixed_s=0.40e-3,
    rank0_per_entry_s=22.6e-6,
    report_bytes_fixed=1390.0,
    report_bytes_per_entry=235.0,
    manifest_bytes_fixed=1278.0,
    manifest_bytes_per_entry=167.0,
    store_rtt_s=36e-6,
    store_server_s=14.5e-6,
    store_value_gbps=0.52,
    crc_gbps=13.1,
    torch_save_gbps=0.95,
    fresh_copy_gbps=3.5,
)


# ---------------------------------------------------------------- the terms


def poll_interval(elapsed_s: float, ranks: int = 1) -> float:
    """The poll interval in force ``elapsed_s`` after a rank started waiting."""
    t, delay, ceiling = 0.0, POLL_S, max_poll(ranks)
    while t + delay < elapsed_s and delay < ceiling:
        t += delay
        delay = min(delay * POLL_GROWTH, ceiling)
    return delay


def store_response_s(ranks: int, c: Costs, m: Machine) -> tuple[float, float]:
    """(response time of one request, server utilisation) while ``ranks`` clients each keep one
    request in flight every ``max_poll(ranks)`` (the waiting ranks) on the one-threaded TCPStore
    server: exact mean-value analysis of a closed network with one queue and a think time."""
    service, think = c.store_server_s, max_poll(ranks)
    queue, response = 0.0, service
    for n in range(1, ranks + 1):
        response = service * (1 + queue)
        queue = n / (response + think) * response
    throughput = ranks / (response + think)
    client_side = max(0.0, c.store_rtt_s - service)  # the caller's own part of a round trip
    return response + client_side + m.net_rtt_s, throughput * service


def persist_terms(s: Setting, c: Costs) -> dict:
    """Writing a rank's file takes as long as the tightest of four limits: its two writer
    threads' CRC, its node's NIC (shared by the node's ranks), the OST holding it (a file of
    stripe count 1; files are spread round-robin, so an OST holds ceil(ranks / OSTs) of them)
    and its share of the file system's aggregate bandwidth."""
    m, b = s.machine, s.written_per_rank
    bounds = {
        "writer CRC": b / (2 * c.crc_gbps * GB),
        "node NIC": b * m.gpus_per_node / (m.nic_gbps * GB),
        "OSTs, stripe count 1": math.ceil(s.ranks / m.fs_osts) * b / (m.ost_gbps * GB),
        "FS aggregate": s.total_bytes / (m.fs_gbps * GB),
    }
    bound = max(bounds, key=bounds.get)
    return {"persist_s": bounds[bound], "write_bound": bound, "persist_bounds": bounds}


def snapshot_terms(s: Setting, c: Costs, persist_s: float, cache_bytes: float | None) -> dict:
    """save() on the training thread, then the capture thread: creating the shard file, the
    device → host-cache copies, the replica digests; whether it fits the fwd+bwd window."""
    m = s.machine
    d2h = min(m.d2h_pinned_gbps, m.host_mem_gbps / m.gpus_per_node) * GB
    copy_s = s.written_per_rank / d2h
    cache = s.written_per_rank if cache_bytes is None else min(cache_bytes, s.written_per_rank)
    if cache < s.written_per_rank:  # streams: the rest waits for writers to free cache slots
        copy_s = max(copy_s, cache / d2h + persist_s * (1 - cache / s.written_per_rank))
    # The digests read each replica with tensor.cpu() in 64 MiB pieces (save/job.py): pageable
    # copies on the capture thread's current stream, which is the device's default stream, the
    # one training computes on: that copy time is taken from training (read from the code; not
    # measured on a GPU here).
    digest_copy_s = s.replicas_held_per_rank / (m.d2h_pageable_gbps * GB)
    digest_s = digest_copy_s + s.replicas_held_per_rank / (c.crc_gbps * GB)
    create_s = s.ranks / m.fs_create_per_s  # every rank creates its file in one directory
    save_call_s = s.tensors_per_rank * c.save_per_tensor_s * m.cpu_factor
    snapshot_s = create_s + copy_s + digest_s
    wait_s = max(0.0, snapshot_s - s.fwd_bwd_s)  # the guarded optimizer step waits for the rest
    return {
        "save_call_s": save_call_s,
        "create_s": create_s,
        "d2h_s": copy_s,
        "digest_s": digest_s,
        "digest_on_compute_stream_s": digest_copy_s,
        "in_host_memory_s": save_call_s + snapshot_s,
        "durable_s": save_call_s + create_s + max(copy_s + digest_s, persist_s),
        "overlaps_iteration": snapshot_s <= s.fwd_bwd_s,
        "step_wait_s": wait_s,
        "stall_s": save_call_s + digest_copy_s + wait_s,
        "cache_bytes_per_node": cache * m.gpus_per_node,
    }


def commit_terms(s: Setting, c: Costs, requests: tuple[float, float]) -> dict:
    """From the slowest rank's report to every rank holding the verdict (rank 0's round): rank
    0 notices the last report, reads every report from the store, reviews them, opens every
    shard file, writes the manifest and renames; the others notice the verdict at their next
    poll (the last of ``ranks - 1`` pollers at random phases: nearly one poll interval)."""
    m, R, T = s.machine, s.ranks, s.tensors_per_rank
    response, load = store_response_s(R, c, m)
    fixed, per_rank = requests
    report_bytes = R * (c.report_bytes_fixed + c.report_bytes_per_entry * T)
    manifest_bytes = R * (c.manifest_bytes_fixed + c.manifest_bytes_per_entry * T)
    gather_s = (fixed + per_rank * R) * response + report_bytes / (c.store_value_gbps * GB)
    if R == 1:  # alone, the report stays in memory and nobody waits for a verdict
        gather_s = 0.0
    review_s = R * (c.rank0_fixed_s + c.rank0_per_entry_s * T) * m.cpu_factor
    files_s = R * m.fs_stat_s  # rank 0 opens every shard file to check its size
    publish_s = manifest_bytes / (m.ost_gbps * GB) + 6 * m.fs_stat_s  # write, fsync, rename
    work = gather_s + review_s + files_s + publish_s
    notice = poll_interval(0.0) / 2 + poll_interval(work, R) * (R - 1) / R if R > 1 else 0.0
    return {
        "store_response_s": response,
        "store_load": load,
        "gather_s": gather_s,
        "review_s": review_s,
        "check_files_s": files_s,
        "publish_s": publish_s,
        "notice_s": notice,
        "commit_s": work + notice,
        "manifest_bytes": manifest_bytes,
        "report_bytes": report_bytes,
        "retention_s": R * m.fs_stat_s,
    }


def times_out(snap: dict, commit: dict) -> bool:
    """Whether rank 0 would claim the verdict only after the other ranks' deadlines (the
    default ``commit_timeout_s`` from their save()): they claim an abort first, every save
    fails. Rank 0 claims once it has gathered, reviewed and opened every file."""
    claim_s = snap["durable_s"] + commit["gather_s"] + commit["review_s"] + commit["check_files_s"]
    return claim_s > COMMIT_TIMEOUT_S


def overhead(s: Setting, snap: dict, commit: dict, every: int) -> float | None:
    """Fraction of training time lost at a checkpoint every ``every`` iterations: the stall,
    plus the wait of the next capture for cache slots still being written (one cache), plus
    the wait of the save after next for a commit still running (two saves in flight). None
    when the saves time out (:func:`times_out`)."""
    if times_out(snap, commit):
        return None
    cycle = every * s.iteration_s
    late_cache = max(0.0, snap["durable_s"] - cycle)
    late_commit = max(
        0.0, snap["durable_s"] + commit["commit_s"] + commit["retention_s"] - 2 * cycle
    )
    return (snap["stall_s"] + max(late_cache, late_commit)) / cycle


def baselines(s: Setting, c: Costs, persist_s: float) -> dict:
    """Stalls of the paper's two kinds of baseline, with the same inputs: a synchronous
    torch.save of each rank's shard (at torch.save's own rate, or the storage's if slower),
    and an asynchronous copy into freshly allocated host buffers before a background flush
    (CheckFreq / TorchSnapshot style)."""
    sync_s = max(s.written_per_rank / (c.torch_save_gbps / s.machine.cpu_factor * GB), persist_s)
    fresh = min(c.fresh_copy_gbps, s.machine.d2h_pageable_gbps)
    return {"sync_stall_s": sync_s, "async_copy_stall_s": s.written_per_rank / (fresh * GB)}


def evaluate(
    s: Setting, c: Costs, requests: tuple[float, float], every: list[int], cache_bytes: float | None
) -> dict:
    persist = persist_terms(s, c)
    snap = snapshot_terms(s, c, persist["persist_s"], cache_bytes)
    commit, base = commit_terms(s, c, requests), baselines(s, c, persist["persist_s"])
    out = {
        "setting": s.name,
        "ranks": s.ranks,
        "nodes": s.nodes,
        "machine": s.machine.name,
        "fs": s.machine.fs_name,
        "total_gb": s.total_bytes / GB,
        "per_rank_gb": s.written_per_rank / GB,
        "iteration_s": s.iteration_s,
        **snap,
        **persist,
        **commit,
        **base,
    }
    out["checkpoint_gbps"] = s.total_bytes / snap["stall_s"] / GB
    out["committed_s"] = snap["durable_s"] + commit["commit_s"]
    out["committed_gbps"] = s.total_bytes / out["committed_s"] / GB
    out["overhead"] = {k: overhead(s, snap, commit, k) for k in every}
    out["commit_over_two_iterations"] = (
        snap["durable_s"] + commit["commit_s"] + commit["retention_s"]
    ) > 2 * s.iteration_s
    out["times_out"] = times_out(snap, commit)
    for name in ("sync", "async_copy"):
        stall = base[f"{name}_stall_s"]
        out[f"{name}_gbps"] = s.total_bytes / stall / GB
        out[f"{name}_overhead"] = {k: stall / (k * s.iteration_s) for k in every}
    return out


# ---------------------------------------------------------------- what breaks

#: The reader's limits (datastates/format/codec.py): a manifest past SPLIT_BYTES is written as
#: a head and parts of at most MAX_MANIFEST_BYTES each, MAX_SPLIT_BYTES together.
MAX_MANIFEST_BYTES = 256 << 20
SPLIT_BYTES = 32 << 20
MAX_SPLIT_BYTES = 1 << 30
COMMIT_TIMEOUT_S = 300.0  #: CheckpointConfig.commit_timeout_s default


def dominant(row: dict) -> str:
    """The largest term of the time from save() to committed."""
    terms = {
        "save() call": row["save_call_s"],
        "file creates": row["create_s"],
        "device→host copy": row["d2h_s"],
        "replica digests": row["digest_s"],
        f"write ({row['write_bound']})": row["persist_s"],
        "rank 0 gathers reports": row["gather_s"],
        "rank 0 reviews reports": row["review_s"],
        "rank 0 opens every file": row["check_files_s"],
        "manifest write": row["publish_s"],
    }
    return max(terms, key=terms.get)


def breaks(row: dict, machine_mem: float) -> list[str]:
    """Limits the row crosses, in the order they are reached as the world grows."""
    out = []
    if row["commit_over_two_iterations"]:
        out.append("a checkpoint every iteration waits for the commit before last")
    if row["store_load"] >= 0.7:
        out.append(f"TCPStore {row['store_load']:.0%} busy with decision polls")
    if row["manifest_bytes"] > MAX_SPLIT_BYTES:
        out.append(
            f"manifest {row['manifest_bytes'] / 2**20:.0f} MiB > the reader's 1 GiB "
            "for a split manifest"
        )
    if row["times_out"]:
        out.append(
            f"rank 0 decides after commit_timeout_s ({COMMIT_TIMEOUT_S:.0f} s): every save fails"
        )
    if not row["overlaps_iteration"]:
        out.append("snapshot longer than fwd+bwd")
    if row["cache_bytes_per_node"] > machine_mem / 2:
        out.append("host cache > half the node's memory")
    return out


# ---------------------------------------------------------------- inputs


def load_costs(inputs: str | None, tensors_json: str | None) -> tuple[Costs, list[str]]:
    """The measured costs: ``inputs`` (scale_inputs.py's JSON) if given, else :data:`MEASURED`;
    per-tensor costs from ``tensors_json`` if given. Also says where each came from."""
    costs, sources = MEASURED, ["built-in constants (MEASURED)"]
    if inputs and os.path.exists(inputs):
        with open(inputs) as f:
            d = json.load(f)
        t, st, r0 = d["tensors"]["per_tensor_s"], d["store"], d["rank0"]
        costs = dataclasses.replace(
            costs,
            save_per_tensor_s=t["save"],
            commit_per_tensor_s=t["commit"],
            restore_per_tensor_s=t["restore"],
            rank0_fixed_s=r0["per_rank_fixed_s"],
            rank0_per_entry_s=r0["per_entry_s"],
            report_bytes_fixed=r0["report_bytes"]["per_rank"],
            report_bytes_per_entry=r0["report_bytes"]["per_entry"],
            manifest_bytes_fixed=r0["manifest_bytes"]["per_rank"],
            manifest_bytes_per_entry=r0["manifest_bytes"]["per_entry"],
            store_rtt_s=st["round_trip_s"],
            store_server_s=st["server_cpu_s_per_request"],
            store_value_gbps=st["value_gbps"],
        )
        sources = [
            f"{inputs} (measured {d.get('measured', '?')}"
            + (f"; rank 0's review {r0['measured']})" if "measured" in r0 else ")")
        ]
    if tensors_json:
        with open(tensors_json) as f:
            t = json.load(f)["per_tensor_s"]
        costs = dataclasses.replace(
            costs,
            save_per_tensor_s=t["save"],
            commit_per_tensor_s=t["commit"],
            restore_per_tensor_s=t["restore"],
        )
        sources.append(f"per-tensor costs from {tensors_json}")
    return costs, sources


def load_commit_scale(path: str) -> tuple[tuple[float, float], list[dict]]:
    """Rank 0's store requests per save as ``fixed + per_rank x ranks`` (least squares over the
    multi-rank rows of commit_scale.py's results), and the rows themselves."""
    with open(path) as f:
        rows = json.load(f)["rows"]
    pts = [(r["world"], r["rank0_requests"]) for r in rows if r["world"] > 1]
    n = len(pts)
    mx, my = sum(x for x, _ in pts) / n, sum(y for _, y in pts) / n
    slope = sum((x - mx) * (y - my) for x, y in pts) / sum((x - mx) ** 2 for x, _ in pts)
    return (my - slope * mx, slope), rows


# ---------------------------------------------------------------- validation


def validate(c: Costs, requests: tuple[float, float], rows: list[dict]) -> list[dict]:
    """Model vs measurement of commit_scale.py: its state has 8 replicated tensors, one
    per-rank tensor and an RNG state per rank (9 tensors; the RNG state's entries are in the
    fixed part of the review's cost, as in the probe), every rank a process of one 2-core VM,
    the store on loopback. The model knows nothing of the cores being shared."""
    out = []
    for r in rows:
        s = Setting("commit-scale", 0.0, 1, 1, r["world"], 9, 1.0, 0.0, DEV_VM)
        model = commit_terms(s, c, requests)
        out.append(
            {
                "world": r["world"],
                "measured_s": r["latency_s"],
                **model,
                "rank0_requests": r["rank0_requests"],
                "model_rank0_requests": requests[0] + requests[1] * r["world"],
            }
        )
    return out


# ---------------------------------------------------------------- command line


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--inputs", default="results/scale-model/inputs.json")
    parser.add_argument("--tensors-json", default=None)
    parser.add_argument("--commit-scale", default="results/commit-scale/results.json")
    parser.add_argument("--validate", action="store_true")
    parser.add_argument("--every", default="1,10", help="checkpoint every k iterations")
    parser.add_argument(
        "--host-cache-gib",
        type=float,
        default=None,
        help="host cache per rank (default: sized to the rank's state)",
    )
    parser.add_argument(
        "--cpu-factor",
        type=float,
        default=None,
        help="CPU time on the target core / here (default 1)",
    )
    parser.add_argument(
        "--store-server-us",
        type=float,
        default=None,
        help="TCPStore server time per request, instead of the measured one",
    )
    parser.add_argument(
        "--tensors-per-rank",
        type=int,
        default=None,
        help="tensors each rank saves, instead of each setting's own",
    )
    parser.add_argument(
        "--no-replica-check",
        action="store_true",
        help="CheckpointConfig(replica_check=False): no replica digests",
    )
    parser.add_argument(
        "--sweep",
        action="store_true",
        help="the 70B job at 256 to 8,192 ranks instead of the four settings",
    )
    parser.add_argument(
        "--dp",
        default=None,
        help="with --sweep: the data parallel sizes (64 ranks each), e.g. 116,120",
    )
    parser.add_argument("--out", default=None, help="write model.json here")
    args = parser.parse_args(argv)
    costs, sources = load_costs(args.inputs, args.tensors_json)
    if args.store_server_us is not None:
        costs = dataclasses.replace(costs, store_server_s=args.store_server_us * 1e-6)
        sources.append(f"store server time {args.store_server_us:g} us (given)")
    dps = tuple(int(x) for x in args.dp.split(",")) if args.dp else SWEEP_DP
    settings = sweep(dps) if args.sweep else SETTINGS
    if args.cpu_factor is not None:
        settings = [
            dataclasses.replace(
                s, machine=dataclasses.replace(s.machine, cpu_factor=args.cpu_factor)
            )
            for s in settings
        ]
        sources.append(f"cpu factor {args.cpu_factor:g} (given)")
    if args.no_replica_check:
        settings = [dataclasses.replace(s, replica_check=False) for s in settings]
        sources.append("replica check off (given)")
    if args.tensors_per_rank is not None:
        settings = [
            dataclasses.replace(s, tensors_per_rank=args.tensors_per_rank) for s in settings
        ]
        sources.append(f"{args.tensors_per_rank} tensors per rank (given)")
    requests, measured = load_commit_scale(args.commit_scale)
    print(f"inputs: {'; '.join(sources)}; store requests from {args.commit_scale}")
    if args.validate:
        rows = validate(costs, requests, measured)
        print(scale_report.validation(rows))
    else:
        every = [int(k) for k in args.every.split(",")]
        cache = None if args.host_cache_gib is None else args.host_cache_gib * GiB
        rows = [evaluate(s, costs, requests, every, cache) for s in settings]
        for row, s in zip(rows, settings):
            row["dominant"], row["breaks"] = dominant(row), breaks(row, s.machine.host_mem_bytes)
        print(scale_report.sweep(rows) if args.sweep else scale_report.evaluation(rows))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        name = "validation.json" if args.validate else "sweep.json" if args.sweep else "model.json"
        with open(os.path.join(args.out, name), "w") as f:
            json.dump(
                {
                    "sources": sources,
                    "costs": dataclasses.asdict(costs),
                    "requests": requests,
                    "rows": rows,
                },
                f,
                indent=1,
                default=str,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""From raw samples to the numbers in the report: medians, min-max, pairwise ratios, fractions of limits.

Pure functions over the dictionaries produced by :mod:`benchmarks.phases` and
:mod:`benchmarks.limits` (no torch, no I/O), so they are unit-tested directly.

Conventions:
- throughputs are GB/s (1e9 B/s) of the *state's* bytes (identical for every method), not of the
  bytes a method happens to write (which are reported separately as ``disk_bytes``);
- ``vs_reference`` ratios are ``method / reference`` of a *time* within the same round, so a value
  above 1 means the method took that many times longer than the reference (datastates).
"""

from __future__ import annotations

from .common import GB, median_of, paired_ratios, safe_div, summarize


def _per_sample(samples: list[dict], fn) -> dict | None:
    return summarize(fn(s) for s in samples)


def _rate(nbytes: int, seconds: float | None) -> float | None:
    return safe_div(nbytes / GB, seconds)


def analyze_save(phase: dict, limits: dict, reference: str) -> dict:
    """Per-method summaries of a state phase's save rounds.

    ``frac_write_limit`` divides each save's committed throughput by the write probe of its own
    round when the phase has one (``round_write_gbps``), else by the run's disk write limit.
    """
    nbytes = phase["state"]["nbytes"]
    write_lim = median_of(limits.get("write"))
    copy_lim = median_of(limits.get("copy"))
    probes = phase.get("round_write_gbps") or []
    if len(probes) != len(phase["rounds"]):
        probes = [None] * len(phase["rounds"])
    out = {}
    for name in phase["methods"]:
        samples = [rnd[name] for rnd in phase["rounds"] if name in rnd]
        if not samples:
            continue
        # The disk's speed in the same round (probe), else the run's limit.
        lims = [p or write_lim for rnd, p in zip(phase["rounds"], probes) if name in rnd]
        held = phase["setup"].get(name, {}).get("held_rss", 0)
        last = samples[-1]
        out[name] = {
            "blocked_s": _per_sample(samples, lambda s: s["blocked_s"]),
            "snapshot_s": _per_sample(samples, lambda s: s["snapshot_s"]),
            "commit_s": _per_sample(samples, lambda s: s["commit_s"]),
            "checkpoint_gbps": _per_sample(samples, lambda s: _rate(nbytes, s["blocked_s"])),
            "snapshot_gbps": _per_sample(samples, lambda s: _rate(nbytes, s["snapshot_s"])),
            "committed_gbps": _per_sample(samples, lambda s: _rate(nbytes, s["commit_s"])),
            "frac_write_limit": summarize(
                safe_div(_rate(nbytes, s["commit_s"]), lim) for s, lim in zip(samples, lims)
            ),
            "frac_copy_limit": _per_sample(
                samples, lambda s: safe_div(_rate(nbytes, s["snapshot_s"]), copy_lim)
            ),
            "held_rss": held,
            "transient_rss": _per_sample(samples, lambda s: s["transient_rss"]),
            "peak_extra_rss": _per_sample(samples, lambda s: held + s["transient_rss"]),
            "files": last["files"],
            "disk_bytes": last["disk_bytes"],
            "first_save": phase["setup"].get(name, {}).get("first_save"),
            "vs_reference": {
                k: summarize(paired_ratios(phase["rounds"], k, name, reference))
                for k in ("blocked_s", "snapshot_s", "commit_s")
            },
        }
    return out


def analyze_load(phase: dict, limits: dict, reference: str) -> dict:
    nbytes = phase["state"]["nbytes"]
    cold_lim = median_of(limits.get("read") or limits.get("read_cold"))
    warm_lim = median_of(limits.get("read_warm"))
    copy_lim = median_of(limits.get("copy"))
    rounds = phase.get("load_rounds", [])
    names = sorted({n for rnd in rounds for n in rnd}, key=phase["methods"].index)
    out = {}
    for name in names:
        samples = [rnd[name] for rnd in rounds if name in rnd]
        out[name] = {
            "cold_s": _per_sample(samples, lambda s: s["cold_s"]),
            "warm_s": _per_sample(samples, lambda s: s["warm_s"]),
            "cold_gbps": _per_sample(samples, lambda s: _rate(nbytes, s["cold_s"])),
            "warm_gbps": _per_sample(samples, lambda s: _rate(nbytes, s["warm_s"])),
            "frac_cold_read": _per_sample(
                samples, lambda s: safe_div(_rate(nbytes, s["cold_s"]), cold_lim)
            ),
            "frac_warm_read": _per_sample(
                samples, lambda s: safe_div(_rate(nbytes, s["warm_s"]), warm_lim)
            ),
            "frac_warm_copy": _per_sample(
                samples, lambda s: safe_div(_rate(nbytes, s["warm_s"]), copy_lim)
            ),
            "cold_rss_extra": _per_sample(samples, lambda s: s["cold_rss_extra"]),
            "verified": all(s["verified"] for s in samples),
            "vs_reference": {
                k: summarize(paired_ratios(rounds, k, name, reference))
                for k in ("cold_s", "warm_s")
            },
        }
    return out


def _mean(xs: list[float]) -> float | None:
    return sum(xs) / len(xs) if xs else None


def analyze_e2e(e2e: dict, reference: str) -> dict:
    """Slowdown vs. the adjacent no-checkpoint loop, stall per checkpoint, ratios vs reference.

    A round holds ``"baseline:<id>"`` (a loop without checkpoints run right before that method's
    loops) and ``"<id>@<k>"`` entries.
    """
    rounds = e2e["rounds"]
    out: dict = {
        "baseline_s": summarize(
            v["total_s"] for r in rounds for key, v in r.items() if key.startswith("baseline")
        ),
        "methods": {},
    }
    order = {name: i for i, name in enumerate(e2e.get("methods", []))}
    keys = sorted(
        {k for r in rounds for k in r if "@" in k},
        key=lambda key: (order.get(key.rsplit("@", 1)[0], len(order)), int(key.rsplit("@", 1)[1])),
    )
    for key in keys:
        name, k = key.rsplit("@", 1)
        base_key = f"baseline:{name}"
        loops = [(r[key], r.get(base_key)) for r in rounds if key in r]

        def stall(loop, base):
            if base is None or not loop["n_ckpt"]:
                return None
            return (loop["total_s"] - base["total_s"]) / loop["n_ckpt"]

        def update_wait(loop, _base):
            a, b = _mean(loop["update_after_ckpt_s"]), _mean(loop["update_other_s"])
            return None if a is None or b is None else a - b

        totals = [lo["total_s"] for lo, _ in loops]
        bases = [b["total_s"] for _, b in loops if b is not None]
        save_call = summarize(_mean(lo["save_call_s"]) for lo, _ in loops)
        upd = summarize(update_wait(lo, b) for lo, b in loops)
        out["methods"].setdefault(name, {})[k] = {
            "total_s": summarize(totals),
            # Least-disturbed loops: robust to a busy neighbour, which only ever adds time.
            "slowdown_min": safe_div(min(totals), min(bases)) if bases else None,
            # Measured at the checkpoint itself: save() (with any wait for an earlier save) plus
            # the extra time of the next optimizer step. Misses CPU contention by background work.
            "direct_stall_s": (
                save_call["median"] + max(0.0, upd["median"] if upd else 0.0) if save_call else None
            ),
            "n_ckpt": loops[0][0]["n_ckpt"],
            "slowdown": summarize(paired_ratios(rounds, "total_s", key, base_key)),
            "stall_per_ckpt_s": summarize(stall(lo, b) for lo, b in loops),
            "save_call_s": save_call,
            "update_wait_s": upd,
            "vs_reference": summarize(paired_ratios(rounds, "total_s", key, f"{reference}@{k}")),
        }
    return out

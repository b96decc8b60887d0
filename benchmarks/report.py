"""results.json (machine-readable, with every raw sample) and report.md (tables + charts)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from .common import fmt_bytes, fmt_rate, fmt_s
from .limits import LIMIT_LABELS

SCHEMA = "datastates-bench/1"


def _clean(obj):
    """JSON-safe copy: NaN/inf become null, Paths and other objects become strings."""
    if isinstance(obj, dict):
        return {str(k): _clean(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_clean(v) for v in obj]
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if obj is None or isinstance(obj, (bool, int, str)):
        return obj
    return str(obj)


def write_json(results: dict, path: Path) -> None:
    path.write_text(json.dumps(_clean(results), indent=1, sort_keys=False) + "\n")


# ----------------------------------------------------------------------------------- formatting
def _span(summary: dict | None, fmt) -> str:
    if not summary:
        return "n/a"
    if summary["n"] == 1 or summary["min"] == summary["max"]:
        return fmt(summary["median"])
    return f"{fmt(summary['median'])} ({fmt(summary['min'])}–{fmt(summary['max'])})"


def _med(summary: dict | None, fmt) -> str:
    return "n/a" if not summary else fmt(summary["median"])


def _x(v: float) -> str:
    return f"{v:.2f}x"


def _pct(v: float) -> str:
    return f"{100 * v:.0f}%"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return lines + [""]


def _label(results: dict, name: str) -> str:
    return results["methods"].get(name, {}).get("label", name)


# ----------------------------------------------------------------------------------- sections
def _header(results: dict) -> list[str]:
    meta = results["meta"]
    lines = ["# datastates benchmark report", ""]
    if results.get("interrupted"):
        lines += ["**Interrupted: partial results.**", ""]
    lines += [
        f"- Date: {meta['started']} — duration {fmt_s(meta.get('duration_s'))}",
        f"- Command: `{meta['command']}`",
        f"- Preset: `{meta['preset']}`, rounds: {meta['reps']}, reference for ratios: "
        f"`{results['reference']}`",
        f"- Target directory: `{meta['dir']}` ({meta.get('filesystem', '?')})",
        f"- Machine: {meta['cpus']} CPUs, {fmt_bytes(meta['mem_total'])} RAM "
        f"({fmt_bytes(meta['mem_available_start'])} available at start); torch "
        f"{meta['torch']}, python {meta['python']}, datastates {meta['datastates']}",
        "",
    ]
    for note in results.get("notes", []):
        lines.append(f"> {note}")
    return lines + [""]


def _limits(results: dict) -> list[str]:
    lim = results.get("limits", {}).get("summary", {})
    names = {
        **LIMIT_LABELS,
        "write": "**disk write limit** (best write per round)",
        "read": "**cold read limit** (best cold read per round)",
        "copy": "**copy limit** (best copy per round)",
    }
    rows = [[names.get(k, k), _span(v, fmt_rate), str(v["n"])] for k, v in lim.items() if v]
    return [
        "## Physical limits (same run, same disk)",
        "",
        f"Files of {fmt_bytes(results['limits'].get('file_bytes'))}; GB/s = 1e9 B/s. Save "
        "results are compared with the disk write limit (best of buffered and O_DIRECT), "
        "snapshots with the in-memory copy limit, cold loads with the cold read limit.",
        "",
    ] + _table(["limit", "median (min–max)", "n"], rows)


def _checksums(results: dict) -> list[str]:
    rows = [
        [
            r["backend"],
            fmt_rate(r["gbps_1t"]),
            fmt_rate(r["gbps_2t"]),
            f"{r['gil_share']:.0%}",
            "yes" if r["in_use"] else "",
        ]
        for r in results.get("checksums") or []
    ]
    if not rows:
        return []
    return [
        "## CRC-32 backends (same values as zlib)",
        "",
        "GIL: speed of a Python loop on another thread while the backend checksums, relative "
        "to the loop alone (near 0% would mean the GIL is held).",
        "",
    ] + _table(
        [
            "backend",
            "1 thread",
            "2 threads at once",
            "GIL: other thread's speed",
            "used by datastates",
        ],
        rows,
    )


def _summary(results: dict) -> list[str]:
    """One row per method: the headline ratios vs the reference on the GPT state."""
    phase = results.get("phases", {}).get("gpt/full")
    if not phase or not phase.get("save"):
        return []
    e2e = ((results.get("e2e") or {}).get("summary") or {}).get("methods", {})
    ks = sorted({k for per in e2e.values() for k in per}, key=int)
    write_lim = (results["limits"].get("summary") or {}).get("write")
    rows = []
    for name, s in phase["save"].items():
        load = phase.get("load", {}).get(name)
        row = [
            _label(results, name),
            _med(s["blocked_s"], fmt_s),
            _med(s["vs_reference"]["blocked_s"], _x),
            _med(s["commit_s"], fmt_s),
            _med(s["vs_reference"]["commit_s"], _x),
            _med(s["frac_write_limit"], _pct),
            _med(load["cold_s"], fmt_s) if load else "–",
            _med(load["frac_cold_read"], _pct) if load else "–",
            _med(load["warm_s"], fmt_s) if load else "–",
            _med(load.get("frac_warm_copy"), _pct) if load else "–",
        ]
        row += [_med(e2e.get(name, {}).get(k, {}).get("slowdown"), _x) for k in ks]
        rows.append(row)
    return [
        "## Summary — GPT state",
        "",
        f"Medians over rounds; ×ref = time / datastates' time in the same round. Disk write "
        f"limit {_med(write_lim, fmt_rate)}.",
        "",
    ] + _table(
        [
            "method",
            "blocked",
            "×ref",
            "durable+committed",
            "×ref",
            "of disk write limit",
            "cold load",
            "of cold read limit",
            "warm load",
            "warm load, of copy limit",
        ]
        + [f"e2e slowdown, every {k}" for k in ks],
        rows,
    )


def _save_section(results: dict, key: str, phase: dict) -> list[str]:
    st = phase["raw"]["state"]
    lines = [
        f"## Save — `{key}`",
        "",
        f"{st['description']}: {fmt_bytes(st['nbytes'])} in {st['ntensors']} tensors.",
    ]
    probes = [p for p in phase["raw"].get("round_write_gbps", []) if p]
    if probes:
        lines.append(
            f"Disk write probe at the start of each round: "
            f"{', '.join(fmt_rate(p) for p in probes)}; *of disk write limit* compares "
            f"each save with the probe of its round."
        )
    lines.append("")
    rows = []
    for name, s in phase["save"].items():
        vs = s["vs_reference"]
        rows.append(
            [
                _label(results, name),
                _span(s["blocked_s"], fmt_s),
                _span(s["snapshot_s"], fmt_s),
                _span(s["commit_s"], fmt_s),
                _med(s["checkpoint_gbps"], fmt_rate),
                _med(s["committed_gbps"], fmt_rate),
                _med(s["frac_write_limit"], _pct),
                _med(s["frac_copy_limit"], _pct),
                f"{fmt_bytes(s['peak_extra_rss']['median'])} ({fmt_bytes(s['held_rss'])} held)",
                f"{s['files']} / {fmt_bytes(s['disk_bytes'])}",
                _span(vs["blocked_s"], _x),
                _span(vs["commit_s"], _x),
            ]
        )
    lines += _table(
        [
            "method",
            "blocked",
            "captured",
            "durable+committed",
            "ckpt GB/s (bytes/blocked)",
            "committed GB/s",
            "of disk write limit",
            "capture vs copy limit",
            "peak extra RSS",
            "files / on disk",
            "blocked ×ref",
            "committed ×ref",
        ],
        rows,
    )
    if phase["raw"].get("errors"):
        lines += [f"- `{m}` failed: {e}" for m, e in phase["raw"]["errors"].items()] + [""]
    return lines


def _load_section(results: dict, key: str, phase: dict) -> list[str]:
    if not phase.get("load"):
        return []
    rows = []
    for name, s in phase["load"].items():
        rows.append(
            [
                _label(results, name),
                _span(s["cold_s"], fmt_s),
                _span(s["warm_s"], fmt_s),
                _med(s["cold_gbps"], fmt_rate),
                _med(s["frac_cold_read"], _pct),
                _med(s["warm_gbps"], fmt_rate),
                _med(s.get("frac_warm_copy"), _pct),
                "yes" if s["verified"] else "**NO**",
                _span(s["vs_reference"]["cold_s"], _x),
            ]
        )
    return [
        f"### Load into the live state — `{key}`",
        "",
        "Cold: every checkpoint file dropped from the page cache first; warm: read once "
        "before. Verified: a fingerprint of every tensor matches after the load (the state is "
        "overwritten with a sentinel before each load).",
        "",
    ] + _table(
        [
            "method",
            "cold",
            "warm",
            "cold GB/s",
            "of cold read limit",
            "warm GB/s",
            "warm, of copy limit",
            "verified",
            "cold ×ref",
        ],
        rows,
    )


def _e2e_section(results: dict) -> list[str]:
    e2e = results.get("e2e")
    if not e2e:
        return []
    cfg, summ = e2e["raw"]["config"], e2e["summary"]
    lines = [
        "## End-to-end training",
        "",
        f"{cfg['model']} ({fmt_bytes(cfg['state_bytes'])} of state), batch "
        f"{cfg['batch_size']}x{cfg['block_size']}, {cfg['steps']} steps per loop, "
        f"{cfg['rounds']} round(s). Loop without checkpoints: "
        f"{_span(summ['baseline_s'], fmt_s)}. Every loop includes the optimizer step after "
        "each save and drains all saves before the clock stops.",
        "",
    ]
    rows = []
    for name, per_k in summ["methods"].items():
        for k, s in sorted(per_k.items(), key=lambda kv: int(kv[0])):
            rows.append(
                [
                    _label(results, name),
                    k,
                    str(s["n_ckpt"]),
                    _span(s["total_s"], fmt_s),
                    _span(s["slowdown"], _x),
                    "n/a" if s.get("slowdown_min") is None else _x(s["slowdown_min"]),
                    _med(s["stall_per_ckpt_s"], fmt_s),
                    fmt_s(s.get("direct_stall_s")),
                    _med(s["save_call_s"], fmt_s),
                    _med(s["update_wait_s"], fmt_s),
                    _span(s["vs_reference"], _x),
                ]
            )
    lines += _table(
        [
            "method",
            "every k",
            "ckpts",
            "total",
            "slowdown",
            "slowdown (min/min)",
            "stall / ckpt (from totals)",
            "direct stall / ckpt",
            "save() call (incl. wait for previous)",
            "extra wait in optimizer step",
            "total ×ref",
        ],
        rows,
    )
    if e2e["raw"].get("errors"):
        lines += [f"- `{m}` failed: {e}" for m, e in e2e["raw"]["errors"].items()] + [""]
    return lines


def _charts(results: dict) -> list[str]:
    ch = results.get("charts", {})
    lines = ["## Charts", ""]
    if ch.get("skipped"):
        return lines + [f"Charts skipped: {ch['skipped']}.", ""]
    return lines + [f"![{f}]({f})" for f in ch.get("files", [])] + [""]


def _methods(results: dict) -> list[str]:
    rows = []
    for name, m in results["methods"].items():
        status = "ran" if m.get("available") else f"not run: {m.get('reason')}"
        rows.append(
            [
                f"`{name}`",
                m.get("label", name),
                m.get("kind", ""),
                ", ".join(m.get("scopes", [])),
                status,
            ]
        )
    return ["## Methods", ""] + _table(["id", "method", "kind", "scopes", "status"], rows)


def _reading_notes() -> list[str]:
    return [
        "## How to read this",
        "",
        "- *blocked*: time the caller spends inside `save()`. *captured*: until the state no "
        "longer depends on the live tensors (lazy/async methods copy in the background). "
        "*durable+committed*: until every file is fsynced and the checkpoint is published.",
        "- Throughputs divide the state's bytes (the same for every method) by a time; "
        "`files / on disk` shows what each method actually wrote.",
        "- Peak extra RSS = memory kept between saves (host caches, stagers; measured at "
        "setup + first save) + the largest RSS rise during a save.",
        "- Rounds are interleaved (every method once per round, order rotated); `×ref` ratios "
        "are computed pair by pair within a round, method time / reference time: above 1 "
        "means slower than the reference.",
        "- End-to-end slowdown is loop time / time of the loop without checkpoints run right "
        "before it; *min/min* divides the fastest loop by the fastest baseline (robust to a "
        "busy neighbour, which only adds time). Stall / ckpt (from totals) = extra time / "
        "number of checkpoints, which includes CPU contention by background writers; the "
        "direct stall = time in `save()` (including waiting for an earlier save) + extra time "
        "of the optimizer step that follows, which does not.",
        "",
    ]


def render_markdown(results: dict) -> str:
    lines = _header(results) + _summary(results) + _limits(results) + _checksums(results)
    for key, phase in results.get("phases", {}).items():
        if phase.get("save"):
            lines += _save_section(results, key, phase)
        lines += _load_section(results, key, phase)
    lines += _e2e_section(results) + _charts(results) + _methods(results) + _reading_notes()
    skipped = results.get("skipped", [])
    if skipped:
        lines += ["## Skipped", ""] + [f"- {s}" for s in skipped] + [""]
    return "\n".join(lines)


def write_markdown(results: dict, path: Path) -> None:
    path.write_text(render_markdown(results))

"""Markdown tables of the scale model's rows (benchmarks/scale_model.py), as docs/scale.md shows
them: one table per question (what stalls, what persists and commits, what it costs end to end,
what dominates and what breaks), so a rerun of the model can replace them as they are.

Pure formatting: rows in (the dicts ``scale_model.evaluate`` and ``scale_model.validate``
return), text out.
"""

from __future__ import annotations


def seconds(x: float) -> str:
    """A duration for a table: ms below one second, s above."""
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s" if x < 100 else f"{x:,.0f} s"


def _table(header: list[str], lines: list[list[str]]) -> str:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(cells) + " |" for cells in lines]
    return "\n".join(out)


def snapshot_table(rows: list[dict]) -> str:
    return _table(
        [
            "setting",
            "ranks",
            "GB per rank",
            "save() call",
            "file create",
            "D2H copy",
            "replica digests (on the compute stream)",
            "in host memory",
            "overlaps fwd+bwd",
            "stall",
        ],
        [
            [
                r["setting"],
                f"{r['ranks']:,}",
                f"{r['per_rank_gb']:.2f}",
                seconds(r["save_call_s"]),
                seconds(r["create_s"]),
                seconds(r["d2h_s"]),
                f"{seconds(r['digest_s'])} ({seconds(r['digest_on_compute_stream_s'])})",
                seconds(r["in_host_memory_s"]),
                "yes" if r["overlaps_iteration"] else "**no**",
                seconds(r["stall_s"]),
            ]
            for r in rows
        ],
    )


def commit_table(rows: list[dict]) -> str:
    return _table(
        [
            "setting",
            "persist (bound)",
            "gather reports",
            "review",
            "open every file",
            "manifest",
            "commit latency",
            "store busy",
            "committed after save()",
        ],
        [
            [
                r["setting"],
                f"{seconds(r['persist_s'])} ({r['write_bound']})",
                seconds(r["gather_s"]),
                seconds(r["review_s"]),
                seconds(r["check_files_s"]),
                f"{r['manifest_bytes'] / 2**20:,.0f} MiB",
                seconds(r["commit_s"]),
                f"{r['store_load']:.0%}",
                seconds(r["committed_s"]),
            ]
            for r in rows
        ],
    )


def _overheads(values: dict, fmt: str) -> str:
    return " / ".join("fails" if v is None else format(v, fmt) for v in values.values())


def cost_table(rows: list[dict]) -> str:
    ks = " / ".join(str(k) for k in rows[0]["overhead"])
    return _table(
        [
            "setting",
            "checkpoint GB/s (size / stall)",
            "committed GB/s",
            f"overhead, every {ks} it.",
            "sync torch.save: stall, GB/s",
            f"overhead, every {ks}",
            "async copy: stall, GB/s",
            f"overhead, every {ks}",
        ],
        [
            [
                r["setting"],
                f"{r['checkpoint_gbps']:,.0f}",
                f"{r['committed_gbps']:,.0f}",
                _overheads(r["overhead"], ".2%"),
                f"{seconds(r['sync_stall_s'])}, {r['sync_gbps']:,.0f}",
                _overheads(r["sync_overhead"], ".1%"),
                f"{seconds(r['async_copy_stall_s'])}, {r['async_copy_gbps']:,.0f}",
                _overheads(r["async_copy_overhead"], ".1%"),
            ]
            for r in rows
        ],
    )


def limits_table(rows: list[dict]) -> str:
    return _table(
        ["setting", "dominant term (save() to committed)", "limits crossed"],
        [[r["setting"], r["dominant"], "; ".join(r["breaks"]) or "none"] for r in rows],
    )


def evaluation(rows: list[dict]) -> str:
    return "\n\n".join(t(rows) for t in (snapshot_table, commit_table, cost_table, limits_table))


def validation(rows: list[dict]) -> str:
    return _table(
        [
            "ranks",
            "measured",
            "model",
            "model / measured",
            "gather",
            "review",
            "publish",
            "notice",
            "rank 0 requests: measured / fit",
        ],
        [
            [
                str(r["world"]),
                seconds(r["measured_s"]),
                seconds(r["commit_s"]),
                f"{r['commit_s'] / r['measured_s']:.2f}",
                seconds(r["gather_s"]),
                seconds(r["review_s"]),
                seconds(r["publish_s"]),
                seconds(r["notice_s"]),
                f"{r['rank0_requests']:.1f} / {r['model_rank0_requests']:.1f}",
            ]
            for r in rows
        ],
    )


def sweep(rows: list[dict]) -> str:
    """One line per world size: where the time goes and which limits are crossed (the
    overhead at the first checkpoint interval asked for)."""
    every = next(iter(rows[0]["overhead"]))
    return _table(
        [
            "ranks",
            "file system",
            "persist",
            "gather",
            "review",
            "commit latency",
            "store busy",
            "manifest",
            f"overhead, every {every} it.",
            "limits crossed",
        ],
        [
            [
                f"{r['ranks']:,}",
                r["fs"],
                seconds(r["persist_s"]),
                seconds(r["gather_s"]),
                seconds(r["review_s"]),
                seconds(r["commit_s"]),
                f"{r['store_load']:.0%}",
                f"{r['manifest_bytes'] / 2**20:,.0f} MiB",
                _overheads({every: r["overhead"][every]}, ".2%"),
                "; ".join(r["breaks"]) or "none",
            ]
            for r in rows
        ],
    )

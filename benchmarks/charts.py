"""PNG charts of the results (matplotlib, Agg backend).

``draw_all`` returns the written file names, or raises :class:`ChartsUnavailable` when matplotlib
cannot be imported, in which case the run still writes report.md and results.json.
Bars are medians; error bars span min..max over the rounds.
"""

from __future__ import annotations

from pathlib import Path


class ChartsUnavailable(RuntimeError):
    pass


def _pyplot():
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as e:  # noqa: BLE001 - any import problem means no charts
        raise ChartsUnavailable(f"matplotlib not available ({type(e).__name__}: {e})") from e
    return plt


def _err(summary: dict | None) -> tuple[float, float, float]:
    if not summary:
        return 0.0, 0.0, 0.0
    m = summary["median"]
    return m, m - summary["min"], summary["max"] - m


def _hbar_groups(
    ax,
    groups: dict[str, dict[str, dict | None]],
    xlabel: str,
    order: list[str],
    log: bool = False,
    limit: float | None = None,
    limit_label: str = "",
) -> None:
    """Horizontal bars: one row per method (in ``order``), one colour per group (a state, a k)."""
    present = {m for series in groups.values() for m, v in series.items() if v}
    methods = [m for m in order if m in present] + sorted(present - set(order))
    n = max(1, len(groups))
    height = 0.8 / n
    for gi, (gname, series) in enumerate(groups.items()):
        ys, vals, lo, hi = [], [], [], []
        for mi, m in enumerate(methods):
            if series.get(m) is None:
                continue
            v, a, b = _err(series[m])
            ys.append(mi + gi * height - 0.4 + height / 2)
            vals.append(v)
            lo.append(a)
            hi.append(b)
        ax.barh(ys, vals, height=height, xerr=[lo, hi], label=gname, capsize=2)
    ax.set_yticks(range(len(methods)))
    ax.set_yticklabels(methods)
    ax.invert_yaxis()
    ax.set_xlabel(xlabel)
    if log:
        ax.set_xscale("log")
    if limit:
        ax.axvline(limit, color="k", linestyle="--", linewidth=1, label=limit_label)
    ax.grid(axis="x", alpha=0.3)
    ax.legend(
        fontsize=8,
        loc="upper center",
        bbox_to_anchor=(0.5, -0.08 - 0.3 / max(4, len(methods))),
        ncol=min(3, len(groups) + (1 if limit else 0)),
        frameon=False,
    )


def draw_all(results: dict, out: Path) -> list[str]:
    plt = _pyplot()
    files: list[str] = []
    phases = {k: v for k, v in results.get("phases", {}).items() if v.get("save")}
    limits = results.get("limits", {}).get("summary", {})
    order = list(results.get("methods", {}))

    def save_fig(fig, name: str) -> None:
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        files.append(name)

    e2e = (results.get("e2e") or {}).get("summary")
    if phases:
        stall_groups = {}
        if e2e and e2e.get("methods"):
            ks = sorted({k for per in e2e["methods"].values() for k in per}, key=int)
            stall_groups = {
                f"every {k} steps": {
                    m: per.get(k, {}).get("stall_per_ckpt_s") for m, per in e2e["methods"].items()
                }
                for k in ks
            }
        ncols = 3 if stall_groups else 2
        fig, axes = plt.subplots(1, ncols, figsize=(6.5 * ncols, 0.45 * _rows(phases) + 2.5))
        _hbar_groups(
            axes[0],
            {
                f"{k} blocked": {m: s["blocked_s"] for m, s in v["save"].items()}
                for k, v in phases.items()
            },
            "caller blocked per save (s, log)",
            order,
            log=True,
        )
        _hbar_groups(
            axes[1],
            {
                f"{k} snapshot": {m: s["snapshot_s"] for m, s in v["save"].items()}
                for k, v in phases.items()
            },
            "time until captured (s, log)",
            order,
            log=True,
        )
        if stall_groups:
            _hbar_groups(
                axes[2], stall_groups, "training stall per checkpoint, end to end (s)", order
            )
        fig.suptitle("Stall per checkpoint (save micro-benchmark; end-to-end loop)")
        save_fig(fig, "stall.png")

        fig, ax = plt.subplots(figsize=(9, 0.45 * _rows(phases) + 2.5))
        write = limits.get("write")
        _hbar_groups(
            ax,
            {k: {m: s["committed_gbps"] for m, s in v["save"].items()} for k, v in phases.items()},
            "committed throughput (GB/s of state)",
            order,
            limit=write["median"] if write else None,
            limit_label="disk write limit",
        )
        ax.set_title("Save until durable and committed")
        save_fig(fig, "committed_throughput.png")

    if e2e and e2e.get("methods"):
        ks = sorted({k for per in e2e["methods"].values() for k in per}, key=int)
        groups = {
            f"every {k} steps": {
                m: per.get(k, {}).get("slowdown") for m, per in e2e["methods"].items()
            }
            for k in ks
        }
        fig, ax = plt.subplots(figsize=(9, 0.5 * len(e2e["methods"]) * max(1, len(ks)) / 2 + 2.5))
        _hbar_groups(
            ax,
            groups,
            "training time / time without checkpoints",
            order,
            limit=1.0,
            limit_label="no checkpoint",
        )
        ax.set_title("End-to-end slowdown")
        save_fig(fig, "e2e_slowdown.png")

    loads = {k: v["load"] for k, v in results.get("phases", {}).items() if v.get("load")}
    if loads:
        rows = len({m for per in loads.values() for m in per})
        fig, axes = plt.subplots(1, 2, figsize=(13, 0.35 * rows * len(loads) + 2.5))
        for ax, temp, lim in ((axes[0], "cold", "read_cold"), (axes[1], "warm", "read_warm")):
            _hbar_groups(
                ax,
                {k: {m: s[f"{temp}_gbps"] for m, s in per.items()} for k, per in loads.items()},
                f"{temp} load into the live state (GB/s)",
                order,
                limit=(limits.get(lim) or {}).get("median"),
                limit_label=f"{temp} read limit",
            )
        fig.suptitle("Restore in place (cold: files dropped from the page cache)")
        save_fig(fig, "load_throughput.png")
    return files


def _rows(phases: dict) -> int:
    return max(len(v["save"]) for v in phases.values()) * max(1, len(phases)) // 2 + 1

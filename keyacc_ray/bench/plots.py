"""PNG plots of a side-by-side report (matplotlib, no display needed)."""
from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_report(report: dict, out_dir: str | Path, title: str = "") -> list[Path]:
    plt = _plt()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    runs, plan = report["runs"], report["plan"]
    files = []

    def per_level(key, fname, ylabel, slo=None, extra=None):
        fig, ax = plt.subplots(figsize=(6.4, 4.2))
        for pol, levels in runs.items():
            xs = sorted(levels, key=int)
            ax.plot([int(x) for x in xs], [levels[x][key] for x in xs], marker="o", label=pol)
        if slo is not None:
            ax.axhline(slo, color="red", linestyle="--", linewidth=1, label="objective")
        if extra:
            extra(ax)
        ax.set_xlabel("concurrent clients (closed loop)")
        ax.set_ylabel(ylabel)
        ax.set_title(f"{title}: {ylabel} vs concurrency" if title else fname)
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out / fname, dpi=110)
        plt.close(fig)
        files.append(out / fname)

    def cpu_line(ax):
        if report.get("cpu_alone"):
            ax.axhline(report["cpu_alone"]["output_tok_per_s"], color="gray", linestyle=":", label="CPU pool alone")

    per_level("output_tok_per_s", "throughput.png", "output tokens/s", extra=cpu_line)
    per_level("tpot_p99_ms", "tpot_p99.png", "p99 TPOT (ms)", slo=plan["tpot_slo_ms"])
    per_level("ttft_p99_ms", "ttft_p99.png", "p99 TTFT (ms)", slo=plan["ttft_slo_ms"])
    tl = report.get("timeline")
    if tl and tl.get("t"):
        fig, axes = plt.subplots(3, 1, figsize=(7.5, 7.5), sharex=True)
        for pool, ys in sorted(tl["queue"].items()):
            axes[0].plot(tl["t"], ys, label=f"{pool} queued")
        for pool, ys in sorted(tl["running"].items()):
            axes[0].plot(tl["t"], ys, linestyle="--", label=f"{pool} running")
        axes[0].set_ylabel("sequences")
        for way, ys in sorted(tl["moves"].items()):
            axes[1].step(tl["t"], ys, where="post", label=way)
        axes[1].set_ylabel("moves / interval")
        for pool, ys in sorted(tl["tokens_per_s"].items()):
            axes[2].plot(tl["t"], ys, label=pool)
        axes[2].set_ylabel("tokens/s")
        axes[2].set_xlabel("seconds into the run")
        for ax in axes:
            ax.grid(alpha=0.3)
            if ax.get_legend_handles_labels()[0]:
                ax.legend(fontsize=8)
        axes[0].set_title(f"timeline: {tl['policy']} at c={tl['concurrency']}")
        fig.tight_layout()
        fig.savefig(out / "timeline.png", dpi=110)
        plt.close(fig)
        files.append(out / "timeline.png")
    return files

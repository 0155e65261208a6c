"""``--plot``: one PNG comparing configurations (throughput, TTFT, tokens by source)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from kvoffload.benchmark.throughput import ConfigSummary
from kvoffload.errors import ConfigError
from kvoffload.metrics import SOURCES

__all__ = ["plot_comparison"]

_SOURCE_LABELS = {
    "computed": "computed",
    "device": "device prefix cache",
    "host": "host tier",
    "disk": "disk tier",
    "remote": "remote tier",
}


def plot_comparison(summaries: Sequence[ConfigSummary], path: str | Path, title: str = "") -> None:
    """Write a PNG with three panels: requests/s (median, bars from min to max of the repeats),
    TTFT mean / median / p99, and admitted tokens by source, stacked."""
    try:
        import matplotlib
    except ImportError:
        raise ConfigError("plot", "needs matplotlib: pip install 'kvoffload[plot]'") from None

    matplotlib.use("Agg")  # files only, never a window
    import matplotlib.pyplot as plt

    labels = [c.label for c in summaries]
    x = range(len(summaries))
    fig, (ax_tput, ax_ttft, ax_src) = plt.subplots(1, 3, figsize=(15, 4.8))

    med = [c.median("requests_per_s") for c in summaries]
    lo = [m - c.spread("requests_per_s")[0] for m, c in zip(med, summaries, strict=True)]
    hi = [c.spread("requests_per_s")[1] - m for m, c in zip(med, summaries, strict=True)]
    ax_tput.bar(x, med, yerr=[lo, hi], capsize=6, color="tab:blue")
    ax_tput.set_title("Throughput (median, min-max of repeats)")
    ax_tput.set_ylabel("requests/s")

    width = 0.27
    for i, (stat, color) in enumerate(
        (("mean", "tab:orange"), ("median", "tab:green"), ("p99", "tab:red"))
    ):
        ax_ttft.bar(
            [k + (i - 1) * width for k in x],
            [c.median(f"{stat}_ttft_ms") / 1000 for c in summaries],
            width,
            label=stat,
            color=color,
        )
    ax_ttft.set_title("Time to first token")
    ax_ttft.set_ylabel("seconds")
    ax_ttft.legend()

    bottom = [0.0] * len(summaries)
    for source in SOURCES:
        heights = [c.median(f"tokens_{source}") for c in summaries]
        if not any(heights):
            continue
        ax_src.bar(x, heights, bottom=bottom, label=_SOURCE_LABELS[source])
        bottom = [b + h for b, h in zip(bottom, heights, strict=True)]
    ax_src.set_title("Admitted tokens by source")
    ax_src.set_ylabel("tokens")
    ax_src.set_ylim(0, max(bottom, default=0) * 1.3 or 1)  # room for the legend above the bars
    ax_src.legend(loc="upper left", ncol=3, fontsize="small")

    for ax in (ax_tput, ax_ttft, ax_src):
        ax.set_xticks(list(x), labels, rotation=12)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    try:
        fig.savefig(path, format="png", dpi=90)
    except OSError as exc:
        raise ConfigError("plot", f"cannot write {str(path)!r}: {exc.strerror or exc}") from exc
    finally:
        plt.close(fig)

"""What ``kvoffload bench trace`` prints and draws from a replay's result
(:func:`kvoffload.benchmark.trace_replay.replay_trace`): a table per trace, and hit rate against
capacity. A capacity the warm-up never fills shows ``-``."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from kvoffload.benchmark.hit_rate import gap_closed

__all__ = ["format_trace", "plot_traces"]

_WIDTH = 10
_TITLES = {
    "token_hit_rate": "token-weighted prefix-hit rate (hit tokens / input tokens)",
    "block_hit_ratio": "block-level prefix-hit ratio (hit blocks / blocks)",
}


def _cell(value: float | None, fmt: str) -> str:
    if value is None or math.isnan(value):
        return f"{'-':>{_WIDTH}}"
    return f"{value:>{_WIDTH}{fmt}}"


def _row(label: str, values: Sequence[float | None], fmt: str = ".4f", extra: str = "") -> str:
    return f"{label:<22}" + "".join(_cell(v, fmt) for v in values) + extra


def format_trace(name: str, result: dict[str, Any], metric: str, gib: Sequence[float] = ()) -> str:
    """The tables of one trace, ``metric`` (``token_hit_rate`` or ``block_hit_ratio``) in its
    main rows; ``gib``: each capacity's size in GiB, shown under it when given."""
    capacities = result["capacities"]
    lines = [
        f"trace {name}: {result['requests']} requests, {result['blocks']} blocks, "
        f"{result['distinct_blocks']} distinct",
    ]
    if result["warmup_requests"]:
        lines.append(
            f"warm-up: the first {result['warmup_requests']} requests "
            f"({result['warmup_distinct_blocks']} distinct blocks) are replayed, not scored; "
            "'-': a capacity the warm-up never fills (not scored)"
        )
    lines += [
        _TITLES[metric],
        "",
        f"{'policy':<22}" + "".join(f"{c:>{_WIDTH}}" for c in capacities) + "   replay s",
    ]
    if gib:
        lines.append(f"{'  (GiB)':<22}" + "".join(f"{g:>{_WIDTH}.4g}" for g in gib))
    if "infinite" in result:
        lines.append(_row("infinite (reference)", [result["infinite"]] * len(capacities)))
        lines.append(_row("belady (reference)", result["belady"]))
    for policy, row in result["policies"].items():
        lines.append(_row(policy, row, extra=f"{result['replay_s'][policy]:>11.1f}"))
    base = result["policies"].get("lru")
    if base is not None:
        lines += ["", "ratio to lru"]
        for policy, row in result["policies"].items():
            lines.append(
                _row(policy, [_ratio(r, b) for r, b in zip(row, base, strict=True)], ".2f")
            )
        if "belady" in result:
            lines += ["", "share of the LRU -> Belady gap closed"]
            for policy, row in result["policies"].items():
                shares = [
                    None if r is None else gap_closed(r, b, o)
                    for r, b, o in zip(row, base, result["belady"], strict=True)
                ]
                lines.append(_row(policy, shares, ".2f"))
    return "\n".join(lines)


def _ratio(value: float | None, base: float | None) -> float | None:
    if value is None or base is None:
        return None
    return value / base if base else math.nan


def plot_traces(
    results: dict[str, dict[str, Any]], path: str, metric: str, gib: Sequence[float] = ()
) -> None:
    """Hit rate against capacity (in GiB when ``gib`` is given), one panel per trace, one line
    per policy and reference; unscored capacities are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def nan(row: Sequence[float | None]) -> list[float]:
        return [math.nan if v is None else v for v in row]

    n = len(results)
    cols = min(3, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.8 * rows), squeeze=False)
    for ax, (name, result) in zip(axes.flat, results.items(), strict=False):
        xs = list(gib) or result["capacities"]
        if "infinite" in result:
            ax.plot(xs, [result["infinite"]] * len(xs), "k--", label="infinite")
            ax.plot(xs, nan(result["belady"]), "k:", marker="x", label="belady")
        for policy, row in result["policies"].items():
            ax.plot(xs, nan(row), marker="o", label=policy)
        ax.set_xscale("log")
        ax.set_title(name)
        ax.set_xlabel("tier capacity (GiB)" if gib else "tier capacity (blocks)")
        ax.set_ylabel(_TITLES[metric].split(" (")[0])
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)

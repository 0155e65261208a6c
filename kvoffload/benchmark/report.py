"""What ``bench throughput`` prints and writes: each run's summary lines, the configurations
side by side with their throughput ratios and what their spread allows one to conclude, and the
``--output-json`` payload. Every number is read from :class:`ThroughputResult` /
:class:`ConfigSummary` (plots: :mod:`kvoffload.benchmark.plot`)."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from kvoffload.benchmark.throughput import (
    WIDE_SPREAD,
    ConfigSummary,
    ThroughputResult,
    throughput_ratios,
)
from kvoffload.errors import ConfigError

__all__ = ["COMPARED", "format_comparison", "format_result", "json_payload", "write_json"]

_MIB = 2**20
#: A tier's failure causes, in words.
_CAUSES = {"full": "no space left", "io": "I/O error", "timeout": "timed out"}

#: Figures compared across configurations: (key, row name in the table, format).
COMPARED = (
    ("requests_per_s", "requests/s", "{:.3f}"),
    ("total_tokens_per_s", "total tokens/s", "{:.1f}"),
    ("output_tokens_per_s", "output tokens/s", "{:.1f}"),
    ("elapsed_s", "elapsed s", "{:.2f}"),
    ("mean_ttft_ms", "mean TTFT ms", "{:.0f}"),
    ("median_ttft_ms", "median TTFT ms", "{:.0f}"),
    ("p99_ttft_ms", "p99 TTFT ms", "{:.0f}"),
    ("mean_itl_ms", "mean ITL ms", "{:.1f}"),
    ("median_itl_ms", "median ITL ms", "{:.1f}"),
    ("p99_itl_ms", "p99 ITL ms", "{:.1f}"),
    ("prefix_cache_hit_rate_pct", "prefix cache hit rate %", "{:.1f}"),
    ("external_hit_rate_pct", "external hit rate %", "{:.1f}"),
    ("tokens_computed", "tokens computed", "{:.0f}"),
    ("tokens_device", "tokens from device cache", "{:.0f}"),
    ("tokens_host", "tokens from host tier", "{:.0f}"),
    ("tokens_disk", "tokens from disk tier", "{:.0f}"),
    ("tokens_remote", "tokens from remote tier", "{:.0f}"),
    ("preemptions", "preemptions", "{:.0f}"),
)


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "n/a"


def format_result(r: ThroughputResult) -> str:
    """vLLM's three summary lines, then latencies, where tokens came from, and what offloading
    moved, per tier; every number read from :meth:`ThroughputResult.figures` / ``stats``."""
    lines = _summary_lines(r)
    s = r.stats
    if "offload_load_jobs" in s:
        lines += _offload_lines(s)
    if "offload_tier_disk_stored_blocks" in s:
        lines += _disk_lines(s, r.disk_path)
    if "offload_tier_remote_stored_blocks" in s:
        lines.append(
            f"Remote tier: {int(s['offload_tier_remote_stored_blocks'])} blocks stored, "
            f"{int(s['offload_tier_remote_loaded_blocks'])} loaded "
            f"({int(s['offload_tier_remote_failed_load_blocks'])} failed, "
            f"{int(s['offload_tier_remote_vanished_blocks'])} vanished), "
            f"{int(s['offload_tier_remote_dropped_store_blocks'])} stores dropped, "
            f"{int(s['offload_tier_remote_lookups_sent'])} lookups sent"
        )
    return "\n".join(lines)


def _summary_lines(r: ThroughputResult) -> list[str]:
    f = r.figures()
    sources = r.tokens_by_source
    admitted = sum(sources.values())
    shown = [k for k, v in sources.items() if v or k in ("computed", "device", "host")]
    names = {"device": "device prefix cache", "host": "host tier", "disk": "disk tier"}
    external = (
        f", External prefix cache hit rate: {f['external_hit_rate_pct']:.1f}%"
        if "offload_load_jobs" in r.stats
        else ""
    )
    return [
        f"Throughput: {f['requests_per_s']:.2f} requests/s, {f['total_tokens_per_s']:.2f} total "
        f"tokens/s, {f['output_tokens_per_s']:.2f} output tokens/s",
        f"Total num prompt tokens:  {r.prompt_tokens}",
        f"Total num output tokens:  {r.output_tokens}",
        f"TTFT ms: mean {f['mean_ttft_ms']:.1f}, median {f['median_ttft_ms']:.1f}, "
        f"p99 {f['p99_ttft_ms']:.1f}; ITL ms: mean {f['mean_itl_ms']:.1f}, "
        f"median {f['median_itl_ms']:.1f}, p99 {f['p99_itl_ms']:.1f}",
        "Tokens by source: "
        + ", ".join(f"{sources[k]} {names.get(k, k)} ({_pct(sources[k], admitted)})" for k in shown)
        + f" of {admitted} admitted ({int(f['preemptions'])} preemptions)",
        f"Prefix cache hit rate: {f['prefix_cache_hit_rate_pct']:.1f}%{external}",
    ]


def _offload_lines(s: Mapping[str, float]) -> list[str]:
    return [
        f"Offloading: stored {int(s['offload_stored_blocks'])} blocks "
        f"({s['offload_store_bytes'] / _MIB:.1f} MiB) in {s['offload_store_seconds']:.2f} s, "
        f"loaded {int(s['offload_loaded_blocks'])} blocks "
        f"({s['offload_load_bytes'] / _MIB:.1f} MiB) in {s['offload_load_seconds']:.2f} s",
        f"Offloaded tier: {int(s['offload_tier_evicted_blocks'])} evictions, "
        f"{int(s['offload_failed_loads'])} failed loads, "
        f"{int(s['offload_failed_stores'])} failed stores, "
        f"{int(s['offload_rejected_stores'])} stores refused (tier full)",
    ]


def _disk_lines(s: Mapping[str, float], path: str | None) -> list[str]:
    """What the disk tier found at start (a warm restart: blocks an earlier run left in its
    directory), and what it wrote, failed to write (by cause) and gave back."""
    where = f" in {path}" if path else ""
    found = int(s.get("offload_tier_disk_scanned_blocks", 0))
    start = (
        f"Disk tier{where}: warm start, {found} blocks found on disk "
        f"(scan {int(s.get('offload_tier_disk_scan_ms', 0))} ms)"
        if found
        else f"Disk tier{where}: started empty"
    )
    failed = int(s.get("offload_tier_disk_failed_store_blocks", 0))
    prefix = "offload_tier_disk_failed_store_"
    causes = [
        f"{int(v)} {_CAUSES.get(key[len(prefix) :], key[len(prefix) :])}"
        for key, v in s.items()
        if key.startswith(prefix) and key != prefix + "blocks" and v
    ]
    return [
        start,
        f"Disk tier: {int(s['offload_tier_disk_stored_blocks'])} blocks written, "
        f"{failed} failed writes" + (f" ({', '.join(causes)})" if causes else "") + ", "
        f"{int(s['offload_tier_promoted_blocks'])} promoted to the host tier "
        f"({int(s['offload_tier_failed_promotion_blocks'])} failed, "
        f"{int(s['offload_tier_refused_promotion_blocks'])} refused), "
        f"{int(s['offload_tier_disk_evicted_blocks'])} evictions, "
        f"{int(s['offload_retries'])} deferred lookups",
    ]


def _cell(c: ConfigSummary, key: str, fmt: str) -> str:
    med = fmt.format(c.median(key))
    if len(c.runs) == 1:
        return med
    lo, hi = (fmt.format(v) for v in c.spread(key))
    return med if lo == hi else f"{med} [{lo}-{hi}]"


def format_comparison(summaries: Sequence[ConfigSummary]) -> str:
    """The configurations side by side (median [min-max] of their repeats), the throughput
    ratios against the first (no offloading) and the last (ideal), and what the spread allows
    one to conclude."""
    rows = [
        (key, name, fmt)
        for key, name, fmt in COMPARED
        if not key.startswith("tokens_")
        or key in ("tokens_computed", "tokens_device", "tokens_host")
        or any(c.median(key) for c in summaries)
    ]
    cells = [[_cell(c, key, fmt) for c in summaries] for key, _, fmt in rows]
    width = max(
        12, *(len(c.label) + 2 for c in summaries), *(len(x) + 2 for row in cells for x in row)
    )
    name_width = max(len(name) for _, name, _ in rows) + 2
    out = [f"{'':<{name_width}}" + "".join(f"{c.label:>{width}}" for c in summaries)]
    for (_, name, _), row in zip(rows, cells, strict=True):
        out.append(f"{name:<{name_width}}" + "".join(f"{x:>{width}}" for x in row))
    out.append("")
    ratios = throughput_ratios(summaries)
    base, ideal = summaries[0], summaries[-1]
    for i, c in enumerate(summaries[1:], start=1):
        line = f"{c.label}: {_ratio_text(ratios[(c.label, base.label)])} the throughput of {base.label}"
        if c is not ideal:
            line += f", {_ratio_text(ratios[(c.label, ideal.label)], pct=True)} of {ideal.label}"
            if i >= 2:
                prev = summaries[i - 1].label
                line += f", {_ratio_text(ratios[(c.label, prev)])} {prev}"
        out.append(line)
    if len(base.runs) == 1:
        out.append("One run per configuration: no spread to judge (use --repeats 3 or more).")
    key = "requests_per_s"
    for c in summaries:
        if c.is_wide(key):
            lo, hi = c.spread(key)
            out.append(
                f"Spread too wide to conclude: {c.label} ran at {lo:.3f}-{hi:.3f} requests/s "
                f"over {len(c.runs)} repeats (more than {100 * WIDE_SPREAD:.0f}% of its median); "
                "rerun on a quieter machine or with more --repeats."
            )
    for (label, other), r in ratios.items():
        if r["inconclusive"]:
            out.append(
                f"Cannot conclude whether {label} is faster than {other}: "
                f"the ratio ranges {r['min']:.2f}x-{r['max']:.2f}x over the repeats."
            )
    return "\n".join(out)


def _ratio_text(r: dict[str, Any], pct: bool = False) -> str:
    """``2.88x (range 2.10x-3.40x)``, or as a percentage; no range when min == max."""
    if pct:
        text, lo, hi = (
            f"{100 * r['median']:.1f}%",
            f"{100 * r['min']:.0f}",
            f"{100 * r['max']:.0f}%",
        )
    else:
        text, lo, hi = f"{r['median']:.2f}x", f"{r['min']:.2f}x", f"{r['max']:.2f}x"
    return text if r["min"] == r["max"] else f"{text} (range {lo}-{hi})"


def json_payload(
    args: Mapping[str, Any],
    workload: Sequence[str],
    summaries: Sequence[ConfigSummary],
    all_runs: Sequence[ThroughputResult],
    compared: bool,
    engine_a: ThroughputResult | None = None,
) -> dict[str, Any]:
    """What ``--output-json`` holds: the flags, the workload, each configuration's medians and
    spread (vLLM's keys), the throughput ratios (when compared) and every run."""
    payload: dict[str, Any] = {
        "args": dict(args),
        "workload": list(workload),
        "results": [c.to_dict() for c in summaries],
        "throughput_ratios": [
            {"config": label, "against": other, **ratio}
            for (label, other), ratio in throughput_ratios(summaries).items()
        ]
        if compared
        else [],
        "all_runs": [r.to_dict() for r in all_runs],
    }
    if engine_a is not None:
        payload["engine_a"] = engine_a.to_dict()
    return payload


def write_json(path: str | Path, payload: Mapping[str, Any]) -> None:
    """Write ``payload``; :class:`ConfigError` naming ``output_json`` when it cannot be."""
    try:
        Path(path).write_text(json.dumps(payload, indent=2, default=str))
    except OSError as exc:
        raise ConfigError(
            "output_json", f"cannot write {str(path)!r}: {exc.strerror or exc}"
        ) from exc

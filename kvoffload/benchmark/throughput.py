"""Offline throughput of the reference engine on a workload, with and without offloading.

A run's figures come from the engine's own statistics (:mod:`kvoffload.metrics.stats` defines
tokens by source and hit rates once) and from its requests' latencies. Repeats of a configuration
are summarised by their median and spread (min-max), never by the best run.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvoffload.benchmark.datasets import BenchRequest
from kvoffload.engine import Engine, RequestOutput, SamplingParams
from kvoffload.errors import ConfigError
from kvoffload.metrics import hit_rates, stats_delta, tokens_by_source

__all__ = [
    "WIDE_SPREAD",
    "ConfigSummary",
    "ThroughputResult",
    "format_comparison",
    "format_result",
    "run_throughput",
    "summarize",
    "throughput_ratios",
    "unlimited_device_blocks",
]

_MIB = 2**20
#: A figure whose repeats span more than this fraction of their median is too noisy to compare.
WIDE_SPREAD = 0.25

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


def _ms_summary(name: str, seconds: Sequence[float]) -> dict[str, float]:
    """vLLM ``bench serve``'s mean / median / p99, in milliseconds (0 when empty)."""
    if not seconds:
        return {f"mean_{name}_ms": 0.0, f"median_{name}_ms": 0.0, f"p99_{name}_ms": 0.0}
    ms = np.asarray(seconds, dtype=np.float64) * 1000
    return {
        f"mean_{name}_ms": float(ms.mean()),
        f"median_{name}_ms": float(np.median(ms)),
        f"p99_{name}_ms": float(np.percentile(ms, 99)),
    }


@dataclass
class ThroughputResult:
    """One run's figures. Token counts cover the measured requests only (not the warm-up);
    ``stats`` is what the engine counted during them (gauges: their value at the end)."""

    label: str
    repeat: int
    elapsed_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    num_device_blocks: int
    latencies: dict[str, float]
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def tokens_by_source(self) -> dict[str, int]:
        return tokens_by_source(self.stats)

    def figures(self) -> dict[str, float]:
        """Every number the summary shows, by name (the ``COMPARED`` keys and more)."""
        rates = hit_rates(self.stats)
        out: dict[str, float] = {
            "requests_per_s": self.num_requests / self.elapsed_s,
            "total_tokens_per_s": (self.prompt_tokens + self.output_tokens) / self.elapsed_s,
            "output_tokens_per_s": self.output_tokens / self.elapsed_s,
            "elapsed_s": self.elapsed_s,
            **self.latencies,
            "prefix_cache_hit_rate_pct": 100 * (rates["prefix_cache"] or 0.0),
            "external_hit_rate_pct": 100 * (rates["external"] or 0.0),
            "preemptions": self.stats.get("preemptions", 0),
        }
        for source, n in self.tokens_by_source.items():
            out[f"tokens_{source}"] = n
        return out

    def to_dict(self) -> dict[str, Any]:
        figures = self.figures()
        return {
            "label": self.label,
            "repeat": self.repeat,
            # vLLM bench throughput's keys
            "elapsed_time": self.elapsed_s,
            "num_requests": self.num_requests,
            "total_num_tokens": self.prompt_tokens + self.output_tokens,
            "requests_per_second": figures["requests_per_s"],
            "tokens_per_second": figures["total_tokens_per_s"],
            "prompt_tokens": self.prompt_tokens,
            "output_tokens": self.output_tokens,
            "num_device_blocks": self.num_device_blocks,
            **figures,
            "tokens_by_source": self.tokens_by_source,
            "stats": self.stats,
        }


def unlimited_device_blocks(requests: Sequence[BenchRequest], block_size: int) -> int:
    """Device blocks that hold every distinct prompt block plus every request's own tail, so
    that nothing is ever evicted (the "ideal" run)."""
    if block_size <= 0:
        raise ConfigError("block_size", f"must be a positive integer, got {block_size}")
    block_ids: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent id, tokens) -> id
    tails = 0
    for r in requests:
        full = len(r.prompt) // block_size
        parent = -1
        for b in range(full):
            parent = block_ids.setdefault(
                (parent, tuple(r.prompt[b * block_size : (b + 1) * block_size])), len(block_ids)
            )
        tails += -(-(len(r.prompt) - full * block_size + r.output_len) // block_size) + 1
    return len(block_ids) + tails


def _serve(
    engine: Engine,
    requests: Sequence[BenchRequest],
    params: list[SamplingParams],
    arrivals: Sequence[float] | None,
    bar: Any,
) -> list[RequestOutput]:
    """All requests at once (offline), or each at its arrival time (seconds from the start)."""
    if arrivals is None:
        return engine.generate([r.prompt for r in requests], params, progress=bar)
    start = time.perf_counter()
    ids: list[str] = []
    done: dict[str, RequestOutput] = {}
    nxt = 0
    while len(done) < len(requests):
        now = time.perf_counter() - start
        while nxt < len(requests) and arrivals[nxt] <= now:
            ids.append(engine.add_request(requests[nxt].prompt, params[nxt]))
            nxt += 1
        if not engine.has_unfinished() and nxt < len(requests):
            time.sleep(max(0.0, arrivals[nxt] - now))
            continue
        for out in engine.step():
            done[out.request_id] = out
            if bar is not None:
                bar.update(1)
    return [done[i] for i in ids]


def run_throughput(
    requests: Sequence[BenchRequest],
    label: str,
    engine_kwargs: dict[str, Any],
    progress: Callable[[int, str], Any] | None = None,
    repeat: int = 1,
    arrivals: Sequence[float] | None = None,
    on_phase: Callable[[str], Any] | None = None,
) -> ThroughputResult:
    """Build an engine, warm it up, run every request to completion and time it.

    ``progress(total, label)`` returns a tqdm-like bar (``update``, ``close``) or ``None``;
    ``on_phase(text)`` hears "loading model" and "warming up". ``arrivals``: seconds from the
    start at which each request arrives (default: all at once). The clock stops when the last
    request finishes; stores still in flight are then drained so that the statistics are
    complete.
    """
    if on_phase is not None:
        on_phase(f"{label}: loading model {engine_kwargs.get('model', 'small')}")
    with Engine(**engine_kwargs) as engine:
        vocab = engine.model_config.vocab_size
        # Warm up at full step size: torch's first large forward pass costs seconds (allocator
        # growth, kernel selection) that would otherwise land on whichever run comes first.
        if on_phase is not None:
            on_phase(f"{label}: warming up")
        longest = max(len(r.prompt) for r in requests)
        capacity = engine.num_device_blocks * engine.config.block_size // 2
        warm_len = max(1, min(engine.config.max_num_batched_tokens, longest, capacity - 2))
        warm = [[(7 * i + 3) % (vocab - 2) + 1 for i in range(warm_len)]]
        engine.generate(warm, SamplingParams(max_tokens=2, ignore_eos=True))
        engine.drain()
        before = engine.stats()
        params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True) for r in requests]
        bar = progress(len(requests), label) if progress is not None else None
        start = time.perf_counter()
        outputs = _serve(engine, requests, params, arrivals, bar)
        elapsed = time.perf_counter() - start
        if bar is not None:
            bar.close()
        engine.drain()
        stats = stats_delta(before, engine.stats())
        num_device_blocks = engine.num_device_blocks
    return ThroughputResult(
        label=label,
        repeat=repeat,
        elapsed_s=elapsed,
        num_requests=len(outputs),
        prompt_tokens=sum(o.num_prompt_tokens for o in outputs),
        output_tokens=sum(len(o.output_token_ids) for o in outputs),
        num_device_blocks=num_device_blocks,
        latencies={
            **_ms_summary("ttft", [o.ttft for o in outputs]),
            **_ms_summary("itl", [t for o in outputs for t in o.inter_token_latencies]),
        },
        stats=stats,
    )


def _pct(part: float, whole: float) -> str:
    return f"{100 * part / whole:.1f}%" if whole else "n/a"


def format_result(r: ThroughputResult) -> str:
    """vLLM's three summary lines, then latencies, where tokens came from, and what offloading
    moved; every number read from :meth:`ThroughputResult.figures` / ``stats``."""
    f, s = r.figures(), r.stats
    sources = r.tokens_by_source
    admitted = sum(sources.values())
    shown = [k for k, v in sources.items() if v or k in ("computed", "device", "host")]
    names = {"device": "device prefix cache", "host": "host tier", "disk": "disk tier"}
    lines = [
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
        f"Prefix cache hit rate: {f['prefix_cache_hit_rate_pct']:.1f}%"
        + (
            f", External prefix cache hit rate: {f['external_hit_rate_pct']:.1f}%"
            if "offload_load_jobs" in s
            else ""
        ),
    ]
    if "offload_load_jobs" in s:
        lines += [
            f"Offloading: stored {int(s['offload_stored_blocks'])} blocks "
            f"({s['offload_store_bytes'] / _MIB:.1f} MiB) in {s['offload_store_seconds']:.2f} s, "
            f"loaded {int(s['offload_loaded_blocks'])} blocks "
            f"({s['offload_load_bytes'] / _MIB:.1f} MiB) in {s['offload_load_seconds']:.2f} s",
            f"Offloaded tier: {int(s['offload_tier_evicted_blocks'])} evictions, "
            f"{int(s['offload_failed_loads'])} failed loads, "
            f"{int(s['offload_failed_stores'])} failed stores, "
            f"{int(s['offload_rejected_stores'])} stores refused (tier full)",
        ]
    if "offload_tier_disk_stored_blocks" in s:
        lines.append(
            f"Disk tier: {int(s['offload_tier_disk_stored_blocks'])} blocks written, "
            f"{int(s['offload_tier_promoted_blocks'])} promoted to the host tier "
            f"({int(s['offload_tier_failed_promotion_blocks'])} failed, "
            f"{int(s['offload_tier_refused_promotion_blocks'])} refused), "
            f"{int(s['offload_tier_disk_evicted_blocks'])} evictions, "
            f"{int(s['offload_retries'])} deferred lookups"
        )
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


@dataclass
class ConfigSummary:
    """One configuration over its interleaved repeats: median and spread of every figure."""

    label: str
    runs: list[ThroughputResult]

    def values(self, key: str) -> list[float]:
        return [r.figures()[key] for r in self.runs]

    def median(self, key: str) -> float:
        return float(statistics.median(self.values(key)))

    def spread(self, key: str) -> tuple[float, float]:
        values = self.values(key)
        return min(values), max(values)

    def is_wide(self, key: str) -> bool:
        lo, hi = self.spread(key)
        med = self.median(key)
        return med > 0 and (hi - lo) / med > WIDE_SPREAD

    def to_dict(self) -> dict[str, Any]:
        first = self.runs[0]
        keys = list(first.figures())
        medians = {k: self.median(k) for k in keys}
        return {
            "label": self.label,
            "repeats": len(self.runs),
            "elapsed_time": medians["elapsed_s"],
            "num_requests": first.num_requests,
            "total_num_tokens": first.prompt_tokens + first.output_tokens,
            "requests_per_second": medians["requests_per_s"],
            "tokens_per_second": medians["total_tokens_per_s"],
            "prompt_tokens": first.prompt_tokens,
            "output_tokens": first.output_tokens,
            "num_device_blocks": first.num_device_blocks,
            **medians,
            "spread": {k: list(self.spread(k)) for k in keys},
            "wide_spread": [k for k in keys if self.is_wide(k)],
        }


def summarize(results: Sequence[ThroughputResult]) -> list[ConfigSummary]:
    """Group runs by configuration, in order of first appearance."""
    by_label: dict[str, list[ThroughputResult]] = {}
    for r in results:
        by_label.setdefault(r.label, []).append(r)
    return [ConfigSummary(label, runs) for label, runs in by_label.items()]


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


def throughput_ratios(summaries: Sequence[ConfigSummary]) -> dict[tuple[str, str], dict[str, Any]]:
    """Requests/s of each configuration against the first (no offloading), of the middle ones
    against the last (ideal), and of each middle one after the first against the one before it
    (e.g. host + disk against host alone): ``(label, other) -> {median, min, max,
    inconclusive}``, where the range pairs the extremes of the repeats and ``inconclusive``
    means it includes 1."""
    key = "requests_per_s"
    base, ideal = summaries[0], summaries[-1]
    pairs = [(c, base) for c in summaries[1:]] + [(c, ideal) for c in summaries[1:-1]]
    pairs += [(summaries[i], summaries[i - 1]) for i in range(2, len(summaries) - 1)]
    out: dict[tuple[str, str], dict[str, Any]] = {}
    for c, other in pairs:
        (clo, chi), (olo, ohi) = c.spread(key), other.spread(key)
        lo, hi = clo / ohi, chi / olo
        out[(c.label, other.label)] = {
            "median": c.median(key) / other.median(key),
            "min": lo,
            "max": hi,
            "inconclusive": len(c.runs) > 1 and lo < 1 < hi,
        }
    return out


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

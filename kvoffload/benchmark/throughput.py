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
from kvoffload.metrics import hit_rates, stats_delta, tokens_by_source

__all__ = [
    "WIDE_SPREAD",
    "ConfigSummary",
    "ThroughputResult",
    "run_throughput",
    "summarize",
    "throughput_ratios",
]

#: A figure whose repeats span more than this fraction of their median is too noisy to compare.
WIDE_SPREAD = 0.25


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
    ``stats`` is what the engine counted during them (gauges: their value at the end);
    ``disk_path``: the disk tier's directory, if it had one."""

    label: str
    repeat: int
    elapsed_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    num_device_blocks: int
    latencies: dict[str, float]
    stats: dict[str, float] = field(default_factory=dict)
    disk_path: str | None = None

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
            "disk_path": self.disk_path,
        }


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
        if on_phase is not None:
            on_phase(f"{label}: warming up")
        _warm_up(engine, requests)
        before = engine.stats()
        params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True) for r in requests]
        bar = None
        try:
            bar = progress(len(requests), label) if progress is not None else None
            start = time.perf_counter()
            outputs = _serve(engine, requests, params, arrivals, bar)
            elapsed = time.perf_counter() - start
        finally:
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
        disk_path=engine_kwargs.get("kv_disk_path"),
    )


def _warm_up(engine: Engine, requests: Sequence[BenchRequest]) -> None:
    """One request at full step size: torch's first large forward pass costs seconds (allocator
    growth, kernel selection) that would otherwise land on whichever run comes first. Its stores
    are drained, and the engine's Prometheus series restart after it, so that ``/metrics``
    counts the measured requests only, as the summary does."""
    vocab = engine.model_config.vocab_size
    longest = max(len(r.prompt) for r in requests)
    capacity = engine.num_device_blocks * engine.config.block_size // 2
    warm_len = max(1, min(engine.config.max_num_batched_tokens, longest, capacity - 2))
    warm = [[(7 * i + 3) % (vocab - 2) + 1 for i in range(warm_len)]]
    engine.generate(warm, SamplingParams(max_tokens=2, ignore_eos=True))
    engine.drain()
    engine.metrics.reset()


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

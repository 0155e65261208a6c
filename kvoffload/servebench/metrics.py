"""The benchmark's figures, with ``vllm bench serve``'s definitions and JSON keys, and the
servers' prefix-hit rates by source (from their ``/metrics``).

Definitions (vLLM's ``calculate_metrics``): over successful requests, TPOT = (latency - TTFT) /
(output tokens - 1) for outputs of more than one token; ITL pools every request's gaps; a request
is good when every SLO of ``goodput`` (``ttft``, ``tpot``, ``e2el``; milliseconds) is at least
its value (TPOT of a one-token output counts as 0); throughputs divide by the run's wall
duration; ``max_output_tokens_per_s`` and ``max_concurrent_requests`` are the peaks over
one-second buckets from the first send (a token chunk counts once in its second, a request in
every second it was active). Only metrics named in ``percentile_metrics`` get their
``mean/median/std/p{P}_{metric}_ms`` keys; ``client_queue_time`` (and
``e2el_including_client_queue`` at a finite rate) exist only under a concurrency cap.
"""

from __future__ import annotations

import math
import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from kvoffload.servebench.client import RequestResult

__all__ = [
    "DETAILED_KEYS",
    "GOODPUT_METRICS",
    "PERCENTILE_METRICS",
    "hit_rates_by_source",
    "parse_goodput",
    "scrape_sources",
    "summarize",
]

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el", "client_queue_time",
                      "e2el_including_client_queue")
GOODPUT_METRICS = ("ttft", "tpot", "e2el")
#: Per-request arrays kept only with ``--save-detailed`` (as vLLM does).
DETAILED_KEYS = ("input_lens", "output_lens", "start_times", "ttfts", "itls", "generated_texts",
                 "errors")


def parse_goodput(pairs: Sequence[str]) -> dict[str, float]:
    """``["ttft:500", "tpot:50"]`` -> ``{"ttft": 500.0, "tpot": 50.0}`` (milliseconds);
    ValueError naming what is wrong."""
    out = {}
    for pair in pairs:
        name, sep, value = pair.partition(":")
        if not sep or name not in GOODPUT_METRICS:
            raise ValueError(f"give SLOs as KEY:MS with KEY one of {GOODPUT_METRICS}, got {pair!r}")
        try:
            ms = float(value)
        except ValueError:
            raise ValueError(f"{name}: {value!r} is not a number of milliseconds") from None
        if not ms >= 0 or math.isinf(ms):
            raise ValueError(f"{name}: the SLO must be a finite number >= 0, got {value}")
        out[name] = ms
    return out


def _peaks(ok: Sequence[RequestResult]) -> tuple[float, int]:
    """vLLM's ``max_output_tokens_per_s`` and ``max_concurrent_requests``."""
    if not ok:
        return 0.0, 0
    first = min(r.start_time for r in ok)
    seconds = math.ceil(max(r.start_time + r.latency for r in ok) - first) + 1
    tokens, active = np.zeros(seconds), np.zeros(seconds)
    for r in ok:
        at = r.start_time + r.ttft
        for t in (0.0, *r.itl):
            at += t
            tokens[int(at - first)] += 1
        active[int(r.start_time - first) : int(r.start_time + r.latency - first) + 1] += 1
    return float(tokens.max()), int(active.max())


def _is_good(r: RequestResult, tpot: float, slo_ms: Mapping[str, float]) -> bool:
    values = {"ttft": r.ttft, "tpot": tpot, "e2el": r.latency}
    return all(ms / 1000 >= values[name] for name, ms in slo_ms.items())


def summarize(
    results: Sequence[RequestResult],
    duration: float,
    percentiles: Sequence[float],
    percentile_metrics: Sequence[str] = ("ttft", "tpot", "itl", "e2el"),
    goodput: Mapping[str, float] | None = None,
    max_concurrency: int | None = None,
    request_rate: float = math.inf,
) -> dict[str, Any]:
    """vLLM's result keys (the per-request arrays of :data:`DETAILED_KEYS` included)."""
    ok = [r for r in results if r.success]
    tpots = [(r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1]
    good = sum(
        _is_good(r, (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0,
                 goodput)
        for r in ok
    ) if goodput else 0
    total_in = sum(r.prompt_len for r in ok)
    output_lens = [r.output_tokens if r.success else 0 for r in results]
    total_out = sum(output_lens)
    peak_tokens, peak_requests = _peaks(ok)
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "request_goodput": good / duration if goodput else None,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
        "input_lens": [r.prompt_len for r in results],
        "output_lens": output_lens,
        "ttfts": [r.ttft for r in results],
        "itls": [r.itl for r in results],
        "latencies": [r.latency for r in results],
        "start_times": [r.start_time for r in results],
        "queue_times": [r.queue_time for r in results],
        "generated_texts": [r.generated_text for r in results],
        "errors": [r.error for r in results],
        "max_output_tokens_per_s": peak_tokens,
        "max_concurrent_requests": peak_requests,
        "rtfx": 0.0,  # vLLM's inverse real-time factor of audio inputs: none here
    }
    series = {
        "ttft": [r.ttft for r in ok], "tpot": tpots, "itl": [g for r in ok for g in r.itl],
        "e2el": [r.latency for r in ok],
    }
    if max_concurrency is not None:
        series["client_queue_time"] = [r.queue_time for r in ok]
        if not math.isinf(request_rate):
            series["e2el_including_client_queue"] = [r.latency + r.queue_time for r in ok]
    for name in percentile_metrics:
        if name in series:
            out.update(_stats(name, series[name], percentiles))
    return out


def _stats(name: str, values: list[float], percentiles: Sequence[float]) -> dict[str, float]:
    arr = np.array(values or [0.0]) * 1000
    out = {f"mean_{name}_ms": float(arr.mean()), f"median_{name}_ms": float(np.median(arr)),
           f"std_{name}_ms": float(arr.std())}
    for p in percentiles:
        out[f"p{p:g}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def scrape_sources(urls: Sequence[str]) -> dict[str, float]:
    """``kvoffload_tokens_by_source_total`` summed over ``urls``. vLLM servers: their prompt
    tokens by source (``vllm:prompt_tokens_by_source_total``'s ``local_compute`` as ``computed``,
    ``vllm:prompt_tokens_cached_by_source_total``'s ``device``, ``host``, ``disk``, ...: an
    offloading connector's loads included), else, where a vLLM has no such series, its
    prefix-cache queries and hits as ``device`` / ``computed``."""
    totals: dict[str, float] = {}
    by_source: dict[str, float] = {}  # vLLM's prompt tokens by source, where it has them

    def add(into: dict[str, float], key: str, value: float) -> None:
        into[key] = into.get(key, 0.0) + value

    for url in urls:
        try:
            with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
                text = resp.read().decode()
        except OSError:
            continue
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "kvoffload_tokens_by_source_total":
                    add(totals, s.labels.get("source", "?"), s.value)
                elif s.name == "vllm:prefix_cache_queries_total":
                    add(totals, "_vllm_queries", s.value)
                elif s.name == "vllm:prefix_cache_hits_total":
                    add(totals, "device", s.value)
                elif s.name == "vllm:prompt_tokens_cached_by_source_total":
                    add(by_source, s.labels.get("source", "?"), s.value)
                elif (s.name == "vllm:prompt_tokens_by_source_total"
                      and s.labels.get("source") == "local_compute"):
                    add(by_source, "computed", s.value)
    if "_vllm_queries" in totals:
        queries = totals.pop("_vllm_queries")
        if "computed" in by_source:
            totals.update(by_source)
        else:
            totals["computed"] = queries - totals.get("device", 0.0)
    return totals


def hit_rates_by_source(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, Any]:
    """Tokens by source during the run and each source's share; ``prefix_hit_rate``: the share
    not computed."""
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    total = sum(delta.values())
    shares = {k: (v / total if total else 0.0) for k, v in delta.items()}
    return {
        "tokens_by_source": delta,
        "share_by_source": shares,
        "prefix_hit_rate": 1 - shares.get("computed", 0.0) if total else None,
    }

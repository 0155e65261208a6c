"""The benchmark's figures, with ``vllm bench serve``'s definitions and JSON keys, and the
servers' prefix-hit rates by source (from their ``/metrics``)."""

from __future__ import annotations

import urllib.request
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
from prometheus_client.parser import text_string_to_metric_families

from kvoffload.servebench.client import RequestResult

__all__ = ["hit_rates_by_source", "scrape_sources", "summarize"]

_METRICS = ("ttft", "tpot", "itl", "e2el")


def summarize(
    results: Sequence[RequestResult],
    duration: float,
    percentiles: Sequence[float],
    goodput_ttft_ms: float | None,
    peak_concurrency: int,
) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    values: dict[str, list[float]] = {m: [] for m in _METRICS}
    good = 0
    for r in ok:
        values["ttft"].append(r.ttft)
        values["e2el"].append(r.latency)
        values["itl"].extend(r.itl)
        tpot = (r.latency - r.ttft) / (r.output_tokens - 1) if r.output_tokens > 1 else 0.0
        if r.output_tokens > 1:
            values["tpot"].append(tpot)
        if goodput_ttft_ms is None or r.ttft * 1000 <= goodput_ttft_ms:
            good += 1
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    out: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration if duration else 0.0,
        "request_goodput": good / duration if duration and goodput_ttft_ms else None,
        "output_throughput": total_out / duration if duration else 0.0,
        "total_token_throughput": (total_in + total_out) / duration if duration else 0.0,
        "max_concurrent_requests": peak_concurrency,
        "errors": [r.error for r in results if not r.success][:20],
    }
    for name, series in values.items():
        arr = np.array(series or [0.0]) * 1000
        out[f"mean_{name}_ms"] = float(arr.mean())
        out[f"median_{name}_ms"] = float(np.median(arr))
        out[f"std_{name}_ms"] = float(arr.std())
        for p in percentiles:
            out[f"p{p:g}_{name}_ms"] = float(np.percentile(arr, p))
    return out


def scrape_sources(urls: Sequence[str]) -> dict[str, float]:
    """``kvoffload_tokens_by_source_total`` summed over ``urls`` (vLLM servers: its prefix-cache
    queries and hits as ``device`` / ``computed``)."""
    totals: dict[str, float] = {}
    for url in urls:
        try:
            with urllib.request.urlopen(f"{url}/metrics", timeout=30) as resp:
                text = resp.read().decode()
        except OSError:
            continue
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name == "kvoffload_tokens_by_source_total":
                    src = s.labels.get("source", "?")
                    totals[src] = totals.get(src, 0.0) + s.value
                elif s.name == "vllm:prefix_cache_queries_total":
                    totals["_vllm_queries"] = totals.get("_vllm_queries", 0.0) + s.value
                elif s.name == "vllm:prefix_cache_hits_total":
                    totals["device"] = totals.get("device", 0.0) + s.value
    if "_vllm_queries" in totals:
        totals["computed"] = totals.pop("_vllm_queries") - totals.get("device", 0.0)
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

"""One ``kvoffload bench serve`` run: build the workload, send it, print and return vLLM's
figures plus the servers' hit rates by source; and ``--compare-routing`` (see
:mod:`kvoffload.servebench.compare`)."""

from __future__ import annotations

import argparse
import asyncio
import datetime
import json
import math
import sys
import tempfile
import urllib.request
from pathlib import Path
from typing import Any

from kvoffload.benchmark import traces
from kvoffload.benchmark.datasets import BenchRequest
from kvoffload.benchmark.workload import workload_requests
from kvoffload.servebench.client import arrival_gaps, replay_gaps, run_requests
from kvoffload.servebench.metrics import (
    DETAILED_KEYS,
    hit_rates_by_source,
    parse_goodput,
    scrape_sources,
    summarize,
)

__all__ = ["build_requests", "initial_test", "progress_bar", "run_once"]


def build_requests(flags: argparse.Namespace) -> tuple[list[BenchRequest], list[str | None]]:
    """The workload of the resolved flags (bench throughput's workload table, so both commands
    build the same requests) and, per request, its session (multi-turn workloads: turns of one
    session share the ``x-session-id`` header)."""
    from kvoffload.engine.loader import load_model_config

    model = load_model_config(flags.model)
    if flags.dataset_name == "trace" and flags.generate is not None:
        reqs = _generated(flags, model.vocab_size, model.eos_token_id)
    else:
        reqs = workload_requests(flags, model.vocab_size, model.eos_token_id)
    if flags.dataset_name == "multi_turn":
        n = flags.multi_turn_num_sessions
        return reqs, [f"s{i % n}" for i in range(len(reqs))]
    limit = flags.max_prompt_len if flags.dataset_name == "trace" else None
    if limit:
        reqs = [BenchRequest(r.prompt[:limit], r.output_len, r.arrival_s) for r in reqs]
    return reqs, [None] * len(reqs)


def _generated(flags: argparse.Namespace, vocab: int, eos: int) -> list[BenchRequest]:
    """The generated suite's workload ``--generate``, written out and read back as
    ``--dataset-path`` (one path from hash ids to token ids for suite and file traces)."""

    records = traces.generate(flags.generate, flags.seed, flags.num_prompts)
    with tempfile.TemporaryDirectory(prefix="kvoffload-trace-") as tmp:
        path = Path(tmp) / f"{flags.generate}.jsonl"
        traces.write(records, path)
        return workload_requests(argparse.Namespace(**{**vars(flags), "dataset_path": path}),
                                 vocab, eos)


def _rate(args: argparse.Namespace) -> float:
    return math.inf if args.request_rate is None else args.request_rate


def metrics_urls(url: str) -> list[str]:
    """Where hit rates are read: the backends behind a kvoffload router, else ``url`` itself."""
    try:
        with urllib.request.urlopen(f"{url}/router/stats", timeout=10) as resp:
            return [b["url"] for b in json.loads(resp.read())["backends"]]
    except (OSError, ValueError, KeyError):
        return [url]


def initial_test(url: str, model: str) -> str | None:
    """vLLM's "initial test run": one short request (a one-token prompt, one output token,
    streamed as the workload's are) before anything is measured. ``None`` when it succeeded,
    else why it failed: the server's own error (an unknown model name, a missing API key) or
    why nothing answered. The prompt is shorter than a block: it leaves nothing in any cache."""
    (result,), _ = asyncio.run(run_requests(url, model, [BenchRequest([1], 1)], [0.0], None))
    return None if result.success else result.error


def progress_bar(total: int, args: argparse.Namespace, quiet: bool) -> Any:
    """A bar of requests done on stderr; ``None`` with ``--disable-tqdm`` or ``quiet``, and
    tqdm leaves it out where stderr is not a terminal."""
    if quiet or args.disable_tqdm:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="req", file=sys.stderr, disable=None)


def run_once(args: argparse.Namespace, url: str, quiet: bool = False) -> dict[str, Any]:
    """One run of the workload against ``url``: vLLM's result keys (per-request arrays only
    with ``--save-detailed``) plus the servers' tokens by source."""
    requests, sessions = build_requests(args)
    model = args.served_model_name or args.model
    if args.warmup_pass:  # unmeasured: before the metrics' first scrape
        asyncio.run(run_requests(url, model, requests, [0.0] * len(requests),
                                 args.max_concurrency, sessions))
    urls = metrics_urls(url)
    before = scrape_sources(urls)
    if args.honor_timestamps:
        gaps = replay_gaps([r.arrival_s for r in requests], args.timestamp_scale)
    else:
        gaps = arrival_gaps(len(requests), _rate(args), args.burstiness, args.seed)
    bar = progress_bar(len(requests), args, quiet)
    try:
        results, duration = asyncio.run(run_requests(
            url, model, requests, gaps, args.max_concurrency, sessions,
            on_done=None if bar is None else lambda: bar.update(1)))
    finally:
        if bar is not None:
            bar.close()
    after = scrape_sources(urls)
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    out: dict[str, Any] = {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": "openai",
        "backend": "openai",
        "label": args.label,
        "model_id": args.model,
        "tokenizer_id": args.model,
        "num_prompts": len(requests),
        "request_rate": "inf" if args.request_rate is None else args.request_rate,  # as vLLM
        "burstiness": args.burstiness,
        "max_concurrency": args.max_concurrency,
        **summarize(results, duration, percentiles, args.percentile_metrics.split(","),
                    parse_goodput(args.goodput or []), args.max_concurrency, _rate(args)),
        **hit_rates_by_source(before, after),
    }
    if not quiet:
        print_result(out, percentiles)
        failure = next((r.error for r in results if not r.success), None)
        if failure is not None:
            print(f"First failed request: {failure}")
    if not args.save_detailed:
        for key in DETAILED_KEYS:
            del out[key]
    return out


_TITLES = {
    "ttft": "Time to First Token", "tpot": "Time per Output Token (excl. 1st token)",
    "itl": "Inter-token Latency", "e2el": "End-to-end Latency",
    "client_queue_time": "Client Queue Time",
    "e2el_including_client_queue": "E2EL incl. Client Queue",
}


def print_result(r: dict[str, Any], percentiles: list[float]) -> None:
    print("{s:{c}^60}".format(s=" Serving Benchmark Result ", c="="))
    rows = [
        ("Successful requests:", r["completed"]), ("Failed requests:", r["failed"]),
        ("Maximum request concurrency:", r["max_concurrency"]),
        ("Request rate configured (RPS):", r["request_rate"]),
        ("Benchmark duration (s):", f"{r['duration']:.2f}"),
        ("Total input tokens:", r["total_input_tokens"]),
        ("Total generated tokens:", r["total_output_tokens"]),
        ("Request throughput (req/s):", f"{r['request_throughput']:.2f}"),
        ("Request goodput (req/s):", "n/a" if r["request_goodput"] is None
         else f"{r['request_goodput']:.2f}"),
        ("Output token throughput (tok/s):", f"{r['output_throughput']:.2f}"),
        ("Peak output token throughput (tok/s):", f"{r['max_output_tokens_per_s']:.2f}"),
        ("Peak concurrent requests:", r["max_concurrent_requests"]),
        ("Total token throughput (tok/s):", f"{r['total_token_throughput']:.2f}"),
    ]
    for label, value in rows:
        print(f"{label:<40}{value!s:>20}")
    for name, title in _TITLES.items():
        if f"mean_{name}_ms" not in r:  # not in --percentile-metrics
            continue
        label = name.upper() if len(name) <= 4 else title
        print("{s:{c}^60}".format(s=f" {title} ", c="-"))
        print(f"{'Mean ' + label + ' (ms):':<40}{r[f'mean_{name}_ms']:>20.2f}")
        print(f"{'Median ' + label + ' (ms):':<40}{r[f'median_{name}_ms']:>20.2f}")
        for p in percentiles:
            print(f"{f'P{p:g} {label} (ms):':<40}{r[f'p{p:g}_{name}_ms']:>20.2f}")
    print("{s:{c}^60}".format(s=" Prefix cache (servers' metrics) ", c="-"))
    rate = r["prefix_hit_rate"]
    print(f"{'Prefix hit rate:':<40}{'n/a' if rate is None else f'{rate:.1%}':>20}")
    for source, share in r["share_by_source"].items():
        print(f"{'  ' + source + ':':<40}{share:>20.1%}")
    print("=" * 60)

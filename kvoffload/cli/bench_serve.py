"""``kvoffload bench serve``: an online benchmark against one OpenAI-compatible URL, with ``vllm
bench serve``'s flags, metric definitions and JSON keys; ``--compare-routing N`` starts N
``kvoffload serve`` instances and one ``kvoffload route`` per policy and compares them."""

from __future__ import annotations

import argparse
import json
from typing import Any

from kvoffload.benchmark.traces import SUITE
from kvoffload.cli.args import check_output_path, int_in, real_in

__all__ = ["add_parser"]

SUITE_NAMES = tuple(sorted(SUITE))


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="online serving benchmark (like vllm bench serve)",
        description="Send a workload to an OpenAI-compatible server or router at Poisson "
        "arrivals and report vLLM's serving figures, plus the prefix-hit rate by source from the "
        "servers' /metrics. --compare-routing N compares routing policies over N fresh instances.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server or router URL")
    p.add_argument("--model", default="tiny", help="the served model (its vocabulary)")
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--dataset-name", default="prefix_repetition",
                   choices=("random", "prefix_repetition", "multi_turn", "trace"))
    p.add_argument("--dataset-path", default=None,
                   help="Mooncake-format trace, e.g. ../shared/traces/conversation_trace.jsonl")
    p.add_argument("--generate", default=None, choices=SUITE_NAMES, metavar="NAME",
                   help="--dataset-name trace: a workload of the generated trace suite instead "
                   f"of a file ({', '.join(SUITE_NAMES)}; as bench trace --generate)")
    p.add_argument("--num-prompts", type=int_in(1), default=64)
    p.add_argument("--request-rate", type=real_in(0, positive=True), default=float("inf"))
    p.add_argument("--burstiness", type=real_in(0, positive=True), default=1.0)
    p.add_argument("--max-concurrency", type=int_in(1), default=None)
    p.add_argument("--seed", type=int_in(0), default=0)
    p.add_argument("--random-input-len", type=int_in(1), default=256)
    p.add_argument("--random-output-len", type=int_in(1), default=16)
    p.add_argument("--prefix-repetition-prefix-len", type=int_in(1), default=256)
    p.add_argument("--prefix-repetition-suffix-len", type=int_in(0), default=16)
    p.add_argument("--prefix-repetition-num-prefixes", type=int_in(1), default=8)
    p.add_argument("--prefix-repetition-output-len", type=int_in(1), default=8)
    p.add_argument("--multi-turn-num-sessions", type=int_in(1), default=8)
    p.add_argument("--multi-turn-system-len", type=int_in(0), default=128)
    p.add_argument("--multi-turn-turn-len", type=int_in(1), default=32)
    p.add_argument("--output-len", type=int_in(1), default=None)
    p.add_argument("--trace-block-size", type=int_in(1), default=16,
                   help="tokens per trace hash id")
    p.add_argument("--max-prompt-len", type=int_in(1), default=None,
                   help="keep a trace prompt's first N tokens (fits small caches; prefixes "
                   "stay shared)")
    p.add_argument("--goodput", nargs="+", default=None, metavar="KEY:MS",
                   help="SLOs of a good request (ttft, tpot, e2el; milliseconds), as vLLM's")
    p.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                   help="metrics to report: ttft, tpot, itl, e2el, client_queue_time, "
                   "e2el_including_client_queue")
    p.add_argument("--metric-percentiles", default="50,90,99")
    p.add_argument("--save-detailed", action="store_true",
                   help="keep the per-request arrays (ttfts, itls, ...) in --output-json")
    p.add_argument("--label", default=None)
    p.add_argument("--output-json", default=None)
    p.add_argument("--plot", default=None, help="PNG of TTFT per configuration")
    p.add_argument("--compare-routing", type=int_in(1), default=None, metavar="N",
                   help="start N serve instances and one router per policy; compare")
    p.add_argument("--compare-routing-redis", action="store_true",
                   help="with --compare-routing: a shared Redis tier on every instance")
    p.add_argument("--num-device-blocks", type=int_in(1), default=64,
                   help="with --compare-routing: each instance's device cache")
    p.add_argument("--serve-args", default="--kv-offloading-size 0.05",
                   help="with --compare-routing: more flags for every serve instance")
    p.add_argument("--repeats", type=int_in(1), default=1)
    p.set_defaults(func=_run, parser=p)


def _run(args: argparse.Namespace) -> int:
    from kvoffload.errors import ConfigError

    try:
        if args.dataset_name == "trace" and (args.dataset_path is None) == (args.generate is None):
            raise ConfigError("dataset_path",
                              "--dataset-name trace needs --dataset-path or --generate (one)")
        if args.dataset_name != "trace" and (args.dataset_path or args.generate):
            raise ConfigError("dataset_name",
                              "--dataset-path and --generate need --dataset-name trace")
        _check_metrics(args)
        for setting in ("output_json", "plot"):
            if getattr(args, setting):
                check_output_path(setting, getattr(args, setting))
    except ConfigError as exc:
        args.parser.error(str(exc))
    if args.compare_routing:
        from kvoffload.servebench.compare import compare_routing

        result = compare_routing(args)
    else:
        from kvoffload.servebench.run import run_once

        result = run_once(args, args.base_url.rstrip("/"))
    if args.output_json:
        with open(args.output_json, "w") as f:
            json.dump(result, f, indent=1, default=str)
    if args.plot:
        _plot(result, args.plot)
    return 0 if not result.get("failed") else 1


def _check_metrics(args: argparse.Namespace) -> None:
    from kvoffload.errors import ConfigError
    from kvoffload.servebench.metrics import PERCENTILE_METRICS, parse_goodput

    unknown = set(args.percentile_metrics.split(",")) - set(PERCENTILE_METRICS)
    if unknown:
        raise ConfigError("percentile_metrics",
                          f"unknown {sorted(unknown)}; choose from {','.join(PERCENTILE_METRICS)}")
    try:
        percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    except ValueError:
        percentiles = []
    if not percentiles or not all(0 < p <= 100 for p in percentiles):
        raise ConfigError("metric_percentiles",
                          f"give percentiles in (0, 100] like 50,99; got {args.metric_percentiles!r}")
    try:
        parse_goodput(args.goodput or [])
    except ValueError as exc:
        raise ConfigError("goodput", str(exc)) from None


def _plot(result: dict[str, Any], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    configs = result.get("configs") or {"run": {"mean_ttft_ms": {"median": result["mean_ttft_ms"]},
                                                "prefix_hit_rate": {"median": result["prefix_hit_rate"] or 0}}}
    names = list(configs)
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    axes[0].bar(names, [configs[n]["mean_ttft_ms"]["median"] for n in names])
    axes[0].set_ylabel("mean TTFT (ms)")
    axes[1].bar(names, [configs[n].get("prefix_hit_rate", {}).get("median", 0) for n in names])
    axes[1].set_ylabel("prefix hit rate")
    for ax in axes:
        ax.tick_params(axis="x", rotation=45)
    fig.tight_layout()
    fig.savefig(path)

"""``kvoffload bench serve``: an online benchmark against one OpenAI-compatible URL, with ``vllm
bench serve``'s flags, metric definitions and JSON keys; ``--compare-routing N`` starts N
``kvoffload serve`` instances and one ``kvoffload route`` per policy and compares them;
``--dataset-name sessions`` runs closed-loop chat users (:mod:`kvoffload.servebench.sessions`);
``--compare-offloading`` one instance per offloading configuration
(:mod:`kvoffload.servebench.offloading`)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from typing import Any

from kvoffload.benchmark.traces import SUITE
from kvoffload.cli.args import check_output_path, int_in, real_in
from kvoffload.cli.command import command
from kvoffload.cli.flagspec import Flag, Needs, add_flags, help_section, resolve_flags
from kvoffload.cli.workload_flags import TRACE, WORKLOAD_FLAGS
from kvoffload.servebench.offloading import OFFLOADING_CONFIGS, OFFLOADING_SERVERS
from kvoffload.servebench.routing_configs import CONFIG_NAMES
from kvoffload.servebench.sessions import THINK_TIME_DISTS

__all__ = ["EXIT_INITIAL_TEST", "add_parser"]

#: The exit status when the initial test request fails (nothing was measured).
EXIT_INITIAL_TEST = 3

SUITE_NAMES = tuple(sorted(SUITE))


def _request_rate(text: str) -> float | None:
    """Requests per second, > 0; ``inf`` (``None``) sends every request at once, as vLLM's."""
    if text.strip().lower() in ("inf", "infinity"):
        return None
    return real_in(0, positive=True)(text)


_request_rate.bound = "> 0 or inf"  # type: ignore[attr-defined]  # the range --help states (Flag.help_text reads it)

def _config_names(text: str) -> tuple[str, ...]:
    """A comma list of --compare-routing configurations, each known, none twice."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in CONFIG_NAMES]
    if not names or unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"give distinct names of {', '.join(CONFIG_NAMES)}; got {text!r}")
    return names


_config_names.bound = "names, comma-separated"  # type: ignore[attr-defined]  # the range --help states (Flag.help_text reads it)


def _offloading_names(text: str) -> tuple[str, ...]:
    """A comma list of --compare-offloading configurations, each known, none twice."""
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in OFFLOADING_CONFIGS]
    if not names or unknown or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"give distinct names of {', '.join(OFFLOADING_CONFIGS)}; got {text!r}")
    return names


_offloading_names.bound = "names, comma-separated"  # type: ignore[attr-defined]

COMPARE = Needs("--compare-routing", lambda f, _: f.compare_routing is not None)
OFFLOADING = Needs("--compare-offloading", lambda f, _: bool(f.compare_offloading))
ANY_COMPARE = Needs("--compare-routing or --compare-offloading",
                    lambda f, _: f.compare_routing is not None or bool(f.compare_offloading))
SESSIONS = Needs("--dataset-name sessions", lambda f, _: f.dataset_name == "sessions")
#: The flags that mean nothing to the closed-loop sessions workload (refused with it).
NOT_FOR_SESSIONS = ("num_prompts", "output_len", "request_rate", "burstiness", "warmup_pass")
REDIS = Needs("--compare-routing-redis", lambda f, _: bool(f.compare_routing_redis))

#: bench serve's own flags (vLLM's names where vLLM has the flag); the workload's come from
#: ``workload_flags`` (bench throughput's table), --goodput is added on its own (vLLM's KEY:MS
#: list).
BENCH_SERVE_FLAGS: tuple[Flag, ...] = (
    Flag("base_url", "server or router URL", default="http://127.0.0.1:8000", unit="URL"),
    Flag("model", "the served model: a preset or checkpoint directory (its vocabulary)",
         default="tiny", unit="MODEL"),
    Flag("served_model_name", "the model name sent in requests", unit="NAME", unset="--model"),
    Flag("generate", "a workload of the generated trace suite instead of --dataset-path (as "
         "bench trace --generate)", choices=SUITE_NAMES, needs=TRACE, unset="none"),
    Flag("max_prompt_len", "keep a trace prompt's first N tokens (shared prefixes stay shared)",
         parse=int_in(1), unit="TOKENS", needs=TRACE, unset="all"),
    Flag("request_rate", "mean arrivals per second: Poisson arrivals (gamma with "
         "--burstiness); inf sends every request at once, as vLLM's default; --honor-timestamps "
         "replays the trace's instead", parse=_request_rate, unit="RPS",
         unset="inf: all at once"),
    Flag("burstiness", "gamma shape of the arrivals: 1 = Poisson", parse=real_in(0, positive=True),
         default=1.0, unit="X"),
    Flag("max_concurrency", "requests in flight at most", parse=int_in(1), unit="N",
         unset="no cap"),
    Flag("seed", "seed of the workload and the arrivals", parse=int_in(0), default=0, unit="N"),
    Flag("percentile_metrics", "metrics to report: ttft, tpot, itl, e2el, client_queue_time, "
         "e2el_including_client_queue", default="ttft,tpot,itl,e2el", unit="NAME,..."),
    Flag("metric_percentiles", "percentiles to report", default="50,90,99", unit="P,..."),
    Flag("warmup_pass", "send the workload once, unmeasured and all at once (up to "
         "--max-concurrency), before the measured run: the caches and tiers hold what it "
         "uses, so TTFT shows loads rather than first-use prefills", kind="switch"),
    Flag("save_detailed", "keep the per-request arrays (ttfts, itls, ...) in --output-json",
         kind="switch"),
    Flag("disable_tqdm", "no progress bar (there is none where stderr is not a terminal)",
         kind="switch"),
    Flag("label", "the run's label in the JSON", unit="TEXT", unset="none"),
    Flag("output_json", "write the results here", unit="FILE", unset="none"),
    Flag("plot", "plot mean TTFT and hit rate (per configuration)", unit="FILE.png",
         unset="none"),
    Flag("compare_routing", "start N serve instances and one router per policy; compare",
         parse=int_in(1), unit="N", unset="off"),
    Flag("compare_routing_redis", "a shared Redis tier on every instance", kind="switch",
         needs=COMPARE),
    Flag("compare_routing_redis_link", "each instance reaches the shared Redis over a link of its "
         "own carrying at most this many MB (10^6 bytes) per second each way (a proxy on "
         "loopback simulating a network)", parse=real_in(0, positive=True), unit="MB/S",
         needs=REDIS, unset="direct (loopback)"),
    Flag("num_device_blocks", "each instance's device cache", parse=int_in(1), default=64,
         unit="BLOCKS", needs=ANY_COMPARE),
    Flag("compare_routing_host_size", "each instance's host tier", parse=real_in(0), default=0.05,
         unit="GiB", needs=COMPARE),
    Flag("compare_routing_disk_size", "each instance's own disk tier (a fresh directory per run)",
         parse=real_in(0, positive=True), unit="GiB", needs=COMPARE, unset="no disk tier"),
    Flag("serve_args", "more flags for every serve instance", unit="FLAGS",
         needs=ANY_COMPARE, unset="none"),
    Flag("repeats", "interleaved repeats of every configuration", parse=int_in(1), default=1,
         unit="N", needs=ANY_COMPARE),
    Flag("compare_routing_configs", "the configurations to run (the order rotates by one each "
         "repeat): "
         + ", ".join(CONFIG_NAMES), parse=_config_names, unit="NAME,...", needs=COMPARE,
         unset="all"),
    Flag("compare_offloading", "start one serve instance per offloading configuration (no "
         "offloading, host, host + disk, host + Redis) and compare them", kind="switch"),
    Flag("compare_offloading_configs", "the configurations to run (the order rotates by one "
         "each repeat): " + ", ".join(OFFLOADING_CONFIGS), parse=_offloading_names,
         unit="NAME,...", needs=OFFLOADING, unset="all"),
    Flag("compare_offloading_host_size", "the host tier of every configuration but "
         "no_offloading", parse=real_in(0, positive=True), default=0.05, unit="GiB",
         needs=OFFLOADING),
    Flag("compare_offloading_disk_size", "host_disk's disk tier (a fresh directory per run)",
         parse=real_in(0, positive=True), default=0.2, unit="GiB", needs=OFFLOADING),
    Flag("compare_offloading_server", "the server each configuration starts: kvoffload serve, "
         "or vllm serve with KVOffloadSpec (--model: a checkpoint directory; --serve-args: "
         "vllm serve's flags)", choices=OFFLOADING_SERVERS, default="kvoffload",
         needs=OFFLOADING),
    Flag("compare_offloading_vllm", "the vllm executable of --compare-offloading-server vllm",
         unit="PATH", needs=OFFLOADING,
         unset="beside this Python, on PATH, or .venv-vllm/bin/vllm"),
)

#: The sessions workload's flags (closed-loop chat users; vLLM's multi-turn names where it has
#: them).
SESSIONS_FLAGS: tuple[Flag, ...] = (
    Flag("sessions_num_users", "users, each holding one conversation", parse=int_in(1),
         default=8, unit="N", needs=SESSIONS),
    Flag("sessions_num_rounds", "turns of each conversation", parse=int_in(1), default=4,
         unit="N", needs=SESSIONS),
    Flag("sessions_system_prompt_len", "tokens of the system prompt every user shares",
         parse=int_in(0), default=512, unit="TOKENS", needs=SESSIONS),
    Flag("sessions_user_context_len", "tokens of each user's own context (its first message)",
         parse=int_in(0), default=1024, unit="TOKENS", needs=SESSIONS),
    Flag("sessions_question_len", "tokens of each question", parse=int_in(1), default=64,
         unit="TOKENS", needs=SESSIONS),
    Flag("sessions_answer_len", "max_tokens of every answer (ignore_eos: exactly this many)",
         parse=int_in(1), default=64, unit="TOKENS", needs=SESSIONS),
    Flag("sessions_think_time", "mean seconds a user waits after an answer before its next "
         "turn", parse=real_in(0), default=1.0, unit="SECONDS", needs=SESSIONS),
    Flag("sessions_think_time_dist", "the think time's distribution (drawn per user from "
         "--seed)", choices=THINK_TIME_DISTS, default="exponential", needs=SESSIONS),
)


#: ``--help``'s sections of bench serve's flags, by what they need (else by setting, else
#: "benchmark").
_NEEDS_SECTIONS = {TRACE: "workload", COMPARE: "compare routing", REDIS: "compare routing",
                   OFFLOADING: "compare offloading", ANY_COMPARE: "compare routing or offloading"}
_SECTIONS = {"compare_routing": "compare routing", "compare_offloading": "compare offloading"}


def _sectioned(flag: Flag) -> Flag:
    section = _NEEDS_SECTIONS.get(flag.needs) if flag.needs is not None else None
    return dataclasses.replace(flag, section=section or _SECTIONS.get(flag.dest))


def add_parser(sub: Any) -> None:
    p = sub.add_parser(
        "serve",
        help="online serving benchmark (like vllm bench serve)",
        description="Send a workload to an OpenAI-compatible server or router and report vLLM's "
        "serving figures, plus the prefix-hit rate by source from the servers' /metrics. Every "
        "request is sent at once by default, as vLLM's (--request-rate inf); --request-rate R "
        "sends them at Poisson arrivals of R per second (--burstiness: gamma arrivals). First a "
        "one-token test request (vLLM's initial test run): when it fails, the server's error is "
        "printed and nothing is measured. --dataset-name sessions runs closed-loop chat users "
        "instead (TTFT per round). --compare-routing N compares routing policies over N fresh "
        "instances; --compare-offloading compares offloading configurations. Exit status: 0 "
        "every request succeeded, 1 some failed, 2 a flag or setting was refused, 3 the initial "
        "test request failed.",
    )
    add_flags(p, tuple(  # bench throughput's workloads, plus sessions (online only)
        dataclasses.replace(f, choices=(*f.choices, "sessions"))  # type: ignore[misc]
        if f.dest == "dataset_name" else f for f in WORKLOAD_FLAGS), section="workload")
    add_flags(p, tuple(map(_sectioned, BENCH_SERVE_FLAGS)), section="benchmark")
    add_flags(p, SESSIONS_FLAGS, section="sessions workload (--dataset-name sessions)")
    help_section(p, "benchmark").add_argument("--goodput", nargs="+", metavar="KEY:MS",
                   help="SLOs of a good request (ttft, tpot, e2el; milliseconds), as vLLM's "
                   "(default: none)")
    p.set_defaults(func=_run, parser=p)


@command
def _run(args: argparse.Namespace) -> int:
    from kvoffload.benchmark.trace_file import check_trace_path
    from kvoffload.errors import ConfigError

    given = {name for name in NOT_FOR_SESSIONS if getattr(args, name) not in (None, False)}
    args = resolve_flags(args)
    if args.dataset_name == "sessions" and given:
        raise ConfigError(sorted(given)[0], "--dataset-name sessions is a closed loop of "
                          "--sessions-num-users x --sessions-num-rounds turns: it takes no "
                          + ", ".join("--" + g.replace("_", "-") for g in sorted(given)))
    if args.compare_routing and args.compare_offloading:
        raise ConfigError("compare_offloading", "give --compare-routing or --compare-offloading, "
                          "not both")
    if args.compare_routing and args.dataset_name == "sessions":
        raise ConfigError("compare_routing", "--compare-routing runs open-loop workloads; with "
                          "--dataset-name sessions use --compare-offloading or --base-url")
    if args.compare_offloading and args.compare_offloading_server == "vllm":
        from kvoffload.servebench.vllm_offloading import kv_bytes_per_token, vllm_executable

        kv_bytes_per_token(args.model)
        vllm_executable(args.compare_offloading_vllm)
    if args.dataset_name == "trace" and (args.dataset_path is None) == (args.generate is None):
        raise ConfigError("dataset_path",
                          "--dataset-name trace needs --dataset-path or --generate (one)")
    if args.dataset_path is not None:
        check_trace_path(args.dataset_path)
    _check_metrics(args)
    for setting in ("output_json", "plot"):
        if getattr(args, setting):
            check_output_path(setting, getattr(args, setting))
    from kvoffload.servebench.run import initial_test, run_once
    from kvoffload.servebench.sessions import run_sessions

    run = run_sessions if args.dataset_name == "sessions" else run_once
    if not (args.compare_routing or args.compare_offloading):
        failure = initial_test(args.base_url.rstrip("/"), args.served_model_name or args.model)
        if failure is not None:
            print(f"{args.parser.prog}: the initial test request to {args.base_url} failed: "
                  f"{failure}", file=sys.stderr, flush=True)
            return EXIT_INITIAL_TEST
    if args.compare_routing:
        from kvoffload.servebench.compare import compare_routing

        result = compare_routing(args)
    elif args.compare_offloading:
        from kvoffload.servebench.offloading import compare_offloading

        result = compare_offloading(args, lambda a, url: run(a, url, quiet=True))
    else:
        result = run(args, args.base_url.rstrip("/"))
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

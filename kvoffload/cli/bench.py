"""``kvoffload bench throughput``: flags modelled on ``vllm bench throughput``; ``bench trace`` is
in :mod:`kvoffload.cli.trace`."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from kvoffload.cli.args import check_output_path, int_in, real_in

__all__ = ["add_parser"]

# The main job's workload (`make bench`): long shared prefixes that do not fit the device cache
# but fit the host tier, requests shuffled so that the device cache alone keeps missing.
#: ``kv_remote_url`` of --instances 2's runs while checking, before the server is started.
_PLACEHOLDER_URL = "redis://127.0.0.1:6379/0"

DEFAULTS: dict[str, Any] = {
    "model": "small",
    "num_prompts": 64,
    "dataset_name": "prefix_repetition",
    "prefix_repetition_prefix_len": 2048,
    "prefix_repetition_suffix_len": 32,
    "prefix_repetition_num_prefixes": 8,
    "prefix_repetition_output_len": 16,
    "random_input_len": 1024,
    "random_output_len": 128,
    "output_len": 16,  # multi_turn; a cap for traces only when given
    "num_device_blocks": 600,  # 9,600 tokens: about 4 of the 8 prefixes
    "max_num_seqs": 8,
    "kv_offloading_size": 1.0,  # GiB: every prefix fits
}


def add_parser(subparsers: Any) -> None:
    from kvoffload.eviction import available_eviction_policies
    from kvoffload.scheduler.policy import STORE_POLICIES

    bench = subparsers.add_parser("bench", help="benchmarks of the reference engine")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    p = sub.add_parser(
        "throughput",
        help="offline throughput with and without KV offloading",
        description="Offline throughput of the reference engine. --compare runs the same workload without "
        "offloading, with offloading, and with an unlimited device cache, side by side; --repeats N "
        "interleaves N runs of each and reports medians with their spread. --instances 2 measures "
        "a second engine on the prefixes a first one stored in a shared Redis.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument(
        "--model",
        default=DEFAULTS["model"],
        help="preset (tiny, small) or a local HF checkpoint dir",
    )
    p.add_argument("--device", default="cpu", help="torch device")
    p.add_argument(
        "--dtype",
        default=None,
        choices=("float32", "bfloat16", "float16"),
        help="by device when unset",
    )
    p.add_argument(
        "--seed", type=int_in(0, 2**64 - 1), default=0, help="model weights and dataset seed"
    )
    p.add_argument(
        "--num-prompts", type=int_in(1), default=DEFAULTS["num_prompts"], help="requests to run"
    )
    p.add_argument(
        "--dataset-name",
        choices=("random", "prefix_repetition", "multi_turn", "trace"),
        default=DEFAULTS["dataset_name"],
        help="workload",
    )
    p.add_argument(
        "--dataset-path", default=None, help="Mooncake-format JSONL trace (--dataset-name trace)"
    )
    p.add_argument(
        "--trace-block-size",
        type=int_in(1),
        default=16,
        help="tokens each 512-token trace hash block becomes",
    )
    p.add_argument(
        "--honor-timestamps",
        action="store_true",
        help="trace: send each request at its trace timestamp x --timestamp-scale (default: all at once)",
    )
    p.add_argument(
        "--timestamp-scale",
        type=real_in(0, positive=True),
        default=1.0,
        help="factor on trace arrival times",
    )
    p.add_argument(
        "--input-len",
        type=int_in(1),
        default=None,
        help="input length of each random request (vLLM's legacy name of --random-input-len)",
    )
    p.add_argument(
        "--output-len",
        type=int_in(1),
        default=None,
        help="output length of every request, overriding the dataset's (a cap for traces); "
        f"multi_turn uses {DEFAULTS['output_len']} when unset",
    )
    p.add_argument(
        "--random-input-len",
        type=int_in(1),
        default=None,
        help=f"random: input tokens per request (default --input-len, else {DEFAULTS['random_input_len']})",
    )
    p.add_argument(
        "--random-output-len",
        type=int_in(1),
        default=None,
        help=f"random: output tokens per request (default --output-len, else {DEFAULTS['random_output_len']})",
    )
    p.add_argument(
        "--random-prefix-len",
        type=int_in(0),
        default=0,
        help="random: tokens shared by every prompt before its random part",
    )
    p.add_argument(
        "--random-range-ratio",
        type=real_in(0),
        default=0.0,
        help="random: lengths drawn from [len*(1-r), len*(1+r)]",
    )
    p.add_argument(
        "--prefix-repetition-prefix-len",
        type=int_in(1),
        default=DEFAULTS["prefix_repetition_prefix_len"],
        help="prefix tokens",
    )
    p.add_argument(
        "--prefix-repetition-suffix-len",
        type=int_in(0),
        default=DEFAULTS["prefix_repetition_suffix_len"],
        help="suffix tokens",
    )
    p.add_argument(
        "--prefix-repetition-num-prefixes",
        type=int_in(1),
        default=DEFAULTS["prefix_repetition_num_prefixes"],
        help="distinct prefixes",
    )
    p.add_argument(
        "--prefix-repetition-output-len",
        type=int_in(1),
        default=None,
        help=f"output tokens per request (default --output-len, else {DEFAULTS['prefix_repetition_output_len']})",
    )
    p.add_argument("--multi-turn-num-sessions", type=int_in(1), default=8, help="chat sessions")
    p.add_argument(
        "--multi-turn-system-len", type=int_in(0), default=512, help="shared system prompt tokens"
    )
    p.add_argument(
        "--multi-turn-turn-len", type=int_in(1), default=256, help="tokens added per turn"
    )
    cache = p.add_mutually_exclusive_group()
    cache.add_argument(
        "--num-device-blocks",
        type=int_in(1),
        default=None,
        help=f"engine KV blocks (when neither this nor --kv-cache-memory: {DEFAULTS['num_device_blocks']})",
    )
    cache.add_argument(
        "--kv-cache-memory",
        type=real_in(0, positive=True),
        default=None,
        help="engine KV cache size in GiB",
    )
    p.add_argument("--block-size", type=int_in(1), default=16, help="tokens per engine block")
    p.add_argument(
        "--block-size-factor", type=int_in(1), default=1, help="engine blocks per offloaded block"
    )
    p.add_argument(
        "--max-num-batched-tokens", type=int_in(1), default=2048, help="tokens per engine step"
    )
    p.add_argument(
        "--max-num-seqs",
        type=int_in(1),
        default=DEFAULTS["max_num_seqs"],
        help="requests per engine step",
    )
    p.add_argument(
        "--enable-prefix-caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="the engine's own device prefix cache",
    )
    p.add_argument(
        "--kv-offloading-size",
        type=real_in(0),
        default=DEFAULTS["kv_offloading_size"],
        help="host tier in GiB (0 = off)",
    )
    p.add_argument(
        "--kv-offloading-backend", default="native", choices=("native",), help="offloading backend"
    )
    p.add_argument(
        "--eviction-policy",
        default="adaptive",
        choices=available_eviction_policies(),
        help="host tier eviction policy",
    )
    p.add_argument(
        "--store-policy",
        default="on_compute",
        choices=sorted(STORE_POLICIES),
        help="when blocks are stored",
    )
    p.add_argument(
        "--kv-disk-path",
        default=None,
        help="a disk tier behind the host tier in this directory (--compare: a fresh "
        "subdirectory per run, removed after it; otherwise the directory itself, kept)",
    )
    p.add_argument("--kv-disk-size", type=real_in(0), default=0.0, help="disk tier size in GiB")
    p.add_argument(
        "--kv-disk-eviction-policy",
        default=None,
        choices=available_eviction_policies(),
        help="the disk tier's eviction policy (default: --eviction-policy)",
    )
    p.add_argument(
        "--kv-lookup-retry-seconds",
        type=real_in(0),
        default=2.0,
        help="how long a request waits for its blocks' promotion from a secondary tier",
    )
    p.add_argument(
        "--kv-tier-cascade",
        default="write_through",
        choices=("write_through", "on_evict"),
        help="when host blocks are copied to the disk tier",
    )
    p.add_argument(
        "--store-threshold",
        type=int_in(0),
        default=0,
        help="store a block once this many requests wanted it (>= 2; 0 = always)",
    )
    p.add_argument(
        "--kv-remote-url",
        default=None,
        help="shared Redis/Valkey tier: redis://[:password@]host:port/db, rediss://..., "
        "redis+cluster://host:port,host:port (password also from KVOFFLOAD_REMOTE_PASSWORD)",
    )
    p.add_argument(
        "--kv-remote-optional",
        action="store_true",
        help="run without the remote tier when its server is down at start",
    )
    p.add_argument(
        "--kv-remote-ttl",
        type=real_in(0, positive=True),
        default=None,
        help="seconds until the server expires a block",
    )
    p.add_argument(
        "--kv-remote-lookup-wait",
        type=real_in(0, positive=True),
        default=0.25,
        help="seconds a block's remote lookup may take before it counts as a miss for now",
    )
    p.add_argument(
        "--instances",
        type=int_in(1, 2),
        default=1,
        help="2: engine A, in a process of its own, serves the workload with the remote tier; "
        "then engines B serve fresh requests on A's prefixes loading them from Redis, against B "
        "recomputing them (interleaved over --repeats). A redis-server is started on a free "
        "loopback port (and stopped) unless --kv-remote-url is given. prefix_repetition or "
        "random (with --random-prefix-len) workloads",
    )
    p.add_argument(
        "--kv-events-config",
        default=None,
        help='JSON, e.g. {"enable_kv_cache_events": true, "publisher": "zmq"}',
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="also run without offloading and with an unlimited device cache (--instances 2: "
        "engine B also with a host tier only, and with an unlimited device cache)",
    )
    p.add_argument(
        "--repeats",
        type=int_in(1),
        default=1,
        help="run every configuration this many times, interleaved; report median and min-max",
    )
    p.add_argument("--output-json", default=None, help="write every figure of every run here")
    p.add_argument(
        "--plot",
        default=None,
        metavar="FILE.png",
        help="plot throughput, TTFT and tokens by source",
    )
    p.add_argument(
        "--metrics-port",
        type=int_in(0, 65535),
        default=None,
        help="serve Prometheus /metrics of each run's engine on this port",
    )
    p.add_argument("--metrics-host", default="127.0.0.1", help="address /metrics listens on")
    p.add_argument(
        "--log-stats-interval",
        type=real_in(0),
        default=0.0,
        help="log an engine stats line every N seconds (0 = off)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=_run, check=_check_args, parser=p)

    from kvoffload.cli.trace import add_parser as add_trace_parser

    add_trace_parser(sub)


def _steady_threads() -> None:
    """What the tests do for steady runs, unless the user chose: OpenMP threads that sleep when
    idle (spinning ones slow everything down on a shared machine) and one torch thread per core
    this process may use."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    if "OMP_NUM_THREADS" not in os.environ:
        import torch

        torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))


def _output_len(args: argparse.Namespace, specific: int | None, default: int) -> int:
    if specific is not None:
        return specific
    return default if args.output_len is None else args.output_len


def _requests(
    args: argparse.Namespace, vocab_size: int, eos: int, variant: int = 0
) -> list[Any]:
    """The workload's requests; another ``variant`` (prefix_repetition and random only): fresh
    requests on the same shared prefixes."""
    from kvoffload.benchmark import datasets

    common = {"vocab_size": vocab_size, "eos_token_id": eos, "seed": args.seed}
    name = args.dataset_name
    if name == "random":
        input_len = args.random_input_len
        if input_len is None:
            input_len = DEFAULTS["random_input_len"] if args.input_len is None else args.input_len
        return datasets.random_prompts(
            args.num_prompts,
            input_len,
            _output_len(args, args.random_output_len, DEFAULTS["random_output_len"]),
            prefix_len=args.random_prefix_len,
            range_ratio=args.random_range_ratio,
            variant=variant,
            **common,
        )
    if name == "prefix_repetition":
        return datasets.prefix_repetition(
            args.num_prompts,
            args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes,
            _output_len(
                args, args.prefix_repetition_output_len, DEFAULTS["prefix_repetition_output_len"]
            ),
            variant=variant,
            **common,
        )
    if name == "multi_turn":
        return datasets.multi_turn(
            args.num_prompts,
            args.multi_turn_num_sessions,
            args.multi_turn_system_len,
            args.multi_turn_turn_len,
            _output_len(args, None, DEFAULTS["output_len"]),
            **common,
        )
    return datasets.trace_prompts(
        args.dataset_path, args.num_prompts, args.trace_block_size, args.output_len, **common
    )


def _check_args(args: argparse.Namespace) -> list[tuple[str, dict[str, Any]]]:
    """Check every flag before anything runs; return the runs ``(label, engine kwargs)``.

    Raises :class:`ConfigError` naming the setting: a bad model directory, a dataset path that
    is missing or given without ``--dataset-name trace``, an ``--output-json`` that cannot be
    written (checked now, so that a long run's results are not lost at the end), or any engine
    setting :class:`EngineConfig` refuses. Reads no dataset and loads no weights.
    """
    from kvoffload.engine import EngineConfig
    from kvoffload.engine.loader import load_model_config
    from kvoffload.errors import ConfigError

    load_model_config(args.model)
    if args.dataset_name == "trace":
        if args.dataset_path is None:
            raise ConfigError("dataset_path", "--dataset-name trace needs --dataset-path")
        if not Path(args.dataset_path).is_file():
            raise ConfigError("dataset_path", f"{args.dataset_path!r} is not a file")
    elif args.dataset_path is not None:
        raise ConfigError(
            "dataset_path", f"only read with --dataset-name trace (not {args.dataset_name!r})"
        )
    for setting, path in (("output_json", args.output_json), ("plot", args.plot)):
        if path is not None:
            check_output_path(setting, path)
    if args.plot is not None:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise ConfigError("plot", "needs matplotlib: pip install 'kvoffload[plot]'")
    if args.honor_timestamps and args.dataset_name != "trace":
        raise ConfigError("honor_timestamps", "only applies to --dataset-name trace")
    engine_kwargs: dict[str, Any] = {
        "model": args.model,
        "device": args.device,
        "dtype": args.dtype,
        "seed": args.seed,
        "block_size": args.block_size,
        "block_size_factor": args.block_size_factor,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "enable_prefix_caching": args.enable_prefix_caching,
        "kv_offloading_backend": args.kv_offloading_backend,
        "eviction_policy": args.eviction_policy,
        "store_policy": args.store_policy,
        "store_threshold": args.store_threshold,
        "kv_events_config": args.kv_events_config,
        "metrics_port": args.metrics_port,
        "metrics_host": args.metrics_host,
        "log_stats_interval": args.log_stats_interval,
        "kv_lookup_retry_seconds": args.kv_lookup_retry_seconds,
        "kv_remote_lookup_wait": args.kv_remote_lookup_wait,
    }
    if args.kv_cache_memory is not None:
        engine_kwargs["kv_cache_memory"] = args.kv_cache_memory
    else:
        blocks = args.num_device_blocks
        engine_kwargs["num_device_blocks"] = (
            DEFAULTS["num_device_blocks"] if blocks is None else blocks
        )
    two = args.instances == 2
    if two:
        _check_instances(args)
    runs: list[tuple[str, dict[str, Any]]] = []
    if args.compare or two:
        runs.append(("no offloading", {**engine_kwargs, "kv_offloading_size": 0.0}))
    host_only = {**engine_kwargs, "kv_offloading_size": args.kv_offloading_size}
    if two and args.compare:
        runs.append(("offloading", host_only))
    url = args.kv_remote_url
    if two and url is None:
        url = _PLACEHOLDER_URL  # until _run has started the server
    remote: dict[str, Any] = {}
    if url is not None or args.kv_remote_ttl is not None:  # every offloading run
        remote = {
            "kv_remote_url": url,
            "kv_remote_optional": args.kv_remote_optional,
            "kv_remote_ttl": args.kv_remote_ttl,
        }
    plus = " + remote" if remote else ""
    host_only = {**host_only, **remote}
    with_disk = {
        **host_only,
        "kv_disk_path": args.kv_disk_path,
        "kv_disk_size": args.kv_disk_size,
        "kv_disk_eviction_policy": args.kv_disk_eviction_policy,
        "kv_tier_cascade": args.kv_tier_cascade,
    }
    if args.kv_disk_path is None or args.compare:
        runs.append(("offloading" + plus, host_only))
    if args.kv_disk_path is not None:
        runs.append(("offloading + disk" + plus, with_disk))
    if args.compare:
        # Sized from the requests in _run; a placeholder that passes EngineConfig's checks here.
        ideal = {
            **engine_kwargs,
            "kv_offloading_size": 0.0,
            "enable_prefix_caching": True,
            "num_device_blocks": 1,
        }
        ideal.pop("kv_cache_memory", None)
        runs.append(("unlimited device cache", ideal))
    for _, kwargs in runs:
        EngineConfig(**kwargs)
    return runs


def _check_instances(args: argparse.Namespace) -> None:
    """``--instances 2``'s own checks: :class:`ConfigError` naming the flag that cannot go with
    it. Without ``--kv-remote-url``, ``redis-server`` must be installed."""
    from kvoffload.errors import ConfigError

    name = args.dataset_name
    if name not in ("prefix_repetition", "random"):
        raise ConfigError(
            "dataset_name",
            f"--instances 2 serves engine B fresh requests on engine A's shared prefixes: use "
            f"prefix_repetition or random with --random-prefix-len (not {name!r})",
        )
    if name == "random" and args.random_prefix_len == 0:
        raise ConfigError(
            "random_prefix_len", "--instances 2 on random prompts needs a shared prefix (> 0)"
        )
    if args.kv_offloading_size == 0:
        raise ConfigError(
            "kv_offloading_size", "--instances 2 needs the host tier the remote tier sits behind"
        )
    if args.kv_disk_path is not None:
        raise ConfigError(
            "kv_disk_path", "--instances 2 compares the remote tier with recomputing: no disk tier"
        )
    if args.kv_remote_optional:
        raise ConfigError(
            "kv_remote_optional",
            "--instances 2 measures the remote tier: its server must be up, not optional",
        )
    if args.kv_remote_url is None:
        from kvoffload.benchmark.redis_server import RedisUnavailableError, require_redis_binaries

        try:
            require_redis_binaries()
        except RedisUnavailableError as exc:
            raise ConfigError(
                "kv_remote_url",
                f"--instances 2 without --kv-remote-url starts a local redis-server: {exc}",
            ) from None


@contextlib.contextmanager
def _remote_server(args: argparse.Namespace) -> Iterator[str]:
    """The URL of ``--kv-remote-url``, or of a ``redis-server`` started here on a free loopback
    port and stopped (its files removed) on exit."""
    if args.kv_remote_url is not None:
        yield args.kv_remote_url
        return
    from kvoffload.benchmark.redis_server import standalone_server
    from kvoffload.errors import ConfigError

    stack = contextlib.ExitStack()
    with stack:
        try:
            started = stack.enter_context(standalone_server())
        except (RuntimeError, TimeoutError, OSError) as exc:
            raise ConfigError("kv_remote_url", f"cannot start a local redis-server: {exc}") from exc
        print(f"Started redis-server on {started.address} (stopped at the end).", flush=True)
        yield started.url


def _engine_a(requests: list[Any], kwargs: dict[str, Any]) -> Any:
    """Engine A of ``--instances 2``, in its own process: serve the workload, store its blocks."""
    _steady_threads()
    from kvoffload.benchmark.throughput import run_throughput

    return run_throughput(requests, "engine A", kwargs)


def _run_engine_a(requests: list[Any], kwargs: dict[str, Any]) -> Any:
    """:func:`_engine_a` in a spawned process (nothing shared with this one but the server):
    its :class:`ThroughputResult`, or its exception re-raised here."""
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(_engine_a, requests, kwargs).result()


@contextlib.contextmanager
def _disk_directory(kwargs: dict[str, Any], fresh: bool) -> Iterator[dict[str, Any]]:
    """``kwargs`` for one run: with ``fresh``, its disk tier gets an empty subdirectory of
    ``kv_disk_path`` (removed afterwards), so no run starts warm from another's blocks."""
    path = kwargs.get("kv_disk_path")
    if path is None or not fresh:
        yield kwargs
        return
    Path(path).mkdir(parents=True, exist_ok=True)
    run_dir = tempfile.mkdtemp(prefix="run-", dir=path)
    try:
        yield {**kwargs, "kv_disk_path": run_dir}
    finally:
        shutil.rmtree(run_dir, ignore_errors=True)


def _workload_lines(
    args: argparse.Namespace, requests: list[Any], runs: list[tuple[str, dict[str, Any]]]
) -> list[str]:
    """One or two lines saying what is about to run (and, for traces, what was rescaled)."""
    prompts = [len(r.prompt) for r in requests]
    outputs = [r.output_len for r in requests]
    sharing = {
        "random": f"{args.random_prefix_len}-token shared prefix"
        if args.random_prefix_len
        else "no shared prefix",
        "prefix_repetition": f"{args.prefix_repetition_num_prefixes} shared prefixes of {args.prefix_repetition_prefix_len} tokens",
        "multi_turn": f"{args.multi_turn_num_sessions} sessions sharing a {args.multi_turn_system_len}-token system prompt",
        "trace": "prefixes shared as the trace's hash ids",
    }[args.dataset_name]
    offload = [kw for label, kw in runs if kw.get("kv_offloading_size", 0) > 0]
    device = runs[0][1].get("num_device_blocks")
    lines = [
        f"Workload: model {args.model}, {len(requests)} {args.dataset_name} requests "
        f"({min(prompts)}-{max(prompts)} prompt tokens, {min(outputs)}-{max(outputs)} output tokens), {sharing}.",
        ("Engine B runs: " if args.instances == 2 else "Runs: ")
        + ", ".join(label for label, _ in runs)
        + (f", {args.repeats} interleaved repeats" if args.repeats > 1 else "")
        + "; device cache "
        + (
            f"{device} blocks of {args.block_size} tokens"
            if device
            else f"{args.kv_cache_memory} GiB"
        )
        + (f", host tier {offload[0]['kv_offloading_size']} GiB" if offload else "")
        + ("" if args.enable_prefix_caching else ", device prefix cache off")
        + ".",
    ]
    if args.dataset_name == "trace":
        lines.append(
            f"Trace rescaled: each 512-token hash block is {args.trace_block_size} tokens "
            f"({512 / args.trace_block_size:g}x shorter prompts); "
            + (
                "output lengths as in the trace"
                if args.output_len is None
                else f"output lengths capped at {args.output_len}"
            )
            + "; "
            + (
                f"arrival times from the trace x {args.timestamp_scale:g} "
                f"(last request at {max(r.arrival_s for r in requests) * args.timestamp_scale:.1f} s)"
                if args.honor_timestamps
                else "timestamps ignored, all requests at once (--honor-timestamps to replay them)"
            )
            + "."
        )
    return lines


def _interleaved(
    args: argparse.Namespace,
    runs: list[tuple[str, dict[str, Any]]],
    requests_of: Callable[[int], list[Any]],
    arrivals: list[float] | None,
) -> list[Any]:
    """Every run ``args.repeats`` times, interleaved (ABC ABC, so drift hits every config), on
    ``requests_of(repeat)``, each printed as it ends; the results in order."""
    from tqdm import tqdm

    from kvoffload.benchmark.throughput import format_result, run_throughput

    def bar(total: int, label: str) -> Any:
        if args.no_progress:
            return None
        return tqdm(total=total, desc=label, unit="req", file=sys.stderr)

    def phase(text: str) -> None:
        if not args.no_progress:
            print(text, file=sys.stderr, flush=True)

    results: list[Any] = []
    for repeat in range(1, args.repeats + 1):
        requests = requests_of(repeat)
        for label, kwargs in runs:
            name = f"{label} (repeat {repeat}/{args.repeats})" if args.repeats > 1 else label
            with _disk_directory(kwargs, fresh=args.compare) as run_kwargs:
                result = run_throughput(
                    requests,
                    label,
                    run_kwargs,
                    lambda total, _l, n=name: bar(total, n),
                    repeat,
                    arrivals,
                    phase,
                )
            results.append(result)
            print(f"== {name} ==")
            print(format_result(result), flush=True)
    return results


def _two_instances(
    args: argparse.Namespace,
    runs: list[tuple[str, dict[str, Any]]],
    requests: list[Any],
    fresh: Callable[[int], list[Any]],
) -> tuple[Any, list[Any]]:
    """``--instances 2``: engine A serves ``requests`` in its own process, storing their blocks
    in the shared server; then engines B run ``runs`` on ``fresh(repeat)``: requests on the same
    prefixes, other suffixes every repeat (so that no B finds an earlier B's suffixes in the
    server). Returns A's result and B's."""
    from kvoffload.benchmark.throughput import format_result

    with _remote_server(args) as url:
        for _, kwargs in runs:
            if kwargs.get("kv_remote_url") is not None:
                kwargs["kv_remote_url"] = url
        a_kwargs = next(kw for _, kw in runs if kw.get("kv_remote_url") is not None)
        if not args.no_progress:
            print("engine A: serving the workload in a process of its own", file=sys.stderr)
        engine_a = _run_engine_a(requests, a_kwargs)
        print("== engine A (its own process; stores the prefixes in the remote tier) ==")
        print(format_result(engine_a), flush=True)
        print(
            "\nEngines B: fresh requests on engine A's prefixes (new suffixes every repeat), "
            "each a new engine.",
            flush=True,
        )
        return engine_a, _interleaved(args, runs, fresh, None)


def _run(args: argparse.Namespace) -> int:
    _steady_threads()
    from kvoffload.benchmark.throughput import (
        format_comparison,
        summarize,
        throughput_ratios,
        unlimited_device_blocks,
    )
    from kvoffload.engine.loader import load_model_config
    from kvoffload.errors import ConfigError, KVOffloadError

    try:
        runs = _check_args(args)
        model = load_model_config(args.model)
        requests = _requests(args, model.vocab_size, model.eos_token_id)
        if args.compare:  # (--instances 2: B's requests have the same lengths and prefixes)
            runs[-1][1]["num_device_blocks"] = unlimited_device_blocks(requests, args.block_size)
        if args.log_stats_interval > 0:
            import logging

            logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
        arrivals = (
            [r.arrival_s * args.timestamp_scale for r in requests]
            if args.honor_timestamps
            else None
        )
        for line in _workload_lines(args, requests, runs):
            print(line)
        print(flush=True)
        engine_a = None
        if args.instances == 2:
            engine_a, all_runs = _two_instances(
                args,
                runs,
                requests,
                lambda repeat: _requests(args, model.vocab_size, model.eos_token_id, repeat),
            )
        else:
            all_runs = _interleaved(args, runs, lambda _repeat: requests, arrivals)
        summaries = summarize(all_runs)
        compared = args.compare or engine_a is not None
        if compared:
            note = (
                f", median [min-max] of {args.repeats} interleaved repeats"
                if args.repeats > 1
                else ""
            )
            title = "engine B on engine A's prefixes" if engine_a is not None else "comparison"
            print(f"\n== {title}{note} ==")
            print(format_comparison(summaries))
        if args.plot:
            from kvoffload.benchmark.plot import plot_comparison

            plot_comparison(
                summaries,
                args.plot,
                title=f"{args.model}, {len(requests)} {args.dataset_name} requests",
            )
            print(f"plot written to {args.plot}")
        if args.output_json:
            payload = {
                "args": _shown_args(args),
                "workload": _workload_lines(args, requests, runs),
                "results": [s.to_dict() for s in summaries],
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
            try:
                Path(args.output_json).write_text(json.dumps(payload, indent=2, default=str))
            except OSError as exc:
                raise ConfigError(
                    "output_json", f"cannot write {args.output_json!r}: {exc.strerror or exc}"
                ) from exc
    except KVOffloadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


def _shown_args(args: argparse.Namespace) -> dict[str, Any]:
    """The flags as given, for ``--output-json``; the remote URL without its password."""
    from kvoffload.tiers.redis_url import parse_redis_url

    shown = {k: v for k, v in vars(args).items() if k not in ("func", "check", "parser")}
    if args.kv_remote_url is not None:
        shown["kv_remote_url"] = parse_redis_url(args.kv_remote_url).redacted()
    return shown

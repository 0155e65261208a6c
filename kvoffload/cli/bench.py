"""``kvoffload bench throughput``: offline throughput of the reference engine, flags modelled on
``vllm bench throughput``; ``bench trace`` is in :mod:`kvoffload.cli.trace`.

The flags come from three tables: the workload's (:mod:`kvoffload.cli.workload_flags`), the
engine's and its tiers' (:mod:`kvoffload.cli.engine_flags`, shared with every command that builds
an engine) and this command's own (:data:`BENCH_FLAGS`). Which runs it makes is
:mod:`kvoffload.benchmark.matrix`; how they run, :mod:`kvoffload.benchmark.interleave`; what it
prints and writes, :mod:`kvoffload.benchmark.report`.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, Any

from kvoffload.benchmark.workload import workload_requests
from kvoffload.cli.args import check_output_path, int_in
from kvoffload.cli.command import command
from kvoffload.cli.flagspec import Flag, add_flags, resolve_flags
from kvoffload.cli.workload_flags import (
    add_workload_flags,
    check_workload,
    workload_lines,
)
from kvoffload.errors import ConfigError

if TYPE_CHECKING:
    from kvoffload.benchmark.datasets import BenchRequest
    from kvoffload.benchmark.interleave import Progress
    from kvoffload.benchmark.matrix import Run
    from kvoffload.benchmark.throughput import ThroughputResult
    from kvoffload.engine.model_config import ModelConfig

__all__ = ["BENCH_DEFAULTS", "BENCH_FLAGS", "add_parser"]

#: The main job (`make bench`): long shared prefixes that do not fit the device cache but fit the
#: host tier (600 blocks of 16 tokens hold about 4 of the 8 prefixes; every prefix fits 1 GiB).
BENCH_DEFAULTS: dict[str, Any] = {
    "num_device_blocks": 600,
    "kv_cache_memory": None,
    "max_num_seqs": 8,
    "kv_offloading_size": 1.0,
}

BENCH_FLAGS: tuple[Flag, ...] = (
    Flag(
        "compare",
        "also run without offloading and with an unlimited device cache (and host + "
        "disk against host alone; --instances 2: engine B also with its host tier only)",
        kind="switch",
    ),
    Flag(
        "repeats",
        "run every configuration this many times, interleaved; report median and min-max",
        parse=int_in(1),
        default=1,
        unit="N",
    ),
    Flag(
        "instances",
        "2: engine A, in a process of its own, serves the workload with the "
        "remote tier; then engines B serve fresh requests on A's prefixes, loading them from "
        "Redis, against B recomputing them. A redis-server is started on a free loopback port "
        "(and stopped) unless --kv-remote-url is given. prefix_repetition or random (with "
        "--random-prefix-len) workloads",
        parse=int_in(1, 2),
        default=1,
        unit="N",
    ),
    Flag("output_json", "write every figure of every run here", unit="FILE", unset="none"),
    Flag("plot", "plot throughput, TTFT and tokens by source", unit="FILE.png", unset="none"),
    Flag("no_progress", "no progress bars", kind="switch"),
)


def add_parser(subparsers: Any, argv: Sequence[str] = ()) -> None:
    """Register ``kvoffload bench`` and its commands: when ``argv`` names one, only that one is
    built (the others are placeholders), so that ``bench trace`` imports no engine or server."""
    bench = subparsers.add_parser("bench", help="benchmarks of the reference engine")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    builders: dict[str, Callable[[Any], None]] = {
        "throughput": _add_throughput_parser,
        "trace": _add_trace_parser,
        "serve": _add_serve_parser,
    }
    wanted = [a for a in argv if a in builders][:1] or list(builders)
    for name, build in builders.items():
        if name in wanted:
            build(sub)
        else:
            sub.add_parser(name, help=f"(bench {name})")


def _add_throughput_parser(sub: Any) -> None:
    from kvoffload.cli.engine_flags import add_engine_flags

    p = sub.add_parser(
        "throughput",
        help="offline throughput with and without KV offloading",
        description="Offline throughput of the reference engine. --compare runs the same "
        "workload without offloading, with offloading, and with an unlimited device cache, side "
        "by side (with --kv-disk-path: each run in a fresh subdirectory of it, removed after "
        "it); --repeats N interleaves N runs of each and reports medians with their spread. "
        "--instances 2 measures a second engine on the prefixes a first one stored in a shared "
        "Redis.",
    )
    add_workload_flags(p)
    add_engine_flags(p, defaults=BENCH_DEFAULTS)
    add_flags(p, BENCH_FLAGS, section="benchmark")
    p.set_defaults(func=_run, check=_check_args, parser=p)


def _add_trace_parser(sub: Any) -> None:
    from kvoffload.cli.trace import add_parser

    add_parser(sub)


def _add_serve_parser(sub: Any) -> None:
    from kvoffload.cli.bench_serve import add_parser

    add_parser(sub)


def _check_args(args: argparse.Namespace) -> tuple[argparse.Namespace, list[Run]]:
    """Check every flag before anything runs: the resolved flags and the runs.

    Raises :class:`ConfigError` naming the setting: a flag given without what it needs, a bad
    model directory, a missing trace, an ``--output-json`` or ``--plot`` that cannot be written
    (checked now, so that a long run's results are not lost at the end), or any engine setting
    :class:`EngineConfig` refuses, for any run. Reads no dataset and loads no weights.
    """
    from kvoffload.benchmark.matrix import run_matrix
    from kvoffload.cli.engine_flags import TIER_SETTINGS, engine_kwargs_from_args
    from kvoffload.engine.loader import load_model_config

    two = args.instances == 2
    flags = resolve_flags(args, provided=("remote",) if two else ())
    load_model_config(flags.model)
    check_workload(flags)
    for setting, path in (("output_json", flags.output_json), ("plot", flags.plot)):
        if path is not None:
            check_output_path(setting, path)
    if flags.plot is not None:
        import importlib.util

        if importlib.util.find_spec("matplotlib") is None:
            raise ConfigError("plot", "needs matplotlib: pip install 'kvoffload[plot]'")
    if two:
        _check_instances(flags)
    kwargs = engine_kwargs_from_args(flags)
    disk = {k: kwargs.pop(k) for k in TIER_SETTINGS["disk"] if k in kwargs}
    remote = {k: kwargs.pop(k) for k in TIER_SETTINGS["remote"] if k in kwargs}
    runs = run_matrix(
        kwargs,
        disk if flags.kv_disk_path is not None else None,
        remote if flags.kv_remote_url is not None or two else None,
        compare=flags.compare,
        instances=flags.instances,
    )
    return flags, runs


def _check_instances(flags: argparse.Namespace) -> None:
    """``--instances 2``'s own checks: :class:`ConfigError` naming the flag that cannot go with
    it. Without ``--kv-remote-url``, ``redis-server`` must be installed."""
    name = flags.dataset_name
    if name not in ("prefix_repetition", "random"):
        raise ConfigError(
            "dataset_name",
            f"--instances 2 serves engine B fresh requests on engine A's shared prefixes: use "
            f"prefix_repetition or random with --random-prefix-len (not {name!r})",
        )
    if name == "random" and flags.random_prefix_len == 0:
        raise ConfigError(
            "random_prefix_len", "--instances 2 on random prompts needs a shared prefix (> 0)"
        )
    if flags.kv_offloading_size == 0:
        raise ConfigError(
            "kv_offloading_size", "--instances 2 needs the host tier the remote tier sits behind"
        )
    if flags.kv_disk_path is not None:
        raise ConfigError(
            "kv_disk_path", "--instances 2 compares the remote tier with recomputing: no disk tier"
        )
    if flags.kv_remote_optional:
        raise ConfigError(
            "kv_remote_optional",
            "--instances 2 measures the remote tier: its server must be up, not optional",
        )
    if flags.kv_remote_url is None:
        from kvoffload.benchmark.redis_server import RedisUnavailableError, require_redis_binaries

        try:
            require_redis_binaries()
        except RedisUnavailableError as exc:
            raise ConfigError(
                "kv_remote_url",
                f"--instances 2 without --kv-remote-url starts a local redis-server: {exc}",
            ) from None


@contextlib.contextmanager
def _remote_server(url: str | None) -> Iterator[str]:
    """``url``, or that of a ``redis-server`` started here on a free loopback port and stopped
    (its files removed) on exit."""
    if url is not None:
        yield url
        return
    from kvoffload.benchmark.redis_server import standalone_server

    with contextlib.ExitStack() as stack:
        try:
            started = stack.enter_context(standalone_server())
        except (RuntimeError, TimeoutError, OSError) as exc:
            raise ConfigError("kv_remote_url", f"cannot start a local redis-server: {exc}") from exc
        print(f"Started redis-server on {started.address} (stopped at the end).", flush=True)
        yield started.url


def _progress(flags: argparse.Namespace) -> Progress:
    """Bars and phase lines on stderr (unless ``--no-progress``); each run's summary on stdout."""
    from tqdm import tqdm

    from kvoffload.benchmark.interleave import Progress
    from kvoffload.benchmark.report import format_result

    def result(name: str, r: ThroughputResult) -> None:
        print(f"== {name} ==")
        print(format_result(r), flush=True)

    if flags.no_progress:
        return Progress(result=result)
    return Progress(
        bar=lambda total, name: tqdm(total=total, desc=name, unit="req", file=sys.stderr),
        phase=lambda text: print(text, file=sys.stderr, flush=True),
        result=result,
    )


def _runs_line(flags: argparse.Namespace, runs: list[Run]) -> str:
    """Which runs, how often, on which device cache and host tier."""
    offload = [r.engine_kwargs for r in runs if r.engine_kwargs.get("kv_offloading_size", 0) > 0]
    device = runs[0].engine_kwargs.get("num_device_blocks")
    return (
        ("Engine B runs: " if flags.instances == 2 else "Runs: ")
        + ", ".join(r.label for r in runs)
        + (f", {flags.repeats} interleaved repeats" if flags.repeats > 1 else "")
        + "; device cache "
        + (
            f"{device} blocks of {flags.block_size} tokens"
            if device
            else f"{flags.kv_cache_memory} GiB"
        )
        + (f", host tier {offload[0]['kv_offloading_size']} GiB" if offload else "")
        + ("" if flags.enable_prefix_caching else ", device prefix cache off")
        + "."
    )


@command
def _run(args: argparse.Namespace) -> int:
    from kvoffload.benchmark.interleave import steady_threads
    from kvoffload.benchmark.matrix import size_unlimited
    from kvoffload.engine.loader import load_model_config

    steady_threads()
    flags, runs = _check_args(args)
    model = load_model_config(flags.model)
    requests = workload_requests(flags, model.vocab_size, model.eos_token_id)
    size_unlimited(runs, requests)  # (--instances 2: B's requests have these lengths too)
    if flags.log_stats_interval_s > 0:
        import logging

        logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    lines = workload_lines(flags, requests)
    lines.insert(1, _runs_line(flags, runs))
    print("\n".join(lines) + "\n", flush=True)
    progress = _progress(flags)
    engine_a = None
    if flags.instances == 2:
        engine_a, all_runs = _two_instances(flags, runs, requests, model, progress)
    else:
        arrivals = (
            [r.arrival_s * flags.timestamp_scale for r in requests]
            if flags.honor_timestamps
            else None
        )
        all_runs = _interleaved(
            flags, runs, lambda _repeat: requests, arrivals, progress, flags.compare
        )
    title = f"{flags.model}, {len(requests)} {flags.dataset_name} requests"
    _report(flags, lines, all_runs, engine_a, title)
    return 0


def _interleaved(
    flags: argparse.Namespace,
    runs: list[Run],
    requests_of: Callable[[int], Sequence[BenchRequest]],
    arrivals: list[float] | None,
    progress: Progress,
    fresh_remote: bool,
) -> list[ThroughputResult]:
    """The runs interleaved; with ``--compare`` each on a fresh disk directory, and with
    ``fresh_remote`` also in a fresh remote namespace."""
    from kvoffload.benchmark.interleave import run_interleaved

    return run_interleaved(
        runs,
        requests_of,
        flags.repeats,
        fresh_disk=flags.compare,
        arrivals=arrivals,
        progress=progress,
        fresh_remote=fresh_remote,
    )


def _two_instances(
    flags: argparse.Namespace,
    runs: list[Run],
    requests: list[BenchRequest],
    model: ModelConfig,
    progress: Progress,
) -> tuple[ThroughputResult, list[ThroughputResult]]:
    """``--instances 2``: engine A serves ``requests`` in its own process, storing their blocks
    in the shared server; then engines B run ``runs`` on fresh requests on the same prefixes,
    other suffixes every repeat (so that no B finds an earlier B's suffixes in the server).
    Returns A's result and B's."""
    from kvoffload.benchmark.interleave import run_in_own_process
    from kvoffload.benchmark.report import format_result

    with _remote_server(flags.kv_remote_url) as url:
        for run in runs:
            if run.remote:
                run.engine_kwargs["kv_remote_url"] = url
        a_kwargs = next(run.engine_kwargs for run in runs if run.remote)
        if progress.phase is not None:
            progress.phase("engine A: serving the workload in a process of its own")
        engine_a = run_in_own_process(requests, "engine A", a_kwargs)
        print("== engine A (its own process; stores the prefixes in the remote tier) ==")
        print(format_result(engine_a), flush=True)
        print(
            "\nEngines B: fresh requests on engine A's prefixes (new suffixes every repeat), "
            "each a new engine.",
            flush=True,
        )

        def fresh(repeat: int) -> list[BenchRequest]:
            return workload_requests(flags, model.vocab_size, model.eos_token_id, repeat)

        # Engines B must find engine A's blocks: one namespace for all.
        return engine_a, _interleaved(flags, runs, fresh, None, progress, False)


def _report(
    flags: argparse.Namespace,
    workload: list[str],
    all_runs: list[ThroughputResult],
    engine_a: ThroughputResult | None,
    title: str,
) -> None:
    """The comparison table (when compared), the plot and the JSON."""
    from kvoffload.benchmark.report import format_comparison, json_payload, write_json
    from kvoffload.benchmark.throughput import summarize

    summaries = summarize(all_runs)
    compared = flags.compare or engine_a is not None
    if compared:
        note = (
            f", median [min-max] of {flags.repeats} interleaved repeats"
            if flags.repeats > 1
            else ""
        )
        heading = "engine B on engine A's prefixes" if engine_a is not None else "comparison"
        print(f"\n== {heading}{note} ==")
        print(format_comparison(summaries))
    if flags.plot:
        from kvoffload.benchmark.plot import plot_comparison

        plot_comparison(summaries, flags.plot, title=title)
        print(f"plot written to {flags.plot}")
    if flags.output_json:
        payload = json_payload(
            _shown_args(flags), workload, summaries, all_runs, compared, engine_a
        )
        write_json(flags.output_json, payload)


def _shown_args(flags: argparse.Namespace) -> dict[str, Any]:
    """The flags as they ran, for ``--output-json``; the remote URL without its password."""
    from kvoffload.tiers.redis.url import parse_redis_url

    shown = {k: v for k, v in vars(flags).items() if k not in ("func", "check", "parser")}
    if flags.kv_remote_url is not None:
        shown["kv_remote_url"] = parse_redis_url(flags.kv_remote_url).redacted()
    return shown

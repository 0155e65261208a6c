"""``kvoffload bench throughput``: flags modelled on ``vllm bench throughput``; ``bench trace`` is
in :mod:`kvoffload.cli.trace`."""

from __future__ import annotations

import argparse
import contextlib
import json
import shutil
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from kvoffload.cli.args import check_output_path, int_in, real_in

__all__ = ["add_parser"]

# The main job's workload (`make bench`): long shared prefixes that do not fit the device cache
# but fit the host tier, requests shuffled so that the device cache alone keeps missing.
DEFAULTS: dict[str, Any] = {
    "model": "small",
    "num_prompts": 64,
    "dataset_name": "prefix_repetition",
    "prefix_repetition_prefix_len": 2048,
    "prefix_repetition_suffix_len": 32,
    "prefix_repetition_num_prefixes": 8,
    "output_len": 16,
    "num_device_blocks": 600,  # 9,600 tokens: about 4 of the 8 prefixes
    "max_num_seqs": 8,
    "kv_offloading_size": 1.0,  # GiB: every prefix fits
}


def add_parser(subparsers: Any) -> None:
    bench = subparsers.add_parser("bench", help="benchmarks of the reference engine")
    sub = bench.add_subparsers(dest="bench_command", required=True)
    p = sub.add_parser(
        "throughput",
        help="offline throughput with and without KV offloading",
        description="Offline throughput of the reference engine. --compare runs the same workload without "
        "offloading, with offloading, and with an unlimited device cache, side by side.",
    )
    p.add_argument(
        "--model",
        default=DEFAULTS["model"],
        help="preset (tiny, small) or a local HF checkpoint dir",
    )
    p.add_argument("--device", default="cpu")
    p.add_argument(
        "--dtype", default=None, help="float32, bfloat16 or float16 (default: by device)"
    )
    p.add_argument("--seed", type=int_in(0, 2**64 - 1), default=0)
    p.add_argument("--num-prompts", type=int_in(1), default=DEFAULTS["num_prompts"])
    p.add_argument(
        "--dataset-name",
        choices=("random", "prefix_repetition", "multi_turn", "trace"),
        default=DEFAULTS["dataset_name"],
    )
    p.add_argument(
        "--dataset-path", default=None, help="Mooncake-format JSONL trace (--dataset-name trace)"
    )
    p.add_argument(
        "--trace-block-size", type=int_in(1), default=16, help="tokens per trace hash id"
    )
    p.add_argument("--output-len", type=int_in(1), default=DEFAULTS["output_len"])
    p.add_argument("--random-input-len", type=int_in(1), default=1024)
    p.add_argument(
        "--prefix-repetition-prefix-len",
        type=int_in(1),
        default=DEFAULTS["prefix_repetition_prefix_len"],
    )
    p.add_argument(
        "--prefix-repetition-suffix-len",
        type=int_in(0),
        default=DEFAULTS["prefix_repetition_suffix_len"],
    )
    p.add_argument(
        "--prefix-repetition-num-prefixes",
        type=int_in(1),
        default=DEFAULTS["prefix_repetition_num_prefixes"],
    )
    p.add_argument("--multi-turn-num-sessions", type=int_in(1), default=8)
    p.add_argument("--multi-turn-system-len", type=int_in(0), default=512)
    p.add_argument("--multi-turn-turn-len", type=int_in(1), default=256)
    cache = p.add_mutually_exclusive_group()
    cache.add_argument(
        "--num-device-blocks",
        type=int_in(1),
        default=None,
        help=f"engine KV blocks (default {DEFAULTS['num_device_blocks']})",
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
    p.add_argument("--max-num-batched-tokens", type=int_in(1), default=2048)
    p.add_argument("--max-num-seqs", type=int_in(1), default=DEFAULTS["max_num_seqs"])
    p.add_argument(
        "--kv-offloading-size",
        type=real_in(0),
        default=DEFAULTS["kv_offloading_size"],
        help="host tier in GiB (0 = off)",
    )
    p.add_argument("--kv-offloading-backend", default="native")
    p.add_argument("--eviction-policy", default="lru")
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
        help="the disk tier's eviction policy (default: --eviction-policy)",
    )
    p.add_argument(
        "--kv-tier-cascade",
        default="write_through",
        help="write_through or on_evict: when host blocks are copied to the disk tier",
    )
    p.add_argument("--store-policy", default="on_compute")
    p.add_argument(
        "--store-threshold",
        type=int_in(0),
        default=0,
        help="store a block once this many requests wanted it (>= 2)",
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
        "--kv-remote-ttl", type=real_in(0, positive=True), default=None, help="seconds until the server expires a block"
    )
    p.add_argument(
        "--kv-events-config",
        default=None,
        help='JSON, e.g. {"enable_kv_cache_events": true, "publisher": "zmq"}',
    )
    p.add_argument(
        "--compare",
        action="store_true",
        help="also run without offloading and with an unlimited device cache",
    )
    p.add_argument("--output-json", default=None, help="write the results here")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument(
        "--repeats",
        type=int_in(1),
        default=1,
        help="run every configuration this many times, interleaved; report the fastest of each",
    )
    p.set_defaults(func=_run, check=_check_args)

    from kvoffload.cli.trace import add_parser as add_trace_parser

    add_trace_parser(sub)


def _requests(args: argparse.Namespace, vocab_size: int, eos: int) -> list[Any]:
    from kvoffload.benchmark import datasets

    common = {"vocab_size": vocab_size, "eos_token_id": eos, "seed": args.seed}
    name = args.dataset_name
    if name == "random":
        return datasets.random_prompts(
            args.num_prompts, args.random_input_len, args.output_len, **common
        )
    if name == "prefix_repetition":
        return datasets.prefix_repetition(
            args.num_prompts,
            args.prefix_repetition_prefix_len,
            args.prefix_repetition_suffix_len,
            args.prefix_repetition_num_prefixes,
            args.output_len,
            **common,
        )
    if name == "multi_turn":
        return datasets.multi_turn(
            args.num_prompts,
            args.multi_turn_num_sessions,
            args.multi_turn_system_len,
            args.multi_turn_turn_len,
            args.output_len,
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
    if args.output_json is not None:
        check_output_path("output_json", args.output_json)
    engine_kwargs: dict[str, Any] = {
        "model": args.model,
        "device": args.device,
        "dtype": args.dtype,
        "seed": args.seed,
        "block_size": args.block_size,
        "block_size_factor": args.block_size_factor,
        "max_num_batched_tokens": args.max_num_batched_tokens,
        "max_num_seqs": args.max_num_seqs,
        "kv_offloading_backend": args.kv_offloading_backend,
        "eviction_policy": args.eviction_policy,
        "store_policy": args.store_policy,
        "store_threshold": args.store_threshold,
        "kv_events_config": args.kv_events_config,
    }
    if args.kv_cache_memory is not None:
        engine_kwargs["kv_cache_memory"] = args.kv_cache_memory
    else:
        blocks = args.num_device_blocks
        engine_kwargs["num_device_blocks"] = (
            DEFAULTS["num_device_blocks"] if blocks is None else blocks
        )
    runs: list[tuple[str, dict[str, Any]]] = []
    if args.compare:
        runs.append(("no offloading", {**engine_kwargs, "kv_offloading_size": 0.0}))
    remote: dict[str, Any] = {}
    if args.kv_remote_url is not None or args.kv_remote_ttl is not None:  # every offloading run
        remote = {
            "kv_remote_url": args.kv_remote_url,
            "kv_remote_optional": args.kv_remote_optional,
            "kv_remote_ttl": args.kv_remote_ttl,
        }
    plus = " + remote" if remote else ""
    host_only = {**engine_kwargs, **remote, "kv_offloading_size": args.kv_offloading_size}
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
        ideal = {**engine_kwargs, "kv_offloading_size": 0.0, "num_device_blocks": 1}
        ideal.pop("kv_cache_memory", None)
        runs.append(("unlimited device cache", ideal))
    for _, kwargs in runs:
        EngineConfig(**kwargs)
    return runs


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


def _run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kvoffload.benchmark.throughput import (
        format_comparison,
        format_result,
        run_throughput,
        unlimited_device_blocks,
    )
    from kvoffload.engine.loader import load_model_config
    from kvoffload.errors import KVOffloadError

    try:
        runs = _check_args(args)
        model = load_model_config(args.model)
        requests = _requests(args, model.vocab_size, model.eos_token_id)
        if args.compare:
            runs[-1][1]["num_device_blocks"] = unlimited_device_blocks(requests, args.block_size)

        def bar(total: int, label: str) -> Any:
            return (
                None
                if args.no_progress
                else tqdm(total=total, desc=label, unit="req", file=sys.stderr)
            )

        all_runs: list[Any] = []
        best: dict[str, Any] = {}
        for repeat in range(args.repeats):  # interleaved (ABC ABC), so drift hits every config
            for label, kwargs in runs:
                with _disk_directory(kwargs, fresh=args.compare) as run_kwargs:
                    result = run_throughput(requests, label, run_kwargs, bar)
                all_runs.append(result)
                if label not in best or result.elapsed_s < best[label].elapsed_s:
                    best[label] = result
                suffix = f" (repeat {repeat + 1}/{args.repeats})" if args.repeats > 1 else ""
                print(f"== {label}{suffix} ==")
                print(format_result(result), flush=True)
        results = [best[label] for label, _ in runs]
        if args.compare:
            note = f", best of {args.repeats} interleaved repeats" if args.repeats > 1 else ""
            print(f"\n== comparison{note} ==")
            print(format_comparison(results))
        if args.output_json:
            payload = {
                "args": vars(args) | {"func": None, "check": None},
                "results": [r.to_dict() for r in results],
                "all_runs": [r.to_dict() for r in all_runs],
            }
            Path(args.output_json).write_text(json.dumps(payload, indent=2, default=str))
    except KVOffloadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0

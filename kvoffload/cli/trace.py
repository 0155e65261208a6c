"""``kvoffload bench trace``: replay traces through every eviction policy, to choose one.

Each trace (a Mooncake-format JSONL file, ``--dataset-path``, or a generated workload of the
suite, ``--generate``) is replayed through a real ``CPUOffloadingManager`` per policy and tier
size; the ``infinite`` and ``belady`` references bound what any policy can reach. Prints a table
per trace (hit ratio, ratio to LRU, share of the LRU -> Belady gap closed), and optionally writes
JSON and a plot of hit ratio against capacity.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvoffload.cli.args import check_output_path

__all__ = ["add_parser", "run"]

DEFAULT_CAPACITIES = "250,1000,4000,16000,64000"
_WIDTH = 10


def add_parser(bench_subparsers: Any) -> None:
    """Register ``trace`` under ``kvoffload bench``."""
    p = bench_subparsers.add_parser(
        "trace",
        help="prefix-hit ratio of eviction policies on traces (choose a policy)",
        description=__doc__.split("\n\n")[1].replace("\n", " ").replace("``", ""),
    )
    p.add_argument(
        "--dataset-path",
        action="append",
        default=[],
        metavar="TRACE.jsonl",
        help="a Mooncake-format JSONL trace (repeatable)",
    )
    p.add_argument(
        "--generate",
        action="append",
        default=[],
        metavar="NAME",
        help="a generated workload of the suite (repeatable; 'suite' = all of them)",
    )
    p.add_argument("--seed", type=int, default=0, help="seed of the generated workloads")
    p.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="replay only the first N requests of a file / generate N requests",
    )
    p.add_argument(
        "--capacities",
        default=DEFAULT_CAPACITIES,
        help=f"comma-separated tier sizes in blocks (default {DEFAULT_CAPACITIES})",
    )
    p.add_argument(
        "--policies", default=None, help="comma-separated policy names (default: all registered)"
    )
    p.add_argument(
        "--no-references", action="store_true", help="skip the infinite and belady references"
    )
    p.add_argument("--output-json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, metavar="FILE.png", help="plot hit ratio vs capacity")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run, check=_check_args)


def _check_args(args: argparse.Namespace) -> tuple[list[int], list[str]]:
    """Every check of the flags before anything runs (a :class:`ConfigError` naming the setting);
    returns the capacities and the policies."""
    from kvoffload.validation import check_int

    check_int("seed", args.seed, 0)
    if args.num_requests is not None:
        check_int("num_requests", args.num_requests, 1)
    for setting, path in (("output_json", args.output_json), ("plot", args.plot)):
        if path is not None:
            check_output_path(setting, path)
    _plotting_available(args.plot)
    return _capacities(args.capacities), _policies(args.policies)


def _plotting_available(path: str | None) -> None:
    """Refuse ``--plot`` without matplotlib before anything runs, not after the replay."""
    from kvoffload.errors import ConfigError

    if path is None:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError(
            "plot", "needs matplotlib: pip install 'kvoffload[plot]' (or matplotlib)"
        ) from None


def _capacities(text: str) -> list[int]:
    from kvoffload.errors import ConfigError

    try:
        capacities = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise ConfigError("capacities", f"give block counts like 1000,4000; got {text!r}") from None
    if not capacities or min(capacities) <= 0:
        raise ConfigError("capacities", f"give positive block counts; got {text!r}")
    return capacities


def _policies(text: str | None) -> list[str]:
    from kvoffload.errors import ConfigError
    from kvoffload.eviction import available_eviction_policies

    registered = available_eviction_policies()
    if text is None:
        return registered
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = sorted(set(names) - set(registered))
    if unknown or not names:
        raise ConfigError("policies", f"unknown {unknown or text!r}; registered: {registered}")
    return names


def _traces(args: argparse.Namespace) -> list[tuple[str, list[list[int]]]]:
    from kvoffload.benchmark import traces
    from kvoffload.benchmark.hit_rate import load_trace
    from kvoffload.errors import ConfigError

    names = []
    for name in args.generate:
        names += sorted(traces.SUITE) if name == "suite" else [name]
    unknown = sorted(set(names) - set(traces.SUITE))
    if unknown:
        raise ConfigError("generate", f"unknown {unknown}; choose from {sorted(traces.SUITE)}")
    if not names and not args.dataset_path:
        raise ConfigError(
            "dataset_path", "give a trace with --dataset-path FILE or --generate NAME (or suite)"
        )
    out = [(Path(p).stem, load_trace(p, args.num_requests)) for p in args.dataset_path]
    for name in names:
        records = traces.generate(name, args.seed, args.num_requests)
        out.append((f"{name} (seed {args.seed})", [r["hash_ids"] for r in records]))
    return out


def _row(label: str, values: list[float], fmt: str = ".4f", extra: str = "") -> str:
    return f"{label:<22}" + "".join(f"{v:>{_WIDTH}{fmt}}" for v in values) + extra


def replay_trace(
    requests: list[list[int]],
    capacities: list[int],
    policies: list[str],
    references: bool,
    bar: Any,
) -> dict[str, Any]:
    """Every policy (and the references) at every capacity on one trace."""
    from kvoffload.benchmark.hit_rate import (
        belady_hit_ratio,
        block_keys,
        infinite_hit_ratio,
        replay,
    )

    keys = block_keys(requests)
    result: dict[str, Any] = {
        "requests": len(requests),
        "blocks": sum(len(ids) for ids in requests),
        "distinct_blocks": len(keys),
        "capacities": capacities,
        "policies": {},
        "replay_s": {},
    }
    if references:
        result["infinite"] = infinite_hit_ratio(requests)
        result["belady"] = [belady_hit_ratio(requests, c) for c in capacities]
    progress = None if bar is None else bar.update
    for name in policies:
        start = time.perf_counter()
        result["policies"][name] = [replay(requests, keys, name, c, progress) for c in capacities]
        result["replay_s"][name] = time.perf_counter() - start
    return result


def format_trace(name: str, result: dict[str, Any]) -> str:
    """The tables of one trace."""
    from kvoffload.benchmark.hit_rate import gap_closed

    capacities = result["capacities"]
    lines = [
        f"trace {name}: {result['requests']} requests, {result['blocks']} blocks, "
        f"{result['distinct_blocks']} distinct",
        "block-level prefix-hit ratio (hits / blocks)",
        "",
        f"{'policy':<22}" + "".join(f"{c:>{_WIDTH}}" for c in capacities) + "   replay s",
    ]
    if "infinite" in result:
        lines.append(_row("infinite (reference)", [result["infinite"]] * len(capacities)))
        lines.append(_row("belady (reference)", result["belady"]))
    for policy, row in result["policies"].items():
        lines.append(_row(policy, row, extra=f"{result['replay_s'][policy]:>11.1f}"))
    base = result["policies"].get("lru")
    if base is not None:
        lines += ["", "ratio to lru"]
        for policy, row in result["policies"].items():
            lines.append(
                _row(
                    policy,
                    [r / b if b else float("nan") for r, b in zip(row, base, strict=True)],
                    ".2f",
                )
            )
        if "belady" in result:
            lines += ["", "share of the LRU -> Belady gap closed"]
            for policy, row in result["policies"].items():
                shares = [
                    gap_closed(r, b, o) for r, b, o in zip(row, base, result["belady"], strict=True)
                ]
                lines.append(_row(policy, shares, ".2f"))
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], path: str) -> None:
    """Hit ratio against capacity, one panel per trace, one line per policy and reference."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(results)
    cols = min(3, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5 * cols, 3.8 * rows), squeeze=False)
    for ax, (name, result) in zip(axes.flat, results.items(), strict=False):
        capacities = result["capacities"]
        if "infinite" in result:
            ax.plot(capacities, [result["infinite"]] * len(capacities), "k--", label="infinite")
            ax.plot(capacities, result["belady"], "k:", marker="x", label="belady")
        for policy, row in result["policies"].items():
            ax.plot(capacities, row, marker="o", label=policy)
        ax.set_xscale("log")
        ax.set_title(name)
        ax.set_xlabel("tier capacity (blocks)")
        ax.set_ylabel("prefix-hit ratio")
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    axes.flat[0].legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, format="png", dpi=100)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from kvoffload.errors import KVOffloadError

    try:
        capacities, policies = _check_args(args)
        traces = _traces(args)
        total = sum(len(reqs) for _, reqs in traces) * len(capacities) * len(policies)
        bar = (
            None
            if args.no_progress
            else tqdm(total=total, desc="replay", unit="req", file=sys.stderr, leave=False)
        )
        results: dict[str, dict[str, Any]] = {}
        for name, requests in traces:
            results[name] = replay_trace(
                requests, capacities, policies, not args.no_references, bar
            )
            if bar is not None:
                bar.clear()
            print(format_trace(name, results[name]) + "\n", flush=True)
        if bar is not None:
            bar.close()
        if args.output_json:
            payload = {"args": vars(args) | {"func": None, "check": None}, "traces": results}
            Path(args.output_json).write_text(json.dumps(payload, indent=2))
        if args.plot:
            plot(results, args.plot)
    except KVOffloadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0

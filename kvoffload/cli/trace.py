"""``kvoffload bench trace``: replay traces through every eviction policy, to choose one.

Each trace (a Mooncake-format JSONL file, ``--dataset-path``, or a generated workload of the
suite, ``--generate``) is replayed through a real ``CPUOffloadingManager`` per policy and tier
size; the ``infinite`` and ``belady`` references bound what any policy can reach. Prints a table
per trace (hit ratio, ratio to LRU, share of the LRU -> Belady gap closed), and optionally writes
JSON and a plot of hit ratio against capacity.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

from kvoffload.cli.args import check_output_path, int_in
from kvoffload.cli.command import command
from kvoffload.cli.flagspec import Flag, add_flags, resolve_flags

__all__ = ["TRACE_FLAGS", "add_parser", "run"]

DEFAULT_CAPACITIES = "250,1000,4000,16000,64000"
_WIDTH = 10


TRACE_FLAGS: tuple[Flag, ...] = (
    Flag(
        "dataset_path",
        "a Mooncake-format JSONL trace (repeatable)",
        unit="TRACE.jsonl",
        kind="append",
        default=(),
        unset="none",
    ),
    Flag(
        "generate",
        "a generated workload of the suite (repeatable; 'suite' = all of them)",
        unit="NAME",
        kind="append",
        default=(),
        unset="none",
    ),
    Flag("seed", "seed of the generated workloads", parse=int_in(0), default=0, unit="N"),
    Flag(
        "num_prompts",
        "replay only the first N requests of a file / generate N requests",
        parse=int_in(1),
        unit="N",
        aliases=("--num-requests",),
        unset="a file's every request; each generator's own count",
    ),
    Flag(
        "capacities",
        "comma-separated tier sizes in blocks",
        default=DEFAULT_CAPACITIES,
        unit="BLOCKS,...",
    ),
    Flag("policies", "comma-separated policy names", unit="NAME,...", unset="all registered"),
    Flag("no_references", "skip the infinite and belady references", kind="switch"),
    Flag("output_json", "write the results here", unit="FILE", unset="none"),
    Flag("plot", "plot hit ratio vs capacity", unit="FILE.png", unset="none"),
    Flag("no_progress", "no progress bar", kind="switch"),
)


def add_parser(bench_subparsers: Any) -> None:
    """Register ``trace`` under ``kvoffload bench``."""
    p = bench_subparsers.add_parser(
        "trace",
        help="prefix-hit ratio of eviction policies on traces (choose a policy)",
        description=__doc__.split("\n\n")[1].replace("\n", " ").replace("``", ""),
    )
    add_flags(p, TRACE_FLAGS)
    p.set_defaults(func=run, check=_check_args, parser=p)


def _check_args(
    args: argparse.Namespace,
) -> tuple[argparse.Namespace, list[int], list[str], list[str]]:
    """Every check of the flags before anything runs (a :class:`ConfigError` naming the setting);
    returns the resolved flags, the capacities, the policies and the generated workloads."""
    flags = resolve_flags(args)
    for setting, path in (("output_json", flags.output_json), ("plot", flags.plot)):
        if path is not None:
            check_output_path(setting, path)
    _plotting_available(flags.plot)
    return flags, _capacities(flags.capacities), _policies(flags.policies), _generated(flags)


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


def _generated(flags: argparse.Namespace) -> list[str]:
    """The generated workloads asked for; :class:`ConfigError` for an unknown one or none at
    all (and no file)."""
    from kvoffload.benchmark import traces
    from kvoffload.errors import ConfigError

    names = []
    for name in flags.generate:
        names += sorted(traces.SUITE) if name == "suite" else [name]
    unknown = sorted(set(names) - set(traces.SUITE))
    if unknown:
        raise ConfigError("generate", f"unknown {unknown}; choose from {sorted(traces.SUITE)}")
    if not names and not flags.dataset_path:
        raise ConfigError(
            "dataset_path", "give a trace with --dataset-path FILE or --generate NAME (or suite)"
        )
    return names


def _traces(flags: argparse.Namespace, names: list[str]) -> list[tuple[str, list[list[int]]]]:
    """Every trace: the files', read (saying so unless ``--no-progress``), then the generated."""
    from kvoffload.benchmark import traces
    from kvoffload.benchmark.hit_rate import load_trace

    out = []
    for path in flags.dataset_path:
        if not flags.no_progress:
            print(f"reading {path}", file=sys.stderr, flush=True)
        out.append((Path(path).stem, load_trace(path, flags.num_prompts)))
    for name in names:
        records = traces.generate(name, flags.seed, flags.num_prompts)
        out.append((f"{name} (seed {flags.seed})", [r["hash_ids"] for r in records]))
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


@command
def run(args: argparse.Namespace) -> int:
    from kvoffload.benchmark.report import write_json

    flags, capacities, policies, generated = _check_args(args)
    traces = _traces(flags, generated)
    results = _replay_all(flags, traces, capacities, policies)
    if flags.output_json:
        shown = {k: v for k, v in vars(flags).items() if k not in ("func", "check", "parser")}
        write_json(flags.output_json, {"args": shown, "traces": results})
    if flags.plot:
        plot(results, flags.plot)
    return 0


def _replay_all(
    flags: argparse.Namespace,
    traces: list[tuple[str, list[list[int]]]],
    capacities: list[int],
    policies: list[str],
) -> dict[str, dict[str, Any]]:
    """Every trace replayed, its tables printed as it ends (a progress bar on stderr unless
    ``--no-progress``, closed however the replay ends)."""
    from tqdm import tqdm

    total = sum(len(reqs) for _, reqs in traces) * len(capacities) * len(policies)
    bar = (
        None
        if flags.no_progress
        else tqdm(total=total, desc="replay", unit="req", file=sys.stderr, leave=False)
    )
    results: dict[str, dict[str, Any]] = {}
    try:
        for name, requests in traces:
            results[name] = replay_trace(
                requests, capacities, policies, not flags.no_references, bar
            )
            if bar is not None:
                bar.clear()
            print(format_trace(name, results[name]) + "\n", flush=True)
    finally:
        if bar is not None:
            bar.close()
    return results

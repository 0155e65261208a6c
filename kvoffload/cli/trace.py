"""``kvoffload bench trace``: replay traces through every eviction policy, to choose one.

Each trace (a Mooncake-format JSONL file, ``--dataset-path``: ``.jsonl``, ``.jsonl.gz`` or ``-``
for stdin; or a generated workload of the suite, ``--generate``) is replayed through a real
``CPUOffloadingManager`` per policy and tier size; the ``infinite`` and ``belady`` references
bound what any policy can reach. Prints a table per trace (token-weighted hit rate, ratio to LRU,
share of the LRU -> Belady gap closed), and optionally writes JSON with the run's settings and a
plot of hit rate against capacity. Tier sizes are in blocks, or in GiB through a model's KV shape;
``--warmup-fraction`` scores only the end of each trace.

Imports no torch and no engine: it starts at once.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvoffload.benchmark.kv_shape import DTYPE_BYTES, GIB, KNOWN_SHAPES, KVShape, blocks_for_gib
from kvoffload.cli.args import check_output_path, int_in, real_in
from kvoffload.cli.command import command
from kvoffload.cli.flagspec import Flag, Needs, add_flags, resolve_flags
from kvoffload.errors import ConfigError

if TYPE_CHECKING:
    from kvoffload.benchmark.trace_score import ScoredTrace

__all__ = ["TRACE_FLAGS", "add_parser", "run"]

DEFAULT_CAPACITIES = "250,1000,4000,16000,64000"
_SHAPE_FLAGS = ("kv_shape", "kv_layers", "kv_heads", "head_dim")


def _has_shape(flags: argparse.Namespace, provided: object) -> bool:
    return any(getattr(flags, f) is not None for f in _SHAPE_FLAGS)


_NEEDS_SHAPE = Needs("--kv-shape (or --kv-layers, --kv-heads and --head-dim)", _has_shape)

TRACE_FLAGS: tuple[Flag, ...] = (
    Flag(
        "dataset_path",
        "a Mooncake-format JSONL trace: .jsonl, .jsonl.gz, or - for stdin (repeatable)",
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
        group="capacity",
    ),
    Flag(
        "capacities_gib",
        "comma-separated tier sizes in GiB (instead of --capacities), in blocks of the KV shape",
        unit="GIB,...",
        needs=_NEEDS_SHAPE,
        group="capacity",
        unset="none",
    ),
    Flag(
        "kv_shape",
        "a well-known model's KV shape (layers, KV heads, head dim), to size blocks in bytes: "
        + ", ".join(sorted(KNOWN_SHAPES)),
        choices=sorted(KNOWN_SHAPES),
        unit="MODEL",
        unset="none",
    ),
    Flag(
        "kv_layers",
        "decoder layers of the KV shape (overrides --kv-shape's)",
        parse=int_in(1),
        unit="N",
        unset="--kv-shape's",
    ),
    Flag(
        "kv_heads",
        "KV heads per layer of the KV shape (overrides --kv-shape's)",
        parse=int_in(1),
        unit="N",
        unset="--kv-shape's",
    ),
    Flag(
        "head_dim",
        "head dimension of the KV shape (overrides --kv-shape's)",
        parse=int_in(1),
        unit="N",
        unset="--kv-shape's",
    ),
    Flag(
        "kv_dtype",
        "dtype of the KV cache",
        choices=tuple(DTYPE_BYTES),
        default="bf16",
        unit="|".join(DTYPE_BYTES),
        needs=_NEEDS_SHAPE,
    ),
    Flag(
        "block_size",
        "tokens per trace block (hash id): splits input_length into per-block token weights and "
        "sizes a block in bytes",
        parse=int_in(1),
        default=512,
        unit="TOKENS",
    ),
    Flag(
        "warmup_fraction",
        "replay this leading share of each trace without scoring it, and skip capacities it "
        "never fills (0.5: kvcache-simulator's window)",
        parse=real_in(0, below=1),
        default=0.0,
        unit="F",
    ),
    Flag(
        "weight",
        "what the tables and plot show: hit tokens / input tokens (token counts from "
        "input_length), or hit blocks / blocks",
        choices=("tokens", "blocks"),
        default="tokens",
        unit="tokens|blocks",
    ),
    Flag("policies", "comma-separated policy names", unit="NAME,...", unset="all registered"),
    Flag("no_references", "skip the infinite and belady references", kind="switch"),
    Flag("output_json", "write the results and the run's settings here", unit="FILE", unset="none"),
    Flag("plot", "plot hit rate vs capacity", unit="FILE.png", unset="none"),
    Flag("no_progress", "no progress bar", kind="switch"),
)


def add_parser(bench_subparsers: Any) -> None:
    """Register ``trace`` under ``kvoffload bench``."""
    p = bench_subparsers.add_parser(
        "trace",
        help="prefix-hit rate of eviction policies on traces (choose a policy)",
        description=__doc__.split("\n\n")[1].replace("\n", " ").replace("``", ""),
    )
    add_flags(p, TRACE_FLAGS)
    p.set_defaults(func=run, check=_check_args, parser=p)


@dataclass(frozen=True)
class _Settings:
    """The checked run: the resolved ``flags``, ``capacities`` (blocks), ``gib`` (each capacity
    in GiB, empty without a KV shape), ``shape`` (``None`` without one), ``policies`` and
    ``generated`` (workload names)."""

    flags: argparse.Namespace
    capacities: list[int]
    gib: list[float]
    shape: KVShape | None
    policies: list[str]
    generated: list[str]


def _check_args(args: argparse.Namespace) -> _Settings:
    """Every check of the flags before anything runs (a :class:`ConfigError` naming the
    setting): the settings of the run."""
    flags = resolve_flags(args)
    for setting, path in (("output_json", flags.output_json), ("plot", flags.plot)):
        if path is not None:
            check_output_path(setting, path)
    _plotting_available(flags.plot)
    if list(flags.dataset_path).count("-") > 1:
        raise ConfigError("dataset_path", "standard input (-) can be read only once")
    shape = _shape(flags)
    capacities, gib = _sizes(flags, shape)
    return _Settings(
        flags=flags,
        capacities=capacities,
        gib=gib,
        shape=shape,
        policies=_policies(flags.policies),
        generated=_generated(flags),
    )


def _plotting_available(path: str | None) -> None:
    """Refuse ``--plot`` without matplotlib before anything runs, not after the replay."""
    if path is None:
        return
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        raise ConfigError(
            "plot", "needs matplotlib: pip install 'kvoffload[plot]' (or matplotlib)"
        ) from None


def _shape(flags: argparse.Namespace) -> KVShape | None:
    """The KV shape the flags name (``None`` when none): ``--kv-shape``'s, its fields
    overridden by ``--kv-layers``/``--kv-heads``/``--head-dim``; without ``--kv-shape`` all three
    are needed."""
    if not _has_shape(flags, ()):
        return None
    fields = {"layers": flags.kv_layers, "kv_heads": flags.kv_heads, "head_dim": flags.head_dim}
    if flags.kv_shape is None:
        missing = [f"--{k.replace('_', '-')}" for k, v in fields.items() if v is None]
        if missing:
            raise ConfigError(
                "kv_shape", f"give --kv-shape MODEL, or all of {', '.join(missing)} too"
            )
        return KVShape("custom", dtype=flags.kv_dtype, **fields)
    known = KNOWN_SHAPES[flags.kv_shape]
    given = {k: v for k, v in fields.items() if v is not None}
    name = known.name if not given else f"{known.name} (modified)"
    base = {"layers": known.layers, "kv_heads": known.kv_heads, "head_dim": known.head_dim}
    return KVShape(name, dtype=flags.kv_dtype, **(base | given))


def _sizes(flags: argparse.Namespace, shape: KVShape | None) -> tuple[list[int], list[float]]:
    """The capacities in blocks, and in GiB when there is a KV shape."""
    if flags.capacities_gib is None:
        capacities = _capacities(flags.capacities)
        if shape is None:
            return capacities, []
        per_block = shape.bytes_per_token * flags.block_size
        return capacities, [c * per_block / GIB for c in capacities]
    if shape is None:  # resolve_flags refused --capacities-gib without one
        raise ConfigError("capacities_gib", f"needs {_NEEDS_SHAPE.text}")
    try:
        gib = [float(g) for g in flags.capacities_gib.split(",") if g.strip()]
    except ValueError:
        gib = []
    if not gib or not all(0 < g < float("inf") for g in gib):
        raise ConfigError(
            "capacities_gib",
            f"give positive sizes in GiB like 1,4,16; got {flags.capacities_gib!r}",
        )
    capacities = [blocks_for_gib(g, shape, flags.block_size) for g in gib]
    if min(capacities) < 1:
        raise ConfigError(
            "capacities_gib",
            f"{gib[capacities.index(min(capacities))]:g} GiB holds no whole block of "
            f"{flags.block_size} tokens of {shape.name} "
            f"({shape.bytes_per_token * flags.block_size / 2**20:g} MiB each)",
        )
    return capacities, gib


def _capacities(text: str) -> list[int]:
    try:
        capacities = [int(c) for c in text.split(",") if c.strip()]
    except ValueError:
        raise ConfigError("capacities", f"give block counts like 1000,4000; got {text!r}") from None
    if not capacities or min(capacities) <= 0:
        raise ConfigError("capacities", f"give positive block counts; got {text!r}")
    return capacities


def _policies(text: str | None) -> list[str]:
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


def _traces(settings: _Settings) -> list[tuple[str, ScoredTrace]]:
    """Every trace, scored as the flags say: the files', read (saying so unless
    ``--no-progress``), then the generated."""
    from kvoffload.benchmark import traces
    from kvoffload.benchmark.trace_file import STDIN, read_trace
    from kvoffload.benchmark.trace_score import ScoredTrace

    flags = settings.flags
    out = []
    for path in flags.dataset_path:
        if not flags.no_progress:
            print(f"reading {'stdin' if path == STDIN else path}", file=sys.stderr, flush=True)
        records = read_trace(path, flags.num_prompts, flags.block_size)
        scored = ScoredTrace.build(
            [r.hash_ids for r in records],
            [r.input_length for r in records],
            flags.block_size,
            flags.warmup_fraction,
        )
        out.append((_trace_name(path), scored))
    for name in settings.generated:
        generated = traces.generate(name, flags.seed, flags.num_prompts)
        scored = ScoredTrace.build(
            [r["hash_ids"] for r in generated],
            [r["input_length"] for r in generated],
            flags.block_size,
            flags.warmup_fraction,
        )
        out.append((f"{name} (seed {flags.seed})", scored))
    return out


def _trace_name(path: str) -> str:
    """``conversation_trace`` for ``.../conversation_trace.jsonl(.gz)``; ``stdin`` for ``-``."""
    if path == "-":
        return "stdin"
    name = Path(path).name.removesuffix(".gz")
    return name.rsplit(".", 1)[0] if "." in name else name


@command
def run(args: argparse.Namespace) -> int:
    settings = _check_args(args)
    flags = settings.flags
    traces = _traces(settings)
    results = _replay_all(settings, traces)
    if flags.output_json:
        _write_json(flags.output_json, settings, results)
    if flags.plot:
        from kvoffload.benchmark.trace_replay import METRICS
        from kvoffload.benchmark.trace_report import plot_traces

        plot_traces(results, flags.plot, METRICS[flags.weight], settings.gib)
    return 0


def _replay_all(
    settings: _Settings, traces: list[tuple[str, ScoredTrace]]
) -> dict[str, dict[str, Any]]:
    """Every trace replayed, its tables printed as it ends (a progress bar on stderr unless
    ``--no-progress``, closed however the replay ends)."""
    from tqdm import tqdm

    from kvoffload.benchmark.trace_replay import METRICS, replay_trace
    from kvoffload.benchmark.trace_report import format_trace

    flags = settings.flags
    total = sum(
        len(scored.requests) * sum(map(scored.filled, settings.capacities)) for _, scored in traces
    ) * len(settings.policies)
    bar = (
        None
        if flags.no_progress
        else tqdm(total=total, desc="replay", unit="req", file=sys.stderr, leave=False)
    )
    results: dict[str, dict[str, Any]] = {}
    try:
        for name, scored in traces:
            results[name] = replay_trace(
                scored,
                settings.capacities,
                settings.policies,
                not flags.no_references,
                flags.weight,
                None if bar is None else bar.update,
            )
            if bar is not None:
                bar.clear()
            table = format_trace(name, results[name], METRICS[flags.weight], settings.gib)
            print(table + "\n", flush=True)
    finally:
        if bar is not None:
            bar.close()
    return results


def _write_json(path: str, settings: _Settings, results: dict[str, dict[str, Any]]) -> None:
    """The results with the run's settings; :class:`ConfigError` naming ``output_json`` when the
    file cannot be written."""
    flags = settings.flags
    shown = {k: v for k, v in vars(flags).items() if k not in ("func", "check", "parser")}
    payload = {
        "settings": {
            "block_size": flags.block_size,
            "warmup_fraction": flags.warmup_fraction,
            "weight": flags.weight,
            "kv_shape": (
                None if settings.shape is None else settings.shape.as_json(flags.block_size)
            ),
            "capacities": settings.capacities,
            "capacities_gib": settings.gib or None,
            "policies": settings.policies,
            "references": not flags.no_references,
        },
        "args": shown,
        "traces": results,
    }
    try:
        Path(path).write_text(json.dumps(payload, indent=2, default=str))
    except OSError as exc:
        raise ConfigError("output_json", f"cannot write {path!r}: {exc.strerror or exc}") from exc

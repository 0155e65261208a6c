"""Offline throughput of the reference engine on a workload, with and without offloading."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from kvoffload.benchmark.datasets import BenchRequest
from kvoffload.engine import Engine, SamplingParams
from kvoffload.errors import ConfigError

__all__ = [
    "ThroughputResult",
    "format_comparison",
    "format_result",
    "run_throughput",
    "unlimited_device_blocks",
]

_MIB = 2**20


@dataclass
class ThroughputResult:
    """One run's figures. Token counts cover the measured requests only (not the warm-up)."""

    label: str
    elapsed_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    cached_tokens_engine: int
    cached_tokens_offload: int
    mean_ttft_s: float
    p90_ttft_s: float
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def requests_per_s(self) -> float:
        return self.num_requests / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.elapsed_s

    @property
    def output_tokens_per_s(self) -> float:
        return self.output_tokens / self.elapsed_s

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out.update(
            requests_per_s=self.requests_per_s,
            total_tokens_per_s=self.total_tokens_per_s,
            output_tokens_per_s=self.output_tokens_per_s,
        )
        return out


def unlimited_device_blocks(requests: Sequence[BenchRequest], block_size: int) -> int:
    """Device blocks that hold every distinct prompt block plus every request's own tail, so
    that nothing is ever evicted (the "ideal" run)."""
    if block_size <= 0:
        raise ConfigError("block_size", f"must be a positive integer, got {block_size}")
    block_ids: dict[tuple[int, tuple[int, ...]], int] = {}  # (parent id, tokens) -> id
    tails = 0
    for r in requests:
        full = len(r.prompt) // block_size
        parent = -1
        for b in range(full):
            parent = block_ids.setdefault(
                (parent, tuple(r.prompt[b * block_size : (b + 1) * block_size])), len(block_ids)
            )
        tails += -(-(len(r.prompt) - full * block_size + r.output_len) // block_size) + 1
    return len(block_ids) + tails


def run_throughput(
    requests: Sequence[BenchRequest],
    label: str,
    engine_kwargs: dict[str, Any],
    progress: Callable[[int, str], Any] | None = None,
) -> ThroughputResult:
    """Build an engine, warm it up, run every request to completion and time it.

    ``progress(total, label)`` returns a tqdm-like bar (``update``, ``close``) or ``None``.
    The clock stops when the last request finishes; stores still in flight are then drained so
    that the statistics are complete.
    """
    with Engine(**engine_kwargs) as engine:
        vocab = engine.model_config.vocab_size
        # Warm up at full step size: torch's first large forward pass costs seconds (allocator
        # growth, kernel selection) that would otherwise land on whichever run comes first.
        longest = max(len(r.prompt) for r in requests)
        capacity = engine.num_device_blocks * engine.config.block_size // 2
        warm_len = max(1, min(engine.config.max_num_batched_tokens, longest, capacity - 2))
        warm = [[(7 * i + 3) % (vocab - 2) + 1 for i in range(warm_len)]]
        engine.generate(warm, SamplingParams(max_tokens=2, ignore_eos=True))
        engine.drain()
        before = engine.stats()
        params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True) for r in requests]
        bar = progress(len(requests), label) if progress is not None else None
        start = time.perf_counter()
        outputs = engine.generate([r.prompt for r in requests], params, progress=bar)
        elapsed = time.perf_counter() - start
        if bar is not None:
            bar.close()
        engine.drain()
        after = engine.stats()
    stats = {k: after[k] - before.get(k, 0) for k in after}
    ttfts = sorted(o.ttft for o in outputs)
    return ThroughputResult(
        label=label,
        elapsed_s=elapsed,
        num_requests=len(outputs),
        prompt_tokens=sum(o.num_prompt_tokens for o in outputs),
        output_tokens=sum(len(o.output_token_ids) for o in outputs),
        cached_tokens_engine=sum(o.cached_tokens_engine for o in outputs),
        cached_tokens_offload=sum(o.cached_tokens_offload for o in outputs),
        mean_ttft_s=statistics.fmean(ttfts),
        p90_ttft_s=ttfts[int(0.9 * (len(ttfts) - 1))],
        stats=stats,
    )


def format_result(r: ThroughputResult) -> str:
    """vLLM's three summary lines, then where prompt tokens came from and what offloading moved."""
    lines = [
        f"Throughput: {r.requests_per_s:.2f} requests/s, {r.total_tokens_per_s:.2f} total tokens/s, "
        f"{r.output_tokens_per_s:.2f} output tokens/s",
        f"Total num prompt tokens:  {r.prompt_tokens}",
        f"Total num output tokens:  {r.output_tokens}",
        f"Prefix hit tokens: {r.cached_tokens_engine} from the engine cache, {r.cached_tokens_offload} from "
        f"the offloaded tier, {r.prompt_tokens - r.cached_tokens_engine - r.cached_tokens_offload} computed",
        f"Time to first token: mean {r.mean_ttft_s:.3f} s, p90 {r.p90_ttft_s:.3f} s; "
        f"preemptions {int(r.stats.get('preemptions', 0))}",
    ]
    s = r.stats
    if "offload_store_jobs" in s:
        lines += [
            f"Offloading: stored {int(s['offload_stored_blocks'])} blocks ({s['offload_store_bytes'] / _MIB:.1f} MiB) in "
            f"{s['offload_store_seconds']:.2f} s, loaded {int(s['offload_loaded_blocks'])} blocks "
            f"({s['offload_load_bytes'] / _MIB:.1f} MiB) in {s['offload_load_seconds']:.2f} s",
            f"Offloaded tier: {int(s['offload_tier_evicted_blocks'])} evictions, "
            f"{int(s['offload_failed_loads'])} failed loads, {int(s['offload_failed_stores'])} failed stores, "
            f"{int(s['offload_rejected_stores'])} stores refused (tier full)",
        ]
    if "offload_tier_disk_stored_blocks" in s:
        lines.append(
            f"Disk tier: {int(s['offload_tier_disk_stored_blocks'])} blocks written, "
            f"{int(s['offload_tier_promoted_blocks'])} promoted to the host tier "
            f"({int(s['offload_tier_failed_promotion_blocks'])} failed, "
            f"{int(s['offload_tier_refused_promotion_blocks'])} refused), "
            f"{int(s['offload_tier_disk_evicted_blocks'])} evictions, "
            f"{int(s['offload_retries'])} deferred lookups"
        )
    return "\n".join(lines)


def format_comparison(results: Sequence[ThroughputResult]) -> str:
    """The runs side by side, with ratios against the first (no offloading) and the last (ideal)."""
    width = max(24, *(len(r.label) + 2 for r in results))
    rows = [
        ("requests/s", lambda r: f"{r.requests_per_s:.3f}"),
        ("total tokens/s", lambda r: f"{r.total_tokens_per_s:.1f}"),
        ("output tokens/s", lambda r: f"{r.output_tokens_per_s:.1f}"),
        ("elapsed s", lambda r: f"{r.elapsed_s:.2f}"),
        ("engine-cache hit tokens", lambda r: str(r.cached_tokens_engine)),
        ("offloaded-tier hit tokens", lambda r: str(r.cached_tokens_offload)),
        ("mean TTFT s", lambda r: f"{r.mean_ttft_s:.3f}"),
    ]
    out = [f"{'':<26}" + "".join(f"{r.label:>{width}}" for r in results)]
    for name, cell in rows:
        out.append(f"{name:<26}" + "".join(f"{cell(r):>{width}}" for r in results))
    base, ideal = results[0], results[-1]
    out.append("")
    for r in results[1:]:
        line = f"{r.label}: {r.requests_per_s / base.requests_per_s:.2f}x the throughput of {base.label}"
        if r is not ideal:
            line += f", {100 * r.requests_per_s / ideal.requests_per_s:.1f}% of {ideal.label}"
        out.append(line)
    return "\n".join(out)

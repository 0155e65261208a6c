"""The periodic engine stats line (like vLLM's ``Avg prompt throughput: ...`` line)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Mapping

from kvoffload.metrics.engine_collector import Snapshot
from kvoffload.metrics.stats import hit_rates, stats_delta, tokens_by_source

__all__ = ["StatsLogger", "format_stats_line"]

logger = logging.getLogger("kvoffload.engine")

_MIB = 2**20


def format_stats_line(
    delta: Mapping[str, float],
    tiers: Mapping[str, Mapping[str, float]],
    seconds: float,
    block_bytes: int,
) -> str:
    """One line over an interval of ``seconds`` whose counters moved by ``delta``."""
    per_s = 1.0 / seconds if seconds > 0 else 0.0
    parts = [
        f"Avg prompt throughput: {delta.get('prefilled_prompt_tokens', 0) * per_s:.1f} tokens/s",
        f"Avg generation throughput: {delta.get('output_tokens', 0) * per_s:.1f} tokens/s",
        f"Running: {int(delta.get('num_running', 0))} reqs",
        f"Waiting: {int(delta.get('num_waiting', 0))} reqs",
    ]
    if delta.get("preemptions"):
        parts.append(f"Preemptions: {int(delta['preemptions'])}")
    total = delta.get("device_blocks", 0)
    if total:
        parts.append(
            f"Device KV cache usage: {100 * delta.get('device_used_blocks', 0) / total:.1f}%"
        )
    rates = hit_rates(delta)
    if rates["prefix_cache"] is not None:
        parts.append(f"Prefix cache hit rate: {100 * rates['prefix_cache']:.1f}%")
    if rates["external"] is not None and "offload_load_jobs" in delta:
        parts.append(f"External prefix cache hit rate: {100 * rates['external']:.1f}%")
    sources = tokens_by_source(delta)
    if any(sources.values()):
        parts.append(
            "Tokens by source: "
            + ", ".join(f"{k} {v}" for k, v in sources.items() if v or k in ("computed", "device"))
        )
    for tier, s in tiers.items():
        capacity = s.get("capacity_bytes", s.get("capacity_blocks", 0) * block_bytes)
        used = s.get("used_bytes", s.get("used_blocks", 0) * block_bytes)
        if capacity:
            parts.append(f"{tier} tier usage: {100 * used / capacity:.1f}%")
    if "offload_load_bytes" in delta:
        parts.append(
            f"Offload load: {delta['offload_load_bytes'] * per_s / _MIB:.1f} MiB/s, "
            f"store: {delta.get('offload_store_bytes', 0) * per_s / _MIB:.1f} MiB/s"
        )
    return ", ".join(parts)


class StatsLogger:
    """Logs :func:`format_stats_line` every ``interval`` seconds when :meth:`maybe_log` is called
    (once per engine step; between lines it costs one clock read)."""

    def __init__(self, snapshot: Callable[[], Snapshot], interval: float, block_bytes: int) -> None:
        self._snapshot = snapshot
        self._interval = interval
        self._block_bytes = block_bytes
        self._last_time = time.monotonic()
        self._last_stats: Mapping[str, float] = snapshot()[0]

    def maybe_log(self) -> None:
        now = time.monotonic()
        if now - self._last_time < self._interval:
            return
        stats, tiers = self._snapshot()
        line = format_stats_line(
            stats_delta(self._last_stats, stats), tiers, now - self._last_time, self._block_bytes
        )
        self._last_time, self._last_stats = now, stats
        logger.info("%s", line)

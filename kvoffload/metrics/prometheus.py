"""Prometheus metrics of one engine, in a registry of its own (see ``docs/metrics.md``).

Counters and gauges are read from the engine's own statistics at scrape time (a custom
collector over a ``snapshot`` callable), so a scraped value always equals the engine's counter;
per-tier series come from :meth:`~kvoffload.manager_contract.OffloadingManager.tier_stats` with a ``tier``
label. Latency and size distributions are histograms observed as requests and transfers finish.
The collector: :mod:`~kvoffload.metrics.engine_collector` (engine-wide series) and
:mod:`~kvoffload.metrics.tier_series` (per tier).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Histogram

from kvoffload.metrics.engine_collector import Snapshot, StatsCollector
from kvoffload.transfer import TransferResult

__all__ = ["EngineMetrics"]

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
_TRANSFER_SECONDS_BUCKETS = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
_TRANSFER_SIZE_BUCKETS = (1e5, 1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)


class EngineMetrics:
    """One engine's metrics. ``registry`` is private to it (engines never share series).

    ``snapshot()`` must return the engine's stats and stats per tier taken between two steps;
    the ``observe_*`` methods are called on the engine thread. Transfer series of
    ``directions`` (``(src, dst)`` media) exist from the start, at zero.
    """

    def __init__(
        self,
        snapshot: Callable[[], Snapshot],
        block_bytes: int,
        directions: Iterable[tuple[str, str]] = (),
    ) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._stats = StatsCollector(snapshot, block_bytes)
        self.registry.register(self._stats)
        self._directions: dict[tuple[str, str], tuple[Any, Any]] = {}
        self._add_histograms()
        for direction in directions:
            self._children(direction)

    def _add_histograms(self) -> None:
        reg = self.registry
        self.ttft = Histogram(
            "kvoffload_time_to_first_token_seconds",
            "Seconds from a request's arrival to its first output token.",
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.itl = Histogram(
            "kvoffload_inter_token_latency_seconds",
            "Seconds between two consecutive output tokens of a request.",
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.e2e = Histogram(
            "kvoffload_e2e_request_latency_seconds",
            "Seconds from a request's arrival to its end.",
            buckets=_LATENCY_BUCKETS,
            registry=reg,
        )
        self.transfer_seconds = Histogram(
            "kvoffload_offload_transfer_seconds",
            "Copy time of one transfer job, by direction (GPU_to_CPU = store, CPU_to_GPU = load).",
            ["direction"],
            buckets=_TRANSFER_SECONDS_BUCKETS,
            registry=reg,
        )
        self.transfer_size = Histogram(
            "kvoffload_offload_transfer_size_bytes",
            "Bytes moved by one successful transfer job, by direction.",
            ["direction"],
            buckets=_TRANSFER_SIZE_BUCKETS,
            registry=reg,
        )

    def reset(self) -> None:
        """Restart every series from zero now: counters count from this point (a scraper reads
        the drop as a counter reset, as after a restart), histograms start empty. For what
        what happened before does not count (a benchmark's warm-up). Call it on the engine thread."""
        self._stats.rebase()
        for histogram in (self.ttft, self.itl, self.e2e, self.transfer_seconds, self.transfer_size):
            self.registry.unregister(histogram)
        self._add_histograms()
        for direction in list(self._directions):
            self._children(direction)

    def observe_token(self, ttft: float | None, itl: float | None) -> None:
        """One output token: its request's TTFT (first token) or the gap since the previous."""
        if ttft is not None:
            self.ttft.observe(ttft)
        if itl is not None:
            self.itl.observe(itl)

    def observe_finished(self, latency: float) -> None:
        self.e2e.observe(latency)

    def observe_transfers(self, results: Iterable[TransferResult]) -> None:
        for result in results:
            children = self._directions.get(result.direction) or self._children(result.direction)
            if result.success:
                children[0].observe(result.seconds)
                children[1].observe(result.num_bytes)

    def _children(self, direction: tuple[str, str]) -> tuple[Any, Any]:
        label = f"{direction[0] or 'unknown'}_to_{direction[1] or 'unknown'}"
        children = self._directions[direction] = (
            self.transfer_seconds.labels(label),
            self.transfer_size.labels(label),
        )
        return children

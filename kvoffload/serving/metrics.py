"""The server's own Prometheus series, beside the engine's on ``/metrics``.

``kvoffload_serve_step_base_seconds`` and ``kvoffload_serve_token_compute_seconds`` are the
engine's measured cost model (a step of ``n`` forward tokens takes about ``base + n * per
token`` seconds, see :class:`~kvoffload.serving.loop.StepCostModel`); a router turns them into
the time to compute a prompt's missing blocks. The raw sums are there too.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kvoffload.serving.drain import Drain
from kvoffload.serving.loop import EngineLoop

__all__ = ["ServerMetrics"]


class _LoopCollector(Collector):
    def __init__(self, loop: EngineLoop, drain: Drain) -> None:
        self._loop = loop
        self._drain = drain

    def collect(self) -> Iterator[Metric]:
        cost = self._loop.cost
        base, per_token = cost.fit()
        yield GaugeMetricFamily(
            "kvoffload_serve_step_base_seconds",
            "Measured fixed cost of an engine step (seconds ~ base + tokens x per token).",
            value=base,
        )
        yield GaugeMetricFamily(
            "kvoffload_serve_token_compute_seconds",
            "Measured cost of one forward token in an engine step (the fit's slope).",
            value=per_token,
        )
        yield CounterMetricFamily(
            "kvoffload_serve_step_seconds",
            "Seconds spent in engine steps that computed tokens.",
            value=cost.seconds,
        )
        yield CounterMetricFamily(
            "kvoffload_serve_step_tokens", "Forward tokens of those steps.", value=cost.tokens
        )
        yield GaugeMetricFamily(
            "kvoffload_serve_requests_in_flight",
            "Requests added to the engine and not finished.",
            value=self._loop.num_live,
        )
        yield GaugeMetricFamily(
            "kvoffload_serve_http_requests_in_flight",
            "HTTP requests being answered (this scrape included); a drain waits for them.",
            value=self._drain.in_flight,
        )


class ServerMetrics:
    """The server's registry (one per server)."""

    def __init__(self, loop: EngineLoop, drain: Drain) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_LoopCollector(loop, drain))

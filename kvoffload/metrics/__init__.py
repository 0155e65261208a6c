"""What an operator sees: Prometheus metrics, the periodic stats line, and the one definition of
tokens by source and hit rates that every output reads (``docs/metrics.md``)."""

from kvoffload.metrics.engine_collector import Snapshot
from kvoffload.metrics.logline import StatsLogger, format_stats_line
from kvoffload.metrics.prometheus import EngineMetrics
from kvoffload.metrics.server import MetricsServer
from kvoffload.metrics.stats import (
    OFFLOAD_SOURCES,
    SOURCES,
    external_hits,
    hit_rates,
    is_gauge,
    stats_delta,
    tokens_by_source,
)

__all__ = [
    "OFFLOAD_SOURCES",
    "SOURCES",
    "EngineMetrics",
    "MetricsServer",
    "Snapshot",
    "StatsLogger",
    "external_hits",
    "format_stats_line",
    "hit_rates",
    "is_gauge",
    "stats_delta",
    "tokens_by_source",
]

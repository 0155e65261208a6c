"""What an engine shows an operator while it runs: its Prometheus metrics, the ``/metrics``
server and the periodic stats line (``docs/metrics.md``), wired to the engine's snapshots."""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from kvoffload.engine.config import EngineConfig
from kvoffload.metrics import EngineMetrics, MetricsServer, Snapshot, StatsLogger

__all__ = ["Telemetry"]


class _Snapshots(Protocol):
    def snapshot(self) -> Snapshot: ...


@dataclass(frozen=True, slots=True)
class Telemetry:
    """``metrics`` (the engine's own registry), the stats line's logger (``None`` when
    ``log_stats_interval_s`` is 0) and the metrics server (``None`` without ``metrics_port``)."""

    metrics: EngineMetrics
    stats_logger: StatsLogger | None
    metrics_server: MetricsServer | None

    @classmethod
    def start(
        cls,
        engine: _Snapshots,
        config: EngineConfig,
        block_bytes: int,
        offloading: bool,
        owned: list[Callable[[], object]],
    ) -> Telemetry:
        """Wire ``engine.snapshot`` (bound weakly: a metrics server thread must not keep a
        dropped engine alive) to the metrics, the stats logger and, when asked, a server whose
        ``close`` is appended to ``owned``. ``block_bytes``: one offloaded block (0 if none)."""
        snapshot = _weak_snapshot(engine)
        directions = [("GPU", "CPU"), ("CPU", "GPU")] if offloading else []
        metrics = EngineMetrics(snapshot, block_bytes, directions)
        interval = config.log_stats_interval_s
        stats_logger = StatsLogger(snapshot, interval, block_bytes) if interval > 0 else None
        server = None
        if config.metrics_port is not None:
            server = MetricsServer(metrics.registry, config.metrics_port, config.metrics_host)
            owned.append(server.close)
        return cls(metrics, stats_logger, server)


def _weak_snapshot(engine: _Snapshots) -> Callable[[], Snapshot]:
    """``engine.snapshot`` without a strong reference (empty once the engine is gone)."""
    ref = weakref.ref(engine)

    def snapshot() -> Snapshot:
        alive = ref()
        return ({}, {}) if alive is None else alive.snapshot()

    return snapshot

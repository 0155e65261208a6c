"""The Prometheus collector of an engine's counters and gauges (:class:`StatsCollector`): read
from the engine's own statistics at every scrape, so a scraped value always equals the engine's
counter; the per-tier series come from :mod:`~kvoffload.metrics.tier_series`."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from kvoffload.metrics.stats import external_hits, stats_delta, tokens_by_source
from kvoffload.metrics.tier_series import tier_metrics

__all__ = ["Snapshot", "StatsCollector"]

#: ``(engine stats, stats per tier)``, taken consistently (between two engine steps).
Snapshot = tuple[Mapping[str, float], Mapping[str, Mapping[str, float]]]

# (metric name without _total, Engine.stats key, help) of engine-wide counters.
_ENGINE_COUNTERS = (
    (
        "kvoffload_prompt_tokens",
        "prefilled_prompt_tokens",
        "Prompt tokens of requests whose prefill completed (their first token came).",
    ),
    ("kvoffload_generation_tokens", "output_tokens", "Tokens generated."),
    ("kvoffload_engine_steps", "steps", "Engine steps run."),
    ("kvoffload_num_preemptions", "preemptions", "Requests preempted (recomputed or reloaded)."),
    (
        "kvoffload_prefix_cache_queries",
        "prefix_cache_queries",
        "Tokens each admission needed (re-admissions too), in tokens.",
    ),
    (
        "kvoffload_prefix_cache_hits",
        "prefix_cache_hits",
        "Admitted tokens found in the engine's device prefix cache.",
    ),
    (
        "kvoffload_device_evicted_blocks",
        "device_evicted_blocks",
        "Cached blocks evicted from the device prefix cache.",
    ),
    ("kvoffload_events_published", "events_published", "KV event batches published."),
    ("kvoffload_events_dropped", "events_dropped", "KV event batches dropped (queue full)."),
)

# (metric name without _total, connector stats key after "offload_", help).
_OFFLOAD_COUNTERS = (
    (
        "kvoffload_offload_load_bytes",
        "load_bytes",
        "Bytes loaded from the host tier to the device.",
    ),
    (
        "kvoffload_offload_store_bytes",
        "store_bytes",
        "Bytes stored from the device to the host tier.",
    ),
    ("kvoffload_offload_load_seconds", "load_seconds", "Seconds spent in loads (sum over jobs)."),
    (
        "kvoffload_offload_store_seconds",
        "store_seconds",
        "Seconds spent in stores (sum over jobs).",
    ),
    ("kvoffload_offload_load_jobs", "load_jobs", "Load jobs submitted."),
    ("kvoffload_offload_store_jobs", "store_jobs", "Store jobs submitted."),
    (
        "kvoffload_offload_loaded_blocks",
        "loaded_blocks",
        "Offloaded blocks loaded into the device (jobs that succeeded).",
    ),
    (
        "kvoffload_offload_stored_blocks",
        "stored_blocks",
        "Blocks stored from the device into the host tier (jobs that succeeded).",
    ),
    (
        "kvoffload_offload_failed_loads",
        "failed_loads",
        "Load jobs that failed (tokens recomputed).",
    ),
    ("kvoffload_offload_failed_stores", "failed_stores", "Store jobs that failed."),
    (
        "kvoffload_offload_rejected_stores",
        "rejected_stores",
        "Stores refused because the host tier had no evictable room.",
    ),
    ("kvoffload_offload_lookups", "lookups", "Lookups of requests in the offloading tier."),
)

_FAILED_LOAD_TOKENS = "offload_failed_load_tokens_"
_BY_CHOICE = "offload_recomputed_by_choice_tokens_"
_COST_LOAD = "offload_cost_load_"


class StatsCollector(Collector):
    """Engine counters and gauges, read from ``snapshot()`` at every scrape."""

    def __init__(self, snapshot: Callable[[], Snapshot], block_bytes: int) -> None:
        self._snapshot = snapshot
        self._block_bytes = block_bytes
        #: Counters are shown as counted since this snapshot (``None``: since the start).
        self.baseline: Snapshot | None = None

    def rebase(self) -> None:
        """Count from now on."""
        self.baseline = self._snapshot()

    def snapshot(self) -> Snapshot:
        """The figures shown: counters since the baseline, gauges as they are."""
        stats, tiers = self._snapshot()
        if self.baseline is None:
            return stats, tiers
        base_stats, base_tiers = self.baseline
        return stats_delta(base_stats, stats), {
            tier: stats_delta(base_tiers.get(tier, {}), s) for tier, s in tiers.items()
        }

    def collect(self) -> Iterator[Metric]:
        stats, tiers = self.snapshot()
        for name, key, doc in _ENGINE_COUNTERS:
            yield _counter(name, doc, stats.get(key, 0))
        sources = CounterMetricFamily(
            "kvoffload_tokens_by_source",
            "Tokens admissions needed, by where their KV came from (computed, device, host, "
            "disk, remote); sums to kvoffload_prefix_cache_queries_total.",
            labels=["source"],
        )
        by_source = tokens_by_source(stats)
        for source, n in by_source.items():
            sources.add_metric([source], n)
        yield sources
        queries = stats.get("prefix_cache_queries", 0) - stats.get("prefix_cache_hits", 0)
        yield _counter(
            "kvoffload_external_prefix_cache_queries",
            "Admitted tokens the device prefix cache did not have (asked of the offloading tiers).",
            queries,
        )
        yield _counter(
            "kvoffload_external_prefix_cache_hits",
            "Admitted tokens served by the offloading tiers (failed loads excluded).",
            external_hits(by_source),
        )
        yield _gauge(
            "kvoffload_num_requests_running", "Requests running.", stats.get("num_running", 0)
        )
        yield _gauge(
            "kvoffload_num_requests_waiting", "Requests waiting.", stats.get("num_waiting", 0)
        )
        total = stats.get("device_blocks", 0)
        yield _gauge(
            "kvoffload_kv_cache_usage_perc",
            "Fraction of device KV blocks in use (1 = full).",
            stats.get("device_used_blocks", 0) / total if total else 0.0,
        )
        yield _gauge("kvoffload_device_blocks", "Device KV cache blocks.", total)
        if "offload_load_jobs" in stats:
            for name, key, doc in _OFFLOAD_COUNTERS:
                yield _counter(name, doc, stats.get(f"offload_{key}", 0))
            recomputed = CounterMetricFamily(
                "kvoffload_offload_recomputed_tokens",
                "Tokens whose load from the tier failed, recomputed instead.",
                labels=["tier"],
            )
            for tier in tiers or ("host",):
                recomputed.add_metric([tier], stats.get(f"{_FAILED_LOAD_TOKENS}{tier}", 0))
            yield recomputed
            yield from _load_decision_metrics(stats, tiers)
            if "offload_tier_promotion_jobs" in stats:
                yield SummaryMetricFamily(
                    "kvoffload_tier_promotion_seconds",
                    "Promotions from a secondary tier into the host tier: time from submission "
                    "to the tier's result (vLLM: kv_offload_tiering_promotion_latency_seconds).",
                    count_value=int(stats["offload_tier_promotion_jobs"]),
                    sum_value=stats.get("offload_tier_promotion_us", 0) / 1e6,
                )
        yield from tier_metrics(tiers, self._block_bytes)
        yield from _store_bound_metrics(stats, tiers)


def _store_bound_metrics(
    stats: Mapping[str, float], tiers: Mapping[str, Mapping[str, float]]
) -> Iterable[Metric]:
    """Stores shed because the store path fell behind, per tier (host: device -> host stores
    beyond ``kv_store_max_in_flight``; a secondary tier: writes waiting past their turn), and
    write-through skipped for blocks never reused."""
    if "offload_shed_store_blocks" not in stats:
        return
    shed = CounterMetricFamily(
        "kvoffload_tier_shed_store_blocks",
        "Blocks not stored into this tier because its store path was behind (shed, not queued).",
        labels=["tier"],
    )
    shed.add_metric(["host"], stats.get("offload_shed_store_blocks", 0))
    for tier, s in tiers.items():
        if tier != "host" and "shed_store_blocks" in s:
            shed.add_metric([tier], s["shed_store_blocks"])
    yield shed
    if "offload_tier_skipped_cascade_blocks" in stats:
        yield _counter(
            "kvoffload_tier_skipped_write_blocks",
            "Host blocks never written through to the disk and remote tiers: evicted before "
            "kv_tier_write_min_reuse requests saw them.",
            stats["offload_tier_skipped_cascade_blocks"],
        )


def _load_decision_metrics(
    stats: Mapping[str, float], tiers: Mapping[str, Mapping[str, float]]
) -> Iterable[Metric]:
    """``load_policy``'s choices and the estimates behind them (:mod:`kvoffload.scheduler.costs`)."""
    by_choice = CounterMetricFamily(
        "kvoffload_offload_recomputed_by_choice_tokens",
        "Hit tokens recomputed because loading them would have been slower (load_policy auto), "
        "by the tier they would have come from.",
        labels=["tier"],
    )
    seen = set(tiers or ("host",))
    for tier in tiers or ("host",):
        by_choice.add_metric([tier], stats.get(f"{_BY_CHOICE}{tier}", 0))
    for key, value in stats.items():  # a tier the manager does not list (promoted: "secondary")
        if key.startswith(_BY_CHOICE) and key[len(_BY_CHOICE) :] not in seen:
            by_choice.add_metric([key[len(_BY_CHOICE) :]], value)
    yield by_choice
    yield _gauge(
        "kvoffload_offload_cost_token_seconds",
        "Estimated seconds to compute one more token in an engine step (measured; a prior until "
        "then).",
        stats.get("offload_cost_token_s", 0.0),
    )
    yield _gauge(
        "kvoffload_offload_cost_step_seconds",
        "Estimated seconds of one engine step: the least an asynchronous load delays its request.",
        stats.get("offload_cost_step_s", 0.0),
    )
    load = GaugeMetricFamily(
        "kvoffload_offload_cost_load_block_seconds",
        "Estimated seconds to load one offloaded block (per KV-cache group) from the tier into "
        "the device (a secondary tier: its promotion plus the host load).",
        labels=["tier"],
    )
    for key, value in stats.items():
        if key.startswith(_COST_LOAD) and key.endswith("_s"):
            load.add_metric([key[len(_COST_LOAD) : -2]], value)
    yield load


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)

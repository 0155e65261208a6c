"""Prometheus metrics of one engine, in a registry of its own (see ``docs/metrics.md``).

Counters and gauges are read from the engine's own statistics at scrape time (a custom
collector over a ``snapshot`` callable), so a scraped value always equals the engine's counter;
per-tier series come from :meth:`~kvoffload.manager_contract.OffloadingManager.tier_stats` with a ``tier``
label. Latency and size distributions are histograms observed as requests and transfers finish.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)
from prometheus_client.registry import Collector

from kvoffload.metrics.stats import external_hits, stats_delta, tokens_by_source
from kvoffload.transfer import TransferResult

__all__ = ["EngineMetrics", "Snapshot"]

#: ``(engine stats, stats per tier)``, taken consistently (between two engine steps).
Snapshot = tuple[Mapping[str, float], Mapping[str, Mapping[str, float]]]

_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80)
_TRANSFER_SECONDS_BUCKETS = (1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1)
_TRANSFER_SIZE_BUCKETS = (1e5, 1e6, 5e6, 10e6, 20e6, 40e6, 60e6, 80e6, 100e6, 150e6, 200e6)

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

# tier_stats() counter keys -> (metric name without _total, help). Bytes are derived as
# blocks x block bytes where the tier does not report them itself.
_TIER_COUNTERS = (
    ("stored_blocks", "kvoffload_tier_stored_blocks", "Blocks written into the tier."),
    ("loaded_blocks", "kvoffload_tier_loaded_blocks", "Blocks read from the tier."),
    ("evicted_blocks", "kvoffload_tier_evicted_blocks", "Blocks evicted from the tier."),
    ("failed_store_blocks", "kvoffload_tier_failed_store_blocks", "Blocks whose store failed."),
    ("failed_load_blocks", "kvoffload_tier_failed_load_blocks", "Blocks whose load failed."),
)
_FAILED_LOAD_CAUSE = "failed_load_"
_FAILED_LOAD_TOKENS = "offload_failed_load_tokens_"
_BY_CHOICE = "offload_recomputed_by_choice_tokens_"
_COST_LOAD = "offload_cost_load_"
#: Causes of TierJobResult.failed_keys that fail a load; exported at 0 until they happen.
_LOAD_FAILURE_CAUSES = ("missing", "checksum", "layout", "corrupt", "io", "timeout")


class _StatsCollector(Collector):
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
        yield from self._tier_metrics(tiers)
        yield from _store_bound_metrics(stats, tiers)

    def _tier_metrics(self, tiers: Mapping[str, Mapping[str, float]]) -> Iterable[Metric]:
        if not tiers:
            return
        label = ["tier"]
        gauges = {
            name: GaugeMetricFamily(name, doc, labels=label)
            for name, doc in (
                ("kvoffload_tier_capacity_blocks", "Blocks the tier can hold."),
                ("kvoffload_tier_used_blocks", "Blocks the tier holds."),
                ("kvoffload_tier_capacity_bytes", "Bytes the tier can hold."),
                ("kvoffload_tier_used_bytes", "Bytes the tier holds."),
                ("kvoffload_tier_usage_perc", "Fraction of the tier's capacity in use."),
            )
        }
        counters = {
            key: CounterMetricFamily(name, doc, labels=label) for key, name, doc in _TIER_COUNTERS
        }
        byte_counters = {
            key: CounterMetricFamily(
                name.replace("_blocks", "_bytes"),
                doc.replace("Blocks", "Bytes of blocks"),
                labels=label,
            )
            for key, name, doc in _TIER_COUNTERS
        }
        causes = CounterMetricFamily(
            "kvoffload_tier_failed_load_blocks_by_cause",
            "Blocks whose load from the tier failed, by cause (missing, checksum, layout, "
            "corrupt, io, timeout); each was recomputed.",
            labels=["tier", "cause"],
        )
        block_bytes = self._block_bytes
        for tier, s in tiers.items():
            capacity_blocks = s.get("capacity_blocks", 0)
            used_blocks = s.get("used_blocks", 0)
            capacity_bytes = s.get("capacity_bytes", capacity_blocks * block_bytes)
            used_bytes = s.get("used_bytes", used_blocks * block_bytes)
            if not capacity_blocks and block_bytes:
                capacity_blocks = capacity_bytes // block_bytes
            gauges["kvoffload_tier_capacity_blocks"].add_metric([tier], capacity_blocks)
            gauges["kvoffload_tier_used_blocks"].add_metric([tier], used_blocks)
            gauges["kvoffload_tier_capacity_bytes"].add_metric([tier], capacity_bytes)
            gauges["kvoffload_tier_used_bytes"].add_metric([tier], used_bytes)
            gauges["kvoffload_tier_usage_perc"].add_metric(
                [tier], used_bytes / capacity_bytes if capacity_bytes else 0.0
            )
            for key, _, _ in _TIER_COUNTERS:
                blocks = s.get(key, 0)
                counters[key].add_metric([tier], blocks)
                bytes_key = key.replace("_blocks", "_bytes")
                byte_counters[key].add_metric([tier], s.get(bytes_key, blocks * block_bytes))
            by_cause = dict.fromkeys(_LOAD_FAILURE_CAUSES, 0.0)
            for key, value in s.items():
                if key.startswith(_FAILED_LOAD_CAUSE) and key != "failed_load_blocks":
                    by_cause[key[len(_FAILED_LOAD_CAUSE) :]] = value
            for cause, value in by_cause.items():
                causes.add_metric([tier, cause], value)
        yield from gauges.values()
        yield from counters.values()
        yield from byte_counters.values()
        yield causes
        lookups = SummaryMetricFamily(
            "kvoffload_tier_lookup_round_trip_seconds",
            "Batched lookups of an asynchronous tier: one network round trip each, off the "
            "engine thread (the engine never waits on it).",
            labels=label,
        )
        for tier, s in tiers.items():
            if "lookup_round_trips" in s:
                lookups.add_metric(
                    [tier], int(s["lookup_round_trips"]), s.get("lookup_round_trip_us", 0) / 1e6
                )
        if lookups.samples:
            yield lookups
        yield from _promotion_metrics(tiers)
        yield from _codec_metrics(tiers)


#: A compressed tier's codec counters (``codec_*`` of its stats) -> metric name, help, scale.
_CODEC_COUNTERS = (
    ("codec_raw_bytes", "kvoffload_tier_codec_raw_bytes", "Bytes of blocks the codec encoded.", 1),
    (
        "codec_stored_bytes",
        "kvoffload_tier_codec_stored_bytes",
        "Bytes those blocks were stored as (raw when encoding did not make them smaller).",
        1,
    ),
    ("codec_encode_us", "kvoffload_tier_codec_encode_seconds", "Time spent encoding blocks.", 1e-6),
    ("codec_decode_us", "kvoffload_tier_codec_decode_seconds", "Time spent decoding blocks.", 1e-6),
)


def _codec_metrics(tiers: Mapping[str, Mapping[str, float]]) -> Iterable[Metric]:
    """Each tier's codec: bytes before and after, seconds spent (I/O threads), and the ratio."""
    coded = {tier: s for tier, s in tiers.items() if "codec_raw_bytes" in s}
    if not coded:
        return
    ratio = GaugeMetricFamily(
        "kvoffload_tier_compression_ratio",
        "Raw bytes per stored byte of the blocks the tier's codec encoded (1 before any).",
        labels=["tier"],
    )
    for key, name, doc, scale in _CODEC_COUNTERS:
        family = CounterMetricFamily(name, doc, labels=["tier"])
        for tier, s in coded.items():
            family.add_metric([tier], s.get(key, 0) * scale)
        yield family
    for tier, s in coded.items():
        stored = s.get("codec_stored_bytes", 0)
        ratio.add_metric([tier], s.get("codec_raw_bytes", 0) / stored if stored else 1.0)
    yield ratio


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


def _promotion_metrics(tiers: Mapping[str, Mapping[str, float]]) -> Iterable[Metric]:
    """Each secondary tier's promotions on their own (a router weighs a block by the tier it
    would come from): jobs and seconds, and their blocks."""
    seconds = SummaryMetricFamily(
        "kvoffload_tier_promotion_job_seconds",
        "Promotions from this tier into the host tier: time from submission to the tier's "
        "result, per job.",
        labels=["tier"],
    )
    blocks = CounterMetricFamily(
        "kvoffload_tier_promotion_blocks",
        "Blocks of this tier's promotion jobs (failed ones included).",
        labels=["tier"],
    )
    for tier, s in tiers.items():
        if "promotion_jobs" in s:
            seconds.add_metric([tier], int(s["promotion_jobs"]), s.get("promotion_us", 0) / 1e6)
            blocks.add_metric([tier], s.get("promotion_blocks", 0))
    if seconds.samples:
        yield seconds
        yield blocks


def _counter(name: str, doc: str, value: float) -> CounterMetricFamily:
    return CounterMetricFamily(name, doc, value=value)


def _gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, doc, value=value)


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
        self._stats = _StatsCollector(snapshot, block_bytes)
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

"""The per-tier Prometheus series of an engine (label ``tier``), from each tier's
:meth:`~kvoffload.manager_contract.OffloadingManager.tier_stats` (``docs/metrics.md``)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    Metric,
    SummaryMetricFamily,
)

__all__ = ["tier_metrics"]

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
#: Causes of TierJobResult.failed_keys that fail a load; exported at 0 until they happen.
_LOAD_FAILURE_CAUSES = ("missing", "checksum", "layout", "corrupt", "io", "timeout")


def tier_metrics(tiers: Mapping[str, Mapping[str, float]], block_bytes: int) -> Iterable[Metric]:
    """The per-tier series (label ``tier``): capacity and use, block and byte counters, failed
    loads by cause, lookup round trips, promotions and codecs. ``block_bytes``: one block's bytes,
    for the figures a tier reports in blocks only."""
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

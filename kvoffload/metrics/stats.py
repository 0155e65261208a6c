"""The one definition of every derived figure: tokens by source, hit rates, run deltas.

Everything an operator reads (Prometheus series, the periodic log line, the benchmark's summary
lines, ``--output-json``, plots) is computed here from :meth:`kvoffload.engine.Engine.stats`,
so two outputs never disagree.

Tokens by source count what each *admission* of a request needed (a request re-admitted after a
preemption counts again, as vLLM's prefix-cache queries do) by where its KV came from:

* ``device``: the engine's own prefix cache (``prefix_cache_hits``);
* ``host`` / ``disk`` / ``remote`` (and any other tier name a manager reports through
  :meth:`~kvoffload.manager_contract.OffloadingManager.load_source`): loaded from that offloading tier
  (``offload_hit_tokens_<tier>`` planned, less ``offload_failed_load_tokens_<tier>`` whose load
  failed and were recomputed);
* ``computed``: the rest of ``prefix_cache_queries``, prefilled by the model.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = [
    "OFFLOAD_SOURCES",
    "SOURCES",
    "external_hits",
    "hit_rates",
    "is_gauge",
    "stats_delta",
    "tokens_by_source",
]

#: Offloading tiers in the order blocks move down to them.
OFFLOAD_SOURCES = ("host", "disk", "remote")
#: Every source of a token's KV, printed in this order.
SOURCES = ("computed", "device", *OFFLOAD_SOURCES)

_HIT_PREFIX = "offload_hit_tokens_"
_FAILED_PREFIX = "offload_failed_load_tokens_"

# Stats that are current values, not monotonic counters: a run's figure is the value at its end.
_GAUGE_KEYS = frozenset({"device_blocks", "device_used_blocks", "num_running", "num_waiting"})
_GAUGE_SUFFIXES = (
    "capacity_blocks",
    "capacity_bytes",
    "used_blocks",
    "used_bytes",
    "live_requests",
    "jobs_in_flight",
    "tracked_keys",
    "scanned_blocks",  # what a tier's start-up scan found (a warm restart), not a count of runs
    "scan_ms",
)


#: The load decision's cost estimates (``offload_cost_*_s``: :mod:`kvoffload.scheduler.costs`).
_GAUGE_PREFIXES = ("offload_cost_",)


def is_gauge(key: str) -> bool:
    """Whether ``key`` of :meth:`Engine.stats` is a current value rather than a counter."""
    return key in _GAUGE_KEYS or key.endswith(_GAUGE_SUFFIXES) or key.startswith(_GAUGE_PREFIXES)


def stats_delta(before: Mapping[str, float], after: Mapping[str, float]) -> dict[str, float]:
    """What happened between two snapshots: counters subtracted, gauges as they are ``after``."""
    return {k: v if is_gauge(k) else v - before.get(k, 0) for k, v in after.items()}


def tokens_by_source(stats: Mapping[str, float]) -> dict[str, int]:
    """Tokens admissions needed, by source (see the module docstring); sums to
    ``prefix_cache_queries``. Every source of :data:`SOURCES` is present, others when seen."""
    device = int(stats.get("prefix_cache_hits", 0))
    out = dict.fromkeys(SOURCES, 0)
    out["device"] = device
    offloaded = 0
    for key, value in stats.items():
        if key.startswith(_HIT_PREFIX):
            tier = key[len(_HIT_PREFIX) :]
            served = int(value - stats.get(_FAILED_PREFIX + tier, 0))
            out[tier] = served
            offloaded += served
    out["computed"] = int(stats.get("prefix_cache_queries", 0)) - device - offloaded
    return out


def external_hits(sources: Mapping[str, int]) -> int:
    """Tokens of :func:`tokens_by_source` served by the offloading tiers."""
    return sum(v for k, v in sources.items() if k not in ("computed", "device"))


def hit_rates(stats: Mapping[str, float]) -> dict[str, float | None]:
    """vLLM's two hit rates, as fractions (``None`` when nothing was queried).

    ``prefix_cache``: device prefix-cache hits over queried tokens. ``external``: tokens served
    by the offloading tiers over the tokens the device cache did not have.
    """
    sources = tokens_by_source(stats)
    queries = sum(sources.values())
    missed = queries - sources["device"]
    return {
        "prefix_cache": sources["device"] / queries if queries else None,
        "external": external_hits(sources) / missed if missed else None,
    }

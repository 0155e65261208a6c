"""Our offloading stack as a whole vLLM offloading spec (0.32 and 0.33): :class:`KVOffloadSpec`.

``kv_connector_extra_config``::

    {"spec_name": "KVOffloadSpec",
     "spec_module_path": "kvoffload.integrations.vllm.spec",
     "cpu_bytes_to_use": 8000000000,
     "eviction_policy": "prefix",              # a kvoffload policy name (default "adaptive")
     "store_threshold": 2,                     # our reuse filter (default 0: off)
     "max_tracker_size": 64000,
     "kvoffload_cascade": "write_through",     # or "on_evict"
     "kvoffload_tier_write_max_in_flight": 64, # blocks written per tier at once (default: half
                                               # the host); the rest wait, shed if evicted first
     "kvoffload_tier_write_min_reuse": 2,      # write through blocks 2 requests saw (default 1)
     "kvoffload_tiers": [{"kind": "disk", "path": "kv-disk", "size_gib": 200},
                         {"kind": "redis", "url": "redis://cache:6379/0"}],
     "kvoffload_lookup_retry_s": 2.0,          # how long a request waits on RETRY (then MISS)
     "kvoffload_load_policy": "auto",          # or "always", "never" (docs/vllm.md)
     "kvoffload_stats_file": "kvoffload-stats.json"}  # optional: stats when idle

Another ``kvoffload_*`` key is an error naming it (a misspelling is never ignored). The model's
weights are digested (to name its blocks by content) only when ``kvoffload_tiers`` is set.

What vLLM runs and what is ours:

* **Worker side:** on CUDA-alike and XPU platforms vLLM's own (the spec extends vLLM's
  ``TieringOffloadingSpec`` for it): ``CPUOffloadingWorker`` copies GPU <-> the shared-memory CPU
  pool by chunk id. On vLLM's CPU platform, where vLLM's refuses to start, ours:
  :class:`~kvoffload.integrations.vllm.worker.KVOffloadCPUWorker` copies between vLLM's CPU KV
  cache and the same pool on our copy threads.
* **Scheduler side (ours):** :class:`~kvoffload.integrations.vllm.manager.KVOffloadManager`
  over our :class:`~kvoffload.managers.CPUOffloadingManager` (slot ids = vLLM chunk ids) with
  our eviction policy (admission control included, which vLLM's ``CachePolicy`` cannot
  express), our :class:`~kvoffload.managers.tiering.TieringOffloadingManager` with our tiers on
  vLLM's CPU pool (promotions shared by every request that wants the block, failed promotions
  answered ``MISS`` to that request from then on: it recomputes), and our
  :class:`~kvoffload.managers.FilterReusedOffloadingManager` (a block is stored once
  ``store_threshold`` distinct *requests* saw it; vLLM's filter counts lookups).
* **Not ours:** the request scheduling itself is vLLM's ``OffloadingConnectorScheduler``; what
  it does with a failed load is vLLM's behaviour. How long a request waits on ``RETRY`` is
  bounded by our ``kvoffload_lookup_retry_s`` (vLLM re-asks without end).

Bad settings raise :class:`~kvoffload.errors.ConfigError` naming the setting.
"""

from __future__ import annotations

import difflib
from typing import Any

from vllm.v1.kv_offload.base import OffloadingGaugeMetadata, OffloadingMetricMetadata
from vllm.v1.kv_offload.config import OffloadingConfig
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec

from kvoffload.errors import ConfigError
from kvoffload.eviction import available_eviction_policies
from kvoffload.integrations.vllm.compat import cpu_config_info
from kvoffload.integrations.vllm.manager import STATS_METRIC, KVOffloadManager
from kvoffload.integrations.vllm.region import open_scheduler_region, release_region
from kvoffload.integrations.vllm.shared_pool_view import unexported_alias
from kvoffload.integrations.vllm.tiers import TIER_BUILDERS, layout_of_spec
from kvoffload.integrations.vllm.worker import CPUPlatformWorker
from kvoffload.manager_contract import OffloadingManager as KVOManager
from kvoffload.managers import CPUOffloadingManager, FilterReusedOffloadingManager
from kvoffload.managers.tiering import CASCADE_MODES, TieringOffloadingManager
from kvoffload.scheduler.costs import check_load_policy
from kvoffload.tiers.contract import SecondaryTier

__all__ = ["KVOFFLOAD_SETTINGS", "KVOffloadSpec"]

#: The ``kvoffload_*`` keys of ``kv_connector_extra_config``; any other is a (misspelt) error.
KVOFFLOAD_SETTINGS = (
    "kvoffload_cascade",
    "kvoffload_load_policy",
    "kvoffload_lookup_retry_s",
    "kvoffload_stats_file",
    "kvoffload_tier_write_max_in_flight",
    "kvoffload_tier_write_min_reuse",
    "kvoffload_tiers",
)


class KVOffloadSpec(CPUPlatformWorker, TieringOffloadingSpec):
    """Our scheduler side; vLLM's worker side, ours on vLLM's CPU platform (module docstring)."""

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        metrics = super().build_metric_definitions(extra_config)
        metrics[STATS_METRIC] = OffloadingGaugeMetadata(
            documentation="kvoffload manager counters and gauges, one series per stat.",
            labelnames=("stat",),
        )
        return metrics

    def __init__(self, config: OffloadingConfig) -> None:
        super().__init__(config)
        extra = self.extra_config
        _reject_unknown_settings(extra)
        if self.secondary_tier_configs:
            raise ConfigError(
                "secondary_tiers", "is vLLM's tiering setting; KVOffloadSpec reads kvoffload_tiers"
            )
        self.policy_name = str(extra.get("eviction_policy", "adaptive"))
        if self.policy_name not in available_eviction_policies():
            raise ConfigError(
                "eviction_policy",
                f"unknown kvoffload policy {self.policy_name!r}; "
                f"choose from {available_eviction_policies()}",
            )
        self.store_threshold = _int_setting(extra, "store_threshold", 0, minimum=0)
        self.max_tracker_size = _int_setting(extra, "max_tracker_size", 64_000, minimum=1)
        self.cascade = extra.get("kvoffload_cascade", "write_through")
        if self.cascade not in CASCADE_MODES:
            raise ConfigError(
                "kvoffload_cascade", f"{self.cascade!r}; choose from {list(CASCADE_MODES)}"
            )
        self.write_max_in_flight: int | None = None
        if extra.get("kvoffload_tier_write_max_in_flight") is not None:
            self.write_max_in_flight = _int_setting(
                extra, "kvoffload_tier_write_max_in_flight", 0, minimum=0
            )
        self.write_min_reuse = _int_setting(extra, "kvoffload_tier_write_min_reuse", 1, minimum=1)
        tiers = extra.get("kvoffload_tiers", [])
        if not isinstance(tiers, list) or not all(isinstance(t, dict) for t in tiers):
            raise ConfigError("kvoffload_tiers", f"must be a list of objects, got {tiers!r}")
        for tier in tiers:
            if tier.get("kind") not in TIER_BUILDERS:
                raise ConfigError(
                    "kvoffload_tiers.kind",
                    f"{tier.get('kind')!r}; choose from {sorted(TIER_BUILDERS)}",
                )
        self.tier_configs: list[dict[str, Any]] = tiers
        stats_file = extra.get("kvoffload_stats_file")
        if stats_file is not None and not isinstance(stats_file, str):
            raise ConfigError("kvoffload_stats_file", f"must be a path, got {stats_file!r}")
        self.stats_file: str | None = stats_file
        retry_s = extra.get("kvoffload_lookup_retry_s", 2.0)
        if isinstance(retry_s, bool) or not isinstance(retry_s, int | float) or retry_s < 0:
            raise ConfigError("kvoffload_lookup_retry_s", f"must be seconds >= 0, got {retry_s!r}")
        self.lookup_retry_s = float(retry_s)
        self.load_policy = check_load_policy(
            extra.get("kvoffload_load_policy", "auto"), "kvoffload_load_policy"
        )
        if self.num_chunks <= 0:
            raise ConfigError(
                "cpu_bytes_to_use",
                f"{extra.get('cpu_bytes_to_use')!r} bytes hold no chunk of "
                f"{self.kv_bytes_per_chunk} bytes",
            )

    def get_manager(self) -> KVOffloadManager:
        if self._manager is None:
            self._manager = self._build_manager()
        return self._manager  # type: ignore[return-value]

    def _build_manager(self) -> KVOffloadManager:
        # The CPU pool vLLM's worker maps (same engine id): our tiers read and write it. Its name
        # leaves /dev/shm now when the workers mapped it first (region.py).
        region = open_scheduler_region(
            self._engine_id, self.num_chunks, self.kv_bytes_per_chunk, self.cpu_page_size_per_worker
        )
        vllm_view = region.create_kv_memoryview()
        pool = unexported_alias(vllm_view)  # our tiers' views never pin vLLM's mapping
        vllm_view.release()
        events = self.kv_events_config.enable_kv_cache_events
        tiers: list[SecondaryTier] = []

        def release_pool() -> None:
            release_region(region)

        try:
            if self.tier_configs:  # naming the model digests its weights: only for tiers
                layout = layout_of_spec(self, self.kv_bytes_per_chunk)  # a pool row
                for tier in self.tier_configs:
                    options = {k: v for k, v in tier.items() if k != "kind"}
                    build = TIER_BUILDERS[tier["kind"]]
                    tiers.append(build(pool, layout, events, options, "kvoffload_tiers"))
            host = CPUOffloadingManager(self.num_chunks, self.policy_name, enable_events=events)
            manager: KVOManager = host
            close = None
            if tiers:
                tiering = TieringOffloadingManager(
                    host,
                    tiers,
                    self.cascade,
                    max_in_flight=self.write_max_in_flight,
                    min_reuse=self.write_min_reuse,
                )
                manager, close = tiering, tiering.close
            if self.store_threshold >= 2:
                manager = FilterReusedOffloadingManager(
                    manager, self.store_threshold, self.max_tracker_size
                )
        except BaseException:
            for built in tiers:
                built.close()
            release_pool()
            raise
        return KVOffloadManager(
            manager,
            close=close,
            on_shutdown=release_pool,
            config_info=cpu_config_info(self),
            stats_file=self.stats_file,
            lookup_retry_s=self.lookup_retry_s,
            load_policy=self.load_policy,
            block_tokens=self.tokens_per_block[0] * self.blocks_per_chunk,
        )


def _reject_unknown_settings(extra: Any) -> None:
    """A ``kvoffload_*`` key we do not read is a misspelling: raise naming it and its close
    matches (vLLM's own keys and other connectors' are left alone)."""
    unknown = sorted(k for k in extra if k.startswith("kvoffload_") and k not in KVOFFLOAD_SETTINGS)
    if unknown:
        key = unknown[0]
        close = difflib.get_close_matches(key, KVOFFLOAD_SETTINGS, n=2, cutoff=0.6)
        hint = f"did you mean {' or '.join(close)}?" if close else ""
        raise ConfigError(
            key,
            f"unknown kvoffload setting{'s' if len(unknown) > 1 else ''} {unknown}; {hint} "
            f"known: {list(KVOFFLOAD_SETTINGS)}",
        )


def _int_setting(extra: Any, name: str, default: int, minimum: int) -> int:
    value = extra.get(name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigError(name, f"must be an integer >= {minimum}, got {value!r}")
    return value

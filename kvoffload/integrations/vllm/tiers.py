"""Our secondary tiers (disk, Redis) as vLLM 0.33 ``SecondaryTierManager`` classes.

Configure behind vLLM's CPU tier with ``TieringOffloadingSpec``::

    "secondary_tiers": [{"type": "KVOffloadDiskTier",
                         "module_path": "kvoffload.integrations.vllm.tiers",
                         "path": "kv-disk", "size_gib": 200}]

:class:`KVOffloadTier` is the one generic adapter: vLLM builds it with its CPU pool's
``memoryview`` (``view[chunk]`` is one chunk's bytes) and the tier options; it builds one of our
:class:`~kvoffload.tiers.contract.SecondaryTier` on that same view (our contract was shaped after
vLLM's, so the bytes move straight between vLLM's pool and our disk files or Redis values, with
no copy in between) and translates:

==================================  ==============================================================
vLLM                                kvoffload
==================================  ==============================================================
``TransferJob(job_id, keys,         ``TierJob(job_id, keys, slots)`` (``slots`` = the chunk ids);
chunk_ids, is_promotion, ctx)``     the request context becomes ours (:func:`kvoffload_context`)
``LookupResult`` HIT / MISS /       the same; our ``HIT_PENDING`` (this tier is still writing the
RETRY                               key) is vLLM's RETRY ("being transferred, ask again")
``JobResult(success,                ``TierJobResult``: ``success`` iff no failed key; a promotion
successful_keys, transfer_time,     that failed some keys lists the others as ``successful_keys``;
transfer_bytes)``                   vLLM then frees the failed chunks and the request recomputes
``OffloadingEvent(Medium.STORAGE,   our tier events (``medium`` "STORAGE", ``locality``
locality, ownership)``              "LOCAL"/"REMOTE"); ``ownership`` is the tier type
``get_stats()``                     our ``stats()``: gauges and per-call counter increments,
                                    metrics ``kvoffload:secondary_tier_*`` labelled by tier
==================================  ==============================================================

A subclass names only how to build its tier (:meth:`KVOffloadTier.build_tier`) from the tier's
options in ``secondary_tiers``; unknown or bad options raise
:class:`~kvoffload.errors.ConfigError` naming the option.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Collection, Iterable
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingGaugeMetadata,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from kvoffload.errors import ConfigError
from kvoffload.integrations.vllm.compat import our_key, our_keys, vllm_keys
from kvoffload.integrations.vllm.context import kvoffload_context
from kvoffload.integrations.vllm.shared_pool_view import unexported_alias
from kvoffload.manager_contract import LookupResult as KVOLookupResult
from kvoffload.tiers.contract import KVLayout, SecondaryTier, TierJob

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

__all__ = [
    "GAUGE_STATS",
    "METRIC_PREFIX",
    "TIER_BUILDERS",
    "KVOffloadDiskTier",
    "KVOffloadRedisTier",
    "KVOffloadTier",
    "build_disk_tier",
    "build_redis_tier",
    "layout_of_spec",
]

_LOOKUP = {
    KVOLookupResult.HIT: LookupResult.HIT,
    KVOLookupResult.MISS: LookupResult.MISS,
    KVOLookupResult.HIT_PENDING: LookupResult.RETRY,
    KVOLookupResult.RETRY: LookupResult.RETRY,
}
_CAUSES = ("missing", "checksum", "layout", "corrupt", "io", "timeout", "full")
#: Stats of the tier contract exported as gauges (the other contract stats are counters).
GAUGE_STATS = ("capacity_bytes", "used_bytes", "used_blocks")
_COUNTER_STATS = (
    "stored_blocks",
    "loaded_blocks",
    "evicted_blocks",
    "failed_load_blocks",
    "failed_store_blocks",
    *(f"failed_load_{cause}" for cause in _CAUSES),
)
METRIC_PREFIX = "kvoffload:secondary_tier_"
_TIER_LABEL = "kvoffload_tier"
_GIB = 2**30
_DISK_OPTION_OF = {
    "kv_disk_path": "path",
    "kv_disk_size": "size_gib",
    "kv_disk_compression": "compression",
}


def layout_of_spec(spec: OffloadingSpec, block_bytes: int) -> KVLayout:
    """What one chunk of vLLM's CPU pool means, as our :class:`KVLayout` (its fingerprint keeps
    blocks of another model, dtype, chunk size, KV layout or worker count apart; the model is
    named by content, not by path).

    vLLM's offloading config does not carry heads and head size; they are folded into
    ``block_bytes`` and the per-worker byte count in ``model``, and written as 0.
    """
    config = spec.config
    tokens_per_chunk = (
        spec.tokens_per_block[0] * spec.blocks_per_chunk if spec.tokens_per_block else 0
    )
    identity = "|".join(
        (
            f"vllm:{_model_identity(config.model)}",
            f"world={config.parallel.world_size}",
            f"replicated={config.replicated_layout}",
            f"canonical={config.canonical_layout}",
            f"kv_layout={config.kv_cache_layout}",
            f"worker_bytes={config.worker_kv_bytes_per_block}",
        )
    )
    return KVLayout(
        model=identity,
        dtype=config.model.dtype,
        tokens_per_block=tokens_per_chunk,
        num_layers=sum(len(group.layer_names) for group in config.groups),
        num_kv_heads=0,
        head_dim=0,
        block_bytes=block_bytes,
    )


def _model_identity(offloading_model: Any) -> str:
    """The served model named by content (:func:`kvoffload.identity.fingerprint_from_vllm`:
    configuration, dtype, weight files; never the path), from vLLM's ``ModelConfig`` where one is
    current, else from the spec's ``OffloadingModelConfig`` (its ``name`` is the checkpoint)."""
    from kvoffload.identity import fingerprint_from_vllm

    try:
        from vllm.config import get_current_vllm_config_or_none
    except ImportError:  # pragma: no cover - older vLLM
        current = None
    else:
        current = get_current_vllm_config_or_none()
    model_config = getattr(current, "model_config", None) or offloading_model
    return fingerprint_from_vllm(model_config)


class KVOffloadTier(SecondaryTierManager):
    """A vLLM secondary tier backed by one kvoffload :class:`SecondaryTier`.

    Every method runs on vLLM's scheduler (under its tiering manager's lock) and returns at
    once: our tiers never block the calling thread. vLLM's contract for ``drain_jobs`` and
    ``shutdown`` is ours for ``drain_jobs`` and ``close``.
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        backpressure_detector: BackpressureDetector | None = None,
        **options: Any,
    ) -> None:
        super().__init__(
            offloading_spec=offloading_spec,
            primary_kv_view=primary_kv_view,
            tier_type=tier_type,
            backpressure_detector=backpressure_detector,
        )
        layout = layout_of_spec(offloading_spec, self.block_size_bytes)
        enable_events = offloading_spec.kv_events_config.enable_kv_cache_events
        # An alias, so that no view our tier derives pins vLLM's mapping at its cleanup.
        pool = unexported_alias(primary_kv_view)
        self.tier: SecondaryTier = self.build_tier(pool, layout, enable_events, options)
        self.locality = Locality(self.tier.locality)
        self._events_enabled = enable_events
        self._jobs: dict[int, Collection[OffloadKey]] = {}  # in flight: promotions' keys
        self._reported: dict[str, int] = dict.fromkeys(_COUNTER_STATS, 0)

    @abstractmethod
    def build_tier(
        self, pool: memoryview, layout: KVLayout, enable_events: bool, options: dict[str, Any]
    ) -> SecondaryTier:
        """Build the tier from the options of its ``secondary_tiers`` entry (``type``,
        ``module_path`` and ``backpressure`` already removed by vLLM)."""

    # -- lookups and jobs ------------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        return _LOOKUP[self.tier.lookup(our_key(key), kvoffload_context(req_context))]

    def submit_store(self, job_metadata: TransferJob) -> None:
        self._jobs[job_metadata.job_id] = ()
        self.tier.submit_store(_tier_job(job_metadata), kvoffload_context(job_metadata.req_context))

    def submit_load(self, job_metadata: TransferJob) -> None:
        self._jobs[job_metadata.job_id] = job_metadata.keys
        ctx = kvoffload_context(job_metadata.req_context)
        job = _tier_job(job_metadata)
        # vLLM's scheduler never calls touch: a promotion is the use our tier's policy sees.
        self.tier.touch(job.keys, ctx)
        self.tier.submit_load(job, ctx)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        if not self._events_enabled:
            self.tier.take_events()  # vLLM drains no events then; keep none
        results = []
        for done in self.tier.get_finished_jobs():
            keys = self._jobs.pop(done.job_id)
            successful = None
            if done.failed_keys and not done.is_store:
                successful = [k for k in keys if our_key(k) not in done.failed_keys]
            results.append(
                JobResult(
                    job_id=done.job_id,
                    success=done.success,
                    successful_keys=successful,
                    transfer_time=done.seconds,
                    transfer_bytes=done.num_bytes,
                )
            )
        return results

    def has_pending_work(self) -> bool:
        return bool(self._jobs)

    def drain_jobs(self) -> None:
        self.tier.drain_jobs()

    # -- requests --------------------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()  # chunk level: only newly computed chunks cascade

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.tier.touch(our_keys(keys), kvoffload_context(req_context))

    def on_request_finished(self, req_context: ReqContext) -> None:
        self.tier.request_finished(kvoffload_context(req_context))

    # -- events, stats, lifecycle ----------------------------------------------------------------

    def take_events(self) -> Iterable[OffloadingEvent]:
        return [
            OffloadingEvent(
                keys=vllm_keys(event.keys),
                medium=Medium(event.medium),
                removed=event.removed,
                locality=Locality(event.locality or self.tier.locality),
                ownership=self.tier_type,
            )
            for event in self.tier.take_events()
        ]

    @classmethod
    def build_metric_definitions(
        cls, extra_config: dict[str, Any]
    ) -> dict[str, OffloadingMetricMetadata]:
        labels = (_TIER_LABEL,)
        metrics: dict[str, OffloadingMetricMetadata] = {
            METRIC_PREFIX + name: OffloadingGaugeMetadata(
                documentation=f"kvoffload secondary tier: {name.replace('_', ' ')}.",
                labelnames=labels,
            )
            for name in GAUGE_STATS
        }
        for name in _COUNTER_STATS:
            metrics[METRIC_PREFIX + name] = OffloadingCounterMetadata(
                documentation=f"kvoffload secondary tier: {name.replace('_', ' ')}.",
                labelnames=labels,
            )
        return metrics

    def get_stats(self) -> OffloadingConnectorStats:
        """Gauges now, and the counters' increase since the last call."""
        stats = self.tier.stats()
        out = OffloadingConnectorStats()
        label = (f"{self.tier.name}:{self.tier_type}",)
        for name in GAUGE_STATS:
            out.set_gauge(METRIC_PREFIX + name, stats.get(name, 0), label)
        for name in _COUNTER_STATS:
            value = stats.get(name, 0)
            increase = value - self._reported[name]
            if increase:
                out.increase_counter(METRIC_PREFIX + name, increase, label)
                self._reported[name] = value
        return out

    def shutdown(self) -> None:
        self.tier.close()


def _tier_job(job: TransferJob) -> TierJob:
    return TierJob(job.job_id, our_keys(job.keys), job.chunk_ids.tolist())


def _take(options: dict[str, Any], name: str, setting: str, required: bool = False) -> Any:
    if name not in options:
        if required:
            raise ConfigError(f"{setting}.{name}", "is required")
        return None
    return options.pop(name)


def _reject_unknown(tier: str, options: dict[str, Any], setting: str) -> None:
    if options:
        raise ConfigError(
            f"{setting}.{sorted(options)[0]}", f"is not an option of {tier}: {sorted(options)}"
        )


def build_disk_tier(
    pool: memoryview,
    layout: KVLayout,
    enable_events: bool,
    options: dict[str, Any],
    setting: str = "secondary_tiers",
) -> SecondaryTier:
    """Our :class:`~kvoffload.tiers.disk.tier.DiskTier` from tier options: ``path`` and ``size_gib``
    (required), ``eviction_policy`` ("adaptive"), ``num_threads`` (4), ``o_direct`` (false),
    ``rescan_interval`` (seconds, 2.0; 0 = never), ``compression`` ("none"; ``lossless``,
    ``auto``; ``fp8`` needs a head size, which vLLM's layouts do not carry). Errors name
    ``<setting>.<option>``."""
    from kvoffload.tiers.disk.settings import DiskTierSettings
    from kvoffload.tiers.disk.tier import DiskTier
    from kvoffload.tiers.factory import validate_disk_settings

    options = dict(options)
    path = _take(options, "path", setting, required=True)
    size_gib = _take(options, "size_gib", setting, required=True)
    kwargs = {
        name: options.pop(name)
        for name in ("eviction_policy", "num_threads", "o_direct", "rescan_interval", "compression")
        if name in options
    }
    _reject_unknown("the disk tier", options, setting)
    try:
        validate_disk_settings(path, size_gib)
        settings = DiskTierSettings(path, int(size_gib * _GIB), **kwargs)
        return DiskTier(pool, layout, settings, enable_events=enable_events)
    except ConfigError as exc:  # name the option as it is spelled in the tier's options
        option = _DISK_OPTION_OF.get(exc.field)
        if option is None:
            raise
        raise ConfigError(f"{setting}.{option}", str(exc).split(": ", 1)[-1]) from exc


def build_redis_tier(
    pool: memoryview,
    layout: KVLayout,
    enable_events: bool,
    options: dict[str, Any],
    setting: str = "secondary_tiers",
) -> SecondaryTier:
    """Our :class:`~kvoffload.tiers.redis.tier.RedisTier` from tier options: ``url`` (required;
    ``redis://``, ``rediss://``, ``redis+cluster://``; credentials from the environment, see
    ``docs/remote-tier.md``) and any field of :class:`~kvoffload.tiers.redis.tier.RemoteTierConfig`
    (``timeout_s``, ``ttl_s``, ``lookup_wait_s``, ...). Its events are always gathered."""
    import dataclasses

    from kvoffload.tiers.redis.tier import RedisTier, RemoteTierConfig

    options = dict(options)
    fields = {f.name for f in dataclasses.fields(RemoteTierConfig)}
    kwargs = {name: options.pop(name) for name in list(options) if name in fields}
    if "url" not in kwargs:
        raise ConfigError(f"{setting}.url", "is required")
    _reject_unknown("the Redis tier", options, setting)
    return RedisTier(pool, layout, RemoteTierConfig(**kwargs))


#: Tier kinds by name, for :mod:`kvoffload.integrations.vllm.spec`'s ``kvoffload_tiers``.
TIER_BUILDERS = {"disk": build_disk_tier, "redis": build_redis_tier}


class KVOffloadDiskTier(KVOffloadTier):
    """Our disk tier: bounded, checksummed, crash-safe (options: :func:`build_disk_tier`)."""

    def build_tier(
        self, pool: memoryview, layout: KVLayout, enable_events: bool, options: dict[str, Any]
    ) -> SecondaryTier:
        return build_disk_tier(pool, layout, enable_events, options)


class KVOffloadRedisTier(KVOffloadTier):
    """Our Redis / Valkey (Cluster) tier, shared by every engine that points at the same server
    (options: :func:`build_redis_tier`)."""

    def build_tier(
        self, pool: memoryview, layout: KVLayout, enable_events: bool, options: dict[str, Any]
    ) -> SecondaryTier:
        return build_redis_tier(pool, layout, enable_events, options)

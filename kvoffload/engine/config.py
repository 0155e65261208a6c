"""``EngineConfig``: every setting an :class:`~kvoffload.engine.Engine` is built from, checked.

Units, one spelling per kind: durations are seconds and end in ``_s``; sizes a user sets are GiB
(``kv_cache_memory``, ``kv_offloading_size``, ``kv_disk_size``, as vLLM's
``--kv-offloading-size``). The spellings of the previous release are accepted for one release as
deprecated aliases (:data:`RENAMED_SETTINGS`): they warn with a :class:`DeprecationWarning`
naming the new spelling.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from kvoffload.engine.setting_choices import DTYPES, SCHEDULING_POLICIES
from kvoffload.errors import ConfigError
from kvoffload.events import KVEventsConfig
from kvoffload.eviction import available_eviction_policies
from kvoffload.keys import HASH_SCHEMES
from kvoffload.managers.tiering import CASCADE_MODES
from kvoffload.scheduler.costs import LOAD_POLICIES
from kvoffload.scheduler.policy import STORE_POLICIES
from kvoffload.tiers.codec import check_compression
from kvoffload.tiers.factory import validate_disk_settings, validate_remote_settings
from kvoffload.tiers.redis.url import redacted_url
from kvoffload.validation import (
    accepts_renamed,
    check_bool,
    check_choice,
    check_int,
    check_real,
    check_str,
)

__all__ = ["OFFLOADING_BACKENDS", "RENAMED_SETTINGS", "EngineConfig"]

#: Deprecated spelling -> current spelling; the old ones go in the release after next.
RENAMED_SETTINGS: dict[str, str] = {
    "kv_lookup_retry_seconds": "kv_lookup_retry_s",
    "kv_remote_ttl": "kv_remote_ttl_s",
    "kv_remote_lookup_wait": "kv_remote_lookup_wait_s",
    "log_stats_interval": "log_stats_interval_s",
}
OFFLOADING_BACKENDS = ("native",)
_MAX_SEED = 2**64 - 1  # torch.manual_seed's range
_MAX_GIB = 2**33  # 2**63 bytes: more than any address space


@accepts_renamed(RENAMED_SETTINGS)
@dataclass
class EngineConfig:
    """Everything an :class:`Engine` is built from. Invalid values raise :class:`ConfigError`.

    Device cache: ``num_device_blocks`` engine blocks of ``block_size`` tokens, or, when it is
    ``None``, as many as ``kv_cache_memory`` GiB hold. ``scheduling_policy`` orders the waiting
    requests (``cache_aware``, the default: longest device-resident prefix first, then
    the held prefix worth loading, aged by arrival; at most
    ``scheduling_max_bypass`` later arrivals admitted before any request; or ``fcfs``, vLLM's
    arrival order; :mod:`kvoffload.engine.admission`). Offloading is on when
    ``kv_offloading_size`` (GiB of host memory) is > 0; an offloaded block is
    ``block_size * block_size_factor`` tokens. ``store_threshold >= 2`` stores a block only once
    that many requests have wanted it (reuse filter). A disk tier behind the host tier is on when
    ``kv_disk_path`` is set (``kv_disk_size`` GiB on disk; ``docs/disk-tier.md``); blocks cascade
    to it per ``kv_tier_cascade`` (``write_through`` or ``on_evict``), at most
    ``kv_tier_write_max_in_flight`` blocks per tier at a time (``None``: half the host tier; the
    rest wait and are shed if the host evicts them first), and only blocks that
    ``kv_tier_write_min_reuse`` requests saw. Once earlier steps' stores to the host still in
    flight hold ``kv_store_max_in_flight`` blocks (``None``: half the host tier), new offers are
    shed, not queued. A lookup waits up to ``kv_promotion_wait_s`` for its disk or remote hits' promotion,
    so that they load in the same step. A shared Redis / Valkey
    tier (behind the disk tier, if any) is on when ``kv_remote_url`` is set
    (``docs/remote-tier.md``); ``kv_remote_optional`` runs without it when the server is down at
    start, ``kv_remote_ttl_s`` (seconds) lets the server expire the blocks, and a block the server
    has not answered a lookup of within ``kv_remote_lookup_wait_s`` seconds is a miss for now (its
    request computes it rather than waiting on a slow server). ``kv_disk_compression`` and
    ``kv_remote_compression`` (``none``, ``lossless``, ``auto``, ``fp8``) pick each tier's block
    codec (:mod:`kvoffload.tiers.codec`; ``fp8`` is lossy and opt-in). A request whose blocks
    are being promoted from a secondary tier waits for them up to ``kv_lookup_retry_s``
    (and at least a few steps), then computes what it lacks. ``load_policy``: which offloaded
    hits are loaded, ``auto`` (the prefix that is cheaper to load than to compute, by measured
    costs: ``docs/scheduler.md``), ``always`` or ``never`` (stores still happen). ``metrics_port`` serves
    Prometheus metrics at ``http://metrics_host:metrics_port/metrics`` (0: any free port) while
    the engine is open; ``log_stats_interval_s`` > 0 logs a stats line every that many seconds.
    """

    model: str = "small"
    device: str = "cpu"
    dtype: str | None = None
    seed: int = 0
    block_size: int = 16
    num_device_blocks: int | None = None
    kv_cache_memory: float = 1.0
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 16
    scheduling_policy: str = "cache_aware"
    scheduling_max_bypass: int = 32
    enable_prefix_caching: bool = True
    kv_offloading_size: float = 0.0
    kv_offloading_backend: str = "native"
    block_size_factor: int = 1
    eviction_policy: str = "adaptive"
    store_policy: str = "on_compute"
    store_threshold: int = 0
    load_policy: str = "auto"
    kv_disk_path: str | None = None
    kv_disk_size: float = 0.0
    kv_disk_eviction_policy: str | None = None
    kv_disk_o_direct: bool = False
    kv_disk_compression: str = "none"
    kv_tier_cascade: str = "write_through"
    kv_store_max_in_flight: int | None = None
    kv_tier_write_max_in_flight: int | None = None
    kv_tier_write_min_reuse: int = 1
    kv_promotion_wait_s: float = 0.02
    kv_lookup_retry_s: float = 2.0
    kv_remote_url: str | None = None
    kv_remote_optional: bool = False
    kv_remote_ttl_s: float | None = None
    kv_remote_lookup_wait_s: float = 0.25
    kv_remote_compression: str = "none"
    #: The share of each tier's capacity (host, disk) that operator pins may hold (docs/admin.md).
    kv_pin_quota: float = 0.5
    hash_scheme: str = "sha256_cbor"
    hash_seed: str = "0"
    kv_events_config: KVEventsConfig | dict[str, Any] | str | None = None
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    log_stats_interval_s: float = 0.0
    events: KVEventsConfig = field(init=False)

    def __post_init__(self) -> None:
        from kvoffload.engine.loader import resolve_device  # torch: not on import (CLI parsers)

        check_str("model", self.model)
        resolve_device(check_str("device", self.device))
        if self.dtype is not None:
            check_choice("dtype", self.dtype, DTYPES)
        check_int("seed", self.seed, 0, _MAX_SEED)
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "block_size_factor"):
            check_int(name, getattr(self, name), 1)
        if self.num_device_blocks is not None:
            check_int("num_device_blocks", self.num_device_blocks, 1)
        check_real(
            "kv_cache_memory", self.kv_cache_memory, maximum=_MAX_GIB, positive=True, unit="GiB"
        )
        check_choice("scheduling_policy", self.scheduling_policy, SCHEDULING_POLICIES)
        check_int("scheduling_max_bypass", self.scheduling_max_bypass, 0)
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        check_real("kv_pin_quota", self.kv_pin_quota, 0, 1)
        check_real(
            "kv_offloading_size",
            self.kv_offloading_size,
            0,
            _MAX_GIB,
            unit="GiB; 0 disables offloading",
        )
        check_choice("kv_offloading_backend", self.kv_offloading_backend, OFFLOADING_BACKENDS)
        check_choice("eviction_policy", self.eviction_policy, available_eviction_policies())
        check_choice("store_policy", self.store_policy, STORE_POLICIES)
        check_choice("load_policy", self.load_policy, LOAD_POLICIES)
        check_int("store_threshold", self.store_threshold, 0)
        self._check_tiers()
        check_choice("hash_scheme", self.hash_scheme, HASH_SCHEMES)
        check_str("hash_seed", self.hash_seed, allow_empty=True)
        if self.metrics_port is not None:
            check_int("metrics_port", self.metrics_port, 0, 65535)
        check_str("metrics_host", self.metrics_host)
        check_real("log_stats_interval_s", self.log_stats_interval_s, 0, unit="seconds")
        self.events = _events_config(self.kv_events_config)

    def _check_tiers(self) -> None:
        """The secondary tiers' settings, and the host tier they need."""
        validate_disk_settings(self.kv_disk_path, self.kv_disk_size)
        check_bool("kv_disk_o_direct", self.kv_disk_o_direct)
        check_compression("kv_disk_compression", self.kv_disk_compression)
        check_compression("kv_remote_compression", self.kv_remote_compression)
        check_bool("kv_remote_optional", self.kv_remote_optional)
        if self.kv_disk_path is not None and not self.offloading:
            raise ConfigError(
                "kv_disk_path", "a disk tier needs the host tier: set kv_offloading_size > 0"
            )
        if self.kv_disk_eviction_policy is not None:
            check_choice(
                "kv_disk_eviction_policy",
                self.kv_disk_eviction_policy,
                available_eviction_policies(),
            )
        validate_remote_settings(
            self.kv_remote_url, self.kv_remote_ttl_s, self.kv_remote_lookup_wait_s
        )
        if self.kv_remote_url is not None and not self.offloading:
            raise ConfigError(
                "kv_remote_url", "a remote tier needs the host tier: set kv_offloading_size > 0"
            )
        check_choice("kv_tier_cascade", self.kv_tier_cascade, CASCADE_MODES)
        for bound in ("kv_store_max_in_flight", "kv_tier_write_max_in_flight"):
            if getattr(self, bound) is not None:
                check_int(bound, getattr(self, bound), 0)
        check_int("kv_tier_write_min_reuse", self.kv_tier_write_min_reuse, 1)
        check_real("kv_promotion_wait_s", self.kv_promotion_wait_s, 0, 60, unit="seconds")
        check_real("kv_lookup_retry_s", self.kv_lookup_retry_s, 0, unit="seconds")

    def __repr__(self) -> str:
        """The dataclass's repr, with the remote URL's password shown as ``***`` (also ``str``,
        so every log line, message or JSON made from a config is safe)."""
        shown = {f.name: getattr(self, f.name) for f in fields(self) if f.repr}
        if self.kv_remote_url is not None:
            shown["kv_remote_url"] = redacted_url(self.kv_remote_url)
        return f"{type(self).__name__}({', '.join(f'{k}={v!r}' for k, v in shown.items())})"

    @property
    def offloading(self) -> bool:
        return self.kv_offloading_size > 0


def _events_config(events: Any) -> KVEventsConfig:
    """``kv_events_config`` (``None``, a ``KVEventsConfig``, a JSON string or a dict) parsed."""
    if events is None:
        return KVEventsConfig()
    if isinstance(events, KVEventsConfig):
        return events
    if isinstance(events, str):
        return KVEventsConfig.from_json(events)
    if isinstance(events, Mapping):
        return KVEventsConfig.from_dict(dict(events))
    raise ConfigError(
        "kv_events_config", f"must be a KVEventsConfig, a dict or a JSON string, got {events!r}"
    )

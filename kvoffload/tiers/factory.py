"""Building an engine's secondary tiers from its settings: the one place that knows every kind.

:func:`build_secondary_tiers` returns the tiers in lookup order (nearest first). A new kind of
tier adds its settings to :class:`TierSettings` and one branch here.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Protocol

from kvoffload.errors import ConfigError
from kvoffload.tiers.contract import KVLayout, SecondaryTier
from kvoffload.tiers.disk.directory import check_disk_path, check_disk_size
from kvoffload.validation import check_real

__all__ = [
    "TierSettings",
    "build_secondary_tiers",
    "validate_disk_settings",
    "validate_remote_settings",
]

log = logging.getLogger(__name__)

_GIB = 2**30


class TierSettings(Protocol):
    """The settings the factory reads (``EngineConfig`` has them all)."""

    kv_disk_path: str | None
    kv_disk_size: float
    kv_disk_eviction_policy: str | None
    kv_disk_o_direct: bool
    kv_disk_compression: str
    kv_remote_url: str | None
    kv_remote_optional: bool
    kv_remote_ttl_s: float | None
    kv_remote_lookup_wait_s: float
    kv_remote_compression: str
    eviction_policy: str


def validate_disk_settings(path: str | os.PathLike[str] | None, size_gib: float) -> None:
    """Check the disk tier's settings without touching the model: :class:`ConfigError` naming
    ``kv_disk_path`` (not a directory, under a file, not writable) or ``kv_disk_size`` (not a
    positive number; more than the whole filesystem holds). Creates nothing. (A size below one
    block is caught when the tier is built; one above the free space is a warning then.)
    """
    if path is not None and (isinstance(path, bool) or not isinstance(path, str | os.PathLike)):
        raise ConfigError("kv_disk_path", f"must be a directory path, got {path!r}")
    size = check_real("kv_disk_size", size_gib, 0, unit="GiB")
    if path is None:
        if size:
            raise ConfigError("kv_disk_size", f"set without kv_disk_path (got {size_gib!r})")
        return
    if size <= 0:
        raise ConfigError("kv_disk_size", f"must be a positive number of GiB, got {size_gib!r}")
    check_disk_size(check_disk_path(Path(path)), size)


def validate_remote_settings(url: str | None, ttl_s: float | None, lookup_wait_s: float) -> None:
    """Check the remote tier's settings without connecting: :class:`ConfigError` naming
    ``kv_remote_url`` (password hidden), ``kv_remote_ttl_s`` or ``kv_remote_lookup_wait_s``."""
    from kvoffload.tiers.redis.url import parse_redis_url

    check_real("kv_remote_lookup_wait_s", lookup_wait_s, positive=True, unit="seconds")
    if url is None:
        if ttl_s is not None:
            raise ConfigError("kv_remote_ttl_s", f"set without kv_remote_url (got {ttl_s!r})")
        return
    parse_redis_url(url)
    if ttl_s is not None:
        check_real("kv_remote_ttl_s", ttl_s, positive=True, unit="seconds")


def build_secondary_tiers(
    settings: TierSettings, pool: memoryview, layout: KVLayout, enable_events: bool = False
) -> list[SecondaryTier]:
    """The secondary tiers ``settings`` ask for, nearest first (empty when none)."""
    tiers: list[SecondaryTier] = []
    if settings.kv_disk_path is not None:
        from kvoffload.tiers.disk.settings import DiskTierSettings
        from kvoffload.tiers.disk.tier import DiskTier

        validate_disk_settings(settings.kv_disk_path, settings.kv_disk_size)
        disk = DiskTierSettings(
            settings.kv_disk_path,
            int(settings.kv_disk_size * _GIB),
            eviction_policy=settings.kv_disk_eviction_policy or settings.eviction_policy,
            o_direct=settings.kv_disk_o_direct,
            compression=settings.kv_disk_compression,
        )
        tiers.append(DiskTier(pool, layout, disk, enable_events=enable_events))
    if settings.kv_remote_url is not None:
        remote = _build_remote_tier(settings, pool, layout, enable_events)
        if remote is not None:
            tiers.append(remote)
    return tiers


def _build_remote_tier(
    settings: TierSettings, pool: memoryview, layout: KVLayout, enable_events: bool
) -> SecondaryTier | None:
    """The Redis / Valkey tier; ``None`` (with a warning) when the server cannot be reached at
    start and ``kv_remote_optional`` is set."""
    from kvoffload.tiers.redis.tier import RedisTier, RemoteTierConfig

    if settings.kv_remote_url is None:
        raise ConfigError("kv_remote_url", "a remote tier needs a URL")
    validate_remote_settings(
        settings.kv_remote_url, settings.kv_remote_ttl_s, settings.kv_remote_lookup_wait_s
    )
    config = RemoteTierConfig(
        url=settings.kv_remote_url,
        ttl_s=settings.kv_remote_ttl_s,
        lookup_wait_s=settings.kv_remote_lookup_wait_s,
        optional=settings.kv_remote_optional,
        compression=settings.kv_remote_compression,
    )
    try:
        return RedisTier(pool, layout, config, enable_events=enable_events)
    except ConfigError as exc:
        if not settings.kv_remote_optional or exc.field != "kv_remote_url":
            raise
        log.warning("running without the remote tier (kv_remote_optional): %s", exc)
        return None

"""Building an engine's secondary tiers from its settings: the one place that knows every kind.

:func:`build_secondary_tiers` returns the tiers in lookup order (nearest first). A new kind of
tier adds its settings to :class:`TierSettings` and one branch here.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Protocol

from kvoffload.errors import ConfigError
from kvoffload.tiers.base import KVLayout, SecondaryTier

__all__ = ["TierSettings", "build_secondary_tiers", "validate_disk_settings"]

_GIB = 2**30


class TierSettings(Protocol):
    """The settings the factory reads (``EngineConfig`` has them all)."""

    kv_disk_path: str | None
    kv_disk_size: float
    kv_disk_eviction_policy: str | None
    kv_disk_o_direct: bool
    eviction_policy: str


def validate_disk_settings(path: str | os.PathLike[str] | None, size_gib: float) -> None:
    """Check the disk tier's settings without touching the model: :class:`ConfigError` naming
    ``kv_disk_path`` or ``kv_disk_size``. (A size below one block is caught when the tier is built.)
    """
    if path is None:
        if size_gib:
            raise ConfigError("kv_disk_size", f"set without kv_disk_path (got {size_gib!r})")
        return
    if isinstance(size_gib, bool) or not isinstance(size_gib, (int, float)):
        raise ConfigError("kv_disk_size", f"must be a number of GiB, got {size_gib!r}")
    if not math.isfinite(size_gib) or size_gib <= 0:
        raise ConfigError("kv_disk_size", f"must be a positive number of GiB, got {size_gib!r}")
    root = Path(path)
    if str(path) == "":
        raise ConfigError("kv_disk_path", "must not be empty")
    if root.exists() and not root.is_dir():
        raise ConfigError("kv_disk_path", f"{str(root)!r} exists and is not a directory")
    probe_dir = root
    while not probe_dir.exists():  # the nearest existing ancestor must let us create it
        probe_dir = probe_dir.parent
    if not os.access(probe_dir, os.W_OK | os.X_OK):
        raise ConfigError("kv_disk_path", f"{str(probe_dir)!r} is not writable")


def build_secondary_tiers(
    settings: TierSettings, pool: memoryview, layout: KVLayout, enable_events: bool = False
) -> list[SecondaryTier]:
    """The secondary tiers ``settings`` ask for, nearest first (empty when none)."""
    tiers: list[SecondaryTier] = []
    if settings.kv_disk_path is not None:
        from kvoffload.tiers.disk import DiskTier

        validate_disk_settings(settings.kv_disk_path, settings.kv_disk_size)
        tiers.append(
            DiskTier(
                pool,
                layout,
                settings.kv_disk_path,
                int(settings.kv_disk_size * _GIB),
                eviction_policy=settings.kv_disk_eviction_policy or settings.eviction_policy,
                o_direct=settings.kv_disk_o_direct,
                enable_events=enable_events,
            )
        )
    return tiers

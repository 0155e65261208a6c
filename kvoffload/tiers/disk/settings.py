"""How a disk tier is built: :class:`DiskTierSettings`."""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvoffload.eviction import EvictionPolicy
from kvoffload.tiers.disk.files import FaultHook

__all__ = ["DiskTierSettings"]


@dataclass(frozen=True, slots=True)
class DiskTierSettings:
    """How a :class:`~kvoffload.tiers.disk.tier.DiskTier` is built.

    ``path``: the directory (created if missing); ``capacity_bytes``: the bound on disk, ledger
    included; ``eviction_policy``: a registry name or a policy; ``num_threads``: I/O threads;
    ``o_direct``: bypass the page cache (needs 4 KiB aligned pool and block size and a
    filesystem that supports it); ``rescan_interval``: seconds between looks for other
    processes' new files (0: never); ``fault_hook``: injects OS errors (tests);
    ``compression``: the tier's codec (``none`` by default).
    """

    path: str | os.PathLike[str]
    capacity_bytes: int
    eviction_policy: str | EvictionPolicy = "adaptive"
    num_threads: int = 4
    o_direct: bool = False
    rescan_interval: float = 2.0
    fault_hook: FaultHook | None = None
    #: ``kv_disk_compression``: ``none``, ``lossless``, ``auto`` or ``fp8`` (lossy; opt-in). A
    #: compressed tier keeps its files in a namespace of its own (``<fingerprint>.z``), each
    #: counted by its own size (:mod:`kvoffload.tiers.codec`).
    compression: str = "none"

"""Secondary tiers: blocks held outside device memory and outside the host pool (disk, remote).

A secondary tier never touches the engine's cache: bytes move host pool ↔ tier only, and the
tiering manager moves them host pool ↔ device through the host tier. See ``docs/tiers.md``.
"""

from kvoffload._lazy import lazy_exports
from kvoffload.tiers.blockformat import BlockHeader, CorruptBlockError
from kvoffload.tiers.contract import KVLayout, SecondaryTier, TierJob, TierJobResult

__all__ = [
    "BlockHeader",
    "CorruptBlockError",
    "DiskTier",
    "KVLayout",
    "RedisTier",
    "RemoteTierConfig",
    "SecondaryTier",
    "TierJob",
    "TierJobResult",
]

# The tiers themselves load on first use (the tiering manager imports this package for the
# contract alone, and the tiers start threads and open files or sockets only when built).
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "DiskTier": "kvoffload.tiers.disk.tier",
        "RedisTier": "kvoffload.tiers.redis.tier",
        "RemoteTierConfig": "kvoffload.tiers.redis.tier",
    },
)

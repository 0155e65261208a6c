"""Secondary tiers: blocks held outside device memory and outside the host pool (disk, remote).

A secondary tier never touches the engine's cache: bytes move host pool ↔ tier only, and the
tiering manager moves them host pool ↔ device through the host tier. See ``docs/tiers.md``.
"""

from kvoffload._lazy import lazy_exports
from kvoffload.tiers.base import KVLayout, SecondaryTier, TierJob, TierJobResult
from kvoffload.tiers.blockformat import BlockHeader, CorruptBlockError

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
# contract alone; the Redis tier pulls in redis-py).
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "DiskTier": "kvoffload.tiers.disk",
        "RedisTier": "kvoffload.tiers.remote",
        "RemoteTierConfig": "kvoffload.tiers.remote",
    },
)

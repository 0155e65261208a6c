"""Secondary tiers: blocks held outside device memory and outside the host pool (disk, remote).

A secondary tier never touches the engine's cache: bytes move host pool ↔ tier only, and the
tiering manager moves them host pool ↔ device through the host tier. See ``docs/tiers.md``.
"""

from kvoffload.tiers.base import KVLayout, SecondaryTier, TierJob, TierJobResult
from kvoffload.tiers.blockformat import BlockHeader, CorruptBlockError

__all__ = [
    "BlockHeader",
    "CorruptBlockError",
    "KVLayout",
    "SecondaryTier",
    "TierJob",
    "TierJobResult",
]

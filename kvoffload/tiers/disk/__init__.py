"""The disk tier: blocks as self-checking files in a directory (``docs/disk-tier.md``).

Rooms: :mod:`~kvoffload.tiers.disk.tier` (the :class:`DiskTier` itself, the tier contract),
:mod:`~kvoffload.tiers.disk.jobs` (its I/O threads), :mod:`~kvoffload.tiers.disk.files` (block
files: names, atomic writes, verified reads), :mod:`~kvoffload.tiers.disk.ledger` (the byte count
shared by every process on a directory), :mod:`~kvoffload.tiers.disk.spares` (files made ahead of
writes), :mod:`~kvoffload.tiers.disk.scan` (the warm-restart walk),
:mod:`~kvoffload.tiers.disk.directory` (namespaces and the ``O_DIRECT`` probe) and
:mod:`~kvoffload.tiers.disk.reclaim` (older formats' namespaces). Nothing here imports the Redis
tier; both sit on :mod:`kvoffload.tiers.contract` and :mod:`kvoffload.tiers.blockformat`.
"""

from kvoffload._lazy import lazy_exports

__all__ = ["LEDGER_BYTES", "DiskTier", "DiskTierSettings"]

# The tier loads on first use: its submodules import without it (each is one room of the tier).
__getattr__, __dir__ = lazy_exports(__name__, dict.fromkeys(__all__, "kvoffload.tiers.disk.tier"))

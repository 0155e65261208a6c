"""The disk tier: blocks as self-checking files in a directory (``docs/disk-tier.md``).

Rooms: :mod:`~kvoffload.tiers.disk.tier` (the :class:`DiskTier` itself, the tier contract),
:mod:`~kvoffload.tiers.disk.settings` (how one is built), :mod:`~kvoffload.tiers.disk.upkeep`
(the rescan thread's periodic work), :mod:`~kvoffload.tiers.disk.sizes` (a compressed tier's
file sizes), :mod:`~kvoffload.tiers.disk.counters` (its stats' counts),
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
__getattr__, __dir__ = lazy_exports(
    __name__,
    {
        "DiskTierSettings": "kvoffload.tiers.disk.settings",
        **dict.fromkeys(("LEDGER_BYTES", "DiskTier"), "kvoffload.tiers.disk.tier"),
    },
)

"""``BlockIndex``: which blocks each tier holds, kept live by applying KV events in order.

A tier is one of :data:`~kvoffload.events.messages.TIERS` (``"device"``, ``"host"``, ``"disk"``,
``"remote"``), named from an event's medium and locality by
:func:`~kvoffload.events.messages.tier_of` (the router's index uses the same names). A block is
its published hash within a KV-cache group; events without ``group_idx`` address group 0, and
events without a medium (producers older than mediums) address ``"device"``.

:class:`~kvoffload.events.messages.BlockStored` adds its blocks to the tier,
:class:`~kvoffload.events.messages.BlockRemoved` removes them (unknown ones are ignored), and
:class:`~kvoffload.events.messages.AllBlocksCleared`, which carries no medium, empties the tiers
in ``cleared_tiers`` (default: ``device`` only, since only the device prefix cache emits it; pass
``None`` to empty every tier, as llm-d does). Cost: one set operation per block.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

from kvoffload.events.messages import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    ExternalBlockHash,
    KVCacheEvent,
    KVEventBatch,
    tier_of,
)

__all__ = ["BlockIndex"]


class BlockIndex:
    """Blocks per tier and KV-cache group. Not thread-safe.

    Layout: ``tier -> group -> set of block hashes``. Tiers and groups stay known once seen (so
    :meth:`counts` reports emptied tiers as 0).
    """

    __slots__ = ("_blocks", "_cleared_tiers")

    def __init__(self, cleared_tiers: Collection[str] | None = ("device",)) -> None:
        self._blocks: dict[str, dict[int, set[ExternalBlockHash]]] = {}
        self._cleared_tiers = None if cleared_tiers is None else frozenset(cleared_tiers)

    def apply(self, batch: KVEventBatch) -> None:
        """Apply every event of ``batch``, in order."""
        for event in batch.events:
            self.apply_event(event)

    def apply_event(self, event: KVCacheEvent) -> None:
        """Apply one event."""
        if isinstance(event, BlockStored):
            self._group(event.medium, event.locality, event.group_idx).update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            held = self._group(event.medium, event.locality, event.group_idx)
            for h in event.block_hashes:
                held.discard(h)
        elif isinstance(event, AllBlocksCleared):
            for tier, groups in self._blocks.items():
                if self._cleared_tiers is None or tier in self._cleared_tiers:
                    for held in groups.values():
                        held.clear()
        else:
            raise TypeError(f"not a KV cache event: {event!r}")

    def contains(self, block_hash: ExternalBlockHash, tier: str, group_idx: int = 0) -> bool:
        """Say whether ``tier`` holds ``block_hash`` in group ``group_idx``."""
        groups = self._blocks.get(tier)
        return groups is not None and block_hash in groups.get(group_idx, ())

    def tiers_of(self, block_hash: ExternalBlockHash, group_idx: int = 0) -> list[str]:
        """Return the tiers holding ``block_hash`` in group ``group_idx``, in first-seen order."""
        return [
            tier for tier, groups in self._blocks.items() if block_hash in groups.get(group_idx, ())
        ]

    def prefix_length(
        self, block_hashes: Sequence[ExternalBlockHash], tier: str, group_idx: int = 0
    ) -> int:
        """Return how many leading blocks of ``block_hashes`` ``tier`` holds (a router's hits)."""
        held = self._blocks.get(tier, {}).get(group_idx, ())
        n = 0
        for h in block_hashes:
            if h not in held:
                break
            n += 1
        return n

    def blocks(self, tier: str, group_idx: int = 0) -> frozenset[ExternalBlockHash]:
        """Return a snapshot of the blocks ``tier`` holds in group ``group_idx``."""
        return frozenset(self._blocks.get(tier, {}).get(group_idx, ()))

    def counts(self) -> dict[str, int]:
        """Return the number of blocks (all groups) of every tier seen so far."""
        return {tier: sum(map(len, groups.values())) for tier, groups in self._blocks.items()}

    def tiers(self) -> list[str]:
        """Return every tier seen so far, in first-seen order."""
        return list(self._blocks)

    def clear(self) -> None:
        """Forget everything (e.g. after the publisher restarted)."""
        self._blocks.clear()

    def _group(
        self, medium: str | None, locality: str | None, group_idx: int | None
    ) -> set[ExternalBlockHash]:
        tier = tier_of(medium, locality)
        groups = self._blocks.get(tier)
        if groups is None:
            groups = self._blocks[tier] = {}
        group = 0 if group_idx is None else group_idx
        held = groups.get(group)
        if held is None:
            held = groups[group] = set()
        return held

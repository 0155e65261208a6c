"""The device cache's KV events (``BlockStored`` / ``BlockRemoved`` on ``GPU``), in order.

Device events are published in the order they happened: a step can cache a block (a load lands)
and then evict it (its request is preempted, the block reused), and a router must end up without
it. Consecutive removals are coalesced into one ``BlockRemoved``; nothing is reordered.
"""

from __future__ import annotations

from kvoffload.engine.request import Request
from kvoffload.events.messages import (
    MEDIUM_GPU,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    external_block_hash,
)
from kvoffload.keys import BlockHash

__all__ = ["DeviceEventRecorder"]


class DeviceEventRecorder:
    """Collects one step's device events: :meth:`on_evicted` (the block pool's eviction hook),
    :meth:`stored` (blocks that entered the prefix cache), then :meth:`take`."""

    def __init__(self, block_size: int, int_block_hashes: bool) -> None:
        self.block_size = block_size
        self.int_block_hashes = int_block_hashes
        # The device's event types (AllBlocksCleared: what a device prefix-cache reset announces).
        self._events: list[BlockStored | BlockRemoved | AllBlocksCleared] = []
        self._removed: list[bytes | int] = []

    def on_evicted(self, block_hash: BlockHash) -> None:
        self._removed.append(external_block_hash(block_hash, self.int_block_hashes))

    def stored(self, req: Request, indices: list[int]) -> None:
        """Blocks ``indices`` of ``req`` entered the device cache: one ``BlockStored`` per run of
        consecutive indices (its parent is the block before the run)."""
        self._flush_removals()
        as_int, bs = self.int_block_hashes, self.block_size
        runs: list[list[int]] = []
        for i in indices:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, last = run[0], run[-1]
            parent = req.block_hashes[first - 1] if first else None
            self._events.append(
                BlockStored(
                    block_hashes=[external_block_hash(req.block_hashes[i], as_int) for i in run],
                    parent_block_hash=None
                    if parent is None
                    else external_block_hash(parent, as_int),
                    token_ids=req.all_token_ids[first * bs : (last + 1) * bs],
                    block_size=bs,
                    lora_id=None,
                    medium=MEDIUM_GPU,
                    lora_name=None,
                    group_idx=0,
                )
            )

    def take(self) -> list[BlockStored | BlockRemoved | AllBlocksCleared]:
        """The events since the last call, in the order they happened."""
        self._flush_removals()
        events, self._events = self._events, []
        return events

    def _flush_removals(self) -> None:
        if self._removed:
            self._events.append(BlockRemoved(self._removed, MEDIUM_GPU, group_idx=0))
            self._removed = []

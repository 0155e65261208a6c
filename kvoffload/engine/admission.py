"""The order in which a step tries waiting requests for admission, chosen by
``scheduling_policy``: ``"fcfs"`` (:class:`~kvoffload.engine.waiting_queue.FCFSQueue`, vLLM's
order) or ``"cache_aware"`` (:class:`~kvoffload.engine.cache_aware_queue.CacheAwareQueue`, the
default). Both speak :class:`~kvoffload.engine.waiting_queue.WaitingQueue`'s protocol with the
engine scheduler.
"""

from __future__ import annotations

from kvoffload.engine.block_pool import BlockPool
from kvoffload.engine.cache_aware_queue import CacheAwareQueue
from kvoffload.engine.setting_choices import SCHEDULING_POLICIES
from kvoffload.engine.waiting_queue import FCFSQueue, HeldProbe, HeldWorth, WaitingQueue

__all__ = [
    "SCHEDULING_POLICIES",
    "CacheAwareQueue",
    "FCFSQueue",
    "HeldProbe",
    "HeldWorth",
    "WaitingQueue",
    "make_waiting_queue",
]


def make_waiting_queue(
    policy: str,
    pool: BlockPool,
    block_size: int,
    max_bypass: int,
    held: HeldProbe | None,
    held_worth: HeldWorth | None = None,
) -> WaitingQueue:
    """The waiting queue of ``policy`` (one of :data:`SCHEDULING_POLICIES`); ``held`` and
    ``held_worth`` describe the host tier's blocks to the cache-aware order."""
    if policy == "fcfs":
        return FCFSQueue()
    if policy == "cache_aware":
        return CacheAwareQueue(pool, block_size, max_bypass, held, held_worth)
    raise ValueError(f"unknown scheduling policy {policy!r}; choose from {SCHEDULING_POLICIES}")

"""Least-recently-used eviction."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Container, Iterator, Sequence

from kvoffload.base import ReqContext
from kvoffload.eviction.base import EvictionPolicy, OffloadedBlock, register_eviction_policy
from kvoffload.keys import OffloadKey

__all__ = ["LRUPolicy"]


@register_eviction_policy
class LRUPolicy(EvictionPolicy):
    """Evict the evictable block used least recently.

    One ``OrderedDict`` in recency order (oldest first). :meth:`touch` walks a prefix tail to head,
    so the head of a prefix, which every longer hit needs, ends up most recent and leaves last.
    :meth:`request_finished` commits the whole request the same way, the blocks it stored
    included (a new block enters at the recent end in store order, head first, until then), so
    that after a request the chain it used leaves tail first.
    Eviction scans from the oldest end and skips pinned, pending and protected blocks; those sit
    near the recent end (just stored or just touched), so the scan rarely passes many.
    """

    name = "lru"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._blocks: OrderedDict[OffloadKey, OffloadedBlock] = OrderedDict()
        # Bound C methods: get() runs once per block per lookup, insert() once per stored block
        # (measured hot path: a Python-level call per block costs ~5% of the whole stream).
        self.get = self._blocks.get  # type: ignore[method-assign]
        self.insert = self._blocks.__setitem__  # type: ignore[method-assign]
        self.remove = self._blocks.__delitem__  # type: ignore[method-assign]

    # The three below are replaced per instance in __init__; they state the behaviour.
    def get(self, key: OffloadKey) -> OffloadedBlock | None:
        return self._blocks.get(key)

    def insert(self, key: OffloadKey, block: OffloadedBlock) -> None:
        self._blocks[key] = block

    def remove(self, key: OffloadKey) -> None:
        del self._blocks[key]

    def insert_n(self, keys: Sequence[OffloadKey], blocks: Sequence[OffloadedBlock]) -> None:
        self._blocks.update(zip(keys, blocks, strict=True))

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        blocks = self._blocks
        move = blocks.move_to_end
        for key in reversed(keys):
            if key in blocks:  # a membership test: cheaper than catching KeyError for absent keys
                move(key)

    def request_finished(
        self,
        touched: Sequence[Sequence[OffloadKey]],
        stored: Sequence[Sequence[OffloadKey]],
        ctx: ReqContext,
    ) -> None:
        blocks = self._blocks
        move = blocks.move_to_end
        # The stored runs first, then the touched chains (the whole request, head last).
        for keys in itertools.chain(reversed(stored), reversed(touched)):
            for key in reversed(keys):
                if key in blocks:
                    move(key)

    def evict(
        self, n: int, protected: Container[OffloadKey]
    ) -> list[tuple[OffloadKey, OffloadedBlock]] | None:
        victims: list[tuple[OffloadKey, OffloadedBlock]] = []
        if n <= 0:
            return victims
        for key, block in self._blocks.items():
            if block.ref_cnt == 0 and key not in protected:
                victims.append((key, block))
                if len(victims) == n:
                    break
        else:
            return None
        blocks = self._blocks
        for key, _ in victims:
            del blocks[key]
        return victims

    def clear(self) -> None:
        self._blocks.clear()

    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self) -> Iterator[OffloadKey]:
        return iter(self._blocks)

"""Adaptive replacement cache (ARC) eviction."""

from __future__ import annotations

import itertools
from collections import OrderedDict
from collections.abc import Container, Iterator, Sequence

from kvoffload.base import ReqContext
from kvoffload.eviction._request_state import keys_seen_by
from kvoffload.eviction.base import EvictionPolicy, OffloadedBlock, register_eviction_policy
from kvoffload.keys import OffloadKey

__all__ = ["ARCPolicy"]


def _next_evictable(
    scan: Iterator[tuple[OffloadKey, OffloadedBlock]], protected: Container[OffloadKey]
) -> tuple[OffloadKey, OffloadedBlock] | None:
    for key, block in scan:
        if block.ref_cnt == 0 and key not in protected:
            return key, block
    return None


@register_eviction_policy
class ARCPolicy(EvictionPolicy):
    """ARC: a recency list and a frequency list whose split adapts to ghost hits.

    ``T1`` holds blocks used by one request, ``T2`` blocks used by two or more, each oldest first;
    ``B1``/``B2`` remember the keys last evicted from ``T1``/``T2`` (at most ``capacity`` each,
    oldest dropped first). ``target`` (0 <= target <= capacity) is the size ``T1`` should have.

    * ``insert``: the key enters the new end of ``T1``. A key remembered in ``B1`` (evicted from
      ``T1`` recently and stored again) raises ``target`` by ``max(1, |B2| / |B1|)``, one in ``B2``
      lowers it by ``max(1, |B1| / |B2|)`` (clamped); either way it leaves the ghost list. A ghost
      hit is a store miss: it is seen where the block comes back, ``prepare_store``, as in vLLM.
    * ``touch`` (tail to head, so the prefix head ends most recent; each key once per request;
      keys not held are ignored): a ready (``ref_cnt >= 0``) ``T1`` block moves to the new end of
      ``T2``, a pending one only to the new end of ``T1`` (its store, not a second use, put it
      there); a ``T2`` block moves to the new end of ``T2``.
    * ``request_finished``: the request's keys, walked tail to head, move to the new end of the
      list they are in (no promotion: the use was counted by ``touch``), so that the chain it
      stored or used leaves ``T1`` / ``T2`` tail first.
    * Eviction rule: for each victim, take the oldest evictable block of ``T1`` if ``T1`` (less
      the victims already taken from it) has at least ``max(1, int(target))`` blocks, else the
      oldest evictable of ``T2``; if the preferred list has none, the other one. Victims from
      ``T1`` go to ``B1``, from ``T2`` to ``B2``. Atomic: the scans do not mutate; exactly ``n``
      victims are committed, or none.

    Costs: O(1) per touched or inserted key; ``evict`` O(n + blocks skipped) with one monotonic
    scan per list. Not thread-safe.
    """

    name = "arc"

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._blocks: dict[OffloadKey, OffloadedBlock] = {}
        # Bound C method: get() runs once per block per lookup.
        self.get = self._blocks.get  # type: ignore[method-assign]
        self._t1: OrderedDict[OffloadKey, OffloadedBlock] = OrderedDict()
        self._t2: OrderedDict[OffloadKey, OffloadedBlock] = OrderedDict()
        self._b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self._b2: OrderedDict[OffloadKey, None] = OrderedDict()
        self.target = 0.0

    def get(self, key: OffloadKey) -> OffloadedBlock | None:  # replaced per instance in __init__
        return self._blocks.get(key)

    def insert(self, key: OffloadKey, block: OffloadedBlock) -> None:
        self._blocks[key] = block
        self._t1[key] = block
        b1, b2 = self._b1, self._b2
        if key in b1:
            self.target = min(self.target + max(1.0, len(b2) / len(b1)), float(self.capacity))
            del b1[key]
        elif key in b2:
            self.target = max(self.target - max(1.0, len(b1) / len(b2)), 0.0)
            del b2[key]

    def remove(self, key: OffloadKey) -> None:
        del self._blocks[key]
        if self._t1.pop(key, None) is None:
            del self._t2[key]

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        seen = keys_seen_by(ctx, self)
        t1, t2 = self._t1, self._t2
        for key in reversed(keys):
            if key in seen:
                continue
            seen.add(key)
            block = t1.get(key)
            if block is not None:
                if block.ref_cnt >= 0:
                    del t1[key]
                    t2[key] = block
                else:
                    t1.move_to_end(key)
            elif key in t2:
                t2.move_to_end(key)

    def request_finished(
        self,
        touched: Sequence[Sequence[OffloadKey]],
        stored: Sequence[Sequence[OffloadKey]],
        ctx: ReqContext,
    ) -> None:
        t1, t2 = self._t1, self._t2
        # The stored runs first, then the touched chains (the whole request, head last).
        for keys in itertools.chain(reversed(stored), reversed(touched)):
            for key in reversed(keys):
                if key in t1:
                    t1.move_to_end(key)
                elif key in t2:
                    t2.move_to_end(key)

    def evict(
        self, n: int, protected: Container[OffloadKey]
    ) -> list[tuple[OffloadKey, OffloadedBlock]] | None:
        if n <= 0:
            return []
        scans = (iter(self._t1.items()), iter(self._t2.items()))
        exhausted = [False, False]
        picks: tuple[list[tuple[OffloadKey, OffloadedBlock]], ...] = ([], [])
        t1_left = len(self._t1)
        want_t1 = max(1, int(self.target))
        for _ in range(n):
            for side in (0, 1) if t1_left >= want_t1 else (1, 0):
                if exhausted[side]:
                    continue
                victim = _next_evictable(scans[side], protected)
                if victim is not None:
                    picks[side].append(victim)
                    t1_left -= side == 0
                    break
                exhausted[side] = True
            else:
                return None
        from_t1, from_t2 = picks
        blocks, t1, t2, b1, b2 = self._blocks, self._t1, self._t2, self._b1, self._b2
        for key, _ in from_t1:
            del t1[key], blocks[key]
            b1[key] = None
        for key, _ in from_t2:
            del t2[key], blocks[key]
            b2[key] = None
        for ghosts in (b1, b2):
            for _ in range(len(ghosts) - self.capacity):
                ghosts.popitem(last=False)
        return from_t1 + from_t2

    def clear(self) -> None:
        for d in (self._blocks, self._t1, self._t2, self._b1, self._b2):
            d.clear()
        self.target = 0.0

    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self) -> Iterator[OffloadKey]:
        return iter(self._blocks)

    def check_invariants(self) -> None:
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        assert not t1.keys() & t2.keys(), "a block is in both T1 and T2"
        assert self._blocks.keys() == t1.keys() | t2.keys(), "get() and T1/T2 disagree"
        for lst in (t1, t2):
            for key, block in lst.items():
                assert self._blocks[key] is block, f"{key.hex()}: stale block record"
        assert not b1.keys() & b2.keys(), "a key is in both ghost lists"
        assert not (b1.keys() | b2.keys()) & self._blocks.keys(), "a held block is also a ghost"
        assert len(b1) <= self.capacity and len(b2) <= self.capacity, "ghost list over capacity"
        assert 0.0 <= self.target <= self.capacity, f"target {self.target} out of range"

"""Adaptive replacement cache (ARC) eviction."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterable, Iterator, Sequence

from kvoffload.eviction._request_state import GroupWatch, RequestUses
from kvoffload.eviction.base import (
    HeldBlocksPolicy,
    OffloadedBlock,
    register_eviction_policy,
    restore_unpinned,
    take_pinned,
)
from kvoffload.keys import OffloadKey
from kvoffload.manager_contract import ReqContext

__all__ = ["ARCPolicy"]


def _next_evictable(
    scan: Iterator[tuple[OffloadKey, OffloadedBlock]], protected: Container[OffloadKey]
) -> tuple[OffloadKey, OffloadedBlock] | None:
    for key, block in scan:
        if block.ref_cnt == 0 and key not in protected:
            return key, block
    return None


@register_eviction_policy
class ARCPolicy(HeldBlocksPolicy):
    """ARC as vLLM 0.33's ``ARCCachePolicy``: a recency list and a frequency list whose split
    adapts to ghost hits.

    ``T1`` holds blocks used by one request, ``T2`` blocks reused, each oldest first; ``B1``/``B2``
    remember the keys last evicted from ``T1``/``T2`` (at most ``capacity`` each, oldest dropped
    first). ``target`` (0 <= target <= capacity) is the size ``T1`` should have.

    * Ghost hit (a key in ``B1`` or ``B2`` that a request is about to store again, once per
      request and key, before the eviction that makes room for it, as vLLM's ``on_store_miss``;
      or a key in ``B1``/``B2`` that is touched): ``B1`` raises ``target`` by
      ``max(1, |B2| / |B1|)``, ``B2`` lowers it by ``max(1, |B1| / |B2|)`` (clamped); the key
      moves to the new end of its ghost list. ``insert``: the key enters the new end of ``T1``
      and leaves the ghost lists.
    * ``touch`` (tail to head, every call): a ready ``T1`` block moves to the new end of ``T2``,
      a pending one to the new end of ``T1`` (its store, not a second use, put it there); a ``T2``
      block to the new end of ``T2``; a ghost key is a ghost hit.
    * ``request_finished``: the keys the request loaded or offered to store, tail to head
      (:meth:`RequestUses.head_to_tail`): a key it only stored moves to the new end of the list it
      is in; a ready block it reused (loaded, or offered when already stored) moves from ``T1``
      to the new end of ``T2``, or to the new end of ``T2``.
    * Eviction rule: for each victim, take the oldest evictable block of ``T1`` if ``T1`` (less
      the victims already taken from it) has at least ``max(1, int(target))`` blocks, else the
      oldest evictable of ``T2``; if the preferred list has none, the other one. Victims from
      ``T1`` go to ``B1``, from ``T2`` to ``B2``; victims are returned in the order chosen.
      Atomic: the scans do not mutate; exactly ``n`` victims are committed, or none.

    * Operator pins (:meth:`pinned` / :meth:`unpinned`): a pinned block leaves ``T1``/``T2``
      (uses while pinned are ignored) and comes back to the new end of its list when unpinned.

    Costs: O(1) per touched, inserted, finished, pinned or unpinned key; ``evict`` O(n + blocks
    skipped) with one monotonic scan per list (pinned blocks are never among the skipped). Not
    thread-safe.
    """

    name = "arc"
    reads_access = True

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        self._t1: OrderedDict[OffloadKey, OffloadedBlock] = OrderedDict()
        self._t2: OrderedDict[OffloadKey, OffloadedBlock] = OrderedDict()
        self._b1: OrderedDict[OffloadKey, None] = OrderedDict()
        self._b2: OrderedDict[OffloadKey, None] = OrderedDict()
        self.target = 0.0
        self._groups = GroupWatch()
        #: blocks held by operator pins, out of T1/T2 (so no scan passes them): key -> whether
        #: it came from T2; back at the new end of its list when unpinned
        self._pinned: dict[OffloadKey, bool] = {}

    def pinned(self, keys: Sequence[OffloadKey]) -> None:
        take_pinned(keys, self._t1, self._t2, self._pinned)

    def unpinned(self, keys: Sequence[OffloadKey]) -> None:
        restore_unpinned(keys, self._blocks, self._t1, self._t2, self._pinned)

    def insert(self, key: OffloadKey, block: OffloadedBlock, ctx: ReqContext | None = None) -> None:
        self._groups.saw((key,))
        self._blocks[key] = block
        self._t1[key] = block
        self._b1.pop(key, None)
        self._b2.pop(key, None)

    def insert_n(
        self,
        keys: Sequence[OffloadKey],
        blocks: Sequence[OffloadedBlock],
        ctx: ReqContext | None = None,
    ) -> None:
        self._groups.saw(keys)
        pairs = list(zip(keys, blocks, strict=True))
        self._blocks.update(pairs)
        self._t1.update(pairs)
        for ghosts in (self._b1, self._b2):
            if not ghosts.keys().isdisjoint(keys):
                for key in keys:
                    ghosts.pop(key, None)

    def remove(self, key: OffloadKey) -> None:
        del self._blocks[key]
        if self._t1.pop(key, None) is None:
            del self._t2[key]

    def store_missed(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        b1, b2 = self._b1, self._b2
        if not (b1.keys().isdisjoint(keys) and b2.keys().isdisjoint(keys)):
            self._ghost_hits(reversed(keys))

    def _ghost_hits(self, keys: Iterable[OffloadKey]) -> None:
        """Adapt ``target`` to a use of each key of ``keys`` that is a ghost, in order (see the
        class docstring)."""
        b1, b2 = self._b1, self._b2
        capacity, target = float(self.capacity), self.target
        for key in keys:
            if key in b1:
                target = min(target + max(1.0, len(b2) / len(b1)), capacity)
                b1.move_to_end(key)
            elif key in b2:
                target = max(target - max(1.0, len(b1) / len(b2)), 0.0)
                b2.move_to_end(key)
        self.target = target

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        ghosts: list[OffloadKey] = []  # in the order met (a hit moves only ghost lists)
        for key in reversed(keys):
            block = t1.get(key)
            if block is not None:
                if block.ref_cnt >= 0:
                    del t1[key]
                    t2[key] = block
                else:
                    t1.move_to_end(key)
            elif key in t2:
                t2.move_to_end(key)
            elif key in b1 or key in b2:
                ghosts.append(key)
        if ghosts:
            self._ghost_hits(ghosts)

    def request_finished(self, uses: RequestUses, ctx: ReqContext) -> None:
        reused, inserted = uses.reused_and_inserted()
        t1, t2 = self._t1, self._t2
        t1_pop, t1_move, t2_move = t1.pop, t1.move_to_end, t2.move_to_end
        for key in reversed(uses.head_to_tail(ctx, not self._groups.mixed)):
            if key in reused:  # a reuse: one more use of the block
                block = t1_pop(key, None)
                if block is not None:
                    t2[key] = block
                elif key in t2:
                    t2_move(key)
            elif key in inserted:  # only stored: recency within its list, no promotion
                if key in t1:
                    t1_move(key)
                elif key in t2:
                    t2_move(key)

    def evict(
        self, n: int, protected: Container[OffloadKey]
    ) -> list[tuple[OffloadKey, OffloadedBlock]] | None:
        if n <= 0:
            return []
        scans = (iter(self._t1.items()), iter(self._t2.items()))
        exhausted = [False, False]
        picks: tuple[list[tuple[OffloadKey, OffloadedBlock]], ...] = ([], [])
        victims: list[tuple[OffloadKey, OffloadedBlock]] = []  # both, in the order chosen
        t1_left = len(self._t1)
        want_t1 = max(1, int(self.target))
        for _ in range(n):
            for side in (0, 1) if t1_left >= want_t1 else (1, 0):
                if exhausted[side]:
                    continue
                victim = _next_evictable(scans[side], protected)
                if victim is not None:
                    picks[side].append(victim)
                    victims.append(victim)
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
        return victims

    def clear(self) -> None:
        self._pinned.clear()
        for d in (self._blocks, self._t1, self._t2, self._b1, self._b2):
            d.clear()
        self.target = 0.0
        self._groups.clear()
        self.generation += 1

    def check_invariants(self) -> None:
        t1, t2, b1, b2 = self._t1, self._t2, self._b1, self._b2
        assert not t1.keys() & t2.keys(), "a block is in both T1 and T2"
        pinned = self._pinned.keys()
        assert not pinned & (t1.keys() | t2.keys()), "a pinned block is still in T1/T2"
        assert self._blocks.keys() == t1.keys() | t2.keys() | pinned, "get() and T1/T2 disagree"
        for lst in (t1, t2):
            for key, block in lst.items():
                assert self._blocks[key] is block, f"{key.hex()}: stale block record"
        assert not b1.keys() & b2.keys(), "a key is in both ghost lists"
        assert not (b1.keys() | b2.keys()) & self._blocks.keys(), "a held block is also a ghost"
        assert len(b1) <= self.capacity and len(b2) <= self.capacity, "ghost list over capacity"
        assert 0.0 <= self.target <= self.capacity, f"target {self.target} out of range"

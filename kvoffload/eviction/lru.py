"""Least-recently-used eviction, in exactly vLLM 0.33's order (``LRUCachePolicy``)."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Container, Iterator, Sequence

from kvoffload.eviction._request_state import (
    GroupWatch,
    RequestState,
    RequestUses,
    request_state,
    take_request_state,
)
from kvoffload.eviction.base import (
    EvictionPolicy,
    OffloadedBlock,
    register_eviction_policy,
    requeue_tail_first,
)
from kvoffload.keys import OffloadKey
from kvoffload.manager_contract import ReqContext

__all__ = ["LRUPolicy"]

#: ``ref_cnt`` of a request's place in the order: never evictable, so the plain scan skips it.
_PLACE = -2


class _RequestPlace(RequestState):
    """One request's place in the recency order (vLLM's *request rank*), taken at its first
    access or positioned store. Keys it stores or accesses at known token positions wait here,
    ordered tail first (``(-position, key)``), until they are used again or it finishes."""

    __slots__ = ("finished", "members", "rank", "seen")
    ref_cnt = _PLACE

    def __init__(self, generation: int = 0) -> None:
        super().__init__(generation)
        self.rank = 0  # 0: not placed yet
        self.members: dict[OffloadKey, int] = {}  # key -> its end-token position
        self.seen: set[OffloadKey] = set()  # keys of the request's access so far
        self.finished = False

    def order(self) -> list[OffloadKey]:
        """The members, first to leave first."""
        members = self.members
        return sorted(members, key=lambda key: (-members[key], key))


@register_eviction_policy
class LRUPolicy(EvictionPolicy):
    """Evict the evictable block used least recently, as vLLM 0.33's LRU does.

    A *use* gives a block the newest place: storing it (without a token position), ``touch``
    (tail to head, so the head of a prefix ends newest), and the request's finish, which walks
    every key the request loaded or offered to store (stored or found ready) tail to head
    (:meth:`RequestUses.head_to_tail`). So after a request its chain leaves tail first, and a
    ready block that a request offered again counts as used by it.

    Requests whose context carries key positions (vLLM's scheduler sets them) are placed as vLLM
    places them: a request takes one place in the order at its first access; the keys it stores,
    and held keys it accesses that were older than that place, wait there ordered tail first
    until their next use or the request's finish. Without positions (our scheduler) no place is
    ever taken and the order is one ``OrderedDict``, oldest first.

    Eviction scans from the oldest end, skipping pinned, pending and protected blocks (they sit
    near the new end: just stored or touched, so the scan rarely passes many); a request's place
    is scanned in its own order. Costs: O(1) per touched, stored or finished key without
    positions; with them, keys renewed while a place is open also get a stamp, and a scan that
    reaches a place sorts its members.
    """

    name = "lru"
    reads_access = True

    def __init__(self, capacity: int) -> None:
        super().__init__(capacity)
        # Held keys and open request places, in recency order (oldest first). A key placed at a
        # request's place also stays here (get() is one C call), at a position that is ignored.
        self._blocks: OrderedDict[object, OffloadedBlock | _RequestPlace] = OrderedDict()
        # Bound C method: get() runs once per block per lookup. (dict.get's overloads are not
        # get()'s signature, and get() is never asked for a place.)
        self.get = self._blocks.get  # type: ignore[method-assign,assignment]
        self._placed: dict[OffloadKey, _RequestPlace] = {}
        # While a place is open: the clock when each key renewed since then was renewed (an
        # unstamped key is older than every open place). Places take their rank from the clock.
        self._stamps: dict[OffloadKey, int] = {}
        self._clock = 0
        self._open = 0
        self._groups = GroupWatch()
        #: keys held by operator pins: a scan that passes them moves them to the new end, so
        #: that each is passed once per turn of the order, not by every eviction
        self._pinned: set[OffloadKey] = set()

    def get(self, key: OffloadKey) -> OffloadedBlock | None:  # replaced per instance in __init__
        return self._blocks.get(key)  # type: ignore[return-value]  # a key: never a place

    def insert(self, key: OffloadKey, block: OffloadedBlock, ctx: ReqContext | None = None) -> None:
        self._groups.saw((key,))
        self._blocks[key] = block
        if ctx is not None and (position := ctx.offload_key_positions.get(key)) is not None:
            self._place(key, self._place_of(ctx), position)
        elif self._open:
            self._stamp(key)

    def insert_n(
        self,
        keys: Sequence[OffloadKey],
        blocks: Sequence[OffloadedBlock],
        ctx: ReqContext | None = None,
    ) -> None:
        if self._open or (ctx is not None and ctx.offload_key_positions):
            super().insert_n(keys, blocks, ctx)
        else:
            self._groups.saw(keys)
            self._blocks.update(zip(keys, blocks, strict=True))

    def remove(self, key: OffloadKey) -> None:
        del self._blocks[key]
        if self._open:
            self._forget_place(key)

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        if self._open:
            self._renew_tail_first(keys)
        else:
            requeue_tail_first(self._blocks, keys)

    def request_accessed(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        positions = ctx.offload_key_positions
        if not positions:
            return
        place = self._place_of(ctx)
        seen, held = place.seen, self._blocks
        for key in keys:
            if key in seen:
                continue
            seen.add(key)
            position = positions.get(key)
            if position is not None and key in held and self._older(key, place, position):
                self._place(key, place, position)

    def request_finished(self, uses: RequestUses, ctx: ReqContext) -> None:
        keys = uses.head_to_tail(ctx, not self._groups.mixed)
        if not self._open:
            requeue_tail_first(self._blocks, keys)
            return
        self._renew_tail_first(keys)
        place = take_request_state(ctx, self, _RequestPlace, self.generation)
        if place is not None and place.rank:  # it closes once no key waits there
            place.finished = True
            if not place.members:
                self._close(place)

    def evict(
        self, n: int, protected: Container[OffloadKey]
    ) -> list[tuple[OffloadKey, OffloadedBlock]] | None:
        if n <= 0:
            return []
        victims = self._scan_places(n, protected) if self._placed else self._scan(n, protected)
        if victims is None:
            return None
        blocks = self._blocks
        for key, _ in victims:
            del blocks[key]
        if self._open:
            for key, _ in victims:
                self._forget_place(key)
        return victims

    def pinned(self, keys: Sequence[OffloadKey]) -> None:
        self._pinned.update(keys)

    def unpinned(self, keys: Sequence[OffloadKey]) -> None:
        self._pinned.difference_update(keys)

    def clear(self) -> None:
        self._pinned.clear()
        for d in (self._blocks, self._placed, self._stamps):
            d.clear()
        self._clock = self._open = 0
        self._groups.clear()
        self.generation += 1

    def __len__(self) -> int:
        return len(self._blocks) - self._open

    def __iter__(self) -> Iterator[OffloadKey]:
        if not self._open:
            return iter(self._blocks)  # type: ignore[arg-type]  # no place open: keys only
        # (isinstance does not narrow object to OffloadKey, a NewType.)
        return (key for key in self._blocks if not isinstance(key, _RequestPlace))  # type: ignore[misc]

    def check_invariants(self) -> None:
        blocks = self._blocks
        places = [key for key in blocks if isinstance(key, _RequestPlace)]
        assert len(places) == self._open, "open places and the order disagree"
        assert self._open or not self._stamps, "stamps kept with no place open"
        for key, place in self._placed.items():
            assert key in blocks and place in blocks, f"{key.hex()}: placed but not held"
            assert key in place.members and key not in self._stamps, f"{key.hex()}: two places"
        for place in places:
            assert place.members or not place.finished, "a finished, empty place is still open"
            for key in place.members:
                assert self._placed[key] is place, f"{key.hex()}: a stale member"
        ranks = [place.rank for place in places]
        assert ranks == sorted(ranks), "request places out of order"
        assert all(stamp <= self._clock for stamp in self._stamps.values()), "a stamp ahead"

    # -- the order -----------------------------------------------------------------------------

    def _scan(
        self, n: int, protected: Container[OffloadKey]
    ) -> list[tuple[OffloadKey, OffloadedBlock]] | None:
        """The ``n`` oldest evictable blocks when no key waits at a request's place (an open,
        empty place has ``ref_cnt`` ``_PLACE`` and is skipped). Operator-pinned blocks the scan
        passed go to the new end afterwards (when no place is open: the order is then recency
        alone), so a long pin costs each eviction O(1) amortized, not O(pinned)."""
        victims: list[tuple[OffloadKey, OffloadedBlock]] = []
        pinned, passed = self._pinned, []
        found = False
        for key, block in self._blocks.items():
            if block.ref_cnt == 0 and key not in protected:
                victims.append((key, block))  # type: ignore[arg-type]  # ref_cnt 0: a block
                if len(victims) == n:
                    found = True
                    break
            elif pinned and key in pinned:
                passed.append(key)
        if passed and not self._open:
            move = self._blocks.move_to_end
            for key in passed:
                move(key)
        return victims if found else None

    def _scan_places(
        self, n: int, protected: Container[OffloadKey]
    ) -> list[tuple[OffloadKey, OffloadedBlock]] | None:
        """The ``n`` oldest evictable blocks, the keys at a request's place taken there."""
        victims: list[tuple[OffloadKey, OffloadedBlock]] = []
        blocks, placed = self._blocks, self._placed
        for key, block in blocks.items():
            if isinstance(block, _RequestPlace):
                candidates = [(member, blocks[member]) for member in block.order()]
            elif key in placed:
                continue  # its place is its request's
            else:
                candidates = [(key, block)]  # type: ignore[list-item]  # no place: an OffloadKey
            for member, record in candidates:
                if record.ref_cnt == 0 and member not in protected:  # a place's ref_cnt: _PLACE
                    victims.append((member, record))  # type: ignore[arg-type]  # so a block
                    if len(victims) == n:
                        return victims
        return None

    def _renew_tail_first(self, keys: Sequence[OffloadKey]) -> None:
        """Give each held key of ``keys``, tail first, the newest place (a place is open)."""
        blocks = self._blocks
        for key in reversed(keys):
            if key in blocks:
                self._forget_place(key)
                blocks.move_to_end(key)
                self._stamp(key)

    def _stamp(self, key: OffloadKey) -> None:
        self._clock += 1
        self._stamps[key] = self._clock

    def _place_of(self, ctx: ReqContext) -> _RequestPlace:
        """The request's place, taken now (at the new end) if it has none yet."""
        place = request_state(ctx, self, _RequestPlace, self.generation)
        if not place.rank:
            self._clock += 1
            place.rank = self._clock
            self._blocks[place] = place
            self._open += 1
        return place

    def _older(self, key: OffloadKey, place: _RequestPlace, position: int) -> bool:
        """Whether held ``key`` is older than it would be at ``place`` with ``position``."""
        current = self._placed.get(key)
        if current is not None:
            return (current.rank, -current.members[key]) < (place.rank, -position)
        stamp = self._stamps.get(key)
        return stamp is None or stamp < place.rank

    def _place(self, key: OffloadKey, place: _RequestPlace, position: int) -> None:
        self._forget_place(key)
        place.members[key] = position
        self._placed[key] = place

    def _forget_place(self, key: OffloadKey) -> None:
        """``key`` leaves its request's place and loses its stamp (it is renewed or gone)."""
        self._stamps.pop(key, None)
        place = self._placed.pop(key, None)
        if place is not None:
            del place.members[key]
            if place.finished and not place.members:
                self._close(place)

    def _close(self, place: _RequestPlace) -> None:
        del self._blocks[place]
        self._open -= 1
        if not self._open:
            self._stamps.clear()

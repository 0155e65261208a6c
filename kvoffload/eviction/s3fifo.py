"""S3-FIFO eviction: a small probation FIFO, a main FIFO with reinsertion, and a ghost FIFO."""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Container, Sequence
from typing import ClassVar

from kvoffload.eviction._request_state import (
    RequestChains,
    RequestUses,
    request_state,
    take_request_state,
)
from kvoffload.eviction.base import (
    HeldBlocksPolicy,
    OffloadedBlock,
    register_eviction_policy,
    restore_unpinned,
    take_pinned,
)
from kvoffload.keys import OffloadKey
from kvoffload.manager_contract import ReqContext

__all__ = ["S3FIFOPolicy"]


def taken_from_small(
    victims: list[tuple[OffloadKey, OffloadedBlock]], from_main: list[OffloadKey]
) -> list[tuple[OffloadKey, OffloadedBlock]]:
    """The victims of an :meth:`S3FIFOPolicy.evict` dry run not in ``from_main``, in order."""
    if not from_main:  # the common case: no list to build
        return victims
    in_main = set(from_main)
    return [victim for victim in victims if victim[0] not in in_main]


@register_eviction_policy
class S3FIFOPolicy(HeldBlocksPolicy):
    """S3-FIFO (Yang et al., SOSP 2023) over request-level uses.

    Three FIFOs, oldest first: ``small`` (new blocks; its target size is ``small_ratio`` of the
    capacity, at least 1), ``main`` (blocks used again), ``ghost`` (keys that left ``small``
    unused, at most ``capacity`` of them). Each held block has a frequency 0..3 (on its record:
    ``OffloadedBlock.freq``; the FIFOs map keys to records, so a use or a scan step is one lookup).

    * ``insert``: a key remembered by ``ghost`` leaves it and enters ``main``; any other key
      enters ``small``. Frequency 0.
    * ``touch``: each block once per request (its store is the storing request's use, so a
      block's own store-and-touch is one use): frequency ``+1``, capped at 3. No reordering: FIFOs
      move only on eviction.
    * ``request_finished``: the keys the request stored, walked tail to head, that are still in
      ``small``, or in ``main`` unused since they entered it (frequency 0: stored from the ghost),
      move to the new end of their FIFO, so that a chain leaves tail first (its head, which every
      hit on the chain needs, last).
    * Eviction rule, per victim: if ``small`` holds at least its target, pop ``small``'s oldest
      block: used again (frequency >= 1) -> move it to the new end of ``main`` with frequency 0
      and continue; else, if evictable, it is the victim and its key enters ``ghost`` (a one-hit
      wonder); a pinned/pending/protected unused block is passed over and stays. Otherwise pop
      ``main``'s oldest: frequency >= 1 -> reinsert at the new end with frequency ``-1`` and
      continue; else, if evictable, it is the victim (no ghost); else passed over. When the
      preferred FIFO has no victim left, the other one is used.

    Atomic: the moves are simulated (a dry run over the FIFOs' iterators that records the
    victims, promotions and reinsertions) and committed only when ``n`` victims were found;
    otherwise nothing changes. ``insert_n`` inserts a stored run in one loop when no key of it is
    remembered by ``ghost``. Each block is reinserted at most 3 times per
    call, so ``evict`` is O(n + blocks moved or passed over); ``touch``/``insert`` are O(1) per key.
    Operator pins (:meth:`pinned` / :meth:`unpinned`, O(1) per key) take a block out of both
    FIFOs (its uses still count in ``freq``) and put it back at the new end of its FIFO.
    """

    name = "s3fifo"
    #: The highest frequency a block reaches (two bits).
    max_freq: ClassVar[int] = 3

    def __init__(self, capacity: int, small_ratio: float = 0.1) -> None:
        super().__init__(capacity)
        self._small: OrderedDict[OffloadKey, OffloadedBlock] = OrderedDict()
        self._main: OrderedDict[OffloadKey, OffloadedBlock] = OrderedDict()
        self._ghost: OrderedDict[OffloadKey, None] = OrderedDict()
        self.small_target: float = max(1, int(capacity * small_ratio))  # a float in adaptive
        #: blocks held by operator pins, out of both FIFOs (so no scan passes them): key ->
        #: whether it came from ``main``; back at the new end of its FIFO when unpinned
        self._pinned: dict[OffloadKey, bool] = {}

    def pinned(self, keys: Sequence[OffloadKey]) -> None:
        take_pinned(keys, self._small, self._main, self._pinned)

    def unpinned(self, keys: Sequence[OffloadKey]) -> None:
        restore_unpinned(keys, self._blocks, self._small, self._main, self._pinned)

    def insert(self, key: OffloadKey, block: OffloadedBlock, ctx: ReqContext | None = None) -> None:
        block.freq = 0
        block.user = 0 if ctx is None else ctx.serial  # its store is the request's use
        self._enter(key, block)
        if ctx is not None:
            self._chains(ctx).stored.append((key,))

    def insert_n(
        self,
        keys: Sequence[OffloadKey],
        blocks: Sequence[OffloadedBlock],
        ctx: ReqContext | None = None,
    ) -> None:
        user = 0 if ctx is None else ctx.serial
        if self._remembers(keys):  # one by one: some enter main
            enter = self._enter
            for key, block in zip(keys, blocks, strict=True):
                block.freq, block.user = 0, user
                enter(key, block)
        else:  # none is remembered: all enter small, in order, in one loop without a call per key
            held, small = self._blocks, self._small
            for key, block in zip(keys, blocks, strict=True):
                block.freq, block.user = 0, user
                held[key] = small[key] = block
        if ctx is not None:
            self._chains(ctx).stored.append(keys)

    def _remembers(self, keys: Sequence[OffloadKey]) -> bool:
        """Whether a key of ``keys`` is remembered (a store of it may enter ``main``)."""
        return not self._ghost.keys().isdisjoint(keys)

    def _enter(self, key: OffloadKey, block: OffloadedBlock) -> None:
        """Place a new block: in ``main`` if ``ghost`` remembers its key, else in ``small``."""
        self._blocks[key] = block
        if key in self._ghost:
            del self._ghost[key]
            self._main[key] = block
        else:
            self._small[key] = block

    def _chains(self, ctx: ReqContext) -> RequestChains:
        return request_state(ctx, self, RequestChains, self.generation)

    def remove(self, key: OffloadKey) -> None:
        del self._blocks[key]
        if self._small.pop(key, None) is None:
            del self._main[key]

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        # A use counts once per request: a block stamped with the request's serial (used or
        # stored by it already) is skipped.
        get, max_freq, user = self._blocks.get, self.max_freq, ctx.serial
        for key in keys:
            block = get(key)
            if block is not None and block.user != user:
                block.user = user
                if block.freq < max_freq:
                    block.freq += 1

    def request_finished(self, uses: RequestUses, ctx: ReqContext) -> None:
        chains = take_request_state(ctx, self, RequestChains, self.generation)
        if chains is not None:
            self._commit_request(chains)

    def _commit_request(self, chains: RequestChains) -> None:
        """The keys the request stored, tail to head, that are still in ``small`` (or in ``main``
        unused since they entered it) move to the new end of their FIFO."""
        small, main = self._small, self._main
        small_move, main_move, main_get = small.move_to_end, main.move_to_end, main.get
        for keys in reversed(chains.stored):
            for key in reversed(keys):
                if key in small:
                    small_move(key)
                else:
                    block = main_get(key)
                    if block is not None and not block.freq:
                        main_move(key)

    def evict(
        self, n: int, protected: Container[OffloadKey]
    ) -> list[tuple[OffloadKey, OffloadedBlock]] | None:
        if n <= 0:
            return []
        small_scan = iter(self._small.items())
        main_scan = iter(self._main.items())
        target = math.ceil(self.small_target)  # an int: small_left is one (same comparisons)
        small_left = len(self._small)
        small_done = main_done = False
        # The dry run's record, replayed by _commit on success. One loop, no call per victim:
        # this is the hot path of a full tier (a helper call per victim made evict ~25% slower on
        # the Zipf stream of benchmarks/manager_hot_path.py).
        victims: list[tuple[OffloadKey, OffloadedBlock]] = []  # in order; the rest from small
        from_main: list[OffloadKey] = []  # victims taken from main, in order
        promoted: list[OffloadKey] = []  # keys moved from small to main
        # (key, block, its new frequency) put at main's end, in order. The dry run leaves the
        # records' frequencies alone: the commit sets them.
        moved: list[tuple[OffloadKey, OffloadedBlock, int]] = []
        appended: deque[tuple[OffloadKey, OffloadedBlock, int]] = deque()  # not yet rescanned
        while True:
            if not small_done and (small_left >= target or main_done):
                # Stop at n victims or, main not done, when small_left falls below the target:
                # at the victim count ``stop`` (small_left counts this pass's victims at the end).
                floor = -1 if main_done else target
                taken = len(victims)
                stop = min(n, taken + small_left - floor + 1)
                for key, block in small_scan:
                    if block.freq:
                        promoted.append(key)
                        moved_item = (key, block, 0)
                        moved.append(moved_item)
                        appended.append(moved_item)
                        main_done = False  # main has a new tail to scan, even if it was done
                        small_left -= 1
                        stop = min(n, taken + small_left - floor + 1)
                        continue
                    if not block.ref_cnt and key not in protected:
                        victims.append((key, block))
                        if len(victims) >= stop:
                            break
                else:
                    small_done = True
                small_left -= len(victims) - taken
                if small_done:
                    continue
                if len(victims) == n:
                    self._commit(victims, from_main, promoted, moved)
                    return victims
            elif not main_done:
                while True:
                    item = next(main_scan, None)
                    if item is not None:
                        key, block = item
                        freq = block.freq
                    elif appended:
                        key, block, freq = appended.popleft()
                    else:
                        main_done = True
                        break
                    if freq >= 1:
                        moved_item = (key, block, freq - 1)
                        moved.append(moved_item)
                        appended.append(moved_item)
                        continue
                    if not block.ref_cnt and key not in protected:
                        from_main.append(key)
                        victims.append((key, block))
                        if len(victims) == n:
                            self._commit(victims, from_main, promoted, moved)
                            return victims
                        break
            else:
                return None

    def _commit(
        self,
        victims: list[tuple[OffloadKey, OffloadedBlock]],
        from_main: list[OffloadKey],
        promoted: list[OffloadKey],
        moved: list[tuple[OffloadKey, OffloadedBlock, int]],
    ) -> None:
        """Apply a successful dry run of :meth:`evict` (its lists, each in scan order)."""
        self._apply_moves(promoted, moved)
        blocks, small, main, ghost = self._blocks, self._small, self._main, self._ghost
        for key, _ in taken_from_small(victims, from_main):
            del small[key], blocks[key]
            ghost[key] = None
        for key in from_main:
            del main[key], blocks[key]
        for _ in range(len(ghost) - self.capacity):
            ghost.popitem(last=False)

    def _apply_moves(
        self, promoted: list[OffloadKey], moved: list[tuple[OffloadKey, OffloadedBlock, int]]
    ) -> None:
        """The first part of a commit: ``promoted`` leave ``small``, and ``moved`` (keys
        promoted into ``main`` or reinserted there, in scan order) take their places in
        ``main``; before any victim of ``main`` is removed (a key may be moved, then evicted)."""
        small, main = self._small, self._main
        for key in promoted:
            del small[key]
        move = main.move_to_end
        for key, block, freq in moved:  # the last move of a key sets its place and frequency
            block.freq = freq
            if key in main:
                move(key)
            else:
                main[key] = block

    def clear(self) -> None:
        self._pinned.clear()
        for d in (self._blocks, self._small, self._main, self._ghost):
            d.clear()
        self.generation += 1

    def check_invariants(self) -> None:
        small, main, ghost = self._small, self._main, self._ghost
        assert not small.keys() & main.keys(), "a block is in both small and main"
        pinned = self._pinned.keys()
        assert not pinned & (small.keys() | main.keys()), "a pinned block is still in a FIFO"
        assert self._blocks.keys() == small.keys() | main.keys() | pinned, "get() and the FIFOs"
        assert not ghost.keys() & self._blocks.keys(), "a held block is also a ghost"
        assert len(ghost) <= self.capacity, "ghost FIFO over capacity"
        for fifo in (small, main):
            for key, block in fifo.items():
                assert block is self._blocks[key], f"{key.hex()}: two records"
                assert 0 <= block.freq <= self.max_freq, f"{key.hex()}: frequency {block.freq}"

"""Adaptive eviction: S3-FIFO with a learned probation size and a learned history reach."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvoffload.eviction._request_state import RequestChains
from kvoffload.eviction.base import OffloadedBlock, register_eviction_policy, requeue_tail_first
from kvoffload.eviction.s3fifo import S3FIFOPolicy, taken_from_small
from kvoffload.keys import OffloadKey
from kvoffload.manager_contract import ReqContext

__all__ = ["AdaptivePolicy"]


@register_eviction_policy
class AdaptivePolicy(S3FIFOPolicy):
    """S3-FIFO with a learned probation size and history reach, chains tail first.

    The structure and the eviction rule are S3-FIFO's (:class:`S3FIFOPolicy`): new blocks enter
    the probation FIFO ``small``; blocks used again there move to ``main``, a FIFO with
    reinsertion by a 0..3 frequency; unused ones leave into the ``ghost`` history, which remembers
    when each left (counted in evictions from ``small``). The changes:

    * **Probation size** (ARC's marginal rule on S3-FIFO's queues). A key stored again that left
      ``small`` fewer than ``small_target`` evictions ago would have been a hit in a ``small``
      twice as large: ``small_target += step``. A key stored again that left ``main`` (remembered
      in ``main_ghost``, ``capacity`` keys) fewer than ``small_target`` evictions ago would have
      been a hit had ``main`` had those slots instead: ``small_target -= step``. Both compare the
      same extra space, so the split moves to where it earns more hits. Bounded to
      ``[1, capacity / 2]``, starting at 5% of the capacity; ``step = max(1, capacity / 512)``.
    * **A history as long as ``main`` keeps a block** (TinyLFU's doorkeeper, with a learned
      reach). A key stored again that left ``small`` fewer than ``reach`` evictions ago enters
      ``main``; an older one is new again (probation). ``reach`` is how long ``main`` keeps a
      block it admits, by Little's law: ``len(main)`` over ``main``'s eviction rate, counted in
      evictions from ``small`` (both rates over about one turnover of ``main``: the counts halve
      whenever ``main``'s passes ``capacity``). Admitting a key that came back later than that
      buys nothing: its next use comes after ``main`` has dropped it again. The reach is capped at
      ``history_size = history_factor x capacity`` (S3-FIFO: ``capacity``), which bounds memory;
      it starts there and stays there while ``main`` rarely evicts. Reuse of KV blocks is often
      far apart (a conversation's next turn comes thousands of new blocks later), so a tier that
      only remembers its own size forgets such a block before it returns; where ``main`` turns
      over fast (agent loops at a small tier) the reach shrinks to what ``main`` can use.
    * **Recency in ``main``, chains tail first.** On ``request_finished`` the keys the request
      stored, tail to head, move to the new end of ``small`` (or of ``main`` if unused since
      entering it); then the blocks of ``main`` it touched, tail to head, move to the new end of
      ``main``. ``main`` is thus ordered by last use, and a block's frequency (capped at 2, not
      S3-FIFO's 3) buys it at most two extra passes: a context that stopped being used (a
      finished agent session) leaves after its last use ages out, as in LRU.

    A use is counted once per request and block, whichever list a scheduler touches it in (as in
    S3-FIFO: the block is stamped with the request's serial). Costs: ``touch``/``insert``/
    ``request_finished`` O(1) per key; ``evict`` as S3-FIFO's. The history is two generations of plain dicts: the older is dropped
    whole when the newer spans ``history_size`` evictions from ``small``, so a key is remembered
    for at least that many and nothing is trimmed key by key. Memory: up to ``2 x history_factor
    + 1`` remembered keys per block of capacity (plus one call's victims).
    """

    name = "adaptive"
    #: Reinsertion passes a block of ``main`` earns at most (S3-FIFO: 3).
    max_freq = 2

    def __init__(
        self, capacity: int, *, history_factor: int = 3, initial_small: float = 0.05
    ) -> None:
        super().__init__(capacity, initial_small)
        # Keys that left small unused: key -> the count of evictions from small when it left.
        # Two generations (see the class docstring); only _commit adds and flips, insert removes.
        self.history_size = history_factor * capacity
        # (A dict of its own, not S3FIFO's OrderedDict: the methods that use that are overridden.)
        self._ghost: dict[OffloadKey, int] = {}  # type: ignore[assignment]
        self._old_ghost: dict[OffloadKey, int] = {}
        self._ghost_opened = 0  # the small-eviction count when _ghost was opened
        self.reach: float = self.history_size
        self._main_ghost: OrderedDict[OffloadKey, int] = OrderedDict()
        self._small_evictions = 0
        self._main_evictions = 0
        # Evictions from small and from main, halved whenever main's count passes the capacity:
        # rates over about one turnover of main.
        self._recent_small = 0.0
        self._recent_main = 0.0
        self._initial_small = max(1.0, capacity * initial_small)
        self.small_target = self._initial_small
        self._max_small = max(1.0, capacity / 2)
        self._step = max(1.0, capacity / 512)

    # -- the policy interface ------------------------------------------------------------------

    def _remembers(self, keys: Sequence[OffloadKey]) -> bool:
        return not (
            self._ghost.keys().isdisjoint(keys)
            and self._old_ghost.keys().isdisjoint(keys)
            and self._main_ghost.keys().isdisjoint(keys)
        )

    def _enter(self, key: OffloadKey, block: OffloadedBlock) -> None:
        self._blocks[key] = block
        left = self._ghost.pop(key, None)
        if left is None:
            left = self._old_ghost.pop(key, None)
        if left is not None:
            age = self._small_evictions - left
            if age < self.small_target:  # a larger small would have kept it, whatever the reach
                self.small_target = min(self.small_target + self._step, self._max_small)
            if age < self.reach:
                self._main[key] = block
                return
        left = self._main_ghost.pop(key, None)
        if left is not None:
            if self._main_evictions - left < self.small_target:
                self.small_target = max(self.small_target - self._step, 1.0)
            self._main[key] = block
            return
        self._small[key] = block

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        super().touch(keys, ctx)
        touched = self._chains(ctx).touched
        for seen in touched:  # the scheduler re-touches one list: keep it once
            if seen is keys:
                return
        touched.append(keys)

    def _commit_request(self, chains: RequestChains) -> None:
        super()._commit_request(chains)  # stored chains: tail first
        for keys in reversed(chains.touched):  # then the blocks of main it touched, head last
            requeue_tail_first(self._main, keys)

    def _commit(
        self,
        victims: list[tuple[OffloadKey, OffloadedBlock]],
        from_main: list[OffloadKey],
        promoted: list[OffloadKey],
        moved: list[tuple[OffloadKey, OffloadedBlock, int]],
    ) -> None:
        self._apply_moves(promoted, moved)
        blocks, small, main = self._blocks, self._small, self._main
        ghost, main_ghost = self._ghost, self._main_ghost
        # Each ghost entry remembers when its key left: the count of evictions from its queue.
        small_evictions = self._small_evictions
        from_small = taken_from_small(victims, from_main)
        for key, _ in from_small:
            del small[key], blocks[key]
            small_evictions += 1
            ghost[key] = small_evictions
        self._small_evictions = small_evictions
        main_evictions = self._main_evictions
        for key in from_main:
            del main[key], blocks[key]
            main_evictions += 1
            main_ghost[key] = main_evictions
        self._main_evictions = main_evictions
        if small_evictions - self._ghost_opened >= self.history_size:
            self._old_ghost, self._ghost = ghost, {}
            self._ghost_opened = small_evictions
        for _ in range(len(main_ghost) - self.capacity):
            main_ghost.popitem(last=False)
        # The reach: how long main keeps a block it admits, counted in evictions from small
        # (Little's law: main's size over its eviction rate, that rate relative to small's).
        recent_small = self._recent_small + len(from_small)
        recent_main = self._recent_main + len(from_main)
        if recent_main > self.capacity:
            recent_small /= 2
            recent_main /= 2
        self._recent_small, self._recent_main = recent_small, recent_main
        if recent_main:
            self.reach = min(len(main) * recent_small / recent_main, self.history_size)

    def clear(self) -> None:
        super().clear()
        for d in (self._old_ghost, self._main_ghost):
            d.clear()
        self.small_target = self._initial_small
        self.reach = self.history_size
        self._recent_small = self._recent_main = 0.0

    def check_invariants(self) -> None:
        small, main, ghost, old = self._small, self._main, self._ghost, self._old_ghost
        assert not small.keys() & main.keys(), "a block is in both small and main"
        pinned = self._pinned.keys()
        assert not pinned & (small.keys() | main.keys()), "a pinned block is still in a FIFO"
        assert self._blocks.keys() == small.keys() | main.keys() | pinned, "get() and the FIFOs"
        held = self._blocks.keys()
        for history in (ghost, old, self._main_ghost):
            assert not history.keys() & held, "held and a ghost"
        assert not ghost.keys() & old.keys(), "a key in both generations of the history"
        opened = self._ghost_opened
        assert all(opened < left <= self._small_evictions for left in ghost.values()), "generation"
        assert all(left <= opened for left in old.values()), "old generation"
        assert self._small_evictions - opened < self.history_size, "generation not closed"
        assert 0 <= self.reach <= self.history_size, f"reach {self.reach}"
        assert len(self._main_ghost) <= self.capacity, "main ghost over capacity"
        assert 1.0 <= self.small_target <= self._max_small, f"small target {self.small_target}"
        for fifo in (small, main):
            for key, block in fifo.items():
                assert block is self._blocks[key], f"{key.hex()}: two records"
                assert 0 <= block.freq <= self.max_freq, f"{key.hex()}: frequency {block.freq}"

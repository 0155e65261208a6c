"""Adaptive eviction: S3-FIFO with a learned probation size and a history longer than the tier."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvoffload.base import ReqContext
from kvoffload.eviction._request_state import lists_touched_by
from kvoffload.eviction.base import OffloadedBlock, register_eviction_policy
from kvoffload.eviction.s3fifo import _EVICT_SMALL, _REINSERT, _TO_MAIN, S3FIFOPolicy
from kvoffload.keys import OffloadKey

__all__ = ["AdaptivePolicy"]

#: Reinsertion passes a block of ``main`` earns at most (S3-FIFO: 3).
_MAX_FREQ = 2


@register_eviction_policy
class AdaptivePolicy(S3FIFOPolicy):
    """S3-FIFO whose probation size adapts to the workload, with a long history, chains tail first.

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
    * **A history longer than the tier** (TinyLFU's doorkeeper). ``ghost`` remembers the last
      ``history_factor`` x ``capacity`` keys that left ``small`` unused (S3-FIFO: ``capacity``); a
      key stored again while remembered enters ``main``. Reuse of KV blocks is often far apart (a
      conversation's next turn comes thousands of new blocks later): a tier that only remembers
      its own size forgets such a block before it returns and keeps treating it as new.
    * **Recency in ``main``, chains tail first.** On ``request_finished`` the keys the request
      stored, tail to head, move to the new end of ``small`` (or of ``main`` if unused since
      entering it); then the blocks of ``main`` it used, tail to head, move to the new end of
      ``main``. ``main`` is thus ordered by last use, and a block's frequency (capped at 2, not
      S3-FIFO's 3) buys it at most two extra passes: a context that stopped being used (a
      finished agent session) leaves after its last use ages out, as in LRU.

    A use is counted once per request per touched key list (a scheduler re-touching the same list
    each step counts once). Costs: ``touch``/``insert``/``request_finished`` O(1) per key;
    ``evict`` as S3-FIFO's. Memory: up to ``history_factor + 1`` remembered keys per block of
    capacity.
    """

    name = "adaptive"

    def __init__(
        self, capacity: int, *, history_factor: int = 3, initial_small: float = 0.05
    ) -> None:
        super().__init__(capacity, initial_small)
        self.history_size = history_factor * capacity
        self._ghost: OrderedDict[OffloadKey, int] = OrderedDict()  # type: ignore[assignment]
        self._main_ghost: OrderedDict[OffloadKey, int] = OrderedDict()
        self._small_evictions = 0
        self._main_evictions = 0
        self._initial_small = max(1.0, capacity * initial_small)
        self.small_target: float = self._initial_small  # type: ignore[assignment]
        self._max_small = max(1.0, capacity / 2)
        self._step = max(1.0, capacity / 512)

    # -- the policy interface ------------------------------------------------------------------

    def insert(self, key: OffloadKey, block: OffloadedBlock) -> None:
        self._blocks[key] = block
        left = self._ghost.pop(key, None)
        if left is not None:
            if self._small_evictions - left < self.small_target:
                self.small_target = min(self.small_target + self._step, self._max_small)
            self._main[key] = 0
            return
        left = self._main_ghost.pop(key, None)
        if left is not None:
            if self._main_evictions - left < self.small_target:
                self.small_target = max(self.small_target - self._step, 1.0)
            self._main[key] = 0
            return
        self._small[key] = 0

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        counted = lists_touched_by(ctx, self)
        for seen in counted:
            if seen is keys:
                return
        counted.append(keys)
        small, main = self._small, self._main
        for key in keys:
            freq = small.get(key)
            if freq is not None:
                if freq < _MAX_FREQ:
                    small[key] = freq + 1
            else:
                freq = main.get(key)
                if freq is not None and freq < _MAX_FREQ:
                    main[key] = freq + 1

    def request_finished(
        self,
        touched: Sequence[Sequence[OffloadKey]],
        stored: Sequence[Sequence[OffloadKey]],
        ctx: ReqContext,
    ) -> None:
        super().request_finished(touched, stored, ctx)  # stored chains: tail first
        main = self._main
        for keys in reversed(touched):  # then the chains it used: main's recency, head last
            for key in reversed(keys):
                if key in main:
                    main.move_to_end(key)

    def _replay(self, ops: list[tuple[int, OffloadKey]]) -> None:
        blocks, small, main = self._blocks, self._small, self._main
        ghost, main_ghost = self._ghost, self._main_ghost
        small_evictions, main_evictions = self._small_evictions, self._main_evictions
        for op, key in ops:
            if op == _TO_MAIN:
                del small[key]
                main[key] = 0
            elif op == _REINSERT:
                main[key] -= 1
                main.move_to_end(key)
            elif op == _EVICT_SMALL:
                del small[key], blocks[key]
                small_evictions += 1
                ghost[key] = small_evictions
            else:
                del main[key], blocks[key]
                main_evictions += 1
                main_ghost[key] = main_evictions
        self._small_evictions, self._main_evictions = small_evictions, main_evictions
        for _ in range(len(ghost) - self.history_size):
            ghost.popitem(last=False)
        for _ in range(len(main_ghost) - self.capacity):
            main_ghost.popitem(last=False)

    def clear(self) -> None:
        super().clear()
        self._main_ghost.clear()
        self.small_target = self._initial_small

    def check_invariants(self) -> None:
        small, main, ghost = self._small, self._main, self._ghost
        assert not small.keys() & main.keys(), "a block is in both small and main"
        assert self._blocks.keys() == small.keys() | main.keys(), "get() and the FIFOs disagree"
        held = self._blocks.keys()
        assert not ghost.keys() & held and not self._main_ghost.keys() & held, "held and a ghost"
        assert len(ghost) <= self.history_size, "history over its bound"
        assert len(self._main_ghost) <= self.capacity, "main ghost over capacity"
        assert 1.0 <= self.small_target <= self._max_small, f"small target {self.small_target}"
        for fifo in (small, main):
            for key, freq in fifo.items():
                assert 0 <= freq <= _MAX_FREQ, f"{key.hex()}: frequency {freq}"

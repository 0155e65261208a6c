"""Reuse counts (how many distinct requests have seen a block) and the manager wrapper that
stores a block only once enough of them have wanted it."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvoffload.errors import ConfigError
from kvoffload.keys import OffloadKey
from kvoffload.manager_contract import (
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    ReqContext,
)

__all__ = ["FilterReusedOffloadingManager", "ReuseCounts"]


class ReuseCounts:
    """How many distinct requests have seen each key: the reuse signal.

    A request counts once per key however often it is recorded (its keys seen so far live on its
    ``ReqContext``, keyed by this instance, so several counters sharing a context count
    independently; :meth:`forget` drops them when the request ends). Counts live in an LRU table
    of at most ``max_tracked`` keys; a key dropped from it starts again from zero. Costs: a few
    dict operations per key recorded.
    """

    def __init__(self, max_tracked: int) -> None:
        self._max_tracked = max_tracked
        self._counts: OrderedDict[OffloadKey, int] = OrderedDict()

    def record(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        """``ctx`` saw ``keys``: each counts once per request."""
        seen: set[OffloadKey] = ctx.setdefault_state(self, set)
        counts = self._counts
        for key in keys:
            if key in seen:
                continue
            seen.add(key)
            count = counts.get(key)
            if count is None:
                if len(counts) >= self._max_tracked:
                    counts.popitem(last=False)
                counts[key] = 1
            else:
                counts[key] = count + 1
                counts.move_to_end(key)

    def count(self, key: OffloadKey) -> int:
        """Distinct requests that have seen ``key`` (0 if untracked)."""
        return self._counts.get(key, 0)

    def forget(self, ctx: ReqContext) -> None:
        """``ctx`` ended: drop its per-request record (its counts stay)."""
        ctx.pop_state(self)

    def __len__(self) -> int:
        return len(self._counts)


class FilterReusedOffloadingManager(OffloadingManager):
    """Wraps any manager; lets a block be stored only once ``store_threshold`` distinct requests
    have seen it.

    A request *sees* a key when it looks it up or offers it for storing; it counts once per request
    however many times it does so (vLLM counts lookups, so one request retried five times counted
    five). Counts live in an LRU table of at most ``max_tracker_size`` keys; a key dropped from the
    table starts again from zero. Filtered keys never reach the backing manager, so they cost no
    capacity, and keys the backing manager already holds are always passed through so that they
    stay protected while the request extends them. Everything else delegates.

    Extra counters in :meth:`stats`: ``filtered_blocks`` (offers declined), ``tracked_keys``.
    """

    def __init__(
        self, backing: OffloadingManager, store_threshold: int = 2, max_tracker_size: int = 64_000
    ) -> None:
        if not isinstance(store_threshold, int) or store_threshold < 1:
            raise ConfigError(
                "store_threshold", f"must be an integer >= 1, got {store_threshold!r}"
            )
        if not isinstance(max_tracker_size, int) or max_tracker_size < 1:
            raise ConfigError(
                "max_tracker_size", f"must be an integer >= 1, got {max_tracker_size!r}"
            )
        self._backing = backing
        self.medium = backing.medium
        self._threshold = store_threshold
        self._counts = ReuseCounts(max_tracker_size)
        self._filtered = 0

    @property
    def backing(self) -> OffloadingManager:
        """The wrapped manager."""
        return self._backing

    def request_count(self, key: OffloadKey) -> int:
        """How many distinct requests have seen ``key`` (0 if untracked)."""
        return self._counts.count(key)

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        self._counts.record((key,), ctx)
        return self._backing.lookup(key, ctx)

    def holds(self, key: OffloadKey, ctx: ReqContext) -> bool:
        return self._backing.holds(key, ctx)  # a probe is not a sighting: nothing recorded

    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> LoadStoreSpec:
        return self._backing.prepare_load(keys, ctx)

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self._backing.touch(keys, ctx)

    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self._backing.complete_load(keys, ctx)

    def prepare_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext
    ) -> PrepareStoreOutput | None:
        self._counts.record(keys, ctx)
        # Held keys pass so that the backing manager protects them; asked with the side-effect
        # free probe (a lookup may start a promotion into the host, or count as a lookup).
        count, threshold, holds = self._counts.count, self._threshold, self._backing.holds
        passed = [k for k in keys if count(k) >= threshold or holds(k, ctx)]
        self._filtered += len(keys) - len(passed)
        return self._backing.prepare_store(passed, ctx)

    def complete_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True
    ) -> None:
        self._backing.complete_store(keys, ctx, success)

    def take_events(self) -> list[OffloadingEvent]:
        return self._backing.take_events()

    def request_finished(self, ctx: ReqContext) -> None:
        self._counts.forget(ctx)
        self._backing.request_finished(ctx)

    def step_begin(self) -> None:
        self._backing.step_begin()

    def step_end(self) -> None:
        self._backing.step_end()

    def num_background_jobs(self) -> int:
        return self._backing.num_background_jobs()

    def await_promotions(self, ctx: ReqContext) -> bool:
        return self._backing.await_promotions(ctx)

    def reset(self) -> None:
        self._backing.reset()

    def load_source(self, key: OffloadKey, ctx: ReqContext) -> str:
        return self._backing.load_source(key, ctx)

    def tier_stats(self) -> dict[str, dict[str, int]]:
        return self._backing.tier_stats()

    def stats(self) -> dict[str, int]:
        stats = self._backing.stats()
        stats["filtered_blocks"] = self._filtered
        stats["tracked_keys"] = len(self._counts)
        return stats

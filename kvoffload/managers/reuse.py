"""A manager wrapper that stores a block only once enough distinct requests have wanted it."""

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

__all__ = ["FilterReusedOffloadingManager"]


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
        self._max_tracked = max_tracker_size
        self._counts: OrderedDict[OffloadKey, int] = OrderedDict()
        self._filtered = 0

    @property
    def backing(self) -> OffloadingManager:
        """The wrapped manager."""
        return self._backing

    def request_count(self, key: OffloadKey) -> int:
        """How many distinct requests have seen ``key`` (0 if untracked)."""
        return self._counts.get(key, 0)

    def _record(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        # Per request and filter (filters sharing a context, one per tier or stacked, count
        # independently): the keys this request was already counted for.
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

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        self._record((key,), ctx)
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
        self._record(keys, ctx)
        # Held keys pass so that the backing manager protects them; asked with the side-effect
        # free probe (a lookup may start a promotion into the host, or count as a lookup).
        counts, threshold, holds = self._counts, self._threshold, self._backing.holds
        passed = [k for k in keys if counts.get(k, 0) >= threshold or holds(k, ctx)]
        self._filtered += len(keys) - len(passed)
        return self._backing.prepare_store(passed, ctx)

    def complete_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True
    ) -> None:
        self._backing.complete_store(keys, ctx, success)

    def take_events(self) -> list[OffloadingEvent]:
        return self._backing.take_events()

    def request_finished(self, ctx: ReqContext) -> None:
        ctx.pop_state(self)
        self._backing.request_finished(ctx)

    def step_begin(self) -> None:
        self._backing.step_begin()

    def step_end(self) -> None:
        self._backing.step_end()

    def num_background_jobs(self) -> int:
        return self._backing.num_background_jobs()

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

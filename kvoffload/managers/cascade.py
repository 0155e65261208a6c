"""Cascades: host blocks written on to the secondary tiers, and when (the cascade strategies:
``write_through`` at once, ``on_evict`` when the host runs short of room).

Which tiers a block may reach, under every strategy: only those that the request whose store
wrote it into the host allowed (``kv_store_tiers``; all when absent). A host copy has exactly
one writer: a request that offers a block the host already holds (or is writing) stores nothing,
so it adds no tier; a block stored again after the host evicted it is a new copy, governed by
its new writer. So a block never reaches a tier that no request storing it allowed, and a
request with ``kv_store_tiers: []`` cascades nothing. Promoted blocks never cascade back.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from typing import ClassVar

from kvoffload.keys import OffloadKey
from kvoffload.manager_contract import LookupResult, ReqContext
from kvoffload.managers.cpu import CPUOffloadingManager
from kvoffload.managers.tier_jobs import NO_REQUEST, BackgroundJob, BackgroundJobs
from kvoffload.tiers.contract import SecondaryTier, TierJob

__all__ = [
    "CASCADES",
    "CASCADE_MODES",
    "Cascade",
    "CascadeQueue",
    "OnEvictCascade",
    "WriteThroughCascade",
]

_HIT = LookupResult.HIT


class CascadeQueue:
    """Host blocks pinned for the tiers that lack them, submitted as one store job per tier and
    step; each pin (host ``pin``, not a load) is released when the tier reports.

    Counters: ``cascaded_blocks``, ``failed_cascade_blocks``.
    """

    def __init__(
        self, host: CPUOffloadingManager, tiers: Sequence[SecondaryTier], jobs: BackgroundJobs
    ) -> None:
        self._host = host
        self._tiers = tiers
        self._jobs = jobs
        self._queued: list[tuple[list[OffloadKey], list[int]]] = [([], []) for _ in tiers]
        self.cascaded_blocks = 0
        self.failed_cascade_blocks = 0

    def add(self, keys: Sequence[OffloadKey], tier: int, probe: ReqContext) -> None:
        """Pin the readable host copies of ``keys`` that tier ``tier`` lacks, for this step's
        job (``probe``: the context of the lookups that decide it)."""
        host_lookup = self._host.lookup
        tier_holds = self._tiers[tier].holds
        # A tier that does not know yet is not asked (a question per stored block would double
        # a remote tier's round trips): the block cascades, and its store overwrites.
        wanted = [k for k in keys if host_lookup(k, probe) is _HIT and not tier_holds(k, probe)]
        if not wanted:
            return
        spec = self._host.pin(wanted)
        queued_keys, queued_slots = self._queued[tier]
        queued_keys.extend(wanted)
        queued_slots.extend(spec.block_ids)

    def submit(self) -> None:
        """Submit the blocks queued this step, one store job per tier."""
        for i, (keys, slots) in enumerate(self._queued):
            if keys:
                self._queued[i] = ([], [])
                job_id = self._jobs.add(BackgroundJob(i, keys, None, self._finished))
                self._tiers[i].submit_store(TierJob(job_id, keys, slots))

    def _finished(self, job: BackgroundJob, failed: Mapping[OffloadKey, str]) -> None:
        self._host.complete_load(job.keys, NO_REQUEST)
        self.cascaded_blocks += len(job.keys) - len(failed)
        self.failed_cascade_blocks += len(failed)

    def __bool__(self) -> bool:
        """Whether blocks are queued for this step's submission."""
        return any(keys for keys, _ in self._queued)

    def reset(self) -> None:
        """Forget the queued blocks (the host is being reset: their pins go with it)."""
        self._queued = [([], []) for _ in self._tiers]


class Cascade(ABC):
    """A cascade strategy: when completed host stores go to the secondary tiers.

    ``cascade_lost_blocks`` counts blocks the host evicted before they could cascade.
    """

    #: The name that selects it (``kv_tier_cascade``).
    name: ClassVar[str]

    def __init__(
        self, queue: CascadeQueue, host: CPUOffloadingManager, evict_headroom: float
    ) -> None:
        self._queue = queue
        self._host = host
        self.cascade_lost_blocks = 0

    @abstractmethod
    def stored(self, keys: Sequence[OffloadKey], tiers: Sequence[int], ctx: ReqContext) -> None:
        """``ctx``'s host store of ``keys`` completed; ``tiers``: where it lets them go."""

    def host_evicted(self, keys: Sequence[OffloadKey]) -> None:  # noqa: B027
        """The host evicted ``keys``. Default: nothing to forget."""

    def step_end(self) -> None:  # noqa: B027
        """Once per step, before the queue is submitted. Default: nothing."""

    def reset(self) -> None:  # noqa: B027
        """Forget everything (the host is being reset). Default: nothing kept."""


class WriteThroughCascade(Cascade):
    """Every completed host store is queued for its tiers at once (submitted at step end)."""

    name = "write_through"

    def stored(self, keys: Sequence[OffloadKey], tiers: Sequence[int], ctx: ReqContext) -> None:
        for tier in tiers:
            self._queue.add(keys, tier, ctx)


class OnEvictCascade(Cascade):
    """Completed host stores are remembered (*dirty*) and cascade, oldest first, only once the
    host's free slots drop below its headroom (``evict_headroom`` of its capacity, at least 1).
    A dirty block the host evicts first is lost to the tiers (``cascade_lost_blocks``)."""

    name = "on_evict"

    def __init__(
        self, queue: CascadeQueue, host: CPUOffloadingManager, evict_headroom: float
    ) -> None:
        super().__init__(queue, host, evict_headroom)
        self._headroom = max(1, int(host.num_blocks * evict_headroom))
        #: stored in the host, not cascaded yet, oldest first: key -> the tiers it may go to
        self._dirty: dict[OffloadKey, Sequence[int]] = {}

    def stored(self, keys: Sequence[OffloadKey], tiers: Sequence[int], ctx: ReqContext) -> None:
        if not tiers:
            return
        dirty = self._dirty
        for key in keys:
            dirty[key] = tiers

    def host_evicted(self, keys: Sequence[OffloadKey]) -> None:
        dirty = self._dirty
        if not dirty:
            return
        lost = 0
        for key in keys:
            if key in dirty:
                del dirty[key]
                lost += 1
        self.cascade_lost_blocks += lost

    def step_end(self) -> None:
        """Queue the oldest dirty blocks while the host has less free room than its headroom."""
        dirty = self._dirty
        if not dirty:
            return
        host = self._host
        n = self._headroom - (host.num_blocks - len(host.policy))
        if n <= 0:
            return
        # Oldest first, in runs of keys that may go to the same tiers (one tier list per
        # request; requests that allow every tier share one): one queue call per run and tier.
        runs: list[tuple[Sequence[int], list[OffloadKey]]] = []
        run_tiers: Sequence[int] | None = None
        for key, tiers in dirty.items():
            if tiers is not run_tiers:
                run: list[OffloadKey] = []
                runs.append((tiers, run))
                run_tiers = tiers
            run.append(key)
            n -= 1
            if not n:
                break
        for tiers, keys in runs:
            for key in keys:
                del dirty[key]
            for tier in tiers:
                self._queue.add(keys, tier, NO_REQUEST)

    def reset(self) -> None:
        self._dirty.clear()


#: The cascade strategies by name.
CASCADES: dict[str, type[Cascade]] = {c.name: c for c in (WriteThroughCascade, OnEvictCascade)}
CASCADE_MODES = tuple(CASCADES)

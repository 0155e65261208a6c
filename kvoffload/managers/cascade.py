"""Cascades: host blocks written on to the secondary tiers, and when (the cascade strategies:
``write_through`` at once, ``on_evict`` when the host runs short of room), within a bound.

Which tiers a block may reach, under every strategy: only those that the request whose store
wrote it into the host allowed (``kv_store_tiers``; all when absent). A host copy has exactly
one writer: a request that offers a block the host already holds (or is writing) stores nothing,
so it adds no tier; a block stored again after the host evicted it is a new copy, governed by
its new writer. So a block never reaches a tier that no request storing it allowed, and a
request with ``kv_store_tiers: []`` cascades nothing. Promoted blocks never cascade back.

**Only what pays** (``min_reuse``): a block seen by fewer than ``min_reuse`` distinct requests
(the tiering manager's :class:`~kvoffload.managers.reuse.ReuseCounts`) is not written yet: it
waits in the host, *cold*, and cascades once a later request's lookup makes it reach
``min_reuse``; a cold block the host evicts first was never worth the write
(``skipped_cascade_blocks``). ``min_reuse=1`` writes every block.

**Never holding the engine back** (``max_in_flight``): at most that many blocks per tier are
being written (pinned in the host) at a time; the rest wait in the tier's *backlog*, unpinned,
oldest first, and are submitted as writes report. A backlog block the host evicts before its turn
is *shed*: the host's eviction policy picks the least likely reused first, and a shed block is
simply not on that tier (``shed_cascade_blocks``, per tier ``shed_store_blocks``). A backlog
holds no host room and is bounded by the host's capacity; ``max_in_flight=0`` sheds every
cascade. Loads come first: a step's promotions are submitted before its cascades, so a promotion
waits behind at most ``max_in_flight`` blocks of writes on a tier.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import ClassVar

from kvoffload.keys import OffloadKey
from kvoffload.manager_contract import LookupResult, ReqContext
from kvoffload.managers.cpu import CPUOffloadingManager
from kvoffload.managers.reuse import ReuseCounts
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
    """Per tier, the host blocks waiting to be written (the backlog, oldest first, unpinned) and
    the blocks being written (pinned in the host, at most ``max_in_flight``); one store job per
    tier and step; each pin (host ``pin``, not a load) is released when the tier reports.

    Counters: ``cascaded_blocks``, ``failed_cascade_blocks``, ``shed_cascade_blocks`` (per tier
    in :meth:`tier_stats`: ``shed_store_blocks``); gauges ``cascade_backlog_blocks``,
    ``cascade_in_flight_blocks``.
    """

    def __init__(
        self,
        host: CPUOffloadingManager,
        tiers: Sequence[SecondaryTier],
        jobs: BackgroundJobs,
        max_in_flight: int,
    ) -> None:
        self._host = host
        self._tiers = tiers
        self._jobs = jobs
        self.max_in_flight = max_in_flight
        #: per tier: keys waiting for their write, oldest first (readable host blocks: a host
        #: eviction removes its keys, :meth:`host_evicted`)
        self._backlog: list[OrderedDict[OffloadKey, None]] = [OrderedDict() for _ in tiers]
        self._in_flight = [0] * len(tiers)  # per tier: blocks submitted, not reported
        self._shed = [0] * len(tiers)
        self.cascaded_blocks = 0
        self.failed_cascade_blocks = 0

    def add(self, keys: Sequence[OffloadKey], tier: int, probe: ReqContext) -> None:
        """Queue the readable host copies of ``keys`` that tier ``tier`` lacks (``probe``: the
        context of the lookups that decide it)."""
        host_lookup = self._host.lookup
        tier_holds = self._tiers[tier].holds
        backlog = self._backlog[tier]
        # A tier that does not know yet is not asked (a question per stored block would double
        # a remote tier's round trips): the block cascades, and its store overwrites.
        wanted = [
            k
            for k in keys
            if k not in backlog and host_lookup(k, probe) is _HIT and not tier_holds(k, probe)
        ]
        if not wanted:
            return
        if not self.max_in_flight:  # no write may be in flight: shed at once
            self._shed[tier] += len(wanted)
            return
        for key in wanted:
            backlog[key] = None

    def submit(self) -> None:
        """Submit the oldest waiting blocks, one store job per tier, as far as the tier's
        writes in flight stay within ``max_in_flight``."""
        held = self._host.policy.get
        for i, backlog in enumerate(self._backlog):
            room = self.max_in_flight - self._in_flight[i]
            if not backlog or room <= 0:
                continue
            keys: list[OffloadKey] = []
            while backlog and len(keys) < room:
                key, _ = backlog.popitem(last=False)
                block = held(key)
                if block is not None and block.ref_cnt >= 0:  # readable (always, see above)
                    keys.append(key)
            if not keys:
                continue
            spec = self._host.pin(keys)
            self._in_flight[i] += len(keys)
            job_id = self._jobs.add(BackgroundJob(i, keys, None, self._finished))
            self._tiers[i].submit_store(TierJob(job_id, keys, list(spec.block_ids)))

    def _finished(self, job: BackgroundJob, failed: Mapping[OffloadKey, str]) -> None:
        self._host.complete_load(job.keys, NO_REQUEST)
        self._in_flight[job.tier] -= len(job.keys)
        self.cascaded_blocks += len(job.keys) - len(failed)
        self.failed_cascade_blocks += len(failed)

    def host_evicted(self, keys: Sequence[OffloadKey]) -> None:
        """The host evicted ``keys``: those still waiting are shed (never written)."""
        for i, backlog in enumerate(self._backlog):
            if backlog:
                shed = 0
                for key in keys:
                    if key in backlog:
                        del backlog[key]
                        shed += 1
                self._shed[i] += shed

    @property
    def shed_cascade_blocks(self) -> int:
        return sum(self._shed)

    @property
    def backlog_blocks(self) -> int:
        return sum(map(len, self._backlog))

    @property
    def in_flight_blocks(self) -> int:
        return sum(self._in_flight)

    def tier_stats(self, tier: int) -> dict[str, int]:
        """``tier``'s cascades: ``shed_store_blocks`` (never written: the tier fell behind),
        ``cascade_backlog_blocks`` and ``cascade_in_flight_blocks`` (gauges)."""
        return {
            "shed_store_blocks": self._shed[tier],
            "cascade_backlog_blocks": len(self._backlog[tier]),
            "cascade_in_flight_blocks": self._in_flight[tier],
        }

    def __bool__(self) -> bool:
        """Whether blocks wait for their write."""
        return any(self._backlog)

    def reset(self) -> None:
        """Forget the waiting blocks and the writes in flight (the host is being reset and the
        tiers' jobs were drained and discarded: their pins go with the host)."""
        self._backlog = [OrderedDict() for _ in self._tiers]
        self._in_flight = [0] * len(self._tiers)


class Cascade(ABC):
    """A cascade strategy: when completed host stores go to the secondary tiers.

    ``cascade_lost_blocks`` counts blocks the host evicted before they could cascade;
    ``skipped_cascade_blocks`` blocks never written because fewer than ``min_reuse`` requests
    saw them (``reuse``: the counts; ``None`` or ``min_reuse <= 1``: every block is worth it).
    """

    #: The name that selects it (``kv_tier_cascade``).
    name: ClassVar[str]

    def __init__(
        self,
        queue: CascadeQueue,
        host: CPUOffloadingManager,
        evict_headroom: float,
        reuse: ReuseCounts | None = None,
        min_reuse: int = 1,
    ) -> None:
        self._queue = queue
        self._host = host
        self._reuse = reuse if min_reuse > 1 else None
        self._min_reuse = min_reuse
        #: completed host stores not worth writing yet, oldest first: key -> its tiers
        self._cold: dict[OffloadKey, Sequence[int]] = {}
        self.cascade_lost_blocks = 0
        self.skipped_cascade_blocks = 0

    @property
    def gated(self) -> bool:
        """Whether blocks must be seen by ``min_reuse`` requests before they are written."""
        return self._reuse is not None

    @abstractmethod
    def stored(self, keys: Sequence[OffloadKey], tiers: Sequence[int], ctx: ReqContext) -> None:
        """``ctx``'s host store of ``keys`` completed; ``tiers``: where it lets them go."""

    def _worth(self, keys: Sequence[OffloadKey], tiers: Sequence[int]) -> list[OffloadKey]:
        """The keys of ``keys`` worth a write now; the others wait, cold, for a reuse."""
        if self._reuse is None:
            return list(keys)
        count, least, cold = self._reuse.count, self._min_reuse, self._cold
        worth = []
        for key in keys:
            if count(key) >= least:
                worth.append(key)
            else:
                cold[key] = tiers
        return worth

    def reused(self, key: OffloadKey) -> None:
        """A request's lookup found ``key`` in the host (its count was just recorded): a cold
        block that reached ``min_reuse`` is queued for its tiers now."""
        tiers = self._cold.get(key)
        reuse = self._reuse
        if tiers is not None and reuse is not None and reuse.count(key) >= self._min_reuse:
            del self._cold[key]
            for tier in tiers:
                self._queue.add((key,), tier, NO_REQUEST)

    def host_evicted(self, keys: Sequence[OffloadKey]) -> None:
        """The host evicted ``keys``: cold ones were never worth a write."""
        cold = self._cold
        if cold:
            for key in keys:
                if cold.pop(key, None) is not None:
                    self.skipped_cascade_blocks += 1

    def step_end(self) -> None:  # noqa: B027
        """Once per step, before the queue is submitted. Default: nothing."""

    def reset(self) -> None:
        """Forget everything (the host is being reset)."""
        self._cold.clear()


class WriteThroughCascade(Cascade):
    """Every completed host store worth writing is queued for its tiers at once (submitted at
    step end, within the queue's bound)."""

    name = "write_through"

    def stored(self, keys: Sequence[OffloadKey], tiers: Sequence[int], ctx: ReqContext) -> None:
        if not tiers:
            return
        worth = self._worth(keys, tiers)
        if worth:
            for tier in tiers:
                self._queue.add(worth, tier, ctx)


class OnEvictCascade(Cascade):
    """Completed host stores are remembered (*dirty*) and cascade, oldest first, only once the
    host's free slots drop below its headroom (``evict_headroom`` of its capacity, at least 1).
    A dirty block the host evicts first is lost to the tiers (``cascade_lost_blocks``)."""

    name = "on_evict"

    def __init__(
        self,
        queue: CascadeQueue,
        host: CPUOffloadingManager,
        evict_headroom: float,
        reuse: ReuseCounts | None = None,
        min_reuse: int = 1,
    ) -> None:
        super().__init__(queue, host, evict_headroom, reuse, min_reuse)
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
        super().host_evicted(keys)
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
            worth = self._worth(keys, tiers)
            for tier in tiers:
                self._queue.add(worth, tier, NO_REQUEST)

    def reset(self) -> None:
        super().reset()
        self._dirty.clear()


#: The cascade strategies by name.
CASCADES: dict[str, type[Cascade]] = {c.name: c for c in (WriteThroughCascade, OnEvictCascade)}
CASCADE_MODES = tuple(CASCADES)

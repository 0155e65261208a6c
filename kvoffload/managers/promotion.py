"""Promotions: secondary-tier blocks brought into host slots for the requests that want them.

A promoted block's life: a lookup queues it (the answer is ``RETRY``); at the step's first
device store or at step end its host slot is reserved (host ``prepare_store``: pending, never
evicted) and one load job per tier and request is submitted; when the tier reports, the block
becomes readable in the host (or is freed, and that request recomputes it) and is pinned for its
request until that request loads it or ends; from then on it is an ordinary host block.
A request's promotion that does not fit the host's room as a whole gets its longest head that
does (:func:`~kvoffload.managers.fitting.reserve_longest_head`); the rest is refused.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from kvoffload.keys import OffloadKey
from kvoffload.manager_contract import LookupResult, PrepareStoreOutput, ReqContext
from kvoffload.managers.cpu import CPUOffloadingManager
from kvoffload.managers.fitting import reserve_longest_head
from kvoffload.managers.tier_jobs import NO_REQUEST, BackgroundJob, BackgroundJobs
from kvoffload.managers.tier_requests import RequestTiers
from kvoffload.tiers.contract import SecondaryTier, TierJob

__all__ = ["QUEUED", "Promotions"]

QUEUED = -1  # the job id of a promotion gathered this step, not yet submitted


class Promotions:
    """The promotions of one tiering manager: queued, in flight, and landed but pinned.

    ``in_flight``: key -> id of the job writing it into the host (:data:`QUEUED` before
    submission; one dict for the manager's life, cleared, never replaced); ``num_queued``: keys queued this step. Counters: ``promoted_blocks``,
    ``failed_promotion_blocks``, ``refused_promotion_blocks`` (no host room, or not admitted),
    ``room_waits``, ``promotion_jobs``, ``promotion_us``; per tier (:meth:`tier_stats`) its
    promotion jobs, their blocks (failed ones included) and microseconds, so a tier's time per
    block is measured on its own.
    """

    def __init__(
        self,
        host: CPUOffloadingManager,
        tiers: Sequence[SecondaryTier],
        jobs: BackgroundJobs,
        host_evicted: Callable[[Sequence[OffloadKey]], None],
    ) -> None:
        self._host = host
        self._tiers = tiers
        self._jobs = jobs
        self._host_evicted = host_evicted  # the manager's: forgets what an eviction removed
        self.in_flight: dict[OffloadKey, int] = {}
        self._queues: list[dict[ReqContext, list[OffloadKey]]] = [{} for _ in tiers]
        self.num_queued = 0
        #: landed promotions pinned in the host for the request that asked for them, until it
        #: loads or ends: ctx -> keys, one host pin each
        self.pins: dict[ReqContext, list[OffloadKey]] = {}
        #: promoted into the host and not loaded since: key -> the tier it came from (entries
        #: leave on their first load or their host eviction, so at most one per host slot)
        self._source: dict[OffloadKey, int] = {}
        self.promoted_blocks = 0
        self.failed_promotion_blocks = 0
        self.refused_promotion_blocks = 0
        self.room_waits = 0
        self.promotion_jobs = 0
        self.promotion_us = 0
        #: per tier: [jobs, blocks, microseconds] of its promotions
        self._per_tier = [[0, 0, 0] for _ in tiers]

    # ------------------------------------------------------------------ gathering (lookups)

    def queue(self, tier: int, ctx: ReqContext, key: OffloadKey) -> None:
        """Queue ``key``'s promotion from ``tier`` for ``ctx`` (submitted by :meth:`submit`)."""
        self._queues[tier].setdefault(ctx, []).append(key)
        self.in_flight[key] = QUEUED
        self.num_queued += 1

    def room(self, state: RequestTiers, step: int) -> int:
        """Host slots one more promotion could get this step: free and evictable ones, less the
        promotions queued this step and the evictable hits this request's scan protects."""
        room = self._host.num_reclaimable - self.num_queued
        if state.scan_step == step:
            room -= state.scan_evictable
        return room

    def must_wait_for_room(self, ctx: ReqContext) -> bool:
        """A secondary hit the host has no room to promote now: whether ``ctx`` waits for room.

        A request that has promoted blocks of its own (queued this step or landed) takes the
        prefix it has (no): it never waits for room it holds itself. Another waits (yes,
        ``room_waits``, nothing queued): the room is held by transfers and by promotions for
        requests ahead of it, each released within a few steps, and lookups run in queue order,
        so it is served before the requests behind it; the scheduler's retry budget bounds it.
        """
        if ctx in self.pins or any(ctx in queue for queue in self._queues):
            return False
        self.room_waits += 1
        return True

    # ------------------------------------------------------------------ submission

    def submit(self, step: int) -> None:
        """Reserve host slots for the promotions gathered in ``step`` and submit them."""
        self.num_queued = 0
        for i, queue in enumerate(self._queues):
            if queue:
                self._queues[i] = {}
                for ctx, keys in queue.items():
                    self._submit(i, ctx, keys, step)

    def _submit(self, tier: int, ctx: ReqContext, keys: list[OffloadKey], step: int) -> None:
        state = ctx.get_state(RequestTiers)
        if state is None:  # the request ended since its lookup
            for key in keys:
                self.in_flight.pop(key, None)
            return
        n, outs = self._reserve(ctx, state, keys, step)
        if n < len(keys):
            self._refuse(state, keys[n:])
            keys = keys[:n]
        promoted: list[OffloadKey] = []
        slots: list[int] = []
        for out in outs:
            if out.evicted_keys:
                self._host_evicted(out.evicted_keys)
            promoted += out.keys_to_store
            slots += out.store_spec.block_ids  # type: ignore[attr-defined]  # the host's spec
        declined = set(keys).difference(promoted)
        if declined:
            host_lookup = self._host.lookup
            for key in declined:
                self.in_flight.pop(key, None)
                if host_lookup(key, ctx) is LookupResult.MISS:  # not admitted; else a device
                    state.failed.add(key)  # store brought it in meanwhile
                    self.refused_promotion_blocks += 1
        if not promoted:
            return
        job_id = self._jobs.add(BackgroundJob(tier, promoted, ctx, self._finished))
        for key in promoted:
            self.in_flight[key] = job_id
        self._tiers[tier].submit_load(TierJob(job_id, promoted, slots), ctx)

    def _reserve(
        self, ctx: ReqContext, state: RequestTiers, keys: list[OffloadKey], step: int
    ) -> tuple[int, list[PrepareStoreOutput]]:
        """Reserve host slots for the longest head of ``keys`` that fits (a prefix: the rest is
        of no use without it); returns its length and the reservations."""
        # The scan's hits are protected from eviction for this reservation. Every host eviction
        # goes through a prepare_store of the manager, which submits queued promotions first,
        # so they are still held (one that was not would get a slot reserved and never written).
        held = self._host.policy.get
        scan = [k for k in state.scan if held(k) is not None] if state.scan_step == step else []
        prepare = self._host.prepare_store
        out = prepare([*scan, *keys], ctx)
        if out is not None:
            return len(keys), [out]
        return reserve_longest_head(len(keys), lambda n: prepare([*scan, *keys[:n]], ctx))

    def _refuse(self, state: RequestTiers, keys: list[OffloadKey]) -> None:
        """No host room for ``keys``: the request recomputes them (others may still promote)."""
        for key in keys:
            self.in_flight.pop(key, None)
        state.failed.update(keys)
        self.refused_promotion_blocks += len(keys)

    # ------------------------------------------------------------------ results and pins

    def _finished(self, job: BackgroundJob, failed: Mapping[OffloadKey, str]) -> None:
        """The tier reported a promotion: its blocks become readable (pinned for a request still
        running) or, where they failed, are freed and recomputed by that request."""
        host, ctx = self._host, job.ctx or NO_REQUEST
        for key in job.keys:
            self.in_flight.pop(key, None)
        live = ctx.get_state(RequestTiers)  # None once the request ended
        ok = [k for k in job.keys if k not in failed]
        if ok:
            host.complete_store(ok, ctx, True)
            source = self._source
            for key in ok:
                source[key] = job.tier
            if live is not None:
                # Held for the request until it loads them: otherwise the next device stores
                # may evict them before it is admitted.
                host.pin(ok)
                self.pins.setdefault(ctx, []).extend(ok)
        if failed:
            bad = [k for k in job.keys if k in failed]
            host.complete_store(bad, ctx, False)
            if live is not None:
                live.failed.update(bad)
        self.promoted_blocks += len(ok)
        self.failed_promotion_blocks += len(job.keys) - len(ok)
        us = int((time.perf_counter() - job.submitted) * 1e6)
        self.promotion_jobs += 1
        self.promotion_us += us
        per_tier = self._per_tier[job.tier]
        per_tier[0] += 1
        per_tier[1] += len(job.keys)
        per_tier[2] += us

    def tier_stats(self, tier: int) -> dict[str, int]:
        """``tier``'s promotions: ``promotion_jobs``, ``promotion_blocks`` (failed included),
        ``promotion_us`` (submission to result, summed)."""
        jobs, blocks, us = self._per_tier[tier]
        return {"promotion_jobs": jobs, "promotion_blocks": blocks, "promotion_us": us}

    def unpin(self, ctx: ReqContext) -> None:
        """Release the pins of ``ctx``'s landed promotions (it loads them now, or it ended)."""
        keys = self.pins.pop(ctx, None)
        if keys:
            self._host.complete_load(keys, NO_REQUEST)

    def source(self, key: OffloadKey) -> int | None:
        """The tier a promotion brought ``key`` from, asked once at its first load; else None."""
        return self._source.pop(key, None)

    def forget(self, evicted: Sequence[OffloadKey]) -> None:
        """The host evicted ``evicted``: they are no longer promoted blocks."""
        source = self._source
        if source:
            for key in evicted:
                source.pop(key, None)

    def reset(self) -> None:
        """Forget every promotion (the tiers' jobs were drained and discarded)."""
        self.in_flight.clear()
        self._queues = [{} for _ in self._tiers]
        self.num_queued = 0
        self.pins.clear()
        self._source.clear()

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if promotion records and host slots disagree (tests only)."""
        get = self._host.policy.get
        for key, job_id in self.in_flight.items():
            if job_id != QUEUED:  # a queued one may meet a device store of the same block
                block = get(key)
                assert block is not None and block.ref_cnt < 0, (
                    f"{key.hex()}: promotion in flight but its host slot is not pending"
                )
                assert job_id in self._jobs, f"{key.hex()}: promotion job {job_id} unknown"
        queued = sum(len(keys) for queue in self._queues for keys in queue.values())
        assert self.num_queued == queued, f"{self.num_queued} promotions counted, {queued} queued"
        for ctx, keys in self.pins.items():
            assert ctx.get_state(RequestTiers) is not None, f"{ctx.req_id} ended but pins blocks"
            for key in keys:
                block = get(key)
                assert block is not None and block.ref_cnt > 0, (
                    f"{key.hex()}: promoted for {ctx.req_id} but not pinned in the host"
                )

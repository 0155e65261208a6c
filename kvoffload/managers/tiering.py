"""The tiering manager: the host tier plus an ordered list of secondary tiers, as one manager.

The host tier (:class:`~kvoffload.managers.cpu.CPUOffloadingManager`) is the only tier that
exchanges blocks with the engine's cache; secondary tiers (:class:`~kvoffload.tiers.SecondaryTier`)
exchange blocks with host slots only. Behind the unchanged :class:`OffloadingManager` contract:

* **Lookup** answers the host first; a host miss asks the secondary tiers in order. A secondary
  hit is *promoted*: host slots are reserved (host ``prepare_store``) and the tier loads into them
  (``submit_load``); until it lands the answer is ``RETRY`` (the scheduler asks again next step),
  then ``HIT`` from the host. A promotion starts only if the host has room for it this step;
  without room a request waits (``RETRY``, ``room_waits``) unless it has promoted blocks of its
  own, then it takes the prefix it has (``MISS``). A failed or refused promotion answers ``MISS``
  to that request from then on: it recomputes.
* **Order**: a step's promotions reserve their host slots before its device stores (at the first
  :meth:`prepare_store` of the step, else at :meth:`step_end`).
* **Stores** go to the host. When a host store completes, its blocks *cascade* to the secondary
  tiers (``cascade="write_through"``), or, with ``cascade="on_evict"``, only when the host runs
  short of free slots (oldest-stored first; a block the host evicts before its turn is lost to
  the secondary tiers and counted in ``cascade_lost_blocks``).
* **Pins**: a host slot being read by a cascade is pinned (host ``pin``) until the
  tier's store reports; a slot being written by a promotion is pending in the host; a landed
  promotion is pinned for the request that asked for it until that request loads
  (:meth:`prepare_load`) or ends (:meth:`request_finished`). None of them is evicted.
* **No convoy**: a promotion serves whoever wants its blocks: a second request wanting a block
  being promoted waits for that same promotion (it would need the same I/O; it never starts a
  second copy). A request waiting for host room waits for transfers and for promotions of the
  requests ahead of it (lookups run in queue order). Every wait is bounded by the request's retry
  budget in the scheduler, after which it takes the prefix it has.
* **Per-request tiers**: ``kv_transfer_params["kv_load_tiers"]`` / ``["kv_store_tiers"]`` list
  the secondary tier names a request may promote from / cascade to (default: all).

Background work is batched per step: lookups and completed host stores only queue jobs, which
are submitted once per step (one job per tier and request); :meth:`step_begin` and the
submission apply the tiers' finished jobs (never blocking). Events: the host's (medium ``CPU``)
and each tier's (``STORAGE`` with its locality), in that order.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

from kvoffload.base import (
    LoadStoreSpec,
    LookupResult,
    OffloadingEvent,
    OffloadingManager,
    PrepareStoreOutput,
    ReqContext,
)
from kvoffload.errors import ConfigError
from kvoffload.keys import OffloadKey
from kvoffload.managers.cpu import CPUOffloadingManager
from kvoffload.tiers.base import SecondaryTier, TierJob

__all__ = ["CASCADE_MODES", "TieringOffloadingManager", "validate_tier_params"]

_MISS = LookupResult.MISS
_HIT = LookupResult.HIT
_HIT_PENDING = LookupResult.HIT_PENDING
_RETRY = LookupResult.RETRY

CASCADE_MODES = ("write_through", "on_evict")
_QUEUED = -1  # a promotion gathered this step, not yet submitted


def validate_tier_params(params: Mapping[str, Any] | None, names: Sequence[str]) -> None:
    """Check ``kv_load_tiers`` / ``kv_store_tiers`` of a request: lists of known tier names."""
    if not params:
        return
    for field in ("kv_load_tiers", "kv_store_tiers"):
        value = params.get(field)
        if value is None:
            continue
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            raise ConfigError(f"kv_transfer_params.{field}", f"must be a list, got {value!r}")
        unknown = [v for v in value if v not in names]
        if unknown:
            raise ConfigError(
                f"kv_transfer_params.{field}",
                f"unknown tiers {unknown}; this engine has {list(names)}",
            )


class _RequestTiers:
    """Per-request state (on the ReqContext): allowed tiers, blocks it must not wait for, and
    the host hits of its current lookup pass (protected while its promotions reserve slots)."""

    __slots__ = ("failed", "load_tiers", "scan", "scan_evictable", "scan_step", "store_tiers")

    def __init__(self, load_tiers: list[int], store_tiers: list[int]) -> None:
        self.load_tiers = load_tiers
        self.store_tiers = store_tiers
        self.failed: set[OffloadKey] = set()
        self.scan: list[OffloadKey] = []
        self.scan_evictable = 0  # scan keys that were evictable when looked up
        self.scan_step = -1


class _BackgroundJob:
    __slots__ = ("ctx", "keys", "promotion", "submitted", "tier")

    def __init__(self, tier: int, keys: list[OffloadKey], ctx: ReqContext | None, promotion: bool):
        self.tier = tier
        self.keys = keys
        self.ctx = ctx
        self.promotion = promotion
        self.submitted = time.perf_counter()


class TieringOffloadingManager(OffloadingManager):
    """Host tier + secondary tiers behind one :class:`OffloadingManager` (module docstring).

    Counters (:meth:`stats`): the host's, unprefixed; per tier ``<name>_<counter>``; and
    ``promoted_blocks``, ``failed_promotion_blocks``, ``refused_promotion_blocks`` (no host room),
    ``cascaded_blocks``, ``failed_cascade_blocks``, ``cascade_lost_blocks``, ``retry_answers``,
    ``room_waits`` (``RETRY`` answers waiting for host room), ``promotion_jobs`` and
    ``promotion_us`` (microseconds from submission to the result, summed); gauges
    ``promotions_in_flight`` and ``pinned_promoted_blocks``.
    """

    medium = "CPU"

    def __init__(
        self,
        host: CPUOffloadingManager,
        tiers: Sequence[SecondaryTier],
        cascade: str = "write_through",
        evict_headroom: float = 0.125,
    ) -> None:
        if cascade not in CASCADE_MODES:
            raise ConfigError(
                "kv_tier_cascade", f"unknown mode {cascade!r}; choose from {list(CASCADE_MODES)}"
            )
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ConfigError("secondary_tiers", f"tier names must be unique, got {names}")
        self.host = host
        self.tiers = list(tiers)
        self.tier_names = names
        self.cascade = cascade
        self._all_tiers = list(range(len(self.tiers)))
        self._headroom = max(1, int(host.num_blocks * evict_headroom))
        self._step = 0
        self._next_job = 0
        self._jobs: dict[int, _BackgroundJob] = {}
        #: key -> job id of the promotion writing it into the host (``_QUEUED`` before submission)
        self._promoting: dict[OffloadKey, int] = {}
        self._promote_queue: list[dict[ReqContext, list[OffloadKey]]] = [{} for _ in self.tiers]
        self._num_queued = 0  # keys in self._promote_queue (0: the queues are empty)
        #: landed promotions pinned in the host for the request that asked for them, until it
        #: loads (:meth:`prepare_load`) or ends: ctx -> keys, one host pin each
        self._promotion_pins: dict[ReqContext, list[OffloadKey]] = {}
        self._cascade_queue: list[tuple[list[OffloadKey], list[int]]] = [
            ([], []) for _ in self.tiers
        ]
        self._dirty: dict[OffloadKey, None] = {}  # on_evict: stored in host, not yet cascaded
        #: promoted into the host and not loaded since: key -> the tier it came from (entries
        #: leave on their first load or their host eviction, so at most one per host slot)
        self._promoted_from: dict[OffloadKey, int] = {}
        self._counters = dict.fromkeys(
            (
                "promoted_blocks",
                "failed_promotion_blocks",
                "refused_promotion_blocks",
                "cascaded_blocks",
                "failed_cascade_blocks",
                "cascade_lost_blocks",
                "retry_answers",
                "room_waits",
                "promotion_jobs",
                "promotion_us",
            ),
            0,
        )

    # ------------------------------------------------------------------ per request

    def _state(self, ctx: ReqContext) -> _RequestTiers:
        state = ctx.get_state(_RequestTiers)
        if state is None:
            params = ctx.kv_transfer_params
            state = _RequestTiers(
                self._selected(params.get("kv_load_tiers")),
                self._selected(params.get("kv_store_tiers")),
            )
            ctx.set_state(state)
        return state

    def _selected(self, names: Sequence[str] | None) -> list[int]:
        if names is None:
            return self._all_tiers
        return [i for i, name in enumerate(self.tier_names) if name in names]

    # ------------------------------------------------------------------ lookups and loads

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        # The host's answer read from its block record (one dict lookup: the record also says
        # whether the block is evictable).
        block = self.host.policy.get(key)
        if block is not None and block.ref_cnt >= 0:  # a host HIT
            state = self._state(ctx)
            if state.scan_step != self._step:
                state.scan_step = self._step
                state.scan.clear()
                state.scan_evictable = 0
            state.scan.append(key)
            if not block.ref_cnt:
                state.scan_evictable += 1
            return _HIT
        if key in self._promoting:
            self._counters["retry_answers"] += 1
            return _RETRY
        if block is not None:  # being written into the host
            return _HIT_PENDING
        state = self._state(ctx)
        if key in state.failed:
            return _MISS
        tiers = self.tiers
        for i in state.load_tiers:
            answer = tiers[i].lookup(key, ctx)
            if answer is _HIT:
                if self._room(state) <= 0:
                    return self._no_room(ctx)
                self._promote_queue[i].setdefault(ctx, []).append(key)
                self._promoting[key] = _QUEUED
                self._num_queued += 1
                self._counters["retry_answers"] += 1
                return _RETRY
            if answer is _RETRY:
                self._counters["retry_answers"] += 1
                return _RETRY
        return _MISS

    def _room(self, state: _RequestTiers) -> int:
        """Host slots one more promotion could get this step: free and evictable ones, less the
        promotions queued this step and the evictable hits this request's scan protects."""
        room = self.host.num_reclaimable - self._num_queued
        if state.scan_step == self._step:
            room -= state.scan_evictable
        return room

    def _no_room(self, ctx: ReqContext) -> LookupResult:
        """A secondary hit the host has no room to promote now. A request that has promoted
        blocks of its own (queued this step or landed) takes the prefix it has (``MISS``): it
        never waits for room it holds itself. Another waits (``RETRY``, nothing queued): the
        room is held by transfers and by promotions for requests ahead of it, each released
        within a few steps, and lookups run in queue order, so it is served before the requests
        behind it; the scheduler's retry budget bounds the wait."""
        if ctx in self._promotion_pins or any(ctx in queue for queue in self._promote_queue):
            return _MISS
        self._counters["room_waits"] += 1
        self._counters["retry_answers"] += 1
        return _RETRY

    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> LoadStoreSpec:
        try:
            return self.host.prepare_load(keys, ctx)
        finally:
            # The request's own load pins what it loads now; its promotion pins have served.
            if self._promotion_pins:
                self._unpin_promoted(ctx)

    def _unpin_promoted(self, ctx: ReqContext) -> None:
        keys = self._promotion_pins.pop(ctx, None)
        if keys:
            self.host.complete_load(keys, _NO_REQUEST)

    def load_source(self, key: OffloadKey, ctx: ReqContext) -> str:
        """The tier a promotion brought ``key`` from, for its first load; else ``"host"``."""
        tier = self._promoted_from.pop(key, None)
        return "host" if tier is None else self.tier_names[tier]

    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self.host.complete_load(keys, ctx)

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self.host.touch(keys, ctx)
        for i in self._state(ctx).load_tiers:
            self.tiers[i].touch(keys, ctx)

    # ------------------------------------------------------------------ stores

    def prepare_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext
    ) -> PrepareStoreOutput | None:
        if self._num_queued:
            # This step's promotions take host room before its device stores do: a device store
            # refused only goes unoffloaded, a promotion refused is recomputed.
            self._submit_promotions()
        out = self.host.prepare_store(keys, ctx)
        if out is not None and out.evicted_keys:
            self._host_evicted(out.evicted_keys)
        return out

    def complete_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True
    ) -> None:
        self.host.complete_store(keys, ctx, success)
        if not success or not self.tiers:
            return
        if self.cascade == "on_evict":
            dirty = self._dirty
            for key in keys:
                dirty[key] = None
            return
        self._queue_cascade(keys, self._state(ctx).store_tiers, ctx)

    def _queue_cascade(
        self, keys: Sequence[OffloadKey], tiers: Sequence[int], ctx: ReqContext | None
    ) -> None:
        """Pin readable host copies of ``keys`` for each tier that lacks them; submitted at
        :meth:`step_end`."""
        host_lookup = self.host.lookup
        probe = ctx if ctx is not None else _NO_REQUEST
        for i in tiers:
            tier_lookup = self.tiers[i].lookup
            # RETRY (an asynchronous tier does not know yet) cascades too: the tier skips
            # keys it turns out to hold.
            wanted = [
                k
                for k in keys
                if host_lookup(k, probe) is _HIT
                and tier_lookup(k, probe) not in (_HIT, _HIT_PENDING)
            ]
            if not wanted:
                continue
            spec = self.host.pin(wanted)
            queued_keys, queued_slots = self._cascade_queue[i]
            queued_keys.extend(wanted)
            queued_slots.extend(spec.block_ids)  # type: ignore[attr-defined]

    def _host_evicted(self, evicted: Sequence[OffloadKey]) -> None:
        """Forget what the host no longer holds: promotion sources, and (``on_evict``) blocks
        that never reached a secondary tier."""
        if self._promoted_from:
            promoted_from = self._promoted_from
            for key in evicted:
                promoted_from.pop(key, None)
        if self._dirty:
            self._forget_dirty(evicted)

    def _forget_dirty(self, evicted: Sequence[OffloadKey]) -> None:
        dirty, lost = self._dirty, 0
        for key in evicted:
            if key in dirty:
                del dirty[key]
                lost += 1
        self._counters["cascade_lost_blocks"] += lost

    # ------------------------------------------------------------------ per step

    def step_begin(self) -> None:
        self._apply_finished()

    def _apply_finished(self) -> None:
        """Apply the tiers' finished jobs: promotions become readable (or are freed), cascades
        unpin their host slots."""
        host, jobs, counters = self.host, self._jobs, self._counters
        for tier in self.tiers:
            for result in tier.get_finished_jobs():
                job = jobs.pop(result.job_id, None)
                if job is None:
                    continue
                failed = result.failed_keys
                if job.promotion:
                    ok = [k for k in job.keys if k not in failed]
                    ctx = job.ctx if job.ctx is not None else _NO_REQUEST
                    for key in job.keys:
                        self._promoting.pop(key, None)
                    live = ctx.get_state(_RequestTiers)  # None once the request ended
                    if ok:
                        host.complete_store(ok, ctx, True)
                        promoted_from = self._promoted_from
                        for key in ok:
                            promoted_from[key] = job.tier
                        if live is not None:
                            # Held for the request until it loads them: otherwise the next
                            # device stores may evict them before it is admitted.
                            host.pin(ok)
                            self._promotion_pins.setdefault(ctx, []).extend(ok)
                    if failed:
                        bad = [k for k in job.keys if k in failed]
                        host.complete_store(bad, ctx, False)
                        if live is not None:
                            live.failed.update(bad)
                    counters["promoted_blocks"] += len(ok)
                    counters["promotion_jobs"] += 1
                    counters["promotion_us"] += int((time.perf_counter() - job.submitted) * 1e6)
                    counters["failed_promotion_blocks"] += len(job.keys) - len(ok)
                else:
                    host.complete_load(job.keys, _NO_REQUEST)
                    counters["cascaded_blocks"] += len(job.keys) - len(failed)
                    counters["failed_cascade_blocks"] += len(failed)

    def step_end(self) -> None:
        self._submit_promotions()
        self._step += 1
        if self._dirty:
            self._cascade_dirty()
        for i, (keys, slots) in enumerate(self._cascade_queue):
            if keys:
                self._cascade_queue[i] = ([], [])
                job_id = self._new_job(_BackgroundJob(i, keys, None, promotion=False))
                self.tiers[i].submit_store(TierJob(job_id, keys, slots))

    def _submit_promotions(self) -> None:
        """Reserve host slots for the promotions gathered this step and submit them."""
        # Jobs that finished during the step unpin their host slots first, so the promotions
        # find the room the cascades held.
        self._apply_finished()
        self._num_queued = 0
        for i, queue in enumerate(self._promote_queue):
            if queue:
                self._promote_queue[i] = {}
                for ctx, keys in queue.items():
                    self._submit_promotion(i, ctx, keys)

    def _submit_promotion(self, tier: int, ctx: ReqContext, keys: list[OffloadKey]) -> None:
        state = ctx.get_state(_RequestTiers)
        promoting = self._promoting
        if state is None:  # the request ended since its lookup
            for key in keys:
                promoting.pop(key, None)
            return
        # The scan's hits are protected from eviction for this reservation. Every host eviction
        # goes through a prepare_store here, which submits queued promotions first, so they are
        # still held (one that was not would get a slot reserved and never written).
        held = self.host.policy.get
        scan = (
            [k for k in state.scan if held(k) is not None]
            if state.scan_step == self._step
            else []
        )
        # As many of the keys (a prefix: the rest is of no use without it) as the host has room
        # for; halving costs O(log n) refusals, each O(1) when nothing is evictable.
        n = len(keys)
        out = self.host.prepare_store([*scan, *keys], ctx)
        while out is None and n > 1:
            n //= 2
            out = self.host.prepare_store([*scan, *keys[:n]], ctx)
        if out is None:
            n = 0
        if n < len(keys):
            for key in keys[n:]:
                promoting.pop(key, None)
            state.failed.update(keys[n:])
            self._counters["refused_promotion_blocks"] += len(keys) - n
            keys = keys[:n]
            if out is None:
                return
        if out.evicted_keys:
            self._host_evicted(out.evicted_keys)
        # Every scan key is held, so only promotion keys are stored (those a device store did not
        # bring in meanwhile and the policy admitted).
        promoted = out.keys_to_store
        slots = out.store_spec.block_ids  # type: ignore[attr-defined]
        wanted = set(keys)
        declined = wanted.difference(promoted)
        if declined:
            host_lookup = self.host.lookup
            for key in declined:
                promoting.pop(key, None)
                if host_lookup(key, ctx) is _MISS:  # not admitted; else a device store won
                    state.failed.add(key)
                    self._counters["refused_promotion_blocks"] += 1
        if not promoted:
            return
        job_id = self._new_job(_BackgroundJob(tier, promoted, ctx, promotion=True))
        for key in promoted:
            promoting[key] = job_id
        self.tiers[tier].submit_load(TierJob(job_id, promoted, slots), ctx)

    def _cascade_dirty(self) -> None:
        """``on_evict``: cascade the oldest dirty blocks while the host has less free room than
        its headroom."""
        host = self.host
        free = host.num_blocks - len(host.policy)
        n = self._headroom - free
        if n <= 0:
            return
        dirty = self._dirty
        batch = []
        for key in dirty:
            batch.append(key)
            if len(batch) >= n:
                break
        for key in batch:
            del dirty[key]
        self._queue_cascade(batch, self._all_tiers, None)

    def _new_job(self, job: _BackgroundJob) -> int:
        job_id = self._next_job
        self._next_job += 1
        self._jobs[job_id] = job
        return job_id

    def num_background_jobs(self) -> int:
        queued = self._num_queued > 0 or any(k for k, _ in self._cascade_queue)
        return len(self._jobs) + int(queued)

    def drain(self) -> None:
        """Block until every tier job finished, and apply the results."""
        self.step_end()
        for tier in self.tiers:
            tier.drain_jobs()
        self.step_begin()

    # ------------------------------------------------------------------ the rest

    def take_events(self) -> list[OffloadingEvent]:
        events = self.host.take_events()
        for tier in self.tiers:
            more = tier.take_events()
            if more:
                events = [*events, *more]
        return events

    def request_finished(self, ctx: ReqContext) -> None:
        if self._promotion_pins:
            self._unpin_promoted(ctx)
        self.host.request_finished(ctx)
        for tier in self.tiers:
            tier.request_finished(ctx)
        ctx.pop_state(_RequestTiers)

    def reset(self) -> None:
        """Drop every block of every tier; background jobs finish first (their results are
        discarded), so no tier still writes into a host slot afterwards."""
        for tier in self.tiers:
            tier.drain_jobs()
            tier.get_finished_jobs()
            tier.reset()
        self._jobs.clear()
        self._promoting.clear()
        self._promote_queue = [{} for _ in self.tiers]
        self._num_queued = 0
        self._promotion_pins.clear()
        self._cascade_queue = [([], []) for _ in self.tiers]
        self._dirty.clear()
        self._promoted_from.clear()
        self.host.reset()

    def stats(self) -> dict[str, int]:
        out = dict(self.host.stats())
        out.update(self._counters)
        out["promotions_in_flight"] = len(self._promoting)
        out["pinned_promoted_blocks"] = sum(map(len, self._promotion_pins.values()))
        for name, tier in zip(self.tier_names, self.tiers, strict=True):
            for stat, value in tier.stats().items():
                out[f"{name}_{stat}"] = value
        return out

    def tier_stats(self) -> dict[str, dict[str, int]]:
        out = {"host": self.host.stats()}
        for name, tier in zip(self.tier_names, self.tiers, strict=True):
            out[name] = tier.stats()
        return out

    def close(self) -> None:
        """Finish background jobs and close the tiers."""
        for tier in self.tiers:
            tier.close()

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if host pins or promotion records disagree (tests only)."""
        self.host.check_invariants()
        for key, job_id in self._promoting.items():
            block = self.host.policy.get(key)
            if job_id != _QUEUED:  # a queued one may meet a device store of the same block
                assert block is not None and block.ref_cnt < 0, (
                    f"{key.hex()}: promotion in flight but its host slot is not pending"
                )
                assert job_id in self._jobs, f"{key.hex()}: promotion job {job_id} unknown"
        queued = sum(len(keys) for queue in self._promote_queue for keys in queue.values())
        assert self._num_queued == queued, f"{self._num_queued} promotions counted, {queued} queued"
        for ctx, keys in self._promotion_pins.items():
            assert ctx.get_state(_RequestTiers) is not None, f"{ctx.req_id} ended but pins blocks"
            for key in keys:
                block = self.host.policy.get(key)
                assert block is not None and block.ref_cnt > 0, (
                    f"{key.hex()}: promoted for {ctx.req_id} but not pinned in the host"
                )


#: The context of background work that belongs to no request (cascades).
_NO_REQUEST = ReqContext("<tiering>")

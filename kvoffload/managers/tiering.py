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
  the secondary tiers and counted in ``cascade_lost_blocks``); :mod:`~kvoffload.managers.cascade`.
* **Pins**: a host slot being read by a cascade is pinned (host ``pin``) until the
  tier's store reports; a slot being written by a promotion is pending in the host; a landed
  promotion is pinned for the request that asked for it until that request loads
  (:meth:`prepare_load`) or ends (:meth:`request_finished`). None of them is evicted.
* **No convoy**: a promotion serves whoever wants its blocks: a second request wanting a block
  being promoted waits for that same promotion (it would need the same I/O; it never starts a
  second copy). A request waiting for host room waits for transfers and for promotions of the
  requests ahead of it (lookups run in queue order). Every wait is bounded by the request's retry
  budget in the scheduler, after which it takes the prefix it has.
* **One step for a disk hit**: :meth:`await_promotions` (the scheduler calls it when a request's
  lookup pass answered ``RETRY``) submits the step's promotions at once and waits, at most
  ``promotion_wait_s``, for the request's to land; its next pass then answers ``HIT`` and the
  load follows in the same step. Past the bound it answers ``RETRY`` as before.
* **Stores within bounds**: at most ``max_in_flight`` cascade blocks per tier are being written;
  the rest wait unpinned and are shed if the host evicts them first; with ``min_reuse`` >= 2 a
  block is written only once that many requests saw it (:mod:`~kvoffload.managers.cascade`).
* **Per-request tiers**: ``kv_transfer_params["kv_load_tiers"]`` / ``["kv_store_tiers"]`` list
  the secondary tier names a request may promote from / cascade to (default: all).

The parts, each in its module: promotions (:mod:`~kvoffload.managers.promotion`), the cascade
strategies and their queue (:mod:`~kvoffload.managers.cascade`), background jobs and their
results (:mod:`~kvoffload.managers.tier_jobs`), per-request tier state
(:mod:`~kvoffload.managers.tier_requests`). This class answers the contract and sequences them.

Background work is batched per step: lookups and completed host stores only queue jobs, which
are submitted once per step (one job per tier and request); :meth:`step_begin` and the
submission apply the tiers' finished jobs (never blocking). Events: the host's (medium ``CPU``)
and each tier's (``STORAGE`` with its locality), in that order.
"""

from __future__ import annotations

import time
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
from kvoffload.managers.cascade import CASCADE_MODES, CASCADES, Cascade, CascadeQueue
from kvoffload.managers.cpu import CPUOffloadingManager
from kvoffload.managers.promotion import Promotions
from kvoffload.managers.reuse import ReuseCounts
from kvoffload.managers.tier_jobs import BackgroundJobs
from kvoffload.managers.tier_requests import RequestTiers, validate_tier_params
from kvoffload.tiers.contract import SecondaryTier

__all__ = ["CASCADE_MODES", "TieringOffloadingManager", "validate_tier_params"]

_MISS = LookupResult.MISS
_HIT = LookupResult.HIT
_HIT_PENDING = LookupResult.HIT_PENDING
_RETRY = LookupResult.RETRY


class TieringOffloadingManager(OffloadingManager):
    """Host tier + secondary tiers behind one :class:`OffloadingManager` (module docstring).

    Its parts: :class:`~kvoffload.managers.promotion.Promotions`, a cascade strategy
    (:class:`~kvoffload.managers.cascade.Cascade`) feeding a
    :class:`~kvoffload.managers.cascade.CascadeQueue`, and the
    :class:`~kvoffload.managers.tier_jobs.BackgroundJobs` both submit to the tiers.

    Counters (:meth:`stats`): the host's, unprefixed; per tier ``<name>_<counter>``; and
    ``promoted_blocks``, ``failed_promotion_blocks``, ``refused_promotion_blocks`` (no host room),
    ``cascaded_blocks``, ``failed_cascade_blocks``, ``cascade_lost_blocks``, ``retry_answers``,
    ``room_waits`` (``RETRY`` answers waiting for host room), ``promotion_jobs`` and
    ``promotion_us`` (microseconds from submission to the result, summed),
    ``shed_cascade_blocks`` (never written: the tier fell behind), ``skipped_cascade_blocks``
    (never written: not reused), ``awaited_promotions`` / ``awaited_promotions_landed`` (waits of
    :meth:`await_promotions` / those whose promotions landed in time); gauges
    ``promotions_in_flight``, ``pinned_promoted_blocks``, ``cascade_backlog_blocks`` and
    ``cascade_in_flight_blocks``.

    Bounds: ``max_in_flight`` cascade blocks being written per tier (``None``: half the host's
    capacity, at least 1; 0 sheds every cascade); ``min_reuse`` distinct requests must have seen
    a block before it is written through (1: every block); ``promotion_wait_s`` seconds at most
    that :meth:`await_promotions` waits (0: never; a disk hit then loads a step later).
    """

    medium = "CPU"

    def __init__(
        self,
        host: CPUOffloadingManager,
        tiers: Sequence[SecondaryTier],
        cascade: str = "write_through",
        evict_headroom: float = 0.125,
        *,
        max_in_flight: int | None = None,
        min_reuse: int = 1,
        promotion_wait_s: float = 0.02,
    ) -> None:
        strategy = CASCADES.get(cascade)
        if strategy is None:
            raise ConfigError(
                "kv_tier_cascade", f"unknown mode {cascade!r}; choose from {list(CASCADE_MODES)}"
            )
        if max_in_flight is None:
            max_in_flight = max(1, host.num_blocks // 2)
        if (
            isinstance(max_in_flight, bool)
            or not isinstance(max_in_flight, int)
            or max_in_flight < 0
        ):
            raise ConfigError(
                "kv_tier_write_max_in_flight", f"must be an integer >= 0, got {max_in_flight!r}"
            )
        if isinstance(min_reuse, bool) or not isinstance(min_reuse, int) or min_reuse < 1:
            raise ConfigError(
                "kv_tier_write_min_reuse", f"must be an integer >= 1, got {min_reuse!r}"
            )
        if not isinstance(promotion_wait_s, (int, float)) or not 0 <= promotion_wait_s <= 60:
            raise ConfigError(
                "kv_promotion_wait_s", f"must be seconds in [0, 60], got {promotion_wait_s!r}"
            )
        names = [t.name for t in tiers]
        if len(set(names)) != len(names):
            raise ConfigError("secondary_tiers", f"tier names must be unique, got {names}")
        self.host = host
        self.tiers = list(tiers)
        self.tier_names = names
        self._every_tier = list(range(len(names)))  # the tiers of requests that do not choose
        self._step = 0
        self._jobs = BackgroundJobs(self.tiers)
        self._promotions = Promotions(host, self.tiers, self._jobs, self._host_evicted)
        self._in_flight = self._promotions.in_flight  # read per lookup (never replaced)
        self._cascade_queue = CascadeQueue(host, self.tiers, self._jobs, max_in_flight)
        #: how many requests saw each block: only kept when writes wait for reuse
        self._reuse = ReuseCounts(max(64_000, 4 * host.num_blocks)) if min_reuse > 1 else None
        #: the cascade strategy (``cascade.name`` is the mode)
        self.cascade: Cascade = strategy(
            self._cascade_queue, host, evict_headroom, self._reuse, min_reuse
        )
        self._promotion_wait_s = float(promotion_wait_s)
        self._awaited = [0, 0]  # await_promotions calls that waited, and those that landed
        self._wait_step = -1  # the step whose wait budget ends at _wait_deadline
        self._wait_deadline = 0.0
        self._retry_answers = 0
        #: this step's keys a tier answered RETRY (its server asked): ctx -> [(tier, key)]
        self._asked: dict[ReqContext, list[tuple[int, OffloadKey]]] = {}

    def _state(self, ctx: ReqContext) -> RequestTiers:
        """The request's :class:`RequestTiers` (read first: this runs per lookup)."""
        state = ctx.get_state(RequestTiers)
        if state is not None:
            return state
        return ctx.setdefault_state(
            RequestTiers, RequestTiers.of, ctx, self.tier_names, self._every_tier
        )

    # ------------------------------------------------------------------ lookups and loads

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        reuse = self._reuse
        if reuse is not None:
            reuse.record((key,), ctx)
        # The host's answer read from its block record (one dict lookup: the record also says
        # whether the block is evictable).
        block = self.host.policy.get(key)
        if block is not None and block.ref_cnt >= 0:  # a host HIT
            if reuse is not None:
                self.cascade.reused(key)  # a cold block seen again may be worth writing now
            state = self._state(ctx)
            if state.scan_step != self._step:
                state.begin_scan(self._step)
            state.scan.append(key)
            if not block.ref_cnt:
                state.scan_evictable += 1
            return _HIT
        if key in self._in_flight:  # being promoted (for this request or another)
            self._retry_answers += 1
            return _RETRY
        if block is not None:  # being written into the host
            return _HIT_PENDING
        state = self._state(ctx)
        if key in state.failed:
            return _MISS
        # The first secondary tier the request may load from that holds the block gets it
        # promoted, room permitting.
        tiers, promotions = self.tiers, self._promotions
        for i in state.load_tiers:
            answer = tiers[i].lookup(key, ctx)
            if answer is _HIT:
                if promotions.room(state, self._step) > 0:
                    promotions.queue(i, ctx, key)
                elif not promotions.must_wait_for_room(ctx):
                    return _MISS
                self._retry_answers += 1
                return _RETRY
            if answer is _RETRY:
                self._asked.setdefault(ctx, []).append((i, key))
                self._retry_answers += 1
                return _RETRY
        return _MISS

    def _promote_answered(self) -> None:
        """Promote this step's tier hits that were ``RETRY`` during the lookups (the tier had
        to ask its server): each such tier waits, within its own bound, for the answers; then
        every request's leading run of answered hits is queued for promotion (room
        permitting), so it starts this step rather than at the request's next lookup."""
        asked, self._asked = self._asked, {}
        for i in {i for pairs in asked.values() for i, _ in pairs}:
            self.tiers[i].wait_for_answers()
        held, promotions = self.host.policy.get, self._promotions
        for ctx, pairs in asked.items():
            state = ctx.get_state(RequestTiers)
            if state is None:  # ended since
                continue
            for i, key in pairs:
                if key in self._in_flight or held(key) is not None:
                    continue
                if key in state.failed or self.tiers[i].lookup(key, ctx) is not _HIT:
                    break
                if promotions.room(state, self._step) <= 0:
                    break
                promotions.queue(i, ctx, key)

    def await_promotions(self, ctx: ReqContext) -> bool:
        """Submit this step's promotions now and wait for ``ctx``'s to land (applying every
        finished tier job meanwhile), within ``promotion_wait_s`` for all the step's waits
        together (so a step of many disk hits stalls no longer than one). Returns whether ``ctx``
        had promotions and all of them finished: its next lookup pass then answers ``HIT`` for
        the landed blocks (pinned for it) and ``MISS`` for failed ones, so the disk hit loads in
        the step it was found. Called by the scheduler after a lookup pass that answered
        ``RETRY``; other requests' promotions are submitted too, never waited for. It sleeps
        until a tier has a result to report (the tiers' shared ``ResultSignal``), never polls."""
        if self._promotion_wait_s <= 0:
            return False
        self._submit_promotions()
        jobs = self._jobs
        pending = jobs.ids_for(ctx)
        if not pending:
            return False
        self._awaited[0] += 1
        if self._wait_step != self._step:  # one budget per step, shared by its lookups
            self._wait_step = self._step
            self._wait_deadline = time.monotonic() + self._promotion_wait_s
        deadline, signal = self._wait_deadline, jobs.signal
        while True:
            seen = signal.count  # before taking the results: one made ready after wakes the wait
            jobs.apply_finished()
            if not any(job_id in jobs for job_id in pending):
                break
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            signal.wait_past(seen, left)  # until a tier has a result (any job's), or the bound
        self._awaited[1] += 1
        state = ctx.get_state(RequestTiers)
        if state is not None:
            state.scan_step = -1  # the next pass is a new scan of this step
        return True

    def holds(self, key: OffloadKey, ctx: ReqContext) -> bool:
        """Whether the host holds ``key`` (stores go to the host). Asks no secondary tier, so it
        promotes nothing and counts nothing."""
        return self.host.policy.get(key) is not None

    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> LoadStoreSpec:
        try:
            return self.host.prepare_load(keys, ctx)
        finally:
            # The request's own load pins what it loads now; its promotion pins have served.
            if self._promotions.pins:
                self._promotions.unpin(ctx)

    def load_source(self, key: OffloadKey, ctx: ReqContext) -> str:
        """The tier a promotion brought ``key`` from, for its first load; else ``"host"``."""
        tier = self._promotions.source(key)
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
        if self._promotions.num_queued or self._asked:
            # This step's promotions take host room before its device stores do: a device store
            # refused only goes unoffloaded, a promotion refused is recomputed.
            self._submit_promotions()
        if self._reuse is not None:
            self._reuse.record(keys, ctx)
        out = self.host.prepare_store(keys, ctx)
        if out is not None and out.evicted_keys:
            self._host_evicted(out.evicted_keys)
        return out

    def complete_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True
    ) -> None:
        self.host.complete_store(keys, ctx, success)
        if success and self.tiers:
            self.cascade.stored(keys, self._state(ctx).store_tiers, ctx)

    def drop_host_evictable(self) -> list[OffloadKey]:
        """Remove every evictable host block now (an operator's clear; pinned ones stay), each
        forgotten as an evicted one; returns their keys."""
        dropped = self.host.drop_evictable()
        if dropped:
            self._host_evicted(dropped)
        return dropped

    def _host_evicted(self, evicted: Sequence[OffloadKey]) -> None:
        """Forget what the host no longer holds: promotion sources, blocks not cascaded yet."""
        self._promotions.forget(evicted)
        self.cascade.host_evicted(evicted)
        self._cascade_queue.host_evicted(evicted)

    # ------------------------------------------------------------------ per step

    def step_begin(self) -> None:
        """Apply the tiers' finished jobs: promotions become readable (or are freed), cascades
        unpin their host slots."""
        self._jobs.apply_finished()

    def step_end(self) -> None:
        self._submit_promotions()
        self._step += 1
        self.cascade.step_end()
        self._cascade_queue.submit()

    def _submit_promotions(self) -> None:
        # Jobs that finished during the step unpin their host slots first, so the promotions
        # find the room the cascades held.
        self._jobs.apply_finished()
        if self._asked:
            self._promote_answered()
        self._promotions.submit(self._step)

    def num_background_jobs(self) -> int:
        queued = self._promotions.num_queued > 0 or bool(self._cascade_queue)
        return len(self._jobs) + int(queued)

    def drain(self) -> None:
        """Block until every tier job finished, and apply the results."""
        self.step_end()
        for tier in self.tiers:
            tier.drain_jobs()
        self.step_begin()
        queue = self._cascade_queue
        while queue:  # writes beyond the bound waited: each round submits some (bounded)
            queue.submit()
            for tier in self.tiers:
                tier.drain_jobs()
            self._jobs.apply_finished()

    # ------------------------------------------------------------------ the rest

    def take_events(self) -> list[OffloadingEvent]:
        events = self.host.take_events()
        for tier in self.tiers:
            more = tier.take_events()
            if more:
                events = [*events, *more]
        return events

    def request_finished(self, ctx: ReqContext) -> None:
        if self._promotions.pins:
            self._promotions.unpin(ctx)
        self.host.request_finished(ctx)
        for tier in self.tiers:
            tier.request_finished(ctx)
        ctx.pop_state(RequestTiers)
        if self._reuse is not None:
            self._reuse.forget(ctx)

    def reset(self) -> None:
        """Drop every block of every tier; background jobs finish first (their results are
        discarded), so no tier still writes into a host slot afterwards."""
        for tier in self.tiers:
            tier.drain_jobs()
            tier.get_finished_jobs()
            tier.reset()
        self._jobs.clear()
        self._asked.clear()
        self._promotions.reset()
        self._cascade_queue.reset()
        self.cascade.reset()
        self.host.reset()

    def stats(self) -> dict[str, int]:
        promotions, queue = self._promotions, self._cascade_queue
        out = dict(self.host.stats())
        out.update(
            promoted_blocks=promotions.promoted_blocks,
            failed_promotion_blocks=promotions.failed_promotion_blocks,
            refused_promotion_blocks=promotions.refused_promotion_blocks,
            cascaded_blocks=queue.cascaded_blocks,
            failed_cascade_blocks=queue.failed_cascade_blocks,
            cascade_lost_blocks=self.cascade.cascade_lost_blocks,
            retry_answers=self._retry_answers,
            room_waits=promotions.room_waits,
            promotion_jobs=promotions.promotion_jobs,
            promotion_us=promotions.promotion_us,
            promotions_in_flight=len(promotions.in_flight),
            pinned_promoted_blocks=sum(map(len, promotions.pins.values())),
            shed_cascade_blocks=queue.shed_cascade_blocks,
            skipped_cascade_blocks=self.cascade.skipped_cascade_blocks,
            cascade_backlog_blocks=queue.backlog_blocks,
            cascade_in_flight_blocks=queue.in_flight_blocks,
            awaited_promotions=self._awaited[0],
            awaited_promotions_landed=self._awaited[1],
        )
        for name, stats in self._secondary_stats().items():
            for stat, value in stats.items():
                out[f"{name}_{stat}"] = value
        return out

    def _secondary_stats(self) -> dict[str, dict[str, int]]:
        """Each secondary tier's stats with its promotions' and cascades' counters."""
        promotions, queue = self._promotions, self._cascade_queue
        return {
            name: {**tier.stats(), **promotions.tier_stats(i), **queue.tier_stats(i)}
            for i, (name, tier) in enumerate(zip(self.tier_names, self.tiers, strict=True))
        }

    def tier_stats(self) -> dict[str, dict[str, int]]:
        """The host's stats and each secondary tier's, with its promotions' jobs, blocks and
        microseconds (``promotion_jobs``, ``promotion_blocks``, ``promotion_us``) and its
        cascades' ``shed_store_blocks``, ``cascade_backlog_blocks``,
        ``cascade_in_flight_blocks``."""
        return {"host": self.host.stats(), **self._secondary_stats()}

    def close(self) -> None:
        """Finish background jobs and close the tiers."""
        for tier in self.tiers:
            tier.close()

    def check_invariants(self) -> None:
        """Raise ``AssertionError`` if host pins or promotion records disagree (tests only)."""
        self.host.check_invariants()
        self._promotions.check_invariants()

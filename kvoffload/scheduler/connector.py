"""The scheduler-side offloading connector: the engine protocol, request lifecycle and
completions. Hit search (``lookup.py``), load and store planning (``loads.py``, ``stores.py``),
the reuse fence (``fence.py``), retried final offers (``retries.py``) and its counters
(``counters.py``) are its parts.

Engine protocol, per request (modelled on vLLM's KV connector):

1. ``get_num_new_matched_tokens(request, num_computed_tokens)`` before allocating: how many
   tokens beyond the engine's own prefix-cache hit can be loaded.
2. ``update_state_after_alloc(request, block_ids, num_external_tokens)`` once blocks are
   allocated: plans the load (the request waits until its load completes).
3. Every step ``build_connector_meta(scheduler_output)``: this step's loads and stores, for the
   worker side; after the step ``update_connector_output(results)``.
4. ``request_finished(request)`` once: says whether the engine must keep the request's blocks
   (transfers still read or write them) until ``update_connector_output`` lists it as freed.

Design choices where vLLM has known problems:

* **No convoy** (vLLM #44294). A request never waits for another request's transfer: blocks
  being loaded for another request are ready in the tier, so it loads them too (the tier counts
  concurrent readers); blocks still being written (``HIT_PENDING``) end the hit, and the rest is
  recomputed. With a tiering manager a lookup may answer ``RETRY`` (a block is being promoted
  from a secondary tier into the host): ``get_num_new_matched_tokens`` then answers ``None`` and
  the engine asks again next step, until ``max_lookup_retry_s`` and
  ``min_lookup_retries`` asks have both passed for the request; then it takes the prefix it has
  (``retry_timeouts``).
* **Only loads that pay** (``load_policy``, :mod:`~kvoffload.scheduler.costs`): under ``auto``
  the answer is the prefix of the hit whose load is cheaper than computing it, by measured costs
  (the decision is folded into the lookup loop, :class:`~kvoffload.scheduler.lookup.HitSearch`);
  a request whose paying prefix is ready does not wait for promotions behind it.
* **Failures degrade** (vLLM #52838). A failed load is reported in ``ConnectorUpdate.failed_loads``
  and the engine recomputes; a failed store frees what it prepared. Nothing asserts on a result.
* **Blocks in use by a transfer are never reused**: ``request_finished`` asks the engine to keep
  blocks while any of the request's jobs is in flight, and a preempted request's in-flight jobs
  are flushed (``jobs_to_flush``) before the next forward pass may overwrite its blocks.
* A ``None`` from ``prepare_store`` stores the longest head of the offer that fits and re-offers
  the whole offer next step (``stores.py``). A finished request's refused offer is kept, its
  blocks held, and retried each step while other transfers are in flight, unless the engine
  needs the blocks first (``retries.py``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Sequence
from typing import Any

from kvoffload.errors import ConfigError, ContractError
from kvoffload.events.messages import BlockRemoved, BlockStored
from kvoffload.manager_contract import OffloadingManager, ReqContext
from kvoffload.scheduler.costs import LoadCosts
from kvoffload.scheduler.counters import ConnectorCounters
from kvoffload.scheduler.events import OffloadEventDescriber
from kvoffload.scheduler.fence import ReuseFence
from kvoffload.scheduler.interface import ConnectorUpdate, ScheduledRequest, SchedulerOutput
from kvoffload.scheduler.jobs import JobTable, PlannedJob
from kvoffload.scheduler.loads import LoadPlanner
from kvoffload.scheduler.lookup import HitSearch, may_wait
from kvoffload.scheduler.params import KV_TRANSFER_PARAMS, parse_kv_transfer_params
from kvoffload.scheduler.policy import STORE_POLICIES, OffloadPolicy
from kvoffload.scheduler.retries import FinishedStoreRetries
from kvoffload.scheduler.state import OffloadRequest, RequestKVState, SchedulerOffloadConfig
from kvoffload.scheduler.stores import StorePlanner
from kvoffload.transfer import ConnectorMetadata, TransferJob, TransferResult

__all__ = ["KV_TRANSFER_PARAMS", "OffloadingConnectorScheduler", "parse_kv_transfer_params"]

logger = logging.getLogger(__name__)

#: Steps between two reads of the secondary tiers' promotion times (``tier_stats`` asks every
#: tier for its counters: not per step).
PROMOTION_POLL_STEPS = 16


class OffloadingConnectorScheduler:
    """Scheduler-side half of the offloading connector (see the module docstring).

    ``events``: when given (and the manager collects events), :meth:`take_events` returns
    self-describing ``BlockStored``/``BlockRemoved`` events for the tier.

    ``costs``: the estimates ``load_policy="auto"`` weighs (:mod:`~kvoffload.scheduler.costs`);
    made here when not given. The connector feeds it the load jobs' copy times and, every
    :data:`PROMOTION_POLL_STEPS` steps, the secondary tiers' promotion times; the engine feeds it
    its steps (:meth:`LoadCosts.observe_step`).
    """

    def __init__(
        self,
        config: SchedulerOffloadConfig,
        manager: OffloadingManager,
        events: OffloadEventDescriber | None = None,
        costs: LoadCosts | None = None,
    ) -> None:
        if config.store_policy not in STORE_POLICIES:
            raise ConfigError(
                "store_policy",
                f"unknown store policy {config.store_policy!r}; choose from {sorted(STORE_POLICIES)}",
            )
        self.config = config
        self.manager = manager
        self._events = events
        self._policies: dict[str, OffloadPolicy] = {
            name: cls(config) for name, cls in STORE_POLICIES.items()
        }
        self._requests: dict[str, RequestKVState] = {}
        self._jobs = JobTable(config.num_workers)
        self._num_workers = config.num_workers
        # Accumulated until the next build_connector_meta:
        self._load_jobs: list[TransferJob] = []
        self._store_jobs: list[TransferJob] = []
        self._jobs_to_flush: list[int] = []
        self._failed_before_submit: list[str] = []
        self._dropped_jobs: list[int] = []  # made stale by reset() before being handed over
        self._counters = ConnectorCounters()
        self._fence = ReuseFence(config.groups)
        if costs is None:
            costs = LoadCosts(name for name in manager.tier_stats() if name != "host")
        self.costs = costs
        #: Seconds spent in ``await_promotions`` since the engine last took them
        #: (:meth:`take_awaited_s`): I/O waits, not compute, so a step's cost excludes them.
        self._awaited_s = 0.0
        self._steps_to_poll = 0
        self._hits = HitSearch(config, manager, costs)
        counts = self._counters.counts
        self._loads = LoadPlanner(
            config, manager, self._jobs, counts, self._counters.hit_tokens_by_source
        )
        self._stores = StorePlanner(config, manager, self._jobs, self._fence, events, counts)
        self._retries = FinishedStoreRetries(
            self._requests, self._jobs, self._plan_final_store, self._end_request
        )

    # ------------------------------------------------------------------ lookups and loads

    def _new_state(self, request: OffloadRequest) -> RequestKVState:
        params = request.kv_transfer_params
        policy, max_offload, max_load = parse_kv_transfer_params(params, self.config.store_policy)
        ctx = ReqContext(request.request_id, dict(params) if params else {})
        state = RequestKVState(self.config, request, ctx, policy, max_offload, max_load)
        self._requests[request.request_id] = state
        return state

    def get_num_new_matched_tokens(
        self, request: OffloadRequest, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        """Tokens beyond ``num_computed_tokens`` loadable from the tier, and whether to load async.

        Whole offloaded blocks only; never the last prompt token (the engine needs its logits).
        ``None`` when not known yet (a block answered ``RETRY``: being promoted from a secondary
        tier): the engine defers the request and asks again next step; once its retry budget is
        spent (``max_lookup_retry_s`` and ``min_lookup_retries``, both) the answer is the
        prefix that is ready. Touches the request's blocks in the tier once answered.
        """
        state = self._requests.get(request.request_id)
        if state is None:
            state = self._new_state(request)
        elif state.finished or state.request is not request:
            raise ContractError(
                f"request id {request.request_id!r} is still in use by a request whose transfers "
                "have not finished; a request id may only be reused once it was freed"
            )
        elif state.answered:  # re-admitted: its engine blocks will be allocated anew
            for group_state in state.group_states:
                group_state.block_ids.clear()
        state.update_offload_keys()
        state.num_locally_computed_tokens = num_computed_tokens
        self._counters.counts["lookups"] += 1
        wait = may_wait(state, self.config)
        if not wait:
            self._counters.counts["retry_timeouts"] += 1
        hit_end = self._hits.hit_end(state, num_computed_tokens, wait)
        if (hit_end is None or not wait) and self._events is not None:
            # Promotions for it (its lookup met blocks on a secondary tier): describe them.
            self._events.remember_request_blocks(state, num_computed_tokens)
        if hit_end is None:
            waited_from = time.perf_counter()
            landed = self.manager.await_promotions(state.req_context)
            self._awaited_s += time.perf_counter() - waited_from
            if landed:
                # Its promotions landed within the manager's wait: the hit loads in this step.
                hit_end = self._hits.hit_end(state, num_computed_tokens, wait)
        if hit_end is None:
            self._counters.counts["retries"] += 1
            return None, False
        state.retry_since = None
        if not state.answered:
            state.answered = True
            for group, group_state in zip(self.config.groups, state.group_states, strict=True):
                group_state.num_hit_blocks = (
                    max(hit_end, num_computed_tokens) // group.offloaded_block_size
                )
        self._hits.touch(state)
        num_hit = max(0, hit_end - num_computed_tokens)
        return num_hit, num_hit > 0

    def skip_lookup(self, request: OffloadRequest) -> bool:
        """The engine could not admit ``request`` now whatever its lookup answered: whether it
        may leave it unasked this step. Yes once its last lookup answered (not ``None``: one that
        waits on promotions is asked again); its blocks are then touched as a lookup touches
        them, so its hit ages in the tier as if asked. O(its blocks), no lookup."""
        state = self._requests.get(request.request_id)
        if state is None or state.request is not request or state.finished:
            return False
        if not state.answered or state.retry_since is not None:
            return False
        state.update_offload_keys()
        self._hits.touch(state)
        return True

    def num_held_blocks(self, request: OffloadRequest, first: int, end: int) -> int:
        """How many of the request's hash blocks ``first, first + 1, ...`` (below ``end``), a
        leading run, the tier holds: a pure probe for the engine's admission order
        (:meth:`~kvoffload.scheduler.lookup.HitSearch.num_held`)."""
        state = self._requests.get(request.request_id)
        return self._hits.num_held(
            request, state if state is None or state.request is request else None, first, end
        )

    def update_state_after_alloc(
        self, request: OffloadRequest, block_ids: Sequence[Sequence[int]], num_external_tokens: int
    ) -> None:
        """Record the request's engine block table and plan the load of its external tokens.

        ``block_ids[g]`` is the request's whole block table in group ``g`` after allocation.
        Block tables are recorded even when nothing is loaded (stores need them).
        """
        state = self._requests.get(request.request_id)
        if state is None:
            raise ContractError(
                f"update_state_after_alloc({request.request_id!r}) before get_num_new_matched_tokens"
            )
        for group_state, ids in zip(state.group_states, block_ids, strict=True):
            group_state.block_ids[:] = ids
            if ids and self._fence:
                self._fence.reallocated(ids, self._jobs_to_flush)
        if state.decision is not None:  # the engine acts on the lookup's answer
            self.costs.decided(state.decision)
            state.decision = None
        if num_external_tokens <= 0:
            return
        job = self._loads.plan(state, num_external_tokens)
        if job is None:
            # The hit vanished between lookup and allocation: recompute instead of loading.
            logger.warning(
                "request %s: offloaded blocks vanished before their load; recomputing",
                request.request_id,
            )
            self._failed_before_submit.append(request.request_id)
            return
        self._load_jobs.append(job)
        end = state.num_locally_computed_tokens + num_external_tokens
        self._policies[state.store_policy].on_blocks_loaded(request.request_id, end)

    # ------------------------------------------------------------------ stores

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata:
        """Plan this step's stores and hand over every job planned since the last call."""
        requests, policies, plan = self._requests, self._policies, self._stores.plan
        store_jobs = self._store_jobs
        self._stores.begin_step()
        for scheduled in scheduler_output.scheduled:
            request = scheduled.request
            state = requests.get(request.request_id)
            if state is None:
                continue
            new_ids = scheduled.new_block_ids
            if new_ids and (scheduled.resumed or any(new_ids)):
                self._record_new_blocks(state, scheduled)
            state.update_offload_keys()
            computed = request.num_computed_tokens + scheduled.num_scheduled_tokens
            policy = policies[state.store_policy]
            jobs, _ = plan(state, policy, min(computed, request.num_tokens))
            store_jobs.extend(jobs)
        if self._retries:
            self._retries.retry(store_jobs)
        flush = self._jobs_to_flush
        for req_id in scheduler_output.preempted_req_ids:
            state = requests.get(req_id)
            if state is not None and state.transfer_jobs:
                flush.extend(state.transfer_jobs)
        meta = ConnectorMetadata(self._load_jobs, store_jobs, flush)
        self._load_jobs, self._store_jobs, self._jobs_to_flush = [], [], []
        self.manager.step_end()
        return meta

    def _record_new_blocks(self, state: RequestKVState, scheduled: ScheduledRequest) -> None:
        """Extend (or, for a resumed request, replace) the request's block tables; a block
        reallocated while a store still reads it flushes that store."""
        fence = self._fence
        for group_state, ids in zip(state.group_states, scheduled.new_block_ids, strict=True):
            if scheduled.resumed:
                group_state.block_ids[:] = ids
            elif ids:
                group_state.block_ids.extend(ids)
            if ids and fence:
                fence.reallocated(ids, self._jobs_to_flush)

    def _plan_final_store(
        self, state: RequestKVState, num_tokens: int
    ) -> tuple[list[TransferJob], int]:
        """Plan a finished request's last stores (``on_finish`` policies offer everything)."""
        policy = self._policies[state.store_policy]
        return self._stores.plan(state, policy, num_tokens, finished=True)

    # ------------------------------------------------------------------ completions

    def update_connector_output(self, results: Iterable[TransferResult]) -> ConnectorUpdate:
        """Apply worker results; a job completes when all ``num_workers`` workers reported it."""
        self.manager.step_begin()
        update = ConnectorUpdate()
        if self._retries.freed:
            update.freed.extend(self._retries.take_freed())
        if self._failed_before_submit:
            update.failed_loads.extend(self._failed_before_submit)
            self._failed_before_submit = []
        jobs, counters = self._jobs, self._counters
        if self.costs.tiers:
            self._poll_promotion_costs()
        if self._dropped_jobs:
            for job_id in self._dropped_jobs:
                self._complete(jobs.pop(job_id), update)
            self._dropped_jobs = []
        for result in results:
            job = jobs.get(result.job_id)
            if job is None:
                logger.debug("ignoring result of unknown job %d", result.job_id)
                continue
            counters.result(job, result)
            if not job.is_store and result.success:
                self.costs.observe_load(result.seconds, len(job.keys) / self._num_workers)
            if not result.success:
                job.failed = True
            job.pending -= 1
            if job.pending > 0:
                continue
            del jobs[result.job_id]
            self._complete(job, update)
        return update

    def _poll_promotion_costs(self) -> None:
        """Every :data:`PROMOTION_POLL_STEPS` steps, fold each secondary tier's promotions since
        the last poll into the cost estimates."""
        if self._steps_to_poll > 0:
            self._steps_to_poll -= 1
            return
        self._steps_to_poll = PROMOTION_POLL_STEPS - 1
        self.costs.fold_promotions(self.manager.tier_stats())

    def _complete(self, job: PlannedJob, update: ConnectorUpdate) -> None:
        """Every worker reported ``job``: tell the manager, then its request."""
        failed = job.failed or job.stale
        if job.fenced:
            self._fence.release(job)
        if job.is_store:
            self._stores.finished(len(job.keys))
        if not job.stale:
            if job.is_store:
                self.manager.complete_store(job.keys, job.ctx, success=not job.failed)
            else:
                self.manager.complete_load(job.keys, job.ctx)
        self._counters.completed(job, failed)
        if failed:
            self._log_failure(job)
        state = self._requests.get(job.req_id)
        if state is None:
            return
        state.transfer_jobs.discard(job.job_id)
        if not job.is_store and not state.finished:
            (update.failed_loads if failed else update.loaded).append(job.req_id)
        if state.finished and not state.transfer_jobs and job.req_id not in self._retries:
            del self._requests[job.req_id]
            update.freed.append(job.req_id)

    def _log_failure(self, job: PlannedJob) -> None:
        """A job failed (or went stale in a reset): its store is not announced; a failure is
        logged."""
        if job.is_store and self._events is not None:
            self._events.forget(job.keys)
        if job.failed:
            logger.warning(
                "request %s: %s of %d blocks failed; %s",
                job.req_id,
                "store" if job.is_store else "load",
                len(job.keys),
                "blocks not offloaded" if job.is_store else "recomputing",
            )

    # ------------------------------------------------------------------ finished requests

    def request_finished(self, request: OffloadRequest) -> tuple[bool, dict[str, Any] | None]:
        """The request ended (finished or aborted). Returns ``(delay_free, params)``.

        Plans the request's final stores (``on_finish`` policies store everything now). An offer
        the tier refuses while other transfers are in flight is kept and retried every step
        (:mod:`~kvoffload.scheduler.retries`); only when it is given up are the policy and the
        manager told the request finished. ``delay_free`` is True while any of its jobs is in
        flight or its offer is kept: the engine must keep its blocks until a later
        ``update_connector_output`` lists the request in ``freed``.
        """
        req_id = request.request_id
        state = self._requests.get(req_id)
        if state is None:
            return False, None
        state.finished = True
        jobs, missing = self._plan_final_store(state, request.num_computed_tokens)
        self._store_jobs.extend(jobs)
        if missing and self._jobs:
            self._retries.keep(req_id, request.num_computed_tokens, missing)
            return True, None
        self._end_request(state)
        if state.transfer_jobs:
            return True, None
        del self._requests[req_id]
        return False, None

    def _end_request(self, state: RequestKVState) -> None:
        """Nothing more is offered for this finished request: tell its policy and the manager."""
        self._policies[state.store_policy].request_finished(state.req_context.req_id)
        self.manager.request_finished(state.req_context)

    @property
    def has_store_retries(self) -> bool:
        """Whether finished requests' blocks are kept for offers the tier refused."""
        return bool(self._retries)

    def abandon_store_retries(self) -> list[str]:
        """The engine needs blocks: stop retrying finished requests' refused offers.

        Returns the requests whose blocks may be freed now; the others (a store still reading
        their blocks) come in ``ConnectorUpdate.freed`` when their transfers end.
        """
        return self._retries.abandon()

    # ------------------------------------------------------------------ misc

    def has_pending_jobs(self) -> bool:
        """True while any job is planned or in flight (the engine must keep stepping)."""
        return bool(
            self._jobs
            or self._store_jobs
            or self._load_jobs
            or self._failed_before_submit
            or self._retries
            or self._retries.freed
            or self.manager.num_background_jobs()
        )

    def reset(self) -> None:
        """Empty the tier. Jobs in flight are flushed next step and their results ignored by the
        manager (their loads count as failed: those requests recompute). Jobs planned but not yet
        handed to the worker are dropped (their host slots belong to the emptied tier now) and
        complete as failed at the next :meth:`update_connector_output`."""
        unsent = {job.job_id for job in (*self._load_jobs, *self._store_jobs)}
        self._load_jobs, self._store_jobs = [], []
        for job_id, job in self._jobs.items():
            if job.stale:  # an earlier reset already dropped it or queued its flush
                continue
            job.stale = True
            (self._dropped_jobs if job_id in unsent else self._jobs_to_flush).append(job_id)
            if job.is_store and self._events is not None:
                self._events.forget(job.keys)
        self.manager.reset()
        for policy in self._policies.values():
            policy.reset()

    def take_events(self) -> list[BlockStored | BlockRemoved]:
        """The tier's KV events since the last call (empty unless ``events`` was given)."""
        events = self.manager.take_events()
        if self._events is None or not events:
            return []
        return self._events.convert(events)

    def take_awaited_s(self) -> float:
        """Seconds this scheduler waited for promotions (``await_promotions``) since the last
        call; the engine leaves them out of the step time it fits compute costs to."""
        awaited, self._awaited_s = self._awaited_s, 0.0
        return awaited

    def stats(self) -> dict[str, float]:
        """Connector counters (:meth:`~kvoffload.scheduler.counters.ConnectorCounters.stats`)
        plus ``recomputed_by_choice_tokens_<tier>``, the cost estimates, the gauges
        ``live_requests``, ``jobs_in_flight`` and ``stores_in_flight_blocks``, and the
        manager's stats prefixed ``tier_``."""
        out = self._counters.stats()
        for source, n in self._hits.recomputed_by_choice.items():
            out[f"recomputed_by_choice_tokens_{source}"] = n
        out.update(self.costs.snapshot(self.config.groups[0].offloaded_block_size))
        out["live_requests"] = len(self._requests)
        out["jobs_in_flight"] = len(self._jobs)
        out["stores_in_flight_blocks"] = self._stores.in_flight
        for name, value in self.manager.stats().items():
            out[f"tier_{name}"] = value
        return out

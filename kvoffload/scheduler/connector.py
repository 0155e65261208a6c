"""The scheduler-side offloading connector: hits, load jobs, store jobs and completions.

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
  the engine asks again next step, until ``max_lookup_retry_seconds`` and
  ``min_lookup_retries`` asks have both passed for the request; then it takes the prefix it has
  (``retry_timeouts``).
* **Failures degrade** (vLLM #52838). A failed load is reported in ``ConnectorUpdate.failed_loads``
  and the engine recomputes; a failed store frees what it prepared. Nothing asserts on a result.
* **Blocks in use by a transfer are never reused**: ``request_finished`` asks the engine to keep
  blocks while any of the request's jobs is in flight, and a preempted request's in-flight jobs
  are flushed (``jobs_to_flush``) before the next forward pass may overwrite its blocks.
* A ``None`` from ``prepare_store`` stores the longest head of the offer that fits and re-offers
  the whole offer next step (the policy rewinds; the stored head is skipped and protected). A
  finished request's refused offer is kept, its blocks held, and retried each step while other
  transfers are in flight, unless the engine needs the blocks first.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from kvoffload.base import (
    LoadStoreSpec,
    LookupResult,
    OffloadingManager,
    PrepareStoreOutput,
    ReqContext,
)
from kvoffload.errors import ConfigError, ContractError
from kvoffload.events.messages import KVCacheEvent
from kvoffload.keys import OffloadKey, offload_key_group, offload_key_hash
from kvoffload.mediums import GPULoadStoreSpec
from kvoffload.scheduler.events import OffloadEventDescriber
from kvoffload.scheduler.interface import ConnectorUpdate, SchedulerOutput
from kvoffload.scheduler.policy import STORE_POLICIES, OffloadPolicy
from kvoffload.scheduler.state import OffloadRequest, RequestKVState, SchedulerOffloadConfig
from kvoffload.transfer import ConnectorMetadata, TransferJob, TransferResult

__all__ = ["KV_TRANSFER_PARAMS", "OffloadingConnectorScheduler", "parse_kv_transfer_params"]

logger = logging.getLogger(__name__)

_HIT = LookupResult.HIT
_RETRY = LookupResult.RETRY


#: The ``kv_transfer_params`` keys the connector reads, and the type of each value.
KV_TRANSFER_PARAMS: dict[str, type] = {
    "store_policy": str,
    "max_offload_tokens": int,
    "max_load_tokens": int,
}


def parse_kv_transfer_params(
    params: Mapping[str, Any] | None, default_policy: str
) -> tuple[str, int | None, int | None]:
    """Validate a request's offloading parameters: ``(store_policy, max_offload_tokens, max_load_tokens)``.

    Recognised keys: ``store_policy`` (a name from ``STORE_POLICIES``), ``max_offload_tokens``
    (store at most the request's first that many tokens) and ``max_load_tokens`` (load at most
    that many tokens beyond the engine's own prefix-cache hit); non-negative ints.
    Other keys are left for other components. Bad values raise :class:`ConfigError`.
    """
    if params is None:
        return default_policy, None, None
    if not isinstance(params, Mapping):
        raise ConfigError("kv_transfer_params", f"must be a dict or None, got {params!r}")
    policy = params.get("store_policy", default_policy)
    # Not a str (a JSON list, say) would be unhashable: a TypeError instead of a ConfigError.
    if not isinstance(policy, str) or policy not in STORE_POLICIES:
        raise ConfigError(
            "kv_transfer_params.store_policy",
            f"unknown store policy {policy!r}; choose from {sorted(STORE_POLICIES)}",
        )
    caps: list[int | None] = []
    for name in (k for k, kind in KV_TRANSFER_PARAMS.items() if kind is int):
        value = params.get(name)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, int) or value < 0
        ):
            raise ConfigError(
                f"kv_transfer_params.{name}", f"must be a non-negative integer, got {value!r}"
            )
        caps.append(value)
    return policy, caps[0], caps[1]


class _Job:
    """A planned transfer until every worker has reported it."""

    __slots__ = (
        "ctx",
        "failed",
        "fenced",
        "is_store",
        "job_id",
        "keys",
        "pending",
        "req_id",
        "sources",
        "stale",
    )

    def __init__(
        self,
        job_id: int,
        req_id: str,
        ctx: ReqContext,
        keys: list[OffloadKey],
        is_store: bool,
        pending: int,
    ):
        self.job_id = job_id
        self.req_id = req_id
        self.ctx = ctx
        self.keys = keys
        self.is_store = is_store
        self.pending = pending  # workers yet to report
        self.failed = False
        self.stale = False  # started before a reset: the manager no longer knows its keys
        self.fenced: list[int] = []  # engine block ids registered in the reuse fence
        self.sources: dict[str, int] = {}  # a load's hit tokens by the tier that supplies them


class OffloadingConnectorScheduler:
    """Scheduler-side half of the offloading connector (see the module docstring).

    ``events``: when given (and the manager collects events), :meth:`take_events` returns
    self-describing ``BlockStored``/``BlockRemoved`` events for the tier.
    """

    def __init__(
        self,
        config: SchedulerOffloadConfig,
        manager: OffloadingManager,
        events: OffloadEventDescriber | None = None,
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
        self._jobs: dict[int, _Job] = {}
        self._next_job_id = 0
        # Accumulated until the next build_connector_meta:
        self._load_jobs: list[TransferJob] = []
        self._store_jobs: list[TransferJob] = []
        self._jobs_to_flush: list[int] = []
        self._failed_before_submit: list[str] = []
        self._dropped_jobs: list[int] = []  # made stale by reset() before being handed over
        # Finished requests whose final offer the tier refused: req id -> (offerable tokens,
        # fewest blocks of the offer left unstored by an attempt so far).
        self._store_retries: dict[str, tuple[int, int]] = {}
        self._freed_without_jobs: list[str] = []  # retries given up, for the next update.freed
        # Reuse fence: engine block id -> store jobs still reading it, for sliding-window groups,
        # whose blocks the engine may free while the request runs. Reallocating one flushes them.
        self._fence: dict[int, set[int]] = {}
        self._full_groups = [
            g for g, c in enumerate(config.groups) if c.sliding_window_blocks is None
        ]
        self._window_groups = [
            g for g, c in enumerate(config.groups) if c.sliding_window_blocks is not None
        ]
        self._counters = dict.fromkeys(
            (
                "lookups",
                "retries",
                "retry_timeouts",
                "hit_tokens",
                "load_jobs",
                "loaded_blocks",
                "failed_loads",
                "store_jobs",
                "stored_blocks",
                "failed_stores",
                "rejected_stores",
                "load_bytes",
                "store_bytes",
            ),
            0,
        )
        self._transfer_seconds = {"load": 0.0, "store": 0.0}
        # hit_tokens split by load_source(); the failed part fell back to recompute
        self._hit_tokens_by_source: dict[str, int] = {}
        self._failed_load_tokens_by_source: dict[str, int] = {}

    # ------------------------------------------------------------------ requests

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
        spent (``max_lookup_retry_seconds`` and ``min_lookup_retries``, both) the answer is the
        prefix that is ready. Touches
        the request's blocks in the tier once answered.
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
        self._counters["lookups"] += 1
        hit_end = self._lookup(state, num_computed_tokens, wait=self._may_wait(state))
        if hit_end is None:
            self._counters["retries"] += 1
            return None, False
        state.retry_since = None
        if not state.answered:
            state.answered = True
            for group, group_state in zip(self.config.groups, state.group_states, strict=True):
                group_state.num_hit_blocks = (
                    max(hit_end, num_computed_tokens) // group.offloaded_block_size
                )
        self._touch(state)
        num_hit = max(0, hit_end - num_computed_tokens)
        return num_hit, num_hit > 0

    def _may_wait(self, state: RequestKVState) -> bool:
        """Whether a ``RETRY`` may still defer the request (its retry budget is not spent)."""
        now = time.monotonic()
        if state.retry_since is None:
            state.retry_since, state.retry_count = now, 0
            return True
        state.retry_count += 1
        config = self.config
        if (
            state.retry_count <= config.min_lookup_retries
            or now - state.retry_since <= config.max_lookup_retry_seconds
        ):
            return True
        self._counters["retry_timeouts"] += 1
        return False

    def _lookup(self, state: RequestKVState, num_computed: int, wait: bool = True) -> int | None:
        """The token index up to which the request can be served from engine + tier, or ``None``
        when a block of the full-attention prefix answered ``RETRY`` and ``wait`` is set (the
        scan goes on past it, so the tier sees every block it may prepare at once)."""
        bound = state.request.num_tokens - 1
        if state.max_load_tokens is not None:
            bound = min(bound, num_computed + state.max_load_tokens)
        align = self.config.load_alignment
        end = bound // align * align
        if end <= num_computed:
            return num_computed
        lookup, ctx, groups = self.manager.lookup, state.req_context, self.config.groups
        for g in self._full_groups:
            obs = groups[g].offloaded_block_size
            keys = state.group_states[g].offload_keys
            i = num_computed // obs
            last = min(end // obs, len(keys))
            retry = False
            while i < last:
                answer = lookup(keys[i], ctx)
                if answer is not _HIT:
                    if answer is not _RETRY or not wait:
                        break
                    retry = True
                i += 1
            if retry:
                return None
            end = min(end, i * obs) // align * align
            if end <= num_computed:
                return num_computed
        changed = bool(self._window_groups)
        while changed:  # a window group's answer lowers the bound; re-check all window groups
            changed = False
            for g in self._window_groups:
                group = groups[g]
                obs = group.offloaded_block_size
                hit_blocks = self._window_hit(
                    state, g, num_computed // obs, end // obs, group.sliding_window_blocks or 0
                )
                if hit_blocks * obs < end:
                    end = hit_blocks * obs // align * align
                    changed = True
                    if end <= num_computed:
                        return num_computed
        return end

    def _window_hit(self, state: RequestKVState, g: int, first: int, last: int, window: int) -> int:
        """Largest ``L <= last`` whose needed blocks ``[max(first, L - window), L)`` are all HIT."""
        keys = state.group_states[g].offload_keys
        last = min(last, len(keys))
        lookup, ctx = self.manager.lookup, state.req_context
        candidate = last
        i = last - 1
        while i >= first:
            if lookup(keys[i], ctx) is _HIT:
                if candidate - i >= window or i == first:
                    return candidate
            else:
                candidate = i
            i -= 1
        return first

    def _touch(self, state: RequestKVState) -> None:
        touch, ctx = self.manager.touch, state.req_context
        for group, group_state in zip(self.config.groups, state.group_states, strict=True):
            keys = group_state.offload_keys
            if not keys:
                continue
            if group.sliding_window_blocks is None:
                touch(keys, ctx)
            else:
                touch(keys[max(0, group_state.num_hit_blocks - group.sliding_window_blocks) :], ctx)

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
            if self._fence:
                self._check_fence(ids)
        if num_external_tokens <= 0:
            return
        start = state.num_locally_computed_tokens
        end = start + num_external_tokens
        keys: list[OffloadKey] = []
        engine_ids: list[int] = []
        group_sizes: list[int] = []
        block_indices: list[int] = []
        for group, group_state in zip(self.config.groups, state.group_states, strict=True):
            obs, factor = group.offloaded_block_size, group.block_size_factor
            first_block, last_block = start // obs, end // obs
            if group.sliding_window_blocks is not None:
                first_block = max(first_block, last_block - group.sliding_window_blocks)
            first_engine = max(start // group.engine_block_size, first_block * factor)
            ids = group_state.block_ids[first_engine : last_block * factor]
            keys.extend(group_state.offload_keys[first_block:last_block])
            engine_ids.extend(ids)
            group_sizes.append(len(ids))
            block_indices.append(first_engine)
        try:
            src = self.manager.prepare_load(keys, state.req_context)
        except ContractError:
            # The hit vanished between lookup and allocation: recompute instead of loading.
            logger.warning(
                "request %s: offloaded blocks vanished before their load; recomputing",
                request.request_id,
            )
            self._failed_before_submit.append(request.request_id)
            return
        job_id = self._new_job(state, keys, is_store=False)
        sources = self._jobs[job_id].sources = self._split_by_source(
            keys, state.req_context, num_external_tokens
        )
        by_source = self._hit_tokens_by_source
        for source, n in sources.items():
            by_source[source] = by_source.get(source, 0) + n
        self._load_jobs.append(
            TransferJob(
                job_id,
                request.request_id,
                src,
                GPULoadStoreSpec(engine_ids, group_sizes, block_indices),
            )
        )
        self._policies[state.store_policy].on_blocks_loaded(request.request_id, end)
        self._counters["load_jobs"] += 1
        self._counters["loaded_blocks"] += len(keys)
        self._counters["hit_tokens"] += num_external_tokens

    def _split_by_source(
        self, keys: list[OffloadKey], ctx: ReqContext, num_tokens: int
    ) -> dict[str, int]:
        """``num_tokens`` split by the tier each key loads from, in proportion to the keys (the
        rounding remainder goes to the first tier); one dict operation per key."""
        load_source = self.manager.load_source
        counts: dict[str, int] = {}
        for key in keys:
            source = load_source(key, ctx)
            counts[source] = counts.get(source, 0) + 1
        if len(counts) <= 1:
            return dict.fromkeys(counts or ("host",), num_tokens)
        out = {source: num_tokens * n // len(keys) for source, n in counts.items()}
        out[next(iter(out))] += num_tokens - sum(out.values())
        return out

    def _new_job(self, state: RequestKVState, keys: list[OffloadKey], is_store: bool) -> int:
        job_id = self._next_job_id
        self._next_job_id += 1
        self._jobs[job_id] = _Job(
            job_id,
            state.req_context.req_id,
            state.req_context,
            keys,
            is_store,
            self.config.num_workers,
        )
        state.transfer_jobs.add(job_id)
        return job_id

    # ------------------------------------------------------------------ stores

    def _plan_store(
        self, state: RequestKVState, num_offloadable_tokens: int, finished: bool = False
    ) -> tuple[list[TransferJob], int]:
        """Plan the stores of the blocks the request's policy offers now.

        Returns the jobs and how many offered blocks the tier does not hold afterwards (0: the
        whole offer is held or being stored; else the tier had no room and the policy re-offers
        them, from the offer's start, next time). When the whole offer does not fit, the longest
        head of it that does is stored (:meth:`_prepare_head`).
        """
        if state.max_offload_tokens is not None:
            num_offloadable_tokens = min(num_offloadable_tokens, state.max_offload_tokens)
        policy = self._policies[state.store_policy]
        keys, starts = policy.get_blocks_to_store(state, num_offloadable_tokens, finished)
        if not keys:
            return [], 0
        req_id = state.req_context.req_id
        groups = self.config.groups
        # Locate each offered key: (group, offloaded block index); keys are grouped in order.
        located: list[tuple[int, int]] = []
        offset = [0] * len(groups)
        for key in keys:
            g = offload_key_group(key) if len(groups) > 1 else 0
            located.append((g, starts[g] + offset[g]))
            offset[g] += 1
        for g, (group, group_state) in enumerate(zip(groups, state.group_states, strict=True)):
            if (
                offset[g]
                and len(group_state.block_ids) < (starts[g] + offset[g]) * group.block_size_factor
            ):
                # The engine has not reported these blocks yet: try again next step.
                policy.on_store_rejected(req_id, starts)
                return [], 0
        out = self.manager.prepare_store(keys, state.req_context)
        if out is not None:
            outs, missing = [out], 0
        else:
            held, outs = self._prepare_head(keys, located, state.req_context)
            missing = len(keys) - held
            # Offer everything again next time: the stored head stays protected (a tier
            # protects the keys of an offer), so the rest never evicts its own prefix.
            policy.on_store_rejected(req_id, starts)
            self._counters["rejected_stores"] += 1
        where = dict(zip(keys, located, strict=True))
        jobs = [self._store_job(state, o.keys_to_store, o.store_spec, where) for o in outs]
        return [job for job in jobs if job is not None], missing

    def _prepare_head(
        self, keys: list[OffloadKey], located: list[tuple[int, int]], ctx: ReqContext
    ) -> tuple[int, list[PrepareStoreOutput]]:
        """Reserve the longest head (in block order) of an offer that does not fit as a whole.

        Binary search over head lengths: a refused ``prepare_store`` changes nothing, an accepted
        one is kept and the search goes on above it (its keys are then held and skipped). At most
        ``log2(len(keys))`` calls; runs only when the whole offer was refused. Returns the length
        of the head now held (or being stored) and the accepted reservations.
        """
        groups = self.config.groups
        # Blocks by the token their KV ends at; each probe passes its keys group by group.
        order = sorted(
            range(len(keys)),
            key=lambda i: (located[i][1] + 1) * groups[located[i][0]].offloaded_block_size,
        )
        outs: list[PrepareStoreOutput] = []
        lo, hi = 0, len(keys)  # the first lo blocks are held, the first hi do not fit
        while hi - lo > 1:
            mid = (lo + hi) // 2
            out = self.manager.prepare_store([keys[i] for i in sorted(order[:mid])], ctx)
            if out is None:
                hi = mid
                continue
            lo = mid
            if out.keys_to_store:
                outs.append(out)
        return lo, outs

    def _store_job(
        self,
        state: RequestKVState,
        stored: list[OffloadKey],
        store_spec: LoadStoreSpec,
        where: Mapping[OffloadKey, tuple[int, int]],
    ) -> TransferJob | None:
        """The job copying ``stored`` (just prepared in the tier) out of the request's blocks."""
        if not stored:
            return None
        groups = self.config.groups
        located = [where[key] for key in stored]
        engine_ids: list[int] = []
        group_sizes = [0] * len(groups)
        block_indices = [-1] * len(groups)
        for g, block in located:
            factor = groups[g].block_size_factor
            engine_ids.extend(
                state.group_states[g].block_ids[block * factor : (block + 1) * factor]
            )
            group_sizes[g] += factor
            if block_indices[g] < 0:
                block_indices[g] = block * factor
        block_indices = [max(0, i) for i in block_indices]
        if self._events is not None:
            self._describe(state, stored, located)
        job_id = self._new_job(state, stored, is_store=True)
        if self._window_groups:
            self._fence_sources(job_id, engine_ids, group_sizes)
        self._counters["store_jobs"] += 1
        self._counters["stored_blocks"] += len(stored)
        return TransferJob(
            job_id,
            state.req_context.req_id,
            GPULoadStoreSpec(engine_ids, group_sizes, block_indices),
            store_spec,
        )

    def _fence_sources(self, job_id: int, engine_ids: list[int], group_sizes: list[int]) -> None:
        job = self._jobs[job_id]
        offset = 0
        for g, size in enumerate(group_sizes):
            if self.config.groups[g].sliding_window_blocks is not None:
                for block_id in engine_ids[offset : offset + size]:
                    self._fence.setdefault(block_id, set()).add(job_id)
                    job.fenced.append(block_id)
            offset += size

    def _check_fence(self, block_ids: Iterable[int]) -> None:
        """Flush store jobs still reading any of ``block_ids`` (just reallocated by the engine)."""
        fence = self._fence
        for block_id in block_ids:
            jobs = fence.pop(block_id, None)
            if jobs:
                flush = self._jobs_to_flush
                flush.extend(jobs.difference(flush))

    def _describe(
        self, state: RequestKVState, keys: list[OffloadKey], located: list[tuple[int, int]]
    ) -> None:
        assert self._events is not None
        tokens = state.request.all_token_ids
        for key, (g, block) in zip(keys, located, strict=True):
            obs = self.config.groups[g].offloaded_block_size
            group_keys = state.group_states[g].offload_keys
            parent = offload_key_hash(group_keys[block - 1]) if block else None
            self._events.record(key, parent, list(tokens[block * obs : (block + 1) * obs]), obs)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ConnectorMetadata:
        """Plan this step's stores and hand over every job planned since the last call."""
        requests = self._requests
        store_jobs = self._store_jobs
        for scheduled in scheduler_output.scheduled:
            request = scheduled.request
            state = requests.get(request.request_id)
            if state is None:
                continue
            if scheduled.new_block_ids:
                for group_state, ids in zip(
                    state.group_states, scheduled.new_block_ids, strict=True
                ):
                    if scheduled.resumed:
                        group_state.block_ids[:] = ids
                    elif ids:
                        group_state.block_ids.extend(ids)
                    if self._fence and ids:
                        self._check_fence(ids)
            state.update_offload_keys()
            jobs, _ = self._plan_store(
                state,
                min(
                    request.num_computed_tokens + scheduled.num_scheduled_tokens, request.num_tokens
                ),
            )
            store_jobs.extend(jobs)
        if self._store_retries:
            self._retry_finished_stores()
        flush = self._jobs_to_flush
        for req_id in scheduler_output.preempted_req_ids:
            state = requests.get(req_id)
            if state is not None and state.transfer_jobs:
                flush.extend(state.transfer_jobs)
        meta = ConnectorMetadata(self._load_jobs, store_jobs, flush)
        self._load_jobs, self._store_jobs, self._jobs_to_flush = [], [], []
        self.manager.step_end()
        return meta

    # ------------------------------------------------------------------ completions

    def update_connector_output(self, results: Iterable[TransferResult]) -> ConnectorUpdate:
        """Apply worker results; a job completes when all ``num_workers`` workers reported it."""
        self.manager.step_begin()
        update = ConnectorUpdate()
        if self._freed_without_jobs:
            update.freed.extend(self._freed_without_jobs)
            self._freed_without_jobs = []
        if self._failed_before_submit:
            update.failed_loads.extend(self._failed_before_submit)
            self._failed_before_submit = []
        jobs, counters = self._jobs, self._counters
        if self._dropped_jobs:
            for job_id in self._dropped_jobs:
                self._complete(jobs.pop(job_id), update)
            self._dropped_jobs = []
        for result in results:
            job = jobs.get(result.job_id)
            if job is None:
                logger.debug("ignoring result of unknown job %d", result.job_id)
                continue
            if job.is_store:
                counters["store_bytes"] += result.num_bytes
                self._transfer_seconds["store"] += result.seconds
            else:
                counters["load_bytes"] += result.num_bytes
                self._transfer_seconds["load"] += result.seconds
            if not result.success:
                job.failed = True
            job.pending -= 1
            if job.pending > 0:
                continue
            del jobs[result.job_id]
            self._complete(job, update)
        return update

    def _complete(self, job: _Job, update: ConnectorUpdate) -> None:
        failed = job.failed or job.stale
        for block_id in job.fenced:
            jobs = self._fence.get(block_id)
            if jobs is not None:
                jobs.discard(job.job_id)
                if not jobs:
                    del self._fence[block_id]
        if not job.stale:
            if job.is_store:
                self.manager.complete_store(job.keys, job.ctx, success=not job.failed)
            else:
                self.manager.complete_load(job.keys, job.ctx)
        if job.is_store and failed and self._events is not None:
            self._events.forget(job.keys)
        if failed and not job.is_store:
            failed_by_source = self._failed_load_tokens_by_source
            for source, n in job.sources.items():
                failed_by_source[source] = failed_by_source.get(source, 0) + n
        if job.failed:
            self._counters["failed_stores" if job.is_store else "failed_loads"] += 1
            logger.warning(
                "request %s: %s of %d blocks failed; %s",
                job.req_id,
                "store" if job.is_store else "load",
                len(job.keys),
                "blocks not offloaded" if job.is_store else "recomputing",
            )
        state = self._requests.get(job.req_id)
        if state is None:
            return
        state.transfer_jobs.discard(job.job_id)
        if not job.is_store and not state.finished:
            (update.failed_loads if failed else update.loaded).append(job.req_id)
        if state.finished and not state.transfer_jobs and job.req_id not in self._store_retries:
            del self._requests[job.req_id]
            update.freed.append(job.req_id)

    def request_finished(self, request: OffloadRequest) -> tuple[bool, dict[str, Any] | None]:
        """The request ended (finished or aborted). Returns ``(delay_free, params)``.

        Plans the request's final stores (``on_finish`` policies store everything now). An offer
        the tier refuses while other transfers are in flight is kept and retried every step (its
        longest fitting head is stored each time) until it is stored, until an attempt neither
        waits for room nor stores more of it than any before (so finished requests cannot take
        turns evicting each other for ever), or until the engine needs the blocks
        (:meth:`abandon_store_retries`); only then are the policy and the manager told the
        request finished. ``delay_free`` is True while any of its jobs is in
        flight or its offer is kept: the engine must keep its blocks until a later
        ``update_connector_output`` lists the request in ``freed``.
        """
        req_id = request.request_id
        state = self._requests.get(req_id)
        if state is None:
            return False, None
        state.finished = True
        jobs, missing = self._plan_store(state, request.num_computed_tokens, finished=True)
        self._store_jobs.extend(jobs)
        if missing and self._jobs:
            self._store_retries[req_id] = (request.num_computed_tokens, missing)
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

    def _retry_finished_stores(self) -> None:
        """Offer the kept offers of finished requests again (see :meth:`request_finished`)."""
        for req_id, (num_tokens, fewest_missing) in list(self._store_retries.items()):
            state = self._requests[req_id]
            jobs, missing = self._plan_store(state, num_tokens, finished=True)
            self._store_jobs.extend(jobs)
            if missing and jobs and missing < fewest_missing:
                self._store_retries[req_id] = (num_tokens, missing)  # progress: go on
            elif missing and not jobs and self._jobs:
                continue  # nothing fits now; transfers in flight may make room
            else:  # stored, or no better than before
                self._give_up_retry(req_id, self._freed_without_jobs)

    def _give_up_retry(self, req_id: str, freed: list[str]) -> None:
        del self._store_retries[req_id]
        state = self._requests[req_id]
        self._end_request(state)
        if not state.transfer_jobs:
            del self._requests[req_id]
            freed.append(req_id)

    @property
    def has_store_retries(self) -> bool:
        """Whether finished requests' blocks are kept for offers the tier refused."""
        return bool(self._store_retries)

    def abandon_store_retries(self) -> list[str]:
        """The engine needs blocks: stop retrying finished requests' refused offers.

        Returns the requests whose blocks may be freed now; the others (a store still reading
        their blocks) come in ``ConnectorUpdate.freed`` when their transfers end.
        """
        freed: list[str] = []
        for req_id in list(self._store_retries):
            self._give_up_retry(req_id, freed)
        return freed

    # ------------------------------------------------------------------ misc

    def has_pending_jobs(self) -> bool:
        """True while any job is planned or in flight (the engine must keep stepping)."""
        return bool(
            self._jobs
            or self._store_jobs
            or self._load_jobs
            or self._failed_before_submit
            or self._store_retries
            or self._freed_without_jobs
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

    def take_events(self) -> list[KVCacheEvent]:
        """The tier's KV events since the last call (empty unless ``events`` was given)."""
        events = self.manager.take_events()
        if self._events is None or not events:
            return []
        return self._events.convert(events)

    def stats(self) -> dict[str, float]:
        """Connector counters (``lookups``: calls of get_num_new_matched_tokens, retries included;
        ``hit_tokens``: tokens whose load was planned, split by tier as ``hit_tokens_<tier>``, and
        ``failed_load_tokens_<tier>`` of those whose load failed and were recomputed; jobs,
        blocks, bytes, seconds) plus the manager's, the latter prefixed ``tier_``."""
        out: dict[str, float] = dict(self._counters)
        for source, n in self._hit_tokens_by_source.items():
            out[f"hit_tokens_{source}"] = n
        for source, n in self._failed_load_tokens_by_source.items():
            out[f"failed_load_tokens_{source}"] = n
        out["load_seconds"] = self._transfer_seconds["load"]
        out["store_seconds"] = self._transfer_seconds["store"]
        out["live_requests"] = len(self._requests)
        out["jobs_in_flight"] = len(self._jobs)
        for name, value in self.manager.stats().items():
            out[f"tier_{name}"] = value
        return out

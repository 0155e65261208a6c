"""Continuous batching over a paged KV cache, with the offloading connector's hooks.

Each step: running requests first (decodes and unfinished prefill chunks, in admission order),
then waiting requests (first come, first served) while the token budget, the sequence limit and
free blocks allow. When a running request needs a block and none is free, the most recently
admitted running request is preempted (its blocks freed, recomputed later). A waiting request's
prompt is served from the engine's prefix cache first, then the offloading connector is asked for
more (`get_num_new_matched_tokens`); a request with tokens to load waits (``LOADING``) until its
load completes, holding its blocks but no token budget. A waiting request whose next block is
being loaded into the engine for another request shares that load: it is passed over until the
load lands (its blocks then enter the prefix cache) instead of loading a second copy, and the
requests behind it are admitted meanwhile, so nobody queues behind it.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvoffload.engine.block_pool import BlockPool, KVBlock
from kvoffload.engine.request import Request, RequestStatus
from kvoffload.keys import BlockHash
from kvoffload.scheduler import (
    ConnectorUpdate,
    OffloadingConnectorScheduler,
    ScheduledRequest,
    SchedulerOutput,
)

__all__ = ["EngineScheduler", "StepPlan"]


@dataclass
class StepPlan:
    """One step: ``scheduled`` (request, tokens to compute) and the connector's view of it."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    connector_output: SchedulerOutput = field(default_factory=SchedulerOutput)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


class EngineScheduler:
    """Owns the queues and the block pool; decides what each step computes."""

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        connector: OffloadingConnectorScheduler | None = None,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.connector = connector
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}
        # Block hashes being loaded into the engine right now (count of loads), and per loading
        # request the range of its block hashes it loads.
        self._loading_hashes: dict[BlockHash, int] = {}
        self._load_ranges: dict[str, tuple[int, int]] = {}
        #: finished requests whose blocks a transfer still uses (freed on ConnectorUpdate.freed)
        self.held: dict[str, Request] = {}
        self._blocks: dict[str, list[KVBlock]] = {}
        #: Tokens each admission needed (re-admissions after preemption too), and those of them
        #: the engine's prefix cache held: vLLM's prefix-cache queries and hits.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self.loading)

    def blocks_of(self, request: Request) -> list[KVBlock]:
        return self._blocks[request.request_id]

    # ------------------------------------------------------------------ scheduling

    def schedule(self) -> StepPlan:
        plan = StepPlan()
        budget = self.max_num_batched_tokens
        preempted: list[str] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            blocks = self._blocks[req.request_id]
            need = _cdiv(req.num_computed_tokens + n, self.block_size) - len(blocks)
            while need > self.pool.num_free_blocks:
                victim = self.running.pop()
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:  # preempted itself
                break
            new = self.pool.allocate(need) if need > 0 else []
            assert new is not None
            blocks.extend(new)
            req.block_ids.extend(b.block_id for b in new)
            plan.scheduled.append((req, n))
            plan.connector_output.scheduled.append(
                ScheduledRequest(req, n, [[b.block_id for b in new]] if new else ())
            )
            budget -= n
            i += 1
        if not preempted:
            self._admit(plan, budget)
        plan.connector_output.preempted_req_ids = preempted
        return plan

    def _admit(self, plan: StepPlan, budget: int) -> None:
        deferred: list[Request] = []
        try:
            self._admit_waiting(plan, budget, deferred)
        finally:
            self.waiting.extendleft(reversed(deferred))

    def _admit_waiting(self, plan: StepPlan, budget: int, deferred: list[Request]) -> None:
        bs = self.block_size
        while (
            self.waiting
            and budget > 0
            and len(self.running) + len(self.loading) < self.max_num_seqs
        ):
            req = self.waiting[0]
            hits = self.pool.find_cached_prefix(req.block_hashes, (req.num_tokens - 1) // bs)
            if (
                self._loading_hashes
                and len(hits) < len(req.block_hashes)
                and req.block_hashes[len(hits)] in self._loading_hashes
            ):
                # Another request is loading this prefix into the engine right now: share that
                # load (its blocks enter the prefix cache when it lands) instead of loading a
                # second copy. Later requests are not held up.
                deferred.append(self.waiting.popleft())
                continue
            num_local = len(hits) * bs
            num_external, load_async = 0, False
            if self.connector is not None:
                matched, load_async = self.connector.get_num_new_matched_tokens(req, num_local)
                num_external = matched or 0
            num_cached = num_local + num_external
            n = 0 if load_async else min(req.num_tokens - num_cached, budget)
            need = _cdiv(num_cached + n, bs) - len(hits)
            self.pool.take(hits)
            new = self.pool.allocate(need)
            if new is None:
                self.pool.free(hits)
                break
            self.waiting.popleft()
            self.prefix_cache_queries += req.num_tokens
            self.prefix_cache_hits += num_local
            blocks = hits + new
            self._blocks[req.request_id] = blocks
            req.block_ids = [b.block_id for b in blocks]
            req.num_cached_blocks = len(hits)
            if req.cached_tokens_engine < 0:
                req.cached_tokens_engine, req.cached_tokens_offload = num_local, num_external
            if self.connector is not None:
                self.connector.update_state_after_alloc(req, [req.block_ids], num_external)
            req.num_computed_tokens = num_local
            if load_async:
                req.num_loading_tokens = num_external
                req.status = RequestStatus.LOADING
                self.loading[req.request_id] = req
                self._track_load(req, len(hits), num_cached // bs)
                continue
            req.num_computed_tokens = num_cached
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            plan.scheduled.append((req, n))
            plan.connector_output.scheduled.append(ScheduledRequest(req, n))
            budget -= n

    def _track_load(self, req: Request, first: int, end: int) -> None:
        self._load_ranges[req.request_id] = (first, end)
        loading = self._loading_hashes
        for h in req.block_hashes[first:end]:
            loading[h] = loading.get(h, 0) + 1

    def _untrack_load(self, req: Request) -> None:
        first, end = self._load_ranges.pop(req.request_id, (0, 0))
        loading = self._loading_hashes
        for h in req.block_hashes[first:end]:
            left = loading[h] - 1
            if left:
                loading[h] = left
            else:
                del loading[h]

    def _preempt(self, req: Request) -> None:
        self.pool.free(self._blocks.pop(req.request_id))
        req.block_ids = []
        req.num_cached_blocks = 0
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)

    # ------------------------------------------------------------------ after the step

    def cache_computed_blocks(self, req: Request) -> list[int]:
        """Register the request's full, computed blocks in the prefix cache; returns the new ones."""
        blocks = self._blocks[req.request_id]
        num_full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes))
        if num_full <= req.num_cached_blocks:
            return []
        added = self.pool.cache(blocks, req.block_hashes, req.num_cached_blocks, num_full)
        req.num_cached_blocks = num_full
        return added

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request (running, loading or waiting); free or hold its blocks."""
        req.status = status
        if req in self.running:
            self.running.remove(req)
        if self.loading.pop(req.request_id, None) is not None:
            self._untrack_load(req)
        if req in self.waiting:
            self.waiting.remove(req)
        delay_free = False
        if self.connector is not None:
            delay_free, _ = self.connector.request_finished(req)
        blocks = self._blocks.pop(req.request_id, None)
        if blocks is None:
            return
        if delay_free:
            self._blocks[req.request_id] = blocks
            self.held[req.request_id] = req
        else:
            self.pool.free(blocks)

    def apply_connector_update(self, update: ConnectorUpdate) -> list[tuple[Request, list[int]]]:
        """Resume loaded requests, roll back failed loads, free held blocks.

        Returns each resumed request with the indices of its blocks that entered the prefix
        cache (the loaded ones), for KV events.
        """
        resumed: list[Request] = []
        for req_id in update.loaded:
            req = self.loading.pop(req_id, None)
            if req is None:
                continue  # aborted while loading
            req.num_computed_tokens += req.num_loading_tokens
            req.num_loading_tokens = 0
            self._untrack_load(req)
            resumed.append(req)
        for req_id in update.failed_loads:
            req = self.loading.pop(req_id, None)
            if req is None:
                continue
            req.cached_tokens_offload = 0
            req.num_loading_tokens = 0
            self._untrack_load(req)
            resumed.append(req)
        out: list[tuple[Request, list[int]]] = []
        for req in resumed:
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            out.append((req, self.cache_computed_blocks(req)))
        for req_id in update.freed:
            req = self.held.pop(req_id, None)
            if req is not None:
                self.pool.free(self._blocks.pop(req_id))
        return out

"""Continuous batching over a paged KV cache, with the offloading connector's hooks.

Each step: running requests first (decodes and unfinished prefill chunks, in admission order),
then waiting requests, in the order of the waiting queue's policy (:mod:`~kvoffload.engine.admission`:
cache-aware, the default, or first come, first served), while the token budget, the sequence limit and free
blocks allow. ``running`` stays in admission order (the order requests left ``waiting``): a
request whose load lands goes back to its admission place, not to the end. When a running request
needs a block and none is free, a request not yet scheduled this step is preempted (its blocks
freed, recomputed later): the most recently admitted one, except that a request whose load just
landed and has not run since is the last choice (its transfer would be thrown away); when only
such requests are left to preempt, it computes what fits in the free blocks instead. Before any
preemption or refused admission, finished requests' blocks kept only to retry a refused store are
released. A waiting request's prompt is served from the engine's prefix cache first, then the
offloading connector is asked for more (`get_num_new_matched_tokens`); a request with tokens to
load waits (``LOADING``) until its load completes, holding its blocks but no token budget. A
waiting request whose next block is
being loaded into the engine for another request shares that load: it is passed over until the
load lands (its blocks then enter the prefix cache) instead of loading a second copy, and the
requests behind it are admitted meanwhile, so nobody queues behind it. A request whose offloaded
hit is not known yet (the connector answers ``None``: blocks are being promoted from a secondary
tier) is passed over the same way and asked again next step; the connector bounds how long. It
keeps the free blocks its prompt will need for the rest of the step's admissions: the requests
behind it are looked up and admitted only while the blocks left over fit them (so no lookup starts
a promotion for a request that could not be admitted now anyway). A request that not one free
block would be left for once its prefix hits are taken is not asked again while it waits, once
the connector has answered it (every answer needs a block: the pass would stop at it anyway); the
connector touches its offloaded blocks instead, as an ask would, so its hit is not lost to
eviction for want of asks.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass, field

from kvoffload.engine.admission import HeldProbe, HeldWorth, make_waiting_queue
from kvoffload.engine.block_pool import BlockPool, KVBlock
from kvoffload.engine.request import Request, RequestStatus
from kvoffload.errors import ContractError
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
        scheduling_policy: str = "cache_aware",
        max_bypass: int = 32,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.connector = connector
        held: HeldProbe | None = None
        held_worth: HeldWorth | None = None
        if connector is not None:
            held, held_worth = connector.num_held_blocks, self._held_block_worth
        self.waiting = make_waiting_queue(
            scheduling_policy, pool, block_size, max_bypass, held, held_worth
        )
        self.running: list[Request] = []
        self.loading: dict[str, Request] = {}
        # Block hashes being loaded into the engine right now (count of loads), and per loading
        # request the range of its block hashes it loads.
        self._loading_hashes: dict[BlockHash, int] = {}
        self._load_ranges: dict[str, tuple[int, int]] = {}
        #: finished requests whose blocks a transfer still uses (freed on ConnectorUpdate.freed)
        self.held: dict[str, Request] = {}
        self._blocks: dict[str, list[KVBlock]] = {}
        #: running requests whose load landed and that have not been scheduled since
        self._just_loaded: set[str] = set()
        #: admission number of every admitted request (``running`` is sorted by it)
        self._admitted: dict[str, int] = {}
        self._admissions = itertools.count()
        #: preemptions that threw away a landed load (every other candidate had one too)
        self.num_preempted_after_load = 0
        #: Tokens each admission needed (re-admissions after preemption too), and those of them
        #: the engine's prefix cache held: vLLM's prefix-cache queries and hits.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0

    def add(self, request: Request) -> None:
        self.waiting.add(request)

    def _held_block_worth(self) -> float:
        """What admitting a request saves per block the host tier holds, as a share of a
        device-resident block (:data:`~kvoffload.engine.waiting_queue.HeldWorth`): by the
        connector's ``load_policy``, 1 (``always``), 0 (``never``), or under ``auto`` computing
        the block less loading it, by the current estimates (:mod:`~kvoffload.scheduler.costs`),
        over computing it. O(1)."""
        connector = self.connector
        if connector is None or connector.config.load_policy == "never":
            return 0.0
        if connector.config.load_policy == "always":
            return 1.0
        costs, tokens = connector.costs, connector.config.groups[0].offloaded_block_size
        compute = costs.token_s * tokens
        keys = len(connector.config.groups)
        return max(0.0, 1.0 - costs.host_block_s(tokens) * keys / compute) if compute > 0 else 0.0

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
        stalled = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            blocks = self._blocks[req.request_id]
            need = _cdiv(req.num_computed_tokens + n, self.block_size) - len(blocks)
            if need > self.pool.num_free_blocks and i > 0 and self._only_just_loaded_from(i):
                # Its load just landed and every other candidate's did too: compute what fits and
                # keep its blocks (the requests before it ran and free blocks as they finish).
                n = (len(blocks) + self.pool.num_free_blocks) * self.block_size
                n -= req.num_computed_tokens
                if n <= 0:
                    stalled = True
                    i += 1
                    continue
                need = self.pool.num_free_blocks
            while need > self.pool.num_free_blocks:
                if self._release_store_retries():
                    continue
                victim = self._pop_victim(i)
                self._preempt(victim)
                preempted.append(victim.request_id)
                if victim is req:
                    break
            if req.status is not RequestStatus.RUNNING:  # preempted itself
                break
            self._just_loaded.discard(req.request_id)
            new = self.pool.allocate(need) if need > 0 else []
            if new is None:  # the room was counted above: the pool broke its count
                raise ContractError(f"the block pool refused {need} blocks it counted as free")
            blocks.extend(new)
            req.block_ids.extend(b.block_id for b in new)
            plan.scheduled.append((req, n))
            plan.connector_output.scheduled.append(
                ScheduledRequest(req, n, [[b.block_id for b in new]] if new else ())
            )
            budget -= n
            i += 1
        if not preempted and not stalled:
            self._admit(plan, budget)
        plan.connector_output.preempted_req_ids = preempted
        return plan

    def _release_store_retries(self) -> bool:
        """Blocks are short: free finished requests' blocks kept only for a refused store.

        Returns whether that freed any now (stores still reading some free them later).
        """
        connector = self.connector
        if connector is None or not connector.has_store_retries:
            return False
        freed = False
        for req_id in connector.abandon_store_retries():
            if self.held.pop(req_id, None) is not None:
                self.pool.free(self._blocks.pop(req_id))
                freed = True
        return freed

    def _only_just_loaded_from(self, first: int) -> bool:
        """Whether every request of ``running[first:]`` just had its load land."""
        just_loaded = self._just_loaded
        return bool(just_loaded) and all(
            self.running[k].request_id in just_loaded for k in range(first, len(self.running))
        )

    def _pop_victim(self, first: int) -> Request:
        """Remove and return the request to preempt among ``running[first:]`` (not scheduled yet).

        The most recently admitted one that did not just finish a load; a just-loaded one only
        when every candidate did. O(running), at most ``max_num_seqs``.
        """
        running, just_loaded = self.running, self._just_loaded
        if just_loaded:
            for k in range(len(running) - 1, first - 1, -1):
                if running[k].request_id not in just_loaded:
                    return running.pop(k)
        return running.pop()

    def _admit(self, plan: StepPlan, budget: int) -> None:
        self.waiting.begin_pass()
        try:
            self._admit_waiting(plan, budget)
        finally:
            self.waiting.end_pass()

    def _admit_waiting(self, plan: StepPlan, budget: int) -> None:
        bs, waiting = self.block_size, self.waiting
        # Free blocks the requests deferred this step for a promotion will need (their whole
        # prompts, an upper bound): the requests behind them only get the rest, so no lookup
        # starts a promotion for a request the pool could not admit now anyway.
        promised = 0
        while budget > 0 and len(self.running) + len(self.loading) < self.max_num_seqs:
            req = waiting.next_candidate()
            if req is None:
                break
            hits = self.pool.find_cached_prefix(req.block_hashes, (req.num_tokens - 1) // bs)
            prompt_blocks = _cdiv(req.num_tokens, bs) - len(hits)
            if promised and self.pool.num_free_blocks - promised < prompt_blocks:
                break
            if (
                self._loading_hashes
                and len(hits) < len(req.block_hashes)
                and req.block_hashes[len(hits)] in self._loading_hashes
            ) or waiting.shares_in_flight(req, len(hits)):
                # Another request is loading (or computing) this prefix into the engine right
                # now: share it (its blocks enter the prefix cache when they land) instead of
                # making a second copy. Later requests are not held up.
                waiting.defer(req)
                continue
            if (
                self.connector is not None
                and self._no_room(hits, promised)
                and not self._release_store_retries()
                and self.connector.skip_lookup(req)
            ):
                break  # no answer could make it fit (the lookup would end the pass here too)
            num_local = len(hits) * bs
            num_external, load_async = 0, False
            if self.connector is not None:
                matched, load_async = self.connector.get_num_new_matched_tokens(req, num_local)
                if matched is None:
                    # Not known yet (a block is being promoted from a secondary tier): ask again
                    # next step; the requests behind it are admitted meanwhile, in the blocks
                    # it leaves.
                    promised += prompt_blocks
                    waiting.defer(req)
                    continue
                num_external = matched
            num_cached = num_local + num_external
            n = 0 if load_async else min(req.num_tokens - num_cached, budget)
            need = _cdiv(num_cached + n, bs) - len(hits)
            self.pool.take(hits)
            new = self._allocate(need, promised)
            if new is None and self._release_store_retries():
                new = self._allocate(need, promised)
            if new is None:
                self.pool.free(hits)
                break
            waiting.take(req)
            self._give_blocks(req, hits, new, num_external)
            waiting.admitted(req, len(hits))
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

    def _no_room(self, hits: list[KVBlock], promised: int) -> bool:
        """Whether not one block would be left for a request with engine prefix hits ``hits``
        once they are taken and ``promised`` kept: whatever the connector answers, admitting it
        needs at least one new block (its first token to compute, or a block to load into)."""
        room = self.pool.num_free_blocks - promised
        if room > len(hits):
            return False
        return room <= [b.ref_cnt for b in hits].count(0)

    def _give_blocks(
        self, req: Request, hits: list[KVBlock], new: list[KVBlock], num_external: int
    ) -> None:
        """Give ``req`` its blocks (engine prefix hits, then new ones) and tell the connector;
        ``num_external`` tokens after the hits come from the offloading tiers."""
        num_local = len(hits) * self.block_size
        self._admitted[req.request_id] = next(self._admissions)
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

    def _allocate(self, n: int, promised: int) -> list[KVBlock] | None:
        """``n`` free blocks, leaving ``promised`` free, or ``None`` if too few."""
        if self.pool.num_free_blocks - promised < n:
            return None
        return self.pool.allocate(n)

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
        del self._admitted[req.request_id]
        if req.request_id in self._just_loaded:
            self._just_loaded.discard(req.request_id)
            self.num_preempted_after_load += 1
        self.pool.free(self._blocks.pop(req.request_id))
        req.block_ids = []
        req.num_cached_blocks = 0
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.num_preemptions += 1
        self.waiting.released(req)
        self.waiting.add_preempted(req)

    # ------------------------------------------------------------------ after the step

    def cache_computed_blocks(self, req: Request) -> list[int]:
        """Register the request's full, computed blocks in the prefix cache; returns the new ones."""
        blocks = self._blocks[req.request_id]
        num_full = min(req.num_computed_tokens // self.block_size, len(req.block_hashes))
        if num_full <= req.num_cached_blocks:
            return []
        hashes = req.block_hashes
        added = self.pool.cache(blocks, hashes, req.num_cached_blocks, num_full)
        req.num_cached_blocks = num_full
        self.waiting.blocks_cached(req, num_full, [hashes[i] for i in added])
        return added

    def finish(self, req: Request, status: RequestStatus) -> None:
        """End a request (running, loading or waiting); free or hold its blocks."""
        req.status = status
        self._just_loaded.discard(req.request_id)
        self._admitted.pop(req.request_id, None)
        if req in self.running:
            self.running.remove(req)
        if self.loading.pop(req.request_id, None) is not None:
            self._untrack_load(req)
        if req in self.waiting:
            self.waiting.remove(req)
        else:
            self.waiting.released(req)
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
            self._just_loaded.add(req_id)
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
        admitted = self._admitted
        for req in resumed:
            req.status = RequestStatus.RUNNING
            bisect.insort(self.running, req, key=lambda r: admitted[r.request_id])
            out.append((req, self.cache_computed_blocks(req)))
        for req_id in update.freed:
            req = self.held.pop(req_id, None)
            if req is not None:
                self.pool.free(self._blocks.pop(req_id))
        return out

"""A small fake inference engine that drives the real scheduler-side connector.

Real parts: :class:`~kvoffload.scheduler.OffloadingConnectorScheduler`, a real
:class:`~kvoffload.CPUOffloadingManager` (any eviction policy) and real block hashing
(:class:`~kvoffload.BlockHasher`). Fake parts: the model and the copies.

The engine (:class:`FakeEngine`) schedules like vLLM's v1 scheduler, step by step:

* running requests first (chunked prefill under a per-step token budget, then one decode token
  per step), preempting the last running request (recompute: blocks freed,
  ``num_computed_tokens = 0``) when blocks run out; then, if nothing was preempted, waiting
  requests in FCFS order: engine prefix-cache hit, ``get_num_new_matched_tokens``, allocation,
  ``update_state_after_alloc``. A request with an async load holds its blocks and waits until
  ``ConnectorUpdate.loaded`` (it then joins the running list) or ``failed_loads`` (it rolls back
  to its prefix-cache hit and recomputes the rest; with sliding-window groups, whose tables hold
  NULL where the load made positions unnecessary, it starts over from a new lookup instead).
  ``update_state_after_alloc`` gets the whole block table; a request's first
  ``ScheduledRequest`` then carries no block ids (``resumed=True`` with the whole table after a
  preemption), later ones the blocks allocated in that step.
* Engine blocks: one pool per KV-cache group with reference counts, a prefix cache of full
  blocks by hash and LRU reuse of free blocks. Sliding-window groups hold NULL_BLOCK_ID for
  positions before the window and free blocks that leave it. Like vLLM, the engine does not tell
  the connector about blocks it frees while a request runs.
* ``request_finished`` on finish and abort; blocks are kept until ``ConnectorUpdate.freed``
  lists the request when the connector asks for it.
* Window semantics: with ``W = sliding_window_blocks * offloaded_block_size`` tokens, computing
  position ``p`` reads positions ``[p - W, p]``, so a hit of ``L`` offloaded blocks needs exactly
  blocks ``[L - window, L)`` (the connector's rule).

The KV and the oracle: the engine's KV cache is an integer array per group
``[num_workers, num_engine_blocks, engine_block_size]``; computing position ``p`` writes a value
that is a hash of the tokens ``[0, p]`` (salted by group). :meth:`FakeEngine.check` asserts, after
every step, that every computed position of every running request holds the value a fresh
computation would write, and that every readable block of the tier holds the values of its key's
prefix. The forward pass also checks the positions it reads before writing new ones.

The worker (:class:`TransferExecutor`) applies transfer jobs with the semantics of
:class:`~kvoffload.load_store_specs.GPULoadStoreSpec` / ``CPULoadStoreSpec`` on a host array
``[num_workers, num_host_blocks, max offloaded block size]``: one part per worker (each worker
moves its own shard and reports the job once), completion after a per-job/per-worker delay in
steps (or only when the test says), flushes (of jobs it was given: anything else is an error), and
injected failures (the failing worker writes garbage into its destination and reports
``success=False``). A store reads its source when it completes, a load writes its destination
then. It asserts that no block read or written by an unfinished transfer is reallocated, written
by the forward pass, or targeted by another transfer.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvoffload import (
    BlockHash,
    BlockHasher,
    CPUOffloadingManager,
    OffloadKey,
    ReqContext,
    make_offload_key,
)
from kvoffload.load_store_specs import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.manager_contract import LoadStoreSpec, LookupResult, PrepareStoreOutput
from kvoffload.scheduler import (
    NULL_BLOCK_ID,
    ConnectorUpdate,
    GroupOffloadConfig,
    OffloadingConnectorScheduler,
    ScheduledRequest,
    SchedulerOffloadConfig,
    SchedulerOutput,
)
from kvoffload.transfer import ConnectorMetadata, TransferJob, TransferResult

__all__ = [
    "FINISHED",
    "LOADING",
    "RUNNING",
    "WAITING",
    "Call",
    "FakeEngine",
    "FakeRequest",
    "Lookup",
    "RecordingManager",
    "StepRecord",
    "TransferExecutor",
    "expected_values",
    "groups_config",
    "make_tokens",
    "single_group",
    "spec_blocks",
]

_MASK62 = (1 << 62) - 1
_MASK64 = (1 << 64) - 1
UNWRITTEN = -1
VOCAB = 1000

WAITING, LOADING, RUNNING, FINISHED = "waiting", "loading", "running", "finished"


def _mix(prev: int, token: int) -> int:
    """The value of a position given the previous position's value and its token (splitmix64)."""
    x = (prev * 0x9E3779B97F4A7C15 + token * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
    x ^= x >> 31
    x = (x * 0xD6E8FEB86659FD93) & _MASK64
    x ^= x >> 29
    return x & _MASK62


def _group_salt(g: int) -> int:
    return (g * 0x5851F42D4C957F2D) & _MASK62


def expected_values(tokens: Sequence[int]) -> list[int]:
    """``values[p]``: what computing position ``p`` of ``tokens`` writes in group 0."""
    out: list[int] = []
    v = 0x1234
    for t in tokens:
        v = _mix(v, t)
        out.append(v)
    return out


def make_tokens(n: int, seed: int) -> list[int]:
    """``n`` deterministic pseudo-random token ids (distinct seeds give distinct sequences)."""
    out: list[int] = []
    v = _mix(seed, 7)
    for _ in range(n):
        v = _mix(v, 11)
        out.append(v % VOCAB)
    return out


# ---------------------------------------------------------------------------------------------
# Recording manager


@dataclass(frozen=True)
class Call:
    """One manager call: method name, request id (``""`` for reset) and keys."""

    method: str
    req_id: str
    keys: tuple[OffloadKey, ...] = ()
    result: Any = None


class RecordingManager(CPUOffloadingManager):
    """A real CPUOffloadingManager that records every call it gets (``calls``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[Call] = []

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        result = super().lookup(key, ctx)
        self.calls.append(Call("lookup", ctx.req_id, (key,), result))
        return result

    def prepare_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> CPULoadStoreSpec:
        self.calls.append(Call("prepare_load", ctx.req_id, tuple(keys)))
        return super().prepare_load(keys, ctx)

    def touch(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self.calls.append(Call("touch", ctx.req_id, tuple(keys)))
        super().touch(keys, ctx)

    def complete_load(self, keys: Sequence[OffloadKey], ctx: ReqContext) -> None:
        self.calls.append(Call("complete_load", ctx.req_id, tuple(keys)))
        super().complete_load(keys, ctx)

    def prepare_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext
    ) -> PrepareStoreOutput | None:
        out = super().prepare_store(keys, ctx)
        self.calls.append(Call("prepare_store", ctx.req_id, tuple(keys), out))
        return out

    def complete_store(
        self, keys: Sequence[OffloadKey], ctx: ReqContext, success: bool = True
    ) -> None:
        self.calls.append(Call("complete_store", ctx.req_id, tuple(keys), success))
        super().complete_store(keys, ctx, success)

    def request_finished(self, ctx: ReqContext) -> None:
        self.calls.append(Call("request_finished", ctx.req_id))
        super().request_finished(ctx)

    def reset(self) -> None:
        self.calls.append(Call("reset", ""))
        super().reset()

    def of(self, method: str, req_id: str | None = None) -> list[Call]:
        """The recorded calls of ``method`` (for ``req_id`` only, when given)."""
        return [
            c for c in self.calls if c.method == method and (req_id is None or c.req_id == req_id)
        ]


# ---------------------------------------------------------------------------------------------
# Requests and engine blocks


class FakeRequest:
    """An engine request; satisfies :class:`kvoffload.scheduler.OffloadRequest`."""

    def __init__(
        self,
        request_id: str,
        prompt: Sequence[int],
        max_tokens: int,
        kv_transfer_params: Mapping[str, Any] | None,
        hasher: BlockHasher,
        num_groups: int,
        arrival_step: int,
    ) -> None:
        self.request_id = request_id
        self.all_token_ids: list[int] = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.num_computed_tokens = 0
        self.kv_transfer_params = kv_transfer_params
        self.max_tokens = max_tokens
        self.output_token_ids: list[int] = []
        self.values = expected_values(self.all_token_ids)
        self._hasher = hasher
        self.block_hashes: list[BlockHash] = hasher.hash_blocks(self.all_token_ids)
        self.status = WAITING
        self.block_table: list[list[int]] = [[] for _ in range(num_groups)]
        self.num_cached_blocks = [
            0
        ] * num_groups  # blocks [0, n) of each group were offered to the cache
        self.arrival_step = arrival_step
        self.first_token_step: int | None = None
        self.finish_step: int | None = None
        self.num_preemptions = 0
        self.local_hit = 0  # tokens hit in the engine prefix cache at the last admission
        self.load_end = 0  # local_hit + external tokens being loaded
        self.aborted = False

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append_token(self, token: int) -> None:
        self.all_token_ids.append(token)
        self.output_token_ids.append(token)
        self.values.append(_mix(self.values[-1], token))
        n = len(self.block_hashes)
        self.block_hashes.extend(
            self._hasher.hash_blocks(
                self.all_token_ids, parent=self.block_hashes[-1] if n else None, start_block=n
            )
        )

    def __repr__(self) -> str:
        progress = f"{self.num_computed_tokens}/{self.num_tokens}"
        return f"FakeRequest({self.request_id}, {self.status}, {progress})"


class BlockPool:
    """The engine blocks of one KV-cache group: reference counts, a prefix cache, LRU reuse."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))  # oldest first
        self.cached: dict[BlockHash, int] = {}
        self.hash_of: dict[int, BlockHash] = {}

    def take_cached(self, bid: int) -> None:
        self.ref[bid] += 1
        self.free.pop(bid, None)

    def allocate(self) -> int:
        bid, _ = self.free.popitem(last=False)
        h = self.hash_of.pop(bid, None)
        if h is not None:
            del self.cached[h]
        self.ref[bid] = 1
        return bid

    def release(self, bid: int) -> None:
        assert self.ref[bid] > 0, f"engine block {bid} released twice"
        self.ref[bid] -= 1
        if self.ref[bid] == 0:
            self.free[bid] = None

    def cache(self, bid: int, h: BlockHash) -> None:
        if h not in self.cached and bid not in self.hash_of:
            self.cached[h] = bid
            self.hash_of[bid] = h

    def drop_cache(self) -> None:
        self.cached.clear()
        self.hash_of.clear()


# ---------------------------------------------------------------------------------------------
# The transfer executor (the worker side)


@dataclass
class _Pending:
    job: TransferJob
    # (group, engine block, host slot, page within the host block), in spec order
    pages: list[tuple[int, int, int, int]]
    parts: dict[int, tuple[int | None, bool]]  # worker -> (due step or None = manual, fails)
    submit_step: int


class TransferExecutor:
    """Runs transfer jobs on the engine's and the host tier's arrays (see the module docstring).

    ``delay(job, worker)``: steps until that worker's part completes (``0``: at the end of the
    step it was submitted in; ``None``: only when :meth:`complete` or a flush says so).
    ``fail(job, worker)``: whether that worker's part fails (decided at submission).
    """

    def __init__(
        self,
        engine: FakeEngine,
        delay: Callable[[TransferJob, int], int | None],
        fail: Callable[[TransferJob, int], bool],
    ) -> None:
        self.engine = engine
        self.delay = delay
        self.fail = fail
        self.pending: dict[int, _Pending] = {}
        self.results: list[TransferResult] = []
        self.submitted: list[tuple[int, TransferJob]] = []  # (step, job)
        self.flushed: list[int] = []
        self.failed_parts: list[tuple[int, int]] = []  # (job id, worker)
        self.busy_engine: Counter[tuple[int, int]] = Counter()  # (group, block) of unfinished jobs
        self.load_writes: Counter[tuple[int, int]] = (
            Counter()
        )  # (group, block) unfinished loads write
        self.host_writes: Counter[int] = Counter()  # slots written by unfinished stores
        self.host_reads: Counter[int] = Counter()  # slots read by unfinished loads

    def _pages(self, job: TransferJob) -> list[tuple[int, int, int, int]]:
        gpu, cpu = (job.src, job.dst) if job.is_store else (job.dst, job.src)
        assert isinstance(gpu, GPULoadStoreSpec), f"job {job.job_id}: engine side is {gpu!r}"
        assert isinstance(cpu, CPULoadStoreSpec), f"job {job.job_id}: host side is {cpu!r}"
        groups = self.engine.config.groups
        assert len(gpu.group_sizes) == len(groups), (
            f"job {job.job_id}: {len(gpu.group_sizes)} group sizes"
        )
        slots = cpu.block_ids
        pages: list[tuple[int, int, int, int]] = []
        ids_off = slot_off = 0
        for g, n in enumerate(gpu.group_sizes):
            f = groups[g].block_size_factor
            skip = gpu.block_indices[g] % f
            if job.is_store:
                assert skip == 0 and n % f == 0, (
                    f"store job {job.job_id} covers part of an offloaded block in group {g}"
                )
            for j in range(n):
                page = skip + j
                bid = gpu.block_ids[ids_off + j]
                assert 0 <= bid < self.engine.pools[g].num_blocks, (
                    f"job {job.job_id}: engine block {bid} in group {g}"
                )
                pages.append((g, bid, slots[slot_off + page // f], page % f))
            ids_off += n
            slot_off += -(-(skip + n) // f) if n else 0
        assert slot_off == len(slots), (
            f"job {job.job_id}: {len(slots)} host blocks for {slot_off} needed"
        )
        return pages

    def submit(self, job: TransferJob, step: int) -> None:
        pages = self._pages(job)
        for g, bid, slot, _ in pages:
            if job.is_store:
                assert self.host_writes[slot] == 0 and self.host_reads[slot] == 0, (
                    f"store job {job.job_id} writes host slot {slot}, "
                    "in use by an unfinished transfer"
                )
                assert self.load_writes[(g, bid)] == 0, (
                    f"store job {job.job_id} reads engine block {bid} (group {g}) "
                    "that an unfinished load still writes"
                )
            else:
                assert self.busy_engine[(g, bid)] == 0, (
                    f"load job {job.job_id} writes engine block {bid} (group {g}), "
                    "in use by an unfinished transfer"
                )
                assert self.host_writes[slot] == 0, (
                    f"load job {job.job_id} reads host slot {slot} still being written"
                )
        for g, bid, slot, _ in pages:
            self.busy_engine[(g, bid)] += 1
            if job.is_store:
                self.host_writes[slot] += 1
            else:
                self.host_reads[slot] += 1
                self.load_writes[(g, bid)] += 1
        parts = {
            w: (self._due(job, w, step), self.fail(job, w))
            for w in range(self.engine.config.num_workers)
        }
        self.pending[job.job_id] = _Pending(job, pages, parts, step)
        self.submitted.append((step, job))

    def _due(self, job: TransferJob, worker: int, step: int) -> int | None:
        d = self.delay(job, worker)
        return None if d is None else step + d

    def _run_part(self, p: _Pending, worker: int) -> None:
        _, fails = p.parts.pop(worker)
        kv, host = self.engine.kv, self.engine.host
        groups = self.engine.config.groups
        garbage = -2 - p.job.job_id
        for g, bid, slot, page in p.pages:
            ebs = groups[g].engine_block_size
            cols = slice(page * ebs, (page + 1) * ebs)
            if p.job.is_store:
                host[worker, slot, cols] = garbage if fails else kv[g][worker, bid]
            else:
                kv[g][worker, bid] = garbage if fails else host[worker, slot, cols]
        if fails:
            self.failed_parts.append((p.job.job_id, worker))
        direction = ("GPU", "CPU") if p.job.is_store else ("CPU", "GPU")
        nbytes = sum(groups[g].engine_block_size for g, *_ in p.pages) * 8
        self.results.append(TransferResult(p.job.job_id, not fails, nbytes, 0.0, direction))
        if not p.parts:
            del self.pending[p.job.job_id]
            for g, bid, slot, _ in p.pages:
                self.busy_engine[(g, bid)] -= 1
                if p.job.is_store:
                    self.host_writes[slot] -= 1
                else:
                    self.host_reads[slot] -= 1
                    self.load_writes[(g, bid)] -= 1
            for counter in (self.busy_engine, self.load_writes, self.host_writes, self.host_reads):
                counter += Counter()  # drop zero counts

    def flush(self, job_ids: Iterable[int]) -> None:
        """Finish every part of ``job_ids`` now (ids already finished: nothing to do)."""
        submitted = {job.job_id for _, job in self.submitted}
        for job_id in job_ids:
            assert job_id in submitted, f"flush of job {job_id}, which the worker was never given"
            self.flushed.append(job_id)
            self.complete([job_id])

    def complete(
        self, job_ids: Iterable[int] | None = None, workers: Iterable[int] | None = None
    ) -> None:
        """Finish the parts of ``job_ids`` (default: every unfinished job) of ``workers``
        (default: all)."""
        ids = list(self.pending) if job_ids is None else list(job_ids)
        for job_id in ids:
            p = self.pending.get(job_id)
            if p is None:
                continue
            for w in sorted(p.parts if workers is None else set(workers) & p.parts.keys()):
                self._run_part(p, w)

    def poll(self, step: int) -> list[TransferResult]:
        """Finish the parts due by ``step``; return every result not yet reported."""
        for job_id in list(self.pending):
            p = self.pending[job_id]
            for w, (due, _) in sorted(p.parts.items()):
                if due is not None and due <= step:
                    self._run_part(p, w)
        out, self.results = self.results, []
        return out

    def has_pending(self) -> bool:
        return bool(self.pending or self.results)

    def is_busy(self, g: int, bid: int) -> bool:
        return self.busy_engine[(g, bid)] > 0

    def jobs(self, req_id: str | None = None, stores: bool | None = None) -> list[TransferJob]:
        """Submitted jobs, optionally of one request and one direction."""
        return [
            job
            for _, job in self.submitted
            if (req_id is None or job.req_id == req_id)
            and (stores is None or job.is_store == stores)
        ]


# ---------------------------------------------------------------------------------------------
# The engine


@dataclass
class Lookup:
    """One ``get_num_new_matched_tokens`` call: step, request, prefix-cache hit, answer."""

    step: int
    req_id: str
    local_hit: int
    external: int | None


@dataclass
class StepRecord:
    """What happened in one step."""

    step: int
    output: SchedulerOutput
    meta: ConnectorMetadata
    results: list[TransferResult]
    update: ConnectorUpdate
    finished: list[str] = field(default_factory=list)


class FakeEngine:
    """A vLLM-like scheduler loop around the real connector (see the module docstring).

    ``num_engine_blocks``: blocks per group (one number for all, or one per group).
    ``delay``/``fail`` configure the executor (defaults: ``store_delay``/``load_delay`` steps, no
    failures). ``manager`` defaults to a :class:`RecordingManager` of ``num_host_blocks`` blocks.
    """

    def __init__(
        self,
        config: SchedulerOffloadConfig,
        *,
        num_engine_blocks: int | Sequence[int] = 64,
        num_host_blocks: int = 64,
        token_budget: int = 64,
        eviction_policy: str = "lru",
        manager: CPUOffloadingManager | None = None,
        enable_prefix_caching: bool = True,
        load_delay: int | None = 0,
        store_delay: int | None = 0,
        delay: Callable[[TransferJob, int], int | None] | None = None,
        fail: Callable[[TransferJob, int], bool] | None = None,
        hash_scheme: str = "xxh3_128",
    ) -> None:
        self.config = config
        self.manager = (
            manager if manager is not None else RecordingManager(num_host_blocks, eviction_policy)
        )
        self.connector = OffloadingConnectorScheduler(config, self.manager)
        self.hasher = BlockHasher(config.hash_block_size, hash_scheme)
        self.token_budget = token_budget
        self.enable_prefix_caching = enable_prefix_caching
        groups = config.groups
        for g, group in enumerate(groups):
            assert group.engine_block_size % config.hash_block_size == 0, (
                f"group {g}: engine block not hash-aligned"
            )
        self.windows: list[int | None] = [
            None
            if g.sliding_window_blocks is None
            else g.sliding_window_blocks * g.offloaded_block_size
            for g in groups
        ]
        self.alignment = math.lcm(*(g.engine_block_size for g in groups))
        sizes = (
            [num_engine_blocks] * len(groups)
            if isinstance(num_engine_blocks, int)
            else list(num_engine_blocks)
        )
        self.pools = [BlockPool(n) for n in sizes]
        nw = config.num_workers
        self.kv = [
            np.full((nw, n, g.engine_block_size), UNWRITTEN, dtype=np.int64)
            for n, g in zip(sizes, groups, strict=True)
        ]
        max_obs = max(g.offloaded_block_size for g in groups)
        self.host = np.full((nw, self.manager.num_blocks, max_obs), UNWRITTEN, dtype=np.int64)
        self.executor = TransferExecutor(
            self,
            delay
            if delay is not None
            else (lambda job, w: store_delay if job.is_store else load_delay),
            fail if fail is not None else (lambda job, w: False),
        )
        self.step_index = -1  # index of the last step run
        self.requests: dict[str, FakeRequest] = {}
        self.waiting: deque[FakeRequest] = deque()
        self.running: list[FakeRequest] = []
        self.loading: dict[str, FakeRequest] = {}
        self.delayed_free: dict[str, FakeRequest] = {}
        self.history: list[StepRecord] = []
        self.lookups: list[Lookup] = []
        self.key_values: dict[
            OffloadKey, np.ndarray
        ] = {}  # expected host content of every key seen
        self._allocated: list[tuple[int, int]] = []  # (group, block) newly allocated this step
        self.failed_load_reqs: list[str] = []  # requests the connector reported in failed_loads
        self._next_req = 0

    # ----------------------------------------------------------------- requests

    def add_request(
        self,
        prompt: Sequence[int],
        max_tokens: int = 1,
        kv_transfer_params: Mapping[str, Any] | None = None,
        req_id: str | None = None,
    ) -> FakeRequest:
        """Queue a request; it arrives at the next step."""
        if req_id is None:
            req_id = f"r{self._next_req}"
            self._next_req += 1
        assert req_id not in self.requests, f"duplicate request id {req_id}"
        assert len(prompt) >= 1 and max_tokens >= 1
        for g, (group, pool) in enumerate(zip(self.config.groups, self.pools, strict=True)):
            tokens = len(prompt) + max_tokens
            w = self.windows[g]
            if w is not None:  # a window group holds one chunk plus the window
                tokens = min(tokens, self.token_budget + w + group.engine_block_size)
            need = -(-tokens // group.engine_block_size)
            assert need <= pool.num_blocks, (
                f"{req_id} can never fit: {need} blocks > {pool.num_blocks}"
            )
        req = FakeRequest(
            req_id,
            prompt,
            max_tokens,
            kv_transfer_params,
            self.hasher,
            len(self.config.groups),
            self.step_index + 1,
        )
        self.requests[req_id] = req
        self.waiting.append(req)
        self._register_keys(req)
        return req

    def abort(self, req_id: str) -> None:
        """Abort a live request between steps (vLLM calls ``request_finished`` for it too)."""
        req = self.requests[req_id]
        if req.status == FINISHED:
            return
        req.aborted = True
        if req.status == WAITING:
            self.waiting.remove(req)
        elif req.status == LOADING:
            del self.loading[req_id]
        else:
            self.running.remove(req)
        self._finish(req)

    def _finish(self, req: FakeRequest) -> None:
        req.status = FINISHED
        req.finish_step = self.step_index
        delay_free, _ = self.connector.request_finished(req)
        if delay_free:
            self.delayed_free[req.request_id] = req
        else:
            self._free_blocks(req)

    def _register_keys(self, req: FakeRequest) -> None:
        """Remember the expected host content of every offloaded block of ``req`` (host oracle)."""
        hbs = self.config.hash_block_size
        for g, group in enumerate(self.config.groups):
            obs = group.offloaded_block_size
            per = obs // hbs
            salt = _group_salt(g)
            for i in range(len(req.block_hashes) // per):
                key = make_offload_key(req.block_hashes[(i + 1) * per - 1], g)
                if key not in self.key_values:
                    vals = np.array(req.values[i * obs : (i + 1) * obs], dtype=np.int64) ^ salt
                    self.key_values[key] = vals

    def offload_key(self, req: FakeRequest, block: int, group: int = 0) -> OffloadKey:
        """The key of offloaded block ``block`` of ``req`` in ``group``."""
        per = self.config.groups[group].offloaded_block_size // self.config.hash_block_size
        return make_offload_key(req.block_hashes[(block + 1) * per - 1], group)

    # ----------------------------------------------------------------- prefix cache

    def _engine_key(self, req: FakeRequest, g: int, j: int) -> BlockHash:
        per = self.config.groups[g].engine_block_size // self.config.hash_block_size
        return req.block_hashes[(j + 1) * per - 1]

    def _window_start(self, g: int, computed: int) -> int:
        """First engine block of group ``g`` needed to compute position ``computed``."""
        w = self.windows[g]
        return 0 if w is None else max(0, computed - w) // self.config.groups[g].engine_block_size

    def _local_hit(self, req: FakeRequest) -> int:
        """Longest prefix (tokens) the engine prefix cache serves in every group."""
        if not self.enable_prefix_caching:
            return 0
        hit = req.num_tokens - 1
        for g, group in enumerate(self.config.groups):
            if self.windows[g] is not None:
                continue
            ebs, cached = group.engine_block_size, self.pools[g].cached
            n = 0
            while (n + 1) * ebs <= hit and self._engine_key(req, g, n) in cached:
                n += 1
            hit = min(hit, n * ebs)
        hit = hit // self.alignment * self.alignment
        while hit > 0 and not all(self._window_cached(req, g, hit) for g in range(len(self.pools))):
            hit -= self.alignment
        return hit

    def _window_cached(self, req: FakeRequest, g: int, hit: int) -> bool:
        if self.windows[g] is None:
            return True
        ebs, cached = self.config.groups[g].engine_block_size, self.pools[g].cached
        return all(
            self._engine_key(req, g, j) in cached
            for j in range(self._window_start(g, hit), hit // ebs)
        )

    def drop_prefix_cache(self) -> None:
        """Forget every cached block hash (blocks in use keep their contents)."""
        for pool in self.pools:
            pool.drop_cache()

    def evict_free_blocks(self, n: int) -> None:
        """Uncache up to ``n`` free cached blocks per group, least recently freed first (a
        finished request's tail goes first, so its head may stay: hits that end mid-block)."""
        for pool in self.pools:
            victims = [bid for bid in pool.free if bid in pool.hash_of][:n]
            for bid in victims:
                del pool.cached[pool.hash_of.pop(bid)]

    # ----------------------------------------------------------------- allocation

    def _try_admit(
        self, req: FakeRequest, local: int, computed: int, total: int
    ) -> list[list[int]] | None:
        """Allocate ``req``'s block table for ``total`` tokens, ``computed`` of them computed or
        loaded, the first ``local`` hit in the prefix cache; ``None`` (no change) if short."""
        plans: list[list[tuple[str, int]]] = []
        for g, (group, pool) in enumerate(zip(self.config.groups, self.pools, strict=True)):
            ebs = group.engine_block_size
            skip_before = self._window_start(g, computed)
            plan: list[tuple[str, int]] = []
            need = 0
            for j in range(-(-total // ebs)):
                if j < skip_before:
                    plan.append(("null", NULL_BLOCK_ID))
                elif (j + 1) * ebs <= local:
                    bid = pool.cached[self._engine_key(req, g, j)]
                    plan.append(("hit", bid))
                    need += pool.ref[bid] == 0
                else:
                    plan.append(("new", -1))
                    need += 1
            if need > len(pool.free):
                return None
            plans.append(plan)
        table: list[list[int]] = []
        for g, (pool, plan) in enumerate(zip(self.pools, plans, strict=True)):
            for kind, bid in plan:
                if kind == "hit":
                    pool.take_cached(
                        bid
                    )  # before allocating: allocation may evict free cached blocks
            ids = []
            for kind, bid in plan:
                if kind == "new":
                    bid = pool.allocate()
                    self._allocated.append((g, bid))
                ids.append(bid)
            table.append(ids)
        return table

    def _try_grow(self, req: FakeRequest, total: int) -> list[list[int]] | None:
        needs = [
            max(0, -(-total // g.engine_block_size) - len(t))
            for g, t in zip(self.config.groups, req.block_table, strict=True)
        ]
        if any(n > len(pool.free) for n, pool in zip(needs, self.pools, strict=True)):
            return None
        new: list[list[int]] = []
        for g, (n, pool) in enumerate(zip(needs, self.pools, strict=True)):
            ids = [pool.allocate() for _ in range(n)]
            self._allocated.extend((g, bid) for bid in ids)
            req.block_table[g].extend(ids)
            new.append(ids)
        return new

    def _free_out_of_window(self, req: FakeRequest) -> None:
        for g, table in enumerate(req.block_table):
            if self.windows[g] is None:
                continue
            for j in range(min(self._window_start(g, req.num_computed_tokens), len(table))):
                if table[j] != NULL_BLOCK_ID:
                    self.pools[g].release(table[j])
                    table[j] = NULL_BLOCK_ID

    def _free_blocks(self, req: FakeRequest) -> None:
        for pool, table in zip(self.pools, req.block_table, strict=True):
            for bid in reversed(table):  # tail first: it is the least likely to be reused
                if bid != NULL_BLOCK_ID:
                    pool.release(bid)
        req.block_table = [[] for _ in self.pools]
        req.num_cached_blocks = [0] * len(self.pools)

    def _cache_computed(self, req: FakeRequest, upto: int) -> None:
        """Offer ``req``'s full blocks below token ``upto`` (computed or loaded) to the cache."""
        if not self.enable_prefix_caching:
            return
        for g, (group, pool) in enumerate(zip(self.config.groups, self.pools, strict=True)):
            table = req.block_table[g]
            n = min(upto // group.engine_block_size, len(table))
            for j in range(req.num_cached_blocks[g], n):
                if table[j] != NULL_BLOCK_ID:
                    pool.cache(table[j], self._engine_key(req, g, j))
            req.num_cached_blocks[g] = max(req.num_cached_blocks[g], n)

    # ----------------------------------------------------------------- one step

    def _preempt(self, req: FakeRequest, out: SchedulerOutput) -> None:
        self._free_blocks(req)
        req.num_computed_tokens = 0
        req.status = WAITING
        req.num_preemptions += 1
        self.waiting.appendleft(req)
        out.preempted_req_ids.append(req.request_id)

    def _schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.token_budget
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            self._free_out_of_window(req)
            new = self._try_grow(req, req.num_computed_tokens + num_new)
            while new is None:
                victim = self.running.pop()
                self._preempt(victim, out)
                preempted = True
                if victim is req:
                    break
                new = self._try_grow(req, req.num_computed_tokens + num_new)
            if new is None:
                break
            out.scheduled.append(ScheduledRequest(req, num_new, new))
            budget -= num_new
            i += 1
        if preempted:
            return out
        for req in list(self.waiting):
            if budget <= 0:
                break
            local = self._local_hit(req)
            external, load_async = self.connector.get_num_new_matched_tokens(req, local)
            self.lookups.append(Lookup(self.step_index, req.request_id, local, external))
            if external is None:
                continue  # the connector cannot tell yet: ask again next step
            assert external >= 0 and local + external < req.num_tokens, (req, local, external)
            assert load_async == (external > 0)
            computed = local + external
            num_new = 0 if external else min(req.num_tokens - local, budget)
            table = self._try_admit(req, local, computed, computed + num_new)
            if table is None:
                break
            self.waiting.remove(req)
            req.block_table = table
            req.local_hit, req.load_end = local, computed
            req.num_cached_blocks = [local // g.engine_block_size for g in self.config.groups]
            self.connector.update_state_after_alloc(req, [list(t) for t in table], external)
            resumed = req.num_preemptions > 0
            if external:
                req.status = LOADING
                self.loading[req.request_id] = req
                continue
            req.num_computed_tokens = local
            req.status = RUNNING
            self.running.append(req)
            # update_state_after_alloc got the whole table; a resumed request re-sends it.
            new_ids = [list(t) for t in table] if resumed else [[] for _ in table]
            out.scheduled.append(ScheduledRequest(req, num_new, new_ids, resumed=resumed))
            budget -= num_new
        return out

    def _forward(self, out: SchedulerOutput) -> None:
        for s in out.scheduled:
            req = s.request
            assert isinstance(req, FakeRequest)
            self._check_request(req)  # what this forward pass reads
            start, end = req.num_computed_tokens, req.num_computed_tokens + s.num_scheduled_tokens
            for g, group in enumerate(self.config.groups):
                ebs, table, salt = group.engine_block_size, req.block_table[g], _group_salt(g)
                for j in range(start // ebs, -(-end // ebs)):
                    bid = table[j]
                    assert bid != NULL_BLOCK_ID, f"{req.request_id}: computing into a NULL block"
                    assert not self.executor.is_busy(g, bid), (
                        f"step {self.step_index}: forward pass writes engine block {bid} "
                        f"(group {g}) that an unfinished transfer uses"
                    )
                    lo, hi = max(start, j * ebs), min(end, (j + 1) * ebs)
                    vals = np.array(req.values[lo:hi], dtype=np.int64) ^ salt
                    self.kv[g][:, bid, lo - j * ebs : hi - j * ebs] = vals
            req.num_computed_tokens = end
            self._cache_computed(req, end)

    def _sample(self, out: SchedulerOutput, record: StepRecord) -> None:
        for s in out.scheduled:
            req = s.request
            assert isinstance(req, FakeRequest)
            if req.status != RUNNING or req.num_computed_tokens < req.num_tokens:
                continue
            req.append_token(req.values[-1] % VOCAB)
            self._register_keys(req)
            if req.first_token_step is None:
                req.first_token_step = self.step_index
            if len(req.output_token_ids) >= req.max_tokens:
                self.running.remove(req)
                self._finish(req)
                record.finished.append(req.request_id)

    def _apply(self, update: ConnectorUpdate) -> None:
        for req_id in update.loaded:
            req = self.loading.pop(req_id, None)
            if req is None:
                assert self.requests[req_id].status == FINISHED, (
                    f"{req_id} reported loaded without a load"
                )
                continue
            req.num_computed_tokens = req.load_end
            self._cache_computed(req, req.load_end)
            req.status = RUNNING
            self.running.append(req)
        for req_id in update.failed_loads:
            req = self.loading.pop(req_id, None)
            if req is None:
                assert self.requests[req_id].status == FINISHED, (
                    f"{req_id} reported failed without a load"
                )
                continue
            self.failed_load_reqs.append(req_id)
            if any(w is not None for w in self.windows):
                # Window groups hold NULL where the load would have made positions unnecessary;
                # recomputing needs them again: start over (lookup, allocation) like a preemption.
                self._free_blocks(req)
                req.num_computed_tokens = 0
                req.status = WAITING
                req.num_preemptions += 1
                self.waiting.appendleft(req)
                continue
            req.num_computed_tokens = req.local_hit  # the loaded blocks are garbage: recompute
            req.status = RUNNING
            self.running.append(req)
        for req_id in update.freed:
            req = self.delayed_free.pop(req_id, None)
            assert req is not None, f"{req_id} freed but its blocks were not kept"
            self._free_blocks(req)

    def step(self) -> StepRecord:
        """Run one engine step and check every invariant afterwards."""
        self.step_index += 1
        self._allocated = []
        out = self._schedule()
        meta = self.connector.build_connector_meta(out)
        self.executor.flush(meta.jobs_to_flush)
        for g, bid in self._allocated:
            assert not self.executor.is_busy(g, bid), (
                f"step {self.step_index}: engine block {bid} (group {g}) "
                "reallocated while a transfer uses it"
            )
        for job in meta.load_jobs:
            self.executor.submit(job, self.step_index)
        self._forward(out)
        for job in meta.store_jobs:
            self.executor.submit(job, self.step_index)
        record = StepRecord(self.step_index, out, meta, [], ConnectorUpdate())
        self._sample(out, record)
        record.results = self.executor.poll(self.step_index)
        record.update = self.connector.update_connector_output(record.results)
        self._apply(record.update)
        self.history.append(record)
        self.check()
        return record

    # ----------------------------------------------------------------- driving

    def is_idle(self) -> bool:
        """No live request, no kept blocks, no job planned or in flight."""
        return not (
            self.waiting
            or self.running
            or self.loading
            or self.delayed_free
            or self.connector.has_pending_jobs()
            or self.executor.has_pending()
        )

    def run(self, max_steps: int = 500) -> list[StepRecord]:
        """Step until idle; fail if that takes more than ``max_steps``."""
        records: list[StepRecord] = []
        for _ in range(max_steps):
            if self.is_idle():
                return records
            records.append(self.step())
        raise AssertionError(
            f"engine not idle after {max_steps} steps: "
            f"{self.waiting=} {self.running=} {self.loading=}"
        )

    def run_until(self, predicate: Callable[[], bool], max_steps: int = 200) -> None:
        """Step until ``predicate()`` holds."""
        for _ in range(max_steps):
            if predicate():
                return
            self.step()
        raise AssertionError(f"condition not reached in {max_steps} steps")

    # ----------------------------------------------------------------- checks

    def _check_request(self, req: FakeRequest) -> None:
        """Every computed position of ``req`` that the engine holds has its fresh value, on every
        worker."""
        nc = req.num_computed_tokens
        if nc == 0:
            return
        values = np.array(req.values[:nc], dtype=np.int64)
        for g, group in enumerate(self.config.groups):
            ebs, table = group.engine_block_size, req.block_table[g]
            nblocks = -(-nc // ebs)
            assert len(table) >= nblocks, (
                f"{req.request_id}: group {g} table shorter than its computed tokens"
            )
            ids = np.array(table[:nblocks], dtype=np.int64)
            held = ids != NULL_BLOCK_ID
            if self.windows[g] is None:
                assert held.all(), f"{req.request_id}: NULL block in full-attention group {g}"
            got = self.kv[g][:, ids[held]]  # [workers, held blocks, ebs]
            want = np.full((nblocks * ebs,), UNWRITTEN, dtype=np.int64)
            want[:nc] = values ^ _group_salt(g)
            want = want.reshape(nblocks, ebs)[held]
            mask = (np.arange(nblocks * ebs) < nc).reshape(nblocks, ebs)[held]
            bad = (got != want[None]) & mask[None]
            if bad.any():
                w, b, o = (int(x[0]) for x in np.nonzero(bad))
                j = int(np.nonzero(held)[0][b])
                raise AssertionError(
                    f"step {self.step_index}: {req.request_id} group {g} position {j * ebs + o} "
                    f"(engine block {table[j]}, worker {w}) holds {got[w, b, o]}, "
                    f"expected {want[b, o]}"
                )

    def check(self) -> None:
        """The per-step invariants: tier consistency, KV oracle, host oracle, block accounting."""
        self.manager.check_invariants()
        for req in self.running:
            self._check_request(req)
        for key, block in self.manager.items():
            if block.ref_cnt < 0:
                continue
            want = self.key_values.get(key)
            assert want is not None, f"tier holds a key no request ever had: {key.hex()}"
            got = self.host[:, block.slot, : len(want)]
            assert (got == want[None]).all(), (
                f"step {self.step_index}: tier block {key.hex()[:16]} holds wrong data"
            )
        for g, pool in enumerate(self.pools):
            refs: Counter[int] = Counter()
            for req in (*self.running, *self.loading.values(), *self.delayed_free.values()):
                refs.update(b for b in req.block_table[g] if b != NULL_BLOCK_ID)
            for req in self.waiting:
                assert not any(b != NULL_BLOCK_ID for b in req.block_table[g]), (
                    f"{req.request_id} waits with blocks"
                )
            for bid in range(pool.num_blocks):
                assert pool.ref[bid] == refs[bid], (
                    f"group {g} engine block {bid}: ref {pool.ref[bid]} != {refs[bid]}"
                )
                assert (pool.ref[bid] == 0) == (bid in pool.free), (
                    f"group {g} engine block {bid}: free list wrong"
                )

    def check_drained(self) -> None:
        """After everything finished: nothing pinned or pending, no state, no engine block held."""
        assert self.is_idle()
        assert not self.connector.has_pending_jobs()
        stats = self.connector.stats()
        assert stats["live_requests"] == 0, stats
        assert stats["jobs_in_flight"] == 0, stats
        for key, block in self.manager.items():
            assert block.ref_cnt == 0, (
                f"tier block {key.hex()[:16]} left with ref_cnt {block.ref_cnt}"
            )
        for g, pool in enumerate(self.pools):
            assert len(pool.free) == pool.num_blocks, (
                f"group {g}: {pool.num_blocks - len(pool.free)} engine blocks leaked"
            )

    # ----------------------------------------------------------------- helpers for tests

    def stored_keys(self) -> set[OffloadKey]:
        """Keys the tier holds, readable or not."""
        return {key for key, _ in self.manager.items()}

    def ready_keys(self) -> set[OffloadKey]:
        """Keys the tier can serve."""
        return {key for key, block in self.manager.items() if block.ref_cnt >= 0}

    def lookup_of(self, req_id: str) -> list[Lookup]:
        return [lk for lk in self.lookups if lk.req_id == req_id]

    def ttft_steps(self, req: FakeRequest) -> int:
        """Steps from arrival to first token, both counted."""
        assert req.first_token_step is not None
        return req.first_token_step - req.arrival_step + 1


def single_group(
    engine_block_size: int = 4,
    block_size_factor: int = 1,
    num_workers: int = 1,
    store_policy: str = "on_compute",
) -> SchedulerOffloadConfig:
    """One full-attention group hashed at the engine block size."""
    return SchedulerOffloadConfig.single_group(
        engine_block_size, block_size_factor, num_workers, store_policy
    )


def groups_config(
    *groups: GroupOffloadConfig,
    hash_block_size: int,
    num_workers: int = 1,
    store_policy: str = "on_compute",
) -> SchedulerOffloadConfig:
    """Several KV-cache groups."""
    return SchedulerOffloadConfig(tuple(groups), hash_block_size, num_workers, store_policy)


def spec_blocks(spec: LoadStoreSpec) -> list[int]:
    """The block ids of a GPU or CPU spec."""
    assert isinstance(spec, GPULoadStoreSpec | CPULoadStoreSpec)
    return list(spec.block_ids)

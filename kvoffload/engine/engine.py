"""The reference engine: model, paged KV cache, continuous batching, offloading and KV events.

It drives kvoffload exactly as vLLM drives its offloading connector. One step::

    worker results -> connector.update_connector_output -> resume / roll back / free
    scheduler.schedule (engine prefix cache, connector lookup, allocation, preemption)
    connector.build_connector_meta -> worker.handle_preemptions, worker.start_load_kv
    forward pass + sampling -> worker.wait_for_save
    advance requests, cache computed blocks, finish (connector.request_finished)
    publish this step's KV events (device cache in the order they happened, then the tier)
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from kvoffload.engine.admin import EngineAdmin
from kvoffload.engine.block_pool import BlockPool
from kvoffload.engine.config import RENAMED_SETTINGS, EngineConfig
from kvoffload.engine.device_events import DeviceEventRecorder
from kvoffload.engine.intake import RequestIntake, generate_params
from kvoffload.engine.loader import load_model, model_identity, resolve_device, resolve_dtype
from kvoffload.engine.offload_stack import DeviceCache, build_offload_stack
from kvoffload.engine.request import Request, RequestOutput, RequestStatus
from kvoffload.engine.runner import ModelRunner
from kvoffload.engine.sampling import SamplingParams
from kvoffload.engine.scheduler import EngineScheduler
from kvoffload.engine.telemetry import Telemetry
from kvoffload.errors import ConfigError, ContractError
from kvoffload.events import create_event_publisher
from kvoffload.events.messages import KVEventBatch
from kvoffload.keys import BlockHasher
from kvoffload.metrics import Snapshot
from kvoffload.validation import renamed_settings

__all__ = ["Engine"]

_GIB = 2**30
_COUNTERS = (
    "steps",
    "forward_tokens",
    "prompt_tokens",
    "prefilled_prompt_tokens",
    "output_tokens",
    "preemptions",
)
logger = logging.getLogger(__name__)


def _release(owned: list[Callable[[], object]]) -> None:
    """Shut down everything in ``owned``, the last acquired first; every one, whatever fails."""
    while owned:
        shutdown = owned.pop()
        try:
            shutdown()
        except Exception:
            logger.exception("engine shutdown: %r failed", shutdown)


class Engine:
    """A small, real LLM engine whose KV cache offloads through kvoffload.

    ``Engine(model="small", kv_offloading_size=4)``; then :meth:`generate`, or
    :meth:`add_request` + :meth:`step` for streaming control. Close it (or use ``with``) to stop
    the transfer threads and the event publisher; an engine dropped without ``close()`` releases
    them when it is garbage-collected, and a failed construction releases what it had acquired.
    """

    def __init__(self, model: str = "small", **kwargs: Any) -> None:
        known = {f.name for f in dataclasses.fields(EngineConfig) if f.init}
        for name in kwargs:
            if name not in known and name not in RENAMED_SETTINGS:
                raise ConfigError(name, f"unknown engine setting; known: {sorted(known)}")
        kwargs = renamed_settings(kwargs, RENAMED_SETTINGS, stacklevel=2)
        self.config = EngineConfig(model=model, **kwargs)
        # Shutdown callables of what this engine owns (copy threads and host pool, the event
        # publisher's thread and socket), run on close(), on a failed construction and when the
        # engine is garbage-collected. The finalizer holds the resources, never the engine.
        self._owned: list[Callable[[], object]] = []
        self._finalizer = weakref.finalize(self, _release, self._owned)
        try:
            self._build()
        except BaseException:
            self._finalizer()
            raise

    def _build(self) -> None:
        config = self.config
        shared = config.offloading and (config.kv_disk_path or config.kv_remote_url) is not None
        named_before_loading = self._model_identity() if shared else None
        self.model, self.model_config, self.tokenizer = load_model(
            config.model, config.device, config.dtype, config.seed
        )
        self.num_device_blocks = self._device_cache_blocks()
        self.runner = self._allocate_device_cache()
        self.hasher = BlockHasher(config.block_size, config.hash_scheme, config.hash_seed)
        self.pool = BlockPool(self.num_device_blocks, enable_caching=config.enable_prefix_caching)
        self.publisher = create_event_publisher(config.events)
        self._owned.append(self.publisher.shutdown)
        self._device_events: DeviceEventRecorder | None = None
        if config.events.enable_kv_cache_events:
            self._device_events = DeviceEventRecorder(
                config.block_size, config.events.int_block_hashes
            )
            self.pool.on_evicted = self._device_events.on_evicted
        stack = None
        if config.offloading:
            device = DeviceCache(
                self.runner.kv_cache,
                self.num_device_blocks,
                self.model_config,
                lambda: self._loaded_model_identity(named_before_loading),
            )
            stack = build_offload_stack(
                config, device, self._device_events is not None, self._owned
            )
        self.worker = stack.worker if stack else None
        self.manager = stack.manager if stack else None
        self.tiering = stack.tiering if stack else None
        self.connector = stack.connector if stack else None
        self.scheduler = EngineScheduler(
            self.pool,
            config.block_size,
            config.max_num_batched_tokens,
            config.max_num_seqs,
            self.connector,
            config.scheduling_policy,
            config.scheduling_max_bypass,
        )
        self._requests: dict[str, Request] = {}  # live requests
        self._finished: list[RequestOutput] = []
        self._ids = itertools.count()
        self._counters = dict.fromkeys(_COUNTERS, 0)
        # step() holds it; metrics scrapes and stats lines read a consistent snapshot under it
        self._lock = threading.Lock()
        block_bytes = self.worker.bytes_per_offloaded_block if self.worker is not None else 0
        telemetry = Telemetry.start(self, config, block_bytes, stack is not None, self._owned)
        self.metrics = telemetry.metrics
        self.metrics_server = telemetry.metrics_server
        self._stats_logger = telemetry.stats_logger
        self._admin: EngineAdmin | None = None
        self._intake = RequestIntake.of(self)

    def _device_cache_blocks(self) -> int:
        """``num_device_blocks``, or as many blocks as ``kv_cache_memory`` GiB hold."""
        config = self.config
        if config.num_device_blocks:
            return config.num_device_blocks
        kv_bytes_per_block = self.model.kv_bytes_per_token() * config.block_size
        num_blocks = int(config.kv_cache_memory * _GIB) // kv_bytes_per_block
        if num_blocks <= 0:
            raise ConfigError(
                "kv_cache_memory",
                f"{config.kv_cache_memory} GiB holds no block of {kv_bytes_per_block} bytes",
            )
        return num_blocks

    def _allocate_device_cache(self) -> ModelRunner:
        config, num_blocks, bs = self.config, self.num_device_blocks, self.config.block_size
        kv_bytes_per_block = self.model.kv_bytes_per_token() * bs
        try:
            if num_blocks * kv_bytes_per_block >= 2**63:
                raise MemoryError("larger than any address space")
            return ModelRunner(self.model, num_blocks, bs, self.model_config.eos_token_id)
        except (RuntimeError, MemoryError) as exc:
            setting = "kv_cache_memory" if config.num_device_blocks is None else "num_device_blocks"
            raise ConfigError(
                setting,
                f"cannot allocate a device KV cache of {num_blocks} blocks x "
                f"{kv_bytes_per_block} bytes (block_size {bs}): {exc}",
            ) from exc

    def _model_identity(self) -> str:
        """The model's name in shared tiers, by content (:func:`model_identity`)."""
        config = self.config
        dtype = resolve_dtype(config.dtype, resolve_device(config.device))
        return model_identity(config.model, dtype, config.seed)

    def _loaded_model_identity(self, before: str | None) -> str:
        """The name of the weights this engine loaded: named before loading and again after
        (a ``stat`` per weight file, the digests being cached), so that a checkpoint rewritten
        while it was read is refused rather than named after weights other than those loaded."""
        after = self._model_identity()
        if before is not None and after != before:
            raise ConfigError(
                "model", f"the checkpoint in {self.config.model!r} changed while it was loaded"
            )
        return after

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        prompt: str | Sequence[int],
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> str:
        """Queue a request; returns its id. Bad request data (a prompt that is not text or token
        ids, or can never fit; sampling or transfer parameters of the wrong kind; an id in use)
        raises :class:`ConfigError` naming it."""
        token_ids, sampling = self._intake.check(prompt, sampling, request_id, kv_transfer_params)
        req_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        if req_id in self._requests or req_id in self.scheduler.held:
            # A finished request whose transfers still use its blocks keeps its id until they end.
            raise ConfigError("request_id", f"{req_id!r} is already in use")
        req = Request(
            req_id, token_ids, sampling, self.hasher, time.perf_counter(), kv_transfer_params
        )
        self._requests[req_id] = req
        self.scheduler.add(req)
        self._counters["prompt_tokens"] += len(token_ids)
        return req_id

    def tokenize(self, prompt: str | Sequence[int]) -> list[int]:
        """``prompt``'s token ids as :meth:`add_request` makes them (text encoded; ids checked);
        an empty prompt raises :class:`ConfigError`."""
        return self._intake.token_ids(prompt)

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; its blocks are freed once no transfer uses them."""
        req = self._requests.get(request_id)
        if req is not None and not req.status.finished:
            self._finish(req, RequestStatus.FINISHED_ABORTED)

    def live_output(self, request_id: str) -> tuple[list[int], list[dict[int, float]]] | None:
        """A live request's output so far: its generated token ids and their log-probabilities
        (empty unless asked for), as the engine's own lists: read them between steps, never
        change them (a server streams from them). ``None`` once the request finished."""
        req = self._requests.get(request_id)
        return None if req is None else (req.output_token_ids, req.logprobs)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that finished in it (and aborts since the last)."""
        if self._admin is not None:
            self._admin.expire()  # pins past their TTL go back to eviction first
        with self._lock:
            finished = self._step()
        if self._stats_logger is not None:
            self._stats_logger.maybe_log()
        return finished

    def _step(self) -> list[RequestOutput]:
        started = time.perf_counter()
        worker, connector = self.worker, self.connector
        if worker is not None and connector is not None:
            results = worker.get_finished()
            if results:
                self.metrics.observe_transfers(results)
            update = connector.update_connector_output(results)
            for req, new_cached in self.scheduler.apply_connector_update(update):
                if new_cached and self._device_events is not None:
                    # loaded blocks now in the device cache
                    self._device_events.stored(req, new_cached)
        plan = self.scheduler.schedule()
        self._counters["preemptions"] += len(plan.connector_output.preempted_req_ids)
        if worker is not None and connector is not None:
            meta = connector.build_connector_meta(plan.connector_output)
            worker.handle_preemptions(meta.jobs_to_flush)
            worker.start_load_kv(meta)
        sampled = self.runner.execute(plan.scheduled) if plan.scheduled else {}
        if worker is not None:
            worker.wait_for_save()
        now = time.perf_counter()
        if connector is not None:
            # What computing costs, for the load decision (load_policy "auto"), without the
            # step's waits for promotions; a step that left requests waiting would give a
            # loading request's room to them.
            awaited = connector.take_awaited_s()  # waiting for promotions is not computing
            if plan.scheduled:
                connector.costs.observe_step(plan.num_tokens, now - started - awaited)
            connector.costs.step_charged = not self.scheduler.waiting
        for req, n in plan.scheduled:
            req.num_computed_tokens += n
            new_cached = self.scheduler.cache_computed_blocks(req)
            if new_cached and self._device_events is not None:
                self._device_events.stored(req, new_cached)
            result = sampled.get(req.request_id)
            if result is not None:
                token, logprobs = result
                if logprobs is not None:
                    req.logprobs.append(logprobs)
                self._append(req, token, now)
        self._counters["steps"] += 1
        self._counters["forward_tokens"] += plan.num_tokens
        if self._device_events is not None:
            self._publish()
        if not plan.scheduled and worker is not None:
            # Nothing to compute: wait for a transfer (a load to resume, a store whose blocks are
            # held) instead of spinning; returns at once when none is in flight.
            landed = worker.wait_for_any(timeout=0.05)
            if not landed and self.tiering is not None and self.tiering.num_background_jobs():
                time.sleep(0.001)  # a promotion or cascade on a tier's threads: yield
        finished, self._finished = self._finished, []
        return finished

    def _append(self, req: Request, token: int, now: float) -> None:
        if req.first_token_time is None:
            req.first_token_time = now
            self._counters["prefilled_prompt_tokens"] += req.num_prompt_tokens
            self.metrics.observe_token(now - req.arrival_time, None)
        else:
            itl = now - req.last_token_time
            req.inter_token_latencies.append(itl)
            self.metrics.observe_token(None, itl)
        req.last_token_time = now
        req.append_token(token)
        self._counters["output_tokens"] += 1
        params = req.sampling_params
        if len(req.output_token_ids) >= params.max_tokens:
            self._finish(req, RequestStatus.FINISHED_LENGTH)
        elif len(req.output_token_ids) >= params.min_tokens and (
            token in params.stop_token_ids
            or (token == self.model_config.eos_token_id and not params.ignore_eos)
        ):
            self._finish(req, RequestStatus.FINISHED_STOPPED)

    def _finish(self, req: Request, status: RequestStatus) -> None:
        self.scheduler.finish(req, status)
        self._requests.pop(req.request_id, None)
        req.finish_time = time.perf_counter()
        self.metrics.observe_finished(req.finish_time - req.arrival_time)
        self._finished.append(self._output(req))

    def _output(self, req: Request) -> RequestOutput:
        first = req.first_token_time if req.first_token_time is not None else req.finish_time
        if req.finish_time is None or first is None:
            raise ContractError(f"request {req.request_id} has no output: it has not finished")
        return RequestOutput(
            request_id=req.request_id,
            prompt_token_ids=list(req.prompt_token_ids),
            output_token_ids=list(req.output_token_ids),
            finish_reason=req.status.value,
            text=self.tokenizer.decode(req.output_token_ids),
            num_prompt_tokens=req.num_prompt_tokens,
            cached_tokens_engine=max(0, req.cached_tokens_engine),
            cached_tokens_offload=req.cached_tokens_offload,
            ttft=first - req.arrival_time,
            latency=req.finish_time - req.arrival_time,
            num_preemptions=req.num_preemptions,
            inter_token_latencies=list(req.inter_token_latencies),
            logprobs=req.logprobs if req.sampling_params.logprobs is not None else None,
        )

    def generate(
        self,
        prompts: Iterable[str | Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        progress: Any = None,
    ) -> list[RequestOutput]:
        """Run ``prompts`` to completion; outputs in prompt order. ``progress``: a tqdm-like bar."""
        prompts, params = generate_params(prompts, sampling)
        ids = [self.add_request(p, s) for p, s in zip(prompts, params, strict=True)]
        wanted = set(ids)
        results: dict[str, RequestOutput] = {}
        while len(results) < len(ids):
            for out in self.step():
                if out.request_id in wanted:
                    results[out.request_id] = out
                    if progress is not None:
                        progress.update(1)
        return [results[i] for i in ids]

    def drain(self, timeout: float = 30.0) -> None:
        """Step until no transfer is in flight (stores of finished requests included)."""
        deadline = time.monotonic() + timeout
        while self.connector is not None and (
            self.connector.has_pending_jobs() or self.scheduler.held
        ):
            if time.monotonic() > deadline:
                raise TimeoutError(f"transfers still in flight after {timeout} s")
            self.step()

    # ------------------------------------------------------------------ operator controls

    @property
    def admin(self) -> EngineAdmin:
        """Operator controls: lookup, pin, unpin, clear, pins (:mod:`kvoffload.engine.admin`);
        made at first use (disk pins of an earlier run are held again then)."""
        if self._admin is None:
            self._admin = EngineAdmin(self, self.config.kv_pin_quota)
        return self._admin

    def warm(
        self, prompt: str | Sequence[int], tiers: Sequence[str] | str | None = None
    ) -> RequestOutput:
        """Compute ``prompt``'s KV and store it in ``tiers`` (default: all) with a prefill-only
        request (one token), promoting what disk or remote hold into the host on the way; returns
        once its stores landed. It steps the engine itself: outputs of other requests that finish
        meanwhile are not returned to anyone, so warm an engine that serves nothing else (a
        server warms with a request of its own instead)."""
        ids, sampling, params = self.admin.warm_request(prompt, tiers)
        req_id = self.add_request(ids, sampling, kv_transfer_params=params or None)
        out = None
        while out is None:
            out = next((o for o in self.step() if o.request_id == req_id), None)
        self.drain()
        return out

    def pin(
        self,
        prompt: str | Sequence[int],
        tiers: Sequence[str] | str = ("host",),
        owner: str = "operator",
        ttl_s: float | None = None,
    ) -> dict[str, Any]:
        """Pin ``prompt``'s blocks in ``tiers`` (:meth:`EngineAdmin.pin`), computing and storing
        them first (:meth:`warm`) when a tier does not hold them all."""
        from kvoffload.managers.pins import NotCached

        try:
            return self.admin.pin(prompt, tiers, owner, ttl_s)
        except NotCached:
            self.warm(prompt, tiers if tiers != ("host",) else None)
        return self.admin.pin(prompt, tiers, owner, ttl_s)

    def publish_events(self) -> None:
        """Publish the KV events gathered since the last step now (an operator's clear between
        steps); nothing when events are off."""
        if self._device_events is not None:
            self._publish()

    # ------------------------------------------------------------------ events

    def _publish(self) -> None:
        if self._device_events is None:
            raise ContractError("publishing device events of an engine without events")
        events = self._device_events.take()
        if self.connector is not None:
            events.extend(self.connector.take_events())
        if events:
            self.publisher.publish(KVEventBatch(time.time(), events))

    # ------------------------------------------------------------------ lifecycle

    def stats(self) -> dict[str, float]:
        """Engine counters and gauges, plus the connector's (``offload_``-prefixed) when
        offloading is on. ``prefix_cache_queries`` / ``prefix_cache_hits``: tokens each admission
        needed / found in the device prefix cache (see :mod:`kvoffload.metrics.stats`)."""
        out: dict[str, float] = dict(self._counters)
        scheduler, pool = self.scheduler, self.pool
        out["prefix_cache_queries"] = scheduler.prefix_cache_queries
        out["prefix_cache_hits"] = scheduler.prefix_cache_hits
        out["num_running"] = len(scheduler.running) + len(scheduler.loading)
        out["num_waiting"] = len(scheduler.waiting)
        out["device_blocks"] = self.num_device_blocks
        out["device_used_blocks"] = self.num_device_blocks - pool.num_free_blocks
        out["device_evicted_blocks"] = pool.num_evicted
        out["preempted_after_load"] = scheduler.num_preempted_after_load
        events = self.publisher.stats()
        out["events_published"] = events.get("published", 0)
        out["events_dropped"] = events.get("dropped", 0)
        if self.connector is not None:
            for name, value in self.connector.stats().items():
                out[f"offload_{name}"] = value
        return out

    def tier_stats(self) -> dict[str, dict[str, int]]:
        """Statistics per offloading tier (``{}`` without offloading); see
        :meth:`~kvoffload.manager_contract.OffloadingManager.tier_stats`."""
        return {} if self.manager is None else self.manager.tier_stats()

    def snapshot(self) -> Snapshot:
        """``(stats(), tier_stats())`` taken between two steps; safe from another thread."""
        with self._lock:
            return self.stats(), self.tier_stats()

    def close(self) -> None:
        """Finish the stores of finished requests when no request is live (so their blocks reach
        every tier, the disk too, for the next engine), then stop the metrics server, the tiers,
        the transfer threads (freeing the host pool) and the event publisher. Idempotent."""
        if self._finalizer.alive and self.connector is not None and not self._requests:
            try:
                self.drain()
            except TimeoutError as exc:
                logger.warning("closing with transfers still in flight: %s", exc)
        self._finalizer()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

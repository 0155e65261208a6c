"""The reference engine: model, paged KV cache, continuous batching, offloading and KV events.

It drives kvoffload exactly as vLLM drives its offloading connector. One step::

    worker results -> connector.update_connector_output -> resume / roll back / free
    scheduler.schedule (engine prefix cache, connector lookup, allocation, preemption)
    connector.build_connector_meta -> worker.handle_preemptions, worker.start_load_kv
    forward pass + sampling -> worker.wait_for_save
    advance requests, cache computed blocks, finish (connector.request_finished)
    publish this step's KV events (device cache first, then the offloading tier)
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from kvoffload.base import OffloadingManager
from kvoffload.engine.block_pool import BlockPool
from kvoffload.engine.loader import load_model
from kvoffload.engine.request import Request, RequestOutput, RequestStatus
from kvoffload.engine.runner import ModelRunner
from kvoffload.engine.sampling import SamplingParams
from kvoffload.engine.scheduler import EngineScheduler
from kvoffload.errors import ConfigError
from kvoffload.events import KVEventsConfig, create_event_publisher
from kvoffload.events.messages import (
    MEDIUM_GPU,
    BlockRemoved,
    BlockStored,
    KVCacheEvent,
    KVEventBatch,
    external_block_hash,
)
from kvoffload.eviction import available_eviction_policies
from kvoffload.keys import HASH_SCHEMES, BlockHash, BlockHasher
from kvoffload.managers import CPUOffloadingManager, FilterReusedOffloadingManager
from kvoffload.metrics import EngineMetrics, MetricsServer, Snapshot, StatsLogger
from kvoffload.scheduler import OffloadingConnectorScheduler, SchedulerOffloadConfig
from kvoffload.scheduler.connector import parse_kv_transfer_params
from kvoffload.scheduler.events import OffloadEventDescriber
from kvoffload.scheduler.policy import STORE_POLICIES
from kvoffload.worker import OffloadingConnectorWorker

__all__ = ["Engine", "EngineConfig"]

_GIB = 2**30
OFFLOADING_BACKENDS = ("native",)


@dataclass
class EngineConfig:
    """Everything an :class:`Engine` is built from. Invalid values raise :class:`ConfigError`.

    Device cache: ``num_device_blocks`` engine blocks of ``block_size`` tokens, or, when it is
    ``None``, as many as ``kv_cache_memory`` GiB hold. Offloading is on when
    ``kv_offloading_size`` (GiB of host memory) is > 0; an offloaded block is
    ``block_size * block_size_factor`` tokens. ``store_threshold >= 2`` stores a block only once
    that many requests have wanted it (reuse filter). ``metrics_port`` serves Prometheus metrics
    at ``http://metrics_host:metrics_port/metrics`` (0: any free port) while the engine is open;
    ``log_stats_interval`` > 0 logs a stats line every that many seconds.
    """

    model: str = "small"
    device: str = "cpu"
    dtype: str | None = None
    seed: int = 0
    block_size: int = 16
    num_device_blocks: int | None = None
    kv_cache_memory: float = 1.0
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 16
    enable_prefix_caching: bool = True
    kv_offloading_size: float = 0.0
    kv_offloading_backend: str = "native"
    block_size_factor: int = 1
    eviction_policy: str = "lru"
    store_policy: str = "on_compute"
    store_threshold: int = 0
    hash_scheme: str = "sha256_cbor"
    hash_seed: str = "0"
    kv_events_config: KVEventsConfig | dict[str, Any] | str | None = None
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    log_stats_interval: float = 0.0
    events: KVEventsConfig = field(init=False)

    def __post_init__(self) -> None:
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "block_size_factor"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(name, f"must be a positive integer, got {value!r}")
        if self.num_device_blocks is not None and (
            not isinstance(self.num_device_blocks, int) or self.num_device_blocks <= 0
        ):
            raise ConfigError(
                "num_device_blocks", f"must be a positive integer, got {self.num_device_blocks!r}"
            )
        if self.kv_cache_memory <= 0:
            raise ConfigError(
                "kv_cache_memory", f"must be positive (GiB), got {self.kv_cache_memory!r}"
            )
        if self.kv_offloading_size < 0:
            raise ConfigError(
                "kv_offloading_size",
                f"must be >= 0 (GiB; 0 disables offloading), got {self.kv_offloading_size!r}",
            )
        if self.kv_offloading_backend not in OFFLOADING_BACKENDS:
            raise ConfigError(
                "kv_offloading_backend",
                f"unknown backend {self.kv_offloading_backend!r}; choose from {list(OFFLOADING_BACKENDS)}",
            )
        if self.eviction_policy not in available_eviction_policies():
            raise ConfigError(
                "eviction_policy",
                f"unknown policy {self.eviction_policy!r}; choose from {available_eviction_policies()}",
            )
        if self.store_policy not in STORE_POLICIES:
            raise ConfigError(
                "store_policy",
                f"unknown store policy {self.store_policy!r}; choose from {sorted(STORE_POLICIES)}",
            )
        if not isinstance(self.store_threshold, int) or self.store_threshold < 0:
            raise ConfigError(
                "store_threshold", f"must be an integer >= 0, got {self.store_threshold!r}"
            )
        if self.hash_scheme not in HASH_SCHEMES:
            raise ConfigError(
                "hash_scheme",
                f"unknown scheme {self.hash_scheme!r}; choose from {sorted(HASH_SCHEMES)}",
            )
        port = self.metrics_port
        if port is not None and (
            not isinstance(port, int) or isinstance(port, bool) or not 0 <= port <= 65535
        ):
            raise ConfigError("metrics_port", f"must be a port in [0, 65535] or None, got {port!r}")
        interval = self.log_stats_interval
        if not isinstance(interval, (int, float)) or not math.isfinite(interval) or interval < 0:
            raise ConfigError(
                "log_stats_interval", f"must be a finite number of seconds >= 0, got {interval!r}"
            )
        events = self.kv_events_config
        if events is None:
            self.events = KVEventsConfig()
        elif isinstance(events, KVEventsConfig):
            self.events = events
        elif isinstance(events, str):
            self.events = KVEventsConfig.from_json(events)
        else:
            self.events = KVEventsConfig.from_dict(dict(events))

    @property
    def offloading(self) -> bool:
        return self.kv_offloading_size > 0


class Engine:
    """A small, real LLM engine whose KV cache offloads through kvoffload.

    ``Engine(model="small", kv_offloading_size=4)``; then :meth:`generate`, or
    :meth:`add_request` + :meth:`step` for streaming control. Close it (or use ``with``) to stop
    the transfer threads and the event publisher.
    """

    def __init__(self, model: str = "small", **kwargs: Any) -> None:
        self.config = config = EngineConfig(model=model, **kwargs)
        self.model, self.model_config, self.tokenizer = load_model(
            config.model, config.device, config.dtype, config.seed
        )
        bs = config.block_size
        kv_bytes_per_block = self.model.kv_bytes_per_token() * bs
        num_blocks = (
            config.num_device_blocks or int(config.kv_cache_memory * _GIB) // kv_bytes_per_block
        )
        if num_blocks <= 0:
            raise ConfigError(
                "kv_cache_memory",
                f"{config.kv_cache_memory} GiB holds no block of {kv_bytes_per_block} bytes",
            )
        self.num_device_blocks = num_blocks
        self.runner = ModelRunner(self.model, num_blocks, bs)
        self.hasher = BlockHasher(bs, config.hash_scheme, config.hash_seed)
        self.pool = BlockPool(num_blocks, enable_caching=config.enable_prefix_caching)
        self.publisher = create_event_publisher(config.events)
        self._events_on = config.events.enable_kv_cache_events
        self._gpu_events: list[KVCacheEvent] = []
        self._removed_gpu: list[bytes | int] = []
        if self._events_on:
            self.pool.on_evicted = self._on_device_evicted
        self.connector: OffloadingConnectorScheduler | None = None
        self.worker: OffloadingConnectorWorker | None = None
        self.manager: OffloadingManager | None = None
        if config.offloading:
            self._build_offloading()
        self.scheduler = EngineScheduler(
            self.pool, bs, config.max_num_batched_tokens, config.max_num_seqs, self.connector
        )
        self._requests: dict[str, Request] = {}  # live requests
        self._finished: list[RequestOutput] = []
        self._ids = itertools.count()
        self._counters = dict.fromkeys(
            (
                "steps",
                "forward_tokens",
                "prompt_tokens",
                "prefilled_prompt_tokens",
                "output_tokens",
                "preemptions",
            ),
            0,
        )
        # step() holds it; metrics scrapes and stats lines read a consistent snapshot under it
        self._lock = threading.Lock()
        block_bytes = self.worker.bytes_per_offloaded_block if self.worker is not None else 0
        directions = [("GPU", "CPU"), ("CPU", "GPU")] if self.worker is not None else []
        self.metrics = EngineMetrics(self.snapshot, block_bytes, directions)
        self._stats_logger = (
            StatsLogger(self.snapshot, config.log_stats_interval, block_bytes)
            if config.log_stats_interval > 0
            else None
        )
        self.metrics_server: MetricsServer | None = None
        if config.metrics_port is not None:
            try:
                self.metrics_server = MetricsServer(
                    self.metrics.registry, config.metrics_port, config.metrics_host
                )
            except BaseException:
                self.close()
                raise

    def _build_offloading(self) -> None:
        config = self.config
        worker = OffloadingConnectorWorker(
            config.block_size_factor, int(config.kv_offloading_size * _GIB)
        )
        worker.register_kv_caches([self.runner.kv_cache], num_blocks=self.num_device_blocks)
        manager: OffloadingManager = CPUOffloadingManager(
            worker.num_host_blocks, config.eviction_policy, enable_events=self._events_on
        )
        if config.store_threshold >= 2:
            manager = FilterReusedOffloadingManager(manager, config.store_threshold)
        sched_config = SchedulerOffloadConfig.single_group(
            config.block_size, config.block_size_factor, store_policy=config.store_policy
        )
        describer = (
            OffloadEventDescriber(config.events.int_block_hashes) if self._events_on else None
        )
        self.worker = worker
        self.manager = manager
        self.connector = OffloadingConnectorScheduler(sched_config, manager, describer)

    # ------------------------------------------------------------------ requests

    def add_request(
        self,
        prompt: str | Sequence[int],
        sampling: SamplingParams | None = None,
        request_id: str | None = None,
        kv_transfer_params: dict[str, Any] | None = None,
    ) -> str:
        """Queue a request; returns its id. A prompt that can never fit raises :class:`ConfigError`."""
        sampling = sampling or SamplingParams()
        token_ids = (
            self.tokenizer.encode(prompt) if isinstance(prompt, str) else [int(t) for t in prompt]
        )
        if not token_ids:
            raise ConfigError("prompt", "must not be empty")
        vocab = self.model_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ConfigError("prompt", f"token ids must be in [0, {vocab})")
        max_len = len(token_ids) + sampling.max_tokens
        capacity = self.num_device_blocks * self.config.block_size
        if max_len > capacity:
            raise ConfigError(
                "prompt",
                f"prompt + max_tokens = {max_len} tokens exceeds the device KV cache ({capacity} tokens)",
            )
        if max_len > self.model_config.max_position_embeddings:
            raise ConfigError(
                "prompt",
                f"{max_len} tokens exceed the model's {self.model_config.max_position_embeddings} positions",
            )
        if kv_transfer_params is not None:
            parse_kv_transfer_params(kv_transfer_params, self.config.store_policy)
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

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; its blocks are freed once no transfer uses them."""
        req = self._requests.get(request_id)
        if req is not None and not req.status.finished:
            self._finish(req, RequestStatus.FINISHED_ABORTED)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work

    # ------------------------------------------------------------------ stepping

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns the requests that finished in it (and aborts since the last)."""
        with self._lock:
            finished = self._step()
        if self._stats_logger is not None:
            self._stats_logger.maybe_log()
        return finished

    def _step(self) -> list[RequestOutput]:
        worker, connector = self.worker, self.connector
        if worker is not None and connector is not None:
            results = worker.get_finished()
            if results:
                self.metrics.observe_transfers(results)
            update = connector.update_connector_output(results)
            for req, new_cached in self.scheduler.apply_connector_update(update):
                if new_cached and self._events_on:
                    self._device_stored(req, new_cached)  # loaded blocks now in the device cache
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
        for req, n in plan.scheduled:
            req.num_computed_tokens += n
            new_cached = self.scheduler.cache_computed_blocks(req)
            if new_cached and self._events_on:
                self._device_stored(req, new_cached)
            result = sampled.get(req.request_id)
            if result is not None:
                token, logprobs = result
                if logprobs is not None:
                    req.logprobs.append(logprobs)
                self._append(req, token, now)
        self._counters["steps"] += 1
        self._counters["forward_tokens"] += plan.num_tokens
        if self._events_on:
            self._publish()
        if not plan.scheduled and worker is not None:
            # Nothing to compute: wait for a transfer (a load to resume, a store whose blocks are
            # held) instead of spinning; returns at once when none is in flight.
            worker.wait_for_any(timeout=0.05)
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
        elif token in params.stop_token_ids or (
            token == self.model_config.eos_token_id and not params.ignore_eos
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
        assert req.finish_time is not None and first is not None
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
        prompts = list(prompts)
        params = (
            sampling
            if isinstance(sampling, Sequence)
            else [sampling or SamplingParams()] * len(prompts)
        )
        if len(params) != len(prompts):
            raise ConfigError(
                "sampling", f"{len(params)} sampling params for {len(prompts)} prompts"
            )
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

    # ------------------------------------------------------------------ events

    def _on_device_evicted(self, block_hash: BlockHash) -> None:
        self._removed_gpu.append(
            external_block_hash(block_hash, self.config.events.int_block_hashes)
        )

    def _device_stored(self, req: Request, indices: list[int]) -> None:
        as_int, bs = self.config.events.int_block_hashes, self.config.block_size
        runs: list[list[int]] = []
        for i in indices:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            first, last = run[0], run[-1]
            parent = req.block_hashes[first - 1] if first else None
            self._gpu_events.append(
                BlockStored(
                    block_hashes=[external_block_hash(req.block_hashes[i], as_int) for i in run],
                    parent_block_hash=None
                    if parent is None
                    else external_block_hash(parent, as_int),
                    token_ids=req.all_token_ids[first * bs : (last + 1) * bs],
                    block_size=bs,
                    lora_id=None,
                    medium=MEDIUM_GPU,
                    lora_name=None,
                    group_idx=0,
                )
            )

    def _publish(self) -> None:
        events = self._gpu_events
        if self._removed_gpu:
            events.insert(0, BlockRemoved(self._removed_gpu, MEDIUM_GPU, group_idx=0))
            self._removed_gpu = []
        if self.connector is not None:
            events.extend(self.connector.take_events())
        if events:
            self.publisher.publish(KVEventBatch(time.time(), events))
        self._gpu_events = []

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
        events = self.publisher.stats()
        out["events_published"] = events.get("published", 0)
        out["events_dropped"] = events.get("dropped", 0)
        if self.connector is not None:
            for name, value in self.connector.stats().items():
                out[f"offload_{name}"] = value
        return out

    def tier_stats(self) -> dict[str, dict[str, int]]:
        """Statistics per offloading tier (``{}`` without offloading); see
        :meth:`~kvoffload.base.OffloadingManager.tier_stats`."""
        return {} if self.manager is None else self.manager.tier_stats()

    def snapshot(self) -> Snapshot:
        """``(stats(), tier_stats())`` taken between two steps; safe from another thread."""
        with self._lock:
            return self.stats(), self.tier_stats()

    def close(self) -> None:
        """Stop the metrics server, the transfer threads and the event publisher. Idempotent."""
        server = getattr(self, "metrics_server", None)
        if server is not None:
            server.close()
        if self.worker is not None:
            self.worker.shutdown()
        self.publisher.shutdown()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

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
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvoffload.base import OffloadingManager
from kvoffload.engine.block_pool import BlockPool
from kvoffload.engine.loader import DTYPES, load_model, resolve_device
from kvoffload.engine.request import Request, RequestOutput, RequestStatus
from kvoffload.engine.runner import ModelRunner
from kvoffload.engine.sampling import SamplingParams
from kvoffload.engine.scheduler import EngineScheduler
from kvoffload.errors import ConfigError, HostAllocationError
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
from kvoffload.managers.tiering import (
    CASCADE_MODES,
    TieringOffloadingManager,
    validate_tier_params,
)
from kvoffload.metrics import EngineMetrics, MetricsServer, Snapshot, StatsLogger
from kvoffload.scheduler import OffloadingConnectorScheduler, SchedulerOffloadConfig
from kvoffload.scheduler.connector import parse_kv_transfer_params
from kvoffload.scheduler.events import OffloadEventDescriber
from kvoffload.scheduler.policy import STORE_POLICIES
from kvoffload.tiers import KVLayout
from kvoffload.tiers.factory import (
    build_secondary_tiers,
    validate_disk_settings,
    validate_remote_settings,
)
from kvoffload.validation import check_bool, check_choice, check_int, check_real, check_str
from kvoffload.worker import OffloadingConnectorWorker

__all__ = ["Engine", "EngineConfig"]

_GIB = 2**30
_MAX_SEED = 2**64 - 1  # torch.manual_seed's range
_MAX_GIB = 2**33  # 2**63 bytes: more than any address space
logger = logging.getLogger(__name__)
OFFLOADING_BACKENDS = ("native",)


@dataclass
class EngineConfig:
    """Everything an :class:`Engine` is built from. Invalid values raise :class:`ConfigError`.

    Device cache: ``num_device_blocks`` engine blocks of ``block_size`` tokens, or, when it is
    ``None``, as many as ``kv_cache_memory`` GiB hold. Offloading is on when
    ``kv_offloading_size`` (GiB of host memory) is > 0; an offloaded block is
    ``block_size * block_size_factor`` tokens. ``store_threshold >= 2`` stores a block only once
    that many requests have wanted it (reuse filter). A disk tier behind the host tier is on when
    ``kv_disk_path`` is set (``kv_disk_size`` GiB on disk; ``docs/disk-tier.md``); blocks cascade
    to it per ``kv_tier_cascade`` (``write_through`` or ``on_evict``). A shared Redis / Valkey
    tier (behind the disk tier, if any) is on when ``kv_remote_url`` is set
    (``docs/remote-tier.md``); ``kv_remote_optional`` runs without it when the server is down at
    start, ``kv_remote_ttl`` (seconds) lets the server expire the blocks, and a block the server
    has not answered a lookup of within ``kv_remote_lookup_wait`` seconds is a miss for now (its
    request computes it rather than waiting on a slow server). A request whose blocks
    are being promoted from a secondary tier waits for them up to ``kv_lookup_retry_seconds``
    (and at least a few steps), then computes what it lacks. ``metrics_port`` serves
    Prometheus metrics at ``http://metrics_host:metrics_port/metrics`` (0: any free port) while
    the engine is open; ``log_stats_interval`` > 0 logs a stats line every that many seconds.
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
    eviction_policy: str = "adaptive"
    store_policy: str = "on_compute"
    store_threshold: int = 0
    kv_disk_path: str | None = None
    kv_disk_size: float = 0.0
    kv_disk_eviction_policy: str | None = None
    kv_disk_o_direct: bool = False
    kv_tier_cascade: str = "write_through"
    kv_lookup_retry_seconds: float = 2.0
    kv_remote_url: str | None = None
    kv_remote_optional: bool = False
    kv_remote_ttl: float | None = None
    kv_remote_lookup_wait: float = 0.25
    hash_scheme: str = "sha256_cbor"
    hash_seed: str = "0"
    kv_events_config: KVEventsConfig | dict[str, Any] | str | None = None
    metrics_port: int | None = None
    metrics_host: str = "127.0.0.1"
    log_stats_interval: float = 0.0
    events: KVEventsConfig = field(init=False)

    def __post_init__(self) -> None:
        check_str("model", self.model)
        resolve_device(check_str("device", self.device))
        if self.dtype is not None:
            check_choice("dtype", self.dtype, DTYPES)
        check_int("seed", self.seed, 0, _MAX_SEED)
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs", "block_size_factor"):
            check_int(name, getattr(self, name), 1)
        if self.num_device_blocks is not None:
            check_int("num_device_blocks", self.num_device_blocks, 1)
        check_real(
            "kv_cache_memory", self.kv_cache_memory, maximum=_MAX_GIB, positive=True, unit="GiB"
        )
        check_bool("enable_prefix_caching", self.enable_prefix_caching)
        check_real(
            "kv_offloading_size",
            self.kv_offloading_size,
            0,
            _MAX_GIB,
            unit="GiB; 0 disables offloading",
        )
        check_choice("kv_offloading_backend", self.kv_offloading_backend, OFFLOADING_BACKENDS)
        check_choice("eviction_policy", self.eviction_policy, available_eviction_policies())
        check_choice("store_policy", self.store_policy, STORE_POLICIES)
        check_int("store_threshold", self.store_threshold, 0)
        validate_disk_settings(self.kv_disk_path, self.kv_disk_size)
        check_bool("kv_disk_o_direct", self.kv_disk_o_direct)
        check_bool("kv_remote_optional", self.kv_remote_optional)
        if self.kv_disk_path is not None and not self.offloading:
            raise ConfigError(
                "kv_disk_path", "a disk tier needs the host tier: set kv_offloading_size > 0"
            )
        if self.kv_disk_eviction_policy is not None:
            check_choice(
                "kv_disk_eviction_policy",
                self.kv_disk_eviction_policy,
                available_eviction_policies(),
            )
        validate_remote_settings(
            self.kv_remote_url, self.kv_remote_ttl, self.kv_remote_lookup_wait
        )
        if self.kv_remote_url is not None and not self.offloading:
            raise ConfigError(
                "kv_remote_url", "a remote tier needs the host tier: set kv_offloading_size > 0"
            )
        check_choice("kv_tier_cascade", self.kv_tier_cascade, CASCADE_MODES)
        check_real("kv_lookup_retry_seconds", self.kv_lookup_retry_seconds, 0, unit="seconds")
        check_choice("hash_scheme", self.hash_scheme, HASH_SCHEMES)
        check_str("hash_seed", self.hash_seed, allow_empty=True)
        if self.metrics_port is not None:
            check_int("metrics_port", self.metrics_port, 0, 65535)
        check_str("metrics_host", self.metrics_host)
        check_real("log_stats_interval", self.log_stats_interval, 0, unit="seconds")
        events = self.kv_events_config
        if events is None:
            self.events = KVEventsConfig()
        elif isinstance(events, KVEventsConfig):
            self.events = events
        elif isinstance(events, str):
            self.events = KVEventsConfig.from_json(events)
        elif isinstance(events, Mapping):
            self.events = KVEventsConfig.from_dict(dict(events))
        else:
            raise ConfigError(
                "kv_events_config",
                f"must be a KVEventsConfig, a dict or a JSON string, got {events!r}",
            )

    @property
    def offloading(self) -> bool:
        return self.kv_offloading_size > 0


def _release(owned: list[Callable[[], object]]) -> None:
    """Shut down everything in ``owned``, the last acquired first; every one, whatever fails."""
    while owned:
        shutdown = owned.pop()
        try:
            shutdown()
        except Exception:
            logger.exception("engine shutdown: %r failed", shutdown)


def _weak_snapshot(engine: Engine) -> Callable[[], Snapshot]:
    """``engine.snapshot`` without a strong reference (empty once the engine is gone)."""
    ref = weakref.ref(engine)

    def snapshot() -> Snapshot:
        alive = ref()
        return ({}, {}) if alive is None else alive.snapshot()

    return snapshot


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
            if name not in known:
                raise ConfigError(name, f"unknown engine setting; known: {sorted(known)}")
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
        try:
            if num_blocks * kv_bytes_per_block >= 2**63:
                raise MemoryError("larger than any address space")
            self.runner = ModelRunner(self.model, num_blocks, bs)
        except (RuntimeError, MemoryError) as exc:
            setting = "kv_cache_memory" if config.num_device_blocks is None else "num_device_blocks"
            raise ConfigError(
                setting,
                f"cannot allocate a device KV cache of {num_blocks} blocks x "
                f"{kv_bytes_per_block} bytes (block_size {bs}): {exc}",
            ) from exc
        self.hasher = BlockHasher(bs, config.hash_scheme, config.hash_seed)
        self.pool = BlockPool(num_blocks, enable_caching=config.enable_prefix_caching)
        self.publisher = create_event_publisher(config.events)
        self._owned.append(self.publisher.shutdown)
        self._events_on = config.events.enable_kv_cache_events
        self._gpu_events: list[KVCacheEvent] = []
        self._removed_gpu: list[bytes | int] = []
        if self._events_on:
            self.pool.on_evicted = self._on_device_evicted
        self.connector: OffloadingConnectorScheduler | None = None
        self.worker: OffloadingConnectorWorker | None = None
        self.manager: OffloadingManager | None = None
        self.tiering: TieringOffloadingManager | None = None
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
        # Weakly bound: a metrics server thread must not keep a dropped engine alive.
        snapshot = _weak_snapshot(self)
        self.metrics = EngineMetrics(snapshot, block_bytes, directions)
        self._stats_logger = (
            StatsLogger(snapshot, config.log_stats_interval, block_bytes)
            if config.log_stats_interval > 0
            else None
        )
        self.metrics_server: MetricsServer | None = None
        if config.metrics_port is not None:
            self.metrics_server = MetricsServer(
                self.metrics.registry, config.metrics_port, config.metrics_host
            )
            self._owned.append(self.metrics_server.close)

    def _build_offloading(self) -> None:
        config = self.config
        host_bytes = int(config.kv_offloading_size * _GIB)
        block_bytes = self.model.kv_bytes_per_token() * config.block_size * config.block_size_factor
        if host_bytes < block_bytes:
            raise ConfigError(
                "kv_offloading_size",
                f"{config.kv_offloading_size} GiB ({host_bytes} bytes) holds no offloaded block: "
                f"one is {block_bytes} bytes (block_size {config.block_size} x "
                f"block_size_factor {config.block_size_factor} tokens); use at least "
                f"{block_bytes / _GIB:.3g} GiB",
            )
        worker = OffloadingConnectorWorker(config.block_size_factor, host_bytes)
        self._owned.append(worker.shutdown)
        try:
            worker.register_kv_caches(
                [self.runner.kv_cache], num_blocks=self.num_device_blocks, block_dim=0
            )
        except HostAllocationError as exc:
            raise ConfigError(
                "kv_offloading_size", f"{config.kv_offloading_size} GiB: {exc}"
            ) from exc
        host = CPUOffloadingManager(
            worker.num_host_blocks, config.eviction_policy, enable_events=self._events_on
        )
        manager: OffloadingManager = host
        tiers = build_secondary_tiers(
            config,
            worker.host_pool.memoryview(),
            self._kv_layout(worker.bytes_per_offloaded_block),
            self._events_on,
        )
        if tiers:
            self.tiering = tiering = TieringOffloadingManager(host, tiers, config.kv_tier_cascade)
            # Tier threads write into the host pool: they stop before the worker frees it.
            self._owned.append(lambda: (tiering.drain(), tiering.close()))
            manager = tiering
        if config.store_threshold >= 2:
            manager = FilterReusedOffloadingManager(manager, config.store_threshold)
        sched_config = SchedulerOffloadConfig.single_group(
            config.block_size,
            config.block_size_factor,
            store_policy=config.store_policy,
            max_lookup_retry_seconds=config.kv_lookup_retry_seconds,
        )
        describer = (
            OffloadEventDescriber(config.events.int_block_hashes) if self._events_on else None
        )
        self.worker = worker
        self.manager = manager
        self.connector = OffloadingConnectorScheduler(sched_config, manager, describer)

    def _kv_layout(self, block_bytes: int) -> KVLayout:
        """What an offloaded block's bytes mean (stored with every block a secondary tier holds).
        Preset models have random weights drawn from ``seed``, so the seed is part of the model."""
        config, mc = self.config, self.model_config
        model = config.model
        if not Path(model).is_dir():
            model = f"{model}@seed{config.seed}"
        return KVLayout(
            model=model,
            dtype=str(self.runner.kv_cache.dtype),
            tokens_per_block=config.block_size * config.block_size_factor,
            num_layers=mc.num_layers,
            num_kv_heads=mc.num_kv_heads,
            head_dim=mc.head_dim,
            block_bytes=block_bytes,
        )

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
        if sampling is None:
            sampling = SamplingParams()
        elif not isinstance(sampling, SamplingParams):
            raise ConfigError("sampling", f"must be a SamplingParams or None, got {sampling!r}")
        if request_id is not None and not isinstance(request_id, str):
            raise ConfigError("request_id", f"must be a str or None, got {request_id!r}")
        token_ids = self._token_ids(prompt)
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
            if self.tiering is not None:
                validate_tier_params(kv_transfer_params, self.tiering.tier_names)
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

    def _token_ids(self, prompt: Any) -> list[int]:
        """The prompt's token ids: text is encoded, a sequence must hold ints (not bools)."""
        if isinstance(prompt, str):
            token_ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, Sequence) and not isinstance(prompt, bytes | bytearray):
            token_ids = list(prompt)
            bad = next(
                (t for t in token_ids if isinstance(t, bool) or not isinstance(t, int)), None
            )
            if bad is not None:
                raise ConfigError("prompt", f"token ids must be integers, got {bad!r}")
        else:
            raise ConfigError("prompt", f"must be a str or a sequence of token ids, got {prompt!r}")
        if not token_ids:
            raise ConfigError("prompt", "must not be empty")
        return token_ids

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
        if isinstance(prompts, str | bytes) or not isinstance(prompts, Iterable):
            raise ConfigError("prompts", f"must be a list of prompts, got {prompts!r}")
        prompts = list(prompts)
        if isinstance(sampling, list | tuple):
            params = list(sampling)
        elif sampling is None or isinstance(sampling, SamplingParams):
            params = [sampling or SamplingParams()] * len(prompts)
        else:
            raise ConfigError(
                "sampling", f"must be a SamplingParams, a list of them or None, got {sampling!r}"
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

    def _flush_device_removals(self) -> None:
        """Queue the removals seen since the last device event as one ``BlockRemoved``.

        Device events are published in the order they happened: a step can cache a block (a
        load lands) and then evict it (its request is preempted, the block reused), and a router
        must end up without it. Consecutive removals are coalesced; nothing is reordered.
        """
        if self._removed_gpu:
            self._gpu_events.append(BlockRemoved(self._removed_gpu, MEDIUM_GPU, group_idx=0))
            self._removed_gpu = []

    def _device_stored(self, req: Request, indices: list[int]) -> None:
        self._flush_device_removals()
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
        self._flush_device_removals()
        events = self._gpu_events
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
        :meth:`~kvoffload.base.OffloadingManager.tier_stats`."""
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

"""The shared remote tier: offloaded blocks on a Redis or Valkey server, standalone or Cluster.

Engines on many machines that point at the same server (and run the same model, block size and
hash seed) load each other's blocks. ``docs/remote-tier.md`` covers setup and measurements.

Data: one Redis string per block, key ``kvo:<layout fingerprint hex>:<OffloadKey bytes>`` (so two
layouts never share a block; keys spread over every Cluster slot), value the self-checking
:mod:`~kvoffload.tiers.blockformat` header (``align=8``) followed by the host slot's bytes.

Threads: every method runs on the scheduler's thread and never touches the network. All tier
state (known answers, blocks being written, counters, events) belongs to that thread. Two
background threads do the I/O and post their outcomes to an inbox that the scheduler thread
applies at its next call:

* the lookup thread answers the keys :meth:`RedisTier.lookup` could not (``RETRY``) with one
  pipelined ``EXISTS`` round trip per batch, and refreshes the server's memory figures;
* the I/O thread runs store and load jobs (loads first) as pipelined ``SET`` / ``GET`` batches;
  in Cluster mode redis-py groups each pipeline per shard node.

Answers: ``HIT`` once a store of this tier completed or the server said the key exists; a
remote ``MISS`` is believed for ``miss_ttl_s`` (then asked again: another engine may have stored
it). A key unanswered after ``lookup_wait_s`` is a ``MISS`` for now, so a slow or dead server
delays a request by at most that long.

The server may evict or expire blocks at any time (``maxmemory``, ``ttl_s``): a ``HIT`` is a
promise the server may break, so a load of a vanished block fails with ``"missing"`` and the
engine recomputes (counted as ``vanished_blocks``). For the same reason invariant 4 of the tier
contract (a block being loaded is never evicted) holds only as far as the server keeps it.

Faults: a network error or timeout fails the batch's blocks (``"io"`` / ``"timeout"``; stores
dropped, loads recomputed) and marks the server down for a backoff that doubles up to
``max_backoff_s``; while down, lookups answer ``MISS`` and jobs fail at once without touching the
network. Credentials never appear in ``repr``, errors, logs or events.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import redis
from redis.cluster import RedisCluster
from redis.exceptions import MovedError

from kvoffload.base import LookupResult, OffloadingEvent, ReqContext
from kvoffload.errors import ConfigError
from kvoffload.keys import OffloadKey
from kvoffload.tiers.base import KVLayout, SecondaryTier, TierJob, TierJobResult
from kvoffload.tiers.blockformat import (
    CorruptBlockError,
    encode_header,
    parse_header,
    payload_checksum,
    verify_payload,
)
from kvoffload.tiers.redis_client import FramedValue, close_client, connect, error_cause
from kvoffload.tiers.redis_url import PASSWORD_ENV, SETTING, USERNAME_ENV, parse_redis_url

__all__ = ["RedisTier", "RemoteTierConfig", "remote_key_prefix"]

log = logging.getLogger(__name__)

#: Values are padded to 8 bytes, not to disk pages.
VALUE_ALIGN = 8
_LOAD_CAUSES = ("missing", "checksum", "layout", "corrupt", "io", "timeout")
_STORE_CAUSES = ("io", "timeout", "full")
_MIN_BACKOFF_S = 0.05
#: The result of a command not sent because the server is marked down.
_DOWN = redis.ConnectionError("the remote server is marked down (reconnect backoff)")


@dataclass(frozen=True, slots=True)
class RemoteTierConfig:
    """Settings of :class:`RedisTier` (``url`` is ``kv_remote_url``; see
    :mod:`~kvoffload.tiers.redis_url` for its forms)."""

    url: str
    #: Bound of every network call (connect, send, receive), seconds.
    timeout_s: float = 1.0
    #: Server-side expiry of stored blocks (``SET ... PX``); ``None`` keeps them until evicted.
    ttl_s: float | None = None
    #: A key the lookup thread has not answered after this long is a MISS for now.
    lookup_wait_s: float = 0.25
    #: A remote MISS is believed this long before the server is asked again.
    miss_ttl_s: float = 2.0
    #: Bytes of values per pipelined round trip (a batch is split into such chunks).
    pipeline_bytes: int = 16 << 20
    #: How often the server's memory figures are refreshed, seconds.
    stats_interval_s: float = 1.0
    #: The reconnect backoff doubles from 50 ms up to this, seconds.
    max_backoff_s: float = 5.0
    #: Most answers (hits and misses each) remembered locally; the oldest are forgotten first.
    max_known_keys: int = 1 << 20

    def __post_init__(self) -> None:
        positive = {
            "kv_remote_timeout": self.timeout_s,
            "kv_remote_lookup_wait_s": self.lookup_wait_s,
            "kv_remote_miss_ttl": self.miss_ttl_s,
            "kv_remote_stats_interval": self.stats_interval_s,
            "kv_remote_max_backoff": self.max_backoff_s,
        }
        if self.ttl_s is not None:
            positive["kv_remote_ttl_s"] = self.ttl_s
        for name, value in positive.items():
            if not (isinstance(value, int | float) and math.isfinite(value) and value > 0):
                raise ConfigError(name, f"must be a positive number of seconds, got {value!r}")
        for name, value in (
            ("kv_remote_pipeline_bytes", self.pipeline_bytes),
            ("kv_remote_max_known_keys", self.max_known_keys),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ConfigError(name, f"must be a positive integer, got {value!r}")


def remote_key_prefix(layout: KVLayout) -> bytes:
    """The prefix of every Redis key this layout's blocks are stored under."""
    return b"kvo:" + layout.fingerprint().hex().encode() + b":"


class _Job:
    """A queued job: the caller's job and the (key, slot) pairs that need the network."""

    __slots__ = ("is_store", "job", "work")

    def __init__(self, job: TierJob, is_store: bool, work: list[tuple[OffloadKey, int]]) -> None:
        self.job = job
        self.is_store = is_store
        self.work = work


class RedisTier(SecondaryTier):
    """A :class:`SecondaryTier` on a Redis / Valkey server or Cluster (see the module docstring).

    Events (medium ``STORAGE``, locality ``REMOTE``) are gathered only with ``enable_events``:
    blocks this tier stored, and blocks a load found gone (the server's own evictions are not
    seen). Construction connects and checks the server: an unreachable server or refused credentials
    raise :class:`ConfigError` naming ``kv_remote_url`` (password hidden).
    """

    name = "remote"
    locality = "REMOTE"

    def __init__(
        self,
        pool: memoryview,
        layout: KVLayout,
        config: RemoteTierConfig,
        enable_events: bool = False,
    ) -> None:
        super().__init__(pool, layout)
        self.config = config
        self._enable_events = enable_events
        self.url = parse_redis_url(config.url)
        self._flat = pool.cast("B") if pool.format != "B" or pool.ndim != 1 else pool
        self._block_bytes = layout.block_bytes
        self._fingerprint = layout.fingerprint()
        self._prefix = remote_key_prefix(layout)
        self._ttl_ms = None if config.ttl_s is None else max(1, round(config.ttl_s * 1000))
        self._closed = False

        # Scheduler-thread state.
        self._hits: dict[OffloadKey, None] = {}
        self._misses: dict[OffloadKey, float] = {}
        self._asked: dict[OffloadKey, float] = {}
        self._writing: set[OffloadKey] = set()
        self._events: list[OffloadingEvent] = []
        self._done_now: list[TierJobResult] = []
        self._counters: Counter[str] = Counter()

        # Shared with the background threads, under _lock.
        self._lock = threading.Lock()
        self._work_cv = threading.Condition(self._lock)
        self._lookup_cv = threading.Condition(self._lock)
        self._idle_cv = threading.Condition(self._lock)
        self._loads: deque[_Job] = deque()
        self._stores: deque[_Job] = deque()
        self._lookup_queue: list[OffloadKey] = []
        self._inbox: list[tuple[str, Any]] = []
        self._in_flight = 0
        self._stop = False
        # Written by the background threads, read anywhere (single attribute reads).
        self._down_until = 0.0
        self._backoff_s = _MIN_BACKOFF_S
        self._server: dict[str, int] = {}
        self._server_base: dict[str, int] | None = None
        self._io_counters: Counter[str] = Counter()

        self._client, self._zero_copy = self._connect()
        self._shards = (
            ThreadPoolExecutor(max_workers=16, thread_name_prefix="kvo-remote-shard")
            if self.url.cluster
            else None
        )
        self._threads = [
            threading.Thread(target=self._io_loop, name="kvo-remote-io", daemon=True),
            threading.Thread(target=self._lookup_loop, name="kvo-remote-lookup", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def __repr__(self) -> str:
        return f"RedisTier({self.url.redacted()!r})"

    # ----------------------------------------------------------------- setup

    def _connect(self) -> tuple[Any, bool]:
        where = self.url.redacted()
        client = None
        try:
            client, zero_copy = connect(self.url, self.config.timeout_s)
            client.ping()
            self._server = self._read_server_figures(client)
        except redis.AuthenticationError as exc:
            problem = (
                f"{where}: the server refused the credentials (from the URL or the "
                f"{USERNAME_ENV} / {PASSWORD_ENV} environment): {self.url.scrub(str(exc))}"
            )
        except (redis.RedisError, OSError) as exc:
            problem = self._tls_problem(str(exc)) or (
                f"cannot reach {where}: {self.url.scrub(str(exc)) or type(exc).__name__} "
                "(start the server, fix the URL, or set kv_remote_optional to run without "
                "the remote tier)"
            )
        else:
            self._server_base = dict(self._server)
            return client, zero_copy
        if client is not None:
            close_client(client)
        raise ConfigError(SETTING, problem)

    def _tls_problem(self, error: str) -> str | None:
        """What to say when the server's TLS certificate failed verification (``None``
        otherwise): which CA the URL trusts, and how to name the right one."""
        if not self.url.tls or "CERTIFICATE_VERIFY_FAILED" not in error:
            return None
        ca = dict(self.url.tls_options).get("ssl_ca_certs")
        trusted = f"ssl_ca_certs={ca}" if ca else "the system's CAs (no ssl_ca_certs given)"
        return (
            f"{self.url.redacted()}: the server's TLS certificate did not verify against "
            f"{trusted}: {self.url.scrub(error)} (give the CA that signed it in kv_remote_url: "
            "rediss://host:port/db?ssl_ca_certs=/path/to/ca.pem)"
        )

    # -------------------------------------------------------------- contract

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        if self._inbox:
            self._apply_inbox()
        if key in self._hits:
            return LookupResult.HIT
        if key in self._writing:
            return LookupResult.HIT_PENDING
        now = time.monotonic()
        expiry = self._misses.get(key)
        if expiry is not None and expiry > now:
            return LookupResult.MISS
        deadline = self._asked.get(key)
        if deadline is not None:
            return LookupResult.RETRY if now < deadline else LookupResult.MISS
        if now < self._down_until or self._closed:
            return LookupResult.MISS
        self._asked[key] = now + self.config.lookup_wait_s
        with self._lock:
            self._lookup_queue.append(key)
            if len(self._lookup_queue) == 1:
                self._lookup_cv.notify()
        return LookupResult.RETRY

    def submit_store(self, job: TierJob, ctx: ReqContext | None = None) -> None:
        if self._inbox:
            self._apply_inbox()
        work = []
        for key, slot in zip(job.keys, job.slots, strict=True):
            if key in self._hits or key in self._writing:
                continue  # held or being written: reported as stored
            self._writing.add(key)
            work.append((key, slot))
        self._enqueue(_Job(job, True, work))

    def submit_load(self, job: TierJob, ctx: ReqContext | None = None) -> None:
        if self._inbox:
            self._apply_inbox()
        self._enqueue(_Job(job, False, list(zip(job.keys, job.slots, strict=True))))

    def _enqueue(self, queued: _Job) -> None:
        if not queued.work or self._closed:
            failed = dict.fromkeys((key for key, _ in queued.work), "io")
            self._done_now.append(self._finish_job(queued, failed, 0, 0.0))
            return
        with self._lock:
            (self._stores if queued.is_store else self._loads).append(queued)
            self._in_flight += 1
            self._work_cv.notify()

    def get_finished_jobs(self) -> list[TierJobResult]:
        if self._inbox:
            self._apply_inbox()
        done, self._done_now = self._done_now, []
        return done

    def drain_jobs(self) -> None:
        with self._lock:
            while self._in_flight:
                self._idle_cv.wait()

    def take_events(self) -> list[OffloadingEvent]:
        if self._inbox:
            self._apply_inbox()
        events, self._events = self._events, []
        return events

    def reset(self) -> None:
        """Forget what this tier knows (answers, nothing being written); jobs finish first. The
        server's blocks stay: other engines share them, and a changed layout never reads them."""
        self.drain_jobs()
        self._apply_inbox()
        self._hits.clear()
        self._misses.clear()
        self._asked.clear()

    def stats(self) -> dict[str, int]:
        if self._inbox:
            self._apply_inbox()
        server, base = self._server, self._server_base or {}
        out = {
            "capacity_bytes": server.get("capacity_bytes", 0),
            "used_bytes": server.get("used_bytes", 0),
            "used_blocks": server.get("keys", 0),
            "evicted_blocks": sum(
                server.get(k, 0) - base.get(k, 0) for k in ("evicted_keys", "expired_keys")
            ),
            "stored_blocks": 0,
            "loaded_blocks": 0,
            "failed_load_blocks": 0,
            "failed_store_blocks": 0,
            "vanished_blocks": 0,
            "dropped_store_blocks": 0,
            "lookups_sent": 0,
            "lookup_round_trips": 0,
            "lookup_round_trip_us": 0,
            "connection_errors": 0,
            "reconnects": 0,
            "connected": int(time.monotonic() >= self._down_until),
            "known_hits": len(self._hits),
            **{f"failed_load_{c}": 0 for c in _LOAD_CAUSES},
            **{f"failed_store_{c}": 0 for c in _STORE_CAUSES},
        }
        out.update(self._counters)
        with self._lock:
            out.update(self._io_counters)
        return out

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        with self._lock:
            self._stop = True
            self._work_cv.notify_all()
            self._lookup_cv.notify_all()
        for thread in self._threads:
            thread.join()
        self._apply_inbox()
        if self._shards is not None:
            self._shards.shutdown()
        close_client(self._client)

    # ------------------------------------------------------ scheduler thread

    def _apply_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for kind, payload in inbox:
            if kind == "lookup":
                self._apply_answers(*payload)
            else:
                self._done_now.append(self._finish_job(*payload))

    def _apply_answers(self, keys: list[OffloadKey], exists: list[bool] | None) -> None:
        expiry = time.monotonic() + self.config.miss_ttl_s
        hits, misses, cap = self._hits, self._misses, self.config.max_known_keys
        for i, key in enumerate(keys):
            self._asked.pop(key, None)
            if key in hits or key in self._writing:
                continue
            if exists is not None and exists[i]:
                misses.pop(key, None)
                hits[key] = None
                if len(hits) > cap:
                    del hits[next(iter(hits))]
            else:
                misses.pop(key, None)  # re-insert: the oldest entries stay first
                misses[key] = expiry
                if len(misses) > cap:
                    del misses[next(iter(misses))]

    def _finish_job(
        self, queued: _Job, failed: dict[OffloadKey, str], num_bytes: int, seconds: float
    ) -> TierJobResult:
        counters = self._counters
        ok = [key for key, _ in queued.work if key not in failed]
        if queued.is_store:
            for key, _ in queued.work:
                self._writing.discard(key)
            for key in ok:
                self._misses.pop(key, None)
                self._hits[key] = None
            counters["stored_blocks"] += len(ok)
            if ok and self._enable_events:
                self._events.append(OffloadingEvent(ok, self.medium, False, self.locality))
        else:
            counters["loaded_blocks"] += len(ok)
            gone = [key for key in failed if key in self._hits]
            for key in gone:
                del self._hits[key]
            if gone and self._enable_events:
                self._events.append(OffloadingEvent(gone, self.medium, True, self.locality))
        kind = "store" if queued.is_store else "load"
        for cause in failed.values():
            counters[f"failed_{kind}_blocks"] += 1
            counters[f"failed_{kind}_{cause}"] += 1
            if queued.is_store and cause in ("io", "timeout"):
                counters["dropped_store_blocks"] += 1
            if not queued.is_store and cause == "missing":
                counters["vanished_blocks"] += 1
        return TierJobResult(queued.job.job_id, queued.is_store, failed, num_bytes, seconds)

    # ---------------------------------------------------- background threads

    def _post(self, kind: str, payload: Any) -> None:
        with self._lock:
            self._inbox.append((kind, payload))

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._io_counters[name] += n

    def _is_down(self) -> bool:
        return time.monotonic() < self._down_until

    def _mark_up(self) -> None:
        if self._backoff_s != _MIN_BACKOFF_S:
            self._backoff_s = _MIN_BACKOFF_S
            self._count("reconnects")
            log.info("remote tier %s reachable again", self.url.redacted())

    def _mark_down(self, exc: BaseException) -> None:
        self._count("connection_errors")
        self._down_until = time.monotonic() + self._backoff_s
        log.warning(
            "remote tier %s failed (%s: %s); retrying in %.2f s",
            self.url.redacted(),
            type(exc).__name__,
            self.url.scrub(str(exc)),
            self._backoff_s,
        )
        self._backoff_s = min(2 * self._backoff_s, self.config.max_backoff_s)

    def _io_loop(self) -> None:
        while True:
            with self._lock:
                while not (self._loads or self._stores or self._stop):
                    self._work_cv.wait()
                if self._stop:
                    queued_jobs = [*self._loads, *self._stores]
                    self._loads.clear()
                    self._stores.clear()
                    for queued in queued_jobs:
                        failed = dict.fromkeys((k for k, _ in queued.work), "io")
                        self._inbox.append(("job", (queued, failed, 0, 0.0)))
                    self._in_flight -= len(queued_jobs)
                    self._idle_cv.notify_all()
                    return
                queued = self._loads.popleft() if self._loads else self._stores.popleft()
            start = time.perf_counter()
            run = self._run_store if queued.is_store else self._run_load
            try:
                failed, num_bytes = run(queued.work)
            except Exception as exc:  # never let a job go unreported: it fails, serving goes on
                log.error("remote tier job failed: %s", self.url.scrub(repr(exc)))
                failed, num_bytes = dict.fromkeys((key for key, _ in queued.work), "io"), 0
            with self._lock:
                self._inbox.append(
                    ("job", (queued, failed, num_bytes, time.perf_counter() - start))
                )
                self._in_flight -= 1
                self._idle_cv.notify_all()

    def _chunks(self, work: list[tuple[OffloadKey, int]]) -> list[list[tuple[OffloadKey, int]]]:
        step = max(1, self.config.pipeline_bytes // (self._block_bytes + 64))
        return [work[i : i + step] for i in range(0, len(work), step)]

    def _round_trip(self, redis_keys: list[bytes], add: Callable[[Any, int], object]) -> list[Any]:
        """One pipelined round trip: ``add(pipe, i)`` queues the command of ``redis_keys[i]``.
        Returns one result per key, an exception for each key whose command failed. A whole
        round trip that fails marks the server down; while it is down nothing is sent."""
        if self._is_down():
            return [_DOWN] * len(redis_keys)
        if self._shards is None:
            pipe = self._client.pipeline(transaction=False)
            for i in range(len(redis_keys)):
                add(pipe, i)
            return self._execute(pipe, len(redis_keys))
        return self._cluster_round_trip(redis_keys, add)

    def _execute(self, pipe: Any, n: int) -> list[Any]:
        try:
            results = pipe.execute(raise_on_error=False)
        except (redis.RedisError, OSError) as exc:
            self._mark_down(exc)
            return [exc] * n
        self._mark_up()
        return results

    def _cluster_round_trip(
        self, redis_keys: list[bytes], add: Callable[[Any, int], object]
    ) -> list[Any]:
        """Group the keys per shard node and run one pipeline per node, all nodes at once.

        redis-py's own cluster pipeline retries every failed command one by one, each up to
        the socket timeout, so a hung shard would stall a batch for ``n x timeout``; here a
        node's batch costs one timeout at most, and only that node's keys fail."""
        client = self._client
        results: list[Any] = [None] * len(redis_keys)
        groups: dict[str, tuple[Any, list[int]]] = {}
        uncovered: BaseException | None = None
        for i, rkey in enumerate(redis_keys):
            try:
                node = client.get_node_from_key(rkey)
            except (redis.RedisError, OSError) as exc:  # its slot has no master (failover)
                results[i] = uncovered = exc
                continue
            groups.setdefault(node.name, (node, []))[1].append(i)

        def run(node: Any, indices: list[int]) -> list[Any]:
            pipe = client.get_redis_connection(node).pipeline(transaction=False)
            for i in indices:
                add(pipe, i)
            try:
                return pipe.execute(raise_on_error=False)
            except (redis.RedisError, OSError) as exc:
                return [exc] * len(indices)

        futures = [(self._shards.submit(run, node, idx), idx) for node, idx in groups.values()]
        broken: BaseException | None = uncovered
        for future, indices in futures:
            for i, result in zip(indices, future.result(), strict=True):
                results[i] = result
                if isinstance(result, redis.ConnectionError | redis.TimeoutError | MovedError):
                    broken = result
        if broken is None:
            self._mark_up()
        elif isinstance(broken, MovedError):
            self._refresh_topology(broken, down=False)
        else:
            self._refresh_topology(broken)
        return results

    def _refresh_topology(self, exc: BaseException, down: bool = True) -> None:
        """Follow a failover or resharding: re-read the slot map (best effort)."""
        if down:
            self._mark_down(exc)
        with contextlib.suppress(redis.RedisError, OSError):
            self._client.nodes_manager.initialize()

    def _run_store(self, work: list[tuple[OffloadKey, int]]) -> tuple[dict[OffloadKey, str], int]:
        failed: dict[OffloadKey, str] = {}
        flat, size, fp, prefix, ttl = (
            self._flat,
            self._block_bytes,
            self._fingerprint,
            self._prefix,
            self._ttl_ms,
        )
        stored = 0
        for chunk in self._chunks(work):

            def add(pipe: Any, i: int, chunk: list[tuple[OffloadKey, int]] = chunk) -> None:
                key, slot = chunk[i]
                payload = flat[slot * size : (slot + 1) * size]
                header = encode_header(fp, key, size, payload_checksum(payload), VALUE_ALIGN)
                value = FramedValue(header, payload) if self._zero_copy else header + payload
                pipe.set(prefix + key, value, px=ttl)

            results = self._round_trip([prefix + key for key, _ in chunk], add)
            for (key, _), result in zip(chunk, results, strict=True):
                if isinstance(result, BaseException):
                    failed[key] = error_cause(result)
                else:
                    stored += 1
        return failed, stored * size

    def _run_load(self, work: list[tuple[OffloadKey, int]]) -> tuple[dict[OffloadKey, str], int]:
        failed: dict[OffloadKey, str] = {}
        flat, size, fp, prefix = self._flat, self._block_bytes, self._fingerprint, self._prefix
        loaded = 0
        bad: list[bytes] = []
        for chunk in self._chunks(work):
            rkeys = [prefix + key for key, _ in chunk]
            results = self._round_trip(rkeys, lambda pipe, i, rkeys=rkeys: pipe.get(rkeys[i]))
            for (key, slot), value in zip(chunk, results, strict=True):
                if isinstance(value, BaseException):
                    failed[key] = error_cause(value)
                    continue
                if value is None:
                    failed[key] = "missing"
                    continue
                try:
                    header = parse_header(value, fp, key, VALUE_ALIGN)
                    if header.payload_len != size:
                        raise CorruptBlockError("corrupt", f"payload of {header.payload_len} B")
                    payload = memoryview(value)[header.header_len :]
                    verify_payload(header, payload)
                except CorruptBlockError as exc:
                    failed[key] = exc.cause
                    bad.append(prefix + key)
                    continue
                flat[slot * size : (slot + 1) * size] = payload
                loaded += 1
        if bad:  # best effort: values that can never be served go
            self._round_trip(bad, lambda pipe, i: pipe.delete(bad[i]))
        return failed, loaded * size

    def _lookup_loop(self) -> None:
        next_stats = time.monotonic() + self.config.stats_interval_s
        while True:
            with self._lock:
                while not self._lookup_queue and not self._stop:
                    timeout = next_stats - time.monotonic()
                    if timeout <= 0:
                        break
                    self._lookup_cv.wait(timeout)
                if self._stop:
                    return
                batch, self._lookup_queue = self._lookup_queue, []
            if batch:
                try:
                    answers = self._exists(batch)
                except Exception as exc:  # every asked key gets an answer, even on a bug
                    log.error("remote tier lookup failed: %s", self.url.scrub(repr(exc)))
                    answers = None
                self._post("lookup", (batch, answers))
            if time.monotonic() >= next_stats:
                next_stats = time.monotonic() + self.config.stats_interval_s
                if not self._is_down():
                    try:
                        self._server = self._read_server_figures(self._client)
                    except (redis.RedisError, OSError) as exc:
                        self._mark_down(exc)
                    except Exception as exc:  # figures are informative: keep the old ones
                        log.error("remote tier INFO failed: %s", self.url.scrub(repr(exc)))

    def _exists(self, keys: list[OffloadKey]) -> list[bool] | None:
        """One pipelined EXISTS round trip for ``keys``; ``None`` when the server is down."""
        if self._is_down():
            return None
        rkeys = [self._prefix + key for key in keys]
        self._count("lookups_sent", len(keys))
        start = time.perf_counter()
        results = self._round_trip(rkeys, lambda pipe, i: pipe.exists(rkeys[i]))
        self._count("lookup_round_trip_us", int((time.perf_counter() - start) * 1e6))
        self._count("lookup_round_trips")
        return [not isinstance(r, BaseException) and r > 0 for r in results]

    def _read_server_figures(self, client: Any) -> dict[str, int]:
        """Capacity, use, key count and eviction counters summed over the (master) nodes."""
        if isinstance(client, RedisCluster):
            per_node = client.info(
                "memory", "stats", "keyspace", target_nodes=RedisCluster.PRIMARIES
            )
            infos = [per_node] if "used_memory" in per_node else list(per_node.values())
        else:
            infos = [client.info("memory", "stats", "keyspace")]
        figures = Counter[str]()
        db = f"db{self.url.db}"
        for info in infos:
            maxmemory = int(info.get("maxmemory", 0))
            figures["capacity_bytes"] += maxmemory or int(info.get("total_system_memory", 0))
            figures["used_bytes"] += int(info.get("used_memory", 0))
            figures["evicted_keys"] += int(info.get("evicted_keys", 0))
            figures["expired_keys"] += int(info.get("expired_keys", 0))
            keyspace = info.get(db)
            figures["keys"] += int(keyspace["keys"]) if isinstance(keyspace, dict) else 0
        return dict(figures)

"""The shared remote tier: offloaded blocks on a Redis or Valkey server, standalone or Cluster.

Engines on many machines that point at the same server (and run the same model, block size and
hash seed) load each other's blocks. ``docs/remote-tier.md`` covers setup and measurements.

Data: one Redis string per block, key ``kvo:<layout fingerprint hex>:<OffloadKey bytes>`` (so two
layouts never share a block; keys spread over every Cluster slot), value the self-checking
:mod:`~kvoffload.tiers.blockformat` header (``align=8``) followed by the host slot's bytes, or by
their codec frame (``compression``, :mod:`kvoffload.tiers.codec`: encoded and decoded on the I/O
thread; lossy blocks under their own layout's keys).

Layers: :class:`RedisTier` keeps the tier contract, what it knows of the server's keys
(:class:`~kvoffload.tiers.redis.answers.RemoteAnswers`) and two threads; the network is the
:class:`~kvoffload.tiers.redis.transport.RedisTransport` under it (pipelines over several
connections, per-shard fan-out, topology, health), on
:class:`~kvoffload.tiers.redis.connection.RedisConnection` (RESP, values received straight into
host slots).

Threads: every method runs on the scheduler's thread and never touches the network. All tier
state (known answers, blocks being written, counters, events) belongs to that thread. Two
background threads do the I/O and post their outcomes to an inbox that the scheduler thread
applies at its next call:

* the lookup thread answers the keys :meth:`RedisTier.lookup` could not (``RETRY``) with one
  pipelined ``PTTL`` round trip per batch (existence and expiry in one answer), and refreshes
  the server's memory figures;
* the I/O thread runs store and load jobs (loads first), each spread by the transport over
  connections (and shards) in parallel.

Answers: ``HIT`` once a store of this tier completed or the server said the key exists, until
the server's expiry (``ttl_s``) if any; a remote ``MISS`` is believed for ``miss_ttl_s``. A key
unanswered after ``lookup_wait_s`` is a ``MISS`` for now, so a slow or dead server delays a
request by at most that long; a question that failed is no answer (asked again when the server
is back).

The server may evict or expire blocks at any time (``maxmemory``, ``ttl_s``): a ``HIT`` is a
promise the server may break, so a load of a vanished block fails with ``"missing"`` and the
engine recomputes (counted as ``vanished_blocks``). For the same reason invariant 4 of the tier
contract (a block being loaded is never evicted) holds only as far as the server keeps it.

Loads are verified in full (header, layout, length, xxh3 checksum); a value that can never be
served (garbage, another layout, a wrong length or type) fails its load and is deleted. A failed
load's slot may hold part of the bad value (the caller frees it, as for the disk tier).

Faults: a network error or timeout fails the keys of the connection it hit (``"io"`` /
``"timeout"``; stores dropped, loads recomputed) and marks the server down for a backoff that
doubles up to ``max_backoff_s``; while down, lookups answer ``MISS`` and jobs fail at once without
touching the network. Credentials never appear in ``repr``, errors, logs or events.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter, deque
from collections.abc import Sequence
from typing import Any

from kvoffload.errors import ConfigError
from kvoffload.keys import OffloadKey
from kvoffload.manager_contract import LookupResult, OffloadingEvent, ReqContext
from kvoffload.tiers.codec import BlockCodec
from kvoffload.tiers.contract import KVLayout, SecondaryTier, TierJob, TierJobResult
from kvoffload.tiers.redis.answers import FOREVER, RemoteAnswers
from kvoffload.tiers.redis.blocks import JobOutcome, RemoteBlocks
from kvoffload.tiers.redis.config import VALUE_ALIGN, RemoteTierConfig, remote_key_prefix
from kvoffload.tiers.redis.messages import cluster_node_problem, connect_problem
from kvoffload.tiers.redis.transport import RedisTransport
from kvoffload.tiers.redis.url import SETTING, parse_redis_url

__all__ = ["VALUE_ALIGN", "RedisTier", "RemoteTierConfig", "remote_key_prefix"]

log = logging.getLogger(__name__)

_LOAD_CAUSES = ("missing", "checksum", "layout", "corrupt", "io", "timeout")
_STORE_CAUSES = ("io", "timeout", "full")


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
    seen). Construction connects and checks the server: an unreachable server, refused
    credentials or a URL of the wrong mode (standalone / Cluster) raise :class:`ConfigError`
    naming ``kv_remote_url`` in one line (password hidden).
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
        self._closed = False

        # Scheduler-thread state.
        self._answers = RemoteAnswers(
            config.lookup_wait_s, config.miss_ttl_s, config.max_known_keys
        )
        self._events: list[OffloadingEvent] = []
        self._done_now: list[TierJobResult] = []
        self._counters: Counter[str] = Counter()

        # Shared with the background threads, under _lock.
        self._lock = threading.Lock()
        self._work_cv = threading.Condition(self._lock)
        self._lookup_cv = threading.Condition(self._lock)
        self._idle_cv = threading.Condition(self._lock)
        self._answered_cv = threading.Condition(self._lock)
        self._loads: deque[_Job] = deque()
        self._stores: deque[_Job] = deque()
        self._lookup_queue: list[OffloadKey] = []
        #: keys queued or being asked, whose answers are not in the inbox yet
        self._unanswered = 0
        self._inbox: list[tuple[str, Any]] = []
        self._in_flight = 0
        self._stop = False
        # Written by the lookup thread, read anywhere (single attribute reads).
        self._server: dict[str, int] = {}
        self._server_base: dict[str, int] = {}
        self._io_counters: Counter[str] = Counter()

        codec = BlockCodec(config.compression, layout, "kv_remote_compression")  # checked first
        self._transport = self._connect()
        ttl_ms = None if config.ttl_s is None else max(1, round(config.ttl_s * 1000))
        self._blocks = RemoteBlocks(
            pool, layout, self._transport, ttl_ms, self.url.namespace, codec
        )
        self._threads = [
            threading.Thread(target=self._io_loop, name="kvo-remote-io", daemon=True),
            threading.Thread(target=self._lookup_loop, name="kvo-remote-lookup", daemon=True),
        ]
        for thread in self._threads:
            thread.start()

    def __repr__(self) -> str:
        return f"RedisTier({self.url.redacted()!r})"

    def _connect(self) -> RedisTransport:
        """The transport, with the server checked: reachable, credentials accepted, the URL's
        mode (standalone or Cluster) the server's; else a one-line :class:`ConfigError`."""
        config = self.config
        transport = RedisTransport(
            self.url,
            config.timeout_s,
            connections=config.connections,
            pipeline_bytes=config.pipeline_bytes,
            max_backoff_s=config.max_backoff_s,
        )
        try:
            transport.start()
            self._server = transport.server_figures()
        except Exception as exc:
            transport.close()
            problem = connect_problem(self.url, exc, config.optional)
            raise ConfigError(SETTING, problem) from None
        if self._server.get("cluster_enabled") and not self.url.cluster:
            transport.close()
            raise ConfigError(SETTING, cluster_node_problem(self.url))
        self._server_base = dict(self._server)
        return transport

    # -------------------------------------------------------------- contract

    def lookup(self, key: OffloadKey, ctx: ReqContext) -> LookupResult:
        if self._inbox:
            self._apply_inbox()
        answer = self._answers.answer(key)
        if answer is not None:
            return answer
        now = time.monotonic()
        if self._closed or now < self._transport.down_until:
            return LookupResult.MISS
        self._answers.ask(key, now)
        with self._lock:
            self._lookup_queue.append(key)
            self._unanswered += 1
            if len(self._lookup_queue) == 1:
                self._lookup_cv.notify()
        return LookupResult.RETRY

    def wait_for_answers(self) -> None:
        """Wait up to ``answer_wait_s`` for the answers to every key asked so far, then apply
        them (a later :meth:`lookup` of those keys answers from them). Returns at once when
        nothing is being asked (a server marked down is not asked)."""
        wait_s = self.config.answer_wait_s
        if wait_s <= 0 or not self._unanswered:
            return
        start = time.perf_counter()
        deadline = time.monotonic() + wait_s
        with self._lock:
            while self._unanswered and not self._stop:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._answered_cv.wait(left)
            answered = not self._unanswered
        counters = self._counters
        counters["answer_waits"] += 1
        counters["answer_wait_us"] += int((time.perf_counter() - start) * 1e6)
        if not answered:
            counters["answer_wait_timeouts"] += 1
        self._apply_inbox()

    def forget_misses(self, keys: Sequence[OffloadKey]) -> None:
        misses = self._answers.misses
        for key in keys:
            misses.pop(key, None)

    def holds(self, key: OffloadKey, ctx: ReqContext) -> bool:
        """Whether the tier knows it holds ``key`` (a hit not expired) or is writing it; never
        asks the server."""
        if self._inbox:
            self._apply_inbox()
        return self._answers.holds(key)

    def submit_store(self, job: TierJob, ctx: ReqContext | None = None) -> None:
        if self._inbox:
            self._apply_inbox()
        answers = self._answers
        work = []
        for key, slot in zip(job.keys, job.slots, strict=True):
            if answers.holds(key):
                continue  # held or being written: reported as stored
            answers.writing.add(key)
            work.append((key, slot))
        self._enqueue(_Job(job, True, work))

    def submit_load(self, job: TierJob, ctx: ReqContext | None = None) -> None:
        if self._inbox:
            self._apply_inbox()
        self._enqueue(_Job(job, False, list(zip(job.keys, job.slots, strict=True))))

    def _enqueue(self, queued: _Job) -> None:
        if not queued.work or self._closed:
            failed = dict.fromkeys((key for key, _ in queued.work), "io")
            self._done_now.append(self._finish_job(queued, JobOutcome(failed, 0, 0.0)))
            self.result_signal.notify()
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
        self._answers.clear()

    def stats(self) -> dict[str, int]:
        if self._inbox:
            self._apply_inbox()
        server, base = self._server, self._server_base
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
            "answer_waits": 0,
            "answer_wait_us": 0,
            "answer_wait_timeouts": 0,
            "store_us": 0,
            "load_us": 0,
            "connection_errors": 0,
            "reconnects": 0,
            "connected": int(not self._transport.is_down()),
            "known_hits": len(self._answers.hits),
            **{f"failed_load_{c}": 0 for c in _LOAD_CAUSES},
            **{f"failed_store_{c}": 0 for c in _STORE_CAUSES},
        }
        out.update(self._counters)
        with self._lock:
            out.update(self._io_counters)
        out.update(self._transport.counters())
        out.update(self._blocks.codec.stats.as_stats())
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
        self._transport.close()

    # ------------------------------------------------------ scheduler thread

    def _apply_inbox(self) -> None:
        with self._lock:
            inbox, self._inbox = self._inbox, []
        for kind, payload in inbox:
            if kind == "lookup":
                self._answers.learned(*payload)
            else:
                self._done_now.append(self._finish_job(*payload))

    def _finish_job(self, queued: _Job, outcome: JobOutcome) -> TierJobResult:
        counters, answers, failed = self._counters, self._answers, outcome.failed
        ok = [key for key, _ in queued.work if key not in failed]
        if queued.is_store:
            answers.writing.difference_update(key for key, _ in queued.work)
            ttl = self.config.ttl_s
            answers.stored(ok, FOREVER if ttl is None else outcome.sent_at + ttl)
            counters["stored_blocks"] += len(ok)
            if ok and self._enable_events:
                self._events.append(OffloadingEvent(ok, self.medium, False, self.locality))
        else:
            counters["loaded_blocks"] += len(ok)
            gone = answers.gone(list(failed))
            if gone and self._enable_events:
                self._events.append(OffloadingEvent(gone, self.medium, True, self.locality))
        kind = "store" if queued.is_store else "load"
        counters[f"{kind}_us"] += int(outcome.seconds * 1e6)
        for cause in failed.values():
            counters[f"failed_{kind}_blocks"] += 1
            counters[f"failed_{kind}_{cause}"] += 1
            if queued.is_store and cause in ("io", "timeout"):
                counters["dropped_store_blocks"] += 1
            if not queued.is_store and cause == "missing":
                counters["vanished_blocks"] += 1
        return TierJobResult(
            queued.job.job_id, queued.is_store, failed, outcome.num_bytes, outcome.seconds
        )

    # ---------------------------------------------------- background threads

    def _io_loop(self) -> None:
        while True:
            with self._lock:
                while not (self._loads or self._stores or self._stop):
                    self._work_cv.wait()
                if self._stop:
                    self._fail_queued()
                    return
                queued = self._loads.popleft() if self._loads else self._stores.popleft()
            start = time.perf_counter()
            try:
                run = self._blocks.store if queued.is_store else self._blocks.load
                outcome = run(queued.work)
            except Exception as exc:  # never let a job go unreported: it fails, serving goes on
                log.error("remote tier job failed: %s", self.url.scrub(repr(exc)))
                outcome = JobOutcome(dict.fromkeys((key for key, _ in queued.work), "io"), 0, 0.0)
            outcome.seconds = time.perf_counter() - start
            with self._lock:
                self._inbox.append(("job", (queued, outcome)))
                self._in_flight -= 1
                self._idle_cv.notify_all()
            self.result_signal.notify()

    def _fail_queued(self) -> None:
        """On close (under the lock): every job not started fails ``"io"``."""
        queued_jobs = [*self._loads, *self._stores]
        self._loads.clear()
        self._stores.clear()
        for queued in queued_jobs:
            failed = dict.fromkeys((k for k, _ in queued.work), "io")
            self._inbox.append(("job", (queued, JobOutcome(failed, 0, 0.0))))
        self._in_flight -= len(queued_jobs)
        self._idle_cv.notify_all()
        if queued_jobs:
            self.result_signal.notify()

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
                asked_at = time.monotonic()
                try:
                    answers = self._ask(batch)
                except Exception as exc:  # every asked key gets an answer, even on a bug
                    log.error("remote tier lookup failed: %s", self.url.scrub(repr(exc)))
                    answers = [None] * len(batch)
                with self._lock:
                    self._inbox.append(("lookup", (batch, answers, asked_at)))
                    self._unanswered -= len(batch)
                    self._answered_cv.notify_all()
            if time.monotonic() >= next_stats:
                next_stats = time.monotonic() + self.config.stats_interval_s
                self._refresh_figures()

    def _ask(self, keys: list[OffloadKey]) -> list[int | None]:
        """One pipelined ``PTTL`` round trip for ``keys``: per key the remaining milliseconds
        (-1: no expiry, -2: missing), or ``None`` when unknown (the round trip failed)."""
        if self._transport.is_down():
            return [None] * len(keys)
        start = time.perf_counter()
        prefix = self._blocks.prefix
        results = self._transport.ttls([prefix + key for key in keys])
        elapsed_us = int((time.perf_counter() - start) * 1e6)
        with self._lock:
            self._io_counters["lookups_sent"] += len(keys)
            self._io_counters["lookup_round_trip_us"] += elapsed_us
            self._io_counters["lookup_round_trips"] += 1
        return [r if isinstance(r, int) else None for r in results]

    def _refresh_figures(self) -> None:
        if self._transport.is_down():
            return
        try:
            self._server = server = self._transport.server_figures()
        except OSError:
            return  # the transport marked the server down
        except Exception as exc:  # figures are informative: keep the old ones
            log.error("remote tier INFO failed: %s", self.url.scrub(repr(exc)))
            return
        if server.get("evicted_keys", 0) > self._server_base.get("evicted_keys", 0):
            self._blocks.codec.note_capacity_bound()  # the server evicts: room is what is short

"""Our scheduler-side manager stack behind vLLM 0.33's ``OffloadingManager`` interface.

:class:`KVOffloadManager` wraps any kvoffload :class:`~kvoffload.manager_contract.OffloadingManager` (as
:class:`~kvoffload.integrations.vllm.spec.KVOffloadSpec` builds it: our CPU manager and eviction
policy, our tiering manager with our tiers, our reuse filter) and translates per call:

* keys are the same bytes (block hash + 4-byte big-endian group), passed through;
* the request context becomes ours (:func:`kvoffload_context`), so per-request state of our
  policies, filter and tiering manager lives as long as vLLM's request context;
* our ``CPULoadStoreSpec(block_ids)`` becomes vLLM's ``CPULoadStoreSpec`` (the same slot ids:
  our host slots *are* vLLM's CPU chunk ids, so vLLM's CPU worker moves the bytes);
* ``LookupResult`` by name (ours has vLLM's four answers, ``RETRY`` included);
* our step hooks: ``step_begin`` (apply finished tier jobs) at the step's first
  lookup/prepare_store (as vLLM's tiering manager polls), ``step_end`` at ``on_schedule_end``;
* a retry budget: vLLM re-asks a lookup that answered ``RETRY``/``HIT_PENDING`` every step, with
  no end; once a request has waited ``lookup_retry_s`` for a key, it is answered ``MISS`` (it
  takes the prefix it has and recomputes the rest), as our own scheduler's budget does;
* ``load_policy``: ``auto`` answers ``MISS`` past the prefix of a hit that is cheaper to load
  than to compute (:mod:`~kvoffload.integrations.vllm.load_choice`, which looks ahead on the
  request's keys), ``never`` answers ``MISS`` to every lookup without asking the tiers (stores
  still happen), ``always`` passes every answer through. The costs it weighs
  (:class:`~kvoffload.scheduler.costs.LoadCosts`), measured in this process: computing, from
  the scheduler's own steps (``on_schedule_end`` to ``on_schedule_end`` while busy) against the
  tokens of the blocks offered to ``prepare_store`` in them (each computed full block is offered
  once; decode tokens, in no full block, fall into the fit's fixed part; one more step is not
  charged: vLLM's waiting queue is out of sight, and a loading request's step goes to the
  requests behind it); promotions, from the
  tiers' promotion times (``tier_stats``, every 16 steps). The host -> device load is vLLM's
  worker's copy, timed in the worker process only: it is priced at its prior, a fraction
  (``PRIOR_LOAD_FRACTION["host"]``) of computing the block;
* ``get_load_source``: the tier a loaded block came from (``host``; ``disk`` for a block our
  tiering manager promoted from the disk tier for this load; vLLM's ``EXTERNAL_UNSPECIFIED`` for
  the Redis tier), so vLLM's hit counters by source split host and disk hits;
* events: medium ``"CPU"``/``"STORAGE"`` and locality to vLLM's ``Medium``/``Locality``;
* stats: every counter and gauge of our ``stats()`` as one gauge ``kvoffload:manager`` labelled
  by ``stat``, with how long lookups that answered ``RETRY``/``HIT_PENDING`` kept the request
  waiting and how long an engine step takes while requests are in (``lookup_wait_s_p50``,
  ``engine_step_s_p50``, ...: :class:`~kvoffload.integrations.vllm.waits.LookupWaits`); only
  the gauges that changed go to vLLM each step, the summaries at most every second
  (:meth:`KVOffloadManager.get_stats`); all of it as JSON in ``kvoffload_stats_file``, when
  set, whenever the engine goes idle and at shutdown.

Not thread-safe, like our managers; vLLM enters it from its scheduler thread only (the default
no-op ``lock``).
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Iterable, Sequence
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import (
    OffloadingConnectorStats,
)
from vllm.v1.kv_offload.base import (
    LoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingManager,
    OffloadKey,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from kvoffload.integrations.vllm.compat import ConfigInfoMapping, our_key, our_keys, vllm_keys
from kvoffload.integrations.vllm.context import kvoffload_context
from kvoffload.integrations.vllm.load_choice import LoadChooser
from kvoffload.integrations.vllm.waits import LookupWaits
from kvoffload.manager_contract import LookupResult as KVOLookupResult
from kvoffload.manager_contract import OffloadingManager as KVOManager
from kvoffload.scheduler.costs import LoadCosts, check_load_policy

__all__ = ["STATS_METRIC", "SUMMARY_INTERVAL_S", "KVOffloadManager"]

STATS_METRIC = "kvoffload:manager"
#: Seconds between two publications of the summaries (cost estimates, wait quantiles).
SUMMARY_INTERVAL_S = 1.0
_LOOKUP = {result: LookupResult[result.name] for result in KVOLookupResult}
_FINAL = (KVOLookupResult.HIT, KVOLookupResult.MISS)
#: Our tier names as vLLM's cache-hit sources; another tier (``remote``: Redis) is vLLM's
#: ``EXTERNAL_UNSPECIFIED`` ("uninstrumented connector or remote store").
_SOURCES = {"host": CacheHitSource.HOST, "disk": CacheHitSource.DISK}


class KVOffloadManager(OffloadingManager):
    """vLLM's view of one kvoffload manager stack (see the module docstring).

    ``close`` is called at ``shutdown`` (our tiering manager's, which closes its tiers), then,
    if it succeeded, ``on_shutdown`` (the spec unmaps vLLM's shared pool there).
    """

    def __init__(
        self,
        manager: KVOManager,
        close: Any = None,
        on_shutdown: Any = None,
        config_info: ConfigInfoMapping | None = None,
        stats_file: str | None = None,
        lookup_retry_s: float = 2.0,
        load_policy: str = "auto",
        block_tokens: int = 16,
        costs: LoadCosts | None = None,
    ) -> None:
        self.inner = manager
        self.medium = Medium.CPU
        self._close = close
        self._on_shutdown = on_shutdown
        self._config_info = dict(config_info or {})
        self._step_begun = False
        self._busy = False  # this step called lookup
        self._computed = False  # this step called prepare_store (it computed tokens)
        self._was_busy = False  # the step before did either
        self._live: set[str] = set()  # vLLM's requests between on_new_request and finished
        self._sent: dict[str, float] = {}  # the gauges as vLLM last took them
        self._summary_due = 0.0  # when get_stats next adds the summaries
        self._retry_budget_s = lookup_retry_s
        self.budget_misses = 0  # lookups answered MISS because the request waited too long
        self.waits = LookupWaits()
        self._stats_file = stats_file
        self.load_policy = check_load_policy(load_policy, "kvoffload_load_policy")
        if costs is None:
            costs = LoadCosts(name for name in manager.tier_stats() if name != "host")
            # vLLM's waiting queue is out of our sight: take it as full (a loading request's
            # step goes to the others), so one more step is not charged.
            costs.step_charged = False
        self.costs = costs
        self.block_tokens = block_tokens
        self._chooser = LoadChooser(costs, block_tokens)
        self._step = 0
        self._step_started: float | None = None  # when the last busy step ended
        self._offered_keys = 0  # keys offered to prepare_store this step
        self._steps_to_poll = 0

    def _begin_step(self) -> None:
        if not self._step_begun:
            self._step_begun = True
            self.inner.step_begin()

    # -- lookups and transfers -------------------------------------------------------------------

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        self._begin_step()
        self._busy = True
        if self.load_policy == "never":
            return LookupResult.MISS
        ctx = kvoffload_context(req_context)
        if self.load_policy == "auto":
            inner_lookup = self.inner.lookup
            ours = our_key(key)  # the same bytes, our key type
            result = self._chooser.lookup(ours, ctx, self._step, lambda k: inner_lookup(k, ctx))
        else:
            result = self.inner.lookup(our_key(key), ctx)
        waited = self.waits.answered(key, result in _FINAL, req_context)
        if waited > self._retry_budget_s:
            # vLLM re-asks every step without end; past our budget the request takes the
            # prefix it has and recomputes from here (as our own scheduler's retry budget does).
            self.waits.answered(key, True, req_context)
            self.budget_misses += 1
            return LookupResult.MISS
        return _LOOKUP[result]

    def get_load_source(self, key: OffloadKey, req_context: ReqContext) -> CacheHitSource:
        # vLLM asks after prepare_load; our tiering manager remembers, for a promoted block's
        # first load, the tier it came from (vLLM's per-source hit counters then show disk hits
        # as disk, as vLLM's own tiering manager reports them).
        source = self.inner.load_source(our_key(key), kvoffload_context(req_context))
        return _SOURCES.get(source, CacheHitSource.EXTERNAL_UNSPECIFIED)

    def prepare_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> LoadStoreSpec:
        spec = self.inner.prepare_load(our_keys(keys), kvoffload_context(req_context))
        return CPULoadStoreSpec(spec.block_ids)  # type: ignore[attr-defined]

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.inner.touch(our_keys(keys), kvoffload_context(req_context))

    def complete_load(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        self.inner.complete_load(our_keys(keys), kvoffload_context(req_context))

    def prepare_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext
    ) -> PrepareStoreOutput | None:
        self._begin_step()
        self._computed = True
        self._offered_keys += len(keys)
        out = self.inner.prepare_store(our_keys(keys), kvoffload_context(req_context))
        if out is None:
            return None
        return PrepareStoreOutput(
            keys_to_store=vllm_keys(out.keys_to_store),
            store_spec=CPULoadStoreSpec(out.store_spec.block_ids),  # type: ignore[attr-defined]
            evicted_keys=vllm_keys(out.evicted_keys),
        )

    def complete_store(
        self, keys: Collection[OffloadKey], req_context: ReqContext, success: bool = True
    ) -> None:
        self.inner.complete_store(our_keys(keys), kvoffload_context(req_context), success)

    # -- requests and steps ----------------------------------------------------------------------

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        kvoffload_context(req_context)
        self._live.add(req_context.req_id)
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._live.discard(req_context.req_id)
        ctx = kvoffload_context(req_context)
        self._chooser.request_finished(ctx)
        self.inner.request_finished(ctx)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._begin_step()  # a step without lookups still applies finished tier jobs
        self.inner.step_end()
        self._step_begun = False
        self.waits.step_ended(bool(self._live))
        busy = self._busy or self._computed
        self._measure_step(busy)
        if self._was_busy and not busy:
            self.write_stats_file()  # the engine went idle (vLLM may never call shutdown)
        self._was_busy, self._busy, self._computed = busy, False, False

    def _measure_step(self, busy: bool) -> None:
        """Time the step that just ended (from the end of the last busy one) against the tokens
        of the blocks it offered to store; every 16 steps, fold in the tiers' promotions."""
        now = time.perf_counter()
        if self._step_started is not None:
            self.costs.observe_step(
                self._offered_keys * self.block_tokens, now - self._step_started
            )
        self._step_started = now if busy else None
        self._offered_keys = 0
        self._step += 1
        if self.costs.tiers:
            if self._steps_to_poll <= 0:
                self._steps_to_poll = 16
                self.costs.fold_promotions(self.inner.tier_stats())
            self._steps_to_poll -= 1

    def has_pending_work(self) -> bool:
        return self.inner.num_background_jobs() > 0

    # -- events, stats, lifecycle ----------------------------------------------------------------

    def take_events(self) -> Iterable[OffloadingEvent]:
        return [
            OffloadingEvent(
                keys=vllm_keys(event.keys),
                medium=Medium(event.medium),
                removed=event.removed,
                locality=Locality(event.locality) if event.locality else None,
            )
            for event in self.inner.take_events()
        ]

    def get_stats(self) -> OffloadingConnectorStats:
        """Our gauges that changed since vLLM last took them (vLLM asks every step and ships
        them to its API server, which sets each one: sending all ~90 every step cost both
        processes CPU the forward needs); the summaries (:meth:`load_stats`, the wait
        quantiles, which sort their samples) at most every :data:`SUMMARY_INTERVAL_S`. Most
        steps change none: vLLM then ships nothing. Prometheus keeps each gauge's last value;
        vLLM's log line lists those that changed in its interval."""
        stats = OffloadingConnectorStats()
        figures: dict[str, float] = dict(self.inner.stats())
        figures["retry_budget_misses"] = self.budget_misses
        now = time.monotonic()
        if now >= self._summary_due:
            self._summary_due = now + SUMMARY_INTERVAL_S
            figures.update(self.load_stats())
            for what, summary in self.waits.summary().items():
                for figure, amount in summary.items():
                    figures[f"{what}_{figure}"] = amount
        sent = self._sent
        for name, value in figures.items():
            if sent.get(name) != value:
                sent[name] = value
                stats.set_gauge(STATS_METRIC, value, (name,))
        return stats

    def load_stats(self) -> dict[str, float]:
        """``recomputed_by_choice_tokens_<tier>`` and the cost estimates (``cost_*``)."""
        out: dict[str, float] = {
            f"recomputed_by_choice_tokens_{tier}": n
            for tier, n in self._chooser.recomputed_by_choice.items()
        }
        out.update(self.costs.snapshot(self.block_tokens))
        return out

    def write_stats_file(self) -> None:
        """Write our stats and the lookup-wait summary as JSON to ``stats_file`` (if set): at
        shutdown and whenever the engine goes idle."""
        if self._stats_file is None:
            return
        stats = {
            **self.inner.stats(),
            "retry_budget_misses": self.budget_misses,
            **self.load_stats(),
        }
        report = {"stats": stats, **self.waits.summary()}
        with open(self._stats_file, "w") as f:
            json.dump(report, f, indent=1)

    def config_info(self) -> Sequence[ConfigInfoMapping]:
        return [self._config_info]

    def reset_cache(self) -> None:
        self.inner.reset()

    def shutdown(self) -> None:
        self.write_stats_file()
        # on_shutdown (unmapping the pool) only after close succeeded: a tier that failed to
        # close may still be writing the pool (vLLM's tiering manager keeps it then, too).
        if self._close is not None:
            self._close()
            self._close = None
        if self._on_shutdown is not None:
            self._on_shutdown()
            self._on_shutdown = None

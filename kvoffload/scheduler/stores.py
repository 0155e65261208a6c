"""Store planning: the blocks a request's store policy offers, reserved in the tier, and the
jobs that copy them out of the request's engine blocks.

When the tier refuses a whole offer (``prepare_store`` answers ``None``: no evictable room
now), the longest head of it that fits is stored
(:func:`~kvoffload.managers.fitting.reserve_longest_head`) and the policy re-offers the whole
offer next time: the stored head is then skipped and protected by the tier, so the rest never
evicts its own prefix.

**Shedding.** With ``config.max_stores_in_flight`` set, the store path has *fallen behind* when
the stores planned in earlier steps and not completed yet hold that many blocks: then every new
offer is *shed* instead of queued (blocks the tier already holds are kept: they cost no copy,
and the tier protects them). A step's offers are never shed while the path keeps up, however
large (a long prefill is stored whole). A shed block is simply not offloaded: it is never
offered again (the policy moved past it), its engine blocks are freed as usual, and no load
depends on it (a later lookup misses it). Counted in ``shed_store_blocks``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from kvoffload.keys import OffloadKey, offload_key_group
from kvoffload.load_store_specs import GPULoadStoreSpec
from kvoffload.manager_contract import (
    LoadStoreSpec,
    OffloadingManager,
    PrepareStoreOutput,
    ReqContext,
)
from kvoffload.managers.fitting import reserve_longest_head
from kvoffload.scheduler.events import OffloadEventDescriber
from kvoffload.scheduler.fence import ReuseFence
from kvoffload.scheduler.jobs import JobTable
from kvoffload.scheduler.policy import OffloadPolicy
from kvoffload.scheduler.state import RequestKVState, SchedulerOffloadConfig
from kvoffload.transfer import TransferJob

__all__ = ["StorePlanner"]

#: Where an offered block is: (KV-cache group, offloaded block index in that group).
Location = tuple[int, int]


class StorePlanner:
    """Plans a request's stores; counts ``store_jobs`` (planned), ``rejected_stores`` (offers
    refused as a whole) and ``shed_store_blocks`` into ``counters``. Sliding-window sources
    are registered in the reuse ``fence``; each stored block is described to ``events``.
    ``in_flight``: blocks of planned store jobs not completed yet (:meth:`finished` lowers it),
    of which ``this_step`` were planned since the last :meth:`begin_step`."""

    def __init__(
        self,
        config: SchedulerOffloadConfig,
        manager: OffloadingManager,
        jobs: JobTable,
        fence: ReuseFence,
        events: OffloadEventDescriber | None,
        counters: dict[str, int],
    ) -> None:
        self._config = config
        self._manager = manager
        self._jobs = jobs
        self._fence = fence
        self._events = events
        self._counters = counters
        self._fences = any(g.sliding_window_blocks is not None for g in config.groups)
        self._limit = config.max_stores_in_flight
        self.in_flight = 0
        self.this_step = 0

    def begin_step(self) -> None:
        """A new engine step plans its stores: what is in flight now is from earlier steps."""
        self.this_step = 0

    def finished(self, num_blocks: int) -> None:
        """A store job of ``num_blocks`` blocks completed (or failed, or went stale)."""
        self.in_flight -= num_blocks
        self.this_step = min(self.this_step, self.in_flight)

    @property
    def behind(self) -> bool:
        """Whether stores of earlier steps still in flight reach ``max_stores_in_flight``."""
        limit = self._limit
        return limit is not None and self.in_flight - self.this_step >= limit

    def plan(
        self,
        state: RequestKVState,
        policy: OffloadPolicy,
        num_offloadable_tokens: int,
        finished: bool = False,
    ) -> tuple[list[TransferJob], int]:
        """Plan the stores of the blocks ``policy`` offers for the request now.

        Returns the jobs and how many offered blocks the tier does not hold afterwards (0: the
        whole offer is held or being stored; else the tier had no room and the policy re-offers
        them, from the offer's start, next time).
        """
        if state.max_offload_tokens is not None:
            num_offloadable_tokens = min(num_offloadable_tokens, state.max_offload_tokens)
        keys, starts = policy.get_blocks_to_store(state, num_offloadable_tokens, finished)
        if not keys:
            return [], 0
        req_id = state.req_context.req_id
        located = self._locate(state, keys, starts)
        if located is None:
            # The engine has not reported these blocks yet: try again next step.
            policy.on_store_rejected(req_id, starts)
            return [], 0
        if self.behind:
            keys, located = self._shed(keys, located, state.req_context)
            if not keys:
                return [], 0
        out = self._manager.prepare_store(keys, state.req_context)
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

    def _locate(
        self, state: RequestKVState, keys: list[OffloadKey], starts: Sequence[int]
    ) -> list[Location] | None:
        """Each offered key's location (keys come grouped, in block order from ``starts[g]``),
        or ``None`` if the engine has not reported the blocks of one yet."""
        groups = self._config.groups
        located: list[Location] = []
        offset = [0] * len(groups)
        for key in keys:
            g = offload_key_group(key) if len(groups) > 1 else 0
            located.append((g, starts[g] + offset[g]))
            offset[g] += 1
        for g, (group, group_state) in enumerate(zip(groups, state.group_states, strict=True)):
            needed = (starts[g] + offset[g]) * group.block_size_factor
            if offset[g] and len(group_state.block_ids) < needed:
                return None
        return located

    def _shed(
        self, keys: list[OffloadKey], located: list[Location], ctx: ReqContext
    ) -> tuple[list[OffloadKey], list[Location]]:
        """The store path is behind: keep only the keys the tier holds (no copy; the tier
        protects them); the others are shed (counted)."""
        holds = self._manager.holds
        kept = [i for i, key in enumerate(keys) if holds(key, ctx)]
        self._counters["shed_store_blocks"] += len(keys) - len(kept)
        return [keys[i] for i in kept], [located[i] for i in kept]

    def _prepare_head(
        self, keys: list[OffloadKey], located: list[Location], ctx: ReqContext
    ) -> tuple[int, list[PrepareStoreOutput]]:
        """Reserve the longest head (in block order) of an offer that does not fit as a whole:
        its length and the accepted reservations. Runs only when the whole offer was refused."""
        groups = self._config.groups
        # Blocks by the token their KV ends at; each probe passes its keys group by group.
        order = sorted(
            range(len(keys)),
            key=lambda i: (located[i][1] + 1) * groups[located[i][0]].offloaded_block_size,
        )
        prepare = self._manager.prepare_store
        return reserve_longest_head(
            len(keys), lambda n: prepare([keys[i] for i in sorted(order[:n])], ctx)
        )

    def _store_job(
        self,
        state: RequestKVState,
        stored: list[OffloadKey],
        store_spec: LoadStoreSpec,
        where: Mapping[OffloadKey, Location],
    ) -> TransferJob | None:
        """The job copying ``stored`` (just prepared in the tier) out of the request's blocks."""
        if not stored:
            return None
        groups = self._config.groups
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
            self._events.record_request_blocks(state, stored, located)
        job = self._jobs.new(state, stored, is_store=True)
        self.in_flight += len(stored)
        self.this_step += len(stored)
        if self._fences:
            self._fence.add(job, engine_ids, group_sizes)
        self._counters["store_jobs"] += 1
        return TransferJob(
            job.job_id,
            state.req_context.req_id,
            GPULoadStoreSpec(engine_ids, group_sizes, block_indices),
            store_spec,
        )

"""Load planning: the job that copies a request's hit blocks from the tier into the engine
blocks just allocated for them."""

from __future__ import annotations

from kvoffload.errors import ContractError
from kvoffload.keys import OffloadKey
from kvoffload.load_store_specs import GPULoadStoreSpec
from kvoffload.manager_contract import OffloadingManager, ReqContext
from kvoffload.scheduler.jobs import JobTable
from kvoffload.scheduler.state import RequestKVState, SchedulerOffloadConfig
from kvoffload.transfer import TransferJob

__all__ = ["LoadPlanner"]


class LoadPlanner:
    """Plans loads (``prepare_load`` pins the tier's blocks) and counts ``load_jobs`` and
    ``hit_tokens`` (planned) into ``counters``, and hit tokens by the tier that supplies them into
    ``hit_tokens_by_source``."""

    def __init__(
        self,
        config: SchedulerOffloadConfig,
        manager: OffloadingManager,
        jobs: JobTable,
        counters: dict[str, int],
        hit_tokens_by_source: dict[str, int],
    ) -> None:
        self._config = config
        self._manager = manager
        self._jobs = jobs
        self._counters = counters
        self._by_source = hit_tokens_by_source

    def plan(self, state: RequestKVState, num_external_tokens: int) -> TransferJob | None:
        """The load of the ``num_external_tokens`` tokens after the request's locally computed
        ones, or ``None`` when a hit vanished since the lookup (the request recomputes).

        A sliding-window group loads only its last window; the destination skips the engine
        pages of the first offloaded block that the engine already holds
        (``GPULoadStoreSpec.block_indices``).
        """
        start = state.num_locally_computed_tokens
        end = start + num_external_tokens
        keys: list[OffloadKey] = []
        engine_ids: list[int] = []
        group_sizes: list[int] = []
        block_indices: list[int] = []
        for group, group_state in zip(self._config.groups, state.group_states, strict=True):
            obs, factor = group.offloaded_block_size, group.block_size_factor
            first_block, last_block = start // obs, end // obs
            if group.sliding_window_blocks is not None:
                first_block = max(first_block, last_block - group.sliding_window_blocks)
            first_engine = max(start // group.engine_block_size, first_block * factor)
            ids = group_state.block_ids[first_engine : last_block * factor]
            keys.extend(group_state.offload_keys[first_block:last_block])
            engine_ids.extend(ids)
            group_sizes.append(len(ids))
            block_indices.append(first_engine)
        ctx = state.req_context
        try:
            src = self._manager.prepare_load(keys, ctx)
        except ContractError:
            return None
        job = self._jobs.new(state, keys, is_store=False)
        job.sources = self._split_by_source(keys, ctx, num_external_tokens)
        by_source = self._by_source
        for source, n in job.sources.items():
            by_source[source] = by_source.get(source, 0) + n
        self._counters["load_jobs"] += 1
        self._counters["hit_tokens"] += num_external_tokens
        return TransferJob(
            job.job_id, ctx.req_id, src, GPULoadStoreSpec(engine_ids, group_sizes, block_indices)
        )

    def _split_by_source(
        self, keys: list[OffloadKey], ctx: ReqContext, num_tokens: int
    ) -> dict[str, int]:
        """``num_tokens`` split by the tier each key loads from, in proportion to the keys (the
        rounding remainder goes to the first tier); one dict operation per key."""
        load_source = self._manager.load_source
        counts: dict[str, int] = {}
        for key in keys:
            source = load_source(key, ctx)
            counts[source] = counts.get(source, 0) + 1
        if len(counts) <= 1:
            return dict.fromkeys(counts or ("host",), num_tokens)
        out = {source: num_tokens * n // len(keys) for source, n in counts.items()}
        out[next(iter(out))] += num_tokens - sum(out.values())
        return out

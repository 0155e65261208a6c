"""Hit search: how far a request can be served from the engine's cache plus the tier.

Full-attention groups need every block of the prefix; sliding-window groups only the blocks of
the last window before the hit's end. Each group can only lower the answer; window groups are
re-checked until it is stable. The answer is a multiple of the config's ``load_alignment`` and
never covers the last prompt token (the engine needs its logits). ``HitSearch.num_held`` is the
admission order's probe of the same blocks: the leading run the tier holds, nothing touched.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from kvoffload.keys import OffloadKey, make_offload_key
from kvoffload.manager_contract import LookupResult, OffloadingManager, ReqContext
from kvoffload.scheduler.costs import LoadCosts, PayingPrefix
from kvoffload.scheduler.state import OffloadRequest, RequestKVState, SchedulerOffloadConfig

__all__ = ["HitSearch", "may_wait"]

_HIT = LookupResult.HIT
_RETRY = LookupResult.RETRY
#: The context of :meth:`HitSearch.num_held`'s probes (of no request).
_PROBE = ReqContext("")


def may_wait(state: RequestKVState, config: SchedulerOffloadConfig) -> bool:
    """Whether a ``RETRY`` may still defer the request: its retry budget is spent once both
    ``max_lookup_retry_s`` and ``min_lookup_retries`` asks have passed since its first
    deferred ask (seconds alone would give up after one step on a slow engine, asks alone at
    once on an idle one)."""
    now = time.monotonic()
    if state.retry_since is None:
        state.retry_since, state.retry_count = now, 0
        return True
    state.retry_count += 1
    return (
        state.retry_count <= config.min_lookup_retries
        or now - state.retry_since <= config.max_lookup_retry_s
    )


class HitSearch:
    """Looks a request's blocks up in the manager, group by group (see the module docstring),
    and takes the part of a hit that pays (``config.load_policy``, :mod:`~kvoffload.scheduler.costs`).

    ``recomputed_by_choice``: tokens of hits left to recompute because loading them would have
    been slower (``auto``; ``never`` asks the tier nothing, so counts nothing), by tier
    (``host``, or the tier of blocks being promoted: :attr:`LoadCosts.promoted_source`)."""

    def __init__(
        self, config: SchedulerOffloadConfig, manager: OffloadingManager, costs: LoadCosts
    ) -> None:
        self._config = config
        self._manager = manager
        self._costs = costs
        self._full_groups = [
            g for g, c in enumerate(config.groups) if c.sliding_window_blocks is None
        ]
        self._window_groups = [
            g for g, c in enumerate(config.groups) if c.sliding_window_blocks is not None
        ]
        self.recomputed_by_choice: dict[str, int] = {}

    def hit_end(self, state: RequestKVState, num_computed: int, wait: bool = True) -> int | None:
        """The token index up to which the request can be served from engine + tier, or ``None``
        when a block of the full-attention prefix answered ``RETRY`` and ``wait`` is set (the
        scan goes on past it, so the tier sees every block it may prepare at once). With
        ``load_policy="auto"`` the full-attention prefix is cut where loading stops paying; a
        cut before the first ``RETRY`` block answers at once instead of waiting."""
        state.decision = None
        if self._config.load_policy == "never":
            return num_computed
        bound = state.request.num_tokens - 1
        if state.max_load_tokens is not None:
            bound = min(bound, num_computed + state.max_load_tokens)
        align = self._config.load_alignment
        end = bound // align * align
        if end <= num_computed:
            return num_computed
        full_end = self._full_groups_end(state, num_computed, end, wait)
        if full_end is None or full_end <= num_computed or not self._window_groups:
            return full_end
        return self._window_groups_end(state, num_computed, full_end)

    def _full_groups_end(
        self, state: RequestKVState, num_computed: int, end: int, wait: bool
    ) -> int | None:
        """``end`` lowered to the leading run of ``HIT`` blocks of every full-attention group
        (the first one's cut to the prefix that pays, under ``auto``)."""
        lookup, ctx, groups = self._manager.lookup, state.req_context, self._config.groups
        align = self._config.load_alignment
        pay: PayingPrefix | None = None
        for g in self._full_groups:
            obs = groups[g].offloaded_block_size
            keys = state.group_states[g].offload_keys
            first = i = num_computed // obs
            last = min(end // obs, len(keys))
            retry_at = -1
            if pay is None and self._config.load_policy == "auto":
                pay = state.decision = self._costs.decision(obs, len(groups), counted=False)
                while i < last:
                    answer = lookup(keys[i], ctx)
                    if answer is _HIT:
                        pay.host()
                    elif answer is _RETRY and wait:
                        if retry_at < 0:
                            retry_at = i
                        pay.promoted_block()
                    else:
                        break
                    i += 1
                cut = first + pay.best
                if retry_at >= cut:  # the prefix that pays is ready: no need to wait
                    retry_at = -1
                if cut < i and retry_at < 0:
                    self._count_recomputed(pay, obs, (i - cut) * obs)
                i = min(i, cut)
            else:
                while i < last:
                    answer = lookup(keys[i], ctx)
                    if answer is not _HIT:
                        if answer is not _RETRY or not wait:
                            break
                        if retry_at < 0:
                            retry_at = i
                    i += 1
            if retry_at >= 0:
                return None
            end = min(end, i * obs) // align * align
            if end <= num_computed:
                return num_computed
        return end

    def _count_recomputed(self, pay: PayingPrefix, obs: int, tokens: int) -> None:
        """Count ``tokens`` of a hit left to recompute, split host / promoted by blocks."""
        promoted = (pay.promoted - pay.best_promoted) * obs
        by_tier = self.recomputed_by_choice
        if promoted:
            source = self._costs.promoted_source
            by_tier[source] = by_tier.get(source, 0) + promoted
        if tokens > promoted:
            by_tier["host"] = by_tier.get("host", 0) + tokens - promoted

    def _window_groups_end(self, state: RequestKVState, num_computed: int, end: int) -> int:
        """``end`` lowered until every sliding-window group has its last window's blocks."""
        groups, align = self._config.groups, self._config.load_alignment
        changed = bool(self._window_groups)
        while changed:  # a window group's answer lowers the bound; re-check all window groups
            changed = False
            for g in self._window_groups:
                group = groups[g]
                obs = group.offloaded_block_size
                hit_blocks = self._window_hit(
                    state, g, num_computed // obs, end // obs, group.sliding_window_blocks or 0
                )
                if hit_blocks * obs < end:
                    end = hit_blocks * obs // align * align
                    changed = True
                    if end <= num_computed:
                        return num_computed
        return end

    def _window_hit(self, state: RequestKVState, g: int, first: int, last: int, window: int) -> int:
        """Largest ``L <= last`` whose needed blocks ``[max(first, L - window), L)`` are all HIT."""
        keys = state.group_states[g].offload_keys
        last = min(last, len(keys))
        lookup, ctx = self._manager.lookup, state.req_context
        candidate = last
        i = last - 1
        while i >= first:
            if lookup(keys[i], ctx) is _HIT:
                if candidate - i >= window or i == first:
                    return candidate
            else:
                candidate = i
            i -= 1
        return first

    def num_held(
        self, request: OffloadRequest, state: RequestKVState | None, first: int, end: int
    ) -> int:
        """How many of ``request``'s hash blocks ``first, first + 1, ...`` (below ``end``), a
        leading run, the tier holds (:meth:`~kvoffload.manager_contract.OffloadingManager.holds`:
        for a tiering manager, the host tier); ``state``: the request's, if it has one (its
        keys are reused). A pure probe: nothing is counted, touched or promoted. Full attention
        only (0 when the first group has a sliding window)."""
        group = self._config.groups[0]
        if group.sliding_window_blocks is not None:
            return 0
        per = group.offloaded_block_size // self._config.hash_block_size
        hashes, holds = request.block_hashes, self._manager.holds
        known: Sequence[OffloadKey] = () if state is None else state.group_states[0].offload_keys
        last = min(end, len(hashes))
        j = first // per
        while j * per < last and (j + 1) * per <= len(hashes):
            key = known[j] if j < len(known) else make_offload_key(hashes[(j + 1) * per - 1], 0)
            if not holds(key, _PROBE):
                break
            j += 1
        return max(0, min(j * per, last) - first)

    def touch(self, state: RequestKVState) -> None:
        """Mark the request's blocks as used in the tier (a window group: its last window's)."""
        touch, ctx = self._manager.touch, state.req_context
        for group, group_state in zip(self._config.groups, state.group_states, strict=True):
            keys = group_state.offload_keys
            if not keys:
                continue
            if group.sliding_window_blocks is None:
                touch(keys, ctx)
            else:
                touch(keys[max(0, group_state.num_hit_blocks - group.sliding_window_blocks) :], ctx)

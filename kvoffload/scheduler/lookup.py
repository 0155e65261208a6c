"""Hit search: how far a request can be served from the engine's cache plus the tier.

Full-attention groups need every block of the prefix; sliding-window groups only the blocks of
the last window before the hit's end. Each group can only lower the answer; window groups are
re-checked until it is stable. The answer is a multiple of the config's ``load_alignment`` and
never covers the last prompt token (the engine needs its logits).
"""

from __future__ import annotations

import time

from kvoffload.manager_contract import LookupResult, OffloadingManager
from kvoffload.scheduler.state import RequestKVState, SchedulerOffloadConfig

__all__ = ["HitSearch", "may_wait"]

_HIT = LookupResult.HIT
_RETRY = LookupResult.RETRY


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
    """Looks a request's blocks up in the manager, group by group (see the module docstring)."""

    def __init__(self, config: SchedulerOffloadConfig, manager: OffloadingManager) -> None:
        self._config = config
        self._manager = manager
        self._full_groups = [
            g for g, c in enumerate(config.groups) if c.sliding_window_blocks is None
        ]
        self._window_groups = [
            g for g, c in enumerate(config.groups) if c.sliding_window_blocks is not None
        ]

    def hit_end(self, state: RequestKVState, num_computed: int, wait: bool = True) -> int | None:
        """The token index up to which the request can be served from engine + tier, or ``None``
        when a block of the full-attention prefix answered ``RETRY`` and ``wait`` is set (the
        scan goes on past it, so the tier sees every block it may prepare at once)."""
        bound = state.request.num_tokens - 1
        if state.max_load_tokens is not None:
            bound = min(bound, num_computed + state.max_load_tokens)
        align = self._config.load_alignment
        end = bound // align * align
        if end <= num_computed:
            return num_computed
        full_end = self._full_groups_end(state, num_computed, end, wait)
        if full_end is None or full_end <= num_computed:
            return full_end
        return self._window_groups_end(state, num_computed, full_end)

    def _full_groups_end(
        self, state: RequestKVState, num_computed: int, end: int, wait: bool
    ) -> int | None:
        """``end`` lowered to the leading run of ``HIT`` blocks of every full-attention group."""
        lookup, ctx, groups = self._manager.lookup, state.req_context, self._config.groups
        align = self._config.load_alignment
        for g in self._full_groups:
            obs = groups[g].offloaded_block_size
            keys = state.group_states[g].offload_keys
            i = num_computed // obs
            last = min(end // obs, len(keys))
            retry = False
            while i < last:
                answer = lookup(keys[i], ctx)
                if answer is not _HIT:
                    if answer is not _RETRY or not wait:
                        break
                    retry = True
                i += 1
            if retry:
                return None
            end = min(end, i * obs) // align * align
            if end <= num_computed:
                return num_computed
        return end

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

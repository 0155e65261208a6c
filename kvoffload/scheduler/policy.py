"""Store policies: which of a request's blocks to offer to the tier, and when.

A policy owns its per-request progress (which blocks it has already offered). The connector
asks it every step, passes its answer to ``OffloadingManager.prepare_store``, and calls
:meth:`OffloadPolicy.on_store_rejected` when the manager answered ``None`` so that those blocks
are offered again next step instead of being dropped.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from kvoffload.errors import ConfigError
from kvoffload.keys import OffloadKey
from kvoffload.scheduler.state import (
    NULL_BLOCK_ID,
    GroupOffloadConfig,
    RequestKVState,
    SchedulerOffloadConfig,
)

__all__ = [
    "STORE_POLICIES",
    "OffloadPolicy",
    "StoreOnComputePolicy",
    "StoreOnFinishPolicy",
    "StorePromptOnlyPolicy",
    "create_store_policy",
]

_NO_BLOCKS: tuple[list[OffloadKey], list[int]] = ([], [])


class OffloadPolicy(ABC):
    """Decides which full offloaded blocks of a request to offer for storing.

    Contract: :meth:`get_blocks_to_store` returns ``(keys, starts)``: keys concatenated group by
    group in prefix order, and per group the index (in that group's ``offload_keys``) of its first
    returned key. Returned blocks count as offered: they are not returned again unless
    :meth:`on_store_rejected` rewinds them. Blocks loaded from a tier are never offered
    (:meth:`on_blocks_loaded`). Only full blocks within ``num_offloadable_tokens`` (tokens whose KV
    is computed by the end of this step) are returned. The caller does not mutate
    ``req_kv_state`` through the policy.
    """

    name: ClassVar[str]

    def __init__(self, config: SchedulerOffloadConfig) -> None:
        self.config = config

    @abstractmethod
    def get_blocks_to_store(
        self, req_kv_state: RequestKVState, num_offloadable_tokens: int, finished: bool = False
    ) -> tuple[list[OffloadKey], list[int]]:
        """Return this step's blocks to offer (``finished``: the request's last chance)."""

    @abstractmethod
    def on_store_rejected(self, req_id: str, starts: list[int]) -> None:
        """The tier had no room: offer again, next time, from ``starts`` (per group) on."""

    @abstractmethod
    def on_blocks_loaded(self, req_id: str, num_tokens: int) -> None:
        """The first ``num_tokens`` tokens were loaded from a tier: never offer their blocks."""

    @abstractmethod
    def request_finished(self, req_id: str) -> None:
        """Drop the request's progress. Called once, after its last :meth:`get_blocks_to_store`."""

    @abstractmethod
    def reset(self) -> None:
        """Forget every request's progress (the tier was emptied: everything is storable again)."""


class StoreOnComputePolicy(OffloadPolicy):
    """Offer each full offloaded block once, in the step whose forward pass computes it."""

    name = "on_compute"

    def __init__(self, config: SchedulerOffloadConfig) -> None:
        super().__init__(config)
        # req_id -> per group, the index of the next block to offer
        self._next: dict[str, list[int]] = {}

    def _limit(self, req_kv_state: RequestKVState, num_offloadable_tokens: int) -> int:
        return num_offloadable_tokens

    def get_blocks_to_store(
        self, req_kv_state: RequestKVState, num_offloadable_tokens: int, finished: bool = False
    ) -> tuple[list[OffloadKey], list[int]]:
        num_offloadable_tokens = self._limit(req_kv_state, num_offloadable_tokens)
        req_id = req_kv_state.req_context.req_id
        progress = self._next.get(req_id)
        if progress is None:
            progress = self._next[req_id] = [0] * len(req_kv_state.group_states)
        keys: list[OffloadKey] | None = None
        starts: list[int] = progress  # replaced by a copy before the first mutation
        for g, (group, state) in enumerate(
            zip(req_kv_state.config.groups, req_kv_state.group_states, strict=True)
        ):
            start = progress[g]
            end = min(num_offloadable_tokens // group.offloaded_block_size, len(state.offload_keys))
            if end <= start:
                continue
            if group.sliding_window_blocks is not None:
                start = _first_held_block(req_kv_state, group, state.block_ids, start, end)
            if keys is None:
                keys, starts = [], list(progress)
            starts[g] = start
            keys.extend(state.offload_keys[start:end])
            progress[g] = end
        return _NO_BLOCKS if keys is None else (keys, starts)

    def on_store_rejected(self, req_id: str, starts: list[int]) -> None:
        progress = self._next.get(req_id)
        if progress is not None:
            for g, start in enumerate(starts):
                progress[g] = min(progress[g], start)

    def on_blocks_loaded(self, req_id: str, num_tokens: int) -> None:
        progress = self._next.setdefault(req_id, [0] * len(self.config.groups))
        for g, group in enumerate(self.config.groups):
            progress[g] = max(progress[g], num_tokens // group.offloaded_block_size)

    def request_finished(self, req_id: str) -> None:
        self._next.pop(req_id, None)

    def reset(self) -> None:
        self._next.clear()


def _first_held_block(
    req_kv_state: RequestKVState,
    group: GroupOffloadConfig,
    block_ids: list[int],
    start: int,
    end: int,
) -> int:
    """First offloaded block in ``[start, end)`` of a sliding-window group the engine still holds.

    The engine may drop blocks that no longer serve the window of its next token (position
    ``num_computed_tokens``, reading ``window`` tokens back), without telling us; a block is
    only offered when all its tokens are inside that window, and when its engine blocks are not
    ``NULL_BLOCK_ID`` in the recorded table. Drops only happen at the front.
    """
    obs, factor = group.offloaded_block_size, group.block_size_factor
    window_tokens = (group.sliding_window_blocks or 0) * obs
    first = max(start, -(-(req_kv_state.request.num_computed_tokens - window_tokens) // obs))
    for i in range(end - 1, first - 1, -1):
        head = i * factor
        if head >= len(block_ids) or block_ids[head] == NULL_BLOCK_ID:
            return i + 1
    return min(first, end)


class StoreOnFinishPolicy(StoreOnComputePolicy):
    """Offer nothing while the request runs; when it finishes, offer all its full blocks
    (prompt and generated). The engine keeps those blocks until the stores complete."""

    name = "on_finish"

    def get_blocks_to_store(
        self, req_kv_state: RequestKVState, num_offloadable_tokens: int, finished: bool = False
    ) -> tuple[list[OffloadKey], list[int]]:
        if not finished:
            return _NO_BLOCKS
        return super().get_blocks_to_store(req_kv_state, num_offloadable_tokens, finished)


class StorePromptOnlyPolicy(StoreOnComputePolicy):
    """Like ``on_compute``, but never offer blocks holding generated tokens."""

    name = "prompt_only"

    def _limit(self, req_kv_state: RequestKVState, num_offloadable_tokens: int) -> int:
        return min(num_offloadable_tokens, req_kv_state.request.num_prompt_tokens)


STORE_POLICIES: dict[str, type[OffloadPolicy]] = {
    cls.name: cls for cls in (StoreOnComputePolicy, StoreOnFinishPolicy, StorePromptOnlyPolicy)
}


def create_store_policy(name: str, config: SchedulerOffloadConfig) -> OffloadPolicy:
    """Instantiate the store policy registered as ``name``."""
    cls = STORE_POLICIES.get(name)
    if cls is None:
        raise ConfigError(
            "store_policy", f"unknown store policy {name!r}; choose from {sorted(STORE_POLICIES)}"
        )
    return cls(config)

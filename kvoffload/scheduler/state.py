"""Scheduler-side data types: the offloading configuration and per-request KV state.

Data only. Store progress is not here: it belongs to the store policy (``policy.py``), which
imports this module (never the reverse), as does the connector.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvoffload.errors import ConfigError
from kvoffload.keys import BlockHash, OffloadKey, make_offload_key
from kvoffload.manager_contract import ReqContext
from kvoffload.scheduler.costs import PayingPrefix, check_load_policy
from kvoffload.validation import accepts_renamed

__all__ = [
    "NULL_BLOCK_ID",
    "GroupOffloadConfig",
    "OffloadRequest",
    "RequestGroupState",
    "RequestKVState",
    "SchedulerOffloadConfig",
]

#: Engine block id of a position whose KV the engine does not hold (outside a sliding window).
NULL_BLOCK_ID = -1


class OffloadRequest(Protocol):
    """What the connector reads from an engine request (vLLM's ``Request`` has all of it).

    Read-only members (properties here), so that a request's plain attributes of narrower types
    (``list[int]`` for ``Sequence[int]``) or properties satisfy it: the connector never sets them.
    """

    @property
    def request_id(self) -> str: ...

    @property
    def num_tokens(self) -> int:
        """Prompt tokens plus tokens generated so far."""
        ...

    @property
    def num_prompt_tokens(self) -> int: ...

    @property
    def num_computed_tokens(self) -> int:
        """Tokens whose KV the engine has computed (or loaded)."""
        ...

    @property
    def block_hashes(self) -> Sequence[BlockHash]:
        """Chained hashes of every full block of ``hash_block_size`` tokens so far."""
        ...

    @property
    def all_token_ids(self) -> Sequence[int]: ...

    @property
    def kv_transfer_params(self) -> Mapping[str, Any] | None: ...


@dataclass(frozen=True, slots=True)
class GroupOffloadConfig:
    """One KV-cache group: how its engine blocks map onto offloaded blocks.

    ``sliding_window_blocks`` is the window size in offloaded blocks (a request needs only the
    last window's blocks), or ``None`` for full attention (it needs every block before).
    """

    engine_block_size: int
    block_size_factor: int
    sliding_window_blocks: int | None = None

    @property
    def offloaded_block_size(self) -> int:
        """Tokens per offloaded block: ``engine_block_size * block_size_factor``."""
        return self.engine_block_size * self.block_size_factor


@accepts_renamed({"max_lookup_retry_seconds": "max_lookup_retry_s"})
@dataclass(frozen=True, slots=True)
class SchedulerOffloadConfig:
    """Static offloading configuration of one engine.

    ``hash_block_size`` is the granularity of ``OffloadRequest.block_hashes``; every group's
    offloaded block size must be a multiple of it (the key of an offloaded block is the hash of
    the last hash-block inside it, plus the group index). ``num_workers`` worker processes each
    move their own shard: a job completes when all of them have reported it.
    ``store_policy`` names the default :class:`~kvoffload.scheduler.policy.OffloadPolicy`.
    """

    groups: tuple[GroupOffloadConfig, ...]
    hash_block_size: int
    num_workers: int = 1
    store_policy: str = "on_compute"
    #: How long one request may be deferred by RETRY lookups before it takes the prefix it has:
    #: until both this many seconds and :attr:`min_lookup_retries` asks have passed (seconds
    #: alone would give up after one step on a slow engine; asks alone, at once on an idle one).
    max_lookup_retry_s: float = 2.0
    min_lookup_retries: int = 4
    #: The store path is behind once stores planned in earlier steps and not completed hold this
    #: many offloaded blocks; new offers are then shed, not queued (``scheduler/stores.py``).
    #: ``None``: no bound.
    max_stores_in_flight: int | None = None
    #: Which hits are loaded (:data:`~kvoffload.scheduler.costs.LOAD_POLICIES`): ``auto`` the
    #: prefix that is cheaper to load than to compute, ``always`` all, ``never`` none.
    load_policy: str = "auto"

    def __post_init__(self) -> None:
        check_load_policy(self.load_policy)
        if self.max_stores_in_flight is not None and (
            isinstance(self.max_stores_in_flight, bool)
            or not isinstance(self.max_stores_in_flight, int)
            or self.max_stores_in_flight < 0
        ):
            raise ConfigError(
                "max_stores_in_flight",
                f"must be an integer >= 0 or None, got {self.max_stores_in_flight!r}",
            )
        if not self.max_lookup_retry_s >= 0:
            raise ConfigError(
                "max_lookup_retry_s", f"must be >= 0, got {self.max_lookup_retry_s!r}"
            )
        if self.min_lookup_retries < 0:
            raise ConfigError(
                "min_lookup_retries", f"must be >= 0, got {self.min_lookup_retries!r}"
            )
        if not self.groups:
            raise ConfigError("groups", "at least one KV-cache group is required")
        if self.hash_block_size <= 0:
            raise ConfigError("hash_block_size", f"must be positive, got {self.hash_block_size}")
        if self.num_workers <= 0:
            raise ConfigError("num_workers", f"must be positive, got {self.num_workers}")
        for g, group in enumerate(self.groups):
            if group.engine_block_size <= 0 or group.block_size_factor <= 0:
                raise ConfigError(
                    f"groups[{g}]",
                    f"block sizes must be positive, got {group.engine_block_size}x{group.block_size_factor}",
                )
            if group.offloaded_block_size % self.hash_block_size:
                raise ConfigError(
                    f"groups[{g}].offloaded_block_size",
                    f"{group.offloaded_block_size} is not a multiple of hash_block_size {self.hash_block_size}",
                )
            if group.sliding_window_blocks is not None and group.sliding_window_blocks <= 0:
                raise ConfigError(f"groups[{g}].sliding_window_blocks", "must be positive or None")

    @property
    def load_alignment(self) -> int:
        """Loads cover a multiple of this many tokens: whole offloaded blocks of every group."""
        groups = self.groups
        if len(groups) == 1:  # read per lookup: the common case without a generator
            return groups[0].offloaded_block_size
        return math.lcm(*(g.offloaded_block_size for g in groups))

    @classmethod
    def single_group(
        cls,
        engine_block_size: int,
        block_size_factor: int = 1,
        num_workers: int = 1,
        store_policy: str = "on_compute",
        max_lookup_retry_s: float = 2.0,
        *,
        max_stores_in_flight: int | None = None,
        load_policy: str = "auto",
    ) -> SchedulerOffloadConfig:
        """One full-attention group, hashed at the engine block size (the reference engine's case)."""
        return cls(
            (GroupOffloadConfig(engine_block_size, block_size_factor),),
            engine_block_size,
            num_workers,
            store_policy,
            max_lookup_retry_s,
            max_stores_in_flight=max_stores_in_flight,
            load_policy=load_policy,
        )


@dataclass(slots=True)
class RequestGroupState:
    """One request in one KV-cache group.

    ``offload_keys[i]`` names offloaded block ``i`` (grows as the request's full blocks appear);
    ``block_ids[j]`` is the engine block holding the request's ``j``-th engine block of this group
    (``NULL_BLOCK_ID`` where the engine holds nothing). ``num_hit_blocks``: offloaded blocks
    covered by hits (engine prefix cache plus offloaded tier) when the request was admitted.
    """

    offload_keys: list[OffloadKey] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    num_hit_blocks: int = 0


@dataclass(slots=True, eq=False)
class RequestKVState:
    """Everything the scheduler side tracks for one live request.

    ``transfer_jobs`` holds the ids of this request's jobs in flight (loads and stores); the
    engine must not free the request's engine blocks while it is non-empty.
    ``store_policy`` is the policy name this request uses (validated at creation).
    """

    config: SchedulerOffloadConfig
    request: OffloadRequest
    req_context: ReqContext
    store_policy: str
    max_offload_tokens: int | None = None
    max_load_tokens: int | None = None
    group_states: list[RequestGroupState] = field(default_factory=list)
    num_locally_computed_tokens: int = 0
    transfer_jobs: set[int] = field(default_factory=set)
    finished: bool = False
    num_hashes_seen: int = 0  # len(request.block_hashes) at the last update_offload_keys
    #: Whether get_num_new_matched_tokens has answered (not None) for this request yet.
    answered: bool = False
    #: When the current run of RETRY answers began (monotonic seconds), or None, and its length.
    retry_since: float | None = None
    retry_count: int = 0
    #: The load decision of the last lookup (``load_policy="auto"``), until acted on.
    decision: PayingPrefix | None = None

    def __post_init__(self) -> None:
        if not self.group_states:
            self.group_states = [RequestGroupState() for _ in self.config.groups]

    def update_offload_keys(self) -> None:
        """Extend every group's ``offload_keys`` to cover the request's current full blocks."""
        hashes = self.request.block_hashes
        num_hashes = len(hashes)
        if num_hashes == self.num_hashes_seen:
            return
        self.num_hashes_seen = num_hashes
        hbs = self.config.hash_block_size
        for g, (group, state) in enumerate(zip(self.config.groups, self.group_states, strict=True)):
            per_block = group.offloaded_block_size // hbs
            keys = state.offload_keys
            i = len(keys)
            while (i + 1) * per_block <= num_hashes:
                keys.append(make_offload_key(hashes[(i + 1) * per_block - 1], g))
                i += 1

"""FilterReusedOffloadingManager over a real CPUOffloadingManager."""

from __future__ import annotations

from pathlib import Path

import pytest
from tier_cases import host_pool, layout
from tier_cases import key as tier_key

from kvoffload import (
    ConfigError,
    CPULoadStoreSpec,
    CPUOffloadingManager,
    FilterReusedOffloadingManager,
    LookupResult,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    TieringOffloadingManager,
)
from kvoffload.tiers.disk.settings import DiskTierSettings
from kvoffload.tiers.disk.tier import DiskTier

MISS, HIT, HIT_PENDING = LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING


def make(
    num_blocks: int = 4, threshold: int = 2, tracker: int = 64
) -> FilterReusedOffloadingManager:
    return FilterReusedOffloadingManager(
        CPUOffloadingManager(num_blocks, "lru", enable_events=True), threshold, tracker
    )


def test_counts_distinct_requests_not_lookups(keys: list[OffloadKey]) -> None:
    m = make()
    a, b = ReqContext("a"), ReqContext("b")
    for _ in range(5):
        assert m.lookup(keys[1], a) is MISS
    assert m.request_count(keys[1]) == 1
    out = m.prepare_store([keys[1]], a)  # offering it again does not count again either
    assert out is not None and out.keys_to_store == []
    assert m.request_count(keys[1]) == 1
    m.lookup(keys[1], b)
    assert m.request_count(keys[1]) == 2
    out = m.prepare_store([keys[1]], b)
    assert out is not None and out.keys_to_store == [keys[1]]


def test_a_second_identical_prompt_stores_all_its_blocks(keys: list[OffloadKey]) -> None:
    """Offered blocks count as seen: the connector looks up only up to the first miss, so counting
    lookups alone would let one more block through per request."""
    m = make(num_blocks=8)
    prompt = keys[1:5]
    for i, expected in enumerate(([], prompt)):
        ctx = ReqContext(f"req-{i}")
        assert m.lookup(prompt[0], ctx) is MISS  # stops at the first miss
        out = m.prepare_store(prompt, ctx)
        assert out is not None and out.keys_to_store == expected
    assert m.stats()["filtered_blocks"] == 4


def test_filtered_blocks_cost_no_capacity(keys: list[OffloadKey], ctx: ReqContext) -> None:
    m = make(num_blocks=2)
    backing = m.backing
    assert isinstance(backing, CPUOffloadingManager)
    before = backing.stats()
    out = m.prepare_store(keys[1:6], ctx)
    assert out is not None and (out.keys_to_store, out.evicted_keys) == ([], [])
    assert backing.stats() == before
    assert list(backing.items()) == []


def test_keys_held_by_the_backing_manager_pass_through_and_stay_protected(
    keys: list[OffloadKey],
) -> None:
    k = keys
    backing = CPUOffloadingManager(2)
    m = FilterReusedOffloadingManager(backing, store_threshold=2)
    direct = ReqContext("direct")
    for key in (k[1], k[2]):  # stored without the filter seeing them: 1 is the LRU block
        out = backing.prepare_store([key], direct)
        assert out is not None
        backing.complete_store([key], direct)

    x, y = ReqContext("x"), ReqContext("y")
    m.lookup(k[3], x)
    # y extends the prefix [1] with 3: 1 was seen once only, yet it must stay protected.
    out = m.prepare_store([k[1], k[3]], y)
    assert out is not None
    assert (out.keys_to_store, out.evicted_keys) == ([k[3]], [k[2]])
    assert m.lookup(k[1], y) is HIT
    assert m.lookup(k[3], y) is HIT_PENDING


def test_tracker_is_bounded_lru_and_a_dropped_key_restarts_from_zero(
    keys: list[OffloadKey],
) -> None:
    k = keys
    m = make(tracker=3)
    a, b, c = ReqContext("a"), ReqContext("b"), ReqContext("c")
    for key in (k[1], k[2], k[3]):
        m.lookup(key, a)
    m.lookup(k[1], b)  # 1 becomes the most recently counted
    m.lookup(k[4], b)  # the table is full: 2 is dropped, not 1
    assert [m.request_count(key) for key in (k[1], k[2], k[3], k[4])] == [2, 0, 1, 1]
    assert m.stats()["tracked_keys"] == 3
    m.lookup(k[2], c)
    assert m.request_count(k[2]) == 1  # restarted: c is its first request again
    out = m.prepare_store([k[2]], c)
    assert out is not None and out.keys_to_store == []


def test_request_finished_drops_the_request_state_and_delegates(keys: list[OffloadKey]) -> None:
    # Two filters stacked on one backing: each keeps its own per-request state on the context,
    # and request_finished must reach the inner one through the outer one.
    inner = FilterReusedOffloadingManager(CPUOffloadingManager(4), store_threshold=2)
    outer = FilterReusedOffloadingManager(inner, store_threshold=2)
    ctx = ReqContext("a")
    outer.lookup(keys[1], ctx)
    outer.lookup(keys[1], ctx)
    assert (outer.request_count(keys[1]), inner.request_count(keys[1])) == (1, 1)

    outer.request_finished(ctx)
    # Both per-request "already counted" sets are gone: the context counts afresh in both filters.
    outer.lookup(keys[1], ctx)
    assert (outer.request_count(keys[1]), inner.request_count(keys[1])) == (2, 2)


def test_two_filters_sharing_a_request_count_independently(keys: list[OffloadKey]) -> None:
    """One filter per tier, the same ReqContext passed to both: neither may hide keys from the other."""
    cpu_tier = FilterReusedOffloadingManager(CPUOffloadingManager(4), store_threshold=1)
    other_tier = FilterReusedOffloadingManager(CPUOffloadingManager(4), store_threshold=1)
    ctx = ReqContext("a")
    cpu_tier.lookup(keys[1], ctx)
    other_tier.lookup(keys[1], ctx)
    assert cpu_tier.request_count(keys[1]) == other_tier.request_count(keys[1]) == 1
    out = other_tier.prepare_store([keys[2]], ctx)
    assert out is not None and out.keys_to_store == [keys[2]]
    assert cpu_tier.request_count(keys[2]) == 0


def test_everything_else_delegates_to_the_backing_manager(keys: list[OffloadKey]) -> None:
    k = keys
    m = make(num_blocks=2, threshold=1)
    backing = m.backing
    assert isinstance(backing, CPUOffloadingManager)
    assert m.medium == backing.medium == "CPU"
    ctx = ReqContext("a")

    out = m.prepare_store([k[1], k[2]], ctx)
    assert out is not None and isinstance(out.store_spec, CPULoadStoreSpec)
    assert out.store_spec.block_ids == [0, 1]
    m.complete_store([k[1]], ctx)
    m.complete_store([k[2]], ctx, success=False)
    assert [backing.lookup(x, ctx) for x in (k[1], k[2])] == [HIT, MISS]

    spec = m.prepare_load([k[1]], ctx)
    assert isinstance(spec, CPULoadStoreSpec) and spec.block_ids == [0]
    assert [b.ref_cnt for _, b in backing.items()] == [1]
    m.complete_load([k[1]], ctx)
    assert [b.ref_cnt for _, b in backing.items()] == [0]

    out = m.prepare_store([k[3]], ctx)
    assert out is not None
    m.complete_store([k[3]], ctx)
    m.touch([k[1]], ctx)  # 3 becomes the LRU block
    out = m.prepare_store([k[4]], ctx)
    assert out is not None and out.evicted_keys == [k[3]]

    assert m.take_events() == [
        OffloadingEvent([k[1]], "CPU", removed=False),
        OffloadingEvent([k[3]], "CPU", removed=False),
        OffloadingEvent([k[3]], "CPU", removed=True),
    ]
    assert backing.take_events() == []

    m.reset()
    assert backing.stats()["used_blocks"] == 0
    assert m.take_events() == [OffloadingEvent([k[1]], "CPU", removed=True)]

    stats = m.stats()
    assert {key: stats[key] for key in backing.stats()} == backing.stats()
    assert stats["filtered_blocks"] == 0
    assert stats["tracked_keys"] == 4


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"store_threshold": 0}, "store_threshold"),
        ({"store_threshold": "2"}, "store_threshold"),
        ({"max_tracker_size": 0}, "max_tracker_size"),
        ({"max_tracker_size": 1.5}, "max_tracker_size"),
    ],
    ids=["threshold-0", "threshold-str", "tracker-0", "tracker-float"],
)
def test_bad_thresholds_are_config_errors(kwargs: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError, match=field) as info:
        FilterReusedOffloadingManager(CPUOffloadingManager(4), **kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


def test_the_already_held_probe_promotes_nothing(tmp_path: Path) -> None:
    """Over a tiering manager, k0 and k1 are on disk only. A first request offers them for
    storing: they are below the threshold and the host does not hold them, so they are
    filtered. The filter's "already held?" probe asks the host only: it queues no promotion
    (none lands, nothing is pinned for the request) and counts no lookup."""
    pool = host_pool(4)
    host = CPUOffloadingManager(4, "lru")
    tiering = TieringOffloadingManager(
        host, [DiskTier(pool, layout(), DiskTierSettings(tmp_path, 1 << 20, rescan_interval=0))]
    )
    m = FilterReusedOffloadingManager(tiering, store_threshold=2)
    try:
        k0, k1, *fillers = (tier_key(i) for i in range(6))
        writer = ReqContext("writer")
        for batch in ([k0, k1], fillers[:2], fillers[2:]):  # k0, k1 cascade, then leave the host
            out = tiering.prepare_store(batch, writer)
            assert out is not None
            tiering.complete_store(batch, writer)
            tiering.drain()
        assert [host.lookup(k, writer) for k in (k0, k1)] == [MISS, MISS]

        ctx = ReqContext("a")
        out = m.prepare_store([k0, k1], ctx)
        assert out is not None and out.keys_to_store == []
        tiering.drain()
        stats = m.stats()
        assert stats["filtered_blocks"] == 2
        assert stats["promoted_blocks"] == 0 and stats["promotions_in_flight"] == 0
        assert stats["pinned_promoted_blocks"] == 0 and stats["retry_answers"] == 0
        assert [host.lookup(k, ctx) for k in (k0, k1)] == [MISS, MISS]
        assert [m.holds(k, ctx) for k in (k0, fillers[-1])] == [False, True]  # the host only
        assert m.request_count(fillers[-1]) == 0  # a probe is not a sighting
        m.request_finished(ctx)
        tiering.check_invariants()
    finally:
        tiering.close()

"""CPUOffloadingManager: exact scenarios of the manager contract (docs/manager-contract.md).

Blocks are named by number as in vLLM's ``test_cpu_manager``: ``k[3]`` is block 3. The state
machine in ``test_manager_stateful.py`` covers the same contract over random call sequences.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest

from kvoffload import (
    ConfigError,
    ContractError,
    CPULoadStoreSpec,
    CPUOffloadingManager,
    LookupResult,
    OffloadingEvent,
    OffloadKey,
    ReqContext,
    available_eviction_policies,
)
from kvoffload.manager_contract import LoadStoreSpec

MISS, HIT, HIT_PENDING = LookupResult.MISS, LookupResult.HIT, LookupResult.HIT_PENDING


def blocks(manager: CPUOffloadingManager) -> list[tuple[OffloadKey, int, int]]:
    """Every held block as ``(key, slot, ref_cnt)``, in the policy's iteration (eviction) order."""
    return [(key, block.slot, block.ref_cnt) for key, block in manager.items()]


def slots(spec: LoadStoreSpec) -> list[int]:
    """The host slots ``spec`` (a :class:`CPULoadStoreSpec`) addresses."""
    assert isinstance(spec, CPULoadStoreSpec)
    return spec.block_ids


def store(manager: CPUOffloadingManager, keys: Sequence[OffloadKey], ctx: ReqContext) -> list[int]:
    """Prepare and complete a store that must succeed; return the slots used."""
    out = manager.prepare_store(keys, ctx)
    assert out is not None
    manager.complete_store(out.keys_to_store, ctx)
    return slots(out.store_spec)


def stored_event(*keys: OffloadKey) -> OffloadingEvent:
    return OffloadingEvent(list(keys), "CPU", removed=False)


def removed_event(*keys: OffloadKey) -> OffloadingEvent:
    return OffloadingEvent(list(keys), "CPU", removed=True)


def test_vllm_reference_sequence(keys: list[OffloadKey], ctx: ReqContext) -> None:
    """vLLM's ``test_cpu_manager`` walk-through, LRU, 4 slots, step by step."""
    k = keys
    m = CPUOffloadingManager(4, "lru", enable_events=True)

    out = m.prepare_store([k[1], k[2]], ctx)
    assert out is not None
    assert (out.keys_to_store, slots(out.store_spec), out.evicted_keys) == (
        [k[1], k[2]],
        [0, 1],
        [],
    )
    assert m.lookup(k[1], ctx) is HIT_PENDING and m.lookup(k[2], ctx) is HIT_PENDING
    assert m.take_events() == []  # nothing is announced before it is readable

    m.complete_store([k[1], k[2]], ctx)
    assert m.take_events() == [stored_event(k[1], k[2])]
    assert [m.lookup(x, ctx) for x in (k[1], k[2], k[3])] == [HIT, HIT, MISS]

    # 1 is the most recent, 2 the LRU candidate, yet 2 is part of the input and so protected.
    m.touch([k[1]], ctx)
    out = m.prepare_store([k[2], k[3], k[4], k[5]], ctx)
    assert out is not None
    assert (out.keys_to_store, slots(out.store_spec), out.evicted_keys) == (
        [k[3], k[4], k[5]],
        [2, 3, 0],
        [k[1]],
    )
    assert m.take_events() == [removed_event(k[1])]

    # Everything else is pending or protected: no room, and no state change.
    before = (blocks(m), m.stats())
    assert m.prepare_store([k[1], k[6]], ctx) is None
    assert blocks(m) == before[0]
    assert m.stats() == {**before[1], "rejected_stores": before[1]["rejected_stores"] + 1}

    m.complete_store([k[2], k[3], k[4], k[5]], ctx)
    assert m.take_events() == [
        stored_event(k[3], k[4], k[5])
    ]  # 2 was already readable: not re-announced
    assert [m.lookup(x, ctx) for x in (k[1], k[2], k[3], k[4], k[5])] == [MISS, HIT, HIT, HIT, HIT]

    assert m.prepare_load([k[2], k[3]], ctx).block_ids == [1, 2]
    assert (
        m.prepare_store([k[6], k[7], k[8]], ctx) is None
    )  # 2 and 3 are being read: only 4, 5 evictable
    m.complete_load([k[2], k[3]], ctx)

    out = m.prepare_store([k[6], k[7], k[8]], ctx)
    assert out is not None
    assert (out.keys_to_store, slots(out.store_spec), out.evicted_keys) == (
        [k[6], k[7], k[8]],
        [3, 2, 1],
        [k[2], k[3], k[4]],
    )
    m.complete_store([k[6], k[7], k[8]], ctx)

    m.touch([k[5], k[6], k[7]], ctx)  # recency now 8 < 7 < 6 < 5: 8 goes first
    out = m.prepare_store([k[9]], ctx)
    assert out is not None
    assert (out.keys_to_store, slots(out.store_spec), out.evicted_keys) == ([k[9]], [1], [k[8]])

    m.complete_store([k[7], k[9]], ctx, success=False)  # 7 is complete: untouched; 9 is dropped
    assert m.lookup(k[7], ctx) is HIT and m.lookup(k[9], ctx) is MISS
    assert m.take_events() == [
        removed_event(k[2], k[3], k[4]),
        stored_event(k[6], k[7], k[8]),
        removed_event(k[8]),
    ]
    m.check_invariants()


@pytest.mark.parametrize("policy", available_eviction_policies())
def test_prepare_store_never_evicts_a_key_it_was_given(
    keys: list[OffloadKey], ctx: ReqContext, policy: str
) -> None:
    """vLLM regression ``test_already_stored_block_not_evicted_during_prepare_store``, every policy."""
    k = keys
    m = CPUOffloadingManager(4, policy)
    store(m, [k[1], k[2]], ctx)
    m.touch([k[1]], ctx)
    out = m.prepare_store([k[2], k[3], k[4], k[5]], ctx)
    assert out is not None and set(out.evicted_keys) <= {k[1]}  # a policy may admit fewer than 3
    m.complete_store(out.keys_to_store, ctx)
    assert m.lookup(k[2], ctx) is HIT


def test_rejected_prepare_store_changes_nothing(keys: list[OffloadKey], ctx: ReqContext) -> None:
    """A ``None`` answer leaves the manager exactly as a twin that never saw the call."""
    k = keys
    managers = [CPUOffloadingManager(3, enable_events=True) for _ in range(2)]
    for m in managers:
        store(m, [k[1], k[2], k[3]], ctx)
        m.complete_store([k[9]], ctx, success=False)  # ignored: never prepared
        m.prepare_load([k[2]], ctx)
    rejected, twin = managers
    before = (blocks(rejected), rejected.stats())
    assert (
        rejected.prepare_store([k[1], k[4], k[5]], ctx) is None
    )  # needs 2 slots; only 3 is evictable
    assert blocks(rejected) == before[0]
    assert rejected.stats() == {**before[1], "rejected_stores": 1}

    # Same future for both: same slots, same victims, same events.
    for m in managers:
        m.complete_load([k[2]], ctx)
    outs = [m.prepare_store([k[4], k[5], k[6]], ctx) for m in managers]
    assert outs[0] == outs[1]
    assert rejected.take_events() == twin.take_events()


@pytest.mark.parametrize("order", [[2, 3, 4], [4, 2, 3], [3, 4, 2], [4, 3, 2]])
def test_prepare_load_slots_follow_key_order(
    keys: list[OffloadKey], ctx: ReqContext, order: list[int]
) -> None:
    k = keys
    m = CPUOffloadingManager(4)
    slots = dict(zip([k[2], k[3], k[4]], store(m, [k[2], k[3], k[4]], ctx), strict=True))
    wanted = [k[i] for i in order]
    assert m.prepare_load(wanted, ctx).block_ids == [slots[key] for key in wanted]
    assert m.stats()["loaded_blocks"] == 3


def test_blocks_being_loaded_are_not_evicted_and_readers_are_counted(
    keys: list[OffloadKey],
) -> None:
    k = keys
    a, b = ReqContext("a"), ReqContext("b")
    m = CPUOffloadingManager(2)
    store(m, [k[1], k[2]], a)
    m.prepare_load([k[1]], a)
    m.prepare_load([k[1], k[2]], b)  # 1 has two readers, 2 has one
    assert m.prepare_store([k[3]], a) is None
    m.complete_load([k[2]], b)
    out = m.prepare_store([k[3]], a)
    assert out is not None and out.evicted_keys == [k[2]]
    m.complete_store([k[3]], a)
    m.complete_load([k[1]], a)
    assert m.prepare_store([k[4]], a) is not None  # 3 is evictable; 1 still has b reading it
    assert m.lookup(k[1], a) is HIT
    assert dict((key, ref) for key, _, ref in blocks(m))[k[1]] == 1
    m.complete_load([k[1]], b)
    assert dict((key, ref) for key, _, ref in blocks(m))[k[1]] == 0


def test_one_request_loading_a_key_twice_pins_it_twice(
    keys: list[OffloadKey], ctx: ReqContext
) -> None:
    k = keys
    m = CPUOffloadingManager(1)
    store(m, [k[1]], ctx)
    assert m.prepare_load([k[1], k[1]], ctx).block_ids == [0, 0]
    m.complete_load([k[1]], ctx)
    assert m.prepare_store([k[2]], ctx) is None
    m.complete_load([k[1]], ctx)
    assert m.prepare_store([k[2]], ctx) is not None


def test_failed_store_removes_only_its_pending_blocks_and_frees_their_slots(
    keys: list[OffloadKey], ctx: ReqContext
) -> None:
    k = keys
    m = CPUOffloadingManager(4, enable_events=True)
    store(m, [k[1]], ctx)
    out = m.prepare_store([k[2], k[3]], ctx)
    assert out is not None and slots(out.store_spec) == [1, 2]
    m.complete_store([k[2]], ctx)
    m.take_events()

    m.complete_store([k[1], k[2], k[3], k[9]], ctx, success=False)
    assert [m.lookup(x, ctx) for x in (k[1], k[2], k[3])] == [HIT, HIT, MISS]
    assert m.take_events() == []  # 3 was never announced, so its removal isn't either
    assert m.stats()["failed_store_blocks"] == 1
    assert m.stats()["used_blocks"] == 2
    # The freed slot is reused, and the whole capacity is usable again without eviction.
    out = m.prepare_store([k[4], k[5]], ctx)
    assert out is not None and sorted(slots(out.store_spec)) == [2, 3] and out.evicted_keys == []
    m.check_invariants()


def test_repeated_or_unknown_complete_store_is_harmless(
    keys: list[OffloadKey], ctx: ReqContext
) -> None:
    k = keys
    m = CPUOffloadingManager(4, enable_events=True)
    store(m, [k[1], k[2]], ctx)
    snapshot = (blocks(m), m.stats())
    for success in (True, False, True):
        m.complete_store([k[1], k[2], k[7]], ctx, success=success)
    assert (blocks(m), m.stats()) == snapshot
    assert m.take_events() == [stored_event(k[1], k[2])]


@pytest.mark.parametrize("position", [0, 1, 2])
@pytest.mark.parametrize("bad", ["miss", "pending"])
def test_prepare_load_of_a_non_hit_key_raises_and_pins_nothing(
    keys: list[OffloadKey], ctx: ReqContext, position: int, bad: str
) -> None:
    k = keys
    m = CPUOffloadingManager(4)
    store(m, [k[1], k[2]], ctx)
    assert m.prepare_store([k[3]], ctx) is not None  # 3 stays pending
    wanted = [k[1], k[2]]
    wanted.insert(position, k[9] if bad == "miss" else k[3])
    snapshot = (blocks(m), m.stats())
    with pytest.raises(ContractError, match="absent" if bad == "miss" else "being written"):
        m.prepare_load(wanted, ctx)
    assert (blocks(m), m.stats()) == snapshot
    m.check_invariants()


def test_prepare_load_of_a_key_listed_twice_then_a_miss_pins_nothing(
    keys: list[OffloadKey], ctx: ReqContext
) -> None:
    k = keys
    m = CPUOffloadingManager(2)
    store(m, [k[1]], ctx)
    snapshot = blocks(m)
    with pytest.raises(ContractError):
        m.prepare_load([k[1], k[1], k[5]], ctx)
    assert blocks(m) == snapshot


@pytest.mark.parametrize(
    "release",
    [
        [3, 1, 2],  # 3 is ready but not pinned
        [1, 9, 2],  # 9 is absent
        [1, 4],  # 4 is pending
        [1, 1, 2],  # 1 is pinned once, released twice
    ],
)
def test_complete_load_of_an_unpinned_key_raises_and_releases_nothing(
    keys: list[OffloadKey], ctx: ReqContext, release: list[int]
) -> None:
    k = keys
    m = CPUOffloadingManager(4)
    store(m, [k[1], k[2], k[3]], ctx)
    assert m.prepare_store([k[4]], ctx) is not None
    m.prepare_load([k[1], k[2]], ctx)
    snapshot = (blocks(m), m.stats())
    with pytest.raises(ContractError, match="not pinned"):
        m.complete_load([k[i] for i in release], ctx)
    assert (blocks(m), m.stats()) == snapshot
    m.complete_load([k[1], k[2]], ctx)
    assert {ref for _, _, ref in blocks(m)} == {0, -1}


def test_prepare_store_drops_duplicates_and_present_keys(
    keys: list[OffloadKey], ctx: ReqContext
) -> None:
    k = keys
    m = CPUOffloadingManager(4)
    store(m, [k[1]], ctx)
    out = m.prepare_store([k[2], k[1], k[2], k[3], k[3]], ctx)
    assert out is not None
    assert out.keys_to_store == [k[2], k[3]]
    assert slots(out.store_spec) == [1, 2]
    assert m.stats()["used_blocks"] == 3


@pytest.mark.parametrize("offered", [[], [1], [1, 1]])
def test_nothing_to_store_is_an_empty_answer_not_none(
    keys: list[OffloadKey], ctx: ReqContext, offered: list[int]
) -> None:
    k = keys
    m = CPUOffloadingManager(1)
    store(m, [k[1]], ctx)
    m.prepare_load([k[1]], ctx)  # full and nothing evictable: a None would be wrong here
    out = m.prepare_store([k[i] for i in offered], ctx)
    assert out is not None
    assert (out.keys_to_store, slots(out.store_spec), out.evicted_keys) == ([], [], [])
    assert m.stats()["rejected_stores"] == 0


def test_events_are_collected_only_when_enabled_and_drained_by_take(
    keys: list[OffloadKey], ctx: ReqContext
) -> None:
    k = keys
    quiet, loud = CPUOffloadingManager(1), CPUOffloadingManager(1, enable_events=True)
    for m in (quiet, loud):
        store(m, [k[1]], ctx)
        store(m, [k[2]], ctx)
        m.reset()
    assert quiet.take_events() == []
    assert loud.take_events() == [
        stored_event(k[1]),
        removed_event(k[1]),
        stored_event(k[2]),
        removed_event(k[2]),
    ]
    assert loud.take_events() == []


def test_reset_drops_everything_and_restarts_slots(keys: list[OffloadKey], ctx: ReqContext) -> None:
    k = keys
    m = CPUOffloadingManager(4, enable_events=True)
    store(m, [k[1], k[2], k[3]], ctx)
    m.prepare_load([k[2]], ctx)  # pinned: still readable, so its removal is announced
    assert m.prepare_store([k[4]], ctx) is not None  # pending: never announced
    m.take_events()

    m.reset()
    assert m.take_events() == [removed_event(k[1], k[2], k[3])]
    assert [m.lookup(x, ctx) for x in (k[1], k[2], k[3], k[4])] == [MISS] * 4
    assert m.stats()["used_blocks"] == 0
    m.check_invariants()

    # Completions of transfers started before the reset: stores are ignored, loads rejected.
    m.complete_store([k[4]], ctx)
    assert m.take_events() == []
    with pytest.raises(ContractError):
        m.complete_load([k[2]], ctx)

    assert store(m, [k[5], k[6], k[7], k[8]], ctx) == [0, 1, 2, 3]
    m.check_invariants()


def test_touch_ignores_unknown_keys_and_lookup_changes_no_recency(
    keys: list[OffloadKey], ctx: ReqContext
) -> None:
    k = keys
    m = CPUOffloadingManager(2)
    store(m, [k[1]], ctx)
    store(m, [k[2]], ctx)
    m.touch([k[8], k[9]], ctx)
    assert m.lookup(k[1], ctx) is HIT  # a lookup is not a use
    out = m.prepare_store([k[3]], ctx)
    assert out is not None and out.evicted_keys == [k[1]]


def test_touch_makes_the_head_of_a_prefix_the_most_valuable(
    keys: list[OffloadKey], ctx: ReqContext
) -> None:
    k = keys
    m = CPUOffloadingManager(3, "lru")
    store(m, [k[1], k[2], k[3]], ctx)
    m.touch([k[1], k[2], k[3]], ctx)  # eviction order now 3, 2, 1
    out = m.prepare_store([k[4], k[5]], ctx)
    assert out is not None and out.evicted_keys == [k[3], k[2]]


def test_stats_count_what_happened(keys: list[OffloadKey], ctx: ReqContext) -> None:
    k = keys
    m = CPUOffloadingManager(2)
    store(m, [k[1], k[2]], ctx)
    m.prepare_load([k[1]], ctx)
    store(m, [k[3]], ctx)  # evicts 2
    out = m.prepare_store([k[4]], ctx)  # evicts 3
    assert out is not None
    m.complete_store([k[4]], ctx, success=False)
    assert m.prepare_store([k[5], k[6]], ctx) is None
    assert m.stats() == {
        "capacity_blocks": 2,
        "used_blocks": 1,
        "stored_blocks": 3,
        "failed_store_blocks": 1,
        "loaded_blocks": 1,
        "evicted_blocks": 2,
        "rejected_stores": 1,
        "not_admitted_blocks": 0,
    }


@pytest.mark.parametrize("num_blocks", [0, -3, 2.0, "4", None])
def test_bad_num_blocks_is_a_config_error(num_blocks: Any) -> None:
    with pytest.raises(ConfigError, match="num_blocks") as info:
        CPUOffloadingManager(num_blocks)
    assert info.value.field == "num_blocks"


def test_unknown_policy_is_a_config_error_listing_the_choices() -> None:
    with pytest.raises(ConfigError, match="lru") as info:
        CPUOffloadingManager(4, "no-such-policy")
    assert info.value.field == "eviction_policy"

"""Operator pins over real host-tier managers and eviction policies: a pinned block is never
evicted, a pin is all or nothing (quota, readiness), pins are reference-counted per block, TTLs
lapse by the table's clock, and any sequence of operations keeps the table's invariants."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.errors import ConfigError
from kvoffload.eviction import available_eviction_policies
from kvoffload.keys import OffloadKey, make_offload_key
from kvoffload.manager_contract import ReqContext
from kvoffload.managers.cpu import CPUOffloadingManager
from kvoffload.managers.pins import (
    HostPinSite,
    NotCached,
    PinQuotaExceeded,
    PinTable,
    PolicyPinSite,
)

BUILTIN = ["adaptive", "arc", "lru", "prefix", "s3fifo"]


def _keys(n: int, start: int = 0) -> list[OffloadKey]:
    return [make_offload_key(i.to_bytes(16, "big")) for i in range(start, start + n)]


def _store(host: CPUOffloadingManager, keys: Sequence[OffloadKey]) -> list[OffloadKey]:
    """Store ``keys`` (evicting as needed); returns what was evicted."""
    ctx = ReqContext("store")
    out = host.prepare_store(keys, ctx)
    assert out is not None
    host.complete_store(out.keys_to_store, ctx)
    host.request_finished(ctx)
    return out.evicted_keys


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _table(host: CPUOffloadingManager, quota: int, clock: Clock | None = None) -> PinTable:
    return PinTable({"host": HostPinSite(host)}, {"host": quota}, clock or Clock())


@pytest.mark.parametrize("policy", BUILTIN)
def test_pinned_blocks_survive_any_amount_of_stores(policy: str) -> None:
    assert set(BUILTIN) <= set(available_eviction_policies())
    host = CPUOffloadingManager(16, policy)
    pinned = _keys(6)
    _store(host, pinned)
    table = _table(host, 8)
    table.pin("ops", pinned, ["host"], 24)
    evicted: list[OffloadKey] = []
    for round_ in range(20):  # 200 other blocks through 10 free slots
        evicted += _store(host, _keys(10, 100 + 10 * round_))
        host.check_invariants()
    assert evicted and not set(evicted) & set(pinned)
    assert all(host.policy.get(k) is not None for k in pinned)
    # A store that needs more room than the unpinned blocks give is refused, not served by
    # evicting a pinned block.
    assert host.prepare_store(_keys(11, 900), ReqContext("big")) is None
    table.unpin(owner="ops")
    table.check_invariants()
    evicted = []
    for round_ in range(4):
        evicted += _store(host, _keys(16, 1000 + 16 * round_))
    assert set(pinned) <= set(evicted)
    host.check_invariants()


def test_a_pin_past_the_quota_is_refused_whole() -> None:
    host = CPUOffloadingManager(16, "lru")
    keys = _keys(10)
    _store(host, keys)
    table = _table(host, 5)
    with pytest.raises(PinQuotaExceeded, match="quota is 5 blocks, 0 are pinned and this pin adds 6"):
        table.pin("ops", keys[:6], ["host"], 24)
    assert all(host.policy.get(k).ref_cnt == 0 for k in keys)  # type: ignore[union-attr]
    assert not table.pins()
    table.pin("ops", keys[:3], ["host"], 12)
    with pytest.raises(PinQuotaExceeded):
        table.pin("ops", keys[3:6], ["host"], 12)  # 3 + 3 > 5
    # Blocks already pinned cost no quota: another owner pins the same prefix freely.
    table.pin("team-b", keys[:3], ["host"], 12)
    assert table.pinned_blocks("host") == 3
    table.check_invariants()


def test_a_pin_of_blocks_not_ready_is_refused_whole() -> None:
    host = CPUOffloadingManager(16, "lru")
    disk_index = CPUOffloadingManager(16, "lru")  # stands for a tier's index of ref-counted records
    keys = _keys(4)
    _store(host, keys)
    _store(disk_index, keys[:3])  # the last block is missing there
    table = PinTable(
        {"host": HostPinSite(host), "disk": PolicyPinSite(disk_index.policy)},
        {"host": 8, "disk": 8},
        Clock(),
    )
    with pytest.raises(NotCached, match="1 of the prefix's 4 blocks are not ready in the disk"):
        table.pin("ops", keys, ["host", "disk"], 16)
    assert all(host.policy.get(k).ref_cnt == 0 for k in keys)  # type: ignore[union-attr]
    pending = _keys(1, 50)
    assert host.prepare_store(pending, ReqContext("w")) is not None  # written, not ready
    with pytest.raises(NotCached):
        table.pin("ops", pending, ["host"], 4)
    table.check_invariants()


def test_two_owners_hold_a_block_once_and_it_goes_with_the_last() -> None:
    host = CPUOffloadingManager(8, "lru")
    keys = _keys(4)
    _store(host, keys)
    table = _table(host, 8)
    table.pin("a", keys, ["host"], 16)
    table.pin("b", keys[:2], ["host"], 8)
    assert [host.policy.get(k).ref_cnt for k in keys] == [1, 1, 1, 1]  # type: ignore[union-attr]
    assert [p.pin_id for p in table.unpin(owner="a")] == [f"a/{keys[-1].hex()}"]
    assert [host.policy.get(k).ref_cnt for k in keys] == [1, 1, 0, 0]  # type: ignore[union-attr]
    table.unpin(owner="b")
    assert [host.policy.get(k).ref_cnt for k in keys] == [0, 0, 0, 0]  # type: ignore[union-attr]
    assert host.num_reclaimable == 8
    host.check_invariants()


def test_ttl_lapses_by_the_clock_and_a_renewal_moves_it() -> None:
    host = CPUOffloadingManager(8, "lru")
    keys = _keys(2)
    _store(host, keys)
    clock = Clock()
    table = _table(host, 8, clock)
    pin = table.pin("ops", keys, ["host"], 8, ttl_s=10)
    assert pin.expires_at == clock.now + 10
    clock.now += 9
    assert table.expire() == []
    table.pin("ops", keys, ["host"], 8, ttl_s=10)  # renewed: the same id, a new deadline
    clock.now += 5
    assert table.expire() == [] and len(table.pins()) == 1
    clock.now += 6
    assert [p.owner for p in table.expire()] == ["ops"]
    assert table.pins() == [] and host.policy.get(keys[0]).ref_cnt == 0  # type: ignore[union-attr]
    table.check_invariants()


@pytest.mark.parametrize(
    ("owner", "keys", "tiers", "ttl", "field"),
    [
        ("", 2, ["host"], None, "owner"),
        ("a/b", 2, ["host"], None, "owner"),
        ("ops", 2, ["nvme"], None, "tiers"),
        ("ops", 2, [], None, "tiers"),
        ("ops", 0, ["host"], None, "prompt"),
        ("ops", 2, ["host"], -1, "ttl_s"),
        ("ops", 2, ["host"], 0, "ttl_s"),
        ("ops", 2, ["host"], True, "ttl_s"),
    ],
)
def test_bad_pins_name_the_field(owner: str, keys: int, tiers: list[str], ttl: object,
                                 field: str) -> None:
    host = CPUOffloadingManager(8, "lru")
    _store(host, _keys(2))
    table = _table(host, 8)
    with pytest.raises(ConfigError) as err:
        table.pin(owner, _keys(keys), tiers, 8, ttl)  # type: ignore[arg-type]
    assert err.value.field == field
    assert not table.pins()


_OPS = st.lists(
    st.tuples(st.sampled_from(["pin", "unpin", "store", "tick"]), st.integers(0, 5),
              st.integers(1, 6), st.sampled_from([None, 5.0, 20.0])),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(ops=_OPS, policy=st.sampled_from(BUILTIN))
def test_any_sequence_keeps_the_invariants(
    ops: list[tuple[str, int, int, float | None]], policy: str
) -> None:
    """Pins, unpins, stores under pressure and clock ticks in any order: pinned blocks are held
    and referenced exactly as the pins say, never over the quota, and the host stays consistent."""
    host = CPUOffloadingManager(12, policy)
    clock = Clock()
    table = _table(host, 6, clock)
    fresh = 1000
    for op, start, length, ttl in ops:
        keys = _keys(length, start)
        if op == "pin":
            with contextlib.suppress(NotCached, PinQuotaExceeded):
                table.pin(f"o{start % 2}", keys, ["host"], length * 4, ttl)
        elif op == "unpin":
            table.unpin(owner=f"o{start % 2}")
        elif op == "store":
            ctx = ReqContext("s")
            out = host.prepare_store(keys + _keys(3, fresh), ctx)
            fresh += 3
            if out is not None:
                host.complete_store(out.keys_to_store, ctx)
            host.request_finished(ctx)
        else:
            clock.now += 7
            table.expire()
        table.check_invariants()
        host.check_invariants()
        for key in table.pinned_keys("host"):
            block = host.policy.get(key)
            assert block is not None and block.ref_cnt >= 1


def test_lru_moves_pinned_blocks_out_of_the_scans_way() -> None:
    """Pinned blocks at the old end of an LRU order are passed once, then sit at the new end:
    the next evictions find their victims at the old end at once (O(1) amortized per block,
    not O(pinned) per eviction). Unpinned, they are ordinary blocks again."""
    host = CPUOffloadingManager(16, "lru")
    pinned = _keys(8)
    _store(host, pinned)  # the oldest eight
    _store(host, _keys(8, 100))
    table = _table(host, 8)
    table.pin("ops", pinned, ["host"], 32)
    assert set(list(host.policy)[:8]) == set(pinned)
    _store(host, _keys(2, 200))  # one eviction scan passes the pinned eight
    order = list(host.policy)
    assert not set(order[:6]) & set(pinned)  # the unpinned old ones first
    assert set(order[6:14]) == set(pinned)  # then the pinned, moved past them
    host.check_invariants()
    table.unpin(owner="ops")
    evicted = _store(host, _keys(16, 300))
    assert set(pinned) <= set(evicted)


def test_arc_takes_pinned_blocks_out_of_its_lists() -> None:
    """ARC's pinned blocks leave T1/T2 (no scan meets them) and come back to the new end of the
    list they were in once unpinned; lookups find them throughout."""
    host = CPUOffloadingManager(16, "arc")
    keys = _keys(6)
    _store(host, keys)
    policy: Any = host.policy
    table = _table(host, 8)
    table.pin("ops", keys[:4], ["host"], 16)
    assert not set(keys[:4]) & (policy._t1.keys() | policy._t2.keys())
    assert all(host.lookup(k, ReqContext("l")).name == "HIT" for k in keys)
    _store(host, _keys(12, 100))  # 12 more in 16: the 2 unpinned go, the pinned stay
    host.check_invariants()
    table.unpin(owner="ops")
    assert set(list(policy._t1)[-4:]) == set(keys[:4])  # back, at the new end of T1
    host.check_invariants()


@pytest.mark.parametrize("policy", ["s3fifo", "adaptive"])
def test_fifo_policies_take_pinned_blocks_out_of_their_queues(policy: str) -> None:
    host = CPUOffloadingManager(16, policy)
    keys = _keys(6)
    _store(host, keys)
    p: Any = host.policy
    table = _table(host, 8)
    table.pin("ops", keys[:4], ["host"], 16)
    assert not set(keys[:4]) & (p._small.keys() | p._main.keys())
    _store(host, _keys(12, 100))
    assert all(host.policy.get(k) is not None for k in keys[:4])
    host.check_invariants()
    table.unpin(owner="ops")
    assert set(keys[:4]) <= p._small.keys() | p._main.keys()
    host.check_invariants()


def test_prefix_policy_takes_pinned_blocks_off_its_leaf_list() -> None:
    """The prefix policy's pinned blocks leave its leaf list (no sample draws them) and a pinned
    parent is not promoted when its children go; unpinned, a childless block is a leaf again."""
    host = CPUOffloadingManager(16, "prefix")
    keys = _keys(6)
    _store(host, keys)  # one chain: keys[5] is its leaf
    p: Any = host.policy
    assert keys[5] in {e.key for e in p._leaves}
    table = _table(host, 8)
    table.pin("ops", keys, ["host"], 16)
    assert not set(keys) & {e.key for e in p._leaves}
    host.check_invariants()
    for round_ in range(4):  # 40 other blocks through the 10 free slots
        _store(host, _keys(10, 100 + 10 * round_))
        assert not set(keys) & {e.key for e in p._leaves}
        host.check_invariants()
    assert all(host.policy.get(k) is not None for k in keys)
    table.unpin(owner="ops")
    assert keys[5] in {e.key for e in p._leaves}
    host.check_invariants()
    evicted: list[OffloadKey] = []
    for round_ in range(4):
        evicted += _store(host, _keys(16, 1000 + 16 * round_))
    assert set(keys) <= set(evicted)
    host.check_invariants()


def test_a_reset_drops_the_pins_of_the_blocks_it_dropped() -> None:
    """A manager reset drops pinned blocks too; the pins of that tier go with them, and an unpin
    afterwards releases nothing of the blocks stored since (here: a load's reference)."""
    host = CPUOffloadingManager(16, "lru")
    keys = _keys(4)
    _store(host, keys)
    table = _table(host, 8)
    table.pin("ops", keys, ["host"], 16)
    host.reset()
    assert table.pins() == [] and table.pinned_blocks("host") == 0
    table.check_invariants()
    _store(host, keys)
    ctx = ReqContext("load")
    host.prepare_load(keys, ctx)  # a load holds one reference per block
    assert table.unpin(owner="ops") == []
    assert [host.policy.get(k).ref_cnt for k in keys] == [1] * 4  # type: ignore[union-attr]
    table.pin("ops", keys, ["host"], 16)  # a fresh pin holds the blocks stored since
    assert [host.policy.get(k).ref_cnt for k in keys] == [2] * 4  # type: ignore[union-attr]


def test_a_reset_of_one_tier_leaves_a_pin_its_other_tiers() -> None:
    host = CPUOffloadingManager(16, "lru")
    disk = CPUOffloadingManager(16, "lru")
    keys = _keys(4)
    _store(host, keys)
    _store(disk, keys)
    table = PinTable({"host": HostPinSite(host), "disk": PolicyPinSite(disk.policy)},
                     {"host": 8, "disk": 8}, Clock())
    table.pin("ops", keys, ["host", "disk"], 16)
    disk.reset()
    changed = table.expire()
    assert [p.tiers for p in changed] == [("host",)]
    assert table.pinned_blocks("disk") == 0 and table.pinned_blocks("host") == 4
    table.check_invariants()
    table.unpin(owner="ops")
    assert [host.policy.get(k).ref_cnt for k in keys] == [0] * 4  # type: ignore[union-attr]


def test_tier_admin_over_a_manager_stack_without_an_engine() -> None:
    """The manager-level API (a reuse filter over a host tier, as an engine builds it): which
    blocks each tier holds, pins through it, and a clear that keeps the pinned blocks."""
    from kvoffload.managers.admin import TierAdmin, leading
    from kvoffload.managers.reuse import FilterReusedOffloadingManager

    host = CPUOffloadingManager(16, "adaptive")
    admin = TierAdmin(FilterReusedOffloadingManager(host, 1), pin_quota=0.5)
    keys = _keys(10)
    _store(host, keys)
    held, complete = admin.held(keys + _keys(2, 50))
    assert complete and leading(held["host"]) == 10 and admin.tiers == ["host"]
    admin.pins.pin("ops", keys[:4], ["host"], 16)
    assert admin.pins.quotas == {"host": 8}
    assert admin.drop_evictable(["host"]) == {"host": 6}
    assert [host.policy.get(k) is not None for k in keys] == [True] * 4 + [False] * 6
    assert admin.ready_in(keys[:4], ["host"]) and not admin.ready_in(keys, ["host"])
    host.check_invariants()

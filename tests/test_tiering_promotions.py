"""The tiering manager's promotions, step by step with a real host tier and a real disk tier
(each step's I/O drained before the next, so the outcome never depends on thread timing)."""

from __future__ import annotations

from pathlib import Path

from tier_cases import host_pool, key, layout

from kvoffload.keys import OffloadKey
from kvoffload.load_store_specs import CPULoadStoreSpec
from kvoffload.manager_contract import LookupResult, ReqContext
from kvoffload.managers import CPUOffloadingManager
from kvoffload.managers.tiering import TieringOffloadingManager
from kvoffload.tiers.disk.settings import DiskTierSettings
from kvoffload.tiers.disk.tier import DiskTier

HIT, RETRY = LookupResult.HIT, LookupResult.RETRY


def _store(manager: TieringOffloadingManager, keys: list, ctx: ReqContext) -> None:
    """A device store into the host, completed and cascaded to disk."""
    out = manager.prepare_store(keys, ctx)
    assert out is not None and out.keys_to_store == keys
    manager.complete_store(keys, ctx)
    manager.drain()


def test_a_promotion_protects_its_requests_host_hits(tmp_path: Path) -> None:
    """Request A's host hits h0, h1 are followed by k0, k1 on disk only. In the same step another
    request's device store comes: A's promotion reserves first (at that store's prepare_store),
    evicting x0, x1 but never A's own hits h0, h1; the device store then takes h1, the oldest
    block left (A looks it up again next step). Nothing is refused."""
    host = CPUOffloadingManager(4, "lru")
    disk = DiskTier(host_pool(4), layout(), DiskTierSettings(tmp_path, 1 << 20, rescan_interval=0))
    manager = TieringOffloadingManager(host, [disk])
    try:
        h0, h1, k0, k1, x0, x1, y0 = (key(i) for i in range(7))
        writer = ReqContext("writer")
        _store(manager, [k0, k1], writer)
        _store(manager, [h1, x0], writer)
        _store(manager, [x1, h0], writer)  # evicts k0, k1; oldest first: h1, x0, x1, h0
        assert [host.lookup(k, writer) for k in (k0, k1)] == [LookupResult.MISS] * 2

        a = ReqContext("a")
        assert [manager.lookup(k, a) for k in (h0, h1, k0, k1)] == [HIT, HIT, RETRY, RETRY]
        out = manager.prepare_store([y0], ReqContext("b"))  # the same step's device store
        assert out is not None and out.evicted_keys == [h1]  # after A's promotion took x0, x1
        manager.step_end()
        manager.drain()

        stats = manager.stats()
        assert stats["promoted_blocks"] == 2
        assert stats["refused_promotion_blocks"] == 0
        assert stats["evicted_blocks"] == 2 + 2 + 1  # k0, k1; x0, x1; h1
        assert [manager.lookup(k, a) for k in (h0, k0, k1)] == [HIT, HIT, HIT]
        manager.check_invariants()
    finally:
        manager.close()


def _tiering(tmp_path: Path, host_blocks: int = 4) -> TieringOffloadingManager:
    host = CPUOffloadingManager(host_blocks, "lru")
    settings = DiskTierSettings(tmp_path, 1 << 20, rescan_interval=0)
    disk = DiskTier(host_pool(host_blocks), layout(), settings)
    return TieringOffloadingManager(host, [disk])


def _on_disk_only(manager: TieringOffloadingManager, keys: list, fillers: list) -> None:
    """Store ``keys`` (cascaded to disk), then ``fillers`` until the host evicted ``keys``."""
    writer = ReqContext("writer")
    _store(manager, keys, writer)
    for i in range(0, len(fillers), 2):
        _store(manager, fillers[i : i + 2], writer)
    probe = ReqContext("probe")
    assert [manager.host.lookup(k, probe) for k in keys] == [LookupResult.MISS] * len(keys)


def _ref_cnt(manager: TieringOffloadingManager, k: OffloadKey) -> int:
    """The host block of ``k``'s reference count (the block must be in the host tier)."""
    block = manager.host.policy.get(k)
    assert block is not None, k
    return block.ref_cnt


def _promote(manager: TieringOffloadingManager, keys: list, ctx: ReqContext) -> None:
    """``ctx`` looks ``keys`` up (RETRY), the step ends and the promotion lands."""
    assert [manager.lookup(k, ctx) for k in keys] == [RETRY] * len(keys)
    manager.step_end()
    manager.drain()
    assert [manager.lookup(k, ctx) for k in keys] == [HIT] * len(keys)


def test_bug_promotion_reserved_after_the_steps_device_stores(tmp_path: Path) -> None:
    """A looks up k0, k1 (on disk only); in the same step a device store of four new blocks
    comes. The promotion reserves its two host slots first (at that store's prepare_store, not
    at step_end after it), so it is not refused; the device store gets the refusal instead
    (it only goes unoffloaded, where a refused promotion would be recomputed)."""
    manager = _tiering(tmp_path)
    try:
        k0, k1, *rest = (key(i) for i in range(10))
        _on_disk_only(manager, [k0, k1], rest[:4])
        a = ReqContext("a")
        assert [manager.lookup(k, a) for k in (k0, k1)] == [RETRY, RETRY]
        assert manager.prepare_store(rest[4:8], ReqContext("b")) is None  # 2 evictable, not 4
        manager.step_end()
        manager.drain()
        stats = manager.stats()
        assert stats["promoted_blocks"] == 2
        assert stats["refused_promotion_blocks"] == 0
        assert [manager.lookup(k, a) for k in (k0, k1)] == [HIT, HIT]
        manager.check_invariants()
    finally:
        manager.close()


def test_bug_landed_promotion_evicted_before_its_request_loads_it(tmp_path: Path) -> None:
    """A's promotion of k0, k1 lands; before A is admitted, device stores fill the host. The
    promoted blocks stay pinned for A (the stores evict around them) until A's own load pins
    them; after its load they are ordinary evictable blocks."""
    manager = _tiering(tmp_path)
    try:
        k0, k1, *rest = (key(i) for i in range(12))
        _on_disk_only(manager, [k0, k1], rest[:4])
        loaded = manager.stats()["loaded_blocks"]
        assert loaded == 0  # the cascades to disk pinned host blocks; they loaded none
        a, b = ReqContext("a"), ReqContext("b")
        _promote(manager, [k0, k1], a)
        assert manager.stats()["pinned_promoted_blocks"] == 2
        assert manager.stats()["loaded_blocks"] == loaded  # a pin is not a load
        assert manager.prepare_store(rest[4:7], b) is None  # only 2 evictable
        out = manager.prepare_store(rest[4:6], b)
        assert out is not None and set(out.evicted_keys).isdisjoint({k0, k1})
        manager.complete_store(rest[4:6], b)
        manager.drain()
        assert [manager.lookup(k, a) for k in (k0, k1)] == [HIT, HIT]
        manager.check_invariants()

        spec = manager.prepare_load([k0, k1], a)  # A admitted: its load pin replaces the other
        assert manager.stats()["pinned_promoted_blocks"] == 0
        assert manager.stats()["loaded_blocks"] == loaded + 2  # counted once, when loaded
        assert [_ref_cnt(manager, k) for k in (k0, k1)] == [1, 1]
        assert isinstance(spec, CPULoadStoreSpec) and len(spec.block_ids) == 2
        manager.complete_load([k0, k1], a)
        manager.check_invariants()
        out = manager.prepare_store(rest[6:10], b)  # now everything is evictable
        assert out is not None and {k0, k1} <= set(out.evicted_keys)
        manager.check_invariants()
    finally:
        manager.close()


def test_promotion_pins_end_with_the_request(tmp_path: Path) -> None:
    """A request that ends without loading its landed promotion releases its pins; one that ends
    while its promotion is in flight, or before it was submitted, takes no pin at all."""
    manager = _tiering(tmp_path, host_blocks=6)
    try:
        k0, k1, k2, k3, *rest = (key(i) for i in range(14))
        _on_disk_only(manager, [k0, k1, k2, k3], rest[:6])
        a = ReqContext("a")
        _promote(manager, [k0], a)
        manager.request_finished(a)
        assert manager.stats()["pinned_promoted_blocks"] == 0
        assert _ref_cnt(manager, k0) == 0
        manager.check_invariants()

        b = ReqContext("b")  # ends with its promotion in flight
        assert manager.lookup(k1, b) is RETRY
        manager.step_end()
        manager.request_finished(b)
        manager.drain()
        assert manager.host.lookup(k1, b) is HIT
        assert manager.stats()["pinned_promoted_blocks"] == 0
        manager.check_invariants()

        c = ReqContext("c")  # ends before its promotion is submitted
        assert manager.lookup(k2, c) is RETRY
        manager.request_finished(c)
        manager.step_end()
        manager.drain()
        stats = manager.stats()
        assert stats["promotions_in_flight"] == 0 and stats["pinned_promoted_blocks"] == 0
        assert manager.host.lookup(k2, c) is LookupResult.MISS
        assert stats["promoted_blocks"] == 2
        manager.check_invariants()
    finally:
        manager.close()


def test_reset_drops_promotion_pins(tmp_path: Path) -> None:
    manager = _tiering(tmp_path)
    try:
        k0, *rest = (key(i) for i in range(6))
        _on_disk_only(manager, [k0], rest[:4])
        a = ReqContext("a")
        _promote(manager, [k0], a)
        manager.reset()
        assert manager.stats()["pinned_promoted_blocks"] == 0
        manager.request_finished(a)  # nothing left to unpin: no error
        manager.check_invariants()
    finally:
        manager.close()


def test_without_host_room_a_request_waits_unless_it_has_promoted_blocks(tmp_path: Path) -> None:
    """Host of 4 slots, k0..k5 on disk only. A's scan queues k0..k3 (the room) and gets MISS at
    k4: it takes the prefix it has rather than wait for room it holds itself. B finds no room and
    no promotion of its own: it waits (RETRY, nothing queued) until A's load releases the room,
    then its promotion starts."""
    manager = _tiering(tmp_path)
    try:
        ks = [key(i) for i in range(6)]
        fillers = [key(i) for i in range(6, 14)]
        _on_disk_only(manager, ks[:4], fillers[:4])
        _on_disk_only(manager, ks[4:], fillers[4:])
        a, b = ReqContext("a"), ReqContext("b")
        assert [manager.lookup(k, a) for k in ks[:5]] == [RETRY] * 4 + [LookupResult.MISS]
        assert manager.lookup(ks[5], b) is RETRY
        stats = manager.stats()
        assert stats["room_waits"] == 1 and stats["promotions_in_flight"] == 4
        manager.step_end()
        manager.drain()
        assert manager.lookup(ks[5], b) is RETRY  # all four slots pinned for A
        assert manager.stats()["room_waits"] == 2
        manager.step_end()
        manager.drain()

        manager.prepare_load(ks[:4], a)
        manager.complete_load(ks[:4], a)
        assert manager.lookup(ks[5], b) is RETRY
        manager.step_end()
        manager.drain()
        stats = manager.stats()
        assert stats["room_waits"] == 2 and stats["refused_promotion_blocks"] == 0
        assert stats["promoted_blocks"] == 5
        assert manager.lookup(ks[5], b) is HIT
        manager.check_invariants()
    finally:
        manager.close()


def test_a_promotion_that_does_not_fit_promotes_the_longest_head_that_does(tmp_path: Path) -> None:
    """A looks up k0..k9 (on disk only) while the host has room for all ten; before the step
    ends another request's device load pins one host block, so ten no longer fit but nine do.
    The promotion takes the longest head that fits (nine: a binary search over head lengths;
    halving promoted five); only k9 is refused, and A recomputes from there."""
    manager = _tiering(tmp_path, host_blocks=10)
    try:
        ks = [key(i) for i in range(10)]
        fillers = [key(i) for i in range(10, 20)]
        _on_disk_only(manager, ks, fillers)
        a, c = ReqContext("a"), ReqContext("c")
        assert [manager.lookup(k, a) for k in ks] == [RETRY] * 10
        assert manager.lookup(fillers[-1], c) is HIT
        manager.prepare_load([fillers[-1]], c)  # one host slot fewer to reserve
        manager.step_end()
        manager.drain()
        stats = manager.stats()
        assert stats["promoted_blocks"] == 9
        assert stats["refused_promotion_blocks"] == 1
        assert [manager.lookup(k, a) for k in ks] == [HIT] * 9 + [LookupResult.MISS]
        manager.complete_load([fillers[-1]], c)
        manager.check_invariants()
    finally:
        manager.close()

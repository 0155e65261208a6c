"""The tiering manager's promotions, step by step with a real host tier and a real disk tier
(each step's I/O drained before the next, so the outcome never depends on thread timing)."""

from __future__ import annotations

from pathlib import Path

from tier_cases import host_pool, key, layout

from kvoffload.base import LookupResult, ReqContext
from kvoffload.managers import CPUOffloadingManager
from kvoffload.managers.tiering import TieringOffloadingManager
from kvoffload.tiers.disk import DiskTier

HIT, RETRY = LookupResult.HIT, LookupResult.RETRY


def _store(manager: TieringOffloadingManager, keys: list, ctx: ReqContext) -> None:
    """A device store into the host, completed and cascaded to disk."""
    out = manager.prepare_store(keys, ctx)
    assert out is not None and out.keys_to_store == keys
    manager.complete_store(keys, ctx)
    manager.drain()


def test_a_scan_hit_evicted_before_the_promotion_takes_no_room(tmp_path: Path) -> None:
    """Request A's host hits h0, h1 are followed by k0, k1 on disk only. In the same step, before
    the promotion is submitted, another request's device store evicts h1. The promotion then
    needs room for k0 and k1 only (h1 is gone: A looks it up again), and there is exactly that
    much: both are promoted, none refused, and no slot is taken for h1."""
    host = CPUOffloadingManager(4, "lru")
    disk = DiskTier(host_pool(4), layout(), tmp_path, 1 << 20, rescan_interval=0)
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
        assert out is not None and out.evicted_keys == [h1]
        manager.step_end()  # submits A's promotion: x0, x1 are the only evictable blocks
        manager.drain()

        stats = manager.stats()
        assert stats["promoted_blocks"] == 2
        assert stats["refused_promotion_blocks"] == 0
        assert stats["evicted_blocks"] == 2 + 1 + 2  # k0, k1; h1; x0, x1 (nothing for h1 again)
        assert [manager.lookup(k, a) for k in (h0, k0, k1)] == [HIT, HIT, HIT]
        manager.check_invariants()
    finally:
        manager.close()

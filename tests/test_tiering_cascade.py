"""Where cascades go: only to the tiers a request that stored the block allowed
(``kv_store_tiers``), under both cascade strategies, with a real host tier and two real disk
tiers (each step's I/O drained before the next)."""

from __future__ import annotations

from pathlib import Path

import pytest
from tier_cases import host_pool, key, layout

from kvoffload.manager_contract import LookupResult, ReqContext
from kvoffload.managers import CPUOffloadingManager
from kvoffload.managers.tiering import CASCADE_MODES, TieringOffloadingManager
from kvoffload.tiers.disk.settings import DiskTierSettings
from kvoffload.tiers.disk.tier import DiskTier

HOST_BLOCKS = 8


class SecondDisk(DiskTier):
    name = "disk2"


def _manager(tmp_path: Path, cascade: str) -> TieringOffloadingManager:
    pool = host_pool(HOST_BLOCKS)
    tiers = [
        DiskTier(pool, layout(), DiskTierSettings(tmp_path / "d1", 1 << 20, rescan_interval=0)),
        SecondDisk(pool, layout(), DiskTierSettings(tmp_path / "d2", 1 << 20, rescan_interval=0)),
    ]
    host = CPUOffloadingManager(HOST_BLOCKS, "lru")
    # on_evict cascades once fewer than half the host's slots are free.
    return TieringOffloadingManager(host, tiers, cascade, evict_headroom=0.5)


def _store(manager: TieringOffloadingManager, keys: list, ctx: ReqContext) -> list:
    out = manager.prepare_store(keys, ctx)
    assert out is not None
    manager.complete_store(out.keys_to_store, ctx)
    return out.keys_to_store


def _held(manager: TieringOffloadingManager, tier: int, keys: list) -> set:
    probe = ReqContext("probe")
    return {k for k in keys if manager.tiers[tier].lookup(k, probe) is LookupResult.HIT}


@pytest.mark.parametrize("cascade", CASCADE_MODES)
def test_a_block_cascades_only_to_tiers_a_request_that_stored_it_allowed(
    tmp_path: Path, cascade: str
) -> None:
    """A (``kv_store_tiers: []``), B (``["disk2"]``) and C (default: all) store two blocks
    each; D (``[]``) stores x, which E (all) offers again while the host holds it (E stores
    nothing, so it adds no tier). After the cascades: disk holds C's blocks only, disk2 B's and
    C's; x and A's blocks reach no tier."""
    manager = _manager(tmp_path, cascade)
    try:
        a0, a1, b0, b1, c0, c1, x = (key(i) for i in range(7))
        a = ReqContext("a", {"kv_store_tiers": []})
        b = ReqContext("b", {"kv_store_tiers": ["disk2"]})
        c = ReqContext("c")
        d = ReqContext("d", {"kv_store_tiers": []})
        e = ReqContext("e")
        assert _store(manager, [a0, a1], a) == [a0, a1]
        assert _store(manager, [b0, b1], b) == [b0, b1]
        assert _store(manager, [c0, c1], c) == [c0, c1]
        assert _store(manager, [x], d) == [x]
        assert _store(manager, [x], e) == []  # held: nothing stored for E
        for _ in range(4):  # on_evict: the host is 7/8 full, so every step cascades
            manager.drain()
        everything = [a0, a1, b0, b1, c0, c1, x]
        assert _held(manager, 0, everything) == {c0, c1}
        assert _held(manager, 1, everything) == {b0, b1, c0, c1}
        stats = manager.stats()
        assert stats["disk_stored_blocks"] == 2 and stats["disk2_stored_blocks"] == 4
        assert stats["cascade_lost_blocks"] == 0
        manager.check_invariants()
    finally:
        manager.close()

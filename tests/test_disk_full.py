"""A filesystem that fills before the disk tier's bound (issue 18, defect 7), on a real tmpfs
(root only; skipped where a tmpfs cannot be mounted; the fault-hook variants run everywhere):
the tier lowers its limit to what the filesystem holds, evicts to store new blocks, logs that
once, keeps its ledger equal to the files, and grows back when space is freed."""

from __future__ import annotations

import errno
import logging
import random
from pathlib import Path

import pytest
from engine_cases import (
    assert_same_outputs,
    cycling_rounds,
    greedy,
    one_thread,  # noqa: F401  (autouse fixture)
    reference_outputs,
)
from test_engine_disk import disk_engine, one_at_a_time
from tier_cases import (
    BLOCK_BYTES,
    disk_tier,
    fill_slot,
    host_pool,
    key,
    slot_bytes,
    small_tmpfs,
    wait_jobs,
)

from kvoffload.manager_contract import LookupResult, ReqContext
from kvoffload.tiers import TierJob
from kvoffload.tiers.disk.files import file_bytes
from kvoffload.tiers.disk.tier import DiskTier

CTX = ReqContext("test")
FILE = file_bytes(BLOCK_BYTES)
HIT = LookupResult.HIT


def full_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    """Warnings about the full filesystem, and per-block ENOSPC lines (there must be none)."""
    return [
        r.getMessage()
        for r in caplog.records
        if r.levelno >= logging.WARNING
        and ("is full before" in r.getMessage() or "No space left" in r.getMessage())
    ]


def store_batches(tier: DiskTier, pool: memoryview, first: int, batches: int) -> list[dict]:
    """``batches`` stores of 10 new keys each (keys from ``first`` on); their failed keys."""
    failed = []
    for j in range(batches):
        keys = [key(first + 10 * j + i) for i in range(10)]
        for i in range(10):
            fill_slot(pool, i, seed=first + 10 * j + i)
        tier.submit_store(TierJob(first + j, keys, list(range(10))))
        (result,) = wait_jobs(tier)
        failed.append(result.failed_keys)
    return failed


def test_a_filesystem_full_before_the_bound_lowers_the_limit_and_keeps_storing(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A 256 KiB tmpfs (31 block files) under a 60-block bound: the fourth store of 10 fills
    it; the write that finds it full lowers the tier's limit to what the filesystem holds, and
    every later store evicts and succeeds. Before the fix the index never reached its bound, so
    the tier never evicted: every later block failed "full" (0 of 20 stored), with a warning
    per block (29 lines). One I/O thread: the limit is measured once the whole job is done."""
    with small_tmpfs(tmp_path / "small", "256k") as mount:
        pool = host_pool(16)
        tier = disk_tier(mount, pool, blocks=60, num_threads=1)
        try:
            with caplog.at_level(logging.WARNING, logger="kvoffload"):
                failed = store_batches(tier, pool, 1000, 6)
            assert [bool(f) for f in failed] == [False] * 3 + [True] + [False] * 2
            assert set(failed[3].values()) == {"full"}
            stats = tier.stats()
            assert 0 < stats["capacity_blocks"] < 60
            assert stats["filesystem_full_stores"] >= 1
            assert len(full_lines(caplog)) == 1  # once, not once per block
            last = [key(1050 + i) for i in range(10)]
            assert all(tier.lookup(k, CTX) is HIT for k in last)
            tier.submit_load(TierJob(99, last, list(range(6, 16))))
            (loaded,) = wait_jobs(tier)
            assert loaded.success
            for i in range(10):
                assert slot_bytes(pool, 6 + i) == random.Random(1050 + i).randbytes(BLOCK_BYTES)
            assert not list(mount.rglob("*.tmp"))
            tier.check_ledger()
        finally:
            tier.close()


def test_the_limit_grows_back_when_space_is_freed(tmp_path: Path) -> None:
    """Another program's file fills most of the tmpfs; the tier's limit drops to what is left.
    When that file is deleted, the idle tier raises its limit again (at its periodic upkeep)."""
    with small_tmpfs(tmp_path / "small", "512k") as mount:
        filler = mount / "other-program.bin"
        filler.write_bytes(bytes(384 * 1024))
        pool = host_pool(16)
        tier = disk_tier(mount / "tier", pool, blocks=40)
        try:
            store_batches(tier, pool, 2000, 2)
            lowered = tier.stats()["capacity_blocks"]
            assert lowered < 40
            filler.unlink()
            tier._upkeep.refit_filesystem_when_idle()  # what the rescan thread does every interval
            assert tier.stats()["capacity_blocks"] > lowered
            assert not any(store_batches(tier, pool, 3000, 2))
            tier.check_ledger()
        finally:
            tier.close()


def test_enospc_from_a_fault_hook_is_logged_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Runs everywhere: every write fails ENOSPC; each fails "full", one warning in all."""

    def no_space(op: str, k: bytes) -> None:
        if op == "write":
            raise OSError(errno.ENOSPC, "No space left on device")

    pool = host_pool(16)
    tier = disk_tier(tmp_path, pool, blocks=60, fault_hook=no_space)
    try:
        with caplog.at_level(logging.WARNING, logger="kvoffload"):
            failed = store_batches(tier, pool, 0, 3)
        assert all(set(f.values()) == {"full"} and len(f) == 10 for f in failed)
        assert len(full_lines(caplog)) == 1
        assert tier.stats()["filesystem_full_stores"] == 3
        tier.check_ledger()
    finally:
        tier.close()


def test_engine_keeps_offloading_new_prefixes_after_the_filesystem_filled(
    tmp_path: Path,
) -> None:
    """The issue's repro, scaled down: a first pass over 8 prefixes fills the 160 KiB left on a
    2 MiB tmpfs, under a 1.6 MiB bound; a second pass over 3 new prefixes must still reach the disk: a restarted
    engine (empty device and host) serves their next requests from disk. Before the fix the
    second pass stored 0 blocks, and the restarted engine recomputed them. Outputs equal a run
    without offloading."""
    first = cycling_rounds(num_prefixes=8, prefix_blocks=6, num_rounds=1, seed=0)
    second = cycling_rounds(num_prefixes=3, prefix_blocks=6, num_rounds=2, seed=1)
    sampling = greedy(max_tokens=4)
    want = reference_outputs([p for r in first + second for p in r], sampling)
    with small_tmpfs(tmp_path / "small", "2m", free_kib=160) as mount:
        with disk_engine(mount) as engine:
            got = one_at_a_time(engine, first[0], sampling)
            filled = engine.stats()
            got += one_at_a_time(engine, second[0], sampling)
            stats = engine.stats()
            engine.tiering.tiers[0].check_ledger()  # type: ignore[union-attr]
        with disk_engine(mount) as restarted:
            got += one_at_a_time(restarted, second[1], sampling)
            again = restarted.stats()
    assert_same_outputs(got, want)
    assert filled["offload_tier_disk_failed_store_full"] > 0
    assert stats["offload_tier_disk_stored_blocks"] > filled["offload_tier_disk_stored_blocks"]
    assert again["offload_hit_tokens_disk"] > 0

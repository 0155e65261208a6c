"""The disk tier on real files: exact round trips, every kind of bad file detected and dropped,
a full disk, the bound, warm restart, two tiers on one directory, and bad settings."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest
from tier_cases import (
    BLOCK_BYTES,
    dir_bytes,
    disk_tier,
    fill_slot,
    host_pool,
    key,
    layout,
    slot_bytes,
    small_tmpfs,
    tier_file,
    tier_file_or_none,
    wait_jobs,
)

from kvoffload.errors import ConfigError
from kvoffload.manager_contract import LookupResult, ReqContext
from kvoffload.tiers import TierJob
from kvoffload.tiers.disk.files import file_bytes
from kvoffload.tiers.disk.settings import DiskTierSettings
from kvoffload.tiers.disk.tier import LEDGER_BYTES, DiskTier
from kvoffload.tiers.factory import validate_disk_settings

CTX = ReqContext("test")
FILE = file_bytes(BLOCK_BYTES)


def store(tier: DiskTier, job_id: int, keys: list, slots: list[int]) -> dict:
    tier.submit_store(TierJob(job_id, keys, slots))
    (result,) = wait_jobs(tier)
    assert result.job_id == job_id and result.is_store
    return result.failed_keys


def load(tier: DiskTier, job_id: int, keys: list, slots: list[int]) -> dict:
    tier.submit_load(TierJob(job_id, keys, slots))
    (result,) = wait_jobs(tier)
    assert result.job_id == job_id and not result.is_store
    return result.failed_keys


def test_store_then_load_returns_the_exact_bytes(tmp_path: Path) -> None:
    pool = host_pool(8)
    data = [fill_slot(pool, s, seed=s) for s in range(4)]
    with_tier = disk_tier(tmp_path, pool)
    try:
        assert with_tier.lookup(key(0), CTX) is LookupResult.MISS
        with_tier.submit_store(TierJob(1, [key(i) for i in range(4)], [0, 1, 2, 3]))
        assert with_tier.lookup(key(0), CTX) is LookupResult.HIT_PENDING
        wait_jobs(with_tier)
        assert with_tier.lookup(key(0), CTX) is LookupResult.HIT
        assert load(with_tier, 2, [key(3), key(0)], [4, 5]) == {}
        assert slot_bytes(pool, 4) == data[3] and slot_bytes(pool, 5) == data[0]
        stats = with_tier.stats()
        assert stats["stored_blocks"] == 4 and stats["loaded_blocks"] == 2
    finally:
        with_tier.close()


def _corrupt_flip(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[-7] ^= 0x40
    path.write_bytes(bytes(raw))


def _corrupt_truncate(path: Path) -> None:
    raw = path.read_bytes()
    path.write_bytes(raw[: len(raw) - 100])


def _corrupt_header(path: Path) -> None:
    raw = bytearray(path.read_bytes())
    raw[30] ^= 1  # inside the fixed header: the header checksum no longer matches
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    ("damage", "cause"),
    [(_corrupt_flip, "checksum"), (_corrupt_truncate, "corrupt"), (_corrupt_header, "corrupt")],
)
def test_bad_file_fails_its_load_is_counted_and_dropped(tmp_path: Path, damage, cause) -> None:
    pool = host_pool(4)
    fill_slot(pool, 0, seed=1)
    tier = disk_tier(tmp_path, pool)
    try:
        assert store(tier, 1, [key(7)], [0]) == {}
        path = tier_file(tmp_path, key(7))
        damage(path)
        assert load(tier, 2, [key(7)], [1]) == {key(7): cause}
        assert not path.exists()
        assert tier.lookup(key(7), CTX) is LookupResult.MISS
        stats = tier.stats()
        assert stats[f"failed_load_{cause}"] == 1 and stats["failed_load_blocks"] == 1
        assert dir_bytes(tmp_path) == LEDGER_BYTES  # its bytes went back to the ledger
        assert tier.stats()["dir_used_bytes"] == LEDGER_BYTES
    finally:
        tier.close()


def test_foreign_layout_file_is_never_served(tmp_path: Path) -> None:
    """A block written for another model, put where this model's block would be."""
    pool = host_pool(4)
    fill_slot(pool, 0, seed=3)
    other = DiskTier(
        pool, layout("other-model"), DiskTierSettings(tmp_path, 1 << 20, rescan_interval=0)
    )
    try:
        store(other, 1, [key(5)], [0])
    finally:
        other.close()
    tier = disk_tier(tmp_path, pool)
    try:
        assert tier.lookup(key(5), CTX) is LookupResult.MISS  # another namespace
        foreign = tier_file(
            tmp_path / "kvoffload-v2" / layout("other-model").fingerprint().hex(), key(5)
        )
        mine = Path(tier._files.path_of(key(5)))
        mine.parent.mkdir(parents=True, exist_ok=True)
        os.link(foreign, mine)
        tier.close()
        tier = disk_tier(tmp_path, pool)  # warm restart indexes the planted file by name
        assert tier.lookup(key(5), CTX) is LookupResult.HIT
        assert load(tier, 2, [key(5)], [1]) == {key(5): "layout"}
        assert tier.stats()["failed_load_layout"] == 1
        assert not mine.exists() and foreign.exists()
    finally:
        tier.close()


def test_missing_file_is_a_failed_load(tmp_path: Path) -> None:
    pool = host_pool(4)
    tier = disk_tier(tmp_path, pool)
    try:
        store(tier, 1, [key(1)], [0])
        tier_file(tmp_path, key(1)).unlink()  # another process evicted it
        assert load(tier, 2, [key(1)], [1]) == {key(1): "missing"}
        assert tier.lookup(key(1), CTX) is LookupResult.MISS
    finally:
        tier.close()


def test_bound_is_never_exceeded_and_eviction_follows_the_policy(tmp_path: Path) -> None:
    pool = host_pool(4)
    tier = disk_tier(tmp_path, pool, blocks=3)
    try:
        for i in range(6):
            fill_slot(pool, 0, seed=i)
            assert store(tier, i, [key(i)], [0]) == {}
            assert dir_bytes(tmp_path) <= tier.capacity_bytes
            tier.touch([key(0)], CTX)  # LRU keeps key 0
        held = [i for i in range(6) if tier.lookup(key(i), CTX) is LookupResult.HIT]
        assert held == [0, 4, 5]
        assert tier.stats()["evicted_blocks"] == 3
    finally:
        tier.close()


def test_blocks_being_loaded_are_not_evicted(tmp_path: Path) -> None:
    pool = host_pool(4)
    tier = disk_tier(tmp_path, pool, blocks=1)
    try:
        store(tier, 1, [key(1)], [0])
        tier.submit_load(TierJob(2, [key(1)], [1]))
        # The only block is pinned by the load: a store must fail ("full"), not evict it.
        tier.submit_store(TierJob(3, [key(2)], [2]))
        results = {r.job_id: r for r in wait_jobs(tier)}
        assert results[2].success
        assert results[3].failed_keys == {key(2): "full"}
        assert tier.lookup(key(1), CTX) is LookupResult.HIT
    finally:
        tier.close()


def test_warm_restart_indexes_the_directory(tmp_path: Path) -> None:
    pool = host_pool(8)
    data = {i: fill_slot(pool, i, seed=100 + i) for i in range(5)}
    tier = disk_tier(tmp_path, pool)
    store(tier, 1, [key(i) for i in range(5)], list(range(5)))
    tier.close()
    (tmp_path / "kvoffload-v2" / layout().fingerprint().hex() / "ab").mkdir(exist_ok=True)
    stale = tmp_path / "kvoffload-v2" / layout().fingerprint().hex() / "ab" / ".x.1.1.tmp"
    stale.write_bytes(b"half a block")
    os.utime(stale, (1, 1))  # a leftover of a writer killed long ago
    again = disk_tier(tmp_path, pool)
    try:
        assert again.stats()["scanned_blocks"] == 5
        assert not stale.exists()
        assert load(again, 2, [key(i) for i in range(5)], [7, 6, 5, 4, 3]) == {}
        for i, slot in zip(range(5), [7, 6, 5, 4, 3], strict=True):
            assert slot_bytes(pool, slot) == data[i]
    finally:
        again.close()


def test_a_smaller_bound_at_restart_trims_the_directory(tmp_path: Path) -> None:
    pool = host_pool(8)
    tier = disk_tier(tmp_path, pool, blocks=8)
    store(tier, 1, [key(i) for i in range(6)], list(range(6)))
    tier.close()
    small = disk_tier(tmp_path, pool, blocks=2)
    try:
        assert small.stats()["used_blocks"] == 2
        assert dir_bytes(tmp_path) <= small.capacity_bytes
    finally:
        small.close()


def test_two_tiers_on_one_directory_share_blocks_and_one_bound(tmp_path: Path) -> None:
    pool_a, pool_b = host_pool(8), host_pool(8)
    a = disk_tier(tmp_path, pool_a, blocks=4, rescan_interval=0.01)
    b = disk_tier(tmp_path, pool_b, blocks=4, rescan_interval=0.01)
    try:
        data = fill_slot(pool_a, 0, seed=9)
        store(a, 1, [key(1)], [0])
        for _ in range(2000):  # b's rescan finds a's file (bounded wait, not a timing assert)
            b.get_finished_jobs()
            if b.lookup(key(1), CTX) is LookupResult.HIT:
                break
            time.sleep(0.005)
        assert b.lookup(key(1), CTX) is LookupResult.HIT
        assert load(b, 2, [key(1)], [3]) == {}
        assert slot_bytes(pool_b, 3) == data
        # Both write; the directory never holds more than the bound.
        for i in range(2, 12):
            fill_slot(pool_a, 1, seed=i)
            fill_slot(pool_b, 1, seed=i)
            a.submit_store(TierJob(10 + i, [key(i)], [1]))
            b.submit_store(TierJob(10 + i, [key(i + 100)], [1]))
            wait_jobs(a)
            wait_jobs(b)
            assert dir_bytes(tmp_path) <= a.capacity_bytes
    finally:
        a.close()
        b.close()


def test_same_block_written_by_two_tiers_at_once_is_one_intact_file(tmp_path: Path) -> None:
    pool_a, pool_b = host_pool(2), host_pool(2)
    data = fill_slot(pool_a, 0, seed=5)
    pool_b.cast("B")[:BLOCK_BYTES] = data
    a = disk_tier(tmp_path, pool_a)
    b = disk_tier(tmp_path, pool_b)
    try:
        a.submit_store(TierJob(1, [key(1)], [0]))
        b.submit_store(TierJob(1, [key(1)], [0]))
        assert wait_jobs(a)[0].success and wait_jobs(b)[0].success
        assert load(a, 2, [key(1)], [1]) == {}
        assert slot_bytes(pool_a, 1) == data
        assert dir_bytes(tmp_path) == LEDGER_BYTES + FILE
        # The shared count, read now: a.stats() reports it as a last saw it, which may be
        # before b returned its duplicate's bytes (the two jobs finish in either order).
        assert a._ledger.read() + LEDGER_BYTES == LEDGER_BYTES + FILE
    finally:
        a.close()
        b.close()


def test_no_space_from_the_os_fails_stores_cleanly(tmp_path: Path) -> None:
    """The fault-hook variant: runs everywhere."""

    def no_space(op: str, k: bytes) -> None:
        if op == "write" and k == key(2):
            raise OSError(errno.ENOSPC, "No space left on device")

    pool = host_pool(4)
    tier = disk_tier(tmp_path, pool, fault_hook=no_space)
    try:
        failed = store(tier, 1, [key(1), key(2), key(3)], [0, 1, 2])
        assert failed == {key(2): "full"}
        assert tier.lookup(key(2), CTX) is LookupResult.MISS
        assert tier.lookup(key(3), CTX) is LookupResult.HIT
        assert tier.stats()["failed_store_full"] == 1
        assert dir_bytes(tmp_path) == LEDGER_BYTES + 2 * FILE == tier.stats()["dir_used_bytes"]
    finally:
        tier.close()


def test_a_really_full_filesystem_fails_stores_cleanly(tmp_path: Path) -> None:
    """A 64 KiB tmpfs under a 1 MiB bound: the OS runs out first (skips unless root)."""
    with small_tmpfs(tmp_path / "small", "64k") as mount:
        pool = host_pool(40)
        tier = disk_tier(mount, pool, blocks=40)
        try:
            failed = store(tier, 1, [key(i) for i in range(40)], list(range(40)))
            assert failed and set(failed.values()) == {"full"}
            stored = [i for i in range(40) if tier.lookup(key(i), CTX) is LookupResult.HIT]
            assert stored and len(stored) + len(failed) == 40
            assert not list(mount.rglob("*.tmp"))  # failed writes leave nothing behind
            assert load(tier, 2, [key(stored[0])], [0]) == {}
        finally:
            tier.close()


@pytest.mark.parametrize("size", [0, -1.0, float("nan"), float("inf"), "1"])
def test_bad_size_is_a_config_error(tmp_path: Path, size) -> None:
    with pytest.raises(ConfigError, match="kv_disk_size"):
        validate_disk_settings(tmp_path, size)


def test_size_below_one_block_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="kv_disk_size"):
        DiskTier(host_pool(2), layout(), DiskTierSettings(tmp_path, FILE))


def test_path_that_is_a_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(ConfigError, match="kv_disk_path"):
        validate_disk_settings(path, 1.0)
    with pytest.raises(ConfigError, match="kv_disk_path"):
        DiskTier(host_pool(2), layout(), DiskTierSettings(path, 1 << 20))


def test_unwritable_path_is_a_config_error(tmp_path: Path) -> None:
    if os.geteuid() == 0:  # root writes anywhere chmod allows nothing: use a read-only mount
        with small_tmpfs(tmp_path / "ro", "64k") as mount:
            import subprocess

            subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True)
            with pytest.raises(ConfigError, match="kv_disk_path"):
                DiskTier(host_pool(2), layout(), DiskTierSettings(mount / "tier", 1 << 20))
    else:
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        with pytest.raises(ConfigError, match="kv_disk_path"):
            validate_disk_settings(locked / "tier", 1.0)


def _page_aligned_pool(num_slots: int, block_bytes: int) -> memoryview:
    import mmap

    buf = mmap.mmap(-1, num_slots * block_bytes)  # page aligned
    return memoryview(buf).cast("B", (num_slots, block_bytes))


def test_o_direct_round_trip(tmp_path: Path) -> None:
    pool = _page_aligned_pool(4, 4096)
    data = fill_slot(pool, 0, seed=11)
    lay = layout(block_bytes=4096)
    try:
        settings = DiskTierSettings(tmp_path, 1 << 20, o_direct=True, rescan_interval=0)
        tier = DiskTier(pool, lay, settings)
    except ConfigError as exc:  # a filesystem without O_DIRECT: refused cleanly
        pytest.skip(str(exc))
    try:
        assert store(tier, 1, [key(1)], [0]) == {}
        assert load(tier, 2, [key(1)], [3]) == {}
        assert slot_bytes(pool, 3) == data
    finally:
        tier.close()


def test_o_direct_needs_aligned_blocks(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="kv_disk_o_direct"):
        settings = DiskTierSettings(tmp_path, 1 << 20, o_direct=True)
        DiskTier(_page_aligned_pool(4, 2048), layout(), settings)


def test_regression_store_that_evicts_never_finds_the_room_of_its_own_victims_taken(
    tmp_path: Path,
) -> None:
    """Only a store's first chunk used to unlink its victims: another I/O thread could reserve
    before it and fail ``"full"`` with the room about to be freed. Now the victims go and the
    whole job is reserved in one ledger step before any block is written. The hook checks that
    at every write (whatever order the threads run in); before the fix, a chunk could write with
    victims still on disk, and gating the first chunk's reservation failed 4 of 8 blocks."""
    victims = [key(i) for i in range(8)]
    seen_at_write: list[tuple[bool, int]] = []

    def check(op: str, k: bytes) -> None:
        if op == "write" and k not in victims:
            on_disk = any(tier_file_or_none(tmp_path, v) for v in victims)
            seen_at_write.append((on_disk, tier._ledger.read()))

    pool = host_pool(16)
    data = {i: fill_slot(pool, 8 + i, seed=40 + i) for i in range(8)}
    tier = disk_tier(tmp_path, pool, blocks=8, num_threads=4, fault_hook=check)
    try:
        assert store(tier, 1, victims, list(range(8))) == {}
        new = [key(i) for i in range(10, 18)]
        assert store(tier, 2, new, list(range(8, 16))) == {}
        assert seen_at_write == [(False, 8 * FILE)] * 8
        assert all(tier.lookup(k, CTX) is LookupResult.MISS for k in victims)
        assert load(tier, 3, new, list(range(8))) == {}
        assert all(slot_bytes(pool, i) == data[i] for i in range(8))
        assert dir_bytes(tmp_path) == LEDGER_BYTES + 8 * FILE == tier.stats()["dir_used_bytes"]
    finally:
        tier.close()


def test_store_that_does_not_fit_keeps_its_longest_prefix(tmp_path: Path) -> None:
    """Room taken by another process's blocks the index does not know of: the job's first
    blocks are stored, the rest fail ``"full"``, and the ledger holds exactly the files."""
    pool = host_pool(8)
    other = disk_tier(tmp_path, pool, blocks=4)
    tier = disk_tier(tmp_path, pool, blocks=4)
    try:
        assert store(other, 1, [key(100), key(101)], [0, 1]) == {}
        failed = store(tier, 1, [key(i) for i in range(4)], [0, 1, 2, 3])
        assert failed == {key(2): "full", key(3): "full"}
        assert [tier.lookup(key(i), CTX) for i in range(4)] == [LookupResult.HIT] * 2 + [
            LookupResult.MISS
        ] * 2
        assert dir_bytes(tmp_path) == LEDGER_BYTES + 4 * FILE == tier.stats()["dir_used_bytes"]
    finally:
        other.close()
        tier.close()


def test_blocks_found_on_disk_are_announced_once(tmp_path: Path) -> None:
    """A warm start (and the rescan) announce the blocks they index as stored, once, so an
    event consumer learns what a restarted engine holds; later events are as usual."""
    pool = host_pool(8)
    first = disk_tier(tmp_path, pool)
    store(first, 1, [key(i) for i in range(3)], [0, 1, 2])
    first.close()
    again = disk_tier(tmp_path, pool, enable_events=True)
    quiet = disk_tier(tmp_path, pool)  # events off: nothing is kept
    try:
        (event,) = again.take_events()
        assert (event.medium, event.removed, event.locality) == ("STORAGE", False, "LOCAL")
        assert sorted(event.keys) == sorted(key(i) for i in range(3))
        assert again.take_events() == []
        assert quiet.take_events() == [] and quiet._events is None
        # Another process's new block, found by the rescan, is announced at the next poll.
        store(quiet, 2, [key(7)], [3])
        # Its directory's mtime may not have ticked yet: list every directory again.
        again._rescanner.rescan_once(changed_only=False)
        assert again.get_finished_jobs() == []
        assert [(e.keys, e.removed) for e in again.take_events()] == [([key(7)], False)]
        assert again.stats()["discovered_blocks"] == 1
    finally:
        again.close()
        quiet.close()

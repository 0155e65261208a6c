"""Files made ahead of the disk tier's writes (issue 23): spare files made while idle, victims'
files recycled only when no other process can hold them, publication by rename; on real files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from tier_cases import (
    BLOCK_BYTES,
    disk_tier,
    fill_slot,
    host_pool,
    key,
    slot_bytes,
    wait_jobs,
)

from kvoffload.keys import OffloadKey
from kvoffload.tiers import TierJob
from kvoffload.tiers.disk.files import file_bytes
from kvoffload.tiers.disk.spares import SPARE_DIR, SPARE_SUFFIX, _Renamer
from kvoffload.tiers.disk.tier import DiskTier

FILE = file_bytes(BLOCK_BYTES)


def spares(tier: DiskTier) -> list[Path]:
    return sorted((tier.namespace / SPARE_DIR).glob(f"*{SPARE_SUFFIX}"))


def store(tier: DiskTier, job_id: int, keys: list, slots: list[int]) -> None:
    tier.submit_store(TierJob(job_id, keys, slots))
    assert all(r.success for r in wait_jobs(tier))


def inode(tier: DiskTier, k: OffloadKey) -> int:
    return os.stat(tier._files.path_of(k)).st_ino


def test_spare_files_made_while_idle_take_the_next_writes(tmp_path: Path) -> None:
    """After a store the idle tier makes empty spare files (up to its target, here its 8-block
    capacity); the next store writes into them and publishes them under the blocks' names."""
    pool = host_pool(8)
    tier = disk_tier(tmp_path, pool, blocks=8)
    try:
        store(tier, 1, [key(0)], [0])
        made = spares(tier)
        assert len(made) == 8 and all(p.stat().st_size == 0 for p in made)
        inodes = {p.stat().st_ino for p in made}
        data = [fill_slot(pool, s, seed=s) for s in range(1, 4)]
        store(tier, 2, [key(i) for i in range(1, 4)], [1, 2, 3])
        assert {inode(tier, key(i)) for i in range(1, 4)} <= inodes  # written into spares
        tier.submit_load(TierJob(3, [key(i) for i in range(1, 4)], [4, 5, 6]))
        (loaded,) = wait_jobs(tier)
        assert loaded.success
        assert [slot_bytes(pool, s) for s in (4, 5, 6)] == data
        tier.check_ledger()  # empty spares hold no reservation
    finally:
        tier.close()
    assert not spares(tier)  # close removes the tier's spare files


def test_a_victims_file_is_recycled_when_no_other_process_uses_the_directory(
    tmp_path: Path,
) -> None:
    """Alone on the directory, a store that evicts writes into its victims' files (renamed away
    first): no unlink, no new file."""
    pool = host_pool(8)
    tier = disk_tier(tmp_path, pool, blocks=4)
    try:
        store(tier, 1, [key(i) for i in range(4)], [0, 1, 2, 3])
        victim = inode(tier, key(0))
        data = fill_slot(pool, 4, seed=40)
        store(tier, 2, [key(4)], [4])  # evicts key 0 (LRU)
        assert not os.path.exists(tier._files.path_of(key(0)))
        assert inode(tier, key(4)) == victim
        tier.submit_load(TierJob(3, [key(4)], [5]))
        (loaded,) = wait_jobs(tier)
        assert loaded.success and slot_bytes(pool, 5) == data
        tier.check_ledger()
    finally:
        tier.close()


def test_a_victim_another_process_may_read_is_unlinked_never_overwritten(tmp_path: Path) -> None:
    """With another user on the directory (a second tier: its own lock), the evicted file is
    unlinked as before: a reader that opened it keeps reading its bytes intact."""
    pool = host_pool(8)
    tier = disk_tier(tmp_path, pool, blocks=4)
    other = disk_tier(tmp_path, host_pool(2), blocks=4)
    try:
        old = fill_slot(pool, 0, seed=7)
        store(tier, 1, [key(i) for i in range(4)], [0, 1, 2, 3])
        path = tier._files.path_of(key(0))
        before = Path(path).read_bytes()
        reader = os.open(path, os.O_RDONLY)  # the other process's load, in flight
        try:
            fill_slot(pool, 4, seed=41)
            store(tier, 2, [key(4)], [4])  # evicts key 0
            assert not os.path.exists(path)
            assert os.pread(reader, len(before) + 1, 0) == before
            assert before.endswith(old)
            assert inode(tier, key(4)) != os.fstat(reader).st_ino
        finally:
            os.close(reader)
        tier.check_ledger()
    finally:
        other.close()
        tier.close()


def test_a_killed_writers_spares_are_cleaned(tmp_path: Path) -> None:
    """A spare with bytes in it, older than the stale age, is a killed writer's: the scan removes
    it and returns its reservation. Empty spares of processes that are gone are removed by the
    next process that starts alone on the directory."""
    pool = host_pool(4)
    tier = disk_tier(tmp_path, pool, blocks=4)
    try:
        directory = tier.namespace / SPARE_DIR
        assert tier._ledger.reserve_blocks(1, FILE, []) == (1, [])  # the killed writer's
        written = directory / f"99999-dead.1{SPARE_SUFFIX}"
        written.write_bytes(b"half a block")
        empty = directory / f"99999-dead.2{SPARE_SUFFIX}"
        empty.write_bytes(b"")
        for path in (written, empty):
            os.utime(path, (1, 1))
        tier._rescanner.rescan_once(changed_only=False)
        assert not written.exists() and empty.exists()
        tier.check_ledger()
    finally:
        tier.close()
    again = disk_tier(tmp_path, pool, blocks=4)
    try:
        assert not empty.exists()
    finally:
        again.close()


@pytest.mark.parametrize("noreplace", [True, False], ids=["renameat2", "link+unlink"])
def test_publishing_never_replaces_a_block(tmp_path: Path, noreplace: bool) -> None:
    """A spare is published under its block's name only if no file has that name (the second of
    two writers of one block drops its copy), with renameat2 or the fallback for filesystems
    without RENAME_NOREPLACE."""
    publish = _Renamer()
    if not noreplace:
        publish._renameat2 = None
    src, dst = tmp_path / "spare", tmp_path / "block"
    src.write_bytes(b"new")
    dst.write_bytes(b"old")
    with pytest.raises(FileExistsError):
        publish(str(src), str(dst))
    assert dst.read_bytes() == b"old" and src.read_bytes() == b"new"
    dst.unlink()
    publish(str(src), str(dst))
    assert dst.read_bytes() == b"new" and not src.exists()

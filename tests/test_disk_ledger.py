"""The disk tier's shared ledger stays equal to the files on disk through every fault (issue 18,
defect 6), on real files: a victim's late unlink racing a re-store of its key, a ledger step that
fails before or after its unlinks, a killed writer's temporaries removed by a scan."""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager
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
from kvoffload.manager_contract import LookupResult, ReqContext
from kvoffload.tiers import TierJob
from kvoffload.tiers.disk.files import file_bytes
from kvoffload.tiers.disk.ledger import SpaceLedger
from kvoffload.tiers.disk.tier import DiskTier

CTX = ReqContext("test")
FILE = file_bytes(BLOCK_BYTES)
HIT, MISS = LookupResult.HIT, LookupResult.MISS


def block_files(root: Path) -> set[bytes]:
    return {bytes.fromhex(p.stem) for p in root.rglob("*.kvb")}


def test_a_victims_late_unlink_never_deletes_its_keys_new_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Job 2 evicts key 1; its ledger step (which unlinks key 1's file) is held back until job 3,
    which stores key 1 again, has written its file, or for 1 s. Before the fix job 3 went first:
    its write found the old file, counted it as published, and job 2 then deleted it: the next
    load of key 1 failed "missing". Now stores take their ledger steps in submission order, so
    job 3 waits for job 2's step and writes a new file after the unlink."""
    pool = host_pool(8)
    tier = disk_tier(tmp_path, pool, blocks=3, num_threads=2)
    rewritten = threading.Event()
    victim = tier._files.path_of(key(1))
    reserve = SpaceLedger.reserve_blocks

    def held_back(self: SpaceLedger, count: int, block_bytes: int, victims: list, *more):
        if victim in victims:
            rewritten.wait(1.0)
        return reserve(self, count, block_bytes, victims, *more)

    try:
        data = fill_slot(pool, 0, seed=1)
        tier.submit_store(TierJob(1, [key(1), key(9)], [0, 0]))
        wait_jobs(tier)
        write = tier._files.write

        def write_and_tell(
            k: OffloadKey, slot: int, spare: str | None = None, frame: bytes | None = None
        ) -> bool:
            published = write(k, slot, spare, frame)
            if k == key(1):
                rewritten.set()
            return published

        monkeypatch.setattr(SpaceLedger, "reserve_blocks", held_back)
        monkeypatch.setattr(tier._files, "write", write_and_tell)
        tier.submit_store(TierJob(2, [key(2), key(3)], [1, 1]))  # evicts key 1 (LRU)
        assert tier.lookup(key(1), CTX) is MISS
        tier.submit_store(TierJob(3, [key(1)], [0]))  # key 1 again (evicts key 9)
        assert all(r.success for r in wait_jobs(tier))
        assert tier.lookup(key(1), CTX) is HIT
        tier.submit_load(TierJob(4, [key(1)], [5]))
        (loaded,) = wait_jobs(tier)
        assert loaded.failed_keys == {}
        assert slot_bytes(pool, 5) == data
        tier.check_ledger()
    finally:
        tier.close()


@contextmanager
def ledger_fd_replaced(tier: DiskTier, flags: int) -> Iterator[None]:
    """The ledger's descriptor swapped for one opened with ``flags`` on the same file (a real
    EBADF on reads or on writes), then restored."""
    fd = tier._ledger._fd
    saved = os.dup(fd)
    other = os.open(tier.namespace / "ledger", flags)
    os.dup2(other, fd)
    os.close(other)
    try:
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)


@pytest.mark.parametrize(
    "flags",
    [os.O_WRONLY, os.O_RDONLY],
    ids=["step fails before its unlinks", "step fails after its unlinks"],
)
def test_a_failed_ledger_step_loses_no_capacity(tmp_path: Path, flags: int) -> None:
    """A store's ledger step fails (the count cannot be read, or cannot be written after the
    victims were unlinked): its blocks fail "io". Before the fix the victims stayed counted in
    the ledger (and, failing before the unlinks, on disk, out of every index): the next store
    found the directory full, 2 blocks of 2 lost. Now the next step unlinks the victims it owes
    and settles the bytes a failed step freed: the ledger equals the files again."""
    pool = host_pool(8)
    tier = disk_tier(tmp_path, pool, blocks=2)
    try:
        tier.submit_store(TierJob(1, [key(1), key(2)], [0, 1]))
        wait_jobs(tier)
        with ledger_fd_replaced(tier, flags):
            tier.submit_store(TierJob(2, [key(3), key(4)], [2, 3]))  # evicts keys 1 and 2
            (failed,) = wait_jobs(tier)
        assert failed.failed_keys == {key(3): "io", key(4): "io"}
        tier.submit_store(TierJob(3, [key(5), key(6)], [4, 5]))
        (stored,) = wait_jobs(tier)
        assert stored.success
        assert block_files(tmp_path) == {key(5), key(6)}
        assert [tier.lookup(key(i), CTX) for i in (1, 2, 5, 6)] == [MISS, MISS, HIT, HIT]
        tier.check_ledger()
    finally:
        tier.close()


def test_stale_temporaries_removed_by_a_scan_return_their_reservations(tmp_path: Path) -> None:
    """A writer killed mid-write leaves its reservations in the ledger and its temporary files
    on disk. Before the fix the rescan deleted the files 60 s later but kept counting their
    bytes (2 blocks of capacity lost); now the scan returns one reservation per file it
    removes. A block file's second name (its writer died between link and unlink) is only
    unlinked: its bytes belong to the block."""
    pool = host_pool(8)
    tier = disk_tier(tmp_path, pool, blocks=4)
    try:
        tier.submit_store(TierJob(1, [key(1)], [0]))
        wait_jobs(tier)
        hash_dir = tier.namespace / "ab"
        hash_dir.mkdir(exist_ok=True)
        assert tier._ledger.reserve_blocks(2, FILE, []) == (2, [])  # the killed writer's
        leftovers = [hash_dir / f".{key(50 + i).hex()}.999999.{i}.tmp" for i in range(2)]
        for path in leftovers:
            path.write_bytes(b"half a block")
        second_name = hash_dir / f".{key(1).hex()}.999999.9.tmp"
        os.link(tier._files.path_of(key(1)), second_name)
        for path in [*leftovers, second_name]:
            os.utime(path, (1, 1))  # written long ago
        tier._rescanner.rescan_once(changed_only=False)
        assert not list(tmp_path.rglob("*.tmp"))
        assert block_files(tmp_path) == {key(1)}
        tier.check_ledger()
        tier.submit_store(TierJob(2, [key(i) for i in range(2, 5)], [1, 2, 3]))
        (stored,) = wait_jobs(tier)
        assert stored.success  # the room came back: 4 blocks of 4
        tier.check_ledger()
    finally:
        tier.close()


def test_check_ledger_notices_drift(tmp_path: Path) -> None:
    """The check the tests rely on fails when the ledger and the files disagree."""
    pool = host_pool(4)
    tier = disk_tier(tmp_path, pool, blocks=4)
    try:
        tier.submit_store(TierJob(1, [key(1)], [0]))
        wait_jobs(tier)
        tier.check_ledger()
        tier._ledger.release(FILE)
        with pytest.raises(AssertionError, match="ledger counts 0 bytes"):
            tier.check_ledger()
    finally:
        tier.close()

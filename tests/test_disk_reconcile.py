"""The shared ledger converges to the files on disk while processes share the directory
(issue 29): a writer SIGKILLed mid-store leaves reservations for files that never appear and
its spare files; block files removed by hand leave their bytes counted. Real processes, real
files; the kill happens at a chosen write (the child blocks there), never at a timed moment."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from tier_cases import disk_tier, host_pool, key, wait_jobs

from kvoffload.manager_contract import LookupResult, ReqContext
from kvoffload.tiers import TierJob
from kvoffload.tiers.disk.files import SUFFIX
from kvoffload.tiers.disk.scan import count_files
from kvoffload.tiers.disk.spares import SPARE_DIR
from kvoffload.tiers.disk.tier import DiskTier
from kvoffload.tiers.disk.upkeep import RECONCILE_EVERY_TICKS

TESTS = Path(__file__).parent
CTX = ReqContext("test")


def stuck_writer(root: Path, blocks: int, first_key: int, writes: int) -> subprocess.Popen[str]:
    """A child process on ``root`` stopped before its ``writes``-th block write of a 16-block
    store (see ``disk_tier_proc.py``); returned once it is there."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(TESTS.parent), str(TESTS)]))
    proc = subprocess.Popen(
        [
            sys.executable,
            str(TESTS / "disk_tier_proc.py"),
            str(root),
            str(blocks),
            str(first_key),
            str(writes),
        ],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline()  # bounded: the child prints it or exits
    if line != "stuck\n":
        proc.kill()
        _, err = proc.communicate()
        raise AssertionError(f"the writer did not get stuck: {line!r} {err}")
    return proc


def kill(proc: subprocess.Popen[str]) -> None:
    proc.send_signal(signal.SIGKILL)
    proc.communicate()
    assert proc.returncode == -signal.SIGKILL


def drift(tier: DiskTier) -> int:
    """Bytes the ledger counts beyond the namespace's files (other processes idle or dead)."""
    return tier._ledger.read() - count_files(tier.namespace) * tier.file_bytes


def foreign_spares(tier: DiskTier) -> list[str]:
    return [
        name
        for name in os.listdir(tier.namespace / SPARE_DIR)
        if not name.startswith(tier._ledger.owner + ".")
    ]


def test_writers_killed_mid_store_leave_no_drift_once_the_survivor_reconciles(
    tmp_path: Path,
) -> None:
    """Three writers, each SIGKILLed with 16 blocks reserved and 4 published, next to a live
    tier. Before the fix the survivor's ledger kept 3 x 12 blocks too many and every killed
    writer's empty spares stayed (until a process started alone); now the survivor's next
    upkeep tick finds the dead writers' slots and reconciles: the count equals the files,
    the spares are gone, and the whole bound can be written again."""
    blocks = 96
    survivor = disk_tier(tmp_path, host_pool(24), blocks=blocks)
    try:
        for round_no in range(3):
            proc = stuck_writer(tmp_path, blocks, 1000 * (round_no + 1), writes=5)
            try:
                assert not survivor.reconcile_ledger()  # its writes are in flight: wait
            finally:
                kill(proc)
        assert drift(survivor) == 3 * 12 * survivor.file_bytes
        assert foreign_spares(survivor)
        survivor._upkeep.tick()  # one rescan tick
        assert drift(survivor) == 0
        survivor.check_ledger()
        assert foreign_spares(survivor) == []
        survivor.submit_store(TierJob(1, [key(i) for i in range(24)], list(range(24))))
        (stored,) = wait_jobs(survivor)
        assert stored.success
        assert count_files(survivor.namespace) == 3 * (8 + 4) + 24
        survivor.check_ledger()
    finally:
        survivor.close()


def test_block_files_removed_by_hand_leave_the_ledger_at_the_next_tick(tmp_path: Path) -> None:
    """Before the fix, 5 block files removed by hand kept their bytes counted until a process
    started alone; now the load that finds one missing makes the next upkeep tick reconcile,
    while another process keeps using the directory."""
    pool = host_pool(8)
    tier = disk_tier(tmp_path, pool, blocks=8)
    other = disk_tier(tmp_path, host_pool(2), blocks=8)
    try:
        tier.submit_store(TierJob(1, [key(i) for i in range(8)], list(range(8))))
        assert all(r.success for r in wait_jobs(tier))
        for i in range(5):
            os.unlink(tier._files.path_of(key(i)))
        assert drift(tier) == 5 * tier.file_bytes
        tier.submit_load(TierJob(2, [key(0)], [0]))
        (loaded,) = wait_jobs(tier)
        assert loaded.failed_keys == {key(0): "missing"}
        tier._upkeep.tick()
        assert drift(tier) == 0
        tier.check_ledger()
        assert tier.lookup(key(0), CTX) is LookupResult.MISS
        assert sorted(tier.namespace.rglob(f"*{SUFFIX}")) == sorted(
            Path(tier._files.path_of(key(i))) for i in range(5, 8)
        )
    finally:
        other.close()
        tier.close()


def test_a_reconciliation_is_dropped_when_a_ledger_step_came_between(tmp_path: Path) -> None:
    """The walk runs unlocked: if any step changed the ledger meanwhile, nothing is set."""
    tier = disk_tier(tmp_path, host_pool(4), blocks=8)
    try:
        tier.submit_store(TierJob(1, [key(1)], [0]))
        wait_jobs(tier)
        census = tier._ledger.census()
        assert census.quiescent
        tier._ledger.release(0)  # another step
        assert not tier._ledger.settle_census(census, 0, [])
        tier.check_ledger()
    finally:
        tier.close()


def test_the_last_process_to_close_leaves_no_drift(tmp_path: Path) -> None:
    """Before the fix, with no process left the ledger still counted a killed writer's
    reservations (and its spares stayed): the survivor's close now reconciles when a dead
    writer's slot is there, even if no tick came."""
    survivor = disk_tier(tmp_path, host_pool(4), blocks=64)
    namespace, file_bytes = survivor.namespace, survivor.file_bytes
    kill(stuck_writer(tmp_path, 64, 1000, writes=3))
    assert drift(survivor) == 14 * file_bytes
    survivor.close()
    count = int.from_bytes((namespace / "ledger").read_bytes()[:8], "little")
    assert count == count_files(namespace) * file_bytes == 10 * file_bytes
    assert os.listdir(namespace / SPARE_DIR) == []


def test_files_removed_by_hand_and_never_loaded_leave_the_ledger_within_30_ticks(
    tmp_path: Path,
) -> None:
    """Nothing asks for a reconciliation (no load, no dead process): the periodic one does."""
    tier = disk_tier(tmp_path, host_pool(4), blocks=8)
    try:
        tier.submit_store(TierJob(1, [key(i) for i in range(4)], list(range(4))))
        assert all(r.success for r in wait_jobs(tier))
        os.unlink(tier._files.path_of(key(3)))
        for _ in range(RECONCILE_EVERY_TICKS - 1):
            tier._upkeep.tick()
        assert drift(tier) == tier.file_bytes
        tier._upkeep.tick()
        assert drift(tier) == 0
    finally:
        tier.close()

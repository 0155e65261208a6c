"""The tiering manager's store path within bounds, step by step with a real host tier and a real
disk tier (each step's I/O drained or left running on purpose, never timed): cascade writes in
flight are bounded and the rest wait unpinned (shed if the host evicts them first), promotions
are submitted before waiting writes, write-through waits for reuse, and a disk hit lands within
one lookup when the manager may wait for it."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import pytest
from tier_cases import host_pool, key, layout

from kvoffload.errors import ConfigError
from kvoffload.keys import OffloadKey
from kvoffload.manager_contract import LookupResult, ReqContext
from kvoffload.managers import CPUOffloadingManager
from kvoffload.managers.tiering import TieringOffloadingManager
from kvoffload.tiers import TierJob, TierJobResult
from kvoffload.tiers.contract import ResultSignal
from kvoffload.tiers.disk.files import FaultHook
from kvoffload.tiers.disk.settings import DiskTierSettings
from kvoffload.tiers.disk.tier import DiskTier

HIT, MISS, RETRY = LookupResult.HIT, LookupResult.MISS, LookupResult.RETRY
PROBE = ReqContext("probe")


class RecordingDiskTier(DiskTier):
    """A real disk tier that records the order in which jobs reach it, and counts the calls
    asking it for results."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.submitted: list[tuple[str, list[bytes]]] = []
        self.result_polls = 0

    def get_finished_jobs(self) -> list[TierJobResult]:
        self.result_polls += 1
        return super().get_finished_jobs()

    def submit_store(self, job: TierJob, ctx: ReqContext | None = None) -> None:
        self.submitted.append(("store", list(job.keys)))
        super().submit_store(job, ctx)

    def submit_load(self, job: TierJob, ctx: ReqContext | None = None) -> None:
        self.submitted.append(("load", list(job.keys)))
        super().submit_load(job, ctx)


def _tiering(
    tmp_path: Path, host_blocks: int = 4, fault_hook: FaultHook | None = None, **bounds: object
) -> tuple[TieringOffloadingManager, RecordingDiskTier]:
    host = CPUOffloadingManager(host_blocks, "lru")
    settings = DiskTierSettings(tmp_path, 1 << 20, rescan_interval=0, fault_hook=fault_hook)
    disk = RecordingDiskTier(host_pool(host_blocks), layout(), settings)
    return TieringOffloadingManager(host, [disk], **bounds), disk  # type: ignore[arg-type]


def _store(manager: TieringOffloadingManager, keys: list, ctx: ReqContext) -> None:
    """A device store into the host, completed (its cascade queued, not submitted)."""
    out = manager.prepare_store(keys, ctx)
    assert out is not None and out.keys_to_store == keys
    manager.complete_store(keys, ctx)


def _on_disk(disk: DiskTier, keys: list) -> list[bool]:
    return [disk.lookup(k, PROBE) is HIT for k in keys]


def test_cascade_writes_beyond_the_bound_wait_and_are_shed_if_the_host_evicts_them(
    tmp_path: Path,
) -> None:
    """One write in flight: of a0-a2, a0 is written first and a1, a2 wait, unpinned. A device
    store that needs room evicts a1 (the oldest evictable block) before its turn: a1 is shed,
    never written; a2 is written once a0's write reports."""
    manager, disk = _tiering(tmp_path, max_in_flight=1)
    try:
        a0, a1, a2, b0, b1 = (key(i) for i in range(5))
        writer = ReqContext("writer")
        _store(manager, [a0, a1, a2], writer)
        manager.step_end()  # a0's write is submitted; a1, a2 wait
        stats = manager.stats()
        assert (stats["cascade_in_flight_blocks"], stats["cascade_backlog_blocks"]) == (1, 2)
        out = manager.prepare_store([b0, b1], writer)  # 1 free slot + 1 eviction
        assert out is not None and out.evicted_keys == [a1]  # a0 pinned by its write
        manager.complete_store([b0, b1], writer)
        manager.drain()
        stats = manager.stats()
        assert stats["shed_cascade_blocks"] == stats["disk_shed_store_blocks"] == 1
        assert _on_disk(disk, [a0, a1, a2, b0, b1]) == [True, False, True, True, True]
        assert [kind for kind, _ in disk.submitted] == ["store"] * 4  # one block each
        assert stats["cascade_backlog_blocks"] == stats["cascade_in_flight_blocks"] == 0
        manager.check_invariants()
    finally:
        manager.close()


def test_no_write_in_flight_allowed_sheds_every_cascade(tmp_path: Path) -> None:
    manager, disk = _tiering(tmp_path, max_in_flight=0)
    try:
        keys = [key(i) for i in range(3)]
        _store(manager, keys, ReqContext("writer"))
        manager.drain()
        assert _on_disk(disk, keys) == [False] * 3
        assert disk.submitted == []
        assert manager.stats()["disk_shed_store_blocks"] == 3
        assert [manager.host.lookup(k, PROBE) for k in keys] == [HIT] * 3  # the host keeps them
    finally:
        manager.close()


def test_a_promotion_is_submitted_before_the_writes_waiting_for_their_turn(
    tmp_path: Path,
) -> None:
    """k0 is on disk only; w0-w2 wait to be written (one in flight). Request A's lookup of k0
    queues its promotion: at the step's end it reaches the disk before w1, w2 (a load waits
    behind at most ``max_in_flight`` blocks of writes, never behind the whole backlog)."""
    manager, disk = _tiering(tmp_path, host_blocks=8, max_in_flight=1)
    try:
        k0, *rest = (key(i) for i in range(12))
        fillers, waiting = rest[:8], rest[8:11]
        writer = ReqContext("writer")
        _store(manager, [k0], writer)
        manager.drain()
        for i in range(0, 8, 2):
            _store(manager, fillers[i : i + 2], writer)
            manager.drain()
        assert manager.host.lookup(k0, PROBE) is MISS and _on_disk(disk, [k0]) == [True]
        disk.submitted.clear()
        _store(manager, waiting, writer)
        manager.step_end()  # w0's write is in flight; w1, w2 wait
        a = ReqContext("a")
        assert manager.lookup(k0, a) is RETRY
        manager.step_end()  # A's promotion; no room in flight for w1 yet
        manager.drain()
        assert disk.submitted == [
            ("store", [waiting[0]]),
            ("load", [k0]),
            ("store", [waiting[1]]),
            ("store", [waiting[2]]),
        ]
        assert manager.lookup(k0, a) is HIT
        manager.check_invariants()
    finally:
        manager.close()


def test_write_through_waits_until_a_second_request_sees_a_block(tmp_path: Path) -> None:
    """``min_reuse=2``: A's blocks stay in the host only; B's lookup of k0 makes it worth a
    write; k1, never seen again, is evicted unwritten (skipped), so a workload without reuse
    writes nothing to disk."""
    manager, disk = _tiering(tmp_path, min_reuse=2)
    try:
        k0, k1, *fillers = (key(i) for i in range(6))
        a, b = ReqContext("a"), ReqContext("b")
        assert [manager.lookup(k, a) for k in (k0, k1)] == [MISS, MISS]
        _store(manager, [k0, k1], a)
        manager.drain()
        assert _on_disk(disk, [k0, k1]) == [False, False]
        assert manager.lookup(k0, b) is HIT
        manager.drain()
        assert _on_disk(disk, [k0, k1]) == [True, False]
        _store(manager, fillers, ReqContext("c"))  # evicts k0 and k1 (k0 is on disk)
        manager.drain()
        stats = manager.stats()
        assert stats["skipped_cascade_blocks"] == 1  # k1 (the fillers are still in the host)
        assert stats["cascaded_blocks"] == 1
        manager.check_invariants()
    finally:
        manager.close()


def _disk_hits(manager: TieringOffloadingManager) -> tuple[list[OffloadKey], ReqContext]:
    """Blocks k0, k1 stored, then evicted from the host by four others (on disk only); request
    A's lookup pass answers RETRY for both (their promotion queued)."""
    k0, k1, *fillers = (key(i) for i in range(6))
    writer = ReqContext("writer")
    _store(manager, [k0, k1], writer)
    manager.drain()
    _store(manager, fillers, writer)
    manager.drain()
    a = ReqContext("a")
    assert [manager.lookup(k, a) for k in (k0, k1)] == [RETRY, RETRY]
    return [k0, k1], a


@pytest.mark.parametrize(("wait_s", "landed"), [(60.0, True), (0.0, False)])
def test_await_promotions_lands_a_disk_hit_within_the_lookup(
    tmp_path: Path, wait_s: float, landed: bool
) -> None:
    """A's lookup pass finds k0, k1 on disk only (RETRY). ``await_promotions`` submits the
    promotion at once and waits for it (60 s: always long enough, so never timing-dependent):
    the next pass of the same step answers HIT. With no wait allowed it answers RETRY, and the
    promotion goes out at the step's end as before."""
    manager, _ = _tiering(tmp_path, promotion_wait_s=wait_s)
    try:
        (k0, k1), a = _disk_hits(manager)
        assert manager.await_promotions(a) is landed
        expected = [HIT, HIT] if landed else [RETRY, RETRY]
        assert [manager.lookup(k, a) for k in (k0, k1)] == expected
        stats = manager.stats()
        assert stats["awaited_promotions_landed"] == int(landed)
        assert stats["promoted_blocks"] == (2 if landed else 0)
        manager.request_finished(a)
        manager.drain()
        manager.check_invariants()
    finally:
        manager.close()


def test_await_promotions_sleeps_until_a_tier_reports_within_its_bound(tmp_path: Path) -> None:
    """A's promotion is held on the disk tier's I/O thread (its read waits for ``release``):
    ``await_promotions`` asks the tier for results as it submits and once more, sleeps (no tier
    reports anything), asks once more at its bound and answers it did not land; released, the promotion lands and
    A's next pass answers HIT. (Polling would have asked the tier many times meanwhile.)"""
    release = threading.Event()

    def hold_reads(op: str, k: OffloadKey) -> None:
        if op == "read":
            release.wait(60)

    manager, disk = _tiering(tmp_path, fault_hook=hold_reads, promotion_wait_s=0.3)
    try:
        (k0, k1), a = _disk_hits(manager)
        polls = disk.result_polls
        assert manager.await_promotions(a) is False
        # once at the submission, once before the sleep, once at the bound
        assert disk.result_polls - polls == 3
        release.set()
        manager.step_end()
        manager.drain()
        assert [manager.lookup(k, a) for k in (k0, k1)] == [HIT, HIT]
        assert manager.stats()["awaited_promotions_landed"] == 0
        manager.request_finished(a)
        manager.drain()
        manager.check_invariants()
    finally:
        release.set()
        manager.close()


def test_a_disk_tier_notifies_its_result_signal_once_per_result(tmp_path: Path) -> None:
    """Every job result a tier has to report notifies the signal it was given (from its I/O
    threads, and at once for a job with nothing to do), so a waiter never misses one."""
    disk = DiskTier(host_pool(4), layout(), DiskTierSettings(tmp_path, 1 << 20, rescan_interval=0))
    signal = ResultSignal()
    disk.set_result_signal(signal)
    try:
        disk.submit_store(TierJob(1, [key(0), key(1)], [0, 1]))
        assert signal.wait_past(0, 60)  # the store landed: notified (no timing: 60 s bound)
        disk.drain_jobs()
        disk.submit_load(TierJob(2, [], []))  # nothing to read: reported at once
        assert signal.count == 2
        assert sorted(r.job_id for r in disk.get_finished_jobs()) == [1, 2]
        assert not signal.wait_past(2, 0)
    finally:
        disk.close()


@pytest.mark.parametrize(
    ("bounds", "field"),
    [
        ({"max_in_flight": -1}, "kv_tier_write_max_in_flight"),
        ({"max_in_flight": 1.5}, "kv_tier_write_max_in_flight"),
        ({"min_reuse": 0}, "kv_tier_write_min_reuse"),
        ({"promotion_wait_s": -0.1}, "kv_promotion_wait_s"),
        ({"promotion_wait_s": 61}, "kv_promotion_wait_s"),
    ],
)
def test_bad_bounds_are_config_errors(tmp_path: Path, bounds: dict, field: str) -> None:
    disk = DiskTier(host_pool(4), layout(), DiskTierSettings(tmp_path, 1 << 20, rescan_interval=0))
    try:
        with pytest.raises(ConfigError) as info:
            TieringOffloadingManager(CPUOffloadingManager(4, "lru"), [disk], **bounds)
        assert info.value.field == field
    finally:
        disk.close()

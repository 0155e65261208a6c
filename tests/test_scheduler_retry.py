"""Asynchronous answers in the scheduler-side connector: a lookup answered ``RETRY`` (a block being
promoted from the disk tier) makes ``get_num_new_matched_tokens`` answer ``None`` until the
promotion lands, a second request joins the promotion instead of starting another, and the
retry budget bounds the wait. Real connector, real tiering manager, real disk tier."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from fake_engine import FakeRequest, single_group
from tier_cases import host_pool, layout, wait_jobs

from kvoffload import BlockHasher, CPUOffloadingManager
from kvoffload.errors import ConfigError
from kvoffload.keys import make_offload_key
from kvoffload.managers.tiering import TieringOffloadingManager
from kvoffload.scheduler import (
    OffloadingConnectorScheduler,
    SchedulerOffloadConfig,
    SchedulerOutput,
)
from kvoffload.tiers import TierJob
from kvoffload.tiers.disk.settings import DiskTierSettings
from kvoffload.tiers.disk.tier import DiskTier

BLOCK = 4
HASHER = BlockHasher(BLOCK)
PROMPT = list(range(1, 25))  # 6 blocks; the last token is never loaded: 5 blocks can be


def request(req_id: str) -> FakeRequest:
    return FakeRequest(req_id, PROMPT, 2, None, HASHER, 1, 0)


def setup(
    tmp_path: Path, retry_seconds: float = 60.0, min_retries: int = 4, promotion_wait_s: float = 0
):
    """A connector over host + disk whose disk holds the prompt's 5 blocks. The manager does not
    wait for promotions within a lookup unless ``promotion_wait_s`` says so (these tests are
    about ``RETRY``; a wait that ends by time would make them depend on the disk's speed)."""
    pool = host_pool(16)
    disk = DiskTier(pool, layout(), DiskTierSettings(tmp_path, 1 << 20, rescan_interval=0))
    keys = [make_offload_key(h) for h in request("x").block_hashes[:5]]
    disk.submit_store(TierJob(10_000, keys, list(range(5))))
    assert all(r.success for r in wait_jobs(disk))
    manager = TieringOffloadingManager(
        CPUOffloadingManager(16), [disk], promotion_wait_s=promotion_wait_s
    )
    config = dataclasses.replace(
        single_group(BLOCK), max_lookup_retry_s=retry_seconds, min_lookup_retries=min_retries
    )
    return OffloadingConnectorScheduler(config, manager), manager, disk


def step(connector: OffloadingConnectorScheduler, disk: DiskTier) -> None:
    """One engine step's hooks, with the disk tier's I/O finished in between (deterministic)."""
    connector.build_connector_meta(SchedulerOutput())
    disk.drain_jobs()
    connector.update_connector_output([])


def test_promotion_answers_none_then_the_full_hit(tmp_path: Path) -> None:
    connector, manager, disk = setup(tmp_path)
    try:
        first, second = request("a"), request("b")
        assert connector.get_num_new_matched_tokens(first, 0) == (None, False)
        # The second request wants the same blocks: it joins the promotion in flight.
        assert connector.get_num_new_matched_tokens(second, 0) == (None, False)
        step(connector, disk)
        assert connector.get_num_new_matched_tokens(first, 0) == (5 * BLOCK, True)
        assert connector.get_num_new_matched_tokens(second, 0) == (5 * BLOCK, True)
        stats = connector.stats()
        assert stats["retries"] == 2 and stats["retry_timeouts"] == 0
        assert stats["tier_promoted_blocks"] == 5
        assert stats["tier_disk_loaded_blocks"] == 5  # one promotion, not two
        manager.check_invariants()
    finally:
        manager.close()


def test_a_promotion_waited_for_answers_the_full_hit_at_once(tmp_path: Path) -> None:
    """With the manager allowed to wait (60 s: always long enough, never timing-dependent), the
    first ask submits the promotion, waits for it and answers the full hit: no ``None``, no
    retry, the load planned in the step the hit was found."""
    connector, manager, _ = setup(tmp_path, promotion_wait_s=60.0)
    try:
        assert connector.get_num_new_matched_tokens(request("a"), 0) == (5 * BLOCK, True)
        stats = connector.stats()
        assert stats["retries"] == 0
        assert stats["tier_promoted_blocks"] == 5
        assert stats["tier_awaited_promotions_landed"] == 1
        manager.check_invariants()
    finally:
        manager.close()


def test_the_retry_budget_bounds_the_wait(tmp_path: Path) -> None:
    connector, manager, disk = setup(tmp_path, retry_seconds=0.0, min_retries=3)
    try:
        req = request("a")
        answers = [connector.get_num_new_matched_tokens(req, 0) for _ in range(4)]
        for _ in range(1000):  # the monotonic clock must move past the budget of 0 s
            if answers[-1][0] is not None:
                break
            answers.append(connector.get_num_new_matched_tokens(req, 0))
        assert answers[:4] == [(None, False)] * 4  # the first ask and three retries
        assert answers[-1] == (0, False)  # nothing had landed: it takes what is ready
        assert connector.stats()["retry_timeouts"] == 1
        step(connector, disk)  # the promotion still lands, for whoever comes next
        assert connector.get_num_new_matched_tokens(request("b"), 0) == (5 * BLOCK, True)
    finally:
        manager.close()


def test_only_an_answered_request_may_go_unasked(tmp_path: Path) -> None:
    """The engine leaves a request it has no room for unasked (``skip_lookup``) only once the
    connector answered it: one never asked, or waiting on a promotion (``None``), is asked
    again, so its promotions and retry budget go on as before."""
    connector, manager, disk = setup(tmp_path)
    try:
        req = request("a")
        assert not connector.skip_lookup(req)  # never asked
        assert connector.get_num_new_matched_tokens(req, 0) == (None, False)
        assert not connector.skip_lookup(req)  # its promotion is in flight
        step(connector, disk)
        assert connector.get_num_new_matched_tokens(req, 0) == (5 * BLOCK, True)
        lookups = connector.stats()["lookups"]
        assert connector.skip_lookup(req)
        assert connector.stats()["lookups"] == lookups
        assert not connector.skip_lookup(request("a"))  # another request with that id
        manager.check_invariants()
    finally:
        manager.close()


def test_a_failed_promotion_means_recompute(tmp_path: Path) -> None:
    connector, manager, disk = setup(tmp_path)
    try:
        for path in tmp_path.rglob("*.kvb"):
            path.write_bytes(b"garbage")
        req = request("a")
        assert connector.get_num_new_matched_tokens(req, 0) == (None, False)
        step(connector, disk)
        assert connector.get_num_new_matched_tokens(req, 0) == (0, False)
        stats = connector.stats()
        assert stats["tier_failed_promotion_blocks"] == 5
        assert stats["tier_disk_failed_load_corrupt"] == 5
        manager.check_invariants()
    finally:
        manager.close()


def test_the_retry_budget_s_old_spelling_warns_and_still_sets_it() -> None:
    base = single_group(BLOCK)
    with pytest.warns(DeprecationWarning, match="'max_lookup_retry_s'"):
        config = SchedulerOffloadConfig(  # the old spelling, on purpose: not in the signature
            base.groups, base.hash_block_size, max_lookup_retry_seconds=7.5  # type: ignore[call-arg]
        )
    assert config.max_lookup_retry_s == 7.5
    with pytest.raises(ConfigError, match="given twice"):
        SchedulerOffloadConfig(
            base.groups, base.hash_block_size, max_lookup_retry_seconds=1, max_lookup_retry_s=2  # type: ignore[call-arg]
        )

"""The router's measured costs: each secondary tier's promotions are timed on their own (a
tiering manager over a real disk tier and a real Redis tier, promoting from each), exported per
tier on ``/metrics``, and turned by the router into each tier's seconds per block directly."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from remote_cases import make_layout, make_tier
from tier_cases import host_pool, key

from kvoffload.manager_contract import LookupResult, ReqContext
from kvoffload.managers import CPUOffloadingManager
from kvoffload.managers.tiering import TieringOffloadingManager
from kvoffload.metrics import EngineMetrics
from kvoffload.routing.costs import PRIOR_LOAD_FRACTION, BackendCosts, parse_metrics
from kvoffload.tiers.disk.settings import DiskTierSettings
from kvoffload.tiers.disk.tier import DiskTier

HOST_BLOCKS = 4


def _store(manager: TieringOffloadingManager, keys: list, ctx: ReqContext) -> None:
    out = manager.prepare_store(keys, ctx)
    assert out is not None and out.keys_to_store == keys
    manager.complete_store(keys, ctx)
    manager.drain()


def _promote(manager: TieringOffloadingManager, keys: list, tier: str) -> None:
    """A request allowed to load from ``tier`` only promotes ``keys`` from it."""
    ctx = ReqContext(f"from-{tier}", {"kv_load_tiers": [tier]})
    deadline = time.monotonic() + 30
    while (answers := [manager.lookup(k, ctx) for k in keys]) != [LookupResult.RETRY] * len(keys):
        assert time.monotonic() < deadline, answers
        manager.step_end()
        manager.drain()
    manager.step_end()
    manager.drain()
    assert [manager.lookup(k, ctx) for k in keys] == [LookupResult.HIT] * len(keys)
    manager.request_finished(ctx)


def _scrape(manager: TieringOffloadingManager) -> str:
    def snapshot():
        stats = {f"offload_{k}": v for k, v in manager.stats().items()}
        stats["offload_load_jobs"] = 0
        return stats, manager.tier_stats()

    return generate_latest(EngineMetrics(snapshot, manager.tiers[0].layout.block_bytes).registry
                           ).decode()


def test_promotions_are_timed_per_tier_and_the_router_reads_each(
    tmp_path: Path, redis_server
) -> None:
    layout = make_layout()
    pool = host_pool(HOST_BLOCKS, layout.block_bytes)  # the host's slots, both tiers' source
    host = CPUOffloadingManager(HOST_BLOCKS, "lru")
    disk = DiskTier(pool, layout, DiskTierSettings(tmp_path, 1 << 20, rescan_interval=0))
    remote = make_tier(redis_server.url, pool, layout)
    manager = TieringOffloadingManager(host, [disk, remote])
    costs = BackendCosts(block_size=16)
    try:
        costs.update(parse_metrics(_scrape(manager)))  # the baseline scrape
        writer = ReqContext("writer")
        for i in range(0, 8, 2):  # k0..k7 written through to both tiers; the host keeps k4..k7
            _store(manager, [key(i), key(i + 1)], writer)
        _promote(manager, [key(0), key(1)], "disk")
        _promote(manager, [key(2), key(3), key(4)], "remote")
        by_tier = manager.tier_stats()
        assert {t: by_tier[t]["promotion_blocks"] for t in ("disk", "remote")} == {
            "disk": 2, "remote": 3}
        assert by_tier["disk"]["promotion_jobs"] == by_tier["remote"]["promotion_jobs"] == 1
        stats = manager.stats()
        assert stats["remote_promotion_us"] == by_tier["remote"]["promotion_us"] > 0
        assert stats["promotion_us"] == sum(by_tier[t]["promotion_us"] for t in ("disk", "remote"))

        text = _scrape(manager)
        scraped = parse_metrics(text)
        for tier in ("disk", "remote"):
            assert scraped[f"promotion_s_{tier}"] == pytest.approx(
                by_tier[tier]["promotion_us"] / 1e6)
        costs.update(scraped)
        # Each tier's seconds per block, measured on its own (no host load measured: the prior).
        host_prior = PRIOR_LOAD_FRACTION["host"] * costs.compute_block_s
        for tier, blocks in (("disk", 2), ("remote", 3)):
            per_block = by_tier[tier]["promotion_us"] / 1e6 / blocks
            assert costs.promotion_s[tier] == pytest.approx(per_block)
            assert costs.load_block_s(tier) == pytest.approx(per_block + host_prior)
    finally:
        manager.close()


def test_step_cost_fit_falls_back_to_the_line_through_the_origin() -> None:
    """Noise that tips the fitted base below zero must not charge a decode step's fixed cost to
    each of its few tokens: the fall back is the least-squares line through the origin, which
    the large prefill steps dominate."""
    from kvoffload.serving.loop import StepCostModel

    exact = StepCostModel()
    for tokens in (1, 400, 1, 400):
        exact.observe(tokens, 0.001 + tokens * 5e-5)
    assert exact.fit() == pytest.approx((0.001, 5e-5))
    noisy = StepCostModel()  # preempted decode steps: as slow as the one prefill (slope <= 0)
    for _ in range(50):
        noisy.observe(4, 0.010)
    noisy.observe(400, 0.009)
    base, per_token = noisy.fit()
    assert base == 0.0 and 400 * per_token < 0.02  # the 400-token prefill took 9 ms (was 0.3 s)
    decode_only = StepCostModel()
    for _ in range(10):
        decode_only.observe(4, 0.010)
    base, per_token = decode_only.fit()
    assert base == 0.0 and per_token == pytest.approx(0.0025)  # one token count: y / x


def test_computing_is_priced_at_the_fleets_median_measured_cost() -> None:
    """Before any measurement every backend is priced at the prior; after, at the median of
    what was measured, unmeasured backends included (a fixed prior 10x above its peers would
    keep a backend that has not served yet out of every choice, so never measured; and the
    noise between identical backends' own figures would send every new prefix to one)."""
    from kvoffload.routing.costs import PRIOR_TOKEN_S, share_compute_cost

    fleet = [BackendCosts(block_size=16) for _ in range(4)]
    share_compute_cost(fleet)
    assert all(c.compute_block_s == PRIOR_TOKEN_S * 16 for c in fleet)
    for c, token_s in zip(fleet, (4e-5, 6e-5, 9e-5), strict=False):
        c.update({"token_s": token_s, "step_s": 1e-3})
    share_compute_cost(fleet)
    assert [c.compute_block_s for c in fleet] == [pytest.approx(6e-5 * 16)] * 4
    assert fleet[0].measured()["compute_token_s"] == 4e-5  # each backend's own figure, reported


def test_a_load_cost_weighs_each_interval_by_its_blocks() -> None:
    """A scrape interval in which one block loaded slowly moves the estimate by one block's
    weight, not by an interval's (the old mean of per-interval ratios: 0.7 x 1 ms + 0.3 x 158 ms
    = 48 ms per block, which then kept the router from sending the loads that correct it)."""
    costs = BackendCosts()
    totals = {"promotion_s_remote": 0.0, "promotion_blocks_remote": 0.0,
              "host_load_s": 0.0, "host_load_blocks": 0.0}
    costs.update(dict(totals))
    for seconds, blocks in ((0.1, 100), (0.158, 1)):  # 100 blocks at 1 ms, then 1 at 158 ms
        for tier_s, tier_blocks in (("promotion_s_remote", "promotion_blocks_remote"),
                                    ("host_load_s", "host_load_blocks")):
            totals[tier_s] += seconds
            totals[tier_blocks] += blocks
        costs.update(dict(totals))
        if blocks == 100:
            assert costs.promotion_s["remote"] == pytest.approx(1e-3)
            assert costs.host_load_s == pytest.approx(1e-3)
    promotion, host_load = costs.promotion_s["remote"], costs.host_load_s
    assert promotion is not None and host_load is not None
    assert promotion < 5e-3 and host_load < 5e-3  # (0.07 + 0.158) / 71
    assert promotion > 1e-3  # it does move

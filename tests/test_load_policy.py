"""``load_policy``: a hit is loaded only where loading beats computing (``auto``), always, or never.

Deterministic: the worker's copies are reported at the first collection after they finish
(:func:`~engine_cases.delay_completions` with 0), disk promotions are waited for before the next
step, and the decision's cost estimates are pinned (:meth:`LoadCosts.pin`): which prefix is
loaded follows from the pinned figures, never from a clock. The estimators' arithmetic is checked
on its own (hypothesis).
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from typing import Any

import pytest
from engine_cases import (
    BLOCK_SIZE,
    cycling_rounds,
    delay_completions,
    greedy,
    host_gib,
    one_thread,  # noqa: F401 - autouse fixture
    random_tokens,
    tiny_engine,
)
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffload.engine import Engine
from kvoffload.errors import ConfigError
from kvoffload.metrics.prometheus import EngineMetrics
from kvoffload.scheduler.costs import (
    PRIOR_LOAD_FRACTION,
    PRIOR_TOKEN_S,
    PROBE_AFTER_DECLINES,
    LoadCosts,
    PayingPrefix,
    PerBlock,
    StepCostModel,
)

PREFIX_BLOCKS = 6
#: Loading costs a second a block: computing (1 ms a token) is far cheaper.
SLOW_LOADS = {"token_s": 1e-3, "step_s": 0.0, "host": 1.0, "disk": 1.0}
#: Loading is nearly free and no step wait: every hit pays.
FAST_LOADS = {"token_s": 1e-3, "step_s": 0.0, "host": 1e-7, "disk": 1e-7}
#: Loads are cheap but a step (1 s) is longer than computing the whole hit (24 ms).
LONG_STEP = {"token_s": 1e-3, "step_s": 1.0, "host": 1e-7, "disk": 1e-7}


def _prompt(rng: random.Random) -> list[int]:
    return random_tokens(rng, PREFIX_BLOCKS * BLOCK_SIZE + 2)


def _steps_to_first_token(engine: Engine, prompt: list[int]) -> tuple[int, list[int]]:
    """Steps from adding ``prompt`` (alone) to its first token, and its greedy tokens."""
    req_id = engine.add_request(prompt, greedy(max_tokens=3))
    first = 0
    for step in range(1, 40):
        for out in engine.step():
            if out.request_id == req_id:
                engine.drain()
                return first or step, out.output_token_ids
        if engine.tiering is not None:
            for tier in engine.tiering.tiers:
                tier.drain_jobs()
        live = engine.live_output(req_id)
        if not first and live is not None and live[0]:
            first = step
    raise AssertionError("unfinished after 40 steps")


def _host_engine(policy: str, **kwargs: Any) -> Engine:
    options: dict[str, Any] = {
        "num_device_blocks": 8,  # one prompt at a time; the next prompt evicts all of the last
        "max_num_seqs": 1,
        "kv_offloading_size": host_gib(64),
        "eviction_policy": "lru",
        "load_policy": policy,
    }
    options.update(kwargs)
    return tiny_engine(**options)


def _host_hit(engine: Engine, pinned: dict[str, float] | None) -> tuple[int, dict[str, float]]:
    """Run a prompt, push it out of the device with another, pin the costs, run it again: the
    steps to its first token and the stats it changed."""
    rng = random.Random(5)
    first, other = _prompt(rng), random_tokens(rng, 29)  # 8 blocks with its output: evicts all
    delay_completions(engine, lambda _job: 0)
    _steps_to_first_token(engine, first)
    _steps_to_first_token(engine, other)
    engine.connector.costs.pin(pinned)  # type: ignore[union-attr]
    before = engine.stats()
    steps, _ = _steps_to_first_token(engine, first)
    after = engine.stats()
    return steps, {k: after[k] - before.get(k, 0) for k in after if k.startswith("offload_")}


def test_a_hit_that_costs_more_to_load_than_to_compute_is_recomputed() -> None:
    with _host_engine("auto") as engine:
        steps, delta = _host_hit(engine, SLOW_LOADS)
    assert delta["offload_hit_tokens"] == 0
    assert delta["offload_recomputed_by_choice_tokens_host"] == PREFIX_BLOCKS * BLOCK_SIZE
    assert steps == 1  # computed in the step that admitted it


def test_a_hit_that_costs_less_to_load_is_loaded() -> None:
    with _host_engine("auto") as engine:
        steps, delta = _host_hit(engine, FAST_LOADS)
    assert delta["offload_hit_tokens_host"] == PREFIX_BLOCKS * BLOCK_SIZE
    assert delta.get("offload_recomputed_by_choice_tokens_host", 0) == 0
    assert steps == 2  # loaded in the admitting step, computed in the next


def test_a_hit_computed_faster_than_a_step_is_computed_in_the_same_step() -> None:
    with _host_engine("auto") as engine:
        steps, delta = _host_hit(engine, LONG_STEP)
    assert delta["offload_hit_tokens"] == 0
    assert delta["offload_recomputed_by_choice_tokens_host"] == PREFIX_BLOCKS * BLOCK_SIZE
    assert steps == 1


def test_always_loads_whatever_the_costs() -> None:
    with _host_engine("always") as engine:
        steps, delta = _host_hit(engine, SLOW_LOADS)
    assert delta["offload_hit_tokens_host"] == PREFIX_BLOCKS * BLOCK_SIZE
    assert steps == 2


def test_never_loads_but_still_stores() -> None:
    with _host_engine("never") as engine:
        steps, delta = _host_hit(engine, FAST_LOADS)
        assert engine.stats()["offload_stored_blocks"] > 0
    assert delta["offload_hit_tokens"] == 0
    assert delta.get("offload_recomputed_by_choice_tokens_host", 0) == 0  # not asked, not counted
    assert steps == 1


def _disk_engine(policy: str, tmp_path: Path) -> Engine:
    return _host_engine(
        policy,
        kv_offloading_size=host_gib(12),  # under two prompts' blocks
        kv_disk_path=str(tmp_path),
        kv_disk_size=0.01,
        kv_lookup_retry_s=600.0,
        kv_promotion_wait_s=60.0,  # a disk hit's promotion is awaited in its step, however slow
    )


def _disk_hit(engine: Engine, pinned: dict[str, float] | None) -> tuple[int, dict[str, float]]:
    """A prompt, then three others that push it out of the device and the host (not the disk),
    then the prompt again: steps to its first token and the stats it changed."""
    rng = random.Random(5)
    first, others = _prompt(rng), [_prompt(rng) for _ in range(3)]
    delay_completions(engine, lambda _job: 0)
    for prompt in (first, *others):
        _steps_to_first_token(engine, prompt)
    engine.connector.costs.pin(pinned)  # type: ignore[union-attr]
    before = engine.stats()
    steps, _ = _steps_to_first_token(engine, first)
    after = engine.stats()
    return steps, {k: after[k] - before.get(k, 0) for k in after if k.startswith("offload_")}


def test_a_disk_hit_slower_than_computing_is_recomputed_without_waiting(tmp_path: Path) -> None:
    with _disk_engine("auto", tmp_path) as engine:
        steps, delta = _disk_hit(engine, SLOW_LOADS)
    assert delta["offload_hit_tokens"] == 0
    assert delta["offload_retries"] == 0  # no step spent waiting for the promotion
    assert delta["offload_recomputed_by_choice_tokens_disk"] == PREFIX_BLOCKS * BLOCK_SIZE
    assert steps == 1


def test_a_disk_hit_that_pays_is_promoted_and_loaded(tmp_path: Path) -> None:
    with _disk_engine("auto", tmp_path) as engine:
        steps, delta = _disk_hit(engine, FAST_LOADS)
    assert delta["offload_hit_tokens"] == PREFIX_BLOCKS * BLOCK_SIZE
    assert delta["offload_retries"] == 0  # the promotion was awaited in the lookup's step
    assert steps == 2  # as test_engine_hit_steps: promoted and loaded, then computed


@pytest.mark.parametrize("tier", ["host", "host+disk"])
@pytest.mark.parametrize(
    "policy,pinned",
    [
        ("auto", None),  # measured costs, whatever they are on this machine
        ("auto", SLOW_LOADS),
        ("auto", FAST_LOADS),
        ("always", None),
        ("never", None),
    ],
    ids=["auto-measured", "auto-slow-loads", "auto-fast-loads", "always", "never"],
)
def test_outputs_are_the_same_in_every_mode_and_tier(
    tier: str, policy: str, pinned: dict[str, float] | None, tmp_path: Path
) -> None:
    rounds = cycling_rounds(num_prefixes=4, prefix_blocks=6, num_rounds=3, seed=3)
    with tiny_engine(num_device_blocks=512) as reference:
        want = [reference.generate(r, greedy(max_tokens=4)) for r in rounds]
    disk = {"kv_disk_path": str(tmp_path), "kv_disk_size": 0.01} if tier == "host+disk" else {}
    with tiny_engine(
        num_device_blocks=16,  # under two prefixes: each round's prefixes come back from a tier
        kv_offloading_size=host_gib(20) if disk else host_gib(200),
        load_policy=policy,
        **disk,
    ) as engine:
        delay_completions(engine, lambda job: job % 3)
        engine.connector.costs.pin(pinned)  # type: ignore[union-attr]
        got = [engine.generate(r, greedy(max_tokens=4)) for r in rounds]
        stats = engine.stats()
    assert [[o.output_token_ids for o in r] for r in got] == [
        [o.output_token_ids for o in r] for r in want
    ]
    if policy == "never" or pinned is SLOW_LOADS:
        assert stats["offload_hit_tokens"] == 0
    if pinned is FAST_LOADS or policy == "always":
        assert stats["offload_hit_tokens"] > 0


def test_cost_estimates_are_stats_and_metrics(tmp_path: Path) -> None:
    with _disk_engine("auto", tmp_path) as engine:
        _disk_hit(engine, FAST_LOADS)
        engine.connector.costs.pin(None)  # type: ignore[union-attr]
        for _ in range(20):  # the promotions' times are read every 16 steps
            engine.step()
        measured = engine.connector.costs.measured()  # type: ignore[union-attr]
        stats = engine.stats()
        text = _scrape(engine)
    assert measured == {"compute": True, "host": True, "disk": True}
    for key in ("offload_cost_token_s", "offload_cost_load_host_s", "offload_cost_load_disk_s"):
        assert stats[key] > 0
    # The step's fixed cost is the fit's intercept over real step timings: clamped at 0, and
    # 0 when this machine's noise fits one (a figure of the clock, not of the code).
    assert stats["offload_cost_step_s"] >= 0
    assert stats["offload_cost_load_disk_s"] > stats["offload_cost_load_host_s"]
    assert "kvoffload_offload_cost_token_seconds " in text
    assert 'kvoffload_offload_cost_load_block_seconds{tier="disk"}' in text
    assert 'kvoffload_offload_recomputed_by_choice_tokens_total{tier="host"}' in text


def _scrape(engine: Engine) -> str:
    from prometheus_client import generate_latest

    metrics: EngineMetrics = engine.metrics
    return generate_latest(metrics.registry).decode()


def test_an_unknown_load_policy_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="load_policy"):
        Engine("tiny", kv_offloading_size=host_gib(8), load_policy="sometimes")


# ---------------------------------------------------------------------- the estimators


@settings(max_examples=200, deadline=None)
@given(
    alpha=st.floats(0.01, 1.0),
    intervals=st.lists(
        st.tuples(st.floats(0.0, 10.0), st.integers(1, 1000)), min_size=1, max_size=30
    ),
)
def test_per_block_is_the_ratio_of_decayed_sums(
    alpha: float, intervals: list[tuple[float, int]]
) -> None:
    per_block = PerBlock(alpha)
    for seconds, blocks in intervals:
        estimate = per_block.add(seconds, blocks)
    n = len(intervals)
    weights = [(1 - alpha) ** (n - 1 - i) for i in range(n)]
    seconds_sum = sum(w * s for w, (s, _) in zip(weights, intervals, strict=True))
    blocks_sum = sum(w * b for w, (_, b) in zip(weights, intervals, strict=True))
    assert math.isclose(estimate, seconds_sum / blocks_sum, rel_tol=1e-9, abs_tol=1e-12)
    assert per_block.estimate == estimate


@settings(max_examples=100, deadline=None)
@given(
    alpha=st.floats(0.01, 1.0),
    cost=st.floats(1e-6, 1.0),
    blocks=st.lists(st.integers(1, 500), min_size=1, max_size=20),
)
def test_per_block_of_a_steady_cost_is_that_cost(
    alpha: float, cost: float, blocks: list[int]
) -> None:
    per_block = PerBlock(alpha)
    for b in blocks:
        per_block.add(cost * b, b)
    assert math.isclose(per_block.estimate or 0.0, cost, rel_tol=1e-9)


def test_load_costs_priors_then_measurements() -> None:
    costs = LoadCosts(["disk"])
    block = 16
    assert costs.measured() == {"compute": False, "host": False, "disk": False}
    assert costs.token_s == PRIOR_TOKEN_S
    assert costs.step_s == 0.0
    assert math.isclose(
        costs.host_block_s(block), PRIOR_LOAD_FRACTION["host"] * PRIOR_TOKEN_S * block
    )
    for tokens in (10, 100, 1000):
        costs.observe_step(tokens, 0.01 + tokens * 1e-4)
    assert math.isclose(costs.token_s, 1e-4, rel_tol=1e-6)
    assert math.isclose(costs.step_s, 0.01, rel_tol=1e-6)
    costs.observe_load(0.002, 4)
    costs.fold_promotions({"host": {}, "disk": {"promotion_us": 10_000, "promotion_blocks": 2}})
    costs.fold_promotions({"disk": {"promotion_us": 40_000, "promotion_blocks": 8}})  # +30 ms, +6
    costs.observe_promotion("elsewhere", 1.0, 1)  # a tier it does not know: ignored
    assert costs.measured() == {"compute": True, "host": True, "disk": True}
    assert math.isclose(costs.host_block_s(block), 5e-4)
    disk = PerBlock(costs.alpha)
    disk.add(0.01, 2)
    assert math.isclose(costs.promoted_block_s(block), disk.add(0.03, 6) + 5e-4)
    costs.pin({"token_s": 1.0})
    assert costs.token_s == 1.0
    assert math.isclose(costs.host_block_s(block), 5e-4)  # not pinned: still measured


def _decide(costs: LoadCosts, hit_blocks: int, block: int = 16) -> int:
    """The blocks of a ``hit_blocks`` host hit that a fresh decision loads."""
    pay = costs.decision(block)
    for _ in range(hit_blocks):
        pay.host()
    return pay.best


def test_a_stale_slow_load_estimate_is_probed_and_re_measured() -> None:
    """A first copy that stalled (1 s a block, computing a block takes 1.6 ms) makes every hit
    recomputed, and a recomputed hit measures no load: without probes the estimate would never
    change. After ``PROBE_AFTER_DECLINES`` declined hits the next one is priced at the prior and
    loaded; once its copy is measured fast, hits are loaded from then on."""
    costs = LoadCosts()
    for tokens in (10, 100, 1000):
        costs.observe_step(tokens, tokens * 1e-4)
    costs.observe_load(1.0, 1)
    assert [_decide(costs, 8) for _ in range(PROBE_AFTER_DECLINES)] == [0] * PROBE_AFTER_DECLINES
    assert _decide(costs, 8) == 8  # the probe
    costs.observe_load(8e-5, 8)  # its copy: 10 us a block
    assert [_decide(costs, 8) for _ in range(3 * PROBE_AFTER_DECLINES)] == [8] * (
        3 * PROBE_AFTER_DECLINES
    )


def test_a_slow_tier_is_probed_once_per_declines() -> None:
    """Loading really costs more than computing: one hit in ``PROBE_AFTER_DECLINES + 1`` is
    loaded (the probe re-measures it slow), the rest are recomputed; hits that were loaded or
    that had no host blocks do not count towards a probe, and pinned estimates are never probed."""
    costs = LoadCosts()
    for tokens in (10, 100, 1000):
        costs.observe_step(tokens, tokens * 1e-4)
    costs.observe_load(1.0, 1)
    loaded = []
    for _ in range(3):
        decisions = [_decide(costs, 4) for _ in range(PROBE_AFTER_DECLINES + 1)]
        loaded.append(decisions.count(4))
        assert decisions[-1] == 4
        costs.observe_load(1.0, 4)  # the probe measured slow again
    assert loaded == [1, 1, 1]
    for _ in range(2 * PROBE_AFTER_DECLINES):
        assert _decide(costs, 0) == 0  # no hit: nothing declined, no probe due
    assert _decide(costs, 4) == 0
    costs.pin({"token_s": 1e-4, "host": 1.0})
    assert [_decide(costs, 4) for _ in range(3 * PROBE_AFTER_DECLINES)] == [0] * (
        3 * PROBE_AFTER_DECLINES
    )


def test_step_cost_model_fits_a_line() -> None:
    model = StepCostModel()
    for tokens in (1, 50, 200, 7, 900):
        model.observe(tokens, 0.003 + tokens * 2e-5)
    base, per_token = model.fit()
    assert math.isclose(base, 0.003, rel_tol=1e-6)
    assert math.isclose(per_token, 2e-5, rel_tol=1e-6)


def _brute_force_best(compute: float, step: float, costs: list[float]) -> int:
    best, best_gain = 0, 0.0
    for k in range(1, len(costs) + 1):
        gain = k * compute - max(sum(costs[:k]), step)
        if gain > best_gain + 1e-12:
            best, best_gain = k, gain
    return best


@settings(max_examples=300, deadline=None)
@given(
    compute=st.floats(1e-4, 1.0),
    step=st.floats(0.0, 5.0),
    host=st.floats(0.0, 2.0),
    promoted=st.floats(0.0, 2.0),
    kinds=st.lists(st.booleans(), max_size=40),
    lazy=st.booleans(),
)
def test_paying_prefix_is_the_best_leading_prefix(
    compute: float, step: float, host: float, promoted: float, kinds: list[bool], lazy: bool
) -> None:
    pay = PayingPrefix(compute, step, host, (lambda: promoted) if lazy else promoted)
    for is_promoted in kinds:
        if is_promoted:
            pay.promoted_block()
        else:
            pay.host()
    costs = [promoted if p else host for p in kinds]
    want = _brute_force_best(compute, step, costs)
    got_gain = pay.best * compute - max(sum(costs[: pay.best]), step) if pay.best else 0.0
    want_gain = want * compute - max(sum(costs[:want]), step) if want else 0.0
    assert math.isclose(got_gain, want_gain, rel_tol=1e-9, abs_tol=1e-9)
    assert pay.best_promoted == sum(kinds[: pay.best])


def test_one_more_step_is_charged_only_while_nothing_waits() -> None:
    costs = LoadCosts()
    for tokens in (10, 100, 1000):
        costs.observe_step(tokens, 0.05 + tokens * 1e-4)
    assert math.isclose(costs.step_s, 0.05, rel_tol=1e-6)
    assert costs.decision(4).compute_block_s < costs.step_s  # a one-block hit: computed
    costs.step_charged = False  # requests wait: they take the step a loading request leaves
    assert costs.step_s == 0.0
    pay = costs.decision(4)
    pay.host()
    assert pay.best == 1
    rng = random.Random(9)
    with _host_engine("auto") as engine:  # max_num_seqs 1: the second request waits
        engine.add_request(_prompt(rng), greedy(max_tokens=3))
        engine.add_request(_prompt(rng), greedy(max_tokens=3))
        engine.step()
        assert engine.connector.costs.step_charged is False  # type: ignore[union-attr]
        while engine.has_unfinished():
            engine.step()
        assert engine.connector.costs.step_charged is True  # type: ignore[union-attr]

"""Cache-aware admission (``scheduling_policy="cache_aware"``): outputs identical to a run without
offloading (host tier, host + disk, random mixes with aborts and late transfers), waiting requests
whose prefix the engine holds admitted before older cold ones, and no request passed over by more
than ``scheduling_max_bypass`` later arrivals."""

from __future__ import annotations

import random
from collections.abc import Sequence
from pathlib import Path

import pytest
from engine_cases import (
    BLOCK_SIZE,
    assert_outputs_or_aborted_prefix,
    assert_quiescent,
    assert_same_outputs,
    cycling_rounds,
    delay_completions,
    drive,
    greedy,
    host_gib,
    one_thread,  # noqa: F401 - autouse fixture
    random_mix,
    random_tokens,
    reference_outputs,
    tiny_engine,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload.engine import Engine, SamplingParams
from kvoffload.engine.config import EngineConfig
from kvoffload.engine.scheduler import StepPlan

MAX_STEPS = 3000
ROUNDS = cycling_rounds(num_prefixes=4, prefix_blocks=6, num_rounds=3)
FLAT = [p for r in ROUNDS for p in r]
#: Four 6-block prefixes, two requests at a time in a 24-block device cache; the host holds all.
CYCLING = {"num_device_blocks": 24, "max_num_seqs": 2, "kv_offloading_size": host_gib(64)}


@pytest.fixture(scope="module")
def reference() -> list:
    return reference_outputs(FLAT, greedy())


class AdmissionLog:
    """The order in which requests were first admitted (read from the scheduler after each
    step: admission numbers grow with every admission, so the order within a step is exact)."""

    def __init__(self, engine: Engine) -> None:
        self._engine = engine
        self._first: dict[str, int] = {}

    def after_step(self) -> None:
        for req_id, number in self._engine.scheduler._admitted.items():
            self._first.setdefault(req_id, number)

    def run(self) -> None:
        """Step until every request finished (bounded), logging after each step."""
        for _ in range(MAX_STEPS):
            self._engine.step()
            self.after_step()
            if not self._engine.has_unfinished():
                return
        raise AssertionError(f"requests still unfinished after {MAX_STEPS} steps")

    @property
    def order(self) -> list[str]:
        return sorted(self._first, key=self._first.__getitem__)

    def max_bypass(self, arrival: Sequence[str]) -> int:
        """The most later arrivals any request saw admitted before it."""
        place = {r: i for i, r in enumerate(self.order)}
        return max(
            sum(1 for later in arrival[i + 1 :] if place[later] < place[r])
            for i, r in enumerate(arrival)
        )


@pytest.mark.parametrize("policy", ["fcfs", "cache_aware"])
def test_all_at_once_matches_reference_with_late_transfers(reference: list, policy: str) -> None:
    """Every round at once, transfers reported 2 steps late (deterministic): same outputs, and
    cache-aware order runs the requests of one prefix together, so they share its device blocks
    instead of loading it again from the host (FCFS: 40 blocks loaded in 47 steps; cache-aware:
    none, 39 steps)."""
    stats = {}
    for run_policy in ("fcfs", policy):
        with tiny_engine(**CYCLING, scheduling_policy=run_policy) as engine:
            delay_completions(engine, lambda _job: 2)
            assert_same_outputs(engine.generate(FLAT, greedy()), reference)
            engine.drain()
            stats[run_policy] = engine.stats()
            assert_quiescent(engine)
    if policy == "cache_aware":
        for key in ("offload_loaded_blocks", "steps"):
            assert stats["cache_aware"][key] < stats["fcfs"][key], key


def test_host_and_disk_match_reference(tmp_path: Path) -> None:
    """Eight prefixes through a 16-block host tier and a disk tier, all at once: promotions,
    loads and in-flight sharing under cache-aware order change no output."""
    rounds = cycling_rounds(num_prefixes=8, prefix_blocks=6, num_rounds=3)
    prompts = [p for r in rounds for p in r]
    params = greedy(max_tokens=4)
    want = reference_outputs(prompts, params)
    with tiny_engine(
        num_device_blocks=40,
        max_num_seqs=4,
        kv_offloading_size=host_gib(16),
        kv_disk_path=str(tmp_path),
        kv_disk_size=0.01,
        kv_lookup_retry_s=600.0,
        scheduling_policy="cache_aware",
    ) as engine:
        delay_completions(engine, lambda job: job % 3)
        assert_same_outputs(engine.generate(prompts, params), want)
        engine.drain()
        assert engine.stats()["offload_tier_disk_stored_blocks"] > 0
        assert_quiescent(engine)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**16),
    num_device_blocks=st.integers(12, 24),
    max_num_seqs=st.integers(1, 6),
    max_bypass=st.integers(0, 4),
    offload=st.booleans(),
    aborts=st.lists(st.tuples(st.integers(0, 11), st.integers(0, 60)), max_size=3),
    delays=st.lists(st.integers(0, 4), min_size=1, max_size=5),
)
def test_random_mix_matches_reference_and_bounds_bypass(
    seed: int,
    num_device_blocks: int,
    max_num_seqs: int,
    max_bypass: int,
    offload: bool,
    aborts: list[tuple[int, int]],
    delays: list[int],
) -> None:
    """Random prompts over shared prefixes, added two a step, some aborted, transfers late:
    finished requests match the reference, aborted ones a prefix of it, and no request saw
    more than ``max_bypass`` later arrivals admitted before it (aborts left out of the count)."""
    prompts, params = random_mix(seed)
    want = reference_outputs(prompts, params)
    with tiny_engine(
        num_device_blocks=num_device_blocks,
        max_num_seqs=max_num_seqs,
        kv_offloading_size=host_gib(24) if offload else 0.0,
        scheduling_policy="cache_aware",
        scheduling_max_bypass=max_bypass,
    ) as engine:
        if offload:
            delay_completions(engine, lambda job_id: delays[job_id % len(delays)])
        log = AdmissionLog(engine)
        ids, done = drive(
            engine, prompts, params, {step: i for i, step in aborts}, after_step=log.after_step
        )
        assert_outputs_or_aborted_prefix(ids, done, want)
        admitted = set(log.order)
        arrival = [r for r in ids if r in admitted]
        assert log.max_bypass(arrival) <= max_bypass
        assert_quiescent(engine)


def _hot_and_cold(num_hot: int) -> tuple[list[int], list[list[int]], list[int]]:
    """A 6-block prefix and ``num_hot`` prompts on it, and one cold prompt of 6 blocks."""
    rng = random.Random(7)
    prefix = random_tokens(rng, 6 * BLOCK_SIZE)
    hot = [prefix + random_tokens(rng, 3) for _ in range(num_hot)]
    return prefix, hot, random_tokens(rng, 6 * BLOCK_SIZE + 3)


def _admit_cold_among_hot(
    policy: str | None, max_bypass: int | None, num_hot: int = 6
) -> tuple[list[str], str]:
    """The engine holds the hot prefix (a first request computed it); a cold request arrives,
    then ``num_hot`` hot ones; one request runs at a time. Returns the admission order of the
    waiting ones and the cold request's id. ``None``: the engine's default."""
    prefix, hot, cold = _hot_and_cold(num_hot)
    order = {"scheduling_policy": policy, "scheduling_max_bypass": max_bypass}
    with tiny_engine(
        num_device_blocks=24, max_num_seqs=1, **{k: v for k, v in order.items() if v is not None}
    ) as engine:
        engine.generate([[*prefix, 1, 2, 3]], greedy(max_tokens=2))
        log = AdmissionLog(engine)
        log.after_step()
        seen = set(log.order)
        cold_id = engine.add_request(cold, greedy(max_tokens=2))
        for prompt in hot:
            engine.add_request(prompt, greedy(max_tokens=2))
        log.run()
        assert_quiescent(engine)
        return [r for r in log.order if r not in seen], cold_id


def test_requests_on_a_held_prefix_go_first_up_to_the_bypass_bound() -> None:
    """FCFS admits the cold request first. Cache-aware admits hot requests (their prefix is in
    the device cache) before it, exactly ``scheduling_max_bypass`` of them, then the cold one;
    with a bound above the queue's length, every hot one first."""
    order, cold = _admit_cold_among_hot("fcfs", 32)
    assert order[0] == cold
    for bound in (0, 2, 4):
        order, cold = _admit_cold_among_hot("cache_aware", bound)
        assert order.index(cold) == bound, (bound, order)
    order, cold = _admit_cold_among_hot("cache_aware", 32)
    assert order[-1] == cold


def test_hot_requests_share_the_prefix_in_the_device() -> None:
    """Cache-aware, two at a time in 10 blocks: the hot requests run on the held prefix (all 24
    of its tokens device hits for each) and compute 44 tokens; FCFS lets the cold request evict
    part of the prefix first (56 tokens)."""
    prefix, hot, cold = _hot_and_cold(4)
    computed = {}
    for policy in ("fcfs", "cache_aware"):
        with tiny_engine(num_device_blocks=10, max_num_seqs=2, scheduling_policy=policy) as engine:
            engine.generate([[*prefix, 1, 2, 3]], greedy(max_tokens=2))
            before = engine.stats()["forward_tokens"]
            outputs = engine.generate([cold, *hot], greedy(max_tokens=2))
            computed[policy] = engine.stats()["forward_tokens"] - before
            if policy == "cache_aware":
                assert all(o.cached_tokens_engine >= len(prefix) for o in outputs[1:])
    assert computed["cache_aware"] < computed["fcfs"]


def test_no_reuse_admits_in_arrival_order() -> None:
    """Prompts that share nothing: cache-aware admits them in arrival order, as FCFS does."""
    rng = random.Random(3)
    prompts = [random_tokens(rng, 10 + 3 * i) for i in range(8)]
    orders = {}
    for policy in ("fcfs", "cache_aware"):
        with tiny_engine(num_device_blocks=12, max_num_seqs=2, scheduling_policy=policy) as engine:
            log = AdmissionLog(engine)
            ids = [
                engine.add_request(p, SamplingParams(max_tokens=3, ignore_eos=True))
                for p in prompts
            ]
            log.run()
            assert log.order == ids
            orders[policy] = log.order
    assert orders["fcfs"] == orders["cache_aware"]


def test_a_later_turn_waits_for_the_blocks_its_earlier_turn_computes() -> None:
    """Multi-turn sessions all at once, a device cache that holds everything: a later turn
    whose next block its earlier turn is computing waits for it instead of computing it again,
    so cache-aware order computes fewer tokens than FCFS (760 against 856; a rule that waited
    only when such blocks were half of what the turn lacked computed 1,076)."""
    from kvoffload.benchmark.datasets import multi_turn

    requests = multi_turn(24, 4, 32, 24, 4, 256, 256, 0)
    prompts = [r.prompt for r in requests]
    params = [SamplingParams(max_tokens=r.output_len, ignore_eos=True) for r in requests]
    computed = {}
    for policy in ("fcfs", "cache_aware"):
        with tiny_engine(num_device_blocks=512, max_num_seqs=4, scheduling_policy=policy) as engine:
            engine.generate(prompts, params)
            computed[policy] = engine.stats()["forward_tokens"]
    assert computed["cache_aware"] < computed["fcfs"]


def test_cache_aware_is_the_default_order() -> None:
    """An engine built without ``scheduling_policy`` orders by held prefix: the hot requests go
    before the older cold one (as many as the bound allows: all 6 here)."""
    assert EngineConfig(model="tiny").scheduling_policy == "cache_aware"
    order, cold = _admit_cold_among_hot(None, None)
    assert order[-1] == cold


def _no_reuse_schedule(policy: str) -> list[tuple[tuple[str, int], ...]]:
    """Each step's scheduled (request, tokens) on prompts sharing nothing, with a host tier whose
    transfers report 1 or 2 steps late (deterministic); preemptions included."""
    rng = random.Random(11)
    prompts = [random_tokens(rng, 20 + 7 * (i % 5)) for i in range(12)]
    with tiny_engine(
        num_device_blocks=20,
        max_num_seqs=4,
        kv_offloading_size=host_gib(32),
        scheduling_policy=policy,
    ) as engine:
        delay_completions(engine, lambda job_id: 1 + job_id % 2)
        scheduler, steps = engine.scheduler, []
        schedule = scheduler.schedule

        def logged() -> StepPlan:
            plan = schedule()
            steps.append(tuple((r.request_id, n) for r, n in plan.scheduled))
            return plan

        scheduler.schedule = logged  # type: ignore[method-assign]
        engine.generate(prompts, greedy(max_tokens=5))
        assert engine.stats()["preemptions"] > 0
        engine.drain()
        assert_quiescent(engine)
    return steps


def test_no_reuse_runs_the_fcfs_schedule_step_for_step() -> None:
    """With nothing resident cache-aware order is FCFS: the same requests and token counts in
    every step (preemptions and late stores included), so it costs no steps and no tokens."""
    assert _no_reuse_schedule("cache_aware") == _no_reuse_schedule("fcfs")


def test_host_held_blocks_weigh_what_their_load_would_save() -> None:
    """The cache-aware order counts a host-held block as 1 (``always``), 0 (``never``), or under
    ``auto`` as computing it less loading it, over computing it (pinned estimates): 0.75 when a
    load costs a quarter of computing, 0 when it costs more than computing."""
    for policy, worth in (("always", 1.0), ("never", 0.0)):
        with tiny_engine(kv_offloading_size=host_gib(16), load_policy=policy) as engine:
            assert engine.scheduler._held_block_worth() == worth
    compute_block_s = 1e-3 * BLOCK_SIZE
    with tiny_engine(kv_offloading_size=host_gib(16), load_policy="auto") as engine:
        costs = engine.connector.costs  # type: ignore[union-attr]
        costs.pin({"token_s": 1e-3, "host": compute_block_s / 4})
        assert engine.scheduler._held_block_worth() == pytest.approx(0.75)
        costs.pin({"token_s": 1e-3, "host": compute_block_s * 2})
        assert engine.scheduler._held_block_worth() == 0.0

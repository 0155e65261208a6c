"""Scheduler side under random workloads (hypothesis).

Random request arrivals over shared prefixes, lengths, token budgets, small engine pools
(preemption), small tiers (rejected stores, eviction), store shedding (a bound of 0-3 blocks in
flight, or none), per-request store policies and caps,
aborts, engine prefix-cache losses (full and partial: hits that start mid-block), tier resets,
transfer delays per job and worker, and transfer failures. The engine checks the KV oracle, the
tier's contents, the manager's invariants and block accounting after every step; once
everything has finished and drained: no pinned or pending block in the tier, no job, no live
request state, no engine block held.

Sliding-window groups are left out: their known problems are pinned by the strict-xfail tests
in ``test_scheduler_window.py`` and would fail most examples here.
"""

from __future__ import annotations

import dataclasses
import random
from dataclasses import dataclass
from typing import Any

from fake_engine import FakeEngine, groups_config, make_tokens, single_group
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from kvoffload import available_eviction_policies
from kvoffload.scheduler import STORE_POLICIES, GroupOffloadConfig, SchedulerOffloadConfig
from kvoffload.transfer import TransferJob

ARRIVAL_STEPS = 16
EVENT_KINDS = ("abort", "abort", "drop_cache", "evict_cache", "reset")  # (a reset empties the tier)


Prompt = tuple[int, list[int], int, dict[str, Any] | None]  # (arrival, tokens, max_tokens, params)


@dataclass
class Scenario:
    config: SchedulerOffloadConfig
    eviction_policy: str
    engine_blocks: int
    host_blocks: int
    token_budget: int
    prompts: list[Prompt]
    events: list[tuple[int, str, int]]  # (step, kind, argument)
    transfer_seed: int
    max_delay: int
    fail_rate: float


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    workers = draw(st.integers(1, 2))
    policy = draw(st.sampled_from(sorted(STORE_POLICIES)))
    if draw(st.booleans()):
        config = single_group(4, draw(st.integers(1, 3)), workers, policy)
    else:
        config = groups_config(
            GroupOffloadConfig(4, draw(st.integers(1, 2))),
            GroupOffloadConfig(8, 1),
            hash_block_size=4,
            num_workers=workers,
            store_policy=policy,
        )
    # Store shedding: no bound, or a small one the delayed transfers keep reaching.
    shed_bound = draw(st.sampled_from([None, None, 0, 1, 3]))
    config = dataclasses.replace(config, max_stores_in_flight=shed_bound)
    lengths = draw(st.lists(st.integers(8, 32), min_size=1, max_size=2))
    prefixes = [make_tokens(n, 100 + i) for i, n in enumerate(lengths)]
    params = st.one_of(
        st.none(),
        st.none(),
        st.builds(lambda p: {"store_policy": p}, st.sampled_from(sorted(STORE_POLICIES))),
        st.builds(lambda n: {"max_load_tokens": n}, st.integers(0, 24)),
        st.builds(lambda n: {"max_offload_tokens": n}, st.integers(0, 24)),
    )
    events = draw(
        st.lists(
            st.tuples(
                st.integers(0, ARRIVAL_STEPS + 2), st.sampled_from(EVENT_KINDS), st.integers(0, 7)
            ),
            max_size=4,
        )
    )
    # Loads need a prefix that is in the tier but no longer in the engine cache: requests come in
    # two waves, and the engine cache is usually lost (all of it, or many free blocks) between.
    loss_step = draw(st.integers(6, 10))
    loss = draw(st.sampled_from([None, "drop_cache", "evict_cache", "evict_cache"]))
    if loss is not None:
        events.append((loss_step, loss, draw(st.integers(2, 7))))
    prompts = []
    for i in range(draw(st.integers(2, 8))):
        prefix = draw(st.sampled_from(prefixes))
        tokens = prefix + make_tokens(draw(st.integers(1, 16)), 1000 + i)
        late = draw(st.booleans())
        arrival = draw(st.integers(loss_step, ARRIVAL_STEPS - 1) if late else st.integers(0, 3))
        prompts.append((arrival, tokens, draw(st.integers(1, 6)), draw(params)))
    return Scenario(
        config=config,
        eviction_policy=draw(st.sampled_from(available_eviction_policies())),
        engine_blocks=draw(st.integers(14, 40)),
        host_blocks=draw(st.integers(2, 40)),
        token_budget=draw(st.sampled_from([4, 8, 16, 64])),
        prompts=prompts,
        events=events,
        transfer_seed=draw(st.integers(0, 2**16)),
        max_delay=draw(st.sampled_from([0, 1, 3])),
        fail_rate=draw(st.sampled_from([0.0, 0.0, 0.1, 0.3])),
    )


def run_scenario(s: Scenario) -> FakeEngine:
    rng = random.Random(s.transfer_seed)

    def delay(job: TransferJob, worker: int) -> int:
        return rng.randint(0, s.max_delay)

    def fail(job: TransferJob, worker: int) -> bool:
        return rng.random() < s.fail_rate

    engine = FakeEngine(
        s.config,
        num_engine_blocks=s.engine_blocks,
        num_host_blocks=s.host_blocks,
        token_budget=s.token_budget,
        eviction_policy=s.eviction_policy,
        delay=delay,
        fail=fail,
    )
    added = []
    for step in range(ARRIVAL_STEPS + 3):
        for arrival, tokens, max_tokens, params in s.prompts:
            if arrival == step:
                added.append(engine.add_request(tokens, max_tokens, params))
        for at, kind, arg in s.events:
            if at != step:
                continue
            if kind == "abort" and arg < len(added):
                engine.abort(added[arg].request_id)
            elif kind == "drop_cache":
                engine.drop_prefix_cache()
            elif kind == "evict_cache":
                engine.evict_free_blocks(4 * arg)
            elif kind == "reset":
                engine.connector.reset()
        engine.step()
    engine.run(max_steps=1000)
    return engine


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(scenarios())
def test_random_workloads_keep_kv_correct_and_leave_nothing_behind(scenario: Scenario) -> None:
    engine = run_scenario(scenario)
    note(str(engine.connector.stats()))
    engine.check_drained()

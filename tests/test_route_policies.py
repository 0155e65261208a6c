"""Routing policies on hand-made backends: the predicted time to first token of each tier
weighting, each policy's choice (ties in turn, sticky sessions that move only a lost
backend's sessions), and its full ranking, which orders a request's retries."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import pytest

from kvoffload.errors import ConfigError
from kvoffload.routing.costs import BackendCosts
from kvoffload.routing.policies import (
    POLICIES,
    BackendLoad,
    Policy,
    create_policy,
    score_of,
)
from kvoffload.routing.prefix_index import Match
from kvoffload.routing.router import BackendSpec, Router
from kvoffload.serving.prompts import PromptTokenizer


@dataclass
class _Backend:
    url: str
    index_id: int | None
    load: BackendLoad = field(default_factory=BackendLoad)
    costs: BackendCosts = field(default_factory=lambda: _costs())


def _costs(token_s: float = 1e-3, host: float = 2e-3, disk: float = 5e-3,
           remote: float = 9e-3) -> BackendCosts:
    costs = BackendCosts(block_size=16, token_s=token_s, fleet_token_s=token_s, host_load_s=host)
    costs.promotion_s.update(disk=disk - host, remote=remote - host)
    return costs


def choose(policy: Policy, targets: list[_Backend], matches: dict[int, Match],
           session_key: str | None = None) -> int:
    return policy.order(targets, matches, session_key)[0]


def predicted_ttft(load: BackendLoad, costs: BackendCosts, m: Match, weights: str,
                   now: float) -> float:
    return score_of(weights)(load, costs, m, now)


def test_predicted_ttft_of_each_weighting() -> None:
    m = Match(device=2, host=3, disk=1, remote=2, total=10)  # 2 blocks to compute
    load = BackendLoad(busy_until=100.5, prefill_blocks=4, decode_blocks=6)
    costs = _costs()
    compute = 2 * 16e-3
    assert predicted_ttft(load, costs, m, "measured", 100.0) == pytest.approx(
        0.5 + compute + 3 * 2e-3 + 1 * 5e-3 + 2 * 9e-3)
    assert predicted_ttft(load, costs, m, "blind", 100.0) == pytest.approx(0.5 + compute)
    assert predicted_ttft(load, costs, m, "blind", 101.0) == pytest.approx(compute)  # queue done
    credit = 2 * 1.0 + 3 * 0.75 + 1 * 0.25 + 2 * 0.5
    assert predicted_ttft(load, costs, m, "dynamo", 100.0) == pytest.approx(4 + 10 - credit + 6)


def test_the_queue_is_the_prefill_work_still_ahead(monkeypatch) -> None:
    """Prefills queue one after another; time spent on them counts off the queue, one that ends
    early pulls the ones behind it forward, and one overdue keeps its backend busy."""
    import kvoffload.routing.router as router_module

    clock = [0.0]
    monkeypatch.setattr(router_module.time, "monotonic", lambda: clock[0])
    backend = router_module.Backend(router_module.BackendSpec("http://b"), _costs())
    load = backend.load
    first = router_module.Ticket(backend, 0.035, 2)
    clock[0] = 0.005
    second = router_module.Ticket(backend, 0.035, 2)
    assert load.queued_s(0.005) == pytest.approx(0.065)
    assert load.queued_s(0.030) == pytest.approx(0.040)  # 25 ms of it spent since
    assert load.queued_s(0.040) == pytest.approx(0.035)  # and the first 5 ms overdue
    clock[0] = 0.020
    first.first_token()  # 15 ms early
    assert load.queued_s(0.020) == pytest.approx(0.035)
    clock[0] = 0.040
    second.first_token()  # 15 ms early again (it was due at 55 ms)
    assert load.queued_s(0.040) == 0.0
    third = router_module.Ticket(backend, 0.010, 1)  # due at 50 ms
    fourth = router_module.Ticket(backend, 0.010, 1)  # due at 60 ms
    assert load.queued_s(0.045) == pytest.approx(0.015)
    assert load.queued_s(0.080) == pytest.approx(0.030)  # stalled: 30 ms overdue, still busy
    clock[0] = 0.080
    third.first_token()  # late: nothing to pull forward; the fourth is overdue now
    assert load.queued_s(0.080) == pytest.approx(0.020)
    fourth.first_token()
    assert load.queued_s(0.080) == 0.0 and load.prefill_blocks == 0 and not load.pending


def test_kv_aware_weighs_where_blocks_are_and_ties_go_in_turn() -> None:
    a, b, c = _Backend("a", 0), _Backend("b", 1), _Backend("c", 2)
    # b holds the prompt on its host, c in the remote tier: b loads faster.
    matches = {0: Match(total=8), 1: Match(host=8, total=8), 2: Match(remote=8, total=8)}
    policy = create_policy()
    assert {choose(policy, [a, b, c], matches) for _ in range(3)} == {1}
    # Tier-blind scoring cannot tell b from c: the tie goes round between them.
    blind = create_policy(tier_weights="blind")
    assert {choose(blind, [a, b, c], matches) for _ in range(6)} == {1, 2}
    # A queue outweighs the cache: b's predicted prefill queue is long.
    b.load.busy_until = time.monotonic() + 10.0
    assert choose(policy, [a, b, c], matches) == 2


def test_round_robin_least_load_and_sessions() -> None:
    backends = [_Backend(u, i) for i, u in enumerate("abcd")]
    rr = create_policy("round_robin")
    assert [choose(rr, backends, {}) for _ in range(8)] == [0, 1, 2, 3] * 2
    backends[0].load.in_flight = backends[1].load.in_flight = 2
    least = create_policy("least_load")
    assert {choose(least, backends, {}) for _ in range(4)} == {2, 3}
    sticky = create_policy("session")
    users = [f"user{i}" for i in range(40)]
    placed = {u: backends[choose(sticky, backends, {}, u)].url for u in users}
    assert placed == {u: backends[choose(sticky, backends, {}, u)].url for u in users}
    assert len(set(placed.values())) == 4
    survivors = [b for b in backends if b.url != "c"]
    moved = {u for u in users if survivors[choose(sticky, survivors, {}, u)].url != placed[u]}
    assert moved == {u for u in users if placed[u] == "c"}


def test_policies_are_chosen_once_by_name() -> None:
    """Each flag value names a policy object; a wrong name or weighting is a ConfigError."""
    assert [create_policy(name).name for name in POLICIES] == list(POLICIES)
    assert create_policy().needs_match and not create_policy("session").needs_match
    with pytest.raises(ConfigError, match="policy"):
        create_policy("fastest")
    with pytest.raises(ConfigError, match="tier_weights"):
        create_policy("round_robin", "heavy")


def test_each_policy_ranks_every_backend_best_first() -> None:
    backends = [_Backend(u, i) for i, u in enumerate("abcd")]
    for i, b in enumerate(backends):
        b.load.in_flight = [3, 0, 2, 1][i]
    assert create_policy("least_load").order(backends, {}) == [1, 3, 2, 0]
    rr = create_policy("round_robin")
    assert [rr.order(backends, {}) for _ in range(2)] == [[0, 1, 2, 3], [1, 2, 3, 0]]
    # sessions: the next-best is where the session moves if its backend is lost
    sticky = create_policy("session")
    for user in (f"user{i}" for i in range(20)):
        order = sticky.order(backends, {}, user)
        survivors = [b for j, b in enumerate(backends) if j != order[0]]
        moved_to = survivors[sticky.order(survivors, {}, user)[0]].url
        assert backends[order[1]].url == moved_to and sorted(order) == [0, 1, 2, 3]
    # kv_aware: by predicted time to first token
    matches = {0: Match(total=8), 1: Match(host=8, total=8), 2: Match(remote=8, total=8),
               3: Match(device=8, total=8)}
    assert create_policy().order(backends, matches) == [3, 1, 2, 0]


def _router(policy: Policy, n: int) -> Router:
    router = Router([BackendSpec(f"http://b{i}") for i in range(n)], policy,
                    PromptTokenizer("tiny"), block_size=4)
    for b in router.backends:
        b.index_id = router.index.add_instance()
        b.healthy = True
    return router


def test_retries_go_next_best_by_the_policy_ranking() -> None:
    """The router's ranking is the policy's whole order, not its choice then configuration
    order: here the busiest backend is configured second and must come last. Before, the
    choice was swapped to the front and the rest kept their configured order ([c, b, a])."""
    router = _router(create_policy("least_load"), 3)
    a, b, c = router.backends
    a.load.in_flight, b.load.in_flight, c.load.in_flight = 1, 5, 0
    assert [x.url for x in router.rank([1, 2, 3, 4], None).backends] == [c.url, a.url, b.url]
    kv = _router(create_policy(), 3)
    a, b, c = kv.backends
    a.load.busy_until = time.monotonic() + 50.0  # a's queue: 50 s, b's: 100 s, c's: none
    b.load.busy_until = time.monotonic() + 100.0
    assert [x.url for x in kv.rank([1, 2, 3, 4], None).backends] == [c.url, a.url, b.url]


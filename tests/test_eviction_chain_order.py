"""Differences from vLLM 0.33's CPU manager that were defects (issue 9 §5), on the issue's streams.

* Within a chain a request stored, the tail must leave first in every policy: vLLM commits a
  request's recency tail to head when it finishes (``on_request_finished``); before the fix,
  kvoffload's ``lru``, ``arc`` and ``s3fifo`` evicted the head and left the rest unreachable.
* ARC adapts its target when a ghost key comes back through ``prepare_store`` (vLLM's
  ``on_store_miss``, once per request and key) and puts it in T1; before the fix only ``touch`` of
  a ghost key did, and the key went to T2.
* Issue 21: a ready block that a request offers to ``prepare_store`` again is that request's use
  (vLLM refreshes its LRU recency, and ARC promotes it at the request's finish); ARC's ``touch`` of
  a ghost key adapts the target, as vLLM's does.

Each stream runs through the real ``CPUOffloadingManager``; the expected figures are vLLM's
(``tests/test_vllm_parity.py`` checks every decision against vLLM 0.33 on generated streams).
"""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from kvoffload import CPUOffloadingManager, LookupResult, ReqContext, make_offload_key
from kvoffload.eviction import ARCPolicy, available_eviction_policies
from kvoffload.keys import OffloadKey

HIT, MISS = LookupResult.HIT, LookupResult.MISS


def keys(prefix: str, n: int) -> list[OffloadKey]:
    return [make_offload_key(f"{prefix}{i}".encode()) for i in range(n)]


def serve(
    manager: CPUOffloadingManager, chain: Sequence[OffloadKey], name: str
) -> list[OffloadKey]:
    """One request that stores ``chain`` and finishes; return what its store evicted."""
    ctx = ReqContext(name)
    out = manager.prepare_store(chain, ctx)
    assert out is not None
    manager.complete_store(out.keys_to_store, ctx)
    manager.request_finished(ctx)
    return out.evicted_keys


@pytest.mark.parametrize("policy", available_eviction_policies())
def test_a_stored_chain_leaves_tail_first(policy: str) -> None:
    """Three slots; A stores a0 a1 a2 (a0 the head) and finishes; B stores b0. vLLM evicts a2,
    so A's prefix still hits twice: HIT HIT MISS (kvoffload's lru/arc/s3fifo answered MISS HIT HIT)."""
    a, b = keys("a", 3), keys("b", 1)
    manager = CPUOffloadingManager(3, policy)
    serve(manager, a, "A")
    assert serve(manager, b, "B") == [a[2]]
    probe = ReqContext("probe")
    assert [manager.lookup(key, probe) for key in a] == [HIT, HIT, MISS]
    manager.check_invariants()


@pytest.mark.parametrize("policy", available_eviction_policies())
def test_a_chain_with_a_hit_head_leaves_tail_first_too(policy: str) -> None:
    """A request that hits h0 h1 (touched) and stores n0 n1 after them: once it finishes, whatever
    four one-block requests evict of its chain leaves tail first: n1 n0 h1 h0 (the touched head is
    not older than the new tail)."""
    h, n, other = keys("h", 2), keys("n", 2), keys("o", 4)
    manager = CPUOffloadingManager(4, policy)
    serve(manager, h, "first")
    ctx = ReqContext("second")
    chain = h + n
    manager.prepare_load(h, ctx)
    manager.complete_load(h, ctx)
    manager.touch(chain, ctx)
    out = manager.prepare_store(n, ctx)
    assert out is not None and out.evicted_keys == []
    manager.complete_store(out.keys_to_store, ctx)
    manager.request_finished(ctx)
    evicted = []
    for i, key in enumerate(other):
        evicted += serve(manager, [key], f"other-{i}")
    gone = [key for key in evicted if key in chain]
    assert len(gone) >= 2
    assert gone == chain[::-1][: len(gone)]  # the tail first; the hit head outlives the new tail


def test_arc_adapts_to_a_ghost_key_stored_again() -> None:
    """Two slots; store x1, x2; store x3 (evicts the tail, x2, into B1); store x2, each by its
    own request. x2 comes back from B1: vLLM's target goes 0 -> 1 and x2 lands in T1 (kvoffload's
    stayed 0 and put x2 in T2)."""
    x = keys("x", 4)
    manager = CPUOffloadingManager(2, "arc")
    policy = manager.policy
    assert isinstance(policy, ARCPolicy)
    targets = []
    for i, offer in enumerate(([x[1], x[2]], [x[3]], [x[2]])):
        serve(manager, offer, f"r{i}")
        targets.append(policy.target)
    assert targets == [0.0, 0.0, 1.0]
    assert x[2] in policy._t1 and x[2] not in policy._t2
    manager.check_invariants()


def test_arc_counts_a_store_miss_once_per_request() -> None:
    """The same three offers by one request: x1 was this request's store miss already, so its
    return from B1 adapts nothing (vLLM's ``store_miss_keys``): the target stays 0."""
    x = keys("x", 4)
    manager = CPUOffloadingManager(2, "arc")
    policy = manager.policy
    assert isinstance(policy, ARCPolicy)
    ctx = ReqContext("r")
    for offer in ([x[1], x[2]], [x[3]], [x[1]]):
        out = manager.prepare_store(offer, ctx)
        assert out is not None
        manager.complete_store(out.keys_to_store, ctx)
    assert policy.target == 0.0 and x[1] in policy._t1


def test_arc_touch_of_a_ghost_key_adapts_the_target() -> None:
    """Issue 21's stream, capacity 3: store a b c; touch b c; store d (evicts a into B1); touch
    a; store a. vLLM's target goes 1 -> 2 and the store evicts c (kvoffload's went 0 -> 1 and
    evicted d)."""
    a, b, c, d = keys("k", 4)
    manager = CPUOffloadingManager(3, "arc")
    policy = manager.policy
    assert isinstance(policy, ARCPolicy)
    serve(manager, [a, b, c], "s")
    manager.touch([b, c], ReqContext("t"))
    assert serve(manager, [d], "d") == [a]
    manager.touch([a], ReqContext("u"))
    assert policy.target == 1.0
    assert serve(manager, [a], "a") == [c]
    assert policy.target == 2.0


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_a_ready_block_offered_again_is_a_use(policy: str) -> None:
    """Issue 21's stream, capacity 4: S stores a0 a1 a2; X stores x0; R offers a0 a1 a2 (all
    stored already) and finishes; Y stores y0 y1. vLLM counts R's offer as a use of a0..a2 and
    evicts x0 then a2 (kvoffload's lru evicted a2 and a1)."""
    a, x, y = keys("a", 3), keys("x", 1), keys("y", 2)
    manager = CPUOffloadingManager(4, policy)
    serve(manager, a, "S")
    serve(manager, x, "X")
    assert serve(manager, a, "R") == []
    assert serve(manager, y, "Y") == [x[0], a[2]]

"""Stores the host tier cannot take at once, in the real engine: a finished request's refused offer
is kept and stored once room appears, and an offer larger than the room stores its longest head
(every later request on that prefix needs the head), under every store policy."""

from __future__ import annotations

import random

import pytest
from engine_cases import (
    BLOCK_SIZE,
    assert_quiescent,
    assert_same_outputs,
    backing_manager,
    delay_completions,
    greedy,
    host_gib,
    one_thread,  # noqa: F401 - autouse fixture
    random_tokens,
    reference_outputs,
    tiny_engine,
)

from kvoffload.engine import Engine
from kvoffload.keys import BlockHash, offload_key_hash


def _readable(engine: Engine) -> set[bytes]:
    """Block hashes the host tier holds readable."""
    return {offload_key_hash(k) for k, b in backing_manager(engine).items() if b.ref_cnt >= 0}


def _blocks(engine: Engine, prompt: list[int]) -> list[BlockHash]:
    return engine.hasher.hash_blocks(prompt)


#: A bound on stores in flight no test of this module reaches: these tests are about the tier
#: refusing stores, which shedding (``test_engine_store_bounds.py``) would pre-empt.
NO_SHEDDING = 1024


def test_a_finished_requests_refused_store_is_kept_until_stored() -> None:
    """The tier (4 blocks) is all pending with A's store (reported 6 steps late) when B, an
    ``on_finish`` request, ends: its offer is refused, kept with its blocks, and stored once A's
    store completes (A's blocks are then evictable)."""
    rng = random.Random(1)
    a = random_tokens(rng, 4 * BLOCK_SIZE + 1)
    b = random_tokens(rng, 4 * BLOCK_SIZE + 1)
    # No shedding: the tier's own refusal is what is tested (NO_SHEDDING).
    with tiny_engine(
        num_device_blocks=32, kv_offloading_size=host_gib(4), kv_store_max_in_flight=NO_SHEDDING
    ) as engine:
        delay_completions(engine, lambda job_id: 6 if job_id == 0 else 0)
        outs = engine.generate([a], greedy(1))
        assert backing_manager(engine).stats()["used_blocks"] == 4  # A's 4 blocks, pending
        engine.add_request(b, greedy(1), "b", kv_transfer_params={"store_policy": "on_finish"})
        while engine.has_unfinished():
            outs += engine.step()
        assert engine.connector is not None and engine.connector.has_store_retries
        assert "b" in engine.scheduler.held
        engine.drain()
        assert set(_blocks(engine, b)) <= _readable(engine)
        assert engine.stats()["offload_rejected_stores"] > 0
        assert_quiescent(engine)
    assert_same_outputs(outs, reference_outputs([a, b], greedy(1)))


@pytest.mark.parametrize("store_policy", ["on_compute", "on_finish", "prompt_only"])
def test_an_offer_larger_than_the_tier_stores_its_longest_head(store_policy: str) -> None:
    """A 6-block prompt, a 5-block tier: the first 5 blocks are stored, and a second request on
    the same prompt loads them."""
    rng = random.Random(2)
    prompt = random_tokens(rng, 6 * BLOCK_SIZE + 1)
    with tiny_engine(
        num_device_blocks=32,
        kv_offloading_size=host_gib(5),
        store_policy=store_policy,
        kv_store_max_in_flight=NO_SHEDDING,
    ) as engine:
        first = engine.generate([prompt], greedy(2))
        engine.drain()
        assert _readable(engine) == set(_blocks(engine, prompt)[:5])
        engine.pool.reset_prefix_cache()
        again = engine.generate([prompt], greedy(2))
        assert again[0].cached_tokens_offload == 5 * BLOCK_SIZE
        assert_quiescent(engine)
    assert_same_outputs(first + again, reference_outputs([prompt, prompt], greedy(2)))


def test_kept_offers_are_given_up_when_the_engine_needs_their_blocks() -> None:
    """A finished request's kept offer holds its device blocks only until a new request needs
    them: then they are freed and the new request runs (no deadlock, nothing left held)."""
    rng = random.Random(3)
    a = random_tokens(rng, 4 * BLOCK_SIZE + 1)
    b = random_tokens(rng, 4 * BLOCK_SIZE + 1)
    c = random_tokens(rng, 9 * BLOCK_SIZE)
    with tiny_engine(
        num_device_blocks=16, kv_offloading_size=host_gib(4), store_policy="on_finish"
    ) as engine:
        delay_completions(engine, lambda job_id: 50 if job_id == 0 else 0)
        outs = engine.generate([a], greedy(1))
        outs += engine.generate([b], greedy(1))  # refused: A's store is pending for 50 steps
        assert engine.scheduler.held
        outs += engine.generate([c], greedy(1))  # needs B's blocks long before A's store ends
        assert engine.stats()["steps"] < 50
        assert not set(_blocks(engine, b)) & _readable(engine)
        assert_quiescent(engine)
    assert_same_outputs(outs, reference_outputs([a, b, c], greedy(1)))

"""End to end: the engine gives the same output with and without offloading, whatever the store
policy, eviction policy or reuse filter, when every prefix has to come back from the host tier."""

from __future__ import annotations

import pytest
from engine_cases import (
    BLOCK_SIZE,
    assert_quiescent,
    assert_same_outputs,
    cycling_rounds,
    greedy,
    host_gib,
    one_thread,  # noqa: F401 - autouse fixture
    reference_outputs,
    run_rounds,
    tiny_engine,
)

import kvoffload
from kvoffload.engine import RequestOutput, SamplingParams
from kvoffload.errors import ConfigError
from kvoffload.scheduler.policy import STORE_POLICIES

PREFIX_BLOCKS = 6
PREFIX_TOKENS = PREFIX_BLOCKS * BLOCK_SIZE
# Four 6-block prefixes cycle through a 24-block device cache two requests at a time: each
# prefix is evicted from the device before its next round (in arrival order: cache-aware order
# runs a round's requests on the prefixes still held, test_engine_admission.py). The host tier
# holds everything.
CYCLING = {
    "num_device_blocks": 24,
    "max_num_seqs": 2,
    "kv_offloading_size": host_gib(64),
    "scheduling_policy": "fcfs",
}

ROUNDS = cycling_rounds(num_prefixes=4, prefix_blocks=PREFIX_BLOCKS, num_rounds=3)
FLAT = [p for r in ROUNDS for p in r]


@pytest.fixture(scope="module")
def reference() -> list:
    return reference_outputs(FLAT, greedy())


def _cases() -> list:
    cases = [
        pytest.param(sp, ev, 0, id=f"{sp}-{ev}")
        for sp in sorted(STORE_POLICIES)
        for ev in kvoffload.available_eviction_policies()
    ]
    cases += [
        pytest.param(sp, "lru", 2, id=f"{sp}-lru-threshold2") for sp in sorted(STORE_POLICIES)
    ]
    return cases


@pytest.mark.parametrize(("store_policy", "eviction_policy", "store_threshold"), _cases())
def test_cycling_prefixes_match_reference(
    reference: list, store_policy: str, eviction_policy: str, store_threshold: int
) -> None:
    """Greedy tokens identical, full-vocab logprobs within 1e-4, and the prefixes of later rounds
    really came from the host tier (from round 2 on; with the reuse filter, from round 3 on)."""
    with tiny_engine(
        **CYCLING,
        store_policy=store_policy,
        eviction_policy=eviction_policy,
        store_threshold=store_threshold,
    ) as engine:
        rounds = run_rounds(engine, ROUNDS, greedy())
        assert_same_outputs([o for r in rounds for o in r], reference)
        first_served = 2 if store_threshold >= 2 else 1  # the filter stores on the second sighting
        if store_threshold >= 2:
            assert all(o.cached_tokens_offload == 0 for o in rounds[0] + rounds[1])
        for out in (o for r in rounds[first_served:] for o in r):
            assert out.cached_tokens_offload > 0, out.request_id
            assert out.cached_tokens_engine + out.cached_tokens_offload >= PREFIX_TOKENS
        stats = engine.stats()
        assert stats["offload_loaded_blocks"] > 0
        assert stats["offload_failed_loads"] == stats["offload_failed_stores"] == 0
        assert stats["device_evicted_blocks"] > 0
        assert_quiescent(engine)


def test_all_at_once_matches_reference(reference: list) -> None:
    """Every round submitted at once: stores and loads of different requests overlap."""
    with tiny_engine(**CYCLING) as engine:
        outputs = engine.generate(FLAT, greedy())
        assert_same_outputs(outputs, reference)
        assert engine.stats()["offload_loaded_blocks"] > 0
        assert sum(o.cached_tokens_offload for o in outputs) > 0
        assert_quiescent(engine)


def test_block_size_factor_two_matches_reference(reference: list) -> None:
    """Offloaded blocks of two engine blocks (8 tokens): loads start at an offloaded-block boundary.
    In arrival order, so that every request of rounds 2+ loads (some after a partial device hit);
    the cache-aware order runs first the requests whose prefix is still in the device, which then
    load nothing."""
    with tiny_engine(
        num_device_blocks=24,
        max_num_seqs=2,
        block_size_factor=2,
        kv_offloading_size=host_gib(32, factor=2),
        scheduling_policy="fcfs",
    ) as engine:
        rounds = run_rounds(engine, ROUNDS, greedy())
        assert_same_outputs([o for r in rounds for o in r], reference)
        offloaded = [o.cached_tokens_offload for r in rounds[1:] for o in r]
        assert all(n > 0 for n in offloaded)
        assert_quiescent(engine)


def test_seeded_sampling_same_with_and_without_offloading(reference: list) -> None:
    """Temperature sampling with a seed per request draws the same tokens when the prefix KV is
    loaded from the host tier instead of computed."""
    params = [
        SamplingParams(
            max_tokens=8, temperature=0.9, top_p=0.95, top_k=50, seed=100 + i, ignore_eos=True
        )
        for i in range(len(FLAT))
    ]
    want = reference_outputs(FLAT, params)
    with tiny_engine(**CYCLING) as engine:
        got = []
        for r, prompts in enumerate(ROUNDS):
            got += engine.generate(prompts, params[r * len(prompts) : (r + 1) * len(prompts)])
            engine.drain()
        assert_same_outputs(got, want)
        assert engine.stats()["offload_loaded_blocks"] > 0
        assert_quiescent(engine)
    # Really sampled: the tokens are not the greedy ones.
    n = len(reference[0].output_token_ids)
    assert any(
        w.output_token_ids[:n] != g.output_token_ids for w, g in zip(want, reference, strict=True)
    )


def test_per_request_transfer_params(reference: list) -> None:
    """``kv_transfer_params`` caps what one request loads; the output does not change."""
    with tiny_engine(**CYCLING) as engine:
        run_rounds(engine, ROUNDS[:1], greedy())
        capped = [
            engine.add_request(p, greedy(), kv_transfer_params={"max_load_tokens": 2 * BLOCK_SIZE})
            for p in ROUNDS[1]
        ]
        done: dict[str, RequestOutput] = {}
        while len(done) < len(capped):
            done.update((o.request_id, o) for o in engine.step())
        outputs = [done[i] for i in capped]
        assert_same_outputs(outputs, reference[len(ROUNDS[0]) : 2 * len(ROUNDS[0])])
        assert all(o.cached_tokens_offload <= 2 * BLOCK_SIZE for o in outputs)
        assert sum(o.cached_tokens_offload for o in outputs) > 0
        assert_quiescent(engine)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": [1, 2, 512]}, "prompt"),  # the tiny vocabulary is 512
        ({"prompt": [1, -1]}, "prompt"),
        ({"kv_transfer_params": {"store_policy": "sometimes"}}, "kv_transfer_params.store_policy"),
        ({"kv_transfer_params": {"max_load_tokens": -4}}, "kv_transfer_params.max_load_tokens"),
        ({"request_id": "taken"}, "request_id"),
    ],
)
def test_bad_requests_are_refused_at_add_request(kwargs: dict, field: str) -> None:
    with tiny_engine(**CYCLING) as engine:
        engine.add_request([5, 6, 7], greedy(1), request_id="taken")
        with pytest.raises(ConfigError) as err:
            engine.add_request(**{"prompt": [1, 2, 3], **kwargs})
        assert err.value.field == field
        assert len(engine.scheduler.waiting) == 1  # nothing was queued
        engine.generate([[8, 9]], greedy(1))
        assert_quiescent(engine)

"""Scheduler side, loads: hits after the engine's prefix cache lost a prefix, hits that start in
the middle of an offloaded block, the last-token rule, ``max_load_tokens``, two full-attention
groups with different block sizes, and the convoy case (many requests on one offloaded prefix).

Every test runs the real connector and CPU manager inside :class:`fake_engine.FakeEngine`, whose
oracle fails on any wrong, misplaced or garbage load.
"""

from __future__ import annotations

from typing import Any

import pytest
from fake_engine import (
    FINISHED,
    FakeEngine,
    FakeRequest,
    RecordingManager,
    groups_config,
    make_tokens,
    single_group,
)

from kvoffload import LookupResult, ReqContext
from kvoffload.load_store_specs import GPULoadStoreSpec
from kvoffload.scheduler import GroupOffloadConfig
from kvoffload.transfer import TransferJob


def offload(engine: FakeEngine, prompt: list[int]) -> FakeRequest:
    """Run one request over ``prompt`` to the end (its full blocks are stored on compute)."""
    req = engine.add_request(prompt, max_tokens=1)
    engine.run()
    return req


def load_jobs(engine: FakeEngine, req_id: str) -> list[TransferJob]:
    return engine.executor.jobs(req_id, stores=False)


def loaded_keys(engine: FakeEngine, req_id: str) -> list[bytes]:
    manager = engine.manager
    assert isinstance(manager, RecordingManager)
    return [k for c in manager.of("prepare_load", req_id) for k in c.keys]


def offered_keys(engine: FakeEngine, req_id: str) -> set[bytes]:
    manager = engine.manager
    assert isinstance(manager, RecordingManager)
    return {k for c in manager.of("prepare_store", req_id) for k in c.keys}


@pytest.mark.parametrize("factor", [1, 3])
def test_load_after_the_engine_cache_lost_the_prefix(factor: int) -> None:
    """A's blocks are offloaded, then reused by C; B, on A's prefix, loads them from the tier and
    never offers them for storing again."""
    engine = FakeEngine(single_group(4, factor), num_engine_blocks=20)
    prompt = make_tokens(49, 1)
    a = offload(engine, prompt)
    n = 48 // (4 * factor)
    a_keys = [engine.offload_key(a, i) for i in range(n)]
    assert set(a_keys) <= engine.ready_keys()
    offload(engine, make_tokens(77, 2))  # C needs all 20 engine blocks: A's cached blocks are gone

    b = engine.add_request([*prompt, 7, 8, 9], max_tokens=3)
    engine.run()
    (lookup,) = engine.lookup_of(b.request_id)
    assert (lookup.local_hit, lookup.external) == (0, 48)
    assert loaded_keys(engine, b.request_id) == a_keys
    (job,) = load_jobs(engine, b.request_id)
    assert isinstance(job.dst, GPULoadStoreSpec)
    assert job.dst.group_sizes == [12] and job.dst.block_indices == [0]
    assert not offered_keys(engine, b.request_id) & set(a_keys), (
        "loaded blocks are not stored again"
    )
    assert b.status == FINISHED
    engine.check_drained()


def test_hit_starting_in_the_middle_of_an_offloaded_block() -> None:
    """The engine cache still holds 5 of A's engine blocks (20 tokens): offloaded block 1 (engine
    blocks 3-5) is partly present, so B loads engine blocks 5-11 from offloaded blocks 1-3,
    skipping 2 pages of the first one."""
    engine = FakeEngine(single_group(4, 3), num_engine_blocks=32)
    prompt = make_tokens(49, 1)
    a = offload(engine, prompt)
    engine.evict_free_blocks(7)  # A's 12 full blocks, tail first: engine blocks 0-4 stay cached

    b = engine.add_request([*prompt, 7, 8, 9], max_tokens=2)
    engine.run()
    (lookup,) = engine.lookup_of(b.request_id)
    assert (lookup.local_hit, lookup.external) == (20, 28)
    assert loaded_keys(engine, b.request_id) == [engine.offload_key(a, i) for i in (1, 2, 3)]
    (job,) = load_jobs(engine, b.request_id)
    assert isinstance(job.dst, GPULoadStoreSpec)
    assert job.dst.block_indices == [5] and job.dst.group_sizes == [7]
    engine.check_drained()


@pytest.mark.parametrize(
    ("factor", "extra", "expected"), [(1, 0, 32), (3, 0, 24), (1, 1, 36), (3, 1, 36)]
)
def test_last_prompt_token_is_always_recomputed(factor: int, extra: int, expected: int) -> None:
    """A prompt that is an exact multiple of the offloaded block never loads its last block: the
    engine needs the last token's logits. One more token and the whole prefix loads."""
    engine = FakeEngine(single_group(4, factor))
    prompt = make_tokens(36, 1)
    offload(engine, prompt)
    engine.drop_prefix_cache()
    b = engine.add_request(prompt + make_tokens(extra, 2), max_tokens=1)
    engine.run()
    (lookup,) = engine.lookup_of(b.request_id)
    assert lookup.external == expected
    engine.check_drained()


@pytest.mark.parametrize(("cap", "expected"), [(18, 16), (3, 0), (0, 0), (1000, 48)])
def test_max_load_tokens_caps_the_hit(cap: int, expected: int) -> None:
    engine = FakeEngine(single_group(4))
    prompt = make_tokens(49, 1)
    offload(engine, prompt)
    engine.drop_prefix_cache()
    b = engine.add_request([*prompt, 1], max_tokens=1, kv_transfer_params={"max_load_tokens": cap})
    engine.run()
    (lookup,) = engine.lookup_of(b.request_id)
    assert lookup.external == expected
    engine.check_drained()


@pytest.mark.parametrize("lose_block", [False, True])
def test_two_full_groups_with_different_block_sizes(lose_block: bool) -> None:
    """Groups of 12- and 16-token blocks: stores follow each group's own block boundaries, keys
    carry the group, and a hit is bounded by both groups and aligned to whole blocks of both
    (48 tokens). Losing group 1's block 4 (its store fails) bounds the hit at 64 -> 48."""
    config = groups_config(GroupOffloadConfig(12, 1), GroupOffloadConfig(16, 1), hash_block_size=4)

    def fail(job: TransferJob, worker: int) -> bool:
        # The store of the step that completes token 80 carries only group 1's block 4.
        return (
            lose_block
            and job.is_store
            and isinstance(job.src, GPULoadStoreSpec)
            and job.src.block_indices == [0, 4]
        )

    engine = FakeEngine(config, token_budget=4, fail=fail)
    prompt = make_tokens(97, 1)
    a = offload(engine, prompt)
    g0 = [engine.offload_key(a, i, 0) for i in range(8)]
    g1 = [engine.offload_key(a, i, 1) for i in range(6)]
    assert g0[0] != g1[0] and len(set(g0) | set(g1)) == 14
    assert engine.ready_keys() == set(g0) | set(g1) - ({g1[4]} if lose_block else set())

    engine.drop_prefix_cache()
    b = engine.add_request(prompt + make_tokens(20, 2), max_tokens=2)
    engine.run()
    (lookup,) = engine.lookup_of(b.request_id)
    hit = 48 if lose_block else 96
    assert lookup.external == hit
    (job,) = load_jobs(engine, b.request_id)
    assert isinstance(job.dst, GPULoadStoreSpec)
    assert job.dst.group_sizes == [hit // 12, hit // 16] and job.dst.block_indices == [0, 0]
    assert loaded_keys(engine, b.request_id) == g0[: hit // 12] + g1[: hit // 16]
    engine.check_drained()


# --------------------------------------------------------------------------------------- convoy

CONVOY = 32
PREFIX_BLOCKS = 8


def convoy_engine(**kwargs: Any) -> tuple[FakeEngine, list[int]]:
    """A roomy engine and an 8-block prefix (the tests offload it first)."""
    engine = FakeEngine(
        single_group(4), num_engine_blocks=400, num_host_blocks=64, token_budget=1024, **kwargs
    )
    return engine, make_tokens(4 * PREFIX_BLOCKS, 1)


@pytest.mark.parametrize("arrival", ["together", "while_first_load_in_flight"])
def test_convoy_every_request_loads_at_once(arrival: str) -> None:
    """32 requests on one offloaded prefix, arriving together or while the first one's (slower,
    2-step) load is in flight: every lookup answers at once (never None), every request issues
    its own load in its arrival step, all of them pin the same tier blocks concurrently, and
    time to first token stays at 3 steps (arrive + load, load completes, compute; 4 for the slow
    first one). A convoy (vLLM #44294: wait while another request loads the same blocks) would
    make the later requests wait for the first one's load, then for their own."""
    together = arrival == "together"
    engine, prefix = convoy_engine(
        delay=lambda job, w: 1 if together or job.req_id != "first" else 2
    )
    offload(engine, [*prefix, 1])
    engine.drop_prefix_cache()
    start = engine.step_index + 1
    ids = ["first"] + [f"c{i}" for i in range(1, CONVOY)]
    reqs = [
        engine.add_request(prefix + make_tokens(1, 100 + i), 1, req_id=ids[i])
        for i in range(CONVOY if together else 1)
    ]
    engine.step()
    if not together:
        reqs += [
            engine.add_request(prefix + make_tokens(1, 100 + i), 1, req_id=ids[i])
            for i in range(1, CONVOY)
        ]
        engine.step()
        # The first load is still in flight, the 31 new ones too: 32 readers pin every block.
        assert {block.ref_cnt for _, block in engine.manager.items()} == {CONVOY}
    engine.run()

    for req in reqs:
        (lookup,) = engine.lookup_of(req.request_id)
        assert lookup.external == 4 * PREFIX_BLOCKS, "answered at once with the whole prefix"
        assert lookup.step == req.arrival_step
        (issued,) = [
            step
            for step, job in engine.executor.submitted
            if job.req_id == req.request_id and not job.is_store
        ]
        assert issued == req.arrival_step, "its own load, issued in its arrival step"
        assert engine.ttft_steps(req) <= (4 if req.request_id == "first" and not together else 3)
    assert max(r.arrival_step for r in reqs) - start <= 1
    assert engine.connector.stats()["load_jobs"] == CONVOY
    engine.check_drained()


def test_convoy_on_a_prefix_still_being_written() -> None:
    """The prefix's second half is still being stored (HIT_PENDING): 32 requests load the ready
    first half at once and recompute the rest, without waiting for the store."""
    engine, prefix = convoy_engine(load_delay=1, store_delay=None)
    a = engine.add_request([*prefix, 1], max_tokens=1, req_id="a")
    engine.token_budget = 16  # A's prefill in two chunks: two store jobs of 4 blocks each
    engine.run_until(lambda: a.status == FINISHED)
    first, second = engine.executor.jobs("a", stores=True)
    engine.executor.complete([first.job_id])
    engine.step()
    engine.drop_prefix_cache()
    keys = [engine.offload_key(a, i) for i in range(PREFIX_BLOCKS)]
    probe = ReqContext("probe")
    assert [engine.manager.lookup(k, probe) for k in keys] == [LookupResult.HIT] * 4 + [
        LookupResult.HIT_PENDING
    ] * 4

    engine.token_budget = 1024
    reqs = [
        engine.add_request(prefix + make_tokens(1, 100 + i), max_tokens=1) for i in range(CONVOY)
    ]
    engine.run_until(lambda: all(r.status == FINISHED for r in reqs))
    for req in reqs:
        (lookup,) = engine.lookup_of(req.request_id)
        assert lookup.external == 16, "the ready half loads, the pending half is recomputed"
        assert engine.ttft_steps(req) <= 3
    assert engine.manager.lookup(keys[4], probe) is LookupResult.HIT_PENDING
    engine.executor.complete([second.job_id])
    engine.run()
    assert set(keys) <= engine.ready_keys()
    engine.check_drained()


def test_held_probe_reads_a_looked_up_requests_keys_only_for_that_request() -> None:
    """``num_held_blocks`` reuses the keys a lookup made for the request: the same answer as a
    probe of a request never looked up, and a request object that only shares the id (its
    state is another request's) is probed on its own blocks."""
    engine = FakeEngine(single_group(4), num_engine_blocks=40)
    prompt = make_tokens(33, 1)
    offload(engine, prompt)
    connector = engine.connector
    fresh = engine.add_request(prompt, req_id="fresh")
    looked_up = engine.add_request(prompt, req_id="looked-up")
    connector.get_num_new_matched_tokens(looked_up, 0)
    assert connector.num_held_blocks(fresh, 0, 9) == 8
    assert connector.num_held_blocks(looked_up, 0, 9) == 8
    assert connector.num_held_blocks(looked_up, 2, 5) == 3
    other = FakeRequest("looked-up", make_tokens(33, 2), 1, None, engine.hasher, 1, 0)
    assert connector.num_held_blocks(other, 0, 9) == 0

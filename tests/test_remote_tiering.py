"""The remote tier behind the tiering manager, on a real ``redis-server``: what a write-through
cascade costs the server, and promotions that land exactly."""

from __future__ import annotations

import time

import torch
from redis_servers import RedisServer
from remote_cases import (
    WAIT_S,
    fill_random,
    keys_for,
    make_layout,
    make_pool,
    make_tier,
    run_job,
)
from remote_proxy import TrickleProxy

from kvoffload.keys import OffloadKey
from kvoffload.manager_contract import LookupResult, ReqContext
from kvoffload.managers import CPUOffloadingManager
from kvoffload.managers.tiering import TieringOffloadingManager
from kvoffload.tiers.contract import KVLayout


def test_write_through_stores_without_asking_first(redis_server: RedisServer) -> None:
    """Issue 18, defect 4: cascading host stores to the remote tier sends SETs only (before: a
    PTTL/EXISTS question per block first, doubling the round trips and inflating
    ``lookups_sent``). A second engine then finds and promotes every block, byte-exact."""
    layout = make_layout()
    (pool_a, view_a), (pool_b, view_b) = make_pool(8), make_pool(8)
    fill_random(pool_a, seed=30)
    a = TieringOffloadingManager(
        CPUOffloadingManager(8, "lru"), [make_tier(redis_server.url, view_a, layout)]
    )
    b = TieringOffloadingManager(
        CPUOffloadingManager(8, "lru"), [make_tier(redis_server.url, view_b, layout)]
    )
    try:
        keys = keys_for(6, salt=30)
        writer = ReqContext("writer")
        out = a.prepare_store(keys, writer)
        assert out is not None and out.keys_to_store == keys
        slots = out.store_spec.block_ids  # type: ignore[attr-defined]
        a.complete_store(keys, writer)
        a.drain()
        stats = a.stats()
        assert stats["remote_stored_blocks"] == 6 and stats["cascaded_blocks"] == 6
        assert stats["remote_lookups_sent"] == 0 and stats["remote_lookup_round_trips"] == 0

        reader = ReqContext("reader")
        deadline = time.monotonic() + WAIT_S
        while True:  # step by step, as the scheduler asks: RETRY while lookups and promotions run
            answers = [b.lookup(k, reader) for k in keys]
            if LookupResult.RETRY not in answers or time.monotonic() > deadline:
                break
            b.step_end()
            b.drain()
            time.sleep(0.002)
        assert answers == [LookupResult.HIT] * 6
        spec = b.prepare_load(keys, reader)
        got = pool_b[spec.block_ids]  # type: ignore[attr-defined]
        assert torch.equal(got, pool_a[slots])
        assert b.stats()["remote_lookups_sent"] == 6  # the reader asks, once per block
    finally:
        a.close()
        b.close()


def _stored_elsewhere(url: str, layout: KVLayout, keys: list[OffloadKey]) -> torch.Tensor:
    """Another engine's tier stores ``keys``; returns their bytes."""
    pool, view = make_pool(len(keys))
    fill_random(pool, seed=31)
    writer = make_tier(url, view, layout)
    try:
        assert run_job(writer, True, keys, list(range(len(keys)))).success
    finally:
        writer.close()
    return pool


def test_a_remote_hit_is_promoted_in_the_step_that_found_it(redis_server: RedisServer) -> None:
    """Issue 23: a block only the server holds is promoted in the step whose lookups asked the
    server (the step waits, within the tier's ``answer_wait_s``, for the answer), so the next
    step finds it in the host, as for a disk hit. Before: the answer landed only by the next
    step's lookup, which queued the promotion then: one step more per remote hit (this test's
    second lookups answered RETRY)."""
    layout = make_layout()
    keys = keys_for(6, salt=31)
    written = _stored_elsewhere(redis_server.url, layout, keys)
    pool, view = make_pool(8)
    tier = make_tier(redis_server.url, view, layout, answer_wait_s=WAIT_S)
    manager = TieringOffloadingManager(CPUOffloadingManager(8, "lru"), [tier])
    try:
        reader = ReqContext("reader")
        # step 1: the server is asked; the step ends after the answers: promotion submitted
        assert [manager.lookup(k, reader) for k in keys] == [LookupResult.RETRY] * 6
        manager.step_end()
        assert manager.stats()["promotions_in_flight"] == 6
        tier.drain_jobs()  # the promotion's load runs while the step computes
        manager.step_begin()
        # step 2: a host hit
        assert [manager.lookup(k, reader) for k in keys] == [LookupResult.HIT] * 6
        spec = manager.prepare_load(keys, reader)
        assert torch.equal(pool[spec.block_ids], written)  # type: ignore[attr-defined]
        stats = manager.stats()
        assert stats["remote_lookups_sent"] == 6 and stats["remote_answer_waits"] == 1
        assert stats["remote_answer_wait_timeouts"] == 0
        manager.check_invariants()
    finally:
        manager.close()


def test_a_late_answer_waits_for_the_next_step_not_longer(redis_server: RedisServer) -> None:
    """A server whose replies are held (a proxy of ours, released by the test) never holds the
    step beyond ``answer_wait_s``: the step ends unanswered (nothing promoted, the wait counted
    as timed out), and the answer serves a later step. A wait without bound would never
    return here (the replies are released only after it)."""
    layout = make_layout()
    keys = keys_for(4, salt=32)
    written = _stored_elsewhere(redis_server.url, layout, keys)
    proxy = TrickleProxy(redis_server.port)
    pool, view = make_pool(8)
    tier = make_tier(proxy.url(), view, layout, answer_wait_s=0.01, timeout_s=WAIT_S)
    manager = TieringOffloadingManager(CPUOffloadingManager(8, "lru"), [tier])
    try:
        reader = ReqContext("reader")
        proxy.hold()
        assert [manager.lookup(k, reader) for k in keys] == [LookupResult.RETRY] * 4
        manager.step_end()
        stats = manager.stats()
        assert stats["remote_answer_wait_timeouts"] == 1
        assert stats["promotions_in_flight"] == 0
        proxy.release()
        deadline = time.monotonic() + WAIT_S
        while True:  # later steps, as the scheduler runs them
            manager.step_begin()
            answers = [manager.lookup(k, reader) for k in keys]
            if answers == [LookupResult.HIT] * 4 or time.monotonic() > deadline:
                break
            manager.step_end()
            tier.drain_jobs()
        assert answers == [LookupResult.HIT] * 4
        spec = manager.prepare_load(keys, reader)
        assert torch.equal(pool[spec.block_ids], written)  # type: ignore[attr-defined]
    finally:
        manager.close()
        proxy.close()

"""The remote tier behind the tiering manager, on a real ``redis-server``: what a write-through
cascade costs the server, and promotions that land exactly."""

from __future__ import annotations

import time

import torch
from redis_servers import RedisServer
from remote_cases import WAIT_S, fill_random, keys_for, make_layout, make_pool, make_tier

from kvoffload.base import LookupResult, ReqContext
from kvoffload.managers import CPUOffloadingManager
from kvoffload.managers.tiering import TieringOffloadingManager


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

"""Scheduler side, a full-attention group next to a sliding-window group.

The engine (like vLLM's) frees window blocks that leave the window while a request runs and does
not tell the connector. The connector copes on two fronts, each pinned by a regression test
below: it only offers window blocks that are still inside the window of the engine's next token
(so a retried or on-finish store never reads a freed block), and a reuse fence flushes a store
still reading a window block the engine hands to another request.
"""

from __future__ import annotations

from fake_engine import (
    FINISHED,
    WAITING,
    FakeEngine,
    RecordingManager,
    groups_config,
    make_tokens,
)

from kvoffload.load_store_specs import GPULoadStoreSpec
from kvoffload.scheduler import NULL_BLOCK_ID, GroupOffloadConfig, SchedulerOffloadConfig


def window_config(window_blocks: int, store_policy: str = "on_compute") -> SchedulerOffloadConfig:
    """Group 0: full attention; group 1: a window of ``window_blocks`` 4-token blocks."""
    return groups_config(
        GroupOffloadConfig(4, 1),
        GroupOffloadConfig(4, 1, window_blocks),
        hash_block_size=4,
        store_policy=store_policy,
    )


def test_window_group_loads_and_touches_only_the_last_window() -> None:
    """A 6-block hit loads all 6 blocks of the full group but only blocks 4-5 (the window) of the
    window group, into an engine table whose out-of-window positions are NULL; the window
    group touches only from ``num_hit_blocks - window`` on."""
    engine = FakeEngine(window_config(2))
    manager = engine.manager
    assert isinstance(manager, RecordingManager)
    prompt = make_tokens(25, 1)
    a = engine.add_request(prompt, max_tokens=1)
    engine.run()
    assert engine.ready_keys() == {engine.offload_key(a, i, g) for i in range(6) for g in (0, 1)}
    engine.drop_prefix_cache()

    b = engine.add_request([*prompt, 1, 2, 3], max_tokens=4)
    engine.run_until(lambda: b.status != WAITING)
    (lookup,) = engine.lookup_of(b.request_id)
    assert lookup.external == 24
    (load,) = manager.of("prepare_load", b.request_id)
    assert list(load.keys) == [engine.offload_key(b, i, 0) for i in range(6)] + [
        engine.offload_key(b, i, 1) for i in (4, 5)
    ]
    (job,) = engine.executor.jobs(b.request_id, stores=False)
    assert isinstance(job.dst, GPULoadStoreSpec)
    assert job.dst.group_sizes == [6, 2] and job.dst.block_indices == [0, 4]
    assert b.block_table[1][:4] == [NULL_BLOCK_ID] * 4
    # One touch per group at lookup: group 1 from num_hit_blocks (6) - window (2) = block 4 on.
    touches = manager.of("touch", b.request_id)
    assert [list(t.keys) for t in touches] == [
        [engine.offload_key(b, i, 0) for i in range(7)],
        [engine.offload_key(b, i, 1) for i in (4, 5, 6)],
    ]
    engine.run()
    assert b.status == FINISHED
    engine.check_drained()


def test_window_hit_needs_only_the_window() -> None:
    """With a 1-block window, a 32-token hit loads all 8 blocks of the full group but only
    block 7 of the window group."""
    engine = FakeEngine(window_config(1))
    prompt = make_tokens(33, 1)
    engine.add_request(prompt, max_tokens=1)
    engine.run()
    engine.drop_prefix_cache()
    b = engine.add_request([*prompt, 9], max_tokens=2)
    engine.run()
    (lookup,) = engine.lookup_of(b.request_id)
    assert lookup.external == 32
    (job,) = engine.executor.jobs(b.request_id, stores=False)
    assert isinstance(job.dst, GPULoadStoreSpec)
    assert job.dst.group_sizes == [8, 1] and job.dst.block_indices == [0, 7]
    engine.check_drained()


def test_on_finish_does_not_store_window_blocks_the_engine_freed() -> None:
    """``on_finish`` with a window group: by the finish, the engine has freed (and another request
    reused) A's early window blocks; storing them puts B's KV under A's keys in the tier (the
    harness's tier check fails as soon as that store completes)."""
    engine = FakeEngine(window_config(1, "on_finish"), num_engine_blocks=[64, 10], token_budget=24)
    a = engine.add_request(make_tokens(32, 1), max_tokens=6, req_id="a")
    engine.token_budget = 8
    engine.step()
    engine.step()
    engine.token_budget = 24
    engine.add_request(
        make_tokens(16, 2), max_tokens=8, req_id="b"
    )  # reuses a's freed window blocks
    engine.run_until(lambda: a.status == FINISHED)
    engine.run()
    engine.check_drained()


def test_window_block_is_not_reused_while_its_store_is_in_flight() -> None:
    """A stores window blocks 0-3 (a 2-step store); the next step the engine frees blocks 0-2 (out
    of the 1-block window) and hands two of them to B while the store still reads them. Nothing
    flushes that store first (vLLM fences window store sources for this)."""
    engine = FakeEngine(window_config(1), num_engine_blocks=[64, 8], token_budget=24, store_delay=2)
    engine.add_request(make_tokens(32, 1), max_tokens=1, req_id="a")
    engine.token_budget = 16
    engine.step()
    engine.token_budget = 24
    engine.add_request(make_tokens(8, 2), max_tokens=1, req_id="b")
    engine.run()
    engine.check_drained()


def test_rejected_window_store_is_not_retried_from_freed_blocks() -> None:
    """A's stores are rejected while the tier is full of pending blocks; meanwhile the engine
    frees A's early window blocks and B reuses them. When room appears, A's re-offered window
    blocks are copied from B's blocks."""
    engine = FakeEngine(
        window_config(1),
        num_engine_blocks=[64, 16],
        num_host_blocks=16,
        delay=lambda job, w: None if job.req_id == "x" else 0,
    )
    engine.add_request(make_tokens(33, 1), max_tokens=1, req_id="x")  # 16 pending keys: tier full
    engine.step()
    a = engine.add_request(make_tokens(16, 2), max_tokens=10, req_id="a")
    engine.step()  # a's 8 keys: prepare_store answers None
    assert engine.connector.stats()["rejected_stores"] == 1
    engine.add_request(make_tokens(20, 3), max_tokens=4, req_id="b")
    engine.step()
    engine.executor.complete()  # room appears: a's blocks are offered again
    engine.run_until(lambda: a.status == FINISHED)
    engine.run()
    engine.check_drained()

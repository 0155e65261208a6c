"""The engine with its store path bounded: shedding forced (bounds of 0 and 1) and transfers
reported late (:func:`~engine_cases.delay_completions`, so the store path falls behind step for
step, whatever the machine's timing). Outputs stay identical to a run without offloading, shed
stores are counted (stats and ``/metrics``, per tier), and no load is ever lost to a shed store:
a shed block is simply not offloaded."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from engine_cases import (
    BLOCK_SIZE,
    assert_quiescent,
    assert_same_outputs,
    cycling_rounds,
    delay_completions,
    greedy,
    host_gib,
    one_thread,  # noqa: F401  (autouse fixture)
    random_tokens,
    reference_outputs,
    run_rounds,
    tiny_engine,
)

from kvoffload.engine import Engine

ROUNDS = cycling_rounds(num_prefixes=6, prefix_blocks=6, num_rounds=3)
SAMPLING = greedy(max_tokens=4)
#: The tiny preset's file per offloaded block on disk, and the ledger (test_engine_disk.py).
FILE, LEDGER = 8192, 4096


@pytest.fixture(scope="module")
def reference() -> list:
    return reference_outputs([p for r in ROUNDS for p in r], SAMPLING)


def _engine(path: Path, **bounds: Any) -> Engine:
    """Device cache for fewer than all prefixes, host and disk tiers; requests wait for their
    promotions within their lookup however slow the disk is (never timing-dependent)."""
    return tiny_engine(
        num_device_blocks=40,
        kv_offloading_size=host_gib(16),
        kv_disk_path=str(path),
        kv_disk_size=(LEDGER + 200 * FILE) / 2**30,
        kv_lookup_retry_s=600.0,
        kv_promotion_wait_s=60.0,
        **bounds,
    )


def _shed(engine: Engine, tier: str) -> float:
    value = engine.metrics.registry.get_sample_value(
        "kvoffload_tier_shed_store_blocks_total", {"tier": tier}
    )
    assert value is not None, f"no shed series for {tier}"
    return value


@pytest.mark.parametrize(
    ("store_bound", "write_bound"),
    [(0, 0), (1, 1), (1, 0), (4, 1), (None, 0)],
    ids=["none-none", "1-1", "1-none", "4-1", "default-none"],
)
def test_outputs_are_identical_with_shedding_forced(
    tmp_path: Path, reference: list, store_bound: int | None, write_bound: int
) -> None:
    """Every job is reported two steps late: stores fall behind, and offers past the bound are
    shed. Bound 0 stores nothing (host) or writes nothing (disk); every shed block is counted
    in stats and in ``/metrics`` under its tier; no load fails."""
    with _engine(
        tmp_path, kv_store_max_in_flight=store_bound, kv_tier_write_max_in_flight=write_bound
    ) as engine:
        delay_completions(engine, lambda _job: 2)
        outputs = [o for r in run_rounds(engine, ROUNDS, SAMPLING) for o in r]
        stats = engine.stats()
        host_shed, disk_shed = _shed(engine, "host"), _shed(engine, "disk")
        assert_quiescent(engine)
    assert_same_outputs(outputs, reference)
    assert stats["offload_failed_loads"] == 0  # a shed store never loses a load
    assert host_shed == stats["offload_shed_store_blocks"]
    assert disk_shed == stats["offload_tier_disk_shed_store_blocks"]
    if store_bound in (0, 1):
        assert host_shed > 0
    if store_bound == 0:
        assert stats["offload_stored_blocks"] == stats["offload_loaded_blocks"] == 0
    if write_bound == 0:
        assert stats["offload_tier_disk_stored_blocks"] == 0
        assert disk_shed == stats["offload_tier_stored_blocks"]  # every host block, once
        assert disk_shed > 0 or store_bound == 0


def test_shed_stores_never_lose_a_load(tmp_path: Path) -> None:
    """Every job is reported three steps late; the store path is behind once two blocks of
    earlier steps are in flight. A's 6-block prompt is stored whole (nothing was behind). Then
    B is prefilled (its 6 stores in flight for three steps) and A and C come: A loads its six
    blocks while C's stores are shed (the path is behind). Nothing fails, and the outputs are
    those of no offloading."""
    rng = random.Random(7)
    a, b, c = (random_tokens(rng, 6 * BLOCK_SIZE + 1) for _ in range(3))
    with tiny_engine(
        num_device_blocks=40, kv_offloading_size=host_gib(32), kv_store_max_in_flight=2
    ) as engine:
        delay_completions(engine, lambda _job: 3)
        outs = engine.generate([a], greedy(2))
        engine.drain()
        assert engine.stats()["offload_stored_blocks"] == 6
        engine.pool.reset_prefix_cache()
        ids = [engine.add_request(b, greedy(2))]
        done = {o.request_id: o for o in engine.step()}  # B's prefill: 6 stores in flight
        ids += [engine.add_request(p, greedy(2)) for p in (a, c)]
        for _ in range(200):
            if len(done) == 3:
                break
            done.update((o.request_id, o) for o in engine.step())
        outs += [done[i] for i in ids]
        stats = engine.stats()
        assert_quiescent(engine)
    assert outs[2].cached_tokens_offload == 6 * BLOCK_SIZE  # A again: its whole prefix loaded
    assert stats["offload_failed_loads"] == 0
    assert stats["offload_loaded_blocks"] == 6
    assert stats["offload_shed_store_blocks"] >= 6  # C's prompt
    assert_same_outputs(outs, reference_outputs([a, b, a, c], greedy(2)))


def test_write_through_only_what_was_reused(tmp_path: Path, reference: list) -> None:
    """``kv_tier_write_min_reuse=2``: a prefix reaches the disk only once a second request saw
    it. Round 1 writes nothing (each prefix seen once); later rounds write the reused prefixes,
    never the prompts' unique tails; outputs are unchanged."""
    with _engine(tmp_path, kv_tier_write_min_reuse=2) as engine:
        outputs = run_rounds(engine, ROUNDS[:1], SAMPLING)[0]
        assert engine.stats()["offload_tier_disk_stored_blocks"] == 0
        outputs += [o for r in run_rounds(engine, ROUNDS[1:], SAMPLING) for o in r]
        stats = engine.stats()
        assert_quiescent(engine)
    assert_same_outputs(outputs, reference)
    assert stats["offload_tier_disk_stored_blocks"] > 0
    assert stats["offload_tier_skipped_cascade_blocks"] > 0

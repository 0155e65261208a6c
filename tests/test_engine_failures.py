"""Transfers that fail inside the real worker still give the right tokens: a failed load is
recomputed, a failed store leaves its blocks not offloaded. Failures are injected with the worker's
own hook (:class:`FaultInjectingHandler` around the real copy handler), so they travel the real
path: refused at submission, reported as a failed ``TransferResult``, applied by the connector."""

from __future__ import annotations

from collections.abc import Callable

import pytest
from engine_cases import (
    assert_quiescent,
    assert_same_outputs,
    backing_manager,
    cycling_rounds,
    delay_completions,
    greedy,
    host_gib,
    one_thread,  # noqa: F401 - autouse fixture
    reference_outputs,
    run_rounds,
    tiny_engine,
)

from kvoffload.engine import Engine
from kvoffload.keys import make_offload_key
from kvoffload.manager_contract import LookupResult, ReqContext
from kvoffload.worker import FaultInjectingHandler

ROUNDS = cycling_rounds(num_prefixes=4, prefix_blocks=6, num_rounds=3, seed=7)
FLAT = [p for r in ROUNDS for p in r]
CYCLING = {"num_device_blocks": 24, "max_num_seqs": 2, "kv_offloading_size": host_gib(64)}
PREFIX_TOKENS = 6 * 4  # what a request can take from the device cache or load, at most


@pytest.fixture(scope="module")
def reference() -> list:
    return reference_outputs(FLAT, greedy())


def _inject(
    engine: Engine, direction: tuple[str, str], fail: Callable[[int], bool]
) -> FaultInjectingHandler:
    """Route ``direction``'s jobs through a handler that fails those ``fail`` selects."""
    assert engine.worker is not None
    router = engine.worker.offloading_worker
    handler = FaultInjectingHandler(router.handler(*direction), fail)
    router.register_handler(*direction, handler, replace=True)
    return handler


@pytest.mark.parametrize("which", ["all", "every_other"])
def test_failed_loads_are_recomputed(reference: list, which: str) -> None:
    """Whether a later request loads depends on when earlier transfers completed (a finished
    request's device blocks are freed only once its stores landed, and the order they return to
    the free queue decides which prefixes the device cache still holds), so every job is
    reported two steps after its submission: the run is the same step for step on any machine.
    Requests are admitted in arrival order: ``cache_aware`` would run the requests whose prefix
    the device still holds first, and fewer would load."""
    fail = (lambda job_id: True) if which == "all" else (lambda job_id: job_id % 2 == 0)
    with tiny_engine(**CYCLING, scheduling_policy="fcfs") as engine:
        delay_completions(engine, lambda job_id: 2)
        injected = _inject(engine, ("CPU", "GPU"), fail)
        rounds = run_rounds(engine, ROUNDS, greedy())
        outputs = [o for r in rounds for o in r]
        assert_same_outputs(outputs, reference)
        stats = engine.stats()
        assert stats["offload_failed_loads"] == len(injected.injected) > 0
        assert stats["offload_failed_stores"] == 0
        assert stats["offload_tier_evicted_blocks"] == 0  # the host tier holds every prefix
        # Each later request whose prefix is not all in the device cache planned exactly one load
        # (here: all of them); the failed ones report no offload hit.
        later = [o for r in rounds[1:] for o in r]
        loading = [o for o in later if o.cached_tokens_engine < PREFIX_TOKENS]
        assert len(loading) == len(later)
        assert stats["offload_load_jobs"] == len(loading)
        assert sum(o.cached_tokens_offload == 0 for o in loading) == stats["offload_failed_loads"]
        if which == "every_other":
            assert any(o.cached_tokens_offload > 0 for o in later)
        else:
            assert all(o.cached_tokens_offload == 0 for o in later)
        worker_stats = engine.worker.stats()  # type: ignore[union-attr]
        assert worker_stats["CPU_to_GPU_failed_jobs"] == len(injected.injected)
        assert_quiescent(engine)  # failed loads unpinned their tier blocks


@pytest.mark.parametrize("which", ["all", "every_other"])
def test_failed_stores_are_not_offloaded(reference: list, which: str) -> None:
    fail = (lambda job_id: True) if which == "all" else (lambda job_id: job_id % 2 == 0)
    with tiny_engine(**CYCLING) as engine:
        injected = _inject(engine, ("GPU", "CPU"), fail)
        rounds = run_rounds(engine, ROUNDS, greedy())
        assert_same_outputs([o for r in rounds for o in r], reference)
        stats = engine.stats()
        assert stats["offload_failed_stores"] == len(injected.injected) > 0
        assert stats["offload_failed_loads"] == 0
        manager = backing_manager(engine)
        tier = manager.stats()
        held = dict(manager.items())
        assert tier["failed_store_blocks"] > 0
        assert len(held) == tier["stored_blocks"]  # only successful stores are held
        # No block of a failed store is found: a lookup of every prompt block is HIT or MISS,
        # and the MISSes are exactly the blocks no successful store wrote.
        ctx = ReqContext("probe")
        for prompt in FLAT:
            for h in engine.hasher.hash_blocks(prompt):
                key = make_offload_key(h)
                found = manager.lookup(key, ctx)
                assert found is (LookupResult.HIT if key in held else LookupResult.MISS)
        if which == "all":
            assert not held
            assert all(o.cached_tokens_offload == 0 for r in rounds for o in r)
        assert_quiescent(engine)

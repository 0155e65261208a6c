"""Scheduler side, request lifecycles: preemption and re-admission, aborts during loads, the
order of ``request_finished`` relative to every other manager call, and ``reset()`` with jobs in
flight.

Every test runs the real connector and CPU manager inside :class:`fake_engine.FakeEngine`, which
also asserts that no block used by an unfinished transfer is reallocated or overwritten.
"""

from __future__ import annotations

import pytest
from fake_engine import (
    FINISHED,
    LOADING,
    RUNNING,
    WAITING,
    FakeEngine,
    RecordingManager,
    make_tokens,
    single_group,
)

from kvoffload import LookupResult, ReqContext


def test_preemption_flushes_in_flight_stores_and_the_request_reloads() -> None:
    """B is preempted while its stores are in flight: they are listed in ``jobs_to_flush`` of that
    very step (its blocks go to A in the same step). Re-admitted after A, B finds its prefix in
    the tier, loads it and finishes with correct KV."""
    engine = FakeEngine(single_group(4), num_engine_blocks=16, store_delay=None)
    a = engine.add_request(make_tokens(17, 1), max_tokens=30, req_id="a")
    b = engine.add_request(make_tokens(33, 2), max_tokens=30, req_id="b")
    engine.step()  # 5 + 9 of 16 blocks; both requests' stores stay in flight
    engine.run_until(lambda: b.num_preemptions > 0)
    record = engine.history[-1]
    assert record.output.preempted_req_ids == ["b"]
    b_jobs = {job.job_id for job in engine.executor.jobs("b", stores=True)}
    assert b_jobs and b_jobs <= set(record.meta.jobs_to_flush)
    assert b_jobs <= set(engine.executor.flushed)
    assert not engine.executor.pending.keys() & b_jobs

    engine.run_until(lambda: a.status == FINISHED)
    engine.executor.complete()  # a's stores: a's blocks are kept until they finish
    engine.run_until(lambda: b.status != WAITING)
    readmission = engine.lookup_of("b")[-1]
    assert (readmission.external or 0) > 0, "b's flushed stores made its prefix loadable"
    engine.executor.complete()
    engine.run_until(lambda: b.status == FINISHED)
    engine.executor.complete()
    engine.run()
    engine.check_drained()


def test_abort_during_load_keeps_blocks_until_the_load_completes() -> None:
    """Aborted while its load runs, B's blocks stay allocated (the load still writes them) until
    the load completes; then the connector frees B, once, and nothing leaks."""
    engine = FakeEngine(single_group(4), load_delay=None)
    manager = engine.manager
    assert isinstance(manager, RecordingManager)
    prompt = make_tokens(33, 1)
    engine.add_request(prompt, max_tokens=1)
    engine.run()
    engine.drop_prefix_cache()
    b = engine.add_request([*prompt, 4], max_tokens=3, req_id="b")
    engine.step()
    assert b.status == LOADING
    held = list(b.block_table[0])
    engine.abort("b")
    assert "b" in engine.delayed_free, "the load still writes b's blocks: the engine must keep them"
    for _ in range(3):
        engine.step()
        assert all(engine.pools[0].ref[bid] == 1 for bid in held)
    engine.executor.complete()
    record = engine.step()
    assert "b" in record.update.freed
    assert len(manager.of("request_finished", "b")) == 1
    engine.run()
    engine.check_drained()


def test_request_finished_is_the_last_call_for_a_request() -> None:
    """Over a mixed run (on_finish stores, aborts while waiting, loading and running, preemption,
    delayed transfers): for every request, ``OffloadingManager.request_finished`` is called
    exactly once, after its last lookup/prepare_load/prepare_store/touch, and every job the worker
    got corresponds to one prepare_load or non-empty prepare_store."""
    engine = FakeEngine(
        single_group(4, 2),
        num_engine_blocks=24,
        num_host_blocks=24,
        token_budget=16,
        delay=lambda job, w: 1 + job.job_id % 3,
    )
    manager = engine.manager
    assert isinstance(manager, RecordingManager)
    shared = make_tokens(24, 1)
    engine.add_request([*shared, 1], max_tokens=2)
    engine.run()
    engine.drop_prefix_cache()
    reqs = [
        engine.add_request(
            shared + make_tokens(6 + i, 10 + i),
            max_tokens=3 + i % 4,
            kv_transfer_params={"store_policy": "on_finish"} if i % 3 == 0 else None,
        )
        for i in range(8)
    ]
    engine.step()
    assert (reqs[0].status, reqs[7].status) == (LOADING, WAITING)
    engine.abort(reqs[0].request_id)
    engine.abort(reqs[7].request_id)  # never looked up
    for _ in range(3):
        engine.step()
    running_with_store = reqs[2]
    assert running_with_store.status == RUNNING
    assert any(
        p.job.req_id == running_with_store.request_id for p in engine.executor.pending.values()
    )
    engine.abort(running_with_store.request_id)
    engine.run()
    engine.check_drained()
    assert any(r.num_preemptions for r in reqs), "the scenario is meant to preempt"

    per_request = {"prepare_load", "prepare_store", "lookup", "touch"}
    for req in engine.requests.values():
        calls = [(i, c) for i, c in enumerate(manager.calls) if c.req_id == req.request_id]
        finished = [i for i, c in calls if c.method == "request_finished"]
        if not calls:  # aborted before its first lookup: the manager never saw it
            continue
        assert len(finished) == 1, (
            f"{req.request_id}: request_finished called {len(finished)} times"
        )
        late = [c.method for i, c in calls if i > finished[0] and c.method in per_request]
        assert not late, f"{req.request_id}: {late} after request_finished"
        jobs = engine.executor.jobs(req.request_id)
        planned = [c for _, c in calls if c.method == "prepare_load"] + [
            c
            for _, c in calls
            if c.method == "prepare_store" and c.result is not None and c.result.keys_to_store
        ]
        assert len(jobs) == len(planned), (
            f"{req.request_id}: {len(jobs)} jobs for {len(planned)} prepared transfers"
        )


def test_reset_with_jobs_in_flight() -> None:
    """``reset()`` while A's store and B's load are in flight: the tier is empty at once; next step
    both jobs are flushed before anything else touches the tier; A's stale store completion does
    not make A's re-offered (pending) blocks readable; B fails over to recompute."""
    engine = FakeEngine(
        single_group(4), num_host_blocks=16, delay=lambda job, w: 0 if job.req_id == "x" else None
    )
    prefix = make_tokens(16, 1)
    engine.add_request([*prefix, 1], max_tokens=1, req_id="x")
    engine.run()
    engine.drop_prefix_cache()
    a = engine.add_request(make_tokens(13, 2), max_tokens=10, req_id="a")
    b = engine.add_request([*prefix, 2], max_tokens=2, req_id="b")
    engine.step()
    assert b.status == LOADING
    (a_store,) = engine.executor.jobs("a", stores=True)
    (b_load,) = engine.executor.jobs("b", stores=False)
    a_keys = [engine.offload_key(a, i) for i in range(3)]

    engine.connector.reset()
    assert engine.manager.stats()["used_blocks"] == 0
    probe = ReqContext("probe")
    assert all(engine.manager.lookup(k, probe) is LookupResult.MISS for k in a_keys)
    record = engine.step()
    assert {a_store.job_id, b_load.job_id} <= set(record.meta.jobs_to_flush)
    assert "b" in record.update.failed_loads
    # a's blocks were offered again after the reset (new pending store); the stale completion of
    # the old store must not have made them readable before the new store wrote them.
    assert [engine.manager.lookup(k, probe) for k in a_keys] == [LookupResult.HIT_PENDING] * 3
    engine.executor.complete()
    engine.run_until(lambda: a.status == FINISHED and b.status == FINISHED)
    engine.executor.complete()
    engine.run()
    assert set(a_keys) <= engine.ready_keys()
    engine.check_drained()


@pytest.mark.parametrize("resets", [1, 2])
def test_reset_drops_jobs_planned_but_not_yet_handed_over(resets: int) -> None:
    """Regression: ``request_finished`` of an ``on_finish`` request plans its store for the next
    step; a ``reset()`` in between (or two) must drop that job (its host slots belong to the
    emptied tier), neither hand it to the worker nor ask to flush it, and still release the
    request's blocks."""
    engine = FakeEngine(single_group(4, store_policy="on_finish"), num_host_blocks=8)
    a = engine.add_request(make_tokens(20, 1), max_tokens=2, req_id="a")
    engine.run_until(lambda: a.status == FINISHED)
    assert "a" in engine.delayed_free
    for _ in range(resets):
        engine.connector.reset()
    b = engine.add_request(make_tokens(20, 2), max_tokens=1, req_id="b")
    for _ in range(3):
        record = engine.step()
        assert not [j for j in record.meta.store_jobs if j.req_id == "a"], (
            "a stale job reached the worker"
        )
    assert "a" not in engine.delayed_free
    engine.run()
    assert b.status == FINISHED
    engine.check_drained()

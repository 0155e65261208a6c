"""Scheduler side, injected transfer failures: failed loads fall back to recompute, failed stores
leave nothing readable, a job completes only when every worker reported it, and a hit that
vanishes before its load is planned turns into a recompute.

A failing worker writes garbage into its shard of the destination; the harness's oracle checks
every worker's shard, so any garbage the engine or the tier kept would fail the test.
"""

from __future__ import annotations

import pytest
from fake_engine import FINISHED, LOADING, RUNNING, FakeEngine, make_tokens, single_group

from kvoffload import LookupResult, ReqContext
from kvoffload.scheduler import SchedulerOutput
from kvoffload.transfer import TransferJob

# (workers, failing workers)
WORKER_CASES = [(1, {0}), (2, {1}), (2, {0, 1})]


def offloaded_prefix(engine: FakeEngine, n_tokens: int = 33) -> list[int]:
    prompt = make_tokens(n_tokens, 1)
    engine.add_request(prompt, max_tokens=1, req_id="a")
    engine.run()
    engine.drop_prefix_cache()
    return prompt


@pytest.mark.parametrize(("workers", "failing"), WORKER_CASES)
def test_failed_load_recomputes(workers: int, failing: set[int]) -> None:
    def fail(job: TransferJob, worker: int) -> bool:
        return not job.is_store and job.req_id == "b" and worker in failing

    engine = FakeEngine(single_group(4, 2, num_workers=workers), fail=fail)
    prompt = offloaded_prefix(engine)
    b = engine.add_request([*prompt, 3], max_tokens=4, req_id="b")
    engine.run()
    assert engine.lookup_of("b")[0].external == 32
    assert engine.failed_load_reqs == ["b"]
    assert {w for _, w in engine.executor.failed_parts} == failing
    stats = engine.connector.stats()
    assert stats["failed_loads"] == 1
    assert stats["load_jobs"] == 1 and stats["loaded_blocks"] == 0  # blocks that did load
    assert b.status == FINISHED and len(b.output_token_ids) == 4
    engine.check_drained()


@pytest.mark.parametrize(("workers", "failing"), WORKER_CASES)
def test_failed_store_leaves_nothing_in_the_tier(workers: int, failing: set[int]) -> None:
    def fail(job: TransferJob, worker: int) -> bool:
        return job.is_store and job.req_id == "a" and worker in failing

    engine = FakeEngine(single_group(4, 2, num_workers=workers), fail=fail)
    prompt = offloaded_prefix(engine)
    probe = ReqContext("probe")
    a_keys = [engine.offload_key(engine.requests["a"], i) for i in range(4)]
    assert [engine.manager.lookup(k, probe) for k in a_keys] == [LookupResult.MISS] * 4
    assert engine.manager.stats()["used_blocks"] == 0
    b = engine.add_request([*prompt, 3], max_tokens=2, req_id="b")
    engine.run()
    assert engine.lookup_of("b")[0].external == 0, "nothing to load: b recomputes"
    assert not engine.executor.jobs("b", stores=False)
    assert b.status == FINISHED
    assert set(a_keys) <= engine.ready_keys(), "b's own stores offload the prefix"
    engine.check_drained()
    # Blocks that were stored, as the tier counts them: a's failed stores are not among them.
    stats = engine.connector.stats()
    assert stats["failed_stores"] >= 1
    assert stats["stored_blocks"] == stats["tier_stored_blocks"] == len(engine.ready_keys())


def test_load_completes_only_when_every_worker_reported() -> None:
    """Worker 0 finishes b's load at once, worker 1 two steps later: b stays waiting until both
    reported, then runs."""
    engine = FakeEngine(
        single_group(4, num_workers=2), delay=lambda job, w: 0 if job.is_store or w == 0 else 2
    )
    prompt = offloaded_prefix(engine)
    b = engine.add_request([*prompt, 3], max_tokens=1, req_id="b")
    for _ in range(2):  # submitted in the first; worker 0 reported at its end, worker 1 not yet
        record = engine.step()
        assert not record.update.loaded and b.status == LOADING
        assert engine.connector.stats()["jobs_in_flight"] == 1
    record = engine.step()
    assert record.update.loaded == ["b"]
    assert b.status == RUNNING
    engine.run()
    engine.check_drained()


def test_hit_that_vanishes_before_the_load_is_planned_is_recomputed() -> None:
    """The tier loses the hit between lookup and allocation: ``update_state_after_alloc`` plans no
    load and reports the request in ``failed_loads`` at the next update."""
    engine = FakeEngine(single_group(4))
    prompt = offloaded_prefix(engine)
    b = engine.add_request([*prompt, 3], max_tokens=1, req_id="b")
    connector = engine.connector
    external, load_async = connector.get_num_new_matched_tokens(b, 0)
    assert (external, load_async) == (32, True) and external is not None
    engine.manager.reset()  # the tier forgets everything
    connector.update_state_after_alloc(b, [list(range(9))], external)
    assert connector.build_connector_meta(SchedulerOutput()).load_jobs == []
    update = connector.update_connector_output([])
    assert update.failed_loads == ["b"]
    assert connector.request_finished(b) == (False, None)
    assert connector.stats()["live_requests"] == 0
    assert not connector.has_pending_jobs()

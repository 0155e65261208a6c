"""OffloadingConnectorWorker: the engine-step protocol, lifecycle, failures and shutdown."""

from __future__ import annotations

import logging

import pytest
import torch
from worker_cases import HANDLERS, HOST_POISON, finish, make_cache, make_worker

from kvoffload.errors import ContractError
from kvoffload.load_store_specs import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.transfer import ConnectorMetadata, TransferJob
from kvoffload.worker import FaultInjectingHandler, OffloadingConnectorWorker, WorkerState

FACTOR = 2


def store_job(job_id: int, blocks: list[int], slots: list[int]) -> TransferJob:
    return TransferJob(
        job_id,
        f"req-{job_id}",
        GPULoadStoreSpec(blocks, [len(blocks)], [0]),
        CPULoadStoreSpec(slots),
    )


def load_job(job_id: int, slots: list[int], blocks: list[int]) -> TransferJob:
    return TransferJob(
        job_id,
        f"req-{job_id}",
        CPULoadStoreSpec(slots),
        GPULoadStoreSpec(blocks, [len(blocks)], [0]),
    )


def slot_bytes_of(worker, slot: int) -> torch.Tensor:
    return worker.host_pool.slots[slot].cpu()


@pytest.fixture
def cpu_worker():
    cache = make_cache("cross_layer", num_blocks=64)
    cache.randomize(1)
    worker = make_worker(cache, FACTOR, num_slots=32)
    worker.host_pool.buffer.fill_(HOST_POISON)
    yield cache, worker
    worker.shutdown()


# -- the step protocol ------------------------------------------------------------------------------


@pytest.mark.parametrize("defer", [False, True])
@pytest.mark.parametrize(("device", "torch_copies"), HANDLERS)
def test_a_store_reads_the_kv_written_by_its_steps_forward_pass(device, torch_copies, defer):
    cache = make_cache("cross_layer", device, num_blocks=16)
    with make_worker(
        cache, FACTOR, num_slots=4, use_torch_copies=torch_copies, defer_stores=defer
    ) as worker:
        worker.host_pool.buffer.fill_(HOST_POISON)
        worker.handle_preemptions([])
        worker.start_load_kv(ConnectorMetadata(store_jobs=[store_job(1, [4, 5], [2])]))
        worker.offloading_worker.wait([1], timeout=5)  # not submitted: returns at once
        assert torch.all(slot_bytes_of(worker, 2) == HOST_POISON), (
            "store started before the forward pass"
        )
        cache.tensors[0][4:6].fill_(3.0)  # the forward pass writes the KV
        worker.wait_for_save()
        assert worker.defer_stores is defer
        if defer:
            worker.offloading_worker.wait([1], timeout=5)
            assert torch.all(slot_bytes_of(worker, 2) == HOST_POISON), (
                "a deferred store ran before the next step"
            )
            worker.start_load_kv(ConnectorMetadata())
            worker.wait_for_save()
        assert finish(worker, [1])[1].success
        assert torch.equal(
            worker.host_pool.slots[2].cpu().view(torch.bfloat16),
            torch.full((worker.bytes_per_offloaded_block // 2,), 3.0, dtype=torch.bfloat16),
        )


def test_deferral_defaults_to_cuda_only(cpu_worker):
    _, worker = cpu_worker
    assert worker.defer_stores is False


def test_handle_preemptions_submits_deferred_stores_and_blocks_until_done():
    cache = make_cache("cross_layer", num_blocks=64)
    cache.randomize(2)
    with make_worker(cache, FACTOR, num_slots=32, defer_stores=True) as worker:
        jobs = [store_job(i, [2 * i, 2 * i + 1], [i]) for i in range(1, 20)]
        worker.start_load_kv(ConnectorMetadata(store_jobs=jobs))
        worker.wait_for_save()
        worker.handle_preemptions([5, 7, 999])  # 999: unknown, ignored
        expected = torch.cat([cache.page(0, 10), cache.page(0, 11)])
        assert torch.equal(
            worker.host_pool.slots[5].cpu(), expected
        )  # done before any get_finished
        results = finish(worker, [j.job_id for j in jobs])
        assert all(r.success and r.direction == ("GPU", "CPU") for r in results.values())


def test_many_jobs_in_flight_are_each_reported_exactly_once(cpu_worker):
    cache, worker = cpu_worker
    stores = [store_job(i, [2 * i, 2 * i + 1], [i]) for i in range(30)]
    worker.start_load_kv(ConnectorMetadata(store_jobs=stores))
    worker.wait_for_save()
    finish(worker, [j.job_id for j in stores])
    expected = {i: torch.cat([cache.page(0, 2 * i), cache.page(0, 2 * i + 1)]) for i in range(30)}
    cache.poison_blocks(list(range(64)))
    loads = [load_job(100 + i, [i], [2 * (29 - i), 2 * (29 - i) + 1]) for i in range(30)]
    worker.start_load_kv(ConnectorMetadata(load_jobs=loads))
    worker.wait_for_save()
    results = finish(worker, [j.job_id for j in loads])
    assert all(
        r.success and r.num_bytes == worker.bytes_per_offloaded_block for r in results.values()
    )
    assert worker.get_finished() == []
    for i in range(30):
        got = torch.cat([cache.page(0, 2 * (29 - i)), cache.page(0, 2 * (29 - i) + 1)])
        assert torch.equal(got, expected[i])


def test_stats_count_jobs_bytes_and_failures(cpu_worker):
    _, worker = cpu_worker
    worker.start_load_kv(
        ConnectorMetadata(store_jobs=[store_job(1, [0, 1], [0]), store_job(2, [0, 1], [99])])
    )
    worker.wait_for_save()
    finish(worker, [1, 2])
    stats = worker.stats()
    assert stats["GPU_to_CPU_jobs"] == 2 and stats["GPU_to_CPU_failed_jobs"] == 1
    assert stats["GPU_to_CPU_bytes"] == worker.bytes_per_offloaded_block
    assert stats["GPU_to_CPU_seconds"] > 0


def test_start_load_kv_without_wait_for_save_is_a_contract_error(cpu_worker):
    _, worker = cpu_worker
    worker.start_load_kv(ConnectorMetadata(store_jobs=[store_job(1, [0, 1], [0])]))
    with pytest.raises(ContractError, match="wait_for_save"):
        worker.start_load_kv(ConnectorMetadata())


# -- failures ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        store_job(9, [0, 64], [3]),  # engine block out of range
        store_job(9, [0, 1], [32]),  # host slot out of range
        store_job(9, [0, 1, 2], [3, 4]),  # not whole offloaded blocks
        store_job(9, [0, 1], [3, 4]),  # slot count does not match
        store_job(9, [0, 1, 2, 3], [3, 3]),  # one slot written twice
        TransferJob(
            9, "r", GPULoadStoreSpec([0, 1], [2, 0], [0, 0]), CPULoadStoreSpec([3])
        ),  # two groups
        TransferJob(
            9, "r", GPULoadStoreSpec([0, 1], [2], [1]), CPULoadStoreSpec([3])
        ),  # store not aligned
        load_job(9, [3], [5, 5]),  # one engine block written twice
        TransferJob(
            9, "r", CPULoadStoreSpec([3]), CPULoadStoreSpec([4])
        ),  # no handler for CPU -> CPU
    ],
    ids=[
        "engine-range",
        "slot-range",
        "partial",
        "slot-count",
        "dup-slot",
        "groups",
        "unaligned",
        "dup-block",
        "media",
    ],
)
@pytest.mark.parametrize("torch_copies", [False, True])
def test_a_bad_job_fails_alone(torch_copies, bad, caplog):
    cache = make_cache("cross_layer", num_blocks=64)
    cache.randomize(4)
    before = cache.snapshot()
    with make_worker(cache, FACTOR, num_slots=32, use_torch_copies=torch_copies) as worker:
        worker.host_pool.buffer.fill_(HOST_POISON)
        good = [store_job(1, [10, 11], [1]), store_job(2, [20, 21], [2])]
        meta = ConnectorMetadata(
            store_jobs=[good[0], bad, good[1]] if bad.is_store else good,
            load_jobs=[] if bad.is_store else [bad],
        )
        with caplog.at_level(logging.WARNING, logger="kvoffload.worker"):
            worker.start_load_kv(meta)
            worker.wait_for_save()
            results = finish(worker, [1, 9, 2])
        assert not results[9].success and results[1].success and results[2].success
        assert "job 9" in caplog.text
        assert torch.equal(
            worker.host_pool.slots[1].cpu(), torch.cat([cache.page(0, 10), cache.page(0, 11)])
        )
        assert torch.equal(
            worker.host_pool.slots[2].cpu(), torch.cat([cache.page(0, 20), cache.page(0, 21)])
        )
        untouched = [s for s in range(32) if s not in (1, 2)]
        assert torch.all(worker.host_pool.slots[untouched] == HOST_POISON)
        assert all(torch.equal(a, b) for a, b in zip(before, cache.tensors, strict=True))


def test_a_handler_that_raises_fails_only_its_jobs(cpu_worker):
    cache, worker = cpu_worker
    router = worker.offloading_worker
    faulty = FaultInjectingHandler(router.handler("GPU", "CPU"), fail_job={2})
    router.register_handler("GPU", "CPU", faulty, replace=True)
    worker.start_load_kv(
        ConnectorMetadata(store_jobs=[store_job(i, [2 * i, 2 * i + 1], [i]) for i in (1, 2, 3)])
    )
    worker.wait_for_save()
    results = finish(worker, [1, 2, 3])
    assert faulty.injected == [2]
    assert [results[i].success for i in (1, 2, 3)] == [True, False, True]
    assert torch.all(worker.host_pool.slots[2] == HOST_POISON)
    assert torch.equal(
        worker.host_pool.slots[3].cpu(), torch.cat([cache.page(0, 6), cache.page(0, 7)])
    )


def test_a_broken_handler_fails_its_jobs_and_gets_no_more(cpu_worker):
    _, worker = cpu_worker
    router = worker.offloading_worker
    broken = FaultInjectingHandler(router.handler("GPU", "CPU"), fail_in_get_finished=True)
    router.register_handler("GPU", "CPU", broken, replace=True)
    worker.start_load_kv(ConnectorMetadata(store_jobs=[store_job(1, [0, 1], [0])]))
    worker.wait_for_save()
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [(1, False)]
    worker.start_load_kv(ConnectorMetadata(store_jobs=[store_job(2, [2, 3], [1])]))
    worker.wait_for_save()
    assert [(r.job_id, r.success) for r in worker.get_finished()] == [
        (2, False)
    ]  # no handler any more
    assert worker.shutdown() == []


# -- lifecycle and shutdown -------------------------------------------------------------------------


def _state(worker: OffloadingConnectorWorker) -> WorkerState:
    """``worker.state`` as read now (an ``assert worker.state is`` narrows it for mypy, which
    then takes a later check, after a call that changed the state, as impossible)."""
    return worker.state


def test_lifecycle_errors_name_the_state():
    worker = OffloadingConnectorWorker(1, 2**20)
    assert worker.state is WorkerState.CREATED
    with pytest.raises(RuntimeError, match="is created"):
        worker.start_load_kv(ConnectorMetadata())
    with pytest.raises(RuntimeError, match="register_kv_caches first"):
        _ = worker.num_host_blocks
    worker.register_kv_caches(make_cache("cross_layer").tensors)
    assert _state(worker) is WorkerState.RUNNING
    with pytest.raises(RuntimeError, match="is running: cannot register KV caches"):
        worker.register_kv_caches(make_cache("cross_layer").tensors)
    assert worker.shutdown() == []
    assert worker.shutdown() == []  # idempotent
    for call in (worker.get_finished, worker.wait_for_save, lambda: worker.handle_preemptions([1])):
        with pytest.raises(RuntimeError, match="is shut down"):
            call()


def test_shutdown_with_jobs_in_flight_reports_each_once_without_hanging():
    """8 MiB stores on one copy thread: shutdown finds most still queued and cancels them."""
    layers = [torch.zeros(256, 2**16, dtype=torch.uint8) for _ in range(8)]
    worker = OffloadingConnectorWorker(1, 256 * 8 * 2**16, num_copy_threads=1)
    worker.register_kv_caches(layers)
    stores = [
        store_job(i, list(range(i * 16, i * 16 + 16)), list(range(i * 16, i * 16 + 16)))
        for i in range(16)
    ]
    worker.start_load_kv(ConnectorMetadata(store_jobs=stores[:12]))
    worker.wait_for_save()
    worker.start_load_kv(ConnectorMetadata(store_jobs=stores[12:]))  # never saved: never started
    reported = {r.job_id: r.success for r in worker.get_finished()}
    final = worker.shutdown(timeout=10)
    for r in final:
        assert r.job_id not in reported, f"job {r.job_id} reported twice"
        reported[r.job_id] = r.success
    assert sorted(reported) == list(range(16))
    assert not any(reported[i] for i in range(12, 16))
    assert worker.state is WorkerState.SHUT_DOWN


def test_wait_for_any_returns_when_a_result_is_ready(cpu_worker):
    _, worker = cpu_worker
    assert worker.wait_for_any(timeout=0.5) is False  # nothing in flight: at once
    worker.start_load_kv(ConnectorMetadata(store_jobs=[store_job(1, [0, 1], [0])]))
    worker.wait_for_save()
    assert worker.num_in_flight == 1
    assert worker.wait_for_any(timeout=10) is True
    assert [r.job_id for r in worker.get_finished()] == [1]
    assert worker.num_in_flight == 0

"""OffloadingWorker routing and CPUCopyHandler behaviour, with a small real handler."""

from __future__ import annotations

import threading
from collections.abc import Collection

import pytest
import torch
from worker_cases import make_cache

from kvoffload.errors import ContractError, TransferError
from kvoffload.load_store_specs import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.transfer import TransferResult
from kvoffload.worker import (
    CPUCopyHandler,
    HostPool,
    KVCacheLayout,
    OffloadingHandler,
    OffloadingWorker,
    WorkerState,
)


class InstantHandler(OffloadingHandler):
    """Finishes every job at submission; refuses odd job ids when ``refuse_odd``."""

    def __init__(self, refuse_odd: bool = False) -> None:
        self.refuse_odd = refuse_odd
        self.done: list[TransferResult] = []
        self.shut = 0

    def transfer_async(self, job_id, spec):
        if self.refuse_odd and job_id % 2:
            return False
        self.done.append(TransferResult(job_id, True, 1, 0.0, (spec[0].medium, spec[1].medium)))
        return True

    def get_finished(self):
        done, self.done = self.done, []
        return done

    def wait(self, job_ids: Collection[int], timeout=None):
        pass

    def shutdown(self, timeout=None):
        self.shut += 1
        return self.get_finished()


STORE = (GPULoadStoreSpec([0], [1], [0]), CPULoadStoreSpec([0]))
LOAD = (CPULoadStoreSpec([0]), GPULoadStoreSpec([0], [1], [0]))


def test_routes_by_media_and_reports_once():
    worker = OffloadingWorker()
    stores, loads = InstantHandler(), InstantHandler()
    worker.register_handler("GPU", "CPU", stores)
    worker.register_handler("CPU", "GPU", loads)
    assert worker.transfer_async(1, STORE) and worker.transfer_async(2, LOAD)
    assert {(r.job_id, r.direction) for r in worker.get_finished()} == {
        (1, ("GPU", "CPU")),
        (2, ("CPU", "GPU")),
    }
    assert worker.get_finished() == []
    assert worker.handler("CPU", "GPU") is loads


def test_refused_and_unroutable_jobs_come_back_failed():
    worker = OffloadingWorker()
    worker.register_handler("GPU", "CPU", InstantHandler(refuse_odd=True))
    assert worker.transfer_async(2, STORE)
    assert not worker.transfer_async(3, STORE)
    assert not worker.transfer_async(4, LOAD)  # no CPU -> GPU handler
    results = {r.job_id: r.success for r in worker.get_finished()}
    assert results == {2: True, 3: False, 4: False}


def test_duplicate_job_ids_and_handlers_are_contract_errors():
    worker = OffloadingWorker()
    handler = InstantHandler(refuse_odd=True)
    worker.register_handler("GPU", "CPU", handler)
    with pytest.raises(ContractError):
        worker.register_handler("GPU", "CPU", handler)
    worker.register_handler("GPU", "CPU", handler, replace=True)
    worker.transfer_async(1, STORE)  # refused: its failure is pending
    with pytest.raises(ContractError, match="already in flight"):
        worker.transfer_async(1, STORE)


class BrokenHandler(InstantHandler):
    """Accepts jobs but never finishes them; its get_finished raises. Records when it was shut
    down relative to its jobs being reported."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[str] = []

    def transfer_async(self, job_id, spec):
        return True

    def get_finished(self):
        raise RuntimeError("copy engine lost")

    def shutdown(self, timeout=None):
        self.events.append("shutdown")
        return []


def test_a_broken_handler_is_stopped_before_its_jobs_are_reported_failed():
    """A failed job's host slots and engine blocks are reused at once, so the broken handler must
    have stopped its copies first."""
    worker = OffloadingWorker()
    broken, loads = BrokenHandler(), InstantHandler()
    worker.register_handler("GPU", "CPU", broken)
    worker.register_handler("CPU", "GPU", loads)
    assert worker.transfer_async(1, STORE) and worker.transfer_async(2, LOAD)
    results = {r.job_id: r.success for r in worker.get_finished()}
    assert results == {1: False, 2: True}
    assert broken.events == ["shutdown"]
    assert not worker.transfer_async(3, STORE)  # nothing more is routed to it


def test_shutdown_is_idempotent_and_final():
    handler = InstantHandler()
    with OffloadingWorker() as worker:
        worker.register_handler("GPU", "CPU", handler)
        worker.register_handler("CPU", "GPU", handler)
        worker.transfer_async(1, STORE)
    assert worker.state is WorkerState.SHUT_DOWN and handler.shut == 1
    assert worker.shutdown() == []
    with pytest.raises(RuntimeError, match="shut down"):
        worker.transfer_async(2, STORE)
    with pytest.raises(RuntimeError, match="shut down"):
        worker.wait([1])


@pytest.fixture
def cpu_handler():
    cache = make_cache("cross_layer", num_blocks=16)
    layout = KVCacheLayout.from_kv_caches(cache.tensors, 2)
    handler = CPUCopyHandler(layout, HostPool(4, layout.slot_bytes), num_threads=2)
    yield cache, handler
    handler.shutdown()


def test_cpu_handler_rejects_other_spec_pairs_and_duplicates(cpu_handler):
    _, handler = cpu_handler
    with pytest.raises(ContractError, match="GPU <-> CPU"):
        handler.transfer_async(1, (CPULoadStoreSpec([0]), CPULoadStoreSpec([1])))
    spec = (GPULoadStoreSpec([0, 1], [2], [0]), CPULoadStoreSpec([0]))
    handler.transfer_async(1, spec)
    handler.wait([1], timeout=5)
    with pytest.raises(ContractError, match="already in flight"):
        handler.transfer_async(1, spec)  # finished but not reported yet
    assert [r.job_id for r in handler.get_finished()] == [1]
    assert handler.transfer_async(1, spec)  # reported: the id may be reused


def test_cpu_handler_needs_a_cpu_cache():
    layout = KVCacheLayout.from_kv_caches([torch.zeros(4, 8, device="meta")], 1)
    with pytest.raises(ContractError, match="CPU KV cache"):
        CPUCopyHandler(layout, HostPool(1, layout.slot_bytes))


def test_cpu_handler_after_shutdown(cpu_handler):
    _, handler = cpu_handler
    assert handler.shutdown() == []
    assert handler.state is WorkerState.SHUT_DOWN
    with pytest.raises(RuntimeError, match="shut down"):
        handler.transfer_async(1, (GPULoadStoreSpec([0, 1], [2], [0]), CPULoadStoreSpec([0])))


def test_fault_injection_raises_transfer_error():
    from kvoffload.worker import FaultInjectingHandler

    faulty = FaultInjectingHandler(InstantHandler(), fail_job=lambda j: j > 5)
    assert faulty.transfer_async(5, STORE)
    with pytest.raises(TransferError, match="job 6"):
        faulty.transfer_async(6, STORE)
    assert [r.job_id for r in faulty.get_finished()] == [5]


def test_cpu_handler_wait_times_out_then_completes():
    layers = [torch.zeros(64, 2**17, dtype=torch.uint8) for _ in range(8)]  # 64 MiB to copy
    layout = KVCacheLayout.from_kv_caches(layers, 1)
    handler = CPUCopyHandler(layout, HostPool(64, layout.slot_bytes), num_threads=1)
    try:
        handler.transfer_async(
            1, (GPULoadStoreSpec(list(range(64)), [64], [0]), CPULoadStoreSpec(list(range(64))))
        )
        with pytest.raises(TimeoutError, match="job 1"):
            handler.wait([1], timeout=0)
        handler.wait([1], timeout=30)
        (result,) = handler.get_finished()
        assert result.success and result.num_bytes == 64 * 8 * 2**17
    finally:
        handler.shutdown()


class GatedCPUCopyHandler(CPUCopyHandler):
    """The real handler; its copy thread holds the first job it picks up until ``gate`` opens
    (so that the jobs submitted meanwhile are queued behind it), and ``finished`` records the
    order in which jobs finish."""

    def __init__(self, *args, **kwargs) -> None:
        self.gate = threading.Event()
        self.picked = threading.Event()
        self.finished: list[int] = []
        super().__init__(*args, **kwargs)

    def _plan(self, job) -> None:
        if not self.picked.is_set():
            self.picked.set()
            self.gate.wait(timeout=60)
        super()._plan(job)

    def _finish(self, job) -> None:
        self.finished.append(job.job_id)
        super()._finish(job)


def test_cpu_handler_runs_a_load_before_the_stores_queued_ahead_of_it():
    """One copy thread, busy planning store 1; stores 2 and 3 are queued, then load 4 comes: the
    load runs as soon as the thread is free, before the stores queued ahead of it and even
    before store 1's copies (a waiting request needs it; a store only offloads)."""
    layers = [torch.zeros(8, 4096, dtype=torch.uint8) for _ in range(2)]
    layout = KVCacheLayout.from_kv_caches(layers, 1)
    handler = GatedCPUCopyHandler(layout, HostPool(8, layout.slot_bytes), num_threads=1)
    try:
        for job_id in (1, 2, 3):
            handler.transfer_async(
                job_id, (GPULoadStoreSpec([job_id], [1], [0]), CPULoadStoreSpec([job_id]))
            )
            if job_id == 1:
                assert handler.picked.wait(timeout=60)  # the thread holds store 1
        handler.transfer_async(4, (CPULoadStoreSpec([5]), GPULoadStoreSpec([5], [1], [0])))
        handler.gate.set()
        handler.wait([1, 2, 3, 4], timeout=60)
        assert handler.finished == [4, 1, 2, 3]
        assert all(r.success for r in handler.get_finished())
    finally:
        handler.gate.set()
        handler.shutdown()

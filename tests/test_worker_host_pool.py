"""Host pool sizing and allocation: exact sizes, clear errors."""

from __future__ import annotations

import pytest
import torch
from worker_cases import make_cache

from kvoffload.errors import ConfigError, HostAllocationError
from kvoffload.worker import HostPool, OffloadingConnectorWorker, num_host_blocks


def test_num_host_blocks_is_the_budget_divided_by_the_block():
    assert num_host_blocks(10 * 2**20, 2**20) == 10
    assert num_host_blocks(10 * 2**20 + 2**20 - 1, 2**20) == 10
    assert num_host_blocks(2**30, 3 * 2**20) == 341


def test_a_budget_below_one_block_is_a_config_error():
    with pytest.raises(ConfigError, match="do not hold one offloaded block") as info:
        num_host_blocks(2**20 - 1, 2**20)
    assert info.value.field == "kv_offloading_size"
    with pytest.raises(ConfigError):
        num_host_blocks(2**20, 0)


@pytest.mark.parametrize(
    ("num_slots", "slot_bytes"), [(1, 1), (7, 3000), (300, 4096), (5, 2**20 + 12)]
)
def test_allocated_bytes_equal_asked_bytes(num_slots, slot_bytes):
    """No power-of-two rounding (vLLM #53042): the storage is exactly slots x slot bytes."""
    pool = HostPool(num_slots, slot_bytes)
    assert pool.nbytes == num_slots * slot_bytes
    assert pool.buffer.untyped_storage().nbytes() == num_slots * slot_bytes
    assert pool.slots.shape == (num_slots, slot_bytes)
    assert pool.slots.data_ptr() == pool.buffer.data_ptr() == pool.address
    pool.close()


def test_impossible_size_raises_host_allocation_error_with_the_size():
    with pytest.raises(HostAllocationError, match=str(2**60)) as info:
        HostPool(2**30, 2**30)
    assert info.value.num_bytes == 2**60


def test_empty_pool_is_a_config_error():
    with pytest.raises(ConfigError):
        HostPool(0, 4096)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA error")
def test_pinning_without_cuda_is_a_host_allocation_error():
    with pytest.raises(HostAllocationError, match="needs CUDA"):
        HostPool(2, 4096, pin=True)


@pytest.mark.cuda
def test_pinned_pool_is_registered_exactly_and_unregistered_on_close():
    pool = HostPool(3, 2**20 + 4096, pin=True)
    assert pool.pinned and pool.buffer.is_pinned()
    assert pool.buffer.untyped_storage().nbytes() == 3 * (2**20 + 4096)
    pool.close()
    assert not pool.pinned and not pool.buffer.is_pinned()
    pool.close()  # idempotent


def test_connector_sizes_the_pool_from_the_budget():
    cache = make_cache("cross_layer")
    slot = 4 * 3 * 256  # factor x layers x page
    worker = OffloadingConnectorWorker(4, 10 * slot + slot // 2)
    worker.register_kv_caches(cache.tensors)
    assert worker.bytes_per_offloaded_block == slot
    assert worker.num_host_blocks == 10
    assert worker.host_pool.buffer.untyped_storage().nbytes() == 10 * slot
    worker.shutdown()


def test_connector_rejects_a_budget_below_one_block():
    worker = OffloadingConnectorWorker(4, 100)
    with pytest.raises(ConfigError, match="kv_offloading_size"):
        worker.register_kv_caches(make_cache("cross_layer").tensors)


def test_connector_reports_an_impossible_pool():
    worker = OffloadingConnectorWorker(1, 2**60)
    with pytest.raises(HostAllocationError):
        worker.register_kv_caches(make_cache("cross_layer").tensors)

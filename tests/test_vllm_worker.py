"""``KVOffloadSpec``'s worker side where vLLM's refuses to run (its CPU platform, or no platform):
our copy handler between a KV cache in CPU memory and vLLM's shared CPU pool, through vLLM's
``OffloadingWorker`` interface, and the pool unmapped cleanly at shutdown.

Byte-exact round trips for chunks of 2 blocks, loads that start in the middle of a chunk (the
head already on the engine), and the ``BufferError`` vLLM's cleanup logged while a tier still held
a view of the pool (fails on the code before the pool alias).
"""

from __future__ import annotations

import mmap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from vllm_cases import offloading_config, require_vllm, unique_engine_id, vllm_keys

require_vllm()

from vllm.v1.kv_offload.base import (  # noqa: E402
    CanonicalKVCacheRef,
    CanonicalKVCaches,
    CanonicalKVCacheTensor,
    GPULoadStoreSpec,
    ReqContext,
)
from vllm.v1.kv_offload.cpu.common import CPULoadStoreSpec  # noqa: E402
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion  # noqa: E402
from vllm.v1.kv_offload.factory import OffloadingSpecFactory  # noqa: E402

from kvoffload.integrations.vllm.manager import KVOffloadManager  # noqa: E402
from kvoffload.integrations.vllm.worker import KVOffloadCPUWorker  # noqa: E402

SPEC = {"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.integrations.vllm.spec"}
NUM_BLOCKS, PAGE, FACTOR, CHUNKS = 16, 1024, 2, 8


def kv_caches(seed: int) -> tuple[list[torch.Tensor], CanonicalKVCaches]:
    """Two layers' caches (num_blocks, page) in CPU memory, random bytes, one KV-cache group."""
    gen = torch.Generator().manual_seed(seed)
    layers = [
        torch.randint(-128, 128, (NUM_BLOCKS, PAGE), dtype=torch.int8, generator=gen)
        for _ in range(2)
    ]
    canonical = CanonicalKVCaches(
        tensors=[CanonicalKVCacheTensor(tensor=t, page_size_bytes=PAGE) for t in layers],
        group_data_refs=[[CanonicalKVCacheRef(0, PAGE), CanonicalKVCacheRef(1, PAGE)]],
    )
    return layers, canonical


def finish(worker: Any, job_ids: set[int], timeout_s: float = 30.0) -> dict[int, bool]:
    worker.wait(job_ids)
    done: dict[int, bool] = {}
    deadline = time.monotonic() + timeout_s
    while set(done) != job_ids and time.monotonic() < deadline:
        done.update((r.job_id, r.success) for r in worker.get_finished())
    return done


@pytest.fixture
def spec() -> Iterator[Any]:
    config = offloading_config(
        SPEC, num_chunks=CHUNKS, chunk_bytes=2 * PAGE, blocks_per_chunk=FACTOR
    )
    yield OffloadingSpecFactory.create_spec(config)


def test_store_then_load_moves_the_bytes_exactly(spec: Any) -> None:
    src_layers, src = kv_caches(seed=1)
    worker = spec.get_worker(src)
    assert isinstance(worker, KVOffloadCPUWorker)
    try:
        # blocks 4..7 (two chunks of two blocks) into chunks 5 and 2
        store = GPULoadStoreSpec([4, 5, 6, 7], group_sizes=[4], block_indices=[0])
        assert worker.submit_store(1, store, CPULoadStoreSpec([5, 2]))
        assert finish(worker, {1}) == {1: True}
        # into a fresh cache: all of chunk 5, then chunk 2 from its second block (the head is
        # already on the engine: block index 3 of the request, 3 % 2 = 1 block into the chunk)
        for layer in src_layers:
            layer.zero_()
        load = GPULoadStoreSpec([9, 10, 11], group_sizes=[3], block_indices=[1])
        assert worker.submit_load(2, CPULoadStoreSpec([5, 2]), load)
        assert finish(worker, {2}) == {2: True}
    finally:
        worker.shutdown()
    # chunk 5 = blocks 4, 5; chunk 2 = blocks 6, 7. A load from block index 1 skips block 4.
    expected = {9: 5, 10: 6, 11: 7}
    _, reference = kv_caches(seed=1)
    for layer, ref in zip(src_layers, reference.tensors, strict=True):
        for dst, orig in expected.items():
            assert torch.equal(layer[dst], ref.tensor[orig])
        untouched = [b for b in range(NUM_BLOCKS) if b not in expected]
        assert torch.count_nonzero(layer[untouched]) == 0


def test_bad_ids_fail_the_job_without_touching_memory(spec: Any) -> None:
    layers, caches = kv_caches(seed=2)
    snapshot = [t.clone() for t in layers]
    worker = spec.get_worker(caches)
    try:
        bad = GPULoadStoreSpec([0, NUM_BLOCKS + 5], group_sizes=[2], block_indices=[0])
        assert worker.submit_load(3, CPULoadStoreSpec([0]), bad)
        assert finish(worker, {3}) == {3: False}
    finally:
        worker.shutdown()
    assert all(torch.equal(a, b) for a, b in zip(layers, snapshot, strict=True))


def test_disk_tier_views_do_not_block_the_pools_unmapping(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """vLLM's cleanup closes its mmap; a view our disk tier derived from the pool used to keep
    it exported (``BufferError: cannot close exported pointers exist``, the mapping leaked)."""
    mappings: list[mmap.mmap] = []
    original = SharedOffloadRegion.cleanup

    def cleanup(self: SharedOffloadRegion) -> None:
        if self.mmap_obj is not None:
            mappings.append(self.mmap_obj)
        original(self)

    monkeypatch.setattr(SharedOffloadRegion, "cleanup", cleanup)
    tiers = [{"kind": "disk", "path": str(tmp_path / "kv"), "size_gib": 0.01}]
    config = offloading_config(
        {**SPEC, "kvoffload_tiers": tiers}, num_chunks=CHUNKS, engine_id=unique_engine_id()
    )
    manager = OffloadingSpecFactory.create_spec(config).get_manager()
    ctx = ReqContext(req_id="r")
    manager.on_new_request(ctx)
    keys = vllm_keys(3)
    out = manager.prepare_store(keys, ctx)
    assert out is not None and len(out.keys_to_store) == 3
    manager.complete_store(keys, ctx)
    deadline = time.monotonic() + 10
    while manager.has_pending_work() and time.monotonic() < deadline:
        manager.lookup(keys[0], ctx)  # the step's first call applies finished cascades
        manager.on_schedule_end(_step_end())
    assert isinstance(manager, KVOffloadManager)
    assert manager.inner.stats()["disk_stored_blocks"] == 3
    manager.shutdown()
    assert len(mappings) == 1 and mappings[0].closed


def _step_end() -> Any:
    from vllm.v1.kv_offload.base import ScheduleEndContext

    return ScheduleEndContext(new_req_ids=(), preempted_req_ids=())

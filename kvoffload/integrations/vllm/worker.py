"""The worker side of :class:`~kvoffload.integrations.vllm.spec.KVOffloadSpec` on vLLM's CPU
platform: :class:`KVOffloadCPUWorker`, a vLLM ``OffloadingWorker`` over our copy handler.

vLLM's own worker (``CPUOffloadingWorker``) copies with CUDA streams and refuses to start on the
CPU platform. Ours moves blocks between vLLM's CPU-resident KV cache and the spec's shared CPU
pool (the same ``SharedOffloadRegion`` the scheduler side and our tiers map) with
:class:`~kvoffload.worker.cpu_copy.CPUCopyHandler`: ``submit_*`` only queue a job (O(1) on the
engine thread); planning and ``memmove`` run on the handler's threads, off the engine thread;
``get_finished`` never blocks; ``wait`` blocks for the listed jobs (vLLM's fence before it reuses
a block a store still reads).

Layout of one chunk row of the pool, this worker's area (``rank * cpu_page_size`` onwards): our
:class:`~kvoffload.worker.layout.KVCacheLayout` of vLLM's canonical tensors, per KV-cache group
(a chunk holds one group's block: its key names the group), every page view's
``blocks_per_chunk`` pages back to back. Only this worker and our tiers (whole rows) read it.

Invariant: a block is only read from the pool after the job that wrote it was reported finished
(vLLM's scheduler completes the store before any load of the key), and a job accepted here is
reported exactly once, failed or not, never a failure as a success. vLLM (0.32 and 0.33) takes no
failed transfer: its ``OffloadingConnectorWorker.get_finished`` asserts ``success``, so a failed
job stops the engine with an ``AssertionError`` instead of letting a request read KV that was not
copied (docs/vllm.md, *Failed transfers*). Ours fail only on a malformed job; the failures of
real storage (a corrupt or vanished disk block, a dead Redis) happen in promotions on the
scheduler side, which answer ``MISS``, and the request recomputes.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from vllm.platforms import current_platform
from vllm.v1.kv_offload.base import (
    CanonicalKVCaches,
    GPULoadStoreSpec,
    LoadStoreSpec,
    OffloadingWorker,
    TransferResult,
)
from vllm.v1.kv_offload.cpu.shared_offload_region import SharedOffloadRegion

from kvoffload.errors import ConfigError
from kvoffload.integrations.vllm.engine_threads import give_back_core
from kvoffload.integrations.vllm.region import release_region
from kvoffload.load_store_specs import CPULoadStoreSpec as KVOCPUSpec
from kvoffload.load_store_specs import GPULoadStoreSpec as KVOGPUSpec
from kvoffload.worker.cpu_copy import CPUCopyHandler
from kvoffload.worker.layout import KVCacheLayout

__all__ = ["CPUPlatformWorker", "KVOffloadCPUWorker", "RegionSlots", "layout_of_canonical"]

logger = logging.getLogger(__name__)


class RegionSlots:
    """One worker's slots in a chunk-row region: slot ``s`` at ``address + s * slot_stride``,
    ``slot_bytes`` long (a :class:`~kvoffload.worker.host_pool.HostSlots`)."""

    def __init__(self, area: torch.Tensor) -> None:
        if area.dim() != 2 or area.stride(1) != 1 or area.element_size() != 1:
            raise ConfigError("region", f"expected a (chunks, bytes) byte view, got {area.shape}")
        self._area: torch.Tensor | None = area  # the mapping stays alive while copies run
        self.num_slots, self.slot_bytes = area.shape
        self.nbytes = (self.num_slots - 1) * area.stride(0) + self.slot_bytes
        self.address = area.data_ptr()
        self.slot_stride = area.stride(0)

    def release(self) -> None:
        """Drop the view (after the copies stopped), so that the mapping can be closed."""
        self._area = None


def layout_of_canonical(kv_caches: CanonicalKVCaches, blocks_per_chunk: int) -> KVCacheLayout:
    """Our layout of vLLM's canonical KV caches: each canonical tensor as one
    ``(num_blocks, page_size_bytes)`` byte view, grouped as vLLM groups them."""
    views = [
        t.tensor.view(torch.int8).view(-1, t.page_size_bytes).view(torch.uint8)
        for t in kv_caches.tensors
    ]
    num_blocks = {v.shape[0] for v in views}
    if len(num_blocks) != 1:
        raise ConfigError("kv_caches", f"canonical tensors disagree on block count: {num_blocks}")
    groups = [sorted({ref.tensor_idx for ref in refs}) for refs in kv_caches.group_data_refs]
    return KVCacheLayout.from_kv_caches(
        views, blocks_per_chunk, num_blocks=num_blocks.pop(), group_tensors=groups, block_dim=0
    )


def _gpu_spec(spec: GPULoadStoreSpec) -> KVOGPUSpec:
    return KVOGPUSpec(
        spec.block_ids.tolist(),
        [int(n) for n in spec.group_sizes],
        [int(i) for i in spec.block_indices],
    )


def _cpu_spec(spec: LoadStoreSpec) -> KVOCPUSpec:
    return KVOCPUSpec(spec.block_ids.tolist())  # type: ignore[attr-defined]


class KVOffloadCPUWorker(OffloadingWorker):
    """vLLM's ``OffloadingWorker`` contract over our :class:`CPUCopyHandler` (module docstring).

    ``area`` is this worker's ``(num_chunks, cpu_page_size)`` view of the shared region;
    ``release`` is called at :meth:`shutdown`, after the copy threads have stopped.
    """

    def __init__(
        self,
        kv_caches: CanonicalKVCaches,
        blocks_per_chunk: int,
        area: torch.Tensor,
        release: Any = None,
        num_threads: int = 2,
    ) -> None:
        self.layout = layout_of_canonical(kv_caches, blocks_per_chunk)
        self._slots = slots = RegionSlots(area)
        if self.layout.slot_bytes > slots.slot_bytes:
            raise ConfigError(
                "kv_caches",
                f"an offloaded block takes {self.layout.slot_bytes} bytes; the pool's per-worker "
                f"chunk holds {slots.slot_bytes}",
            )
        self._handler = CPUCopyHandler(self.layout, slots, num_threads=num_threads)
        self._release = release

    def submit_store(
        self, job_id: int, src_spec: GPULoadStoreSpec, dst_spec: LoadStoreSpec
    ) -> bool:
        return self._handler.transfer_async(job_id, (_gpu_spec(src_spec), _cpu_spec(dst_spec)))

    def submit_load(
        self,
        job_id: int,
        src_spec: LoadStoreSpec,
        dst_spec: GPULoadStoreSpec,
        expedited: bool = False,
    ) -> bool:
        # Our handler serves loads before stores already; an expedited load needs no more.
        return self._handler.transfer_async(job_id, (_cpu_spec(src_spec), _gpu_spec(dst_spec)))

    def get_finished(self) -> list[TransferResult]:
        return [
            TransferResult(
                job_id=r.job_id,
                success=r.success,
                transfer_size=r.num_bytes,
                transfer_time=r.seconds,
            )
            for r in self._handler.get_finished()
        ]

    def wait(self, job_ids: set[int]) -> None:
        self._handler.wait(job_ids)

    def shutdown(self) -> None:
        try:
            unreported = self._handler.shutdown()
            if unreported:
                logger.info("%d transfer jobs ended by shutdown", len(unreported))
        finally:
            self._slots.release()
            if self._release is not None:
                self._release()
                self._release = None


class CPUPlatformWorker:
    """Mixin for a spec derived from vLLM's ``TieringOffloadingSpec``: vLLM's worker where it
    runs (CUDA-alike, XPU), :class:`KVOffloadCPUWorker` on the same shared pool elsewhere (vLLM's
    CPU platform, where its own refuses to start). On the CPU platform, building the worker
    gives back the core vLLM's binding took for the connector where it left none for the
    scheduler (:mod:`~kvoffload.integrations.vllm.engine_threads`)."""

    def get_worker(self, kv_caches: CanonicalKVCaches) -> OffloadingWorker:
        if current_platform.is_cuda_alike() or current_platform.is_xpu():
            return super().get_worker(kv_caches)  # type: ignore[misc]
        spec: Any = self  # vLLM's spec holds the worker (typed as vLLM's own there)
        if spec._worker is None:
            spec._worker = self._build_cpu_worker(kv_caches)
        worker: OffloadingWorker = spec._worker
        return worker

    def _build_cpu_worker(self, kv_caches: CanonicalKVCaches) -> KVOffloadCPUWorker:
        spec: Any = self
        kept = give_back_core(spec.config.parallel.world_size)
        if kept is not None:
            logger.info(
                "vLLM's CPU binding left no core outside the OpenMP threads: this worker keeps %d "
                "(as without a KV connector), so they do not spin against the scheduler",
                kept,
            )
        rank = 0 if spec.replicated_layout else spec.config.parallel.rank
        region = SharedOffloadRegion(
            engine_id=spec.config.engine_id,
            num_chunks=spec.num_chunks,
            rank=rank,
            kv_bytes_per_chunk=spec.kv_bytes_per_chunk,
            cpu_page_size=spec.cpu_page_size_per_worker,
        )
        try:
            area = region.create_next_worker_view(spec.cpu_page_size_per_worker)
            return KVOffloadCPUWorker(
                kv_caches, spec.blocks_per_chunk, area, release=lambda: release_region(region)
            )
        except BaseException:
            area = None  # drop our view of the mapping before cleanup closes it
            release_region(region)
            raise

"""The worker side of the offloading connector: runs the scheduler's transfer jobs each engine step.

Engine step order::

    handle_preemptions(meta.jobs_to_flush)   # before the forward pass may overwrite their sources
    start_load_kv(meta)                      # stores deferred from the last step, then this step's loads
    <forward pass>                           # writes the KV that this step's store jobs read
    wait_for_save()                          # this step's stores: submitted now (CPU) or deferred (CUDA)
    get_finished()                           # results since the last call, each job exactly once

Invariant: a store job is never submitted before the forward pass of the step whose metadata
carried it has run, i.e. before :meth:`wait_for_save` of that step; on CUDA its copy additionally
waits on the engine's stream, so it reads what the forward pass wrote.

Store deferral: on CUDA, stores are submitted at the next :meth:`start_load_kv` (as vLLM does), so
their device->host traffic starts after the step's sampling transfers. On a CPU engine there are no
such transfers to protect, and the copy threads compete with the engine for cores in either case,
so stores are submitted at :meth:`wait_for_save` by default: they finish a step earlier, which
shortens the time blocks stay pending (``HIT_PENDING``) and the time a preemption has to wait for.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

import torch

from kvoffload.errors import ConfigError, ContractError
from kvoffload.transfer import ConnectorMetadata, TransferJob, TransferResult
from kvoffload.worker.cpu_copy import CPUCopyHandler
from kvoffload.worker.handler import OffloadingHandler, OffloadingWorker, WorkerState, check_state
from kvoffload.worker.host_pool import HostPool, num_host_blocks
from kvoffload.worker.layout import KVCacheLayout
from kvoffload.worker.stats import TransferStats
from kvoffload.worker.torch_copy import TorchCopyHandler

__all__ = ["OffloadingConnectorWorker", "default_copy_threads"]

logger = logging.getLogger(__name__)


def default_copy_threads() -> int:
    """Copy threads for a CPU engine: torch's intra-op thread count (one per core), at most 4.

    Memory bandwidth saturates with a few threads; more only take cores from the engine.
    """
    return max(1, min(4, torch.get_num_threads()))


class OffloadingConnectorWorker:
    """Moves KV blocks between the engine's cache and a host pool, driven by ``ConnectorMetadata``.

    Lifecycle: ``CREATED`` -> :meth:`register_kv_caches` -> ``RUNNING`` -> :meth:`shutdown` ->
    ``SHUT_DOWN``; calls in the wrong state raise ``RuntimeError`` naming the state. All methods
    are called from the engine thread.

    ``host_pool_bytes`` is the host budget (``kv_offloading_size`` GiB * 2**30); the pool holds
    ``host_pool_bytes // bytes_per_offloaded_block`` blocks (:attr:`num_host_blocks`, the size of
    the scheduler's ``CPUOffloadingManager``). ``use_torch_copies`` forces the staged torch path on
    a CPU engine (the reference implementation; slower).
    """

    def __init__(
        self,
        block_size_factor: int | Sequence[int],
        host_pool_bytes: int,
        *,
        num_copy_threads: int | None = None,
        defer_stores: bool | None = None,
        staging_bytes: int = 64 * 2**20,
        use_torch_copies: bool = False,
    ) -> None:
        if not isinstance(host_pool_bytes, int) or host_pool_bytes < 1:
            raise ConfigError(
                "kv_offloading_size", f"must be a positive number of bytes, got {host_pool_bytes!r}"
            )
        if num_copy_threads is not None and num_copy_threads < 1:
            raise ConfigError("num_copy_threads", f"must be positive, got {num_copy_threads}")
        #: Engine blocks per offloaded block: one for all groups, or one per group.
        self.block_size_factor = block_size_factor
        self.host_pool_bytes = host_pool_bytes
        self._num_copy_threads = num_copy_threads
        self._defer_stores_option = defer_stores
        self._staging_bytes = staging_bytes
        self._use_torch_copies = use_torch_copies
        self._state = WorkerState.CREATED
        self._layout: KVCacheLayout | None = None
        self._host_pool: HostPool | None = None
        self._worker = OffloadingWorker()
        self._defer_stores = False
        self._step_stores: list[TransferJob] = []  # this step's stores, until wait_for_save
        self._deferred_stores: list[TransferJob] = []  # last step's stores, until start_load_kv
        self._stats = TransferStats()

    # -- setup ------------------------------------------------------------------------------------

    def register_kv_caches(
        self,
        kv_caches: Sequence[torch.Tensor] | Mapping[str, torch.Tensor],
        num_blocks: int | None = None,
        group_tensors: Sequence[Sequence[int]] | None = None,
        block_dim: int | None = None,
    ) -> None:
        """Build the page views, allocate the host pool and start the copy handlers.

        See :meth:`KVCacheLayout.from_kv_caches` for the accepted shapes and ``block_dim``. Raises
        :class:`ConfigError` for unusable tensors or a budget below one block, and
        :class:`HostAllocationError` when the host pool cannot be allocated.
        """
        check_state(self, self._state, WorkerState.CREATED, "register KV caches")
        layout = KVCacheLayout.from_kv_caches(
            kv_caches, self.block_size_factor, num_blocks, group_tensors, block_dim
        )
        device = layout.device.type
        if device not in ("cpu", "cuda"):
            raise ConfigError(
                "kv_caches", f"tensors on {layout.device}: only CPU and CUDA engines are supported"
            )
        slots = num_host_blocks(self.host_pool_bytes, layout.slot_bytes)
        pool = HostPool(slots, layout.slot_bytes, pin=device == "cuda")
        try:
            handler: OffloadingHandler
            if device == "cuda" or self._use_torch_copies:
                handler = TorchCopyHandler(layout, pool, self._staging_bytes)
            else:
                handler = CPUCopyHandler(
                    layout, pool, self._num_copy_threads or default_copy_threads()
                )
        except BaseException:
            pool.close()
            raise
        self._worker.register_handler("GPU", "CPU", handler)
        self._worker.register_handler("CPU", "GPU", handler)
        self._layout, self._host_pool = layout, pool
        option = self._defer_stores_option
        self._defer_stores = device == "cuda" if option is None else option
        self._state = WorkerState.RUNNING
        logger.info(
            "host pool: %d blocks x %d bytes = %.2f GiB (%s); %d groups, %d page views",
            slots, layout.slot_bytes, pool.nbytes / 2**30, "pinned" if pool.pinned else "pageable",
            len(layout.groups), len(layout.page_views),
        )  # fmt: skip

    @property
    def state(self) -> WorkerState:
        return self._state

    @property
    def layout(self) -> KVCacheLayout:
        """The page views of the registered KV caches."""
        if self._layout is None:
            raise RuntimeError("OffloadingConnectorWorker is created: register_kv_caches first")
        return self._layout

    @property
    def host_pool(self) -> HostPool:
        if self._host_pool is None:
            raise RuntimeError("OffloadingConnectorWorker is created: register_kv_caches first")
        return self._host_pool

    @property
    def num_host_blocks(self) -> int:
        """Offloaded blocks the host pool holds: the scheduler-side manager's ``num_blocks``."""
        return self.host_pool.num_slots

    @property
    def bytes_per_offloaded_block(self) -> int:
        """Host bytes per offloaded block (one slot; the largest group's block)."""
        return self.layout.slot_bytes

    @property
    def defer_stores(self) -> bool:
        """Whether stores wait for the next :meth:`start_load_kv` (True on CUDA by default)."""
        return self._defer_stores

    @property
    def offloading_worker(self) -> OffloadingWorker:
        """The router of jobs to handlers (to wrap a handler, e.g. for failure injection)."""
        return self._worker

    # -- per step ---------------------------------------------------------------------------------

    def handle_preemptions(
        self, jobs_to_flush: Sequence[int], timeout: float | None = None
    ) -> None:
        """Block until the store jobs ``jobs_to_flush`` are done (submitting deferred ones first).

        Ids of jobs already reported or unknown are ignored.
        """
        check_state(self, self._state, WorkerState.RUNNING, "handle preemptions")
        if not jobs_to_flush:
            return
        self._submit_deferred_stores()
        self._worker.wait(jobs_to_flush, timeout)

    def start_load_kv(self, metadata: ConnectorMetadata) -> None:
        """Submit the stores deferred from the last step, then this step's loads.

        This step's stores are held until :meth:`wait_for_save`.
        """
        check_state(self, self._state, WorkerState.RUNNING, "start loading")
        if self._step_stores:
            raise ContractError(
                f"start_load_kv: wait_for_save was not called after the last step "
                f"({len(self._step_stores)} store jobs are waiting for it)"
            )
        self._submit_deferred_stores()
        for job in metadata.load_jobs:
            self._worker.transfer_async(job.job_id, (job.src, job.dst))
        self._step_stores = list(metadata.store_jobs)

    def wait_for_save(self) -> None:
        """Called after the forward pass: this step's stores may now read their KV."""
        check_state(self, self._state, WorkerState.RUNNING, "save")
        stores, self._step_stores = self._step_stores, []
        if self._defer_stores:
            self._deferred_stores.extend(stores)
        else:
            for job in stores:
                self._worker.transfer_async(job.job_id, (job.src, job.dst))

    def _submit_deferred_stores(self) -> None:
        stores, self._deferred_stores = self._deferred_stores, []
        for job in stores:
            self._worker.transfer_async(job.job_id, (job.src, job.dst))

    def get_finished(self) -> list[TransferResult]:
        """Results since the last call, failures included, each job exactly once. Never blocks."""
        check_state(self, self._state, WorkerState.RUNNING, "collect finished transfers")
        results = self._worker.get_finished()
        self._stats.record(results)
        return results

    def wait_for_any(self, timeout: float) -> bool:
        """Block until some job's result is ready for :meth:`get_finished`, or ``timeout`` seconds.

        For an engine with nothing to schedule but loads in flight. Returns whether a result is
        ready (False at once when nothing is in flight; deferred stores are not in flight yet).
        """
        check_state(self, self._state, WorkerState.RUNNING, "wait for transfers")
        return self._worker.wait_for_any(timeout)

    @property
    def num_in_flight(self) -> int:
        """Jobs submitted and not reported by :meth:`get_finished` yet (deferred stores excluded)."""
        return self._worker.num_in_flight

    def stats(self) -> dict[str, float]:
        """Monotonic per-direction counters: ``<src>_to_<dst>_{jobs,failed_jobs,bytes,seconds}``."""
        return self._stats.as_dict()

    # -- teardown ---------------------------------------------------------------------------------

    def shutdown(self, timeout: float | None = 30.0) -> list[TransferResult]:
        """Stop: fail the stores never submitted, cancel queued copies, wait for running ones, free
        the host pool. Returns every result not reported yet. Idempotent.
        """
        if self._state is WorkerState.SHUT_DOWN:
            return []
        never_started = self._step_stores + self._deferred_stores
        self._step_stores, self._deferred_stores = [], []
        results = [
            TransferResult(job.job_id, False, direction=("GPU", "CPU")) for job in never_started
        ]
        results.extend(self._worker.shutdown(timeout))
        if self._host_pool is not None:
            self._host_pool.close()
        self._state = WorkerState.SHUT_DOWN
        self._stats.record(results)
        return results

    def __enter__(self) -> OffloadingConnectorWorker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

"""Engine <-> host copies when the engine's KV cache lives in CPU memory: a small thread pool
running ``memmove`` over precomputed byte ranges.

Why this design (measured on a 2-core VM, ``benchmarks/transfer_bandwidth.py`` and
``docs/worker.md``): ``memmove`` called through ctypes releases the GIL, so two threads copy in
parallel at the memory-bandwidth limit for pages of 64 KiB and up; ``torch.index_select`` on uint8
rows runs at ~1.7 GB/s, per-page ``narrow().copy_()`` pays ~5 us of dispatch per page, and
``np.take`` needs a contiguous destination and uses one core.

A job's page map is turned into copy descriptors ``(dst, src, nbytes)`` with contiguous runs of
pages coalesced (per view: consecutive engine blocks that land in consecutive host positions),
then cut into chunks of at most a few MiB that the threads pick up. Loads are served before stores
(a waiting request needs them); within a priority, jobs run in submission order, each spread over
all threads.

Safety: ``memmove`` writes raw addresses, so every id is checked against its pool
(:class:`~kvoffload.worker.mapping.BlockMapping`) before any address is computed, the handler keeps
the engine's tensors and the host buffer alive, and :meth:`CPUCopyHandler.shutdown` joins the
threads before the host buffer may be released.
"""

from __future__ import annotations

import collections
import ctypes
import itertools
import logging
import queue
import threading
import time
from collections.abc import Collection

import numpy as np

from kvoffload.errors import ContractError
from kvoffload.load_store_specs import CPULoadStoreSpec, GPULoadStoreSpec
from kvoffload.transfer import TransferResult
from kvoffload.worker.handler import OffloadingHandler, TransferSpec, WorkerState, check_state
from kvoffload.worker.host_pool import HostSlots
from kvoffload.worker.layout import KVCacheLayout
from kvoffload.worker.mapping import BlockMapping

__all__ = ["CPUCopyHandler", "CopyPlanner", "split_transfer_direction"]

logger = logging.getLogger(__name__)

_MIN_CHUNK_BYTES = 256 * 2**10
_MAX_CHUNK_BYTES = 8 * 2**20
_LOAD_PRIORITY, _STORE_PRIORITY = 0, 1
_STORE = ("GPU", "CPU")
_LOAD = ("CPU", "GPU")
_CANCELLED = "cancelled by shutdown"


def split_transfer_direction(spec: TransferSpec) -> tuple[bool, GPULoadStoreSpec, CPULoadStoreSpec]:
    """Return ``(is_store, engine spec, host spec)``; ContractError for any other pair of specs."""
    src, dst = spec
    if isinstance(src, GPULoadStoreSpec) and isinstance(dst, CPULoadStoreSpec):
        return True, src, dst
    if isinstance(src, CPULoadStoreSpec) and isinstance(dst, GPULoadStoreSpec):
        return False, dst, src
    raise ContractError(
        f"cannot copy {type(src).__name__} -> {type(dst).__name__}: needs GPU <-> CPU specs"
    )


class CopyPlanner:
    """Turns page maps into byte copies ``(dst, src, nbytes)`` between one layout and one host buffer.

    Per-view constants (page sizes, strides, addresses, slot offsets) are gathered once, so a plan
    costs a handful of vectorised numpy operations per group, whatever the number of views.
    """

    def __init__(
        self,
        layout: KVCacheLayout,
        host_address: int,
        host_bytes: int,
        slot_stride: int | None = None,
    ) -> None:
        # Slot s starts at host_address + s * slot_stride (default: slots back to back).
        self._slot_bytes = slot_stride or layout.slot_bytes
        self._host = (host_address, host_address + host_bytes)

        def column(values: list[int]) -> np.ndarray:
            return np.array(values, dtype=np.int64)[:, None]

        # per group: (page bytes, block strides, page-0 addresses, extent ends, slot offsets), (views, 1) each
        self._groups = [
            (
                column([v.page_bytes for v in g.views]),
                column([v.block_stride for v in g.views]),
                column([v.address for v in g.views]),
                column([v.extent()[1] for v in g.views]),
                column(list(g.slot_offsets)),
            )
            for g in layout.groups
        ]

    def plan(
        self, mapping: BlockMapping, is_store: bool
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Return ``(dst, src, nbytes)`` int64 arrays: the byte copies that carry out ``mapping``.

        Pages adjacent on both sides are coalesced into one copy. Addresses are absolute. Every
        copy is checked to lie inside its page view and the host buffer (``RuntimeError``
        otherwise: a bug), so that a planning error can fail a job but never corrupt memory.
        """
        host_lo, host_hi = self._host
        dsts, srcs, lens = [], [], []
        for gm in mapping.groups:
            pages, strides, bases, ends, offsets = self._groups[gm.group]
            engine = bases + gm.engine_blocks * strides  # (views, pages of the job)
            host = (host_lo + gm.host_slots * self._slot_bytes) + offsets + gm.slot_pages * pages
            starts_run = np.ones(engine.shape, dtype=bool)
            starts_run[:, 1:] = (np.diff(engine, axis=1) != pages) | (
                np.diff(host, axis=1) != pages
            )
            starts = np.flatnonzero(starts_run)
            row = starts // engine.shape[1]
            nbytes = np.diff(np.append(starts, engine.size)) * pages[row, 0]
            eng, hst = engine.ravel()[starts], host.ravel()[starts]
            inside = (
                (eng >= bases[row, 0])
                & (eng + nbytes <= ends[row, 0])
                & (hst >= host_lo)
                & (hst + nbytes <= host_hi)
            )
            if not inside.all():
                raise RuntimeError(
                    f"bug: group {gm.group} planned a copy outside its page views or the host buffer"
                )
            dsts.append(hst if is_store else eng)
            srcs.append(eng if is_store else hst)
            lens.append(nbytes)
        if len(lens) == 1:
            return dsts[0], srcs[0], lens[0]
        if not lens:
            empty = np.empty(0, dtype=np.int64)
            return empty, empty, empty
        return np.concatenate(dsts), np.concatenate(srcs), np.concatenate(lens)


def _chunks(
    dst: np.ndarray, src: np.ndarray, nbytes: np.ndarray, chunk_bytes: int
) -> list[tuple[list[int], list[int], list[int]]]:
    """Cut copies longer than ``chunk_bytes`` into pieces, then group them into chunks of about
    ``chunk_bytes`` (as Python lists, ready for ``map``)."""
    if int(nbytes.sum()) <= chunk_bytes:
        return [(dst.tolist(), src.tolist(), nbytes.tolist())]
    pieces = -(-nbytes // chunk_bytes)
    if (pieces > 1).any():
        which = np.repeat(np.arange(len(nbytes)), pieces)
        offset = (
            np.arange(len(which)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
        ) * chunk_bytes
        dst, src = dst[which] + offset, src[which] + offset
        nbytes = np.minimum(chunk_bytes, nbytes[which] - offset)
    chunk_of = (np.cumsum(nbytes) - nbytes) // chunk_bytes
    bounds = [0, *(np.flatnonzero(np.diff(chunk_of)) + 1).tolist(), len(nbytes)]
    return [
        (dst[a:b].tolist(), src[a:b].tolist(), nbytes[a:b].tolist())
        for a, b in itertools.pairwise(bounds)
    ]


class _Job:
    """One transfer in flight. ``pending`` (chunks left) and ``error`` change under the handler lock."""

    __slots__ = (
        "done",
        "end",
        "error",
        "is_store",
        "job_id",
        "num_bytes",
        "pending",
        "seq",
        "spec",
        "start",
    )

    def __init__(
        self, job_id: int, is_store: bool, spec: tuple[GPULoadStoreSpec, CPULoadStoreSpec], seq: int
    ):
        self.job_id = job_id
        self.is_store = is_store
        self.spec = spec
        self.seq = seq
        self.pending = 0
        self.num_bytes = 0
        self.error: str | None = None
        self.start = self.end = 0.0
        self.done = threading.Event()


class CPUCopyHandler(OffloadingHandler):
    """Both directions between a CPU-resident engine KV cache and the host pool.

    ``transfer_async`` only queues the job (O(1) on the engine thread); validation, planning and
    copying run on ``num_threads`` daemon threads. A malformed spec (e.g. an out-of-range id)
    makes its job fail (``success=False``) without touching memory.
    """

    def __init__(self, layout: KVCacheLayout, host_pool: HostSlots, num_threads: int = 2) -> None:
        if layout.device.type != "cpu":
            raise ContractError(f"CPUCopyHandler needs a CPU KV cache, got one on {layout.device}")
        if num_threads < 1:
            raise ContractError(f"num_threads must be positive, got {num_threads}")
        self._layout = layout
        self._pool = host_pool
        if layout.slot_bytes > host_pool.slot_stride:
            raise ContractError(
                f"host slots of {host_pool.slot_stride} bytes cannot hold offloaded blocks of "
                f"{layout.slot_bytes} bytes"
            )
        self._planner = CopyPlanner(
            layout, host_pool.address, host_pool.nbytes, host_pool.slot_stride
        )
        self._factors = [g.block_size_factor for g in layout.groups]
        self._num_threads = num_threads
        self._lock = threading.Lock()
        self._queue: queue.PriorityQueue[tuple[int, int, int, _Job | None, tuple | None]] = (
            queue.PriorityQueue()
        )
        self._seq = itertools.count()
        self._jobs: dict[int, _Job] = {}  # submitted, not reported yet
        self._finished: list[TransferResult] = []
        self._state = WorkerState.RUNNING
        self._threads = [
            threading.Thread(target=self._serve, name=f"kvoffload-copy-{i}", daemon=True)
            for i in range(num_threads)
        ]
        for thread in self._threads:
            thread.start()

    @property
    def state(self) -> WorkerState:
        return self._state

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        check_state(self, self._state, WorkerState.RUNNING, "submit a transfer")
        is_store, engine_spec, host_spec = split_transfer_direction(spec)
        if job_id in self._jobs:
            raise ContractError(f"job {job_id} is already in flight")
        job = _Job(job_id, is_store, (engine_spec, host_spec), next(self._seq))
        self._jobs[job_id] = job
        self._put(job, 0, None)
        return True

    def _put(self, job: _Job, index: int, chunk: tuple | None) -> None:
        with self._lock:
            if self._state is WorkerState.RUNNING:
                self._queue.put(
                    (
                        _STORE_PRIORITY if job.is_store else _LOAD_PRIORITY,
                        job.seq,
                        index,
                        job,
                        chunk,
                    )
                )
                return
        self._cancel(job)

    def _serve(self) -> None:
        while True:
            _, _, _, job, chunk = self._queue.get()
            if job is None:
                return
            if chunk is None:
                self._plan(job)
            else:
                self._copy(job, chunk)

    def _plan(self, job: _Job) -> None:
        job.start = time.perf_counter()
        engine_spec, host_spec = job.spec
        try:
            mapping = BlockMapping.from_specs(
                engine_spec,
                host_spec,
                is_store=job.is_store,
                block_size_factors=self._factors,
                num_engine_blocks=self._layout.num_blocks,
                num_host_slots=self._pool.num_slots,
            )
            dst, src, nbytes = self._planner.plan(mapping, job.is_store)
        except Exception as exc:
            job.error = f"{type(exc).__name__}: {exc}"
            self._finish(job)
            return
        job.num_bytes = int(nbytes.sum())
        if job.num_bytes == 0:
            self._finish(job)
            return
        per_thread = -(-job.num_bytes // self._num_threads)
        chunks = _chunks(dst, src, nbytes, min(_MAX_CHUNK_BYTES, max(_MIN_CHUNK_BYTES, per_thread)))
        job.pending = len(chunks)
        for index, chunk in enumerate(chunks, start=1):
            self._put(job, index, chunk)

    def _copy(self, job: _Job, chunk: tuple[list[int], list[int], list[int]]) -> None:
        try:
            collections.deque(map(ctypes.memmove, *chunk), maxlen=0)
        except Exception as exc:  # pragma: no cover - memmove over validated ranges does not raise
            with self._lock:
                job.error = f"{type(exc).__name__}: {exc}"
        self._chunk_done(job)

    def _cancel(self, job: _Job) -> None:
        with self._lock:
            job.error = _CANCELLED
        self._chunk_done(job)

    def _chunk_done(self, job: _Job) -> None:
        with self._lock:
            job.pending -= 1
            last = job.pending <= 0
        if last:
            self._finish(job)

    def _finish(self, job: _Job) -> None:
        job.end = time.perf_counter()
        direction = _STORE if job.is_store else _LOAD
        if job.error is None:
            result = TransferResult(job.job_id, True, job.num_bytes, job.end - job.start, direction)
        else:
            level = logging.INFO if job.error == _CANCELLED else logging.WARNING
            logger.log(
                level, "transfer job %d (%s -> %s) failed: %s", job.job_id, *direction, job.error
            )
            result = TransferResult(job.job_id, False, 0, job.end - job.start, direction)
        with self._lock:
            self._finished.append(result)
        job.done.set()

    def get_finished(self) -> list[TransferResult]:
        check_state(self, self._state, WorkerState.RUNNING, "collect finished transfers")
        return self._take_finished()

    def _take_finished(self) -> list[TransferResult]:
        with self._lock:
            results, self._finished = self._finished, []
        for result in results:
            self._jobs.pop(result.job_id, None)
        return results

    def wait(self, job_ids: Collection[int], timeout: float | None = None) -> None:
        check_state(self, self._state, WorkerState.RUNNING, "wait for transfers")
        deadline = None if timeout is None else time.monotonic() + timeout
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            if job is None:
                continue
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not job.done.wait(left):
                raise TimeoutError(f"transfer job {job_id} did not finish within {timeout} s")

    def shutdown(self, timeout: float | None = None) -> list[TransferResult]:
        with self._lock:
            if self._state is WorkerState.SHUT_DOWN:
                return []
            self._state = WorkerState.SHUT_DOWN
            queued = []
            while True:
                try:
                    queued.append(self._queue.get_nowait())
                except queue.Empty:
                    break
        for _, _, _, job, _ in queued:
            if job is not None:
                self._cancel(job)
        for _ in self._threads:
            self._queue.put((-1, -1, 0, None, None))
        deadline = None if timeout is None else time.monotonic() + timeout
        for thread in self._threads:
            thread.join(None if deadline is None else max(0.0, deadline - time.monotonic()))
        stuck = [t.name for t in self._threads if t.is_alive()]
        if stuck:
            logger.warning(
                "copy threads %s still running after %s s; their jobs are reported failed",
                stuck,
                timeout,
            )
        results = self._take_finished()
        results.extend(
            TransferResult(j, False, direction=_STORE if job.is_store else _LOAD)
            for j, job in self._jobs.items()
        )
        self._jobs.clear()
        return results

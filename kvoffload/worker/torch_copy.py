"""Engine <-> host copies with torch ops through a staging buffer on the engine's device.

This is the CUDA path; on a CPU engine it runs synchronously and serves as the reference that the
faster :class:`~kvoffload.worker.cpu_copy.CPUCopyHandler` is tested against.

Per chunk of whole host slots (at most ``staging_bytes``):

* store: gather each view's engine pages (``index_select``) into a staging buffer laid out exactly
  like the host slots, then one device->host copy per run of consecutive host slots (per slot for
  a group smaller than the slot, whose tail is left alone);
* load: the same host<->device copies into staging, then scatter each view's pages into the engine
  cache (``index_copy_``).

Pages are moved as int64 (or the widest word their sizes and addresses allow), not bytes.

So the host link sees few, large copies whatever the engine's page size, and the per-page work is
done by device kernels. On CUDA each direction has its own stream (loads at high priority); a
transfer first waits for the engine's current stream, so a store never reads KV that the forward
pass has not written yet, and a load never overwrites blocks that queued kernels still read.
CUDA events give completion and timing.
"""

from __future__ import annotations

import math
import time
from collections.abc import Collection
from dataclasses import dataclass

import numpy as np
import torch

from kvoffload.errors import ContractError
from kvoffload.transfer import TransferResult
from kvoffload.worker.cpu_copy import split_transfer_direction
from kvoffload.worker.handler import OffloadingHandler, TransferSpec, WorkerState, check_state
from kvoffload.worker.host_pool import HostPool
from kvoffload.worker.layout import KVCacheLayout
from kvoffload.worker.mapping import BlockMapping, GroupMapping

__all__ = ["TorchCopyHandler"]

_STORE = ("GPU", "CPU")
_LOAD = ("CPU", "GPU")
_POLL_SECONDS = 0.0005
_WIDE_DTYPES = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}


@dataclass(slots=True)
class _CudaJob:
    direction: tuple[str, str]
    num_bytes: int
    start: torch.cuda.Event
    end: torch.cuda.Event


def _word_size(*values: int) -> int:
    """The widest element size (8, 4, 2 or 1 bytes) dividing every value."""
    return math.gcd(8, *values)


class TorchCopyHandler(OffloadingHandler):
    """Both directions between the engine's KV cache (CUDA, or CPU as a reference) and the host pool."""

    def __init__(
        self, layout: KVCacheLayout, host_pool: HostPool, staging_bytes: int = 64 * 2**20
    ) -> None:
        self._layout = layout
        self._pool = host_pool
        self._device = layout.device
        self._cuda = self._device.type == "cuda"
        self._chunk_slots = max(1, staging_bytes // layout.slot_bytes)
        self._factors = [g.block_size_factor for g in layout.groups]
        self._streams: dict[bool, torch.cuda.Stream] = {}
        if self._cuda:
            self._streams = {
                True: torch.cuda.Stream(self._device, priority=0),
                False: torch.cuda.Stream(self._device, priority=-1),
            }
        self._jobs: dict[int, _CudaJob] = {}  # CUDA jobs in flight, in submission order
        self._finished: list[TransferResult] = []  # CPU jobs, done at submission
        self._state = WorkerState.RUNNING

    @property
    def state(self) -> WorkerState:
        return self._state

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        check_state(self, self._state, WorkerState.RUNNING, "submit a transfer")
        is_store, engine_spec, host_spec = split_transfer_direction(spec)
        if job_id in self._jobs:
            raise ContractError(f"job {job_id} is already in flight")
        mapping = BlockMapping.from_specs(
            engine_spec,
            host_spec,
            is_store=is_store,
            block_size_factors=self._factors,
            num_engine_blocks=self._layout.num_blocks,
            num_host_slots=self._pool.num_slots,
        )
        direction = _STORE if is_store else _LOAD
        if not self._cuda:
            t0 = time.perf_counter()
            num_bytes = self._transfer(mapping, is_store)
            self._finished.append(
                TransferResult(job_id, True, num_bytes, time.perf_counter() - t0, direction)
            )
            return True
        stream = self._streams[is_store]
        stream.wait_stream(torch.cuda.current_stream(self._device))
        with torch.cuda.stream(stream):
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record(stream)
            try:
                num_bytes = self._transfer(mapping, is_store)
            except BaseException:
                stream.synchronize()  # nothing of a failed job may still be copying once it is reported
                raise
            end.record(stream)
        self._jobs[job_id] = _CudaJob(direction, num_bytes, start, end)
        return True

    def _index(self, ids: np.ndarray) -> torch.Tensor:
        index = torch.from_numpy(np.ascontiguousarray(ids))
        if self._cuda:
            return index.pin_memory().to(self._device, non_blocking=True)
        return index

    def _transfer(self, mapping: BlockMapping, is_store: bool) -> int:
        num_bytes = 0
        for gm in mapping.groups:
            for first in range(0, len(gm.slots), self._chunk_slots):
                num_bytes += self._transfer_chunk(
                    gm, first, min(len(gm.slots), first + self._chunk_slots), is_store
                )
        return num_bytes

    def _transfer_chunk(self, gm: GroupMapping, first: int, last: int, is_store: bool) -> int:
        """Move the pages of ``gm`` that fall in its slots ``[first, last)``; return the bytes moved."""
        group = self._layout.groups[gm.group]
        f = group.block_size_factor
        n = last - first
        row = group.bytes_per_offloaded_block  # a smaller group leaves the slot tail alone
        # pages of this chunk: positions [first * f, last * f) counted from the group's first slot
        lo = max(0, first * f - gm.first_page)
        hi = min(len(gm.engine_blocks), last * f - gm.first_page)
        skip = lo + gm.first_page - first * f  # pages of the chunk's first slot not in the transfer
        index = self._index(gm.engine_blocks[lo:hi])
        staging = torch.empty((n, row), dtype=torch.uint8, device=self._device)
        host_copies = self._host_copies(gm.slots[first:last], staging, row)
        if not is_store:
            for host, staged in host_copies:
                staged.copy_(host, non_blocking=True)
        num_bytes = 0
        for view, offset in zip(group.views, group.slot_offsets, strict=True):
            page = view.page_bytes
            word = _word_size(page, view.block_stride, view.address, offset, row)
            dtype = _WIDE_DTYPES[word]
            engine = view.pages.view(dtype)
            in_slots = staging.as_strided((n, f, page), (row, page, 1), offset).view(dtype)
            if is_store:
                in_slots.copy_(engine.index_select(0, index).view(n, f, page // word))
            else:
                rows = in_slots.reshape(n * f, page // word)[skip : skip + (hi - lo)]
                engine.index_copy_(0, index, rows)
            num_bytes += page * (hi - lo)
        if is_store:
            for host, staged in host_copies:
                host.copy_(staged, non_blocking=True)
        return num_bytes

    def _host_copies(
        self, slots: np.ndarray, staging: torch.Tensor, row: int
    ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Contiguous ``(host, staging)`` pairs covering ``slots``: one per run of consecutive
        slots when a group fills whole slots, else one per slot."""
        host = self._pool.slots
        if row != self._layout.slot_bytes:
            return [(host[int(s), :row], staging[i]) for i, s in enumerate(slots.tolist())]
        breaks = (np.flatnonzero(np.diff(slots) != 1) + 1).tolist()
        return [
            (host[int(slots[a]) : int(slots[a]) + b - a], staging[a:b])
            for a, b in zip([0, *breaks], [*breaks, len(slots)], strict=True)
        ]

    def get_finished(self) -> list[TransferResult]:
        check_state(self, self._state, WorkerState.RUNNING, "collect finished transfers")
        results, self._finished = self._finished, []
        done = [job_id for job_id, job in self._jobs.items() if job.end.query()]
        for job_id in done:
            job = self._jobs.pop(job_id)
            seconds = job.start.elapsed_time(job.end) / 1000.0
            results.append(TransferResult(job_id, True, job.num_bytes, seconds, job.direction))
        return results

    def wait(self, job_ids: Collection[int], timeout: float | None = None) -> None:
        check_state(self, self._state, WorkerState.RUNNING, "wait for transfers")
        deadline = None if timeout is None else time.monotonic() + timeout
        for job_id in job_ids:
            job = self._jobs.get(job_id)
            if job is None:
                continue
            if deadline is None:
                job.end.synchronize()
                continue
            while not job.end.query():
                if time.monotonic() > deadline:
                    raise TimeoutError(f"transfer job {job_id} did not finish within {timeout} s")
                time.sleep(_POLL_SECONDS)

    def shutdown(self, timeout: float | None = None) -> list[TransferResult]:
        """Wait for every copy queued on the streams, whatever ``timeout``: CUDA cannot cancel them,
        and the host buffer must outlive them."""
        if self._state is WorkerState.SHUT_DOWN:
            return []
        for stream in self._streams.values():
            stream.synchronize()
        results = self.get_finished()
        self._state = WorkerState.SHUT_DOWN
        return results

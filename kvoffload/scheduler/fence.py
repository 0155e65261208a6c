"""The reuse fence: engine blocks of sliding-window groups that store jobs still read.

The engine may free a sliding-window group's blocks while their request runs (they left its
window) and reallocate them at once; a store job still reading such a block must finish first.
Each such block is registered here while its store is in flight; reallocating one flushes its
readers (``jobs_to_flush``: the worker completes them before the next forward pass).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from kvoffload.scheduler.jobs import PlannedJob
from kvoffload.scheduler.state import GroupOffloadConfig

__all__ = ["ReuseFence"]


class ReuseFence:
    """Engine block id -> ids of the store jobs still reading it (sliding-window groups only)."""

    def __init__(self, groups: Sequence[GroupOffloadConfig]) -> None:
        self._windowed = [g.sliding_window_blocks is not None for g in groups]
        self._readers: dict[int, set[int]] = {}

    def __bool__(self) -> bool:
        """Whether any block is fenced (else reallocations need no check)."""
        return bool(self._readers)

    def add(self, job: PlannedJob, engine_ids: list[int], group_sizes: list[int]) -> None:
        """Fence the sliding-window blocks among a store job's sources (``engine_ids``, grouped
        by ``group_sizes``)."""
        offset = 0
        readers = self._readers
        for g, size in enumerate(group_sizes):
            if self._windowed[g]:
                for block_id in engine_ids[offset : offset + size]:
                    readers.setdefault(block_id, set()).add(job.job_id)
                    job.fenced.append(block_id)
            offset += size

    def reallocated(self, block_ids: Iterable[int], flush: list[int]) -> None:
        """The engine just (re)allocated ``block_ids``: add the store jobs still reading any of
        them to ``flush``, once each."""
        readers = self._readers
        for block_id in block_ids:
            jobs = readers.pop(block_id, None)
            if jobs:
                flush.extend(jobs.difference(flush))

    def release(self, job: PlannedJob) -> None:
        """``job`` completed: it reads none of its blocks any more."""
        readers = self._readers
        for block_id in job.fenced:
            jobs = readers.get(block_id)
            if jobs is not None:
                jobs.discard(job.job_id)
                if not jobs:
                    del readers[block_id]

"""The tiering manager's background jobs (promotions and cascades) from submission to result."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence

from kvoffload.keys import OffloadKey
from kvoffload.manager_contract import ReqContext
from kvoffload.tiers.contract import ResultSignal, SecondaryTier

__all__ = ["NO_REQUEST", "BackgroundJob", "BackgroundJobs"]

#: The context of background work that belongs to no request (cascades, host pins of a
#: promotion whose request ended).
NO_REQUEST = ReqContext("<tiering>")


class BackgroundJob:
    """One job submitted to secondary tier ``tier``; ``on_done(job, failed_keys)`` applies its
    result (``ctx``: the request a promotion is for, ``None`` for a cascade)."""

    __slots__ = ("ctx", "keys", "on_done", "submitted", "tier")

    def __init__(
        self,
        tier: int,
        keys: list[OffloadKey],
        ctx: ReqContext | None,
        on_done: Callable[[BackgroundJob, Mapping[OffloadKey, str]], None],
    ) -> None:
        self.tier = tier
        self.keys = keys
        self.ctx = ctx
        self.on_done = on_done
        self.submitted = time.perf_counter()


class BackgroundJobs:
    """Job ids (unique per tiering manager) and the jobs not yet reported by their tier;
    :attr:`signal` is notified by every tier whenever it has a result to report."""

    def __init__(self, tiers: Sequence[SecondaryTier]) -> None:
        self._tiers = tiers
        self.signal = ResultSignal()
        for tier in tiers:
            tier.set_result_signal(self.signal)
        self._jobs: dict[int, BackgroundJob] = {}
        self._next_id = 0

    def add(self, job: BackgroundJob) -> int:
        """Register ``job``; returns its id for the :class:`~kvoffload.tiers.contract.TierJob`."""
        job_id = self._next_id
        self._next_id += 1
        self._jobs[job_id] = job
        return job_id

    def apply_finished(self) -> None:
        """Apply every result the tiers have (never blocks); results of jobs dropped by
        :meth:`clear` are ignored."""
        jobs = self._jobs
        for tier in self._tiers:
            for result in tier.get_finished_jobs():
                job = jobs.pop(result.job_id, None)
                if job is not None:
                    job.on_done(job, result.failed_keys)

    def ids_for(self, ctx: ReqContext) -> list[int]:
        """The ids of the jobs in flight for request ``ctx`` (its promotions); O(jobs)."""
        return [job_id for job_id, job in self._jobs.items() if job.ctx is ctx]

    def __contains__(self, job_id: int) -> bool:
        return job_id in self._jobs

    def __len__(self) -> int:
        return len(self._jobs)

    def clear(self) -> None:
        self._jobs.clear()

"""The connector's transfer jobs from planning until every worker has reported them."""

from __future__ import annotations

from kvoffload.keys import OffloadKey
from kvoffload.manager_contract import ReqContext
from kvoffload.scheduler.state import RequestKVState

__all__ = ["JobTable", "PlannedJob"]


class PlannedJob:
    """A planned load or store of ``keys`` for one request, until every worker reported it."""

    __slots__ = (
        "ctx",
        "failed",
        "fenced",
        "is_store",
        "job_id",
        "keys",
        "pending",
        "req_id",
        "sources",
        "stale",
    )

    def __init__(
        self,
        job_id: int,
        req_id: str,
        ctx: ReqContext,
        keys: list[OffloadKey],
        is_store: bool,
        pending: int,
    ):
        self.job_id = job_id
        self.req_id = req_id
        self.ctx = ctx
        self.keys = keys
        self.is_store = is_store
        self.pending = pending  # workers yet to report
        self.failed = False
        self.stale = False  # started before a reset: the manager no longer knows its keys
        self.fenced: list[int] = []  # engine block ids registered in the reuse fence
        self.sources: dict[str, int] = {}  # a load's hit tokens by the tier that supplies them


class JobTable(dict[int, PlannedJob]):
    """The jobs not complete yet, by id; :meth:`new` hands out the ids (never reused)."""

    def __init__(self, num_workers: int) -> None:
        super().__init__()
        self._num_workers = num_workers
        self._next_id = 0

    def new(self, state: RequestKVState, keys: list[OffloadKey], is_store: bool) -> PlannedJob:
        """Plan a job for ``state``'s request; it counts among the request's jobs in flight."""
        job_id = self._next_id
        self._next_id += 1
        ctx = state.req_context
        job = self[job_id] = PlannedJob(job_id, ctx.req_id, ctx, keys, is_store, self._num_workers)
        state.transfer_jobs.add(job_id)
        return job

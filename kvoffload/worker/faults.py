"""Failure injection for tests: a handler that wraps a real one and fails chosen jobs for real.

Nothing is mocked: jobs that are not chosen run on the wrapped handler, chosen ones raise
:class:`~kvoffload.errors.TransferError` at submission, exactly as a handler whose copy could not
start would. ``fail_in_get_finished`` makes the handler itself break, to exercise the worker's
"give up on a broken handler" path.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from kvoffload.errors import TransferError
from kvoffload.transfer import TransferResult
from kvoffload.worker.handler import OffloadingHandler, TransferSpec

__all__ = ["FaultInjectingHandler"]


class FaultInjectingHandler(OffloadingHandler):
    """Delegates to ``inner`` except for the jobs ``fail_job`` selects (a predicate or a set of ids)."""

    def __init__(
        self,
        inner: OffloadingHandler,
        fail_job: Callable[[int], bool] | Collection[int] = (),
        fail_in_get_finished: bool = False,
    ) -> None:
        self.inner = inner
        self._fail_job = fail_job if callable(fail_job) else frozenset(fail_job).__contains__
        self._fail_in_get_finished = fail_in_get_finished
        #: Job ids failed so far, in order.
        self.injected: list[int] = []

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        if self._fail_job(job_id):
            self.injected.append(job_id)
            raise TransferError(f"injected failure of job {job_id}")
        return self.inner.transfer_async(job_id, spec)

    def get_finished(self) -> list[TransferResult]:
        if self._fail_in_get_finished:
            raise TransferError("injected failure of get_finished")
        return self.inner.get_finished()

    def wait(self, job_ids: Collection[int], timeout: float | None = None) -> None:
        self.inner.wait(job_ids, timeout)

    def shutdown(self, timeout: float | None = None) -> list[TransferResult]:
        return self.inner.shutdown(timeout)

"""Deterministic late completions for tests: a handler that reports each job a chosen number of
engine steps after it was submitted, whatever the copy threads' timing.

Nothing is mocked: every job runs on the wrapped (real) handler. When a job is due, the handler
waits for its real copy to finish and then reports its real result. The timing of every result is
thus a function of the step clock only, so a run is reproducible step for step; timing-dependent
orderings (a load landing in the step another request is preempted, a store finishing while the
tier is full) can be provoked on purpose instead of by chance.
"""

from __future__ import annotations

from collections.abc import Callable, Collection

from kvoffload.transfer import TransferResult
from kvoffload.worker.handler import OffloadingHandler, TransferSpec

__all__ = ["DelayedCompletionHandler"]


class DelayedCompletionHandler(OffloadingHandler):
    """Delegates to ``inner``; reports job ``j`` once ``clock() >= submitted_at + delay(j)``.

    ``clock`` is the step counter the delays count in (e.g. the engine's ``steps``); ``delay``
    maps a job id to a whole number of steps (0: report at the first collection after the
    submission step's clock value). :meth:`wait` waits for the real copies (a preemption flush
    must not return before the data moved); the results are still reported when due.
    """

    def __init__(
        self, inner: OffloadingHandler, clock: Callable[[], int], delay: Callable[[int], int]
    ) -> None:
        self.inner = inner
        self._clock = clock
        self._delay = delay
        self._due: dict[int, int] = {}  # job id -> clock value from which it is reported
        self._done: dict[int, TransferResult] = {}  # finished on `inner`, not reported yet

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        accepted = self.inner.transfer_async(job_id, spec)
        if accepted:
            self._due[job_id] = self._clock() + self._delay(job_id)
        return accepted

    def get_finished(self) -> list[TransferResult]:
        now = self._clock()
        due = [job_id for job_id, at in self._due.items() if at <= now]
        if not due:
            return []
        self.inner.wait(due)
        for result in self.inner.get_finished():
            self._done[result.job_id] = result
        out = []
        for job_id in due:
            del self._due[job_id]
            out.append(self._done.pop(job_id))
        return out

    def wait(self, job_ids: Collection[int], timeout: float | None = None) -> None:
        self.inner.wait(job_ids, timeout)

    def shutdown(self, timeout: float | None = None) -> list[TransferResult]:
        results = list(self._done.values())
        results.extend(self.inner.shutdown(timeout))
        self._done.clear()
        self._due.clear()
        return results

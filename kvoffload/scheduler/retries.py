"""Refused final offers of finished requests, kept and offered again each step.

A finished request whose final offer the tier refused (no room while other transfers are in
flight) keeps its engine blocks and its offer; each step the offer comes again (its longest
fitting head is stored each time). It is given up once it is stored, once an attempt neither
waits for room (nothing fit while transfers are in flight) nor stores more of it than any
attempt before (so finished requests whose offers together exceed the tier cannot take turns
evicting each other for ever), or as soon as the engine needs the blocks (:meth:`abandon`).
"""

from __future__ import annotations

from collections.abc import Callable

from kvoffload.scheduler.jobs import JobTable
from kvoffload.scheduler.state import RequestKVState
from kvoffload.transfer import TransferJob

__all__ = ["FinishedStoreRetries"]

#: Plans a finished request's stores of its first ``n`` tokens: (jobs, blocks left unstored).
PlanFinal = Callable[[RequestKVState, int], tuple[list[TransferJob], int]]


class FinishedStoreRetries:
    """The kept offers, by request id; ``freed``: requests given up with no job in flight, whose
    blocks the engine may free (reported in the next ``ConnectorUpdate.freed``)."""

    def __init__(
        self,
        requests: dict[str, RequestKVState],
        jobs: JobTable,
        plan: PlanFinal,
        end_request: Callable[[RequestKVState], None],
    ) -> None:
        self._requests = requests  # the connector's live requests (a freed one is removed)
        self._jobs = jobs
        self._plan = plan
        self._end_request = end_request  # tells the policy and the manager the request ended
        #: req id -> (offerable tokens, fewest blocks of the offer left unstored so far)
        self._kept: dict[str, tuple[int, int]] = {}
        self.freed: list[str] = []

    def __bool__(self) -> bool:
        return bool(self._kept)

    def __contains__(self, req_id: str) -> bool:
        return req_id in self._kept

    def keep(self, req_id: str, num_tokens: int, missing: int) -> None:
        """Keep a finished request's offer of ``num_tokens`` tokens, ``missing`` blocks of it
        refused."""
        self._kept[req_id] = (num_tokens, missing)

    def retry(self, store_jobs: list[TransferJob]) -> None:
        """Offer every kept offer again; the jobs planned go to ``store_jobs``."""
        for req_id, (num_tokens, fewest_missing) in list(self._kept.items()):
            jobs, missing = self._plan(self._requests[req_id], num_tokens)
            store_jobs.extend(jobs)
            if missing and jobs and missing < fewest_missing:
                self._kept[req_id] = (num_tokens, missing)  # progress: go on
            elif missing and not jobs and self._jobs:
                continue  # nothing fits now; transfers in flight may make room
            else:  # stored, or no better than before
                self._give_up(req_id, self.freed)

    def abandon(self) -> list[str]:
        """Give every kept offer up (the engine needs blocks): the requests whose blocks may be
        freed now; the others (a store still reads them) are freed when their transfers end."""
        freed: list[str] = []
        for req_id in list(self._kept):
            self._give_up(req_id, freed)
        return freed

    def take_freed(self) -> list[str]:
        freed, self.freed = self.freed, []
        return freed

    def _give_up(self, req_id: str, freed: list[str]) -> None:
        del self._kept[req_id]
        state = self._requests[req_id]
        self._end_request(state)
        if not state.transfer_jobs:
            del self._requests[req_id]
            freed.append(req_id)

"""The generic worker layer: transfer handlers and the worker that routes jobs to them.

An :class:`OffloadingHandler` moves bytes for one or more ``(source medium, destination medium)``
pairs, asynchronously. :class:`OffloadingWorker` routes each job to the handler registered for
its media and turns every way a job can fail (no handler, a handler that raises or refuses) into a
``TransferResult(success=False)``, so that each submitted job is reported exactly once, failures
included, and a broken handler never takes the engine down.
"""

from __future__ import annotations

import enum
import logging
import time
from abc import ABC, abstractmethod
from collections.abc import Collection

from kvoffload.errors import ContractError
from kvoffload.manager_contract import LoadStoreSpec
from kvoffload.transfer import TransferResult

__all__ = ["OffloadingHandler", "OffloadingWorker", "TransferSpec", "WorkerState"]

logger = logging.getLogger(__name__)

_GIVE_UP_SECONDS = 30.0  # how long a broken handler may take to stop its running copies
_MIN_POLL_SECONDS = 0.0001
_MAX_POLL_SECONDS = 0.002

#: ``(source, destination)`` of one job.
TransferSpec = tuple[LoadStoreSpec, LoadStoreSpec]


class WorkerState(enum.Enum):
    """Lifecycle of handlers, workers and the connector worker."""

    #: Built, but the KV caches are not registered yet (connector worker only).
    CREATED = "created"
    RUNNING = "running"
    SHUT_DOWN = "shut down"


def check_state(owner: object, state: WorkerState, expected: WorkerState, action: str) -> None:
    """Raise ``RuntimeError`` naming the state when ``owner`` cannot do ``action`` in ``state``."""
    if state is not expected:
        raise RuntimeError(
            f"{type(owner).__name__} is {state.value}: cannot {action} (needs {expected.value})"
        )


class OffloadingHandler(ABC):
    """Runs transfers asynchronously. Subclasses implement the four methods below.

    Contract: every job accepted by :meth:`transfer_async` is reported exactly once by
    :meth:`get_finished` (or by :meth:`shutdown`), failed or not. Methods are called from one
    thread (the engine's); handlers may copy on their own threads or streams.
    """

    @abstractmethod
    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        """Start copying ``spec[0]`` to ``spec[1]``; return whether the job was accepted.

        May raise on a malformed spec, before anything was copied.
        """

    @abstractmethod
    def get_finished(self) -> list[TransferResult]:
        """Return the jobs finished since the last call, each exactly once. Never blocks."""

    @abstractmethod
    def wait(self, job_ids: Collection[int], timeout: float | None = None) -> None:
        """Block until every listed job has finished (ids not in flight are ignored).

        Raises ``TimeoutError`` after ``timeout`` seconds. Does not consume the results.
        """

    @abstractmethod
    def shutdown(self, timeout: float | None = None) -> list[TransferResult]:
        """Stop: cancel queued work, wait for running copies, release resources.

        Returns every result not reported yet (cancelled jobs as failures). Idempotent.
        """


class OffloadingWorker:
    """Routes jobs by ``(src.medium, dst.medium)`` to registered handlers.

    Invariants: a job id is in flight at most once; each submitted job is reported exactly once
    by :meth:`get_finished` or :meth:`shutdown`. ``_in_flight`` maps job id -> (handler,
    direction). A handler that raises outside ``transfer_async`` is *broken*: its jobs are
    reported failed and it gets no more work (it is still shut down at the end).
    """

    def __init__(self) -> None:
        self._handlers: dict[tuple[str, str], OffloadingHandler] = {}
        self._in_flight: dict[int, tuple[OffloadingHandler, tuple[str, str]]] = {}
        self._unreported: list[TransferResult] = []  # results not reported yet
        self._broken: list[OffloadingHandler] = []
        self._state = WorkerState.RUNNING
        # The registered handlers, once each; while no handler was replaced (so every job in
        # flight is on one of them) and none broke, they are the active ones: no per-step rebuild.
        self._registered: list[OffloadingHandler] = []
        self._replaced = False

    @property
    def state(self) -> WorkerState:
        return self._state

    def register_handler(
        self, src_medium: str, dst_medium: str, handler: OffloadingHandler, replace: bool = False
    ) -> None:
        """Route ``(src_medium, dst_medium)`` jobs to ``handler`` (``replace`` an existing one)."""
        check_state(self, self._state, WorkerState.RUNNING, "register a handler")
        key = (src_medium, dst_medium)
        if key in self._handlers and not replace:
            raise ContractError(f"a handler for {src_medium} -> {dst_medium} is already registered")
        self._replaced = self._replaced or key in self._handlers
        self._handlers[key] = handler
        self._registered = list({id(h): h for h in self._handlers.values()}.values())

    def handler(self, src_medium: str, dst_medium: str) -> OffloadingHandler:
        """The handler registered for ``(src_medium, dst_medium)`` (``KeyError`` if none)."""
        return self._handlers[(src_medium, dst_medium)]

    def _active_handlers(self) -> list[OffloadingHandler]:
        """Registered handlers and handlers with jobs in flight (replaced ones too), once each."""
        if not self._replaced and not self._broken:
            return self._registered
        handlers = [*self._handlers.values(), *(h for h, _ in self._in_flight.values())]
        return [
            h
            for h in {id(h): h for h in handlers}.values()
            if not any(h is b for b in self._broken)
        ]

    def transfer_async(self, job_id: int, spec: TransferSpec) -> bool:
        """Submit a job; return whether it is in flight. A refused job is reported as failed.

        Raises :class:`ContractError` (and records nothing) for an id already in flight.
        """
        check_state(self, self._state, WorkerState.RUNNING, "submit a transfer")
        if job_id in self._in_flight or any(r.job_id == job_id for r in self._unreported):
            raise ContractError(f"job {job_id} is already in flight")
        src, dst = spec
        direction = (src.medium, dst.medium)
        handler = self._handlers.get(direction)
        if handler is None:
            return self._refuse(
                job_id, direction, f"no handler for {direction[0]} -> {direction[1]}"
            )
        try:
            accepted = handler.transfer_async(job_id, spec)
        except Exception as exc:
            return self._refuse(job_id, direction, f"{type(exc).__name__}: {exc}")
        if not accepted:
            return self._refuse(job_id, direction, "refused by the handler")
        self._in_flight[job_id] = (handler, direction)
        return True

    def _refuse(self, job_id: int, direction: tuple[str, str], why: str) -> bool:
        logger.warning(
            "transfer job %d (%s -> %s) failed at submission: %s", job_id, *direction, why
        )
        self._unreported.append(TransferResult(job_id, False, direction=direction))
        return False

    def get_finished(self) -> list[TransferResult]:
        """Return the jobs finished since the last call, failures included, each exactly once."""
        check_state(self, self._state, WorkerState.RUNNING, "collect finished transfers")
        if self._in_flight:  # else no handler holds a result to collect (most engine steps)
            self._collect()
        results, self._unreported = self._unreported, []
        return results

    @property
    def num_in_flight(self) -> int:
        """Jobs submitted and not reported yet (finished ones waiting for get_finished included)."""
        return len(self._in_flight) + len(self._unreported)

    def wait_for_any(self, timeout: float) -> bool:
        """Block until some job is ready for :meth:`get_finished` or ``timeout`` seconds pass.

        Returns whether one is ready; returns False at once when nothing is in flight. Polls the
        handlers with a backoff from 0.1 ms to 2 ms (so it adds at most ~2 ms of latency).
        """
        check_state(self, self._state, WorkerState.RUNNING, "wait for transfers")
        deadline = time.monotonic() + timeout
        delay = _MIN_POLL_SECONDS
        while True:
            self._collect()
            if self._unreported:
                return True
            left = deadline - time.monotonic()
            if not self._in_flight or left <= 0:
                return False
            time.sleep(min(delay, left))
            delay = min(2 * delay, _MAX_POLL_SECONDS)

    def _collect(self) -> None:
        """Move the handlers' finished results into ``_unreported``."""
        for handler in self._active_handlers():
            try:
                finished = handler.get_finished()
            except Exception:
                logger.exception(
                    "handler %s failed in get_finished; failing its jobs", type(handler).__name__
                )
                self._give_up_on(handler)
                continue
            for result in finished:
                if self._in_flight.pop(result.job_id, None) is not None:
                    self._unreported.append(result)

    def _give_up_on(self, handler: OffloadingHandler) -> None:
        """Stop a broken handler, report its jobs failed and route nothing more to it.

        It is shut down *before* its jobs are reported: a failed job's host slots and engine
        blocks are reused at once (freed, or recomputed into), so no copy of it may still run.
        """
        self._broken.append(handler)
        self._handlers = {k: h for k, h in self._handlers.items() if h is not handler}
        try:
            handler.shutdown(timeout=_GIVE_UP_SECONDS)
        except Exception:
            logger.exception("broken handler %s also failed to shut down", type(handler).__name__)
        for job_id, (h, direction) in list(self._in_flight.items()):
            if h is handler:
                del self._in_flight[job_id]
                self._unreported.append(TransferResult(job_id, False, direction=direction))

    def wait(self, job_ids: Collection[int], timeout: float | None = None) -> None:
        """Block until the listed jobs have finished (ids not in flight are ignored).

        Raises ``TimeoutError`` after ``timeout`` seconds.
        """
        check_state(self, self._state, WorkerState.RUNNING, "wait for transfers")
        deadline = None if timeout is None else time.monotonic() + timeout
        by_handler: dict[int, tuple[OffloadingHandler, list[int]]] = {}
        for job_id in job_ids:
            entry = self._in_flight.get(job_id)
            if entry is not None:
                by_handler.setdefault(id(entry[0]), (entry[0], []))[1].append(job_id)
        for handler, ids in by_handler.values():
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                handler.wait(ids, left)
            except TimeoutError:
                raise
            except Exception:
                logger.exception(
                    "handler %s failed in wait; failing its jobs", type(handler).__name__
                )
                self._give_up_on(handler)

    def shutdown(self, timeout: float | None = None) -> list[TransferResult]:
        """Shut every handler down; return all results not reported yet. Idempotent."""
        if self._state is WorkerState.SHUT_DOWN:
            return []
        self._state = WorkerState.SHUT_DOWN
        handlers = self._active_handlers()
        for handler in [*handlers, *self._broken]:
            try:
                finished = handler.shutdown(timeout)
            except Exception:
                logger.exception("handler %s failed to shut down", type(handler).__name__)
                continue
            for result in finished:
                if self._in_flight.pop(result.job_id, None) is not None:
                    self._unreported.append(result)
        results, self._unreported = self._unreported, []
        results.extend(
            TransferResult(j, False, direction=d) for j, (_, d) in self._in_flight.items()
        )
        self._in_flight.clear()
        self._handlers.clear()
        return results

    def __enter__(self) -> OffloadingWorker:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

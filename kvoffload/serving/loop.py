"""``EngineLoop``: the reference engine on a thread of its own, fed by an asyncio server.

The engine is not thread-safe, so one thread owns it, from its first step to its ``close``: it
takes queued commands (add a request, abort one, stop; each a small object that applies itself)
between steps, steps while there is work (live requests, or transfers still in
flight: a finished request's stores reach the tiers and their KV events go out even when no
request follows), and hands each step's new tokens to the requests' :class:`RequestStream`
through the event loop (one ``call_soon_threadsafe`` per step). Requests are added while others
run: the engine's scheduler batches them continuously. Its lifecycle is :class:`LoopState`.

It also measures the engine's cost: a step of ``n`` forward tokens takes about ``base + n *
per_token`` seconds, fitted by exponentially weighted least squares over the steps that computed
something (:class:`StepCostModel`); the router reads the fit from ``/metrics``.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import enum
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvoffload.engine import Engine, RequestOutput, SamplingParams
from kvoffload.errors import ConfigError, ContractError, KVOffloadError
from kvoffload.scheduler.costs import StepCostModel

__all__ = ["Delta", "EngineLoop", "LoopState", "RequestStream", "StepCostModel", "Unavailable"]

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.25


class Unavailable(KVOffloadError):
    """The server cannot take or finish the request (shutting down, or its engine failed): not
    the request's fault, so another server may serve it (HTTP 503)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@dataclass(slots=True)
class Delta:
    """What one step added to a request: new token ids (and their log-probabilities when asked
    for); ``finished`` is its output when it ended in that step; ``error`` when it was refused
    (:class:`ConfigError`: the request's fault) or could not be served (:class:`Unavailable`)."""

    token_ids: list[int]
    logprobs: list[dict[int, float]]
    finished: RequestOutput | None = None
    error: ConfigError | Unavailable | None = None


class RequestStream:
    """The deltas of one request, in order; iterate with ``async for``. Ends after the delta
    that carries ``finished`` or ``error``."""

    def __init__(self, request_id: str) -> None:
        self.request_id = request_id
        self._queue: asyncio.Queue[Delta] = asyncio.Queue()
        self.done = False

    def put(self, delta: Delta) -> None:
        self._queue.put_nowait(delta)

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> Delta:
        if self.done:
            raise StopAsyncIteration
        delta = await self._queue.get()
        if delta.finished is not None or delta.error is not None:
            self.done = True
        return delta


class LoopState(enum.Enum):
    """Lifecycle of an :class:`EngineLoop`: ``NEW`` -> ``RUNNING`` (:meth:`EngineLoop.start`)
    -> ``DRAINING`` or ``ABORTING`` (a stop taken by the engine thread) -> ``CLOSED``, or
    ``FAILED`` from any running state (the engine raised). Set by the engine thread only, except
    ``RUNNING``; ``CLOSED`` and ``FAILED`` under the loop's lock (:meth:`EngineLoop.add`)."""

    NEW = "new"
    RUNNING = "running"
    DRAINING = "draining"
    ABORTING = "aborting"
    CLOSED = "closed"
    FAILED = "failed"


#: The states in which the engine thread takes no more requests.
_STOPPING = (LoopState.DRAINING, LoopState.ABORTING)
_ENDED = (LoopState.CLOSED, LoopState.FAILED)


@dataclass(slots=True)
class _Add:
    stream: RequestStream
    token_ids: list[int]
    sampling: SamplingParams
    kv_transfer_params: dict[str, Any] | None

    def apply(self, loop: EngineLoop) -> None:
        loop._add(self)

    def refuse(self, error: Unavailable) -> list[tuple[RequestStream, Delta]]:
        return [(self.stream, Delta([], [], error=error))]


@dataclass(slots=True)
class _Abort:
    request_id: str

    def apply(self, loop: EngineLoop) -> None:
        loop._abort(self.request_id)

    def refuse(self, error: Unavailable) -> list[tuple[RequestStream, Delta]]:
        return []


@dataclass(slots=True)
class _Stop:
    drain: bool

    def apply(self, loop: EngineLoop) -> None:
        loop._stop(self.drain)

    def refuse(self, error: Unavailable) -> list[tuple[RequestStream, Delta]]:
        return []


@dataclass(slots=True)
class _Call:
    """Run ``fn`` on the engine thread between steps; its result or error goes to ``future``."""

    fn: Callable[[], Any]
    future: concurrent.futures.Future[Any]

    def apply(self, loop: EngineLoop) -> None:
        if self.future.set_running_or_notify_cancel():
            try:
                self.future.set_result(self.fn())
            except Exception as exc:  # the caller's to answer; the engine goes on
                self.future.set_exception(exc)

    def refuse(self, error: Unavailable) -> list[tuple[RequestStream, Delta]]:
        if self.future.set_running_or_notify_cancel():
            self.future.set_exception(error)
        return []


_Command = _Add | _Abort | _Stop | _Call


class EngineLoop:
    """Runs ``engine`` on its own thread; :meth:`add` and :meth:`abort` are called from the
    event loop passed to :meth:`start`. :meth:`stop` lets live requests finish (``drain``) or
    aborts them, then lets in-flight stores land and closes the engine. The engine is touched
    by that thread only (it is not thread-safe), closing included; commands reach the thread
    through a queue, each an object that knows what it does (:meth:`_add`, :meth:`_abort`,
    :meth:`_stop`)."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.cost = StepCostModel()
        self._commands: queue.SimpleQueue[_Command] = queue.SimpleQueue()
        self._streams: dict[str, tuple[RequestStream, int]] = {}  # id -> (stream, tokens sent)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._step_due = False  # an abort's output waits in the engine for the next step
        self.failed: BaseException | None = None
        # CLOSED/FAILED are set once by the engine thread as it ends, under the lock: an add
        # either sees it and is answered at once, or its command was queued before and is
        # answered by that thread.
        self._closing = threading.Lock()
        self.state = LoopState.NEW

    @property
    def alive(self) -> bool:
        """The engine thread runs and has not failed (it may be stopping)."""
        return (self._thread is not None and self._thread.is_alive()
                and self.state not in _ENDED and self.failed is None)

    @property
    def thread_running(self) -> bool:
        """The engine thread was started and has not ended: it owns the engine."""
        return self._thread is not None and self._thread.is_alive()

    @property
    def num_live(self) -> int:
        return len(self._streams)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.state is not LoopState.NEW:
            raise ContractError(f"EngineLoop is {self.state.value}: cannot start (needs new)")
        self.state = LoopState.RUNNING
        self._loop = loop
        self._thread = threading.Thread(target=self._run, name="kvoffload-engine", daemon=True)
        self._thread.start()

    def add(
        self,
        request_id: str,
        token_ids: list[int],
        sampling: SamplingParams,
        kv_transfer_params: dict[str, Any] | None,
    ) -> RequestStream:
        stream = RequestStream(request_id)
        with self._closing:
            if self.state in _ENDED:
                stream.put(Delta([], [], error=self._unavailable()))
            else:
                self._commands.put(_Add(stream, token_ids, sampling, kv_transfer_params))
        return stream

    def abort(self, request_id: str) -> None:
        self._commands.put(_Abort(request_id))

    def call(self, fn: Callable[[], Any]) -> concurrent.futures.Future[Any]:
        """Run ``fn()`` on the engine thread between two steps (operator controls); the future
        holds its result or its exception, or :class:`Unavailable` once the loop ended."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._closing:
            if self.state in _ENDED:
                future.set_exception(self._unavailable())
            else:
                self._commands.put(_Call(fn, future))
        return future

    def stop(self, drain: bool = True, timeout_s: float = 60.0) -> bool:
        """Stop taking requests; finish (``drain``) or abort the live ones; let stores land;
        close the engine (on its thread). Blocks up to ``timeout_s`` for the thread; returns
        whether it ended."""
        self._commands.put(_Stop(drain))
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("engine thread still running after %.0f s", timeout_s)
                return False
        return True

    def close(self, timeout_s: float = 60.0) -> None:
        """End for good, whatever happened before: aborts what still runs; closes the engine
        here only if its thread never started. An engine thread that outlives ``timeout_s`` is
        left with its engine (logged as an error): closing an engine beside the thread that
        runs it would corrupt it; the process is ending anyway."""
        if self._thread is None:
            self.state = LoopState.CLOSED
            self.engine.close()
        elif self._thread.is_alive() and not self.stop(drain=False, timeout_s=timeout_s):
            logger.error("the engine thread did not end in %.0f s: the engine is not closed "
                         "(its stores may not have landed)", timeout_s)

    # -- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                self._take_commands(block=not self._busy())
                if self.state in _STOPPING and not self._streams:
                    break
                if self._busy():
                    self._step()
            engine.drain()
        except BaseException as exc:  # reported by /health; every waiting request is failed
            self.failed = exc
            logger.exception("engine loop failed")
            self._fail_all(exc)
        finally:
            self._close_commands()
            try:
                engine.close()
            except Exception:
                logger.exception("engine close failed")

    def _unavailable(self) -> Unavailable:
        if self.failed is not None:
            return Unavailable(f"the engine failed: {self.failed!r}")
        return Unavailable("the server is shutting down")

    def _close_commands(self) -> None:
        """No command is taken from here on: requests still queued are answered unavailable."""
        with self._closing:
            self.state = LoopState.FAILED if self.failed is not None else LoopState.CLOSED
        refused: list[tuple[RequestStream, Delta]] = []
        with contextlib.suppress(queue.Empty):
            while True:
                refused += self._commands.get_nowait().refuse(self._unavailable())
        self._post(refused)

    def _busy(self) -> bool:
        engine = self.engine
        connector = engine.connector
        return self._step_due or engine.has_unfinished() or (
            connector is not None and (connector.has_pending_jobs() or bool(engine.scheduler.held))
        )

    def _take_commands(self, block: bool) -> None:
        try:
            command = self._commands.get(timeout=_IDLE_WAIT_S) if block else None
            while True:
                if command is None:
                    command = self._commands.get_nowait()
                command.apply(self)
                command = None
        except queue.Empty:
            return

    def _add(self, command: _Add) -> None:
        stream = command.stream
        if self.state in _STOPPING:
            self._post(command.refuse(Unavailable("the server is shutting down")))
            return
        try:
            self.engine.add_request(command.token_ids, command.sampling, stream.request_id,
                                    command.kv_transfer_params)
        except ConfigError as exc:
            self._post([(stream, Delta([], [], error=exc))])
            return
        self._streams[stream.request_id] = (stream, 0)

    def _abort(self, request_id: str) -> None:
        self.engine.abort(request_id)
        self._step_due = True

    def _stop(self, drain: bool) -> None:
        if self.state is LoopState.ABORTING or (drain and self.state is LoopState.DRAINING):
            return  # a second stop may only turn draining into aborting
        self.state = LoopState.DRAINING if drain else LoopState.ABORTING
        if not drain:
            for request_id in list(self._streams):
                self.engine.abort(request_id)
            self._step_due = True

    def _step(self) -> None:
        engine = self.engine
        self._step_due = False
        before = engine.stats()["forward_tokens"]
        start = time.perf_counter()
        finished = engine.step()
        seconds = time.perf_counter() - start
        tokens = int(engine.stats()["forward_tokens"] - before)
        if tokens:
            self.cost.observe(tokens, seconds)
        out: list[tuple[RequestStream, Delta]] = []
        for output in finished:
            entry = self._streams.pop(output.request_id, None)
            if entry is not None:
                stream, sent = entry
                lps = output.logprobs[sent:] if output.logprobs else []
                out.append((stream, Delta(output.output_token_ids[sent:], lps, finished=output)))
        for request_id, (stream, sent) in self._streams.items():
            live = engine.live_output(request_id)
            if live is not None and len(live[0]) > sent:
                tokens_so_far, logprobs = live
                out.append((stream, Delta(tokens_so_far[sent:], logprobs[sent:])))
                self._streams[request_id] = (stream, len(tokens_so_far))
        if out:
            self._post(out)

    def _post(self, items: list[tuple[RequestStream, Delta]]) -> None:
        loop = self._loop
        if loop is None or loop.is_closed():
            return

        def deliver() -> None:
            for stream, delta in items:
                stream.put(delta)

        with contextlib.suppress(RuntimeError):  # the event loop closed meanwhile
            loop.call_soon_threadsafe(deliver)

    def _fail_all(self, exc: BaseException) -> None:
        error = Unavailable(f"the engine failed: {exc!r}")
        items = [(stream, Delta([], [], error=error)) for stream, _ in self._streams.values()]
        self._streams.clear()
        self._post(items)

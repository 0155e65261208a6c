"""``EngineLoop``: the reference engine on a thread of its own, fed by an asyncio server.

The engine is not thread-safe, so one thread owns it: it takes queued commands (add a request,
abort one) between steps, steps while there is work (live requests, or transfers still in
flight: a finished request's stores reach the tiers and their KV events go out even when no
request follows), and hands each step's new tokens to the requests' :class:`RequestStream`
through the event loop (one ``call_soon_threadsafe`` per step). Requests are added while others
run: the engine's scheduler batches them continuously.

It also measures the engine's cost: a step of ``n`` forward tokens takes about ``base + n *
per_token`` seconds, fitted by exponentially weighted least squares over the steps that computed
something (:class:`StepCostModel`); the router reads the fit from ``/metrics``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any

from kvoffload.engine import Engine, RequestOutput, SamplingParams
from kvoffload.errors import ConfigError

__all__ = ["Delta", "EngineLoop", "RequestStream", "StepCostModel"]

logger = logging.getLogger(__name__)

_IDLE_WAIT_S = 0.25


class Unavailable(Exception):
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


class StepCostModel:
    """``seconds ~ base_s + per_token_s * tokens`` per engine step, by exponentially weighted
    least squares (``decay`` per step). Where the fit is not positive (one token count seen so
    far, or noise tipping the base below zero or the slope to it), the line through the origin
    that fits best: ``per_token_s = sum(tokens * seconds) / sum(tokens^2)``, dominated by the
    large (prefill) steps, never the mean step time over the mean token count (a few-token
    decode step would charge its whole fixed cost to each token: a prefill predicted 10x too
    slow)."""

    def __init__(self, decay: float = 0.98) -> None:
        self.decay = decay
        self._w = self._x = self._y = self._xx = self._xy = 0.0
        self.steps = 0
        self.seconds = 0.0
        self.tokens = 0

    def observe(self, tokens: int, seconds: float) -> None:
        d = self.decay
        self._w = self._w * d + 1
        self._x = self._x * d + tokens
        self._y = self._y * d + seconds
        self._xx = self._xx * d + tokens * tokens
        self._xy = self._xy * d + tokens * seconds
        self.steps += 1
        self.seconds += seconds
        self.tokens += tokens

    def fit(self) -> tuple[float, float]:
        """``(base_s, per_token_s)``, both >= 0 (``(0, 0)`` before any step)."""
        if self._x <= 0:
            return 0.0, 0.0
        through_origin = 0.0, max(self._xy / self._xx, 0.0)
        denom = self._w * self._xx - self._x * self._x
        if denom <= 1e-9 * self._w * self._xx:
            return through_origin
        slope = (self._w * self._xy - self._x * self._y) / denom
        base = (self._y - slope * self._x) / self._w
        if slope <= 0 or base < 0:
            return through_origin
        return base, slope


class EngineLoop:
    """Runs ``engine`` on its own thread; :meth:`add` and :meth:`abort` are called from the
    event loop passed to :meth:`start`. :meth:`stop` lets live requests finish (``drain``) or
    aborts them, then lets in-flight stores land and closes the engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.cost = StepCostModel()
        self._commands: queue.SimpleQueue[tuple[str, Any]] = queue.SimpleQueue()
        self._streams: dict[str, tuple[RequestStream, int]] = {}  # id -> (stream, tokens sent)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping: str | None = None  # None, "drain" or "abort"
        self._step_due = False  # an abort's output waits in the engine for the next step
        self.failed: BaseException | None = None
        # Set once by the engine thread as it ends, under the lock: an add either sees it and is
        # answered at once, or its command was queued before and is answered by that thread.
        self._closing = threading.Lock()
        self._closed = False

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and self.failed is None

    @property
    def num_live(self) -> int:
        return len(self._streams)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
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
            if self._closed:
                stream.put(Delta([], [], error=self._unavailable()))
            else:
                self._commands.put(("add", (stream, token_ids, sampling, kv_transfer_params)))
        return stream

    def abort(self, request_id: str) -> None:
        self._commands.put(("abort", request_id))

    def stop(self, drain: bool = True, timeout_s: float = 60.0) -> None:
        """Stop taking requests; finish (``drain``) or abort the live ones; let stores land;
        close the engine. Blocks up to ``timeout_s`` for the thread."""
        self._commands.put(("stop", "drain" if drain else "abort"))
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("engine thread still running after %.0f s", timeout_s)

    # -- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        engine = self.engine
        try:
            while True:
                self._take_commands(block=not self._busy())
                if self._stopping and not self._streams:
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
            self._closed = True
        refused = []
        with contextlib.suppress(queue.Empty):
            while True:
                kind, arg = self._commands.get_nowait()
                if kind == "add":
                    refused.append((arg[0], Delta([], [], error=self._unavailable())))
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
                self._apply(*command)
                command = None
        except queue.Empty:
            return

    def _apply(self, kind: str, arg: Any) -> None:
        if kind == "add":
            stream, token_ids, sampling, params = arg
            if self._stopping:
                self._post([(stream, Delta([], [], error=Unavailable("the server is shutting down")))])
                return
            try:
                self.engine.add_request(token_ids, sampling, stream.request_id, params)
            except ConfigError as exc:
                self._post([(stream, Delta([], [], error=exc))])
                return
            self._streams[stream.request_id] = (stream, 0)
        elif kind == "abort":
            self.engine.abort(arg)
            self._step_due = True
        elif kind == "stop":
            self._stopping = arg
            if arg == "abort":
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

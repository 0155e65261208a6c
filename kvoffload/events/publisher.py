"""Event publishers: one batch per engine step, sent over ZMQ without ever blocking the step.

:class:`ZmqEventPublisher` numbers each accepted batch (``seq``, from 0) inside :meth:`publish`,
queues it, and returns. A daemon thread encodes and sends queued batches on a PUB socket
(framing in :mod:`kvoffload.events.protocol`), keeps the last ``buffer_steps`` of them, and
answers replay requests on an optional ROUTER socket. When the queue is full, :meth:`publish`
drops the oldest queued batch and counts it (``dropped``); because numbers are given at publish
time, a dropped batch is a visible gap in ``seq`` for subscribers (one replay cannot fill).

Lifecycle: ``RUNNING`` from construction; :meth:`~EventPublisher.shutdown` moves to ``CLOSING``,
sends what is queued (bounded time), closes the sockets, and ends ``CLOSED``. ``publish`` in any
state but ``RUNNING`` raises :class:`~kvoffload.errors.ContractError` naming the state.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import deque
from types import TracebackType

import zmq

from kvoffload.errors import ConfigError, ContractError
from kvoffload.events.codec import EventEncoder
from kvoffload.events.config import KVEventsConfig
from kvoffload.events.messages import KVEventBatch
from kvoffload.events.protocol import (
    REPLAY_END,
    binds_by_default,
    decode_seq,
    encode_seq,
    exposed_beyond_host,
    offset_endpoint,
)

__all__ = [
    "EventPublisher",
    "NullEventPublisher",
    "PublisherState",
    "ZmqEventPublisher",
    "create_event_publisher",
    "warn_if_exposed",
]

logger = logging.getLogger(__name__)

# How often an idle sender thread looks for replay requests (a publish wakes it at once).
_REPLAY_POLL_S = 0.02


def warn_if_exposed(field: str, endpoint: str) -> None:
    """Log a warning when a socket about to be bound at ``endpoint`` is reachable from other
    hosts: whoever connects reads every prompt's token ids (the replay socket serves its whole
    buffer to anyone who asks)."""
    if exposed_beyond_host(endpoint):
        logger.warning(
            "KV events %s %s is reachable from other hosts: events carry every prompt's token ids "
            "(and the replay socket serves its buffered history to whoever connects). Bind "
            "127.0.0.1 unless other hosts must subscribe, and then restrict who can reach it.",
            field,
            endpoint,
        )


class PublisherState(enum.Enum):
    """Where a publisher is in its life: RUNNING -> CLOSING (flushing) -> CLOSED."""

    RUNNING = "running"
    CLOSING = "closing"
    CLOSED = "closed"


class EventPublisher(ABC):
    """Publishes :class:`~kvoffload.events.messages.KVEventBatch` objects; a context manager.

    The engine calls :meth:`publish` once per step that produced events, from one thread, and
    :meth:`shutdown` once at exit. ``publish`` takes ownership of the batch: the caller must not
    change it afterwards.
    """

    def __init__(self) -> None:
        self._state = PublisherState.RUNNING

    @property
    def state(self) -> PublisherState:
        return self._state

    @abstractmethod
    def publish(self, batch: KVEventBatch) -> None:
        """Hand ``batch`` over for sending; never blocks on the network."""

    @abstractmethod
    def shutdown(self, timeout_s: float = 1.0) -> None:
        """Send what is queued (for at most ``timeout_s``), then close. Idempotent."""

    @abstractmethod
    def stats(self) -> dict[str, int]:
        """Return monotonic counters and current gauges."""

    def _check_running(self) -> None:
        if self._state is not PublisherState.RUNNING:
            raise ContractError(f"publish() on a {self._state.name} publisher")

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.shutdown()


class NullEventPublisher(EventPublisher):
    """Accepts batches and sends nothing (events disabled). ``stats()``: ``published``."""

    def __init__(self) -> None:
        super().__init__()
        self._published = 0

    def publish(self, batch: KVEventBatch) -> None:
        self._check_running()
        self._published += 1

    def shutdown(self, timeout_s: float = 1.0) -> None:
        self._state = PublisherState.CLOSED

    def stats(self) -> dict[str, int]:
        return {"published": self._published}


class ZmqEventPublisher(EventPublisher):
    """Publishes batches on a ZMQ PUB socket from a background thread.

    ``endpoint`` is bound when ``bind`` is true, connected (to a subscriber that binds it) when
    false; unset, :func:`~kvoffload.events.protocol.binds_by_default` decides (a wildcard,
    loopback, ipc or inproc address binds). ``replay_endpoint`` is always bound. Binding an
    address other hosts can reach logs a warning (:func:`warn_if_exposed`). Pass ``context`` to share a ZMQ context (required for
    ``inproc://`` subscribers); otherwise the publisher owns one and terminates it on shutdown,
    which waits (within ``timeout_s``) until sent messages have left the process. Failing to
    bind or connect raises :class:`~kvoffload.errors.ConfigError` naming the endpoint field.

    ``stats()``: ``published`` (batches accepted = next seq), ``sent``, ``dropped`` (queue full,
    or unsent at shutdown), ``encode_errors``, ``send_errors``, ``replay_requests``,
    ``bad_replay_requests`` (counters); ``queued``, ``buffered`` (gauges).
    """

    def __init__(
        self,
        endpoint: str = "tcp://127.0.0.1:5557",
        *,
        bind: bool | None = None,
        replay_endpoint: str | None = None,
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        max_queue_size: int = 100_000,
        topic: str = "",
        legacy_array_events: bool = False,
        data_parallel_rank: int = 0,
        context: zmq.Context | None = None,
    ) -> None:
        super().__init__()
        if max_queue_size < 1:
            raise ConfigError("max_queue_size", f"must be >= 1, got {max_queue_size}")
        self._data_parallel_rank = data_parallel_rank
        self._topic = topic.encode()
        self._max_queue_size = max_queue_size
        self._encoder = EventEncoder(legacy_array_events)
        self._owns_context = context is None
        self._ctx = zmq.Context() if context is None else context
        self._pub: zmq.Socket = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        self.replay_endpoint: str | None = None
        try:
            self._pub.setsockopt(zmq.SNDHWM, hwm)
            binds = binds_by_default(endpoint) if bind is None else bind
            self.endpoint = self._attach(self._pub, "endpoint", endpoint, binds)
            if bind is None and not binds:  # the default rule chose: nothing flows unless
                logger.warning(  # some subscriber binds, and nobody may notice
                    "KV events: publishing by connecting to %s (vLLM's rule for a specific "
                    "address): a subscriber must bind it (events listen --bind); set the events "
                    "config's \"bind\": true to bind it here, or false to silence this",
                    endpoint,
                )
            #: Whether ``endpoint`` is bound (else connected: a subscriber must bind it).
            self.binds = binds
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                # A whole buffer must fit in one client's pipe, or ROUTER drops the excess.
                self._replay.setsockopt(zmq.SNDHWM, buffer_steps + 1)
                self.replay_endpoint = self._attach(
                    self._replay, "replay_endpoint", replay_endpoint, True
                )
        except ConfigError:
            self._close_sockets(0)
            raise

        # Guarded by _cond: the queue, _next_seq, _dropped, _state changes, _flush_deadline.
        self._cond = threading.Condition(threading.Lock())
        self._queue: deque[tuple[int, KVEventBatch]] = deque()
        self._next_seq = 0
        self._dropped = 0
        self._flush_deadline = 0.0
        # Owned by the sender thread.
        self._buffer: deque[tuple[bytes, bytes]] = deque(maxlen=buffer_steps)
        self._sent = self._encode_errors = self._send_errors = 0
        self._replay_requests = self._bad_replay_requests = 0
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()

    @staticmethod
    def _attach(sock: zmq.Socket, field: str, endpoint: str, bind: bool) -> str:
        try:
            if bind:
                warn_if_exposed(field, endpoint)
                sock.bind(endpoint)
                return sock.getsockopt_string(zmq.LAST_ENDPOINT)
            sock.connect(endpoint)
            logger.info(
                "KV events %s: connecting to %s, where a subscriber must bind", field, endpoint
            )
            return endpoint
        except zmq.ZMQError as exc:
            action = "bind" if bind else "connect to"
            raise ConfigError(field, f"cannot {action} {endpoint!r}: {exc}") from exc

    @property
    def dropped(self) -> int:
        """Batches accepted by :meth:`publish` that were never sent."""
        return self._dropped

    def publish(self, batch: KVEventBatch) -> None:
        if type(batch) is not KVEventBatch:
            raise ContractError(f"publish() takes a KVEventBatch, got {type(batch).__name__}")
        if batch.data_parallel_rank is None:
            batch.data_parallel_rank = self._data_parallel_rank
        with self._cond:
            self._check_running()
            queue = self._queue
            if len(queue) >= self._max_queue_size:
                queue.popleft()
                self._dropped += 1
            queue.append((self._next_seq, batch))
            self._next_seq += 1
            self._cond.notify()

    def shutdown(self, timeout_s: float = 1.0) -> None:
        with self._cond:
            if self._state is PublisherState.CLOSED:
                return
            if self._state is PublisherState.RUNNING:
                self._state = PublisherState.CLOSING
                self._flush_deadline = time.monotonic() + timeout_s
                self._cond.notify()
        self._thread.join(timeout_s + 1.0)
        if self._thread.is_alive():
            logger.warning("KV event publisher thread did not stop within %.1f s", timeout_s + 1.0)
        self._state = PublisherState.CLOSED

    def stats(self) -> dict[str, int]:
        return {
            "published": self._next_seq,
            "sent": self._sent,
            "dropped": self._dropped,
            "encode_errors": self._encode_errors,
            "send_errors": self._send_errors,
            "replay_requests": self._replay_requests,
            "bad_replay_requests": self._bad_replay_requests,
            "queued": len(self._queue),
            "buffered": len(self._buffer),
        }

    # -- sender thread -------------------------------------------------------------------------

    def _run(self) -> None:
        idle_wait = _REPLAY_POLL_S if self._replay is not None else None
        cond = self._cond
        while True:
            with cond:
                if not self._queue and self._state is PublisherState.RUNNING:
                    cond.wait(idle_wait)
                items = self._queue
                self._queue = deque()
                closing = self._state is not PublisherState.RUNNING
            if closing:
                self._flush(items)
                break
            for seq, batch in items:
                self._send(seq, batch)
            if self._replay is not None:
                self._serve_replays()
        self._close_sockets(max(0, int((self._flush_deadline - time.monotonic()) * 1000)))

    def _flush(self, items: deque[tuple[int, KVEventBatch]]) -> None:
        """Send ``items`` until the shutdown deadline; count the rest as dropped."""
        deadline = self._flush_deadline
        while items and time.monotonic() < deadline:
            self._send(*items.popleft())
        if items:
            with self._cond:
                self._dropped += len(items)
            logger.warning("KV event publisher dropped %d queued batches at shutdown", len(items))

    def _send(self, seq: int, batch: KVEventBatch) -> None:
        try:
            payload = self._encoder.encode(batch)
        except Exception:  # the sender thread must survive any malformed batch
            self._encode_errors += 1
            logger.exception("KV event batch %d could not be encoded; skipped", seq)
            return
        seq_frame = encode_seq(seq)
        self._buffer.append((seq_frame, payload))
        try:
            # PUB never blocks: at the high-water mark ZMQ drops the message for that subscriber.
            self._pub.send_multipart((self._topic, seq_frame, payload), flags=zmq.NOBLOCK)
        except zmq.ZMQError:
            self._send_errors += 1
            logger.warning("KV event batch %d could not be sent", seq, exc_info=True)
            return
        self._sent += 1

    def _serve_replays(self) -> None:
        sock = self._replay
        if sock is None:
            return
        while sock.poll(0, zmq.POLLIN):
            frames = sock.recv_multipart(zmq.NOBLOCK)
            if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
                self._bad_replay_requests += 1
                continue
            identity, start = frames[0], decode_seq(frames[2])
            self._replay_requests += 1
            try:
                for seq_frame, payload in self._buffer:
                    if decode_seq(seq_frame) >= start:
                        sock.send_multipart(
                            (identity, b"", self._topic, seq_frame, payload), flags=zmq.NOBLOCK
                        )
                sock.send_multipart((identity, b"", b"", REPLAY_END, b""), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                self._send_errors += 1
                logger.warning("KV event replay to a client failed", exc_info=True)

    def _close_sockets(self, linger_ms: int) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=linger_ms)
        if self._owns_context:
            self._ctx.term()


def create_event_publisher(
    config: KVEventsConfig, data_parallel_rank: int = 0, context: zmq.Context | None = None
) -> EventPublisher:
    """Return the publisher ``config`` asks for, for data-parallel rank ``data_parallel_rank``.

    A :class:`NullEventPublisher` when events are disabled or ``publisher == "null"``; otherwise a
    :class:`ZmqEventPublisher` binding or connecting as ``config.publisher_binds`` says, on the
    rank's endpoints
    (:func:`~kvoffload.events.protocol.offset_endpoint`).
    """
    if not config.enable_kv_cache_events or config.publisher == "null":
        return NullEventPublisher()
    replay = config.replay_endpoint
    return ZmqEventPublisher(
        offset_endpoint(config.endpoint, data_parallel_rank),
        bind=config.publisher_binds,
        replay_endpoint=None if replay is None else offset_endpoint(replay, data_parallel_rank),
        buffer_steps=config.buffer_steps,
        hwm=config.hwm,
        max_queue_size=config.max_queue_size,
        topic=config.topic,
        legacy_array_events=config.legacy_array_events,
        data_parallel_rank=data_parallel_rank,
        context=context,
    )

"""``KVEventSubscriber``: receives event batches in order, filling sequence gaps from replay.

The subscriber tracks the next sequence number it expects, from 0 (a publisher's first batch)
unless told otherwise. A live batch further ahead means batches were missed (the subscriber
joined late, a high-water mark dropped them, the publisher's queue overflowed): it asks the
publisher's replay socket for them, delivers what comes back in order, then the live batch, and
records a :class:`Gap` saying how many were recovered and how many are lost for good. A live batch behind the expected number was delivered already through
replay (or precedes ``start_seq``) and is skipped. A live number at or below the previous live
one means the publisher restarted (its numbers start again at 0).
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from types import TracebackType

import zmq
from zmq.utils.monitor import recv_monitor_message

from kvoffload.errors import ConfigError, ContractError
from kvoffload.events.codec import EventDecodeError, EventDecoder
from kvoffload.events.messages import KVEventBatch
from kvoffload.events.protocol import SEQ_BYTES, decode_seq, encode_seq
from kvoffload.validation import check_int, check_real

__all__ = ["Gap", "KVEventSubscriber", "ReceivedBatch"]

logger = logging.getLogger(__name__)

_MAX_GAPS_KEPT = 1000
_PEER_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_ACCEPTED


@dataclass(frozen=True, slots=True)
class ReceivedBatch:
    """One batch, as delivered: its sequence number and whether it came through replay.

    ``restarted``: the first batch after the publisher restarted; state built from earlier
    batches (a block index) is stale and must be dropped before applying this one.
    """

    seq: int
    batch: KVEventBatch
    replayed: bool
    restarted: bool = False


@dataclass(frozen=True, slots=True)
class Gap:
    """Batches ``[first_seq, end_seq)`` did not arrive live; ``recovered`` came through replay."""

    first_seq: int
    end_seq: int
    recovered: int

    @property
    def lost(self) -> int:
        """Batches of the gap that neither arrived live nor through replay."""
        return self.end_seq - self.first_seq - self.recovered


class KVEventSubscriber:
    """Subscribes to one publisher's events (``topic`` is a prefix filter; ``""`` takes all).

    ``endpoint`` is bound when ``bind`` is true (for a publisher that connects: vLLM's, given a
    tcp address without a wildcard), connected when false; unset, bound when it holds a wildcard
    (``*``), else connected. When no publisher has reached the socket ``warn_unreached_s``
    seconds after construction (checked in :meth:`receive`), a warning says so once, naming
    the address and the bind rule: nothing binds when both sides connect, and events would
    otherwise go nowhere in silence. :attr:`reached` tells whether one has (``inproc`` is not
    watched: always true). ``start_seq`` is the first batch wanted: 0 (the default) is everything the
    publisher sent, so batches published before the subscription took effect are a gap, counted
    when the first live batch arrives and recovered through ``replay_endpoint`` when given (or at
    once with :meth:`catch_up`); ``None`` starts from whatever arrives first (no history wanted).
    A replay that does not finish within ``replay_timeout_s`` counts its missing batches as lost.

    Not thread-safe. ``stats()``: ``received`` (delivered live), ``replayed`` (delivered through
    replay), ``gaps``, ``lost``, ``skipped``, ``decode_errors``, ``malformed`` (frames that are not
    ``[topic, seq, payload]``), ``replay_timeouts``, ``publisher_restarts``.
    """

    def __init__(
        self,
        endpoint: str,
        topic: str = "",
        replay_endpoint: str | None = None,
        *,
        start_seq: int | None = 0,
        replay_timeout_s: float = 1.0,
        hwm: int = 100_000,
        bind: bool | None = None,
        warn_unreached_s: float = 30.0,
        context: zmq.Context | None = None,
    ) -> None:
        if start_seq is not None:
            check_int("start_seq", start_seq, 0)
        check_real("replay_timeout_s", replay_timeout_s, 0, unit="seconds")
        check_real("warn_unreached_s", warn_unreached_s, 0, unit="seconds")
        check_int("hwm", hwm, 0)
        self._closed = False
        self._replay: zmq.Socket | None = None
        self._monitor: zmq.Socket | None = None
        self._owns_context = context is None
        self._ctx = zmq.Context() if context is None else context
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.RCVHWM, hwm)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic.encode())
        self.replay_endpoint = replay_endpoint
        self._binds = "*" in endpoint if bind is None else bind
        #: Whether a publisher has reached the socket (connected to it, or accepted it).
        self.reached = endpoint.startswith("inproc://")
        if not self.reached:  # watched from before the first connection can happen
            self._monitor = self._sub.get_monitor_socket(_PEER_EVENTS)
        self._warn_at: float | None = time.monotonic() + warn_unreached_s
        try:
            if self._binds:
                self._sub.bind(endpoint)
                endpoint = self._sub.getsockopt_string(zmq.LAST_ENDPOINT)
            else:
                self._sub.connect(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise ConfigError("endpoint", f"cannot subscribe to {endpoint!r}: {exc}") from exc
        if replay_endpoint is not None:
            try:
                self._open_replay_socket()
            except zmq.ZMQError as exc:
                self.close()
                raise ConfigError(
                    "replay_endpoint", f"cannot connect to {replay_endpoint!r}: {exc}"
                ) from exc
        self.endpoint = endpoint
        self._replay_timeout_s = replay_timeout_s
        self._decoder = EventDecoder()
        self._next_seq = start_seq
        self._last_live_seq: int | None = None
        self._restart_pending = False
        self._ready: deque[ReceivedBatch] = deque()
        self._gaps: deque[Gap] = deque(maxlen=_MAX_GAPS_KEPT)
        self._stats = dict.fromkeys(
            (
                "received",
                "replayed",
                "gaps",
                "lost",
                "skipped",
                "decode_errors",
                "malformed",
                "replay_timeouts",
                "publisher_restarts",
            ),
            0,
        )

    @property
    def next_seq(self) -> int | None:
        """The sequence number expected next (``None`` before the first batch without start_seq)."""
        return self._next_seq

    def receive(self, timeout_s: float = 1.0) -> ReceivedBatch | None:
        """Return the next batch in sequence order, waiting up to ``timeout_s`` (else ``None``)."""
        if self._closed:
            raise ContractError("receive() on a closed subscriber")
        deadline = time.monotonic() + timeout_s
        sub = self._sub
        while not self._ready:
            if not self.reached:
                self._watch_peers()
            if not sub.poll(self._wait_ms(deadline), zmq.POLLIN):
                if not self.reached:
                    self._watch_peers()
                return None
            self._on_live(sub.recv_multipart(zmq.NOBLOCK))
            if not self._ready and time.monotonic() >= deadline:
                return None
        return self._ready.popleft()

    def iter_batches(
        self, max_batches: int | None = None, timeout_s: float = 10.0
    ) -> Iterator[ReceivedBatch]:
        """Yield batches until ``max_batches`` were yielded or ``timeout_s`` passed in total."""
        deadline = time.monotonic() + timeout_s
        count = 0
        while max_batches is None or count < max_batches:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            received = self.receive(remaining)
            if received is not None:
                count += 1
                yield received

    def catch_up(self) -> int:
        """Fetch every buffered batch from the next expected one (0 if none) through replay.

        They are delivered by the next :meth:`receive` calls, before any later live batch; live
        copies of them are then skipped. Returns how many were fetched. When no publisher
        serves the replay address yet (a subscriber started before its engine), nothing is
        asked and 0 is returned: the first live batch's gap brings the history then.
        """
        if self._closed:
            raise ContractError("catch_up() on a closed subscriber")
        if self.replay_endpoint is None:
            raise ContractError("catch_up() needs a replay_endpoint")
        if self._next_seq is None:
            self._next_seq = 0
        items = self._request_replay(self._next_seq, None, publisher_may_be_down=True)
        for seq, payload in items or ():
            if seq > self._next_seq:
                self._record_gap(self._next_seq, seq, 0)
            self._deliver(seq, payload, replayed=True)
        return len(items or ())

    def take_gaps(self) -> list[Gap]:
        """Return and forget the gaps met since the last call (at most the last 1000)."""
        gaps = list(self._gaps)
        self._gaps.clear()
        return gaps

    def stats(self) -> dict[str, int]:
        return dict(self._stats)

    def close(self) -> None:
        """Close the sockets (and the context the subscriber owns). Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._stop_watching()
        self._sub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        if self._owns_context:
            self._ctx.term()

    def __enter__(self) -> KVEventSubscriber:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    # -- internals -------------------------------------------------------------------------------

    def _watch_peers(self) -> None:
        """Note a publisher reaching the socket; warn once when none has in time."""
        monitor = self._monitor
        while monitor is not None and monitor.poll(0, zmq.POLLIN):
            if recv_monitor_message(monitor)["event"] & _PEER_EVENTS:
                self._on_reached()
                return
        if self._warn_at is not None and time.monotonic() >= self._warn_at:
            self._warn_at = None
            if self._binds:
                logger.warning(
                    "no KV event publisher has connected to %s yet: is one configured to "
                    "connect there (vLLM's publisher connects to a tcp address without a "
                    "wildcard)?",
                    self.endpoint,
                )
            else:
                logger.warning(
                    "no KV event publisher reached %s yet: is one bound there? A publisher "
                    "given a tcp address without a wildcard connects instead of binding (vLLM's "
                    "rule; kvoffload's publishers bind loopback addresses): then nothing binds. "
                    "Bind this side (events listen --bind) or give the publisher a wildcard, "
                    "ipc:// or (kvoffload) loopback address.",
                    self.endpoint,
                )

    def _on_reached(self) -> None:
        self.reached = True
        self._stop_watching()

    def _stop_watching(self) -> None:
        if self._monitor is not None:
            self._sub.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None

    def _on_live(self, frames: list[bytes]) -> None:
        if not self.reached:
            self._on_reached()
        if len(frames) != 3 or len(frames[1]) != SEQ_BYTES:
            self._stats["malformed"] += 1
            return
        seq = decode_seq(frames[1])
        if seq < 0:
            self._stats["malformed"] += 1
            return
        last_live = self._last_live_seq
        self._last_live_seq = seq
        if last_live is not None and seq <= last_live:
            self._stats["publisher_restarts"] += 1
            logger.warning("KV event publisher restarted (seq %d after %d)", seq, last_live)
            self._next_seq = 0
            self._restart_pending = True
        expected = seq if self._next_seq is None else self._next_seq
        if seq < expected:
            self._stats["skipped"] += 1
            return
        if seq > expected:
            items = None if self.replay_endpoint is None else self._request_replay(expected, seq)
            for replayed_seq, payload in items or ():
                self._deliver(replayed_seq, payload, replayed=True)
            self._record_gap(expected, seq, len(items or ()))
        self._deliver(seq, frames[2], replayed=False)

    def _deliver(self, seq: int, payload: bytes, replayed: bool) -> None:
        self._next_seq = seq + 1
        try:
            batch = self._decoder.decode(payload)
        except EventDecodeError as exc:
            self._stats["decode_errors"] += 1
            logger.warning("KV event batch %d skipped: %s", seq, exc)
            return
        self._stats["replayed" if replayed else "received"] += 1
        self._ready.append(ReceivedBatch(seq, batch, replayed, self._restart_pending))
        self._restart_pending = False

    def _record_gap(self, first_seq: int, end_seq: int, recovered: int) -> None:
        gap = Gap(first_seq, end_seq, recovered)
        self._gaps.append(gap)
        self._stats["gaps"] += 1
        self._stats["lost"] += gap.lost

    def _request_replay(
        self, first_seq: int, end_seq: int | None, publisher_may_be_down: bool = False
    ) -> list[tuple[int, bytes]] | None:
        """Return the buffered batches with ``first_seq <= seq < end_seq``, in order; ``None``
        when no publisher serves the replay address within the timeout (nothing was asked).
        That counts as a timeout unless ``publisher_may_be_down``."""
        sock = self._replay if self._replay is not None else self._open_replay_socket()
        deadline = time.monotonic() + self._replay_timeout_s
        if not sock.poll(self._wait_ms(deadline), zmq.POLLOUT):  # not connected (IMMEDIATE)
            if not publisher_may_be_down:
                self._replay_timed_out(first_seq, "no publisher answers at the replay address")
            return None
        sock.send_multipart((b"", encode_seq(first_seq)), zmq.NOBLOCK)
        items: list[tuple[int, bytes]] = []
        while True:
            if not sock.poll(self._wait_ms(deadline), zmq.POLLIN):
                # Late answers would be mistaken for the next request's: start a fresh socket.
                self._replay_timed_out(first_seq, "timed out")
                sock.close(linger=0)
                self._replay = None
                return items
            frames = sock.recv_multipart(zmq.NOBLOCK)  # [b"", topic, seq, payload]
            if len(frames) != 4 or frames[0] != b"" or len(frames[2]) != SEQ_BYTES:
                self._stats["malformed"] += 1
                continue
            seq = decode_seq(frames[2])
            if seq == -1:
                return items
            if seq >= first_seq and (end_seq is None or seq < end_seq):
                items.append((seq, frames[3]))

    @staticmethod
    def _wait_ms(deadline: float) -> int:
        return max(0, int((deadline - time.monotonic()) * 1000))

    def _replay_timed_out(self, first_seq: int, why: str) -> None:
        self._stats["replay_timeouts"] += 1
        logger.warning("KV event replay from seq %d: %s", first_seq, why)

    def _open_replay_socket(self) -> zmq.Socket:
        if self.replay_endpoint is None:
            raise ContractError("no replay_endpoint to connect to")
        sock = self._replay = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.RCVHWM, 0)  # a whole replay buffer must fit
        # Requests go to a connected publisher only (never queued for one that may never come):
        # writable (POLLOUT) means connected.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        sock.connect(self.replay_endpoint)
        return sock

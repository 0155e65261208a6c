"""``EventFollower``: one backend's KV events, applied to the router's index on a thread.

It subscribes with ``start_seq=0`` and fetches everything the publisher still buffers at once
(replay on join), then applies batches in sequence order; a sequence gap is filled from the
replay socket by :class:`~kvoffload.events.KVEventSubscriber`. When batches are lost for good
(older than the publisher's buffer) or the publisher restarted, the backend's entries are
dropped and rebuilt from a fresh replay of everything still buffered, so the index never keeps
a block whose removal it missed (it may miss blocks stored before the buffer's window until
they are stored again).

Lifecycle: ``CREATED`` -> :meth:`~EventFollower.start` -> ``RUNNING`` ->
:meth:`~EventFollower.stop` -> ``STOPPED`` (also from ``CREATED``); any other move raises
:class:`~kvoffload.errors.ContractError` naming the state. ``stop`` never waits for the thread:
it ends by itself within one receive timeout (0.1 s), and with a ``loop`` no batch is applied
once ``stop`` has returned.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import logging
import threading
from collections.abc import Callable

from kvoffload.errors import ContractError
from kvoffload.events import KVEventSubscriber
from kvoffload.events.messages import KVCacheEvent

__all__ = ["EventFollower", "FollowerState"]

logger = logging.getLogger(__name__)

_RECEIVE_S = 0.1  # how long one receive waits: the longest a stopped follower's thread lives on


class FollowerState(enum.Enum):
    """Where a follower is in its life: CREATED -> RUNNING -> STOPPED."""

    CREATED = "created"
    RUNNING = "running"
    STOPPED = "stopped"


class EventFollower:
    """Feeds ``apply(events)`` with one publisher's batches in order; ``reset()`` is called
    before a rebuild. Without ``loop`` both are called on the follower's thread; with one,
    they run on that event loop (its thread the only one that touches what they change), one
    batch at a time: the thread waits for each to be applied before it takes the next. Then
    call :meth:`start` and :meth:`stop` on the loop's thread too."""

    def __init__(
        self,
        name: str,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        apply: Callable[[list[KVCacheEvent]], None],
        reset: Callable[[], None],
        loop: asyncio.AbstractEventLoop | None = None,
    ) -> None:
        self.name = name
        self._args = (endpoint, topic, replay_endpoint)
        self._apply = apply
        self._reset = reset
        self._loop = loop
        self._state = FollowerState.CREATED
        self._stop = threading.Event()
        self.next_seq = 0  # batches applied so far (the publisher's next seq when caught up)
        self.batches = 0
        self.rebuilds = 0
        self._thread = threading.Thread(target=self._run, name=f"events-{name}", daemon=True)

    @property
    def state(self) -> FollowerState:
        return self._state

    def start(self) -> EventFollower:
        if self._state is not FollowerState.CREATED:
            raise ContractError(f"start() on a {self._state.name} event follower {self.name}")
        self._state = FollowerState.RUNNING
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop following; returns at once (idempotent). The thread ends by itself."""
        self._state = FollowerState.STOPPED
        self._stop.set()

    def _call(self, action: Callable[..., None], *args: object) -> None:
        """``action(*args)`` where it belongs: here, or on the loop (waiting until it ran or
        the follower stopped)."""
        if self._loop is None:
            action(*args)
            return
        done: concurrent.futures.Future[None] = concurrent.futures.Future()

        def on_loop() -> None:
            try:
                if self._state is FollowerState.RUNNING:
                    action(*args)
            finally:
                done.set_result(None)

        self._loop.call_soon_threadsafe(on_loop)
        while not self._stop.is_set():
            try:
                done.result(_RECEIVE_S)
                return
            except concurrent.futures.TimeoutError:
                continue

    def _subscribe(self) -> KVEventSubscriber:
        endpoint, topic, replay = self._args
        sub = KVEventSubscriber(endpoint, topic, replay, start_seq=0, replay_timeout_s=2.0)
        if replay is not None:
            try:
                sub.catch_up()
            except Exception as exc:  # an unanswered replay: live batches fill in, gaps counted
                logger.warning("%s: replay on join failed: %s", self.name, exc)
        return sub

    def _run(self) -> None:
        try:
            sub = self._subscribe()
        except Exception as exc:
            logger.warning("%s: cannot subscribe to KV events: %s", self.name, exc)
            return
        try:
            while not self._stop.is_set():
                got = sub.receive(_RECEIVE_S)
                lost = any(gap.lost for gap in sub.take_gaps())
                if lost or (got is not None and got.restarted):
                    logger.warning("%s: KV events lost or publisher restarted: rebuilding", self.name)
                    sub.close()
                    self._call(self._reset)
                    self.rebuilds += 1
                    self.next_seq = 0
                    sub = self._subscribe()
                    continue
                if got is not None:
                    self._call(self._apply, got.batch.events)
                    self.batches += 1
                    self.next_seq = got.seq + 1
        except RuntimeError as exc:  # the loop closed under us: nothing is followed any more
            if self._loop is None or not self._loop.is_closed():
                raise
            logger.debug("%s: event loop closed: %s", self.name, exc)
        finally:
            sub.close()

"""``EventFollower``: one backend's KV events, applied to the router's index on a thread.

It subscribes with ``start_seq=0`` and fetches everything the publisher still buffers at once
(replay on join), then applies batches in sequence order; a sequence gap is filled from the
replay socket by :class:`~kvoffload.events.KVEventSubscriber`. When batches are lost for good
(older than the publisher's buffer) or the publisher restarted, the backend's entries are
dropped and rebuilt from a fresh replay of everything still buffered, so the index never keeps
a block whose removal it missed (it may miss blocks stored before the buffer's window until
they are stored again).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

from kvoffload.events import KVEventSubscriber
from kvoffload.events.messages import KVCacheEvent

__all__ = ["EventFollower"]

logger = logging.getLogger(__name__)


class EventFollower:
    """Feeds ``apply(events)`` with one publisher's batches in order; ``reset()`` is called
    before a rebuild. Both are called on the follower's thread."""

    def __init__(
        self,
        name: str,
        endpoint: str,
        replay_endpoint: str | None,
        topic: str,
        apply: Callable[[list[KVCacheEvent]], None],
        reset: Callable[[], None],
    ) -> None:
        self.name = name
        self._args = (endpoint, topic, replay_endpoint)
        self._apply = apply
        self._reset = reset
        self._stop = threading.Event()
        self.next_seq = 0  # batches applied so far (the publisher's next seq when caught up)
        self.batches = 0
        self.rebuilds = 0
        self._thread = threading.Thread(target=self._run, name=f"events-{name}", daemon=True)

    def start(self) -> EventFollower:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join(5)

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
                got = sub.receive(0.1)
                lost = any(gap.lost for gap in sub.take_gaps())
                if lost or (got is not None and got.restarted):
                    logger.warning("%s: KV events lost or publisher restarted: rebuilding", self.name)
                    sub.close()
                    self._reset()
                    self.rebuilds += 1
                    self.next_seq = 0
                    sub = self._subscribe()
                    continue
                if got is not None:
                    self._apply(got.batch.events)
                    self.batches += 1
                    self.next_seq = got.seq + 1
        finally:
            sub.close()

"""Draining ``kvoffload serve`` on SIGTERM: the listener stays open and answers while the requests
in flight finish.

:class:`Drain` counts the HTTP requests in flight (:class:`DrainGate`, an ASGI middleware, keeps
the count); once :meth:`Drain.start` is called, every new request but ``/metrics`` is answered
503 with OpenAI's error JSON (``/health`` too, so balancers and routers take the server out of
rotation) and ``Connection: close``, and :attr:`Drain.done` turns true when nothing is in flight.
A client never meets a refused connection or a broken pipe while the server drains.
"""

from __future__ import annotations

import json

from kvoffload.serving.errors import error_body
from kvoffload.serving.guard import ASGIApp, Receive, Scope, Send

__all__ = ["Drain", "DrainGate"]

_ANSWERED_WHILE_DRAINING = frozenset({"/metrics"})


class Drain:
    """The drain's state, shared by the gate (event loop) and the server's ticks (same loop)."""

    def __init__(self) -> None:
        self.draining = False
        self.in_flight = 0

    def start(self) -> None:
        self.draining = True

    @property
    def done(self) -> bool:
        """Draining, and no request in flight."""
        return self.draining and self.in_flight == 0


class DrainGate:
    """ASGI middleware: counts requests in flight in ``drain``; refuses new ones while it
    drains (503)."""

    def __init__(self, app: ASGIApp, drain: Drain) -> None:
        self.app = app
        self.drain = drain

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.drain.draining and scope["path"] not in _ANSWERED_WHILE_DRAINING:
            await _refuse(send)
            return
        self.drain.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.drain.in_flight -= 1


async def _refuse(send: Send) -> None:
    payload = json.dumps(error_body("the server is shutting down", 503)).encode()
    await send({"type": "http.response.start", "status": 503, "headers": [
        (b"content-type", b"application/json"), (b"content-length", str(len(payload)).encode()),
        (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": payload})

"""The front door of ``kvoffload serve`` and ``kvoffload route``: API keys and a body cap.

:class:`RequestGuard` is one ASGI middleware, installed first, that every HTTP request passes:

- **API key** (as ``vllm serve --api-key``): with a key set, a request to any path but the open
  ones (``/health`` and ``/metrics``, open as in vLLM, for load balancers and scrapers) needs
  ``Authorization: Bearer KEY``; otherwise it is answered 401 with OpenAI's error JSON before its
  body is read. The comparison is constant-time (:func:`hmac.compare_digest`).
- **Body cap**: a request whose ``Content-Length`` exceeds ``max_body_bytes`` is answered 413 at
  once, nothing of its body read; a body sent without a length (chunked) is read chunk by chunk
  and answered 413 as soon as the bytes read pass the cap. So no client makes the server hold
  more than ``max_body_bytes`` of one request.

The key is held by :class:`ApiKey`, whose ``repr`` and ``str`` never show it.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from kvoffload.errors import ConfigError, KVOffloadError
from kvoffload.serving.errors import error_body

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "OPEN_PATHS", "ApiKey", "RequestGuard"]

#: The default body cap: far above any prompt a model of 128k positions takes as token ids.
DEFAULT_MAX_REQUEST_BYTES = 4 * 2**20
#: Paths served without a key, as vLLM serves them.
OPEN_PATHS = frozenset({"/health", "/metrics"})

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class ApiKey:
    """A secret bearer token. Shown as ``***`` everywhere; compared in constant time."""

    __slots__ = ("_expected",)

    def __init__(self, key: str) -> None:
        if not key or key != key.strip():
            raise ConfigError("api_key", "must be a non-empty string without surrounding spaces")
        self._expected = f"Bearer {key}".encode()

    def header(self) -> dict[str, str]:
        """The ``Authorization`` header that carries this key (for requests we send)."""
        return {"Authorization": self._expected.decode()}

    def matches(self, authorization: bytes | None) -> bool:
        """Whether an ``Authorization`` header value carries this key (constant-time)."""
        return hmac.compare_digest(authorization or b"", self._expected)

    def __repr__(self) -> str:
        return "ApiKey(***)"

    __str__ = __repr__

    def __reduce__(self) -> Any:  # never pickled (to a log, a child process) with the secret
        raise TypeError("an ApiKey is not picklable")


class _BodyTooLarge(KVOffloadError):
    """Internal: the body read so far passed the cap."""


class RequestGuard:
    """ASGI middleware: the API-key check, then the body cap (see the module docstring). The
    body is read before ``app`` runs and replayed to it, so ``app`` never sees a body over the
    cap; messages after the body (a disconnect) pass through."""

    def __init__(self, app: ASGIApp, api_key: ApiKey | None, max_body_bytes: int) -> None:
        if max_body_bytes < 1:
            raise ConfigError("max_request_bytes", f"must be >= 1, got {max_body_bytes}")
        self.app = app
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes

    def __repr__(self) -> str:
        return f"RequestGuard(api_key={self.api_key!r}, max_body_bytes={self.max_body_bytes})"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or ())
        key = self.api_key
        if key is not None and scope["path"] not in OPEN_PATHS and not key.matches(
            headers.get(b"authorization")
        ):
            await _answer(send, 401, "a valid API key is required: give it as "
                          "'Authorization: Bearer KEY'", code="invalid_api_key")
            return
        length = headers.get(b"content-length")
        if length is not None and not length.isdigit():
            await _answer(send, 400, "Content-Length is not a number")
            return
        if length is not None and int(length) > self.max_body_bytes:
            await _answer(send, 413, self._too_large())
            return
        try:
            body = await self._read_body(receive)
        except _BodyTooLarge:
            await _answer(send, 413, self._too_large())
            return
        if body is None:  # the client left while sending: nobody to answer
            return
        await self.app(scope, _replay(body, receive), send)

    def _too_large(self) -> str:
        return f"the request body is larger than the server's limit of {self.max_body_bytes} bytes"

    async def _read_body(self, receive: Receive) -> bytes | None:
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.max_body_bytes:
                raise _BodyTooLarge
            chunks.append(chunk)
            if not message.get("more_body", False):
                return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that gives ``body`` whole first, then whatever ``receive`` gives."""
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        if pending:
            return pending.pop()
        return await receive()

    return replayed


async def _answer(send: Send, status: int, message: str, code: str | None = None) -> None:
    payload = json.dumps(error_body(message, status, code=code)).encode()
    # The body (or its rest) is not read: the connection is not reused.
    headers = [(b"content-type", b"application/json"),
               (b"content-length", str(len(payload)).encode()), (b"connection", b"close")]
    if status == 401:
        headers.append((b"www-authenticate", b"Bearer"))
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": payload})

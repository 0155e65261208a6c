"""``Connections``: HTTP keep-alive for POSTs that a stale pooled connection must not fail.

A server closes a keep-alive connection that has been idle for its timeout (uvicorn, and so
``kvoffload serve``, ``kvoffload route`` and ``vllm serve``: 5 s); aiohttp keeps idle connections
for 15 s and reuses the oldest first. A request written onto a connection just as the server
closes it meets a reset or an end of stream before any byte of an answer: the server never read
it. aiohttp sends idempotent requests again on a new connection, never a POST, so the POST fails
though the server is alive (1 of 600 requests of a benchmark run at 4 requests/s did). Here such
a POST goes once more, on a connection of its own. A refused connection (nobody listens) or a
second failure is raised as it is: the server is gone.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import aiohttp

__all__ = ["STALE_CONNECTION_ERRORS", "Connections", "error_text"]

#: Raised when the server closed the connection before answering (a reset is a ClientOSError).
STALE_CONNECTION_ERRORS = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)


def error_text(exc: BaseException) -> str:
    """``exc`` as one line fit for a log or a result file: its type and ``str``. Never its
    ``repr``: aiohttp's ``ClientResponseError`` repr carries the request's headers, and with
    them ``Authorization`` (the backends' or the benchmark's key)."""
    return f"{type(exc).__name__}: {exc}"


class Connections:
    """A pooled session (``pooled``: use it for anything else too) and a session whose
    connections serve one request each, for the second attempt. ``stale_retries`` counts the
    POSTs sent twice. ``headers`` go with every request of both (the backends' API key: every
    request to a backend goes through here). Create and close it on the event loop that uses
    it."""

    def __init__(
        self, timeout: aiohttp.ClientTimeout, headers: Mapping[str, str] | None = None
    ) -> None:
        self.pooled = aiohttp.ClientSession(timeout=timeout, headers=headers,
                                            connector=aiohttp.TCPConnector(limit=0))
        self._fresh = aiohttp.ClientSession(
            timeout=timeout, headers=headers,
            connector=aiohttp.TCPConnector(limit=0, force_close=True))
        self.stale_retries = 0

    async def post(self, url: str, **kwargs: Any) -> aiohttp.ClientResponse:
        """POST ``url`` (``kwargs`` as ``ClientSession.post``); the response once its headers
        are in (the caller releases it). Sent a second time, on a new connection, only when the
        first attempt's connection was closed before any byte of an answer."""
        try:
            return await self.pooled.post(url, **kwargs)
        except aiohttp.ClientConnectorError:  # could not connect: nothing to retry here
            raise
        except STALE_CONNECTION_ERRORS:
            self.stale_retries += 1
            return await self._fresh.post(url, **kwargs)

    async def close(self) -> None:
        await self.pooled.close()
        await self._fresh.close()

"""The HTTP front end of ``kvoffload route``: OpenAI's endpoints, proxied to the chosen backend.

``/v1/completions`` and ``/v1/chat/completions`` are routed (the body is forwarded unchanged,
streamed answers relayed chunk by chunk); ``/v1/models`` comes from a healthy backend;
``/health`` is 200 while one backend is in rotation; ``/metrics`` has the router's own series
(decisions per backend, decision time quantiles, retries, backends in rotation, index size,
each backend's measured costs). A request whose backend cannot be reached, fails before any
byte of its answer was relayed, or answers 503 (shutting down, engine failed), is retried on the
next-best backend (by the policy's ranking), which is then out of rotation; a request with no
backend left gets 503, one whose backend answered malformed HTTP 502. A stream whose backend
leaves the rotation, fails, or sends nothing for ``Router.stream_idle_timeout_s`` after its first
byte ends with an error event and ``[DONE]``. Every request's share of its backend's load
(:class:`~kvoffload.routing.router.Ticket`) ends on every path.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

import aiohttp
import numpy as np
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import Receive, Scope, Send

from kvoffload.errors import KVOffloadError
from kvoffload.routing.admin import admin_router
from kvoffload.routing.connections import error_text
from kvoffload.routing.prefix_index import TIERS
from kvoffload.routing.router import Backend, Router, Ticket
from kvoffload.serving.errors import APIError, error_body, install_error_handlers
from kvoffload.serving.guard import DEFAULT_MAX_REQUEST_BYTES, ApiKey, RequestGuard
from kvoffload.serving.request_body import parse_json_object

__all__ = ["BackendLost", "BackendUnavailable", "build_app"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

class BackendLost(KVOffloadError, ConnectionError):
    """The backend left the rotation (its health checks failed) before its first byte."""


class BackendUnavailable(KVOffloadError):
    """The backend answered 503 (shutting down, its engine failed): nothing of the request was
    served, so another backend may serve it."""


_RETRIABLE = (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, asyncio.TimeoutError,
              ConnectionError, BackendLost, BackendUnavailable)
_HOP_HEADERS = {"content-length", "transfer-encoding", "connection", "content-encoding"}


def build_app(
    router: Router, api_key: ApiKey | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> FastAPI:
    """The router's app; ``api_key`` and ``max_request_bytes`` set its front door
    (:class:`~kvoffload.serving.guard.RequestGuard`: /health and /metrics stay open)."""
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await router.start()
        try:
            yield
        finally:
            await router.stop()

    app = FastAPI(title="kvoffload route", docs_url=None, redoc_url=None, openapi_url=None,
                  lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(RequestGuard, api_key=api_key, max_body_bytes=max_request_bytes)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_RouterCollector(router))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if any(b.healthy for b in router.backends) else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/router/stats")
    async def stats() -> dict[str, Any]:
        return router_stats(router)

    @app.post("/router/match")
    async def match(raw: Request) -> dict[str, Any]:
        """What each backend holds of a prompt, in blocks per tier, from the router's index:
        a completions body (``prompt``: text or token ids) or a chat body (``messages``)."""
        data = await raw.body()
        body = parse_json_object(data)
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        ids = await asyncio.to_thread(router.prompt_ids, path, body)
        if ids is None:
            raise APIError("expected a prompt (text or token ids) or chat messages",
                           param="messages" if "messages" in body else "prompt")
        return {
            "block_size": router.block_size,
            "blocks": len(ids) // router.block_size,
            "backends": [{"url": b.url, **{t: getattr(m, t) for t in TIERS}}
                         for b, m in router.holdings(ids)],
        }

    @app.get("/v1/models")
    async def models() -> Response:
        for backend in router.backends:
            if backend.healthy:
                with contextlib.suppress(*_RETRIABLE):
                    async with router.session.get(f"{backend.url}/v1/models") as resp:
                        return Response(await resp.read(), resp.status,
                                        media_type="application/json")
        raise APIError("no backend is available", status=503)

    @app.post("/v1/completions", response_model=None)
    async def completions(raw: Request) -> Response:
        return await _route(router, raw, "/v1/completions")

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(raw: Request) -> Response:
        return await _route(router, raw, "/v1/chat/completions")

    app.include_router(admin_router(router))
    return app


def router_stats(router: Router) -> dict[str, Any]:
    times = np.array(router.decision_us) if router.decision_us else np.zeros(1)
    return {
        "policy": router.policy.name,
        "tier_weights": router.policy.tier_weights,
        "decisions": len(router.decision_us),
        "decision_us_p50": float(np.percentile(times, 50)),
        "decision_us_p99": float(np.percentile(times, 99)),
        "counters": {**router.counters, "stale_connection_retries": router.stale_retries},
        "background_failures": [{"task": task, "cause": cause, "count": n}
                                for (task, cause), n in sorted(router.failures.items())],
        "index": {"keys": router.index.num_keys(), **router.index.counters},
        "backends": [
            {"url": b.url, "healthy": b.healthy, "requests": b.requests,
             "in_flight": b.load.in_flight, "indexed_blocks": router.index.num_blocks(b.index_id)
             if b.index_id is not None else 0, "costs": b.costs.measured()}
            for b in router.backends
        ],
    }


def _read_request(
    router: Router, path: str, data: bytes
) -> tuple[dict[str, Any], list[int] | None, float]:
    """The body parsed and checked, its prompt's token ids, and when parsing ended (on a worker
    thread: a body of up to ``--max-request-bytes`` takes a while, and the loop relays
    meanwhile)."""
    body = parse_json_object(data)
    parsed = time.perf_counter()
    return body, router.prompt_ids(path, body), parsed


async def _route(router: Router, raw: Request, path: str) -> Response:
    data = await raw.body()
    body, ids, start = await asyncio.to_thread(_read_request, router, path, data)
    session_key = raw.headers.get("x-session-id") or (
        body.get("user") if isinstance(body.get("user"), str) else None
    )
    ranking = router.rank(ids, session_key)
    router.decision_us.append((time.perf_counter() - start) * 1e6)
    router.counters["requests"] += 1
    stream = body.get("stream") is True
    headers = {"Content-Type": "application/json"}
    for backend in ranking.backends:  # best first, then the next-best
        if not backend.healthy:  # left the rotation since the decision
            continue
        ticket = Ticket(backend, ranking.prefill_s(backend), ranking.total)
        backend.requests += 1
        response: Response | None = None
        try:
            response = await _forward(router, backend, path, data, headers, stream, ticket)
            return response
        except _RETRIABLE as exc:
            router.mark_dead(backend, f"request failed: {error_text(exc)}")
            router.counters["retries"] += 1
        except aiohttp.ClientError as exc:  # an answer that is not HTTP: the backend served it
            router.counters["bad_answers"] += 1
            logger.warning("%s answered malformed HTTP: %s", backend.url, error_text(exc))
            return JSONResponse(error_body("the backend's answer was malformed", 502),
                                status_code=502)
        finally:  # a relayed stream ends its ticket when it ends; anything else, here
            if not isinstance(response, _RelayResponse):
                ticket.done()
    router.counters["no_backend"] += 1
    return JSONResponse(error_body("no backend is available", 503), status_code=503)


async def _forward(
    router: Router, backend: Backend, path: str, data: bytes, headers: dict[str, str],
    stream: bool, ticket: Ticket,
) -> Response:
    post = router.connections.post(f"{backend.url}{path}", data=data, headers=headers)
    resp = await _unless_lost(backend, post)
    try:
        if not stream or resp.status != 200:
            if not stream:  # no first token to see: count the predicted prefill as done
                asyncio.get_running_loop().call_later(ticket.prefill_s, ticket.first_token)
            payload = await _unless_lost(backend, resp.read())
            if resp.status == 503:
                raise BackendUnavailable(payload[:200].decode(errors="replace"))
            return Response(payload, resp.status, _headers(resp),
                            media_type=resp.headers.get("Content-Type"))
        # a failure here can still be retried
        first = await _unless_lost(backend, resp.content.readany())
        if not first:
            raise aiohttp.ClientPayloadError("the backend closed the stream")
    except BaseException:
        resp.close()  # not released to the pool: a lost backend's connection may hang
        raise
    ticket.first_token()
    relay = _Relay(router, backend, resp, first, ticket)
    return _RelayResponse(relay, resp.status, _headers(resp))


async def _unless_lost(backend: Backend, work: Awaitable[T]) -> T:
    """``work``'s result, unless ``backend`` leaves the rotation first (a backend that stalls:
    alive, silent, failing its health checks): then ``work`` is cancelled and
    :class:`BackendLost` raised, so the request, nothing of it relayed yet, goes elsewhere."""
    task = asyncio.ensure_future(work)
    lost = asyncio.ensure_future(backend.lost.wait())
    try:
        await asyncio.wait({task, lost}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # the client left: nothing waits for the backend any more
        task.cancel()
        raise
    finally:
        lost.cancel()
    if not task.done():
        task.cancel()
        raise BackendLost(f"{backend.url} left the rotation")
    return task.result()


class _Relay:
    """A streamed answer being relayed: its first chunk (read already), the rest as they come.
    The wait for each chunk ends when the backend leaves the rotation or has sent nothing for
    the router's ``stream_idle_timeout_s``; then, as on any failure once bytes went out, the
    stream ends with an error event and ``[DONE]``. :meth:`close` (idempotent) ends the
    ticket and drops the backend's connection; it runs however the stream ends, also when its
    chunks were never asked for."""

    def __init__(self, router: Router, backend: Backend, resp: aiohttp.ClientResponse,
                 first: bytes, ticket: Ticket) -> None:
        self.router, self.backend, self.resp = router, backend, resp
        self.first, self.ticket = first, ticket
        self._lost: asyncio.Future[Any] | None = None

    async def chunks(self) -> AsyncIterator[bytes]:
        try:
            yield self.first
            while chunk := await self._next():
                yield chunk
        except _RETRIABLE as exc:  # tokens were sent already: end the stream with an error event
            self.router.mark_dead(self.backend, f"stream failed: {error_text(exc)}")
            yield b"data: " + json.dumps(error_body("the backend failed mid-stream", 503)).encode()
            yield b"\n\ndata: [DONE]\n\n"
        finally:
            self.close()

    async def _next(self) -> bytes:
        if self._lost is None:
            self._lost = asyncio.ensure_future(self.backend.lost.wait())
        read = asyncio.ensure_future(self.resp.content.readany())
        try:
            await asyncio.wait({read, self._lost}, timeout=self.router.stream_idle_timeout_s,
                               return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # the client left
            read.cancel()
            raise
        if read.done():
            return read.result()
        read.cancel()
        if self._lost.done():
            raise BackendLost(f"{self.backend.url} left the rotation")
        raise TimeoutError(f"{self.backend.url} sent nothing for "
                           f"{self.router.stream_idle_timeout_s} s")

    def close(self) -> None:
        if self._lost is not None:
            self._lost.cancel()
        self.ticket.done()
        self.resp.close()  # a client that left: the backend sees the disconnect and aborts


class _RelayResponse(StreamingResponse):
    """A relayed stream that releases its :class:`_Relay` once sent, or once the client left
    (a generator never started runs no ``finally``)."""

    def __init__(self, relay: _Relay, status: int, headers: dict[str, str]) -> None:
        super().__init__(relay.chunks(), status, headers, media_type="text/event-stream")
        self.relay = relay

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.relay.close()


def _headers(resp: aiohttp.ClientResponse) -> dict[str, str]:
    return {k: v for k, v in resp.headers.items()
            if k.lower() not in _HOP_HEADERS and k.lower() != "content-type"}


class _RouterCollector(Collector):
    def __init__(self, router: Router) -> None:
        self.router = router

    def collect(self) -> list[Metric]:
        r = self.router
        stats = router_stats(r)
        out: list[Metric] = [
            CounterMetricFamily("kvoffload_route_requests", "Requests routed.",
                                value=r.counters["requests"]),
            CounterMetricFamily("kvoffload_route_retries",
                                "Requests retried on another backend after a failure.",
                                value=r.counters["retries"]),
            GaugeMetricFamily("kvoffload_route_decision_p50_microseconds",
                              "Median routing decision time (tokenize, match, choose).",
                              value=stats["decision_us_p50"]),
            GaugeMetricFamily("kvoffload_route_decision_p99_microseconds",
                              "99th percentile routing decision time.",
                              value=stats["decision_us_p99"]),
            GaugeMetricFamily("kvoffload_route_index_keys", "Block keys in the index.",
                              value=r.index.num_keys()),
        ]
        healthy = GaugeMetricFamily("kvoffload_route_backend_healthy", "1 while in rotation.",
                                    labels=["backend"])
        routed = CounterMetricFamily("kvoffload_route_backend_requests",
                                     "Requests sent to each backend.", labels=["backend"])
        costs = GaugeMetricFamily("kvoffload_route_backend_cost_seconds",
                                  "Measured seconds per computed block and per loaded block.",
                                  labels=["backend", "what"])
        failures = CounterMetricFamily(
            "kvoffload_route_background_failures",
            "Background work that failed (health checks, scrapes, event batches), by cause.",
            labels=["task", "cause"])
        for (task, cause), n in sorted(r.failures.items()):
            failures.add_metric([task, cause], n)
        for b in r.backends:
            healthy.add_metric([b.url], float(b.healthy))
            routed.add_metric([b.url], b.requests)
            costs.add_metric([b.url, "compute"], b.costs.compute_block_s)
            for tier in TIERS[1:]:
                costs.add_metric([b.url, f"load_{tier}"], b.costs.load_block_s(tier))
        return [*out, healthy, routed, costs, failures]

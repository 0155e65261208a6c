"""Running ``kvoffload serve``: the engine, its loop thread, the app, uvicorn, and a clean end.

SIGTERM (and a first Ctrl-C) stop the server gracefully. First it drains
(:mod:`kvoffload.serving.drain`): the listener stays open, every new request is answered 503
(``/health`` too; ``/metrics`` still answers), and the requests in flight run to their end. When
none is left uvicorn stops (listener closed, idle connections closed); then the engine loop lets
the stores of finished requests reach every tier (their KV events go out) and closes the engine
on its own thread, and the process exits 0. A second SIGTERM or Ctrl-C stops waiting for the
requests in flight: uvicorn stops at once and the engine loop aborts what is left. After a Ctrl-C, :func:`serve` raises
``KeyboardInterrupt`` once all that is done (the command prints one line and exits 130).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
from collections.abc import AsyncIterator, Callable
from types import FrameType
from typing import Any

import uvicorn
from prometheus_client import CollectorRegistry

from kvoffload.engine import Engine, EngineConfig
from kvoffload.errors import ConfigError
from kvoffload.serving.api import build_app
from kvoffload.serving.context import ServingContext
from kvoffload.serving.drain import Drain
from kvoffload.serving.guard import DEFAULT_MAX_REQUEST_BYTES, ApiKey
from kvoffload.serving.loop import EngineLoop
from kvoffload.serving.metrics import ServerMetrics
from kvoffload.serving.prompts import PromptTokenizer
from kvoffload.serving.ready import ready_line
from kvoffload.tiers.redis.url import parse_redis_url, redacted_url

__all__ = ["KEEP_ALIVE_S", "max_model_len", "remote_tier_id", "serve"]

logger = logging.getLogger(__name__)

#: Seconds an idle kept-alive connection stays open (uvicorn's default: 5). Longer than clients
#: keep idle connections pooled (aiohttp 15 s, httpx 5 s), so a client's reuse never races the
#: server closing it; a client pooling longer still is covered by
#: :class:`kvoffload.routing.connections.Connections` where we are the client.
KEEP_ALIVE_S = 20


def max_model_len(engine: Engine) -> int:
    """Tokens one request may hold: the device cache and the model's positions both bound it."""
    capacity = engine.num_device_blocks * engine.config.block_size
    return min(capacity, engine.model_config.max_position_embeddings)


def remote_tier_id(url: str | None) -> str | None:
    """The shared tier's identity, derived from the parsed URL: instances with equal ids share
    blocks, and only they. Scheme (TLS, Cluster), hosts (lower case; a Cluster's seeds sorted),
    port and db with their defaults, and the key namespace; never credentials or TLS file
    options. A URL that does not parse (the engine refused it at start) is shown redacted."""
    if not url:
        return None
    try:
        parsed = parse_redis_url(url, env={})
    except ConfigError:
        return redacted_url(url)
    scheme = ("rediss" if parsed.tls else "redis") + ("+cluster" if parsed.cluster else "")
    nodes = sorted((host.lower(), port) for host, port in parsed.nodes)
    hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in nodes)
    db = "" if parsed.cluster else f"/{parsed.db}"
    namespace = f"?namespace={parsed.namespace}" if parsed.namespace else ""
    return f"{scheme}://{hosts}{db}{namespace}"


def kv_event_sources(engine: Engine) -> dict[str, Any]:
    """vLLM's ``/kv_event_sources`` answer (publisher settings per data-parallel rank), with
    the endpoints as bound and what a router needs to key blocks: ``block_size`` and the
    shared tier's ``remote_tier`` id. ``{}`` when events are off."""
    config = engine.config.events
    if not config.enable_kv_cache_events:
        return {}
    publisher: Any = engine.publisher
    source = {
        "enable_kv_cache_events": True,
        "publisher": config.publisher,
        "endpoint": getattr(publisher, "endpoint", config.endpoint),
        "replay_endpoint": getattr(publisher, "replay_endpoint", config.replay_endpoint),
        "buffer_steps": config.buffer_steps,
        "hwm": config.hwm,
        "max_queue_size": config.max_queue_size,
        "topic": config.topic,
        "block_size": engine.config.block_size,
        "remote_tier": remote_tier_id(engine.config.kv_remote_url),
    }
    return {"0": source}


def serve(
    config: EngineConfig,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_name: str | None = None,
    log_level: str = "warning",
    sock: socket.socket | None = None,
    api_key: ApiKey | None = None,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
) -> int:
    """Build the engine and serve it until SIGTERM (returns the exit status) or Ctrl-C (raises
    ``KeyboardInterrupt`` after the same graceful end). ``sock``: a socket bound to the address
    (the command binds it before the model loads). Once it answers requests it prints one line
    on stderr (:func:`~kvoffload.serving.ready.ready_line`)."""
    engine = Engine(**_engine_kwargs(config))
    loop = EngineLoop(engine)
    drain = Drain()
    server_metrics = ServerMetrics(loop, drain)
    registries: list[CollectorRegistry] = [engine.metrics.registry, server_metrics.registry]
    ctx = ServingContext(
        loop=loop,
        model_name=served_model_name or config.model,
        max_model_len=max_model_len(engine),
        tokenizer=PromptTokenizer(config.model),
        registries=registries,
        kv_event_sources=kv_event_sources(engine),
        api_key=api_key,
        max_request_bytes=max_request_bytes,
        drain=drain,
    )
    app = build_app(ctx)

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        loop.start(asyncio.get_running_loop())
        try:
            yield
        finally:
            await asyncio.to_thread(loop.stop, True)

    app.router.lifespan_context = lifespan
    uv_config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, access_log=False, lifespan="on",
        timeout_keep_alive=KEEP_ALIVE_S,
    )
    server = _DrainingServer(uv_config, drain, lambda url: print(
        ready_line(engine, url, ctx.model_name, ctx.kv_event_sources), file=sys.stderr,
        flush=True))
    previous = signal.signal(signal.SIGTERM, lambda *_: None)  # uvicorn re-raises it at the end
    try:
        server.run(sockets=[sock] if sock is not None else None)
    finally:
        signal.signal(signal.SIGTERM, previous)
        loop.close()  # after a failed startup; never closes the engine beside its thread
    return 1 if loop.failed is not None or not server.started else 0


class _DrainingServer(uvicorn.Server):
    """uvicorn, whose first SIGTERM or SIGINT starts ``drain`` instead of stopping at once: it
    stops (as uvicorn does on a signal) once nothing is in flight, checked every tick (0.1 s).
    A second signal stops it now, without waiting for the requests in flight."""

    def __init__(self, config: uvicorn.Config, drain: Drain, ready: Callable[[str], None]) -> None:
        super().__init__(config)
        self.drain = drain
        self.ready = ready

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        """uvicorn's, then ``ready(URL)`` once it accepts connections (the port as bound)."""
        await super().startup(sockets)
        if self.started and self.servers and self.servers[0].sockets:
            host, port = self.servers[0].sockets[0].getsockname()[:2]
            self.ready(f"http://{f'[{host}]' if ':' in host else host}:{port}")

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain.draining or not self.started:
            if self.drain.draining and self.drain.in_flight:
                self.force_exit = True  # a second signal: no more waiting for requests
            super().handle_exit(sig, frame)
            return
        self._captured_signals.append(sig)  # re-raised by uvicorn once it has stopped
        self.drain.start()
        logger.warning("draining: new requests are answered 503; %d in flight",
                       self.drain.in_flight)

    async def on_tick(self, counter: int) -> bool:
        if self.drain.done:
            self.should_exit = True
        return await super().on_tick(counter)


def _engine_kwargs(config: EngineConfig) -> dict[str, Any]:
    import dataclasses

    return {f.name: getattr(config, f.name) for f in dataclasses.fields(config) if f.init}

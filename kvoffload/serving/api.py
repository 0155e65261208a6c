"""The OpenAI-compatible endpoints of ``kvoffload serve`` (FastAPI), over an :class:`EngineLoop`.

``/v1/completions`` and ``/v1/chat/completions`` (streamed as server-sent events or not),
``/v1/models``, ``/health``, ``/metrics`` (the engine's Prometheus registry and the server's own
series, on the same port), ``/kv_event_sources`` (vLLM's discovery endpoint: where the KV events
are published) and ``/tokenize``. Every request passes the front door first (API key, body cap:
:mod:`kvoffload.serving.guard`). A request is parsed, validated and tokenized on a worker thread
(the field at fault is named, status 400: :mod:`~kvoffload.serving.request_params`), then added
to the running engine loop (:mod:`~kvoffload.serving.generation`); a client that disconnects
aborts its request, which frees its blocks. A request with several prompts or ``n`` > 1 is one
engine request per choice (``index = prompt * n + j``, as vLLM; with a seed, choice ``j`` draws
with ``seed + j``, as vLLM's parallel sampling); their streams are merged. The answers' shapes:
:mod:`~kvoffload.serving.answer_formats`.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from kvoffload.serving.admin import admin_router
from kvoffload.serving.answer_formats import ChatFormat, CompletionFormat
from kvoffload.serving.context import ServingContext
from kvoffload.serving.drain import DrainGate
from kvoffload.serving.errors import install_error_handlers
from kvoffload.serving.generation import generate
from kvoffload.serving.guard import RequestGuard
from kvoffload.serving.request_params import prepare_chat, prepare_completion, tokenize_body

__all__ = ["build_app"]


def build_app(ctx: ServingContext) -> FastAPI:
    app = FastAPI(title="kvoffload serve", docs_url=None, redoc_url=None, openapi_url=None)
    install_error_handlers(app)
    app.add_middleware(RequestGuard, api_key=ctx.api_key, max_body_bytes=ctx.max_request_bytes)
    app.add_middleware(DrainGate, drain=ctx.drain)  # outermost: counts every request
    ctx.created = ctx.created or int(time.time())
    decode = ctx.loop.engine.tokenizer.decode

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200 if ctx.loop.alive else 503)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {
            "id": ctx.model_name,
            "object": "model",
            "created": ctx.created,
            "owned_by": "kvoffload",
            "root": ctx.loop.engine.config.model,
            "parent": None,
            "max_model_len": ctx.max_model_len,
            "permission": [],
        }
        return {"object": "list", "data": [card]}

    @app.get("/metrics")
    def metrics() -> Response:  # sync: runs on a worker thread (a scrape waits for the step)
        body = b"".join(generate_latest(r) for r in ctx.registries)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/kv_event_sources")
    async def kv_event_sources() -> dict[str, Any]:
        return ctx.kv_event_sources

    @app.post("/tokenize")
    async def tokenize(raw: Request) -> dict[str, Any]:
        return await asyncio.to_thread(tokenize_body, ctx, await raw.body())

    @app.post("/v1/completions", response_model=None)
    async def completions(raw: Request) -> Response:
        job = await asyncio.to_thread(prepare_completion, ctx, await raw.body())
        return await generate(ctx, raw, job, CompletionFormat(ctx, job, decode))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(raw: Request) -> Response:
        job = await asyncio.to_thread(prepare_chat, ctx, await raw.body())
        return await generate(ctx, raw, job, ChatFormat(ctx, job, decode))

    app.include_router(admin_router(ctx.loop, ctx.tokenizer, ctx.registries))
    return app

"""The OpenAI-compatible endpoints of ``kvoffload serve`` (FastAPI), over an :class:`EngineLoop`.

``/v1/completions`` and ``/v1/chat/completions`` (streamed as server-sent events or not),
``/v1/models``, ``/health``, ``/metrics`` (the engine's Prometheus registry and the server's own
series, on the same port), ``/kv_event_sources`` (vLLM's discovery endpoint: where the KV events
are published) and ``/tokenize``. Every request passes the front door first (API key, body cap:
:mod:`kvoffload.serving.guard`). A request is parsed, validated and tokenized on a worker thread
(the field at fault is named, status 400), then added to the running engine loop; a client that
disconnects aborts its request, which frees its blocks.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from pydantic import ValidationError

from kvoffload.engine import SamplingParams
from kvoffload.errors import ConfigError
from kvoffload.serving.admin import admin_router
from kvoffload.serving.drain import Drain, DrainGate
from kvoffload.serving.errors import APIError, error_body, install_error_handlers
from kvoffload.serving.guard import DEFAULT_MAX_REQUEST_BYTES, ApiKey, RequestGuard
from kvoffload.serving.loop import Delta, EngineLoop, RequestStream, Unavailable
from kvoffload.serving.output import TextAssembler, TextPiece, chat_logprobs, completion_logprobs
from kvoffload.serving.prompts import PromptTokenizer, chat_messages
from kvoffload.serving.protocol import ChatCompletionRequest, CompletionRequest
from kvoffload.serving.request_body import check_token_ids, parse_json_object

__all__ = ["ServingContext", "build_app"]

T = TypeVar("T")


@dataclass
class ServingContext:
    """What the endpoints serve: the engine loop, its model's name and limits, the prompt
    tokenizer, the metrics registries, the KV event sources to advertise, and the front door's
    settings (:class:`~kvoffload.serving.guard.RequestGuard`) and its drain on SIGTERM
    (:class:`~kvoffload.serving.drain.Drain`)."""

    loop: EngineLoop
    model_name: str
    max_model_len: int
    tokenizer: PromptTokenizer
    registries: list[CollectorRegistry]
    kv_event_sources: dict[str, Any]
    created: int = 0
    api_key: ApiKey | None = None
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    drain: Drain = field(default_factory=Drain)


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
        return await asyncio.to_thread(_tokenize, ctx, await raw.body())

    @app.post("/v1/completions", response_model=None)
    async def completions(raw: Request) -> Response:
        body, ids, sampling = await asyncio.to_thread(_prepare_completion, ctx, await raw.body())
        return await _generate(ctx, raw, body, ids, sampling, _CompletionFormat(ctx, body, decode))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(raw: Request) -> Response:
        body, ids, sampling = await asyncio.to_thread(_prepare_chat, ctx, await raw.body())
        return await _generate(ctx, raw, body, ids, sampling, _ChatFormat(ctx, body, decode))

    app.include_router(admin_router(ctx.loop, ctx.tokenizer, ctx.registries))
    return app


# -- validation ----------------------------------------------------------------------------------


# Parsing, validation and tokenization run on a worker thread (``asyncio.to_thread``): a large
# body never holds up the event loop, so /health and the streams in flight keep answering.

M = TypeVar("M", CompletionRequest, ChatCompletionRequest)


def _validated(model: type[M], data: bytes) -> M:
    """``data`` as a ``model`` request; a field at fault is a :class:`RequestValidationError`
    (status 400 naming it, as FastAPI's own validation)."""
    try:
        return model.model_validate(parse_json_object(data))
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None


def _prepare_completion(
    ctx: ServingContext, data: bytes
) -> tuple[CompletionRequest, list[int], SamplingParams]:
    body = _validated(CompletionRequest, data)
    _check_model(ctx, body.model)
    ids = _completion_prompt(ctx, body.prompt)
    return body, ids, _sampling(ctx, body, len(ids), body.max_tokens, "prompt", body.logprobs)


def _prepare_chat(
    ctx: ServingContext, data: bytes
) -> tuple[ChatCompletionRequest, list[int], SamplingParams]:
    body = _validated(ChatCompletionRequest, data)
    _check_model(ctx, body.model)
    ids = ctx.tokenizer.encode_chat(chat_messages([m.model_dump() for m in body.messages]))
    top = (body.top_logprobs or 0) if body.logprobs else None
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError("top_logprobs needs logprobs: true", "top_logprobs")
    max_tokens = body.max_completion_tokens or body.max_tokens
    sampling = _sampling(ctx, body, len(ids), max_tokens, "messages", top, chat=True)
    return body, ids, sampling


def _tokenize(ctx: ServingContext, data: bytes) -> dict[str, Any]:
    body = parse_json_object(data)
    messages = body.get("messages")
    if isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
        ids = ctx.tokenizer.encode_chat(chat_messages(messages))
    elif isinstance(body.get("prompt"), str):
        ids = ctx.tokenizer.encode(body["prompt"])
    else:
        raise APIError("give a string 'prompt' or a list of 'messages' objects", "prompt")
    return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}


def _check_model(ctx: ServingContext, model: str | None) -> None:
    if model is not None and model != ctx.model_name:
        raise APIError(
            f"The model `{model}` does not exist; this server serves `{ctx.model_name}`.",
            "model",
            code="model_not_found",
        )


def _completion_prompt(ctx: ServingContext, prompt: Any) -> list[int]:
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise APIError("only one prompt per request is supported", "prompt")
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise APIError("the prompt must not be empty", "prompt")
        return ctx.tokenizer.encode(prompt)
    return check_token_ids(prompt, "prompt", ctx.loop.engine.model_config.vocab_size)


def _sampling(
    ctx: ServingContext,
    body: CompletionRequest | ChatCompletionRequest,
    num_prompt_tokens: int,
    max_tokens: int | None,
    prompt_param: str,
    logprobs: int | None,
    chat: bool = False,
) -> SamplingParams:
    limit = ctx.max_model_len
    if num_prompt_tokens >= limit:
        raise APIError(
            f"This model's maximum context length is {limit} tokens. However, your request has "
            f"{num_prompt_tokens} input tokens.",
            prompt_param,
        )
    if max_tokens is None:
        max_tokens = limit - num_prompt_tokens if chat else min(16, limit - num_prompt_tokens)
    elif num_prompt_tokens + max_tokens > limit:
        raise APIError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the input, "
            f"{max_tokens} in the completion).",
            "max_completion_tokens"
            if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens
            else "max_tokens",
        )
    top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=top_k,
            seed=body.seed,
            ignore_eos=body.ignore_eos,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            logprobs=logprobs,
        )
    except ConfigError as exc:
        raise APIError.from_config_error(exc) from None


# -- generation ----------------------------------------------------------------------------------


async def _until_disconnect(raw: Request, work: Awaitable[T]) -> T | None:
    """``work``'s result, or ``None`` (``work`` cancelled) if the client disconnects first."""
    task = asyncio.ensure_future(work)

    async def disconnected() -> None:
        while (await raw.receive())["type"] != "http.disconnect":
            pass

    watcher = asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    return None


async def _generate(
    ctx: ServingContext,
    raw: Request,
    body: CompletionRequest | ChatCompletionRequest,
    ids: list[int],
    sampling: SamplingParams,
    fmt: _Format,
) -> Response:
    request_id = f"{fmt.prefix}-{uuid.uuid4().hex}"
    stream = ctx.loop.add(request_id, ids, sampling, body.kv_transfer_params)
    assembler = TextAssembler(ctx.loop.engine.tokenizer.decode, body.stop_strings())
    finished = False
    try:
        first = await _until_disconnect(raw, stream.__anext__())
        if first is None:
            return Response(status_code=499)
        if isinstance(first.error, Unavailable):
            raise APIError(first.error.message, status=503)
        if first.error is not None:
            raise APIError(first.error.message, _param_of(first.error, fmt.prompt_param))
        if body.stream:
            finished = True  # the streaming generator owns the request from here
            return StreamingResponse(
                _sse(ctx, stream, first, assembler, fmt, len(ids)),
                media_type="text/event-stream",
            )
        result = await _until_disconnect(raw, _collect(ctx, stream, first, assembler))
        if result is None:
            return Response(status_code=499)
        finished = True
        return JSONResponse(fmt.full(result, len(ids)))
    finally:
        if not finished and not stream.done:
            ctx.loop.abort(request_id)


def _param_of(error: ConfigError, prompt_param: str) -> str:
    if error.field in ("prompt", "request_id"):
        return prompt_param
    if error.field in ("store_policy", "max_offload_tokens", "max_load_tokens", "kv_load_tiers",
                       "kv_store_tiers", "kv_transfer_params"):
        return "kv_transfer_params" if error.field == "kv_transfer_params" else (
            f"kv_transfer_params.{error.field}"
        )
    return error.field


async def _collect(
    ctx: ServingContext, stream: RequestStream, first: Delta, assembler: TextAssembler
) -> TextAssembler:
    delta: Delta | None = first
    while delta is not None:
        piece = assembler.feed(delta)
        if piece.finish_reason is not None:
            if piece.stopped:
                ctx.loop.abort(stream.request_id)
            return assembler
        delta = await stream.__anext__()
    return assembler


async def _sse(
    ctx: ServingContext,
    stream: RequestStream,
    first: Delta,
    assembler: TextAssembler,
    fmt: _Format,
    num_prompt_tokens: int,
) -> AsyncIterator[bytes]:
    done = False
    try:
        delta: Delta = first
        while True:
            if delta.error is not None:
                status = 503 if isinstance(delta.error, Unavailable) else 500
                yield _event(error_body(delta.error.message, status))
                break
            piece = assembler.feed(delta)
            # One chunk per step that produced tokens, as vLLM sends them, even while their text
            # is held back (clients such as `vllm bench serve` time each token by its chunk).
            if delta.token_ids or piece.finish_reason is not None or fmt.first_chunk_pending:
                yield _event(fmt.chunk(piece))
            if piece.finish_reason is not None:
                done = True
                if piece.stopped:
                    ctx.loop.abort(stream.request_id)
                if fmt.include_usage:
                    yield _event(fmt.usage_chunk(assembler, num_prompt_tokens))
                break
            delta = await stream.__anext__()
        yield b"data: [DONE]\n\n"
    finally:
        if not done and not stream.done:
            ctx.loop.abort(stream.request_id)


def _event(payload: dict[str, Any]) -> bytes:
    import json

    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


def _usage(assembler: TextAssembler, num_prompt_tokens: int) -> dict[str, Any]:
    output = assembler.output
    cached = 0 if output is None else output.cached_tokens_engine + output.cached_tokens_offload
    completion = len(assembler.token_ids)
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": completion,
        "total_tokens": num_prompt_tokens + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    }


class _Format:
    """How one API shapes its answers (completions or chat)."""

    prefix = ""
    prompt_param = "prompt"

    def __init__(self, ctx: ServingContext, body: Any, decode: Any) -> None:
        self.model = ctx.model_name
        self.decode = decode
        self.created = int(time.time())
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.kv_transfer_params = body.kv_transfer_params
        self.first_chunk_pending = False

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def usage_chunk(self, assembler: TextAssembler, num_prompt_tokens: int) -> dict[str, Any]:
        out = self._envelope(self.chunk_object, [])
        out["usage"] = _usage(assembler, num_prompt_tokens)
        return out

    chunk_object = ""

    def chunk(self, piece: TextPiece) -> dict[str, Any]:
        raise NotImplementedError

    def full(self, assembler: TextAssembler, num_prompt_tokens: int) -> dict[str, Any]:
        raise NotImplementedError


class _CompletionFormat(_Format):
    prefix = "cmpl"
    chunk_object = "text_completion"

    def __init__(self, ctx: ServingContext, body: CompletionRequest, decode: Any) -> None:
        super().__init__(ctx, body, decode)
        self.want_logprobs = body.logprobs is not None
        self._offset = 0

    def _logprobs(self, piece: TextPiece) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        out = completion_logprobs(piece, self.decode, self._offset)
        self._offset += len(piece.text)
        return out

    def chunk(self, piece: TextPiece) -> dict[str, Any]:
        choice = {"index": 0, "text": piece.text, "logprobs": self._logprobs(piece),
                  "finish_reason": piece.finish_reason, "stop_reason": None}
        return self._envelope("text_completion", [choice])

    def full(self, assembler: TextAssembler, num_prompt_tokens: int) -> dict[str, Any]:
        whole = TextPiece(assembler.text, assembler.token_ids, assembler.logprobs)
        choice = {"index": 0, "text": assembler.text, "logprobs": self._logprobs(whole),
                  "finish_reason": assembler.finish_reason, "stop_reason": None}
        out = self._envelope("text_completion", [choice])
        out["usage"] = _usage(assembler, num_prompt_tokens)
        out["kv_transfer_params"] = self.kv_transfer_params
        return out


class _ChatFormat(_Format):
    prefix = "chatcmpl"
    prompt_param = "messages"
    chunk_object = "chat.completion.chunk"

    def __init__(self, ctx: ServingContext, body: ChatCompletionRequest, decode: Any) -> None:
        super().__init__(ctx, body, decode)
        self.top = (body.top_logprobs or 0) if body.logprobs else None
        self.first_chunk_pending = True

    def _logprobs(self, piece: TextPiece) -> dict[str, Any] | None:
        return None if self.top is None else chat_logprobs(piece, self.decode, self.top)

    def chunk(self, piece: TextPiece) -> dict[str, Any]:
        delta: dict[str, Any] = {"content": piece.text} if piece.text else {}
        if self.first_chunk_pending:
            delta = {"role": "assistant", "content": piece.text}
            self.first_chunk_pending = False
        choice = {"index": 0, "delta": delta, "logprobs": self._logprobs(piece),
                  "finish_reason": piece.finish_reason}
        return self._envelope("chat.completion.chunk", [choice])

    def full(self, assembler: TextAssembler, num_prompt_tokens: int) -> dict[str, Any]:
        whole = TextPiece(assembler.text, assembler.token_ids, assembler.logprobs)
        message = {"role": "assistant", "content": assembler.text}
        choice = {"index": 0, "message": message, "logprobs": self._logprobs(whole),
                  "finish_reason": assembler.finish_reason}
        out = self._envelope("chat.completion", [choice])
        out["usage"] = _usage(assembler, num_prompt_tokens)
        out["kv_transfer_params"] = self.kv_transfer_params
        return out

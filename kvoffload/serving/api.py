"""The OpenAI-compatible endpoints of ``kvoffload serve`` (FastAPI), over an :class:`EngineLoop`.

``/v1/completions`` and ``/v1/chat/completions`` (streamed as server-sent events or not),
``/v1/models``, ``/health``, ``/metrics`` (the engine's Prometheus registry and the server's own
series, on the same port), ``/kv_event_sources`` (vLLM's discovery endpoint: where the KV events
are published) and ``/tokenize``. Every request passes the front door first (API key, body cap:
:mod:`kvoffload.serving.guard`). A request is parsed, validated and tokenized on a worker thread
(the field at fault is named, status 400), then added to the running engine loop; a client that
disconnects aborts its request, which frees its blocks. A request with several prompts or
``n`` > 1 is one engine request per choice (``index = prompt * n + j``, as vLLM; with a seed,
choice ``j`` draws with ``seed + j``, as vLLM's parallel sampling); their streams are merged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field, replace
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
from kvoffload.serving.output import (
    TextAssembler,
    TextPiece,
    chat_logprobs,
    completion_logprobs,
    stop_token_of,
)
from kvoffload.serving.prompts import PromptTokenizer, chat_messages
from kvoffload.serving.protocol import ChatCompletionRequest, CompletionRequest
from kvoffload.serving.request_body import check_token_ids, parse_json_object

__all__ = ["MAX_CHOICES", "MAX_PROMPTS", "ServingContext", "build_app"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: The most prompts one completions request may hold.
MAX_PROMPTS = 64
#: The most choices (prompts x ``n``) one request may ask for: each is an engine request.
MAX_CHOICES = 64
#: ``logit_bias`` values are clamped to this magnitude, as vLLM and OpenAI do.
MAX_BIAS = 100.0


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
        job = await asyncio.to_thread(_prepare_completion, ctx, await raw.body())
        return await _generate(ctx, raw, job, _CompletionFormat(ctx, job, decode))

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(raw: Request) -> Response:
        job = await asyncio.to_thread(_prepare_chat, ctx, await raw.body())
        return await _generate(ctx, raw, job, _ChatFormat(ctx, job, decode))

    app.include_router(admin_router(ctx.loop, ctx.tokenizer, ctx.registries))
    return app


# -- validation ----------------------------------------------------------------------------------


# Parsing, validation and tokenization run on a worker thread (``asyncio.to_thread``): a large
# body never holds up the event loop, so /health and the streams in flight keep answering.

M = TypeVar("M", CompletionRequest, ChatCompletionRequest)


@dataclass(slots=True)
class _Choice:
    """One choice of a request: one engine request."""

    index: int
    token_ids: list[int]
    sampling: SamplingParams


@dataclass(slots=True)
class _Job:
    """A validated request: its body, its prompts (token ids) and its choices."""

    body: CompletionRequest | ChatCompletionRequest
    prompts: list[list[int]]
    choices: list[_Choice]
    #: completions with ``echo``: each prompt's text, sent before its choices' output
    echo: list[str] | None = None


def _validated(model: type[M], data: bytes) -> M:
    """``data`` as a ``model`` request; a field at fault is a :class:`RequestValidationError`
    (status 400 naming it, as FastAPI's own validation); a parameter set to what this server
    does not do is an :class:`APIError` naming it. Fields neither OpenAI nor vLLM define are
    ignored, their names logged (as vLLM does)."""
    raw = parse_json_object(data)
    try:
        body = model.model_validate(raw)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None
    refused = body.refused()
    if refused is not None:
        name, why = refused.split(": ", 1)
        raise APIError(f"`{name}` is not supported by this server: {why}", name)
    unknown = [k for k in raw if k not in model.model_fields]
    if unknown:
        logger.warning("ignored request fields: %s",
                       ", ".join(repr(k[:40]) for k in unknown[:10]))
    return body


def _prepare_completion(ctx: ServingContext, data: bytes) -> _Job:
    body = _validated(CompletionRequest, data)
    _check_model(ctx, body.model)
    prompts, texts = _completion_prompts(ctx, body.prompt)
    max_tokens = body.max_completion_tokens or body.max_tokens
    samplings = [_sampling(ctx, body, len(ids), max_tokens, "prompt", body.logprobs)
                 for ids in prompts]
    echo = None
    if body.echo is True:  # as vLLM: the prompt's text as sent, or its ids decoded
        decode = ctx.loop.engine.tokenizer.decode
        echo = [decode(ids) if text is None else text
                for ids, text in zip(prompts, texts, strict=True)]
    return _Job(body, prompts, _choices(prompts, samplings, body.n), echo)


def _prepare_chat(ctx: ServingContext, data: bytes) -> _Job:
    body = _validated(ChatCompletionRequest, data)
    _check_model(ctx, body.model)
    ids = ctx.tokenizer.encode_chat(chat_messages([m.model_dump() for m in body.messages]))
    top = (body.top_logprobs or 0) if body.logprobs else None
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError("top_logprobs needs logprobs: true", "top_logprobs")
    max_tokens = body.max_completion_tokens or body.max_tokens
    sampling = _sampling(ctx, body, len(ids), max_tokens, "messages", top, chat=True)
    return _Job(body, [ids], _choices([ids], [sampling], body.n))


def _choices(prompts: list[list[int]], samplings: list[SamplingParams], n: int) -> list[_Choice]:
    """``n`` choices per prompt, indexed ``prompt * n + j``; with a seed, choice ``j`` of a
    prompt samples with ``seed + j`` (vLLM's parallel sampling), so they differ yet repeat."""
    if len(prompts) * n > MAX_CHOICES:
        raise APIError(f"at most {MAX_CHOICES} choices per request (prompts x n), "
                       f"got {len(prompts)} x {n}", "n")
    out = []
    for p, (ids, sampling) in enumerate(zip(prompts, samplings, strict=True)):
        for j in range(n):
            seeded = sampling if sampling.seed is None or j == 0 else replace(
                sampling, seed=(sampling.seed + j) % 2**64)
            out.append(_Choice(p * n + j, ids, seeded))
    return out


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


def _completion_prompts(
    ctx: ServingContext, prompt: Any
) -> tuple[list[list[int]], list[str | None]]:
    """The prompts of a completions request (one text or id list, or a list of them, at most
    :data:`MAX_PROMPTS`) as token ids, and each one's text where it was sent as text."""
    several = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)
    prompts = prompt if several else [prompt]
    if len(prompts) > MAX_PROMPTS:
        raise APIError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", "prompt")
    vocab = ctx.loop.engine.model_config.vocab_size
    out: list[list[int]] = []
    texts: list[str | None] = []
    for i, one in enumerate(prompts):
        param = f"prompt.{i}" if several else "prompt"
        if isinstance(one, str):
            if not one:
                raise APIError("the prompt must not be empty", param)
            out.append(ctx.tokenizer.encode(one))
            texts.append(one)
        else:
            out.append(check_token_ids(one, param, vocab))
            texts.append(None)
    return out, texts


def _logit_bias(ctx: ServingContext, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as ``(token id, bias)`` pairs: keys token ids in the vocabulary, values
    clamped to [-100, 100] (as vLLM)."""
    if not bias:
        return ()
    vocab = ctx.loop.engine.model_config.vocab_size
    out = []
    for key, value in bias.items():
        digits = key.strip()
        # ASCII decimal only (str.isdigit() also passes "\u00b2", which int() rejects) and short
        # enough for int() (its digit limit): anything else is not a token id.
        token = int(digits) if digits.isascii() and digits.isdigit() and len(digits) < 20 else -1
        if not 0 <= token < vocab:
            raise APIError(f"logit_bias keys must be token ids in [0, {vocab}), got {key[:40]!r}",
                           "logit_bias")
        out.append((token, min(MAX_BIAS, max(-MAX_BIAS, value))))
    return tuple(out)


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
            "max_completion_tokens" if body.max_completion_tokens else "max_tokens",
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
            min_tokens=body.min_tokens,
            logit_bias=_logit_bias(ctx, body.logit_bias),
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            frequency_penalty=body.frequency_penalty or 0.0,
            presence_penalty=body.presence_penalty or 0.0,
            min_p=body.min_p,
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


def _assembler(ctx: ServingContext, body: Any, choice: _Choice) -> TextAssembler:
    eos = ctx.loop.engine.model_config.eos_token_id
    sampling = choice.sampling
    return TextAssembler(
        ctx.loop.engine.tokenizer.decode,
        body.stop_strings(),
        include_stop=body.include_stop_str_in_output,
        min_tokens=sampling.min_tokens,
        stop_tokens=lambda output: stop_token_of(output, sampling, eos),
        eos_token_id=eos,
    )


async def _generate(ctx: ServingContext, raw: Request, job: _Job, fmt: _Format) -> Response:
    body = job.body
    request_id = f"{fmt.prefix}-{uuid.uuid4().hex}"
    ids = [request_id] if len(job.choices) == 1 else [
        f"{request_id}-{c.index}" for c in job.choices]
    streams = [ctx.loop.add(rid, c.token_ids, c.sampling, body.kv_transfer_params)
               for rid, c in zip(ids, job.choices, strict=True)]
    assemblers = [_assembler(ctx, body, c) for c in job.choices]
    handed_over = False
    try:
        firsts = await _until_disconnect(raw, asyncio.gather(*(s.__anext__() for s in streams)))
        if firsts is None:
            return Response(status_code=499)
        for first in firsts:
            if isinstance(first.error, Unavailable):
                raise APIError(first.error.message, status=503)
            if first.error is not None:
                raise APIError(first.error.message, _param_of(first.error, fmt.prompt_param))
        if body.stream:
            handed_over = True  # the streaming generator owns the requests from here
            return StreamingResponse(_sse(ctx, streams, firsts, assemblers, fmt),
                                     media_type="text/event-stream")
        collected = await _until_disconnect(raw, asyncio.gather(
            *(_collect(ctx, s, f, a) for s, f, a in zip(streams, firsts, assemblers, strict=True))))
        if collected is None:
            return Response(status_code=499)
        return JSONResponse(fmt.full(assemblers))
    finally:
        if not handed_over:
            _abort_unfinished(ctx, streams)


def _abort_unfinished(ctx: ServingContext, streams: list[RequestStream]) -> None:
    for stream in streams:
        if not stream.done:
            ctx.loop.abort(stream.request_id)


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
    streams: list[RequestStream],
    firsts: list[Delta],
    assemblers: list[TextAssembler],
    fmt: _Format,
) -> AsyncIterator[bytes]:
    """The choices' deltas as server-sent events, in the order they come (each chunk names its
    choice's ``index``); usage (when asked) once every choice finished, then ``[DONE]``."""
    done = False
    ready: list[tuple[int, Delta]] = list(enumerate(firsts))
    pending: dict[asyncio.Future[Delta], int] = {}
    live = len(streams)
    try:
        for chunk in fmt.opening():
            yield _event(chunk)
        while live:
            if not ready:
                landed, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for task in sorted(landed, key=pending.__getitem__):
                    ready.append((pending.pop(task), task.result()))
            i, delta = ready.pop(0)
            if delta.error is not None:
                status = 503 if isinstance(delta.error, Unavailable) else 500
                yield _event(error_body(delta.error.message, status))
                break
            piece = assemblers[i].feed(delta)
            # One chunk per step that produced tokens, as vLLM sends them, even while their text
            # is held back (clients such as `vllm bench serve` time each token by its chunk).
            if delta.token_ids or piece.finish_reason is not None:
                yield _event(fmt.chunk(i, piece, assemblers[i]))
            if piece.finish_reason is None:
                pending[asyncio.ensure_future(streams[i].__anext__())] = i
                continue
            live -= 1
            if piece.stopped:
                ctx.loop.abort(streams[i].request_id)
        else:
            done = True
            if fmt.include_usage:
                yield _event(fmt.usage_chunk(assemblers))
        yield b"data: [DONE]\n\n"
    finally:
        for task in pending:
            task.cancel()
        if not done:
            _abort_unfinished(ctx, streams)


def _event(payload: dict[str, Any]) -> bytes:
    return b"data: " + json.dumps(payload, separators=(",", ":")).encode() + b"\n\n"


class _Format:
    """How one API shapes its answers (completions or chat), for the choices of one job."""

    prefix = ""
    prompt_param = "prompt"
    chunk_object = ""

    def __init__(self, ctx: ServingContext, job: _Job, decode: Any) -> None:
        body = job.body
        self.job = job
        self.model = ctx.model_name
        self.decode = decode
        self.token_bytes = ctx.loop.engine.tokenizer.token_bytes
        self.created = int(time.time())
        self.id = f"{self.prefix}-{uuid.uuid4().hex}"
        self.include_usage = bool(body.stream_options and body.stream_options.include_usage)
        self.kv_transfer_params = body.kv_transfer_params
        self.as_token_ids = bool(body.return_tokens_as_token_ids)

    def _envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices}

    def usage(self, assemblers: list[TextAssembler]) -> dict[str, Any]:
        """Prompt tokens counted once per prompt (not per choice), as vLLM."""
        job = self.job
        n = len(job.choices) // len(job.prompts)
        prompt = sum(len(p) for p in job.prompts)
        cached = 0
        for choice, assembler in zip(job.choices, assemblers, strict=True):
            output = assembler.output
            if choice.index % n == 0 and output is not None:
                cached += output.cached_tokens_engine + output.cached_tokens_offload
        completion = sum(len(a.token_ids) for a in assemblers)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": cached},
        }

    def usage_chunk(self, assemblers: list[TextAssembler]) -> dict[str, Any]:
        out = self._envelope(self.chunk_object, [])
        out["usage"] = self.usage(assemblers)
        return out

    def opening(self) -> list[dict[str, Any]]:
        """Chunks a stream begins with, before any token."""
        return []

    def chunk(self, index: int, piece: TextPiece, assembler: TextAssembler) -> dict[str, Any]:
        raise NotImplementedError

    def full(self, assemblers: list[TextAssembler]) -> dict[str, Any]:
        raise NotImplementedError

    @staticmethod
    def _whole(assembler: TextAssembler) -> TextPiece:
        return TextPiece(assembler.text, assembler.token_ids, assembler.logprobs)

    @staticmethod
    def _stop_reason(piece: TextPiece, assembler: TextAssembler) -> str | int | None:
        return None if piece.finish_reason is None else assembler.stop_reason


class _CompletionFormat(_Format):
    prefix = "cmpl"
    chunk_object = "text_completion"

    def __init__(self, ctx: ServingContext, job: _Job, decode: Any) -> None:
        super().__init__(ctx, job, decode)
        body = job.body
        self.want_logprobs = isinstance(body, CompletionRequest) and body.logprobs is not None
        self._offsets = [0] * len(job.choices)
        n = len(job.choices) // len(job.prompts)
        #: per choice, the prompt text still to echo (sent with its first chunk)
        self._echo = [job.echo[i // n] if job.echo else "" for i in range(len(job.choices))]

    def _logprobs(self, index: int, piece: TextPiece) -> dict[str, Any] | None:
        if not self.want_logprobs:
            return None
        out = completion_logprobs(piece, self.decode, self._offsets[index], self.as_token_ids)
        self._offsets[index] += len(piece.text)
        return out

    def _choice(self, index: int, piece: TextPiece, assembler: TextAssembler) -> dict[str, Any]:
        echo, self._echo[index] = self._echo[index], ""
        return {"index": index, "text": echo + piece.text,
                "logprobs": self._logprobs(index, piece),
                "finish_reason": piece.finish_reason,
                "stop_reason": self._stop_reason(piece, assembler)}

    def chunk(self, index: int, piece: TextPiece, assembler: TextAssembler) -> dict[str, Any]:
        return self._envelope("text_completion", [self._choice(index, piece, assembler)])

    def full(self, assemblers: list[TextAssembler]) -> dict[str, Any]:
        choices = []
        for i, assembler in enumerate(assemblers):
            whole = self._whole(assembler)
            whole.finish_reason = assembler.finish_reason
            choices.append(self._choice(i, whole, assembler))
        out = self._envelope("text_completion", choices)
        out["usage"] = self.usage(assemblers)
        out["kv_transfer_params"] = self.kv_transfer_params
        return out


class _ChatFormat(_Format):
    prefix = "chatcmpl"
    prompt_param = "messages"
    chunk_object = "chat.completion.chunk"

    def __init__(self, ctx: ServingContext, job: _Job, decode: Any) -> None:
        super().__init__(ctx, job, decode)
        body = job.body
        self.top = ((body.top_logprobs or 0) if body.logprobs else None) if isinstance(
            body, ChatCompletionRequest) else None

    def _logprobs(self, piece: TextPiece) -> dict[str, Any] | None:
        if self.top is None:
            return None
        return chat_logprobs(piece, self.decode, self.top, self.token_bytes, self.as_token_ids)

    def opening(self) -> list[dict[str, Any]]:
        """A role-only chunk per choice, as vLLM begins a chat stream."""
        return [self._envelope("chat.completion.chunk", [
            {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
             "finish_reason": None}]) for i in range(len(self.job.choices))]

    def chunk(self, index: int, piece: TextPiece, assembler: TextAssembler) -> dict[str, Any]:
        # Always a "content", "" while the text is held back or empty (a special token), as vLLM:
        # clients (`vllm bench serve`) count a chunk whose delta has content and no role as a token.
        delta = {"content": piece.text}
        choice = {"index": index, "delta": delta, "logprobs": self._logprobs(piece),
                  "finish_reason": piece.finish_reason,
                  "stop_reason": self._stop_reason(piece, assembler)}
        return self._envelope("chat.completion.chunk", [choice])

    def full(self, assemblers: list[TextAssembler]) -> dict[str, Any]:
        choices = []
        for i, assembler in enumerate(assemblers):
            message = {"role": "assistant", "content": assembler.text}
            choices.append({"index": i, "message": message,
                            "logprobs": self._logprobs(self._whole(assembler)),
                            "finish_reason": assembler.finish_reason,
                            "stop_reason": assembler.stop_reason})
        out = self._envelope("chat.completion", choices)
        out["usage"] = self.usage(assemblers)
        out["kv_transfer_params"] = self.kv_transfer_params
        return out

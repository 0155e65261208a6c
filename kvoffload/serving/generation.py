"""Running a validated :class:`~kvoffload.serving.request_params.Job` on the engine loop: one
engine request per choice, their outputs merged, answered whole (JSON) or streamed (server-sent
events). A client that disconnects aborts its requests, which frees their blocks; a choice that
meets a stop string is aborted at once.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from kvoffload.errors import ConfigError
from kvoffload.serving.answer_formats import AnswerFormat
from kvoffload.serving.context import ServingContext
from kvoffload.serving.errors import APIError, error_body
from kvoffload.serving.loop import Delta, RequestStream, Unavailable
from kvoffload.serving.output import TextAssembler, stop_token_of
from kvoffload.serving.request_params import Choice, Job

__all__ = ["generate"]

T = TypeVar("T")


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


def _assembler(ctx: ServingContext, body: Any, choice: Choice) -> TextAssembler:
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


async def generate(ctx: ServingContext, raw: Request, job: Job, fmt: AnswerFormat) -> Response:
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
    fmt: AnswerFormat,
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

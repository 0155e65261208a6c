"""Sending the benchmark's requests and timing them as ``vllm bench serve`` does.

Requests go to ``/v1/completions`` with the prompt as token ids, ``stream`` and
``stream_options.include_usage``. On the client's clock (``perf_counter``): TTFT is the first
chunk carrying ``choices`` minus the send time, ITL the gaps between later such chunks, latency
the last such chunk minus the send time; output tokens (and the prompt length) come from the
server's ``usage``. A 200 stream without any such chunk is a failure. Arrivals are a gamma
process at ``request_rate`` (``burstiness`` 1: Poisson; ``inf``: all at once) or a trace's
timestamps, with at most ``max_concurrency`` in flight; a request's ``queue_time`` is how long
it waited for a slot. A request whose pooled connection the server had closed before answering
(its keep-alive timeout racing the reuse: it never read the request) is sent once more on a new
connection, timed from the first send (:class:`~kvoffload.routing.connections.Connections`;
``vllm bench serve`` counts it as failed). A server that needs a key gets the one in
``OPENAI_API_KEY`` as ``Authorization: Bearer`` (``vllm bench serve``'s rule), on every request.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np

from kvoffload.benchmark.datasets import BenchRequest
from kvoffload.routing.connections import Connections, error_text

__all__ = [
    "EventFolder",
    "RequestResult",
    "arrival_gaps",
    "bench_connections",
    "error_message",
    "replay_gaps",
    "run_requests",
    "stream_into",
]


#: The environment variable whose key every benchmark request carries (as ``vllm bench serve``).
API_KEY_ENV = "OPENAI_API_KEY"


def bench_connections(timeout: aiohttp.ClientTimeout) -> Connections:
    """The benchmark's HTTP connections, carrying ``$OPENAI_API_KEY`` as a bearer token when set
    (never printed)."""
    key = os.environ.get(API_KEY_ENV, "").strip()
    return Connections(timeout, {"Authorization": f"Bearer {key}"} if key else None)


@dataclass
class RequestResult:
    """One request as ``vllm bench serve`` records it (seconds, ``perf_counter`` clock)."""

    success: bool = False
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    prompt_len: int = 0
    output_tokens: int = 0
    start_time: float = 0.0
    queue_time: float = 0.0
    generated_text: str = ""
    error: str = ""


def _read_event(out: RequestResult, data: bytes, start: float, last: float) -> float:
    """Fold one SSE payload into ``out``; returns the time of the latest token chunk."""
    msg = json.loads(data)
    if "error" in msg:
        raise ValueError(str(msg["error"].get("message")))
    if choices := msg.get("choices"):
        now = time.perf_counter()
        if out.ttft == 0.0:
            out.ttft = now - start
        else:
            out.itl.append(now - last)
        out.generated_text += choices[0].get("text") or ""
        return now
    if usage := msg.get("usage"):
        out.output_tokens = int(usage.get("completion_tokens") or 0)
        out.prompt_len = int(usage.get("prompt_tokens") or out.prompt_len)
    return last


async def _one(
    conns: Connections, url: str, model: str, req: BenchRequest, session_id: str | None
) -> RequestResult:
    body = {
        "model": model, "prompt": req.prompt, "max_tokens": req.output_len, "temperature": 0.0,
        "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True},
    }
    headers = {"x-session-id": session_id} if session_id else {}
    out = RequestResult(prompt_len=len(req.prompt))
    await stream_into(out, conns, f"{url}/v1/completions", body, _read_event, headers)
    return out


#: Folds one SSE payload into a result; returns the time of the latest token chunk.
EventFolder = Callable[[RequestResult, bytes, float, float], float]


async def stream_into(
    out: RequestResult,
    conns: Connections,
    url: str,
    body: Mapping[str, Any],
    fold: EventFolder,
    headers: Mapping[str, str] | None = None,
) -> None:
    """POST ``body`` to ``url`` and read its SSE stream into ``out`` through ``fold``: start
    time, latency (the last token chunk), success (a token chunk came), or ``error`` (never
    raises for a failed request)."""
    start = last = out.start_time = time.perf_counter()
    try:
        resp = await conns.post(url, json=body, headers=headers or {})
        async with resp:
            if resp.status != 200:
                out.error = f"HTTP {resp.status}: {error_message(await resp.text())}"
                return
            buffer = b""
            async for chunk in resp.content.iter_any():
                buffer += chunk
                while b"\n\n" in buffer:
                    event, buffer = buffer.split(b"\n\n", 1)
                    data = event.removeprefix(b"data: ").strip()
                    if data and data != b"[DONE]" and not data.startswith(b":"):
                        last = fold(out, data, start, last)
        out.latency = last - start
        out.success = out.ttft > 0
        if not out.success:
            out.error = "no token chunk in the stream"
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        out.error = error_text(exc)


def error_message(text: str) -> str:
    """An error answer's message: OpenAI's ``{"error": {"message": ...}}`` (vLLM's and ours),
    else the text; at most 300 characters."""
    try:
        message = json.loads(text)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = text
    return str(message)[:300]


def arrival_gaps(n: int, request_rate: float, burstiness: float, seed: int) -> list[float]:
    """Seconds before each request (vLLM's gamma arrivals; all at 0 when the rate is inf)."""
    if math.isinf(request_rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    theta = 1.0 / (request_rate * burstiness)
    return list(rng.gamma(shape=burstiness, scale=theta, size=n))


def replay_gaps(arrivals: Sequence[float], scale: float) -> list[float]:
    """Seconds before each request to send them at ``arrivals`` (a trace's, sorted) x ``scale``."""
    out, last = [], 0.0
    for at in arrivals:
        out.append(max(0.0, at * scale - last))
        last = max(last, at * scale)
    return out


async def run_requests(
    url: str,
    model: str,
    requests: Sequence[BenchRequest],
    gaps: Sequence[float],
    max_concurrency: int | None,
    sessions: Sequence[str | None] | None = None,
    on_done: Callable[[], object] | None = None,
) -> tuple[list[RequestResult], float]:
    """Run every request, ``gaps[i]`` seconds after the previous one was sent (at most
    ``max_concurrency`` in flight); returns the results (in request order) and the wall
    duration. ``on_done()`` is called as each request ends (a progress bar)."""
    gate: asyncio.Semaphore | contextlib.nullcontext[None] = (
        asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    )
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=10)

    async def limited(i: int, req: BenchRequest) -> RequestResult:
        arrival = time.perf_counter()
        async with gate:
            out = await _one(conns, url, model, req, sessions[i] if sessions else None)
        out.queue_time = out.start_time - arrival
        if on_done is not None:
            on_done()
        return out

    conns = bench_connections(timeout)
    try:
        start = time.perf_counter()
        tasks = []
        for i, (req, gap) in enumerate(zip(requests, gaps, strict=True)):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(limited(i, req)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - start
    finally:
        await conns.close()

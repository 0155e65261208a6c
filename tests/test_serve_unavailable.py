"""A server that cannot serve answers 503 at once, never 400 or a hang: its engine failed (the
requests in flight and every later one), or it stopped (a request arriving after its engine
thread ended). In-process: the real app under uvicorn on a loopback port, a real tiny engine and
its real engine thread, aiohttp as the client; the failure is injected by making the engine's
step raise."""

from __future__ import annotations

import asyncio
import contextlib
import socket
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
import uvicorn

from kvoffload.engine import Engine, RequestOutput
from kvoffload.serving.api import build_app
from kvoffload.serving.context import ServingContext
from kvoffload.serving.loop import EngineLoop
from kvoffload.serving.prompts import PromptTokenizer
from kvoffload.serving.server import max_model_len

pytestmark = pytest.mark.timeout(120)

#: Long enough to fail a test that would otherwise hang, far beyond any answer's time.
ANSWER_S = 30.0
BODY = {"model": "tiny", "prompt": "hello there", "max_tokens": 4, "ignore_eos": True}


@contextlib.asynccontextmanager
async def _client(loop: EngineLoop) -> AsyncIterator[aiohttp.ClientSession]:
    """A client of the app serving ``loop``, on a loopback port of its own."""
    ctx = ServingContext(
        loop=loop,
        model_name="tiny",
        max_model_len=max_model_len(loop.engine),
        tokenizer=PromptTokenizer("tiny"),
        registries=[],
        kv_event_sources={},
    )
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(build_app(ctx), log_level="warning", lifespan="off")
    server = uvicorn.Server(config)
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            assert not task.done(), "the server did not start"
            await asyncio.sleep(0.01)
        base = f"http://127.0.0.1:{sock.getsockname()[1]}"
        async with aiohttp.ClientSession(base) as client:
            yield client
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, ANSWER_S)
        sock.close()


async def _post(client: aiohttp.ClientSession, body: dict[str, Any]) -> tuple[int, Any]:
    """Status and JSON answer of a completion (a stream's first event when it is one)."""
    async with asyncio.timeout(ANSWER_S), client.post("/v1/completions", json=body) as resp:
        return resp.status, await resp.json(content_type=None)


def test_a_failed_engine_answers_503_now_and_later() -> None:
    async def run() -> None:
        engine = Engine("tiny", num_device_blocks=64)
        loop = EngineLoop(engine)

        def broken_step() -> list[RequestOutput]:
            raise RuntimeError("device lost")

        engine.step = broken_step  # type: ignore[method-assign]
        loop.start(asyncio.get_running_loop())
        async with _client(loop) as client:
            status, answer = await _post(client, BODY)
            assert status == 503, answer
            assert answer["error"]["type"] == "service_unavailable_error"
            assert "device lost" in answer["error"]["message"]
            status, answer = await _post(client, BODY)
            assert status == 503 and "device lost" in answer["error"]["message"]
            status, _ = await _post(client, {**BODY, "stream": True})
            assert status == 503
            async with client.get("/health") as health:
                assert health.status == 503
        assert not loop.alive and isinstance(loop.failed, RuntimeError)

    asyncio.run(run())


def test_a_request_after_the_engine_thread_ended_answers_503() -> None:
    async def run() -> None:
        engine = Engine("tiny", num_device_blocks=64)
        loop = EngineLoop(engine)
        loop.start(asyncio.get_running_loop())
        async with _client(loop) as client:
            status, answer = await _post(client, BODY)
            assert status == 200 and answer["usage"]["completion_tokens"] == 4
            await asyncio.to_thread(loop.stop, True)
            status, answer = await _post(client, BODY)
            assert status == 503, answer
            assert "shutting down" in answer["error"]["message"]

    asyncio.run(run())

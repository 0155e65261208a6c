"""A chat stream whose tokens decode to no text yet (a special token: EOS under ``ignore_eos``;
the first byte of a character, held back until the stream ends) still sends one chunk per step
with ``"content": ""`` (vLLM's form), ends with the text it held, and ``bench serve``'s chat
client counts such an answer, empty text included, as a completed turn, as ``vllm bench serve``
does. A real ``kvoffload serve --model tiny``; ``logit_bias`` forces the tokens."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from serve_cases import Process, free_port, serve

from kvoffload.servebench.chat import chat_turn
from kvoffload.servebench.client import RequestResult, bench_connections

pytestmark = pytest.mark.timeout(180)

EOS = 256  # the presets' EOS: decodes to no text
LEAD_BYTE = 0xE2  # starts a 3-byte UTF-8 character: held back while the stream lasts


@pytest.fixture(scope="module")
def server() -> Iterator[Process]:
    with serve(events=False) as process:
        yield process


def _chunks(url: str, token: int, max_tokens: int) -> list[dict[str, Any]]:
    """The choices' deltas of a streamed chat answer forced to ``token``, opening one first."""

    async def run() -> bytes:
        body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": max_tokens, "ignore_eos": True, "stream": True,
                "logit_bias": {str(token): 100}}
        async with aiohttp.ClientSession() as session, session.post(
                f"{url}/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            return await resp.read()

    deltas = []
    for event in asyncio.run(run()).split(b"\n\n"):
        data = event.removeprefix(b"data: ").strip()
        if data and data != b"[DONE]":
            deltas += [choice["delta"] for choice in json.loads(data)["choices"]]
    return deltas


def test_every_chunk_of_an_empty_answer_carries_empty_content(server: Process) -> None:
    opening, *tokens = _chunks(server.url, EOS, 3)
    assert opening == {"role": "assistant", "content": ""}
    assert tokens and all(delta == {"content": ""} for delta in tokens)


def test_held_back_text_is_sent_at_the_end(server: Process) -> None:
    opening, *tokens = _chunks(server.url, LEAD_BYTE, 2)
    assert opening["role"] == "assistant"
    assert all("content" in delta and "role" not in delta for delta in tokens)
    assert tokens[0] == {"content": ""}  # the character is not complete yet: held back
    # The stream's end sends what it held: two lead bytes that complete nothing.
    assert "".join(delta["content"] for delta in tokens) == bytes([LEAD_BYTE] * 2).decode(
        errors="replace")


async def _turn_forced_to_eos(backend: str) -> RequestResult:
    """A chat turn of ``bench serve`` through a proxy that adds a ``logit_bias`` forcing EOS."""

    async def forward(request: web.Request) -> web.Response:
        body = {**await request.json(), "logit_bias": {str(EOS): 100}}
        async with aiohttp.ClientSession() as session, session.post(
                f"{backend}{request.path}", json=body) as resp:
            return web.Response(body=await resp.read(), status=resp.status,
                                content_type="text/event-stream")

    app = web.Application()
    app.router.add_post("/v1/chat/completions", forward)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    conns = bench_connections(aiohttp.ClientTimeout(total=60))
    try:
        return await chat_turn(conns, f"http://127.0.0.1:{port}", "tiny",
                               [{"role": "user", "content": "hi"}], 2)
    finally:
        await conns.close()
        await runner.cleanup()


def test_a_turn_whose_answer_is_empty_text_is_completed(server: Process) -> None:
    result = asyncio.run(_turn_forced_to_eos(server.url))
    assert (result.success, result.error) == (True, "")
    assert (result.generated_text, result.output_tokens) == ("", 2)
    assert result.ttft > 0

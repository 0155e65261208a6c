"""The front door of ``kvoffload serve`` and ``kvoffload route`` (issue #29): API keys on every
endpoint but /health and /metrics (401, OpenAI's error JSON), a body cap (413 before reading an
over-long body), bad text and token ids answered 400 without a traceback (directly and through
the router), and a request's parsing and tokenization kept off the event loop."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
from collections.abc import AsyncIterator, Iterator

import aiohttp
import pytest
import uvicorn
from serve_cases import Process, auth, post_raw, route, serve

from kvoffload.engine import Engine
from kvoffload.serving.api import build_app
from kvoffload.serving.context import ServingContext
from kvoffload.serving.loop import EngineLoop
from kvoffload.serving.prompts import PromptTokenizer
from kvoffload.serving.server import max_model_len

pytestmark = pytest.mark.timeout(180)

KEY = "front-door-key-5521"
SMALL_CAP = 64 * 1024
COMPLETION = {"prompt": "hello there", "max_tokens": 2}
CHAT = {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2}


@pytest.fixture(scope="module")
def keyed() -> Iterator[Process]:
    """A server with an API key (from the environment) and a small body cap."""
    with serve("--max-request-bytes", str(SMALL_CAP), env={"KVOFFLOAD_API_KEY": KEY}) as process:
        yield process


@pytest.fixture(scope="module")
def keyed_route(keyed: Process) -> Iterator[Process]:
    """A router with its own key, sending ``KEY`` to the backend."""
    with route([keyed], "--api-key", "router-key", "--max-request-bytes", str(SMALL_CAP),
               key="router-key", env={"KVOFFLOAD_BACKEND_API_KEY": KEY}) as process:
        yield process


def _get(url: str, key: str | None = None) -> tuple[int, bytes]:
    import urllib.error
    import urllib.request

    request = urllib.request.Request(url, headers=auth(key))
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read()


@pytest.mark.parametrize("server", ["keyed", "keyed_route"])
def test_every_endpoint_but_health_and_metrics_needs_the_key(server: str, request) -> None:
    process: Process = request.getfixturevalue(server)
    key = KEY if server == "keyed" else "router-key"
    guarded = ["/v1/models"] + (["/kv_event_sources"] if server == "keyed" else ["/router/stats"])
    for path in guarded:
        for wrong in (None, "nope", key + "x", key[:-1]):
            status, body = _get(process.url + path, wrong)
            assert status == 401, (path, wrong, body)
            error = json.loads(body)["error"]
            assert error["code"] == "invalid_api_key" and error["type"] == "invalid_request_error"
        assert _get(process.url + path, key)[0] == 200
    posts = ["/v1/completions", "/v1/chat/completions"] + (["/tokenize"] if server == "keyed" else [])
    for path in posts:
        data = json.dumps(CHAT if "chat" in path else COMPLETION).encode()
        status, answer = post_raw(process.url + path, data)
        assert status == 401, answer
        status, answer = post_raw(process.url + path, data, headers=auth(key))
        assert status == 200, answer
    assert _get(process.url + "/health")[0] == 200
    status, text = _get(process.url + "/metrics")
    assert status == 200 and b"# HELP" in text


def _raw_exchange(port: int, head: bytes, body: bytes = b"") -> tuple[int, bytes]:
    """Send ``head`` (and ``body``) on a socket of its own; the answer's status and body."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(head + body)
        received = b""
        while b"\r\n\r\n" not in received or not _complete(received):
            chunk = sock.recv(65536)
            if not chunk:
                break
            received += chunk
    status = int(received.split(b" ", 2)[1])
    return status, received.split(b"\r\n\r\n", 1)[1]


def _complete(received: bytes) -> bool:
    head, _, body = received.partition(b"\r\n\r\n")
    for line in head.split(b"\r\n"):
        if line.lower().startswith(b"content-length:"):
            return len(body) >= int(line.split(b":")[1])
    return False


@pytest.mark.parametrize("server", ["keyed", "keyed_route"])
def test_an_oversized_body_is_413_before_it_is_read(server: str, request) -> None:
    process: Process = request.getfixturevalue(server)
    key = KEY if server == "keyed" else "router-key"
    # A declared length over the cap: answered with no byte of the body sent.
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {key}\r\nContent-Length: {100 * 2**20}\r\n\r\n").encode()
    status, body = _raw_exchange(process.port, head)
    assert status == 413, body
    assert "limit" in json.loads(body)["error"]["message"]
    # No length (chunked): refused once the bytes read pass the cap.
    chunk = b"x" * 8192
    chunked = (f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n") * (SMALL_CAP // len(chunk) + 2)
    head = (f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {key}\r\nTransfer-Encoding: chunked\r\n\r\n").encode()
    status, body = _raw_exchange(process.port, head, chunked + b"0\r\n\r\n")
    assert status == 413, body
    # A body under the cap is served.
    padded = {**COMPLETION, "user": "u" * (SMALL_CAP // 2)}
    status, answer = post_raw(f"{process.url}/v1/completions", json.dumps(padded).encode(),
                              headers=auth(key))
    assert status == 200, answer


LONE_SURROGATE = [
    ("completions", b'{"prompt": "\\ud800abc", "max_tokens": 2}', "prompt"),
    ("chat/completions",
     b'{"messages": [{"role": "user", "content": "\\ud800abc"}], "max_tokens": 2}',
     "messages.0.content"),
]


@pytest.mark.parametrize("server", ["keyed", "keyed_route"])
@pytest.mark.parametrize(("endpoint", "data", "param"), LONE_SURROGATE)
def test_a_lone_surrogate_is_400_naming_the_field(
    server: str, endpoint: str, data: bytes, param: str, request
) -> None:
    process: Process = request.getfixturevalue(server)
    key = KEY if server == "keyed" else "router-key"
    status, answer = post_raw(f"{process.url}/v1/{endpoint}", data, headers=auth(key))
    assert status == 400, answer
    assert answer["error"]["param"] == param
    assert "surrogate" in answer["error"]["message"]


def test_token_ids_beyond_32_bits_are_400_at_the_router(keyed_route: Process) -> None:
    for prompt in ([1, 2**32], [1, 2**40], [[3, 2**33]]):
        status, answer = post_raw(f"{keyed_route.url}/v1/completions",
                                  json.dumps({"prompt": prompt, "max_tokens": 1}).encode(),
                                  headers=auth("router-key"))
        assert status == 400, answer
        assert answer["error"]["param"] == "prompt"


def test_no_traceback_for_bad_input(keyed: Process, keyed_route: Process) -> None:
    """Runs last of this module's server tests: everything above was logged without one."""
    for process in (keyed_route, keyed):
        process.terminate(60)
        output = process.output()
        assert "Traceback" not in output, output[-3000:]


# -- off the event loop --------------------------------------------------------------------------


class _HeldTokenizer(PromptTokenizer):
    """Tokenizes only once ``release`` is set: a stand-in for a prompt that takes long."""

    def __init__(self) -> None:
        super().__init__("tiny")
        self.release = threading.Event()
        self.entered = threading.Event()

    def encode(self, text: str) -> list[int]:
        self.entered.set()
        if not self.release.wait(60):
            raise TimeoutError("never released")
        return super().encode(text)


@contextlib.asynccontextmanager
async def _app_client(
    loop: EngineLoop, tokenizer: PromptTokenizer
) -> AsyncIterator[aiohttp.ClientSession]:
    ctx = ServingContext(loop=loop, model_name="tiny", max_model_len=max_model_len(loop.engine),
                         tokenizer=tokenizer, registries=[], kv_event_sources={})
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(build_app(ctx), log_level="warning", lifespan="off"))
    task = asyncio.create_task(server.serve(sockets=[sock]))
    try:
        while not server.started:
            assert not task.done(), "the server did not start"
            await asyncio.sleep(0.01)
        async with aiohttp.ClientSession(f"http://127.0.0.1:{sock.getsockname()[1]}") as client:
            yield client
    finally:
        server.should_exit = True
        await asyncio.wait_for(task, 30)
        sock.close()


def test_health_answers_while_a_request_is_tokenized() -> None:
    """The tokenizer blocks until /health has answered: were tokenization on the event loop,
    /health could not answer and the test would fail (its 30 s client timeout)."""

    async def run() -> None:
        tokenizer = _HeldTokenizer()
        with Engine("tiny", num_device_blocks=64) as engine:
            loop = EngineLoop(engine)
            loop.start(asyncio.get_running_loop())
            try:
                async with _app_client(loop, tokenizer) as client:
                    pending = asyncio.ensure_future(client.post("/v1/completions",
                                                                json=COMPLETION))
                    await asyncio.to_thread(tokenizer.entered.wait, 30)
                    assert tokenizer.entered.is_set()
                    async with asyncio.timeout(30), client.get("/health") as health:
                        assert health.status == 200
                    tokenizer.release.set()
                    async with asyncio.timeout(30):
                        resp = await pending
                        assert resp.status == 200, await resp.text()
                        resp.release()
            finally:
                tokenizer.release.set()
                await asyncio.to_thread(loop.stop, False)

    asyncio.run(run())


def test_flags_refuse_empty_keys_without_echoing(capsys) -> None:
    from kvoffload.cli.main import main

    for argv in (["serve", "--api-key="], ["route", "--backend-api-key", " k"]):
        with pytest.raises(SystemExit) as exited:
            main([*argv, "--model", "tiny"])
        assert exited.value.code == 2
        assert "non-empty key" in capsys.readouterr().err

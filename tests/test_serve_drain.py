"""SIGTERM on ``kvoffload serve`` (issue #29): while it drains, the listener stays open and a new
request gets the documented 503 (OpenAI's error JSON), never a refused connection or a broken
pipe; the request in flight is answered; then it exits 0. And the engine is only ever closed by
the thread that runs it. Races are pinned by state, not time: the request in flight is one
whose body the test holds back, so it cannot end before the test lets it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import socket
import threading
import time
from collections.abc import Iterator

import pytest
from serve_cases import Process, metric, post_raw, serve

from kvoffload.engine import Engine, SamplingParams
from kvoffload.serving.loop import EngineLoop, LoopState

pytestmark = pytest.mark.timeout(180)

BODY = json.dumps({"prompt": "held back", "max_tokens": 3, "ignore_eos": True}).encode()


def _wait_for(condition, what: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.05)


def _status(url: str) -> int:
    import urllib.error
    import urllib.request

    try:
        with urllib.request.urlopen(url, timeout=30) as response:
            return response.status
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code


@contextlib.contextmanager
def _draining_with_a_held_request(server: Process) -> Iterator[socket.socket]:
    """A request in flight on ``server`` (its headers and half its body are in; the rest waits
    on the test, through the yielded socket), then SIGTERM, once it drains."""
    with socket.create_connection(("127.0.0.1", server.port), timeout=60) as held:
        held.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"
                     b"Content-Type: application/json\r\n"
                     + f"Content-Length: {len(BODY)}\r\n\r\n".encode() + BODY[:10])
        # 2: the held request and the scrape itself.
        _wait_for(lambda: metric(server.url, "kvoffload_serve_http_requests_in_flight") == 2,
                  "the held request never reached the app")
        server.proc.send_signal(signal.SIGTERM)
        _wait_for(lambda: _status(f"{server.url}/health") == 503, "never started draining")
        yield held


def test_sigterm_drains_answering_503_then_exits_0() -> None:
    with serve(events=False) as server:
        with _draining_with_a_held_request(server) as held:
            # New requests, on new connections: answered, 503, OpenAI's error JSON.
            for _ in range(3):
                status, answer = post_raw(f"{server.url}/v1/completions", BODY)
                assert status == 503, answer
                assert answer["error"]["type"] == "service_unavailable_error"
                assert "shutting down" in answer["error"]["message"]
            assert metric(server.url, "kvoffload_serve_requests_in_flight") == 0
            assert server.proc.poll() is None  # still waiting for the held request
            held.sendall(BODY[10:])
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                chunk = held.recv(65536)
                assert chunk, answer
                answer += chunk
        assert answer.startswith(b"HTTP/1.1 200"), answer
        completion = json.loads(answer.split(b"\r\n\r\n", 1)[1])
        assert completion["usage"]["completion_tokens"] == 3
        # It exits by itself once the drain is over (a second SIGTERM here could land while the
        # answered request is still counted in flight, and force the stop).
        assert server.proc.wait(60) == 0
        output = server.output()
        assert "Traceback" not in output and "draining" in output, output


def test_a_second_sigterm_stops_waiting_for_the_requests_in_flight() -> None:
    """The held request never completes its body: after the first SIGTERM the server waits for
    it; the second one ends the wait and the process exits (before, uvicorn closed its listener
    and went on waiting for the request with no limit)."""
    with serve(events=False) as server:
        with _draining_with_a_held_request(server):
            assert server.proc.poll() is None  # waiting for the held request
            server.proc.send_signal(signal.SIGTERM)
            try:
                status = server.proc.wait(60)
            except Exception:
                pytest.fail("a second SIGTERM left the server waiting for its request")
        # uvicorn logs the aborted request's cancellation: a forced stop is not a clean one.
        assert status in (0, -signal.SIGTERM, 128 + signal.SIGTERM), server.output()


def test_the_engine_is_closed_on_its_thread_never_beside_it() -> None:
    """A step that does not return (a hung device): ``close`` waits, logs, and leaves the
    engine alone; once the step returns, the engine thread closes it, and only that thread."""
    engine = Engine("tiny", num_device_blocks=64)
    release = threading.Event()
    entered = threading.Event()
    closed_on: list[str] = []
    step, close = engine.step, engine.close

    def hung_step():
        entered.set()
        release.wait(60)
        return step()

    def recorded_close() -> None:
        closed_on.append(threading.current_thread().name)
        close()

    engine.step = hung_step  # type: ignore[method-assign]
    engine.close = recorded_close  # type: ignore[method-assign]

    async def run() -> None:
        loop = EngineLoop(engine)
        loop.start(asyncio.get_running_loop())
        loop.add("r", [1, 2, 3], SamplingParams(max_tokens=2), None)
        assert await asyncio.to_thread(entered.wait, 30)
        await asyncio.to_thread(loop.close, 0.2)  # the thread is stuck in its step
        assert closed_on == [] and loop.thread_running
        release.set()
        await asyncio.to_thread(loop.stop, False, 30)
        assert loop.state is LoopState.CLOSED

    asyncio.run(run())
    assert closed_on == ["kvoffload-engine"]


def _state(loop: EngineLoop) -> LoopState:
    """``loop.state`` as read now (an ``assert loop.state is`` narrows it for mypy, which then
    takes a later check, after a call that changed the state, as impossible)."""
    return loop.state


def test_an_unstarted_loop_closes_its_engine_and_lifecycle_misuse_is_refused() -> None:
    from kvoffload.errors import ContractError

    engine = Engine("tiny", num_device_blocks=64)
    loop = EngineLoop(engine)
    assert loop.state is LoopState.NEW
    loop.close()
    assert _state(loop) is LoopState.CLOSED
    event_loop = asyncio.new_event_loop()
    with pytest.raises(ContractError, match="closed"):
        loop.start(event_loop)
    event_loop.close()

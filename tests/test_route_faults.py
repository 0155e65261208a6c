"""``kvoffload route`` over real ``kvoffload serve`` processes behind fronts that fail in one way
each (``faulty_front.py``): a stream that stalls after its first chunk, a backend stopped
mid-stream, an answer that is not HTTP, a ``/metrics`` that is not Prometheus text. Each ends
cleanly for the client, and leaves nothing pending in the router's view of the backend."""

from __future__ import annotations

import contextlib
import http.client
import json
import signal
import time

import pytest
from serve_cases import faulty, http_json, metric, post_raw, route, serve

pytestmark = pytest.mark.timeout(180)

ERROR_EVENT = b'data: {"error": {"message": "the backend failed mid-stream"'


def _open_stream(url: str) -> tuple[http.client.HTTPConnection, http.client.HTTPResponse]:
    """A streamed completion through ``url`` (read timeout 60 s: longer means it hangs)."""
    host, port = url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": 200,
            "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body),
                 {"Content-Type": "application/json"})
    resp = conn.getresponse()
    assert resp.status == 200
    return conn, resp


def _settled(url: str) -> dict:
    """The router's stats once no request is in flight (bounded: 30 s)."""
    deadline = time.monotonic() + 30
    while True:
        stats = http_json(f"{url}/router/stats")
        if all(b["in_flight"] == 0 for b in stats["backends"]):
            return stats
        assert time.monotonic() < deadline, f"requests still in flight: {stats['backends']}"
        time.sleep(0.05)


def test_a_stream_whose_backend_goes_silent_ends_with_an_error_event() -> None:
    """A backend that sends a stream's first chunk and then nothing, while its health checks
    pass: after ``--stream-idle-timeout`` the client gets the error event and ``[DONE]``.
    Before, the relay waited for the next chunk for ever (here: the client's 60 s timeout)."""
    with (
        serve("--kv-offloading-size", "0.01") as backend,
        faulty("hold", backend) as front,
        route([front], "--stream-idle-timeout", "1") as router,
    ):
        conn, resp = _open_stream(router.url)
        with contextlib.closing(conn):
            first = resp.readline()
            rest = resp.read()
        assert first.startswith(b"data: {")
        assert ERROR_EVENT in rest and rest.endswith(b"data: [DONE]\n\n")
        stats = _settled(router.url)
        assert stats["counters"]["backend_lost"] == 1  # it rejoins at its next health check


def test_a_stream_ends_when_its_backend_leaves_the_rotation() -> None:
    """A stream's backend stopped (SIGSTOP) after the first chunk reached the client: once its
    health checks take it out of rotation, the stream ends with the error event and
    ``[DONE]``, whatever the idle bound. Before, the relay did not notice (the client hung)."""
    with (
        serve("--kv-offloading-size", "0.01") as backend,
        faulty("hold", backend) as front,  # the bytes after the first chunk never come
        route([front], "--stream-idle-timeout", "3600") as router,
    ):
        conn, resp = _open_stream(router.url)
        with contextlib.closing(conn):
            first = resp.readline()
            backend.proc.send_signal(signal.SIGSTOP)
            try:
                rest = resp.read()
            finally:
                backend.proc.send_signal(signal.SIGCONT)
        assert first.startswith(b"data: {")
        assert ERROR_EVENT in rest and rest.endswith(b"data: [DONE]\n\n")
        assert _settled(router.url)["counters"]["backend_lost"] >= 1


def test_a_malformed_answer_gets_502_and_leaves_nothing_pending() -> None:
    """A backend whose answer is not HTTP (aiohttp: ``ClientResponseError``, not a connection
    failure): the client gets 502 with OpenAI's error JSON, the request's share of the
    backend's load ends, and the backend stays in rotation. Before, the client got a 500 and
    the request stayed pending on that backend for good (in flight, its prefill ever more
    overdue), so ``kv_aware`` stopped choosing it."""
    with (
        serve("--kv-offloading-size", "0.01") as backend,
        faulty("malformed", backend) as front,
        route([front]) as router,
    ):
        for _ in range(2):
            status, answer = post_raw(f"{router.url}/v1/completions",
                                      json.dumps({"prompt": "hi", "max_tokens": 2}).encode())
            assert status == 502 and "malformed" in answer["error"]["message"]
        stats = _settled(router.url)
        assert stats["counters"]["bad_answers"] == 2
        assert stats["backends"][0]["healthy"] and stats["backends"][0]["requests"] == 2


def test_background_failures_are_counted_and_logged_once() -> None:
    """A backend whose ``/metrics`` cannot be parsed: every failed scrape is counted in the
    router's ``/metrics`` by task and cause, and logged once. Before, the failure was dropped
    without a trace and the backend's costs stayed at their priors."""
    with (
        serve("--kv-offloading-size", "0.01") as backend,
        faulty("bad-metrics", backend) as front,
        route([front], "--metrics-interval", "0.05") as router,
    ):
        series = 'kvoffload_route_background_failures_total{cause="ValueError",task="scrape"}'
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(KeyError):
                if metric(router.url, series) >= 3:
                    break
            assert time.monotonic() < deadline, "no scrape failure counted"
            time.sleep(0.05)
        stats = http_json(f"{router.url}/router/stats")
        assert stats["background_failures"][0]["task"] == "scrape"
        router.terminate()
        logged = [line for line in router.output().splitlines() if "scrape of" in line]
        assert len(logged) == 1 and "ValueError" in logged[0]


def test_a_malformed_answer_never_logs_the_backends_key() -> None:
    """aiohttp's ``ClientResponseError`` repr carries the request's headers: logging it showed
    ``--backend-api-key`` in the router's warning. The router logs the error's type and text."""
    key = "sk-backend-malformed-7d2e"
    with (
        serve("--kv-offloading-size", "0.01") as backend,
        faulty("malformed", backend) as front,
        route([front], "--backend-api-key", key, "--log-level", "debug") as router,
    ):
        status, _ = post_raw(f"{router.url}/v1/completions",
                             json.dumps({"prompt": "hi", "max_tokens": 2}).encode())
        assert status == 502
        router.terminate()
        output = router.output()
    assert "answered malformed HTTP" in output  # the warning was written...
    assert key not in output  # ...without the key

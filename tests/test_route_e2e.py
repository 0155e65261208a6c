"""``kvoffload route`` over real ``kvoffload serve`` processes: greedy outputs through the router
equal one engine without offloading; kv_aware keeps a prefix where it is cached; a backend killed
mid-run fails no request (they are retried elsewhere) and leaves the index; a backend closing a
kept-alive connection as a request arrives fails none and stays in rotation; sticky sessions."""

from __future__ import annotations

import json
import signal
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import openai
import pytest
from serve_cases import (
    Process,
    http_json,
    post_raw,
    route,
    serve,
    stale_keepalive,
    unavailable,
)

from kvoffload.engine import Engine, SamplingParams
from kvoffload.serving.prompts import PromptTokenizer

pytestmark = pytest.mark.timeout(180)

SHARED = "System: you answer questions about kvoffload, briefly and exactly. " * 3


@pytest.fixture(scope="module")
def backends() -> Iterator[list[Process]]:
    with serve("--kv-offloading-size", "0.01") as a, serve("--kv-offloading-size", "0.01") as b:
        yield [a, b]


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)


def _wait_until_indexed(url: str, timeout_s: float = 60.0) -> None:
    """Return once some backend's blocks are in the router's index (polled, bounded)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(b["indexed_blocks"] > 0 for b in http_json(f"{url}/router/stats")["backends"]):
            return
        time.sleep(0.05)
    raise AssertionError(f"no KV event reached the router within {timeout_s} s")


def test_outputs_through_route_equal_one_instance(backends: list[Process]) -> None:
    prompts = [SHARED + f"Question {i}?" for i in range(4)] * 2
    tok = PromptTokenizer("tiny")
    with Engine("tiny", num_device_blocks=64) as engine:  # no offloading
        want = [engine.tokenizer.decode(o.output_token_ids) for o in engine.generate(
            [tok.encode(p) for p in prompts], SamplingParams(max_tokens=8, ignore_eos=True))]
    with route(backends) as router, _client(router.url) as client:
        def complete(prompt: str) -> str:
            return client.completions.create(model="tiny", prompt=prompt, max_tokens=8,
                                             temperature=0,
                                             extra_body={"ignore_eos": True}).choices[0].text

        got = [complete(prompts[0])]
        # The first answer's blocks reach the router as KV events, asynchronously: the next
        # request can follow them only once they are indexed (else both backends look empty).
        _wait_until_indexed(router.url)
        got += [complete(p) for p in prompts[1:]]
        assert got == want
        streamed = client.completions.create(model="tiny", prompt=prompts[0], max_tokens=8,
                                             temperature=0, stream=True,
                                             extra_body={"ignore_eos": True})
        assert "".join(c.choices[0].text for c in streamed) == want[0]
        stats = http_json(f"{router.url}/router/stats")
        # The shared prefix stays where it is cached: one backend took every request.
        requests = sorted(b["requests"] for b in stats["backends"])
        assert requests == [0, len(prompts) + 1]
        assert stats["index"]["keys"] > 0 and stats["decision_us_p99"] > 0
        status, answer = post_raw(f"{router.url}/v1/completions", b"{oops")
        assert status == 400 and answer["error"]["type"] == "invalid_request_error"
        status, answer = post_raw(f"{router.url}/v1/completions",
                                  json.dumps({"prompt": "x", "max_tokens": 0}).encode())
        assert status == 400 and answer["error"]["param"] == "max_tokens"  # the backend's answer


def test_round_robin_and_sessions(backends: list[Process]) -> None:
    with route(backends, "--policy", "round_robin") as rr:
        with _client(rr.url) as client:
            for i in range(4):
                client.completions.create(model="tiny", prompt=f"p{i}", max_tokens=1)
        assert [b["requests"] for b in http_json(f"{rr.url}/router/stats")["backends"]] == [2, 2]
    with route(backends, "--policy", "session") as sticky, _client(sticky.url) as client:
        for user in ("alice", "bob", "carol", "dave"):
            for _ in range(2):
                client.completions.create(model="tiny", prompt="hi", max_tokens=1, user=user)
        counts = [b["requests"] for b in http_json(f"{sticky.url}/router/stats")["backends"]]
        assert sum(counts) == 8 and all(c % 2 == 0 for c in counts)


def test_killed_backend_fails_no_request_and_leaves_the_index() -> None:
    with (
        serve("--kv-offloading-size", "0.01") as a,
        serve("--kv-offloading-size", "0.01") as b,
        route([a, b], "--policy", "round_robin") as router,
        _client(router.url) as client,
    ):
        for i in range(4):  # both backends index blocks
            client.completions.create(model="tiny", prompt=SHARED + str(i), max_tokens=2)
        results: list[Any] = []

        def worker(n: int) -> None:
            for i in range(6):
                try:
                    results.append(client.completions.create(
                        model="tiny", prompt=f"{SHARED} {n}/{i}", max_tokens=4))
                except Exception as exc:  # asserted below
                    results.append(exc)

        threads = [threading.Thread(target=worker, args=(n,)) for n in range(3)]
        for t in threads:
            t.start()
        b.kill()  # mid-run: requests in flight there are retried on a
        for t in threads:
            t.join(120)
        assert len(results) == 18
        assert [r for r in results if isinstance(r, Exception)] == []
        stats = http_json(f"{router.url}/router/stats")
        dead = next(s for s in stats["backends"] if s["url"] == b.url)
        alive = next(s for s in stats["backends"] if s["url"] == a.url)
        assert not dead["healthy"] and dead["indexed_blocks"] == 0
        assert alive["healthy"] and alive["indexed_blocks"] > 0


def test_a_kept_alive_connection_closed_by_the_backend_fails_no_request() -> None:
    """A backend's keep-alive timeout firing as the router reuses the connection (made certain
    by the proxy: every request on a reused connection finds it closed) is no failure: the
    request goes again on a new connection to the same backend, which stays in rotation with
    its index. Before, the router took the backend out of rotation and, with no other, failed
    the request (503)."""
    with (
        serve("--kv-offloading-size", "0.01") as backend,
        stale_keepalive(backend) as proxy,
        # no periodic checks or scrapes: only the requests below reuse the connections
        route([proxy], "--health-interval", "3600", "--metrics-interval", "3600") as router,
        _client(router.url) as client,
    ):
        texts = [client.completions.create(model="tiny", prompt=SHARED, max_tokens=4,
                                           temperature=0).choices[0].text for _ in range(3)]
        streamed = client.completions.create(model="tiny", prompt=SHARED, max_tokens=4,
                                             temperature=0, stream=True)
        texts.append("".join(c.choices[0].text for c in streamed))
        assert len(set(texts)) == 1 and texts[0]
        stats = http_json(f"{router.url}/router/stats")
        assert stats["counters"]["backend_lost"] == 0 and stats["counters"]["retries"] == 0
        assert stats["counters"]["stale_connection_retries"] >= 1
        assert stats["backends"][0]["healthy"] and stats["backends"][0]["indexed_blocks"] > 0


def test_a_stalled_backend_leaves_and_its_waiting_requests_go_elsewhere() -> None:
    """A backend that stalls (SIGSTOP: alive, connected, silent) with requests waiting for their
    first byte: once its health checks take it out of rotation, they go to another backend.
    Before, they waited for it for ever (here: until the client's timeout)."""
    with (
        serve("--kv-offloading-size", "0.01") as a,
        serve("--kv-offloading-size", "0.01") as b,
        route([a, b], "--policy", "round_robin", "--health-interval", "0.2") as router,
        _client(router.url) as client,
        ThreadPoolExecutor(4) as pool,
    ):
        a.proc.send_signal(signal.SIGSTOP)
        try:  # round robin: two of the four to the stalled backend
            futures = [pool.submit(client.completions.create, model="tiny", prompt=f"{SHARED}{i}",
                                   max_tokens=2, extra_body={"ignore_eos": True}, timeout=90) for i in range(4)]
            outs = [f.result() for f in futures]
        finally:
            a.proc.send_signal(signal.SIGCONT)
        assert all(o.usage is not None and o.usage.completion_tokens == 2 for o in outs)
        stats = http_json(f"{router.url}/router/stats")
        assert stats["counters"]["backend_lost"] >= 1 and stats["counters"]["retries"] >= 1
        assert stats["counters"]["no_backend"] == 0


def test_a_backend_answering_503_has_its_requests_served_elsewhere(
    backends: list[Process],
) -> None:
    """A backend that answers 503 (shutting down, its engine failed; here a front that answers
    every request so, while its health checks pass) sends nothing of the answer: round robin's
    requests that meet it are served by the other backend, and it leaves the rotation. Before,
    the 503 went back to the client."""
    a, b = backends
    with (
        unavailable(a) as broken,
        route([broken, b], "--policy", "round_robin", "--health-interval", "3600") as router,
        _client(router.url) as client,
    ):
        texts = [client.completions.create(model="tiny", prompt=SHARED, max_tokens=4,
                                           temperature=0).choices[0].text for _ in range(4)]
        assert len(set(texts)) == 1 and texts[0]
        stats = http_json(f"{router.url}/router/stats")
        assert stats["counters"]["retries"] >= 1
        gone = next(s for s in stats["backends"] if s["url"] == broken.url)
        assert not gone["healthy"]


def test_router_match_answers_what_each_backend_holds(backends: list[Process]) -> None:
    """``POST /router/match``: the index's view of a prompt per backend (text, token ids or chat
    messages); a body without a prompt is a 400 naming the field."""
    prompt = SHARED + "What does /router/match answer?"
    with route(backends) as router, _client(router.url) as client:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=1)
        _wait_until_indexed(router.url)
        answer = http_json(f"{router.url}/router/match", {"prompt": prompt})
        assert answer["block_size"] == 16 and answer["blocks"] > 0
        assert [b["url"] for b in answer["backends"]] == [b.url for b in backends]
        cached = [b["device"] + b["host"] + b["disk"] + b["remote"] for b in answer["backends"]]
        assert max(cached) > 0 and all(0 <= c <= answer["blocks"] for c in cached)
        ids = PromptTokenizer("tiny").encode(prompt)
        assert http_json(f"{router.url}/router/match", {"prompt": ids}) == answer
        # Several prompts go to one backend together: placed by the first one's blocks.
        assert http_json(f"{router.url}/router/match", {"prompt": [prompt, "x"]}) == answer
        assert http_json(f"{router.url}/router/match", {"prompt": [ids, [1, 2]]}) == answer
        chat = http_json(f"{router.url}/router/match",
                         {"messages": [{"role": "user", "content": "hi"}]})
        assert len(chat["backends"]) == 2
        status, error = post_raw(f"{router.url}/router/match", json.dumps({"n": 1}).encode())
        assert status == 400 and error["error"]["param"] == "prompt"

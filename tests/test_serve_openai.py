"""``kvoffload serve`` through the official ``openai`` client: completions and chat, streamed and
not, greedy outputs equal to the engine's own, logprobs, stop strings, OpenAI's errors (status
400 naming the field) for every kind of bad input, a client that disconnects mid-stream, and
SIGTERM under load (every request in flight finishes, the stores reach the host tier, exit 0)."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletionMessageParam
from serve_cases import Process, metric, post_raw, serve

from kvoffload.engine import Engine, SamplingParams
from kvoffload.events import MEDIUM_CPU, BlockStored, KVEventSubscriber
from kvoffload.serving.prompts import PromptTokenizer

pytestmark = pytest.mark.timeout(120)

PROMPTS = ["The quick brown fox jumps over the lazy dog. " * 3, "Offloading keeps prefixes. " * 5]


@pytest.fixture(scope="module")
def server() -> Iterator[Process]:
    with serve("--kv-offloading-size", "0.01") as process:
        yield process


@pytest.fixture(scope="module")
def client(server: Process) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
        yield client


@pytest.fixture(scope="module")
def reference() -> Iterator[Engine]:
    with Engine("tiny", num_device_blocks=64) as engine:
        yield engine


def _greedy_text(engine: Engine, token_ids: list[int], max_tokens: int) -> str:
    (out,) = engine.generate([token_ids], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return engine.tokenizer.decode(out.output_token_ids)


def test_completions_equal_the_engine(client: openai.OpenAI, reference: Engine) -> None:
    tok = PromptTokenizer("tiny")
    for prompt in PROMPTS:
        want = _greedy_text(reference, tok.encode(prompt), 12)
        got = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0,
            extra_body={"ignore_eos": True},
        )
        assert got.choices[0].text == want
        assert got.choices[0].finish_reason == "length"
        assert got.usage is not None
        assert got.usage.completion_tokens == 12
        assert got.usage.prompt_tokens == len(tok.encode(prompt))
        streamed = client.completions.create(
            model="tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        chunks = list(streamed)
        assert "".join(c.choices[0].text for c in chunks if c.choices) == want
        usage = chunks[-1].usage
        assert usage is not None and usage.completion_tokens == 12
    # Token ids as the prompt, and the second time its prefix comes from the cache.
    ids = tok.encode(PROMPTS[0])
    again = client.completions.create(model="tiny", prompt=ids, max_tokens=4, temperature=0)
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert (again.usage.prompt_tokens_details.cached_tokens or 0) >= 16


def test_chat_streams_what_it_answers(client: openai.OpenAI, reference: Engine) -> None:
    messages: list[ChatCompletionMessageParam] = [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    want = _greedy_text(reference, PromptTokenizer("tiny").encode_chat(messages), 10)
    full = client.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0,
        extra_body={"ignore_eos": True}, logprobs=True, top_logprobs=2,
    )
    assert full.choices[0].message.content == want
    assert full.choices[0].message.role == "assistant"
    logprobs = full.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    content = logprobs.content
    assert len(content) == 10 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(c.logprob <= 0 for c in content)
    chunks = list(
        client.chat.completions.create(
            model="tiny", messages=messages, max_tokens=10, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"


def test_seeded_sampling_repeats_and_stop_strings_cut(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(model="tiny", prompt=PROMPTS[1], max_tokens=16, temperature=1.0)
    a = client.completions.create(seed=7, **kwargs).choices[0].text
    b = client.completions.create(seed=7, **kwargs).choices[0].text
    assert a == b
    greedy = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0,
        extra_body={"ignore_eos": True}, logprobs=2,
    )
    text = greedy.choices[0].text
    logprobs = greedy.choices[0].logprobs
    assert logprobs is not None and logprobs.tokens is not None and len(logprobs.tokens) == 16
    stop = next(ch for ch in text[3:] if ch.isprintable() and ch != "\ufffd")
    cut = client.completions.create(
        model="tiny", prompt=PROMPTS[0], max_tokens=16, temperature=0, stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_models_health_metrics_and_event_sources(server: Process, client: openai.OpenAI) -> None:
    (card,) = client.models.list().data
    assert card.id == "tiny"
    assert card.model_dump()["max_model_len"] == 1024  # 64 blocks x 16 tokens (vLLM's field)
    assert metric(server.url, "kvoffload_generation_tokens_total") > 0
    assert metric(server.url, "kvoffload_serve_token_compute_seconds") > 0
    sources = json.loads(_get(f"{server.url}/kv_event_sources"))
    assert sources["0"]["endpoint"].startswith("tcp://127.0.0.1:")
    assert sources["0"]["block_size"] == 16


def _get(url: str) -> str:
    import urllib.request

    with urllib.request.urlopen(url, timeout=10) as response:
        return response.read().decode()


# (endpoint, body, param named in the error)
BAD_INPUT = [
    ("completions", b'{"prompt": "x", "max_tokens": 4', None),  # malformed JSON
    ("completions", b'["not", "an", "object"]', None),
    ("completions", {"max_tokens": 4}, "prompt"),
    ("completions", {"prompt": "x", "model": "gpt-5"}, "model"),
    ("completions", {"prompt": "x", "max_tokens": 0}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": -3}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": "4"}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 1.5}, "max_tokens"),
    ("completions", {"prompt": "x", "max_tokens": 2000}, "max_tokens"),
    ("completions", {"prompt": "y" * 1100, "max_tokens": 1}, "prompt"),
    ("completions", {"prompt": "", "max_tokens": 1}, "prompt"),
    ("completions", {"prompt": [], "max_tokens": 1}, "prompt"),
    ("completions", {"prompt": [1, -2], "max_tokens": 1}, "prompt.1"),
    ("completions", {"prompt": [1, 99999], "max_tokens": 1}, "prompt"),
    ("completions", {"prompt": ["a"] * 65, "max_tokens": 1}, "prompt"),
    ("completions", {"prompt": ["a", ""], "max_tokens": 1}, "prompt.1"),
    ("completions", {"prompt": ["a"] * 8, "n": 9, "max_tokens": 1}, "n"),
    ("completions", {"prompt": 7}, "prompt"),
    ("completions", {"prompt": "x", "temperature": "hot"}, "temperature"),
    ("completions", {"prompt": "x", "temperature": -1}, "temperature"),
    ("completions", {"prompt": "x", "top_p": 0}, "top_p"),
    ("completions", {"prompt": "x", "seed": -1}, "seed"),
    ("completions", {"prompt": "x", "n": 17}, "n"),
    ("completions", {"prompt": "x", "n": 0}, "n"),
    ("completions", {"prompt": "x", "stop": 5}, "stop"),
    ("completions", {"prompt": "x", "stream": "yes"}, "stream"),
    ("completions", {"prompt": "x", "logprobs": 99}, "logprobs"),
    ("completions", {"prompt": "x", "presence_penalty": 2.5}, "presence_penalty"),
    ("completions", {"prompt": "x", "frequency_penalty": -3}, "frequency_penalty"),
    ("completions", {"prompt": "x", "repetition_penalty": 0}, "repetition_penalty"),
    ("completions", {"prompt": "x", "min_p": 1.5}, "min_p"),
    ("completions", {"prompt": "x", "max_tokens": 4, "min_tokens": 5}, "min_tokens"),
    ("completions", {"prompt": "x", "logit_bias": {"99999": 5}}, "logit_bias"),
    ("completions", {"prompt": "x", "logit_bias": {"a": 5}}, "logit_bias"),
    ("completions", {"prompt": "x", "logit_bias": {str(i): 1 for i in range(1025)}},
     "logit_bias"),
    ("completions", {"prompt": "x", "stream_options": {"continuous_usage_stats": True}},
     "stream_options.continuous_usage_stats"),
    ("completions", {"prompt": "x", "kv_transfer_params": []}, "kv_transfer_params"),
    ("completions", {"prompt": "x", "kv_transfer_params": {"store_policy": "never"}},
     "kv_transfer_params.store_policy"),
    ("chat/completions", {"messages": []}, "messages"),
    ("chat/completions", {"messages": "hi"}, "messages"),
    ("chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, "messages.0.role"),
    ("chat/completions", {"messages": [{"content": "x"}]}, "messages.0.role"),
    ("chat/completions", {"messages": [{"role": "user", "content": 3}]}, "messages.0.content"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
     "max_tokens"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x" * 1100}]}, "messages"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "model": "nope"},
     "model"),
    ("chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2},
     "top_logprobs"),
]


@pytest.mark.parametrize(("endpoint", "body", "param"), BAD_INPUT)
def test_bad_input_is_400_naming_the_field(
    server: Process, endpoint: str, body: Any, param: str | None
) -> None:
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    status, answer = post_raw(f"{server.url}/v1/{endpoint}", data)
    assert status == 400, answer
    error = answer["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert error["message"] and "Traceback" not in error["message"]


def test_errors_through_the_client_and_unknown_paths(server: Process, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model="tiny", prompt="x", max_tokens=-1)
    body = caught.value.body
    assert isinstance(body, dict) and body["param"] == "max_tokens"
    status, answer = post_raw(f"{server.url}/v1/embeddings", b"{}")
    assert status == 404 and "error" in answer
    # The server still serves.
    assert client.completions.create(model="tiny", prompt="ok", max_tokens=2).choices


def test_disconnect_mid_stream_aborts_and_frees(server: Process) -> None:
    body = json.dumps(
        {"prompt": PROMPTS[1], "max_tokens": 800, "stream": True, "temperature": 0,
         "ignore_eos": True}
    ).encode()
    before = metric(server.url, "kvoffload_generation_tokens_total")
    with socket.create_connection(("127.0.0.1", server.port), timeout=30) as sock:
        sock.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode() + body
        )
        received = b""
        while b"data: " not in received:
            received += sock.recv(4096)
    # The connection is closed: the request must be aborted long before its 800 tokens.
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if metric(server.url, "kvoffload_serve_requests_in_flight") == 0:
            break
        time.sleep(0.1)
    assert metric(server.url, "kvoffload_serve_requests_in_flight") == 0
    assert metric(server.url, "kvoffload_num_requests_running") == 0
    assert metric(server.url, "kvoffload_generation_tokens_total") - before < 600
    assert metric(server.url, "kvoffload_kv_cache_usage_perc") == 0


def test_sigterm_during_load_finishes_everything_and_exits_0() -> None:
    with contextlib.ExitStack() as stack, serve("--kv-offloading-size", "0.01") as process, \
            openai.OpenAI(base_url=f"{process.url}/v1", api_key="x", max_retries=0) as client:
        sources = json.loads(_get(f"{process.url}/kv_event_sources"))["0"]
        sub = KVEventSubscriber(sources["endpoint"], "kv", sources["replay_endpoint"], start_seq=0)
        stack.enter_context(sub)
        results: dict[int, Any] = {}

        def request(i: int) -> None:
            try:
                results[i] = client.completions.create(
                    model="tiny", prompt=f"request {i}: " + PROMPTS[0], max_tokens=24,
                    temperature=0, extra_body={"ignore_eos": True},
                )
            except Exception as exc:  # recorded, asserted below
                results[i] = exc

        threads = [threading.Thread(target=request, args=(i,)) for i in range(6)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 60
        while metric(process.url, "kvoffload_generation_tokens_total") < 1:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        # What was published before the subscription took effect, asked for while the server
        # still answers replay (after it exits, such a gap could not be filled).
        sub.catch_up()
        assert process.terminate(120) == 0
        for t in threads:
            t.join(60)
        assert all(not isinstance(r, Exception) for r in results.values()), results
        assert [len(results[i].choices) for i in range(6)] == [1] * 6
        assert all(results[i].usage.completion_tokens == 24 for i in range(6))
        stored_on_host = 0
        while (got := sub.receive(0.5)) is not None:
            stored_on_host += sum(
                len(e.block_hashes) for e in got.batch.events
                if isinstance(e, BlockStored) and e.medium == MEDIUM_CPU
            )
        assert not sub.take_gaps()
        # Every full block of the six prompts reached the host tier before the exit.
        assert stored_on_host >= 6 * (len(PROMPTS[0]) // 16)

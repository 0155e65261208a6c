"""Issue #30: every OpenAI / vLLM parameter ``kvoffload serve`` accepts, it honours (its effect
checked through the official ``openai`` client against a real server), and every one it does
not do is refused with a 400 naming it. Responses as vLLM's: ``stop_reason``, a chat stream's
role-only first chunk, ``top_logprobs`` that keep tokens decoding to the same text apart, a
token's real ``bytes``, choices indexed with ``n`` > 1 and several prompts, streamed too."""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from openai.types.chat import ChatCompletionMessageParam
from serve_cases import Process, post_raw, serve

pytestmark = pytest.mark.timeout(180)

PROMPT = "The quick brown fox jumps over the lazy dog. " * 2
OTHER = "Offloading keeps prefixes. " * 3
EOS = 256  # the tiny preset's
MESSAGES: list[ChatCompletionMessageParam] = [{"role": "user", "content": "Hi!"}]


@pytest.fixture(scope="module")
def server() -> Iterator[Process]:
    with serve(events=False) as process:
        yield process


@pytest.fixture(scope="module")
def client(server: Process) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0) as client:
        yield client


def _complete(client: openai.OpenAI, prompt: Any = PROMPT, **kwargs: Any) -> Any:
    extra = kwargs.pop("extra_body", {})
    kwargs.setdefault("max_tokens", 16)
    kwargs.setdefault("temperature", 0)
    return client.completions.create(model="tiny", prompt=prompt,
                                      extra_body={"ignore_eos": True, **extra}, **kwargs)


def _greedy_ids(client: openai.OpenAI, prompt: str = PROMPT, **kwargs: Any) -> list[int]:
    out = _complete(client, prompt, extra_body={"return_tokens_as_token_ids": True, **kwargs},
                    logprobs=0)
    return [int(t.split(":")[1]) for t in out.choices[0].logprobs.tokens]


def test_n_choices_differ_and_repeat_under_a_seed(client: openai.OpenAI) -> None:
    kwargs: dict[str, Any] = dict(temperature=1.0, seed=5)
    first = _complete(client, n=3, **kwargs)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert len(set(texts)) == 3
    again = _complete(client, n=3, **kwargs)
    assert [c.text for c in again.choices] == texts
    assert _complete(client, n=1, **kwargs).choices[0].text == texts[0]  # choice j: seed + j
    assert first.usage.completion_tokens == 48
    assert first.usage.prompt_tokens == len(PROMPT.encode())  # the prompt counted once


def test_several_prompts_in_one_request_streamed_or_not(client: openai.OpenAI) -> None:
    alone = [_complete(client, p).choices[0].text for p in (PROMPT, OTHER)]
    both = _complete(client, [PROMPT, OTHER], n=2)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [alone[0], alone[0], alone[1], alone[1]]
    assert both.usage.prompt_tokens == len(PROMPT.encode()) + len(OTHER.encode())
    ids = _complete(client, [list(PROMPT.encode()), list(OTHER.encode())])
    assert [c.text for c in ids.choices] == alone
    streamed: dict[int, str] = defaultdict(str)
    finished = set()
    for chunk in _complete(client, [PROMPT, OTHER], n=2, stream=True,
                           stream_options={"include_usage": True}):
        for choice in chunk.choices:
            streamed[choice.index] += choice.text
            if choice.finish_reason is not None:
                finished.add(choice.index)
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens == 64
    assert finished == {0, 1, 2, 3}
    assert [streamed[i] for i in range(4)] == [alone[0], alone[0], alone[1], alone[1]]


def test_logit_bias_forces_and_forbids_a_token(client: openai.OpenAI) -> None:
    forced = _complete(client, logit_bias={"65": 100}, max_tokens=6)
    assert forced.choices[0].text == "AAAAAA"
    greedy = _greedy_ids(client)
    banned = _greedy_ids(client, logit_bias={str(greedy[0]): -100})
    assert banned[0] != greedy[0]


@pytest.mark.parametrize("key", ["\u00b2", "\u0661", "9" * 5000, "-1", "x"])
def test_logit_bias_keys_that_are_not_token_ids_get_a_400(server: Process, key: str) -> None:
    # "\u00b2" passes str.isdigit() but int() rejects it; 5000 digits pass isdigit() but exceed
    # int()'s digit limit: both once answered 500. "\u0661" (an Arabic-Indic 1) is not an id.
    body = {"model": "tiny", "prompt": "ab", "max_tokens": 2, "logit_bias": {key: 1}}
    status, answer = post_raw(f"{server.url}/v1/completions", json.dumps(body).encode())
    assert (status, answer["error"]["param"]) == (400, "logit_bias"), answer


@pytest.mark.parametrize(("name", "value"), [("stop_token_ids", list(range(500)) * 3),
                                              ("stop", [f"s{i}" for i in range(65)])])
def test_stop_lists_are_bounded(server: Process, name: str, value: list[Any]) -> None:
    # The engine and the text assembler scan these every step: a 4 MiB body could otherwise
    # name a million stop ids and slow every step of every request.
    body = {"model": "tiny", "prompt": "ab", "max_tokens": 2, name: value}
    status, answer = post_raw(f"{server.url}/v1/completions", json.dumps(body).encode())
    assert (status, answer["error"]["param"]) == (400, name), answer
    body[name] = value[:64]
    assert post_raw(f"{server.url}/v1/completions", json.dumps(body).encode())[0] == 200

def test_min_tokens_holds_off_eos_stop_tokens_and_stop_strings(client: openai.OpenAI) -> None:
    # ``stop_reason`` is vLLM's field, not in openai's types: the answers are read untyped.
    eos_now: Any = client.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=8,
                                        logit_bias={str(EOS): 100})
    assert eos_now.usage.completion_tokens == 1
    assert eos_now.choices[0].finish_reason == "stop" and eos_now.choices[0].stop_reason is None
    held: Any = client.completions.create(model="tiny", prompt=PROMPT, temperature=0, max_tokens=8,
                                     logit_bias={str(EOS): 100}, extra_body={"min_tokens": 3})
    assert held.usage.completion_tokens == 4  # three tokens, then EOS
    first = _greedy_ids(client)[0]
    stopped = _complete(client, extra_body={"stop_token_ids": [first]})
    assert stopped.usage.completion_tokens == 1 and stopped.choices[0].stop_reason == first
    later = _complete(client, extra_body={"stop_token_ids": [first], "min_tokens": 5})
    assert later.usage.completion_tokens >= 5
    text = _complete(client).choices[0].text
    stop = text[0]
    assert _complete(client, stop=[stop]).choices[0].text == ""
    head = _complete(client, max_tokens=4).choices[0].text  # the text of min_tokens' tokens
    delayed = _complete(client, stop=[stop], extra_body={"min_tokens": 4}).choices[0].text
    after = text.find(stop, len(head))
    assert delayed == (text if after < 0 else text[:after])
    assert len(delayed) >= len(head) > 0


def test_stop_reason_and_include_stop_str_in_output(client: openai.OpenAI) -> None:
    text = _complete(client).choices[0].text
    stop = next(ch for ch in text[2:] if ch.isprintable() and ch != "\ufffd")
    cut = _complete(client, stop=[stop])
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].stop_reason == stop
    kept = _complete(client, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert kept.choices[0].text == text[: text.index(stop) + 1]
    first = _greedy_ids(client)[0]
    token_stop = _complete(client, extra_body={"stop_token_ids": [first]})
    assert token_stop.choices[0].text == ""  # the stop token's own text is left out (vLLM)
    with_it = _complete(client, extra_body={"stop_token_ids": [first],
                                            "include_stop_str_in_output": True})
    assert with_it.choices[0].text == text[:1] or text[0] == "\ufffd"
    chat: Any = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=0,
                                               max_tokens=8, stop=[stop, "\n"])
    assert chat.choices[0].finish_reason == "length" or chat.choices[0].stop_reason in (stop, "\n")
    assert "stop_reason" in chat.choices[0].model_dump()


def test_penalties_change_greedy_output(client: openai.OpenAI) -> None:
    plain = _greedy_ids(client)
    for name, value in (("repetition_penalty", 3.0), ("frequency_penalty", 2.0),
                        ("presence_penalty", 2.0)):
        changed = _greedy_ids(client, PROMPT, **{name: value})
        assert changed != plain, name
        assert _greedy_ids(client, PROMPT, **{name: value}) == changed  # deterministic
    # Presence penalty: no token repeats while the penalty outweighs the logits' spread.
    assert _greedy_ids(client, repetition_penalty=1.0) == plain


def test_min_p_one_is_greedy(client: openai.OpenAI) -> None:
    greedy = _complete(client).choices[0].text
    sampled = _complete(client, temperature=1.0, seed=3, extra_body={"min_p": 1.0})
    assert sampled.choices[0].text == greedy


def test_max_completion_tokens_on_completions(client: openai.OpenAI) -> None:
    out = _complete(client, extra_body={"max_completion_tokens": 3})
    assert out.usage.completion_tokens == 3


def test_echo_sends_the_prompt_first(client: openai.OpenAI) -> None:
    alone = _complete(client, max_tokens=4).choices[0].text
    echoed = _complete(client, max_tokens=4, echo=True)
    assert echoed.choices[0].text == PROMPT + alone
    ids = _complete(client, [list(PROMPT.encode()), list(OTHER.encode())], max_tokens=4, echo=True)
    assert [c.text[: len(p)] for c, p in zip(ids.choices, (PROMPT, OTHER), strict=True)] == [
        PROMPT, OTHER]
    chunks = list(_complete(client, max_tokens=4, echo=True, stream=True))
    assert chunks[0].choices[0].text.startswith(PROMPT)
    assert "".join(c.choices[0].text for c in chunks) == PROMPT + alone
    with pytest.raises(openai.BadRequestError) as caught:  # echo's prompt logprobs: not computed
        _complete(client, max_tokens=4, echo=True, logprobs=1)
    body = caught.value.body
    assert isinstance(body, dict) and body["param"] == "echo"


def test_top_logprobs_keep_same_text_tokens_apart_and_bytes_are_real(
    client: openai.OpenAI,
) -> None:
    # Of the tiny preset's 512 ids, 256 decode alone to "" and 128 to U+FFFD: keyed by text,
    # the top 20 would collapse. Each must stay, under its text or as token_id:N (vLLM's form).
    by_text = _complete(client, max_tokens=4, logprobs=20).choices[0].logprobs.top_logprobs
    by_id = _complete(client, max_tokens=4, logprobs=20,
                      extra_body={"return_tokens_as_token_ids": True}).choices[0].logprobs
    assert [len(top) for top in by_text] == [len(top) for top in by_id.top_logprobs]
    assert all(len(top) >= 20 for top in by_text)
    assert any(key.startswith("token_id:") for top in by_text for key in top)  # kept apart
    # A byte token's bytes are its byte (not U+FFFD's three); a non-byte id has none.
    high = {str(b): 60 for b in range(0xC0, 0xCA)}
    chat = client.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=0, max_tokens=2, logprobs=True,
        top_logprobs=10, logit_bias=high,
        extra_body={"return_tokens_as_token_ids": True})
    logprobs = chat.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    for item in logprobs.content:
        assert item.bytes is not None and len(item.bytes) == 1 and 0xC0 <= item.bytes[0] < 0xCA
        for alt in item.top_logprobs:
            token = int(alt.token.split(":")[1])
            assert alt.bytes == ([token] if token < 256 else [])
    plain = client.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=0, max_tokens=2, logprobs=True,
        logit_bias=high)
    plain_logprobs = plain.choices[0].logprobs
    assert plain_logprobs is not None and plain_logprobs.content is not None
    assert all(item.token == "\ufffd" and item.bytes is not None and len(item.bytes) == 1
               for item in plain_logprobs.content)


def test_chat_n_streams_with_a_role_only_first_chunk(client: openai.OpenAI) -> None:
    full = client.chat.completions.create(model="tiny", messages=MESSAGES, temperature=1.0,
                                          seed=9, n=2, max_tokens=8,
                                          extra_body={"ignore_eos": True})
    texts = [c.message.content for c in full.choices]
    assert [c.index for c in full.choices] == [0, 1] and texts[0] != texts[1]
    chunks = list(client.chat.completions.create(
        model="tiny", messages=MESSAGES, temperature=1.0, seed=9, n=2, max_tokens=8, stream=True,
        extra_body={"ignore_eos": True}))
    opening = [c.choices[0] for c in chunks[:2]]
    assert [(c.index, c.delta.role, c.delta.content) for c in opening] == [
        (0, "assistant", ""), (1, "assistant", "")]
    streamed: dict[int, str] = defaultdict(str)
    for chunk in chunks[2:]:
        for choice in chunk.choices:
            assert choice.delta.role is None
            streamed[choice.index] += choice.delta.content or ""
    assert [streamed[0], streamed[1]] == texts


# (endpoint, the parameter, a value this server does not do)
REFUSED = [
    ("completions", "best_of", 2),
    ("completions", "echo", "yes"),
    ("completions", "suffix", "x"),
    ("completions", "response_format", {"type": "json_object"}),
    ("completions", "use_beam_search", True),
    ("completions", "prompt_logprobs", 1),
    ("completions", "guided_json", {"type": "object"}),
    ("completions", "structured_outputs", {"regex": "a+"}),
    ("completions", "allowed_token_ids", [1, 2]),
    ("completions", "bad_words", ["x"]),
    ("completions", "truncate_prompt_tokens", 4),
    ("completions", "skip_special_tokens", False),
    ("completions", "priority", 1),
    ("completions", "add_special_tokens", False),
    ("completions", "stream_options", {"include_usage": True}),  # without stream (as vLLM)
    ("chat/completions", "add_special_tokens", True),
    ("chat/completions", "tools", [{"type": "function", "function": {"name": "f"}}]),
    ("chat/completions", "tool_choice", "required"),
    ("chat/completions", "echo", True),
    ("chat/completions", "response_format", {"type": "json_schema"}),
    ("chat/completions", "reasoning_effort", "high"),
    ("chat/completions", "audio", {"voice": "alloy"}),
    ("chat/completions", "continue_final_message", True),
    ("chat/completions", "messages", [{"role": "assistant", "content": "",
                                       "tool_calls": [{"id": "1", "type": "function"}]}]),
]


@pytest.mark.parametrize(("endpoint", "name", "value"), REFUSED)
def test_what_it_does_not_do_is_refused_naming_it(
    client: openai.OpenAI, endpoint: str, name: str, value: Any
) -> None:
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 2}
    if endpoint == "completions":
        body["prompt"] = "x"
    else:
        body["messages"] = MESSAGES
    body[name] = value
    with pytest.raises(openai.BadRequestError) as caught:
        client.post(f"/{endpoint}", body=body, cast_to=object)
    error = caught.value.body
    assert isinstance(error, dict)
    param = error["param"]
    assert param == name or (name == "messages" and param == "messages.0.tool_calls")
    assert name in error["message"]


def test_neutral_values_of_refused_parameters_are_accepted(client: openai.OpenAI) -> None:
    out = client.completions.create(model="tiny", prompt="x", max_tokens=2, best_of=1, echo=False,
                                    suffix=None, extra_body={"response_format": {"type": "text"}})
    assert out.choices[0].text is not None
    chat = client.chat.completions.create(model="tiny", messages=MESSAGES, max_tokens=2, tools=[],
                                          tool_choice="none", response_format={"type": "text"})
    assert chat.choices[0].message.role == "assistant"


#: Values of the sampling parameters, in range or not, of the right type or not.
ANY_VALUE = st.one_of(st.none(), st.booleans(), st.integers(-3, 600), st.floats(-3, 3),
                      st.text(max_size=3), st.lists(st.integers(-1, 600), max_size=3),
                      st.dictionaries(st.sampled_from(["65", "256", "-1", "x"]),
                                      st.floats(-200, 200), max_size=2))
SAMPLING = ["n", "min_tokens", "repetition_penalty", "presence_penalty", "frequency_penalty",
            "logit_bias", "min_p", "include_stop_str_in_output", "stop", "stop_token_ids",
            "seed", "temperature", "top_k", "logprobs", "echo", "best_of"]


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.dictionaries(st.sampled_from(SAMPLING), ANY_VALUE, max_size=5))
def test_any_mix_of_parameters_is_served_or_refused_never_a_crash(
    server: Process, fields: dict[str, Any]
) -> None:
    body = {"model": "tiny", "prompt": ["ab", "cd"], "max_tokens": 3, **fields}
    status, answer = post_raw(f"{server.url}/v1/completions", json.dumps(body).encode())
    assert status in (200, 400), answer
    if status == 400:
        assert answer["error"]["param"], answer
    else:
        n = fields.get("n", 1)
        assert [c["index"] for c in answer["choices"]] == list(range(2 * n))

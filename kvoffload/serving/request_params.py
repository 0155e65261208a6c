"""The request-parameter checks of ``kvoffload serve``: a completions or chat body, parsed and
validated (the field at fault is named, status 400), tokenized and turned into a :class:`Job`:
one :class:`Choice` (one engine request) per prompt and per ``n``, indexed ``prompt * n + j``
as vLLM (with a seed, choice ``j`` draws with ``seed + j``, as vLLM's parallel sampling).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from typing import Any, TypeVar

from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from kvoffload.engine import SamplingParams
from kvoffload.errors import ConfigError
from kvoffload.serving.context import ServingContext
from kvoffload.serving.errors import APIError
from kvoffload.serving.prompts import chat_messages
from kvoffload.serving.protocol import ChatCompletionRequest, CompletionRequest
from kvoffload.serving.request_body import check_token_ids, parse_json_object

__all__ = [
    "MAX_CHOICES",
    "MAX_PROMPTS",
    "Choice",
    "Job",
    "prepare_chat",
    "prepare_completion",
    "tokenize_body",
]

logger = logging.getLogger(__name__)

#: The most prompts one completions request may hold.
MAX_PROMPTS = 64
#: The most choices (prompts x ``n``) one request may ask for: each is an engine request.
MAX_CHOICES = 64
#: ``logit_bias`` values are clamped to this magnitude, as vLLM and OpenAI do.
MAX_BIAS = 100.0


# Parsing, validation and tokenization run on a worker thread (``asyncio.to_thread``): a large
# body never holds up the event loop, so /health and the streams in flight keep answering.

M = TypeVar("M", CompletionRequest, ChatCompletionRequest)


@dataclass(slots=True)
class Choice:
    """One choice of a request: one engine request."""

    index: int
    token_ids: list[int]
    sampling: SamplingParams


@dataclass(slots=True)
class Job:
    """A validated request: its body, its prompts (token ids) and its choices."""

    body: CompletionRequest | ChatCompletionRequest
    prompts: list[list[int]]
    choices: list[Choice]
    #: completions with ``echo``: each prompt's text, sent before its choices' output
    echo: list[str] | None = None


def _validated(model: type[M], data: bytes) -> M:
    """``data`` as a ``model`` request; a field at fault is a :class:`RequestValidationError`
    (status 400 naming it, as FastAPI's own validation); a parameter set to what this server
    does not do is an :class:`APIError` naming it. Fields neither OpenAI nor vLLM define are
    ignored, their names logged (as vLLM does)."""
    raw = parse_json_object(data)
    try:
        body = model.model_validate(raw)
    except ValidationError as exc:
        raise RequestValidationError(exc.errors(include_url=False)) from None
    refused = body.refused()
    if refused is not None:
        name, why = refused.split(": ", 1)
        raise APIError(f"`{name}` is not supported by this server: {why}", name)
    unknown = [k for k in raw if k not in model.model_fields]
    if unknown:
        logger.warning("ignored request fields: %s",
                       ", ".join(repr(k[:40]) for k in unknown[:10]))
    return body


def prepare_completion(ctx: ServingContext, data: bytes) -> Job:
    body = _validated(CompletionRequest, data)
    _check_model(ctx, body.model)
    prompts, texts = _completion_prompts(ctx, body.prompt)
    max_tokens = body.max_completion_tokens or body.max_tokens
    samplings = [_sampling(ctx, body, len(ids), max_tokens, "prompt", body.logprobs)
                 for ids in prompts]
    echo = None
    if body.echo is True:  # as vLLM: the prompt's text as sent, or its ids decoded
        decode = ctx.loop.engine.tokenizer.decode
        echo = [decode(ids) if text is None else text
                for ids, text in zip(prompts, texts, strict=True)]
    return Job(body, prompts, _choices(prompts, samplings, body.n), echo)


def prepare_chat(ctx: ServingContext, data: bytes) -> Job:
    body = _validated(ChatCompletionRequest, data)
    _check_model(ctx, body.model)
    ids = ctx.tokenizer.encode_chat(chat_messages([m.model_dump() for m in body.messages]))
    top = (body.top_logprobs or 0) if body.logprobs else None
    if body.top_logprobs is not None and not body.logprobs:
        raise APIError("top_logprobs needs logprobs: true", "top_logprobs")
    max_tokens = body.max_completion_tokens or body.max_tokens
    sampling = _sampling(ctx, body, len(ids), max_tokens, "messages", top, chat=True)
    return Job(body, [ids], _choices([ids], [sampling], body.n))


def _choices(prompts: list[list[int]], samplings: list[SamplingParams], n: int) -> list[Choice]:
    """``n`` choices per prompt, indexed ``prompt * n + j``; with a seed, choice ``j`` of a
    prompt samples with ``seed + j`` (vLLM's parallel sampling), so they differ yet repeat."""
    if len(prompts) * n > MAX_CHOICES:
        raise APIError(f"at most {MAX_CHOICES} choices per request (prompts x n), "
                       f"got {len(prompts)} x {n}", "n")
    out = []
    for p, (ids, sampling) in enumerate(zip(prompts, samplings, strict=True)):
        for j in range(n):
            seeded = sampling if sampling.seed is None or j == 0 else replace(
                sampling, seed=(sampling.seed + j) % 2**64)
            out.append(Choice(p * n + j, ids, seeded))
    return out


def tokenize_body(ctx: ServingContext, data: bytes) -> dict[str, Any]:
    body = parse_json_object(data)
    messages = body.get("messages")
    if isinstance(messages, list) and all(isinstance(m, dict) for m in messages):
        ids = ctx.tokenizer.encode_chat(chat_messages(messages))
    elif isinstance(body.get("prompt"), str):
        ids = ctx.tokenizer.encode(body["prompt"])
    else:
        raise APIError("give a string 'prompt' or a list of 'messages' objects", "prompt")
    return {"count": len(ids), "max_model_len": ctx.max_model_len, "tokens": ids}


def _check_model(ctx: ServingContext, model: str | None) -> None:
    if model is not None and model != ctx.model_name:
        raise APIError(
            f"The model `{model}` does not exist; this server serves `{ctx.model_name}`.",
            "model",
            code="model_not_found",
        )


def _completion_prompts(
    ctx: ServingContext, prompt: Any
) -> tuple[list[list[int]], list[str | None]]:
    """The prompts of a completions request (one text or id list, or a list of them, at most
    :data:`MAX_PROMPTS`) as token ids, and each one's text where it was sent as text."""
    several = isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)
    prompts = prompt if several else [prompt]
    if len(prompts) > MAX_PROMPTS:
        raise APIError(f"at most {MAX_PROMPTS} prompts per request, got {len(prompts)}", "prompt")
    vocab = ctx.loop.engine.model_config.vocab_size
    out: list[list[int]] = []
    texts: list[str | None] = []
    for i, one in enumerate(prompts):
        param = f"prompt.{i}" if several else "prompt"
        if isinstance(one, str):
            if not one:
                raise APIError("the prompt must not be empty", param)
            out.append(ctx.tokenizer.encode(one))
            texts.append(one)
        else:
            out.append(check_token_ids(one, param, vocab))
            texts.append(None)
    return out, texts


def _logit_bias(ctx: ServingContext, bias: dict[str, float] | None) -> tuple[tuple[int, float], ...]:
    """``logit_bias`` as ``(token id, bias)`` pairs: keys token ids in the vocabulary, values
    clamped to [-100, 100] (as vLLM)."""
    if not bias:
        return ()
    vocab = ctx.loop.engine.model_config.vocab_size
    out = []
    for key, value in bias.items():
        digits = key.strip()
        # ASCII decimal only (str.isdigit() also passes "\u00b2", which int() rejects) and short
        # enough for int() (its digit limit): anything else is not a token id.
        token = int(digits) if digits.isascii() and digits.isdigit() and len(digits) < 20 else -1
        if not 0 <= token < vocab:
            raise APIError(f"logit_bias keys must be token ids in [0, {vocab}), got {key[:40]!r}",
                           "logit_bias")
        out.append((token, min(MAX_BIAS, max(-MAX_BIAS, value))))
    return tuple(out)


def _sampling(
    ctx: ServingContext,
    body: CompletionRequest | ChatCompletionRequest,
    num_prompt_tokens: int,
    max_tokens: int | None,
    prompt_param: str,
    logprobs: int | None,
    chat: bool = False,
) -> SamplingParams:
    limit = ctx.max_model_len
    if num_prompt_tokens >= limit:
        raise APIError(
            f"This model's maximum context length is {limit} tokens. However, your request has "
            f"{num_prompt_tokens} input tokens.",
            prompt_param,
        )
    if max_tokens is None:
        max_tokens = limit - num_prompt_tokens if chat else min(16, limit - num_prompt_tokens)
    elif num_prompt_tokens + max_tokens > limit:
        raise APIError(
            f"This model's maximum context length is {limit} tokens. However, you requested "
            f"{num_prompt_tokens + max_tokens} tokens ({num_prompt_tokens} in the input, "
            f"{max_tokens} in the completion).",
            "max_completion_tokens" if body.max_completion_tokens else "max_tokens",
        )
    top_k = body.top_k if body.top_k is not None and body.top_k > 0 else 0
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p,
            top_k=top_k,
            seed=body.seed,
            ignore_eos=body.ignore_eos,
            stop_token_ids=tuple(body.stop_token_ids or ()),
            logprobs=logprobs,
            min_tokens=body.min_tokens,
            logit_bias=_logit_bias(ctx, body.logit_bias),
            repetition_penalty=1.0 if body.repetition_penalty is None else body.repetition_penalty,
            frequency_penalty=body.frequency_penalty or 0.0,
            presence_penalty=body.presence_penalty or 0.0,
            min_p=body.min_p,
        )
    except ConfigError as exc:
        raise APIError.from_config_error(exc) from None

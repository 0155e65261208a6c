"""Request bodies of the OpenAI API that ``kvoffload serve`` accepts, as pydantic models.

Types are strict where OpenAI's are (a string is not a number, a number is not a string); a
field of the wrong type or out of range fails validation, which the server answers with status
400 and OpenAI's error JSON naming the field. Every parameter OpenAI or vLLM defines is either
honoured or, when set to anything but its neutral value, refused with a 400 naming it
(:data:`REFUSED`; docs/serving.md has the table). Fields neither defines are ignored, as OpenAI
and vLLM do (their names are logged). Client-sized inputs are bounded: ``n`` <= :data:`MAX_N`,
``logit_bias`` <= :data:`MAX_LOGIT_BIAS` entries, ``stop`` <= :data:`MAX_STOP` strings,
``stop_token_ids`` <= :data:`MAX_STOP_TOKEN_IDS` ids (the engine and the text assembler scan
them every step; the server bounds the prompts and choices).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

__all__ = [
    "MAX_LOGIT_BIAS",
    "MAX_N",
    "MAX_STOP",
    "MAX_STOP_TOKEN_IDS",
    "REFUSED",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "StreamOptions",
]

#: The most choices one request may ask for per prompt.
MAX_N = 16
#: The most tokens one ``logit_bias`` may name.
MAX_LOGIT_BIAS = 1024
#: The most stop strings one request may give.
MAX_STOP = 64
#: The most stop token ids one request may give.
MAX_STOP_TOKEN_IDS = 1024

Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]
TokenIds = list[Annotated[StrictInt, Field(ge=0)]]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False
    continuous_usage_stats: Literal[False] = False


class _SamplingFields(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    min_tokens: Annotated[StrictInt, Field(ge=0)] = 0
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    min_p: Annotated[Number, Field(ge=0, le=1)] = 0.0
    seed: Annotated[StrictInt, Field(ge=0, lt=2**64)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_N)] = 1
    stop: StrictStr | Annotated[list[StrictStr], Field(max_length=MAX_STOP)] | None = None
    stop_token_ids: Annotated[TokenIds, Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    include_stop_str_in_output: StrictBool = False
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    frequency_penalty: Annotated[Number, Field(ge=-2, le=2)] | None = None
    repetition_penalty: Annotated[Number, Field(gt=0)] | None = None
    logit_bias: Annotated[dict[str, Number], Field(max_length=MAX_LOGIT_BIAS)] | None = None
    return_tokens_as_token_ids: StrictBool | None = None
    user: StrictStr | None = None
    kv_transfer_params: dict[str, Any] | None = None
    # Parameters OpenAI or vLLM define that this server does not do: refused unless neutral.
    response_format: Any = None
    use_beam_search: Any = None
    length_penalty: Any = None
    allowed_token_ids: Any = None
    bad_words: Any = None
    prompt_logprobs: Any = None
    structured_outputs: Any = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    guided_whitespace_pattern: Any = None
    logits_processors: Any = None
    skip_special_tokens: Any = None
    spaces_between_special_tokens: Any = None
    truncate_prompt_tokens: Any = None
    add_special_tokens: Any = None
    priority: Any = None
    return_token_ids: Any = None
    vllm_xargs: Any = None
    cache_salt: Any = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]

    #: What the endpoint's tokenization does with special tokens (vLLM's default there).
    adds_special_tokens: ClassVar[bool] = True

    def refused(self) -> str | None:
        """The first parameter set to something this server does not do (see :data:`REFUSED`),
        with why, as ``"name: why"``; ``None`` when every one is neutral."""
        for name, (neutral, why) in REFUSED.items():
            if name in type(self).model_fields and not neutral(getattr(self, name)):
                return f"{name}: {why}"
        if self.add_special_tokens not in (None, self.adds_special_tokens):
            return (f"add_special_tokens: only {str(self.adds_special_tokens).lower()} here (the "
                    "tokenizer adds what the model expects)")
        if self.stream_options is not None and not self.stream:
            return "stream_options: only with stream: true"
        return None


def _absent(value: Any) -> bool:
    return value is None


def _false(value: Any) -> bool:
    return value is None or value is False


def _true(value: Any) -> bool:
    return value is None or value is True


def _empty(value: Any) -> bool:
    return value is None or value == [] or value == "" or value == {}


def _text_format(value: Any) -> bool:
    return value is None or (isinstance(value, dict) and value.get("type") == "text")


def _no_tool_choice(value: Any) -> bool:
    return value is None or value in ("none", "auto")


#: Parameter -> (whether a value is neutral, why another is refused). Set to a neutral value a
#: parameter is accepted (``false``, ``null``, empty, its default); otherwise a 400 names it.
REFUSED: dict[str, tuple[Callable[[Any], bool], str]] = {
    "best_of": (_absent, "must equal n: this server does not rank extra candidates"),
    "echo": (_false, "echoing the prompt is not supported"),
    "suffix": (_empty, "insertion (a suffix) is not supported"),
    "response_format": (_text_format, "only {\"type\": \"text\"} is supported (no JSON or "
                        "schema-constrained output)"),
    "tools": (_empty, "tool calling is not supported"),
    "tool_choice": (_no_tool_choice, "tool calling is not supported"),
    "functions": (_empty, "function calling is not supported"),
    "function_call": (_no_tool_choice, "function calling is not supported"),
    "audio": (_absent, "audio output is not supported"),
    "modalities": (lambda v: v is None or v == ["text"], "only [\"text\"] is supported"),
    "prediction": (_absent, "predicted outputs are not supported"),
    "reasoning_effort": (_absent, "the model does not reason"),
    "web_search_options": (_absent, "web search is not supported"),
    "continue_final_message": (_false, "continuing the final message is not supported"),
    "add_generation_prompt": (_true, "the chat template always adds the generation prompt"),
    "chat_template": (_absent, "a per-request chat template is not supported"),
    "chat_template_kwargs": (_empty, "chat template arguments are not supported"),
    "documents": (_empty, "documents are not supported"),
    "use_beam_search": (_false, "beam search is not supported"),
    "length_penalty": (lambda v: v is None or v == 1, "only with beam search (not supported)"),
    "allowed_token_ids": (_absent, "not supported"),
    "bad_words": (_empty, "not supported"),
    "prompt_logprobs": (_absent, "prompt log-probabilities are not supported"),
    "structured_outputs": (_absent, "structured outputs are not supported"),
    "guided_json": (_absent, "guided decoding is not supported"),
    "guided_regex": (_absent, "guided decoding is not supported"),
    "guided_choice": (_absent, "guided decoding is not supported"),
    "guided_grammar": (_absent, "guided decoding is not supported"),
    "guided_decoding_backend": (_absent, "guided decoding is not supported"),
    "guided_whitespace_pattern": (_absent, "guided decoding is not supported"),
    "logits_processors": (_empty, "custom logits processors are not supported"),
    "skip_special_tokens": (_true, "special tokens are always left out of the text"),
    "spaces_between_special_tokens": (_true, "special tokens are always left out of the text"),
    "truncate_prompt_tokens": (_absent, "prompts are not truncated: send a shorter prompt"),
    "priority": (lambda v: v is None or v == 0, "requests are served first come, first served"),
    "return_token_ids": (_false, "not supported"),
    "vllm_xargs": (_empty, "not supported"),
    "cache_salt": (_absent, "per-request cache salts are not supported"),
}


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: one prompt or several, as text or token ids."""

    prompt: StrictStr | TokenIds | list[StrictStr] | list[TokenIds]
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    echo: Any = None
    suffix: Any = None
    best_of: Annotated[StrictInt, Field(ge=1)] | None = None

    def refused(self) -> str | None:
        """As the base's, but ``best_of`` equal to ``n`` and ``echo`` without ``logprobs`` (the
        prompt's log-probabilities are not computed) are honoured."""
        update: dict[str, Any] = {}
        if self.best_of is not None and self.best_of == self.n:
            update["best_of"] = None
        if self.echo is True and self.logprobs is None:
            update["echo"] = None
        if update:
            return self.model_copy(update=update).refused()
        if self.echo is True:
            return "echo: with logprobs it needs the prompt's log-probabilities (not supported)"
        return super().refused()


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[dict[str, Any]] | None = None
    name: StrictStr | None = None
    #: an earlier turn's tool calls: tool calling is not supported, so none may be given
    tool_calls: Annotated[list[Any], Field(max_length=0)] | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    adds_special_tokens: ClassVar[bool] = False  # the chat template writes them

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    echo: Any = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: StrictBool | None = None
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    reasoning_effort: Any = None
    web_search_options: Any = None
    continue_final_message: Any = None
    add_generation_prompt: Any = None
    chat_template: Any = None
    chat_template_kwargs: Any = None
    documents: Any = None
    # Informational (no effect on generation by definition): accepted.
    metadata: dict[str, StrictStr] | None = None
    store: StrictBool | None = None
    service_tier: StrictStr | None = None

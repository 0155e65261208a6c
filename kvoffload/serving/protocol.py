"""Request bodies of the OpenAI API that ``kvoffload serve`` accepts, as pydantic models.

Types are strict where OpenAI's are (a string is not a number, a number is not a string); a
field of the wrong type or out of range fails validation, which the server answers with status
400 and OpenAI's error JSON naming the field. Fields OpenAI defines that the engine cannot honour
(``n`` > 1, penalties) are accepted at their neutral value and refused otherwise, naming them.
Unknown fields are ignored, as OpenAI and vLLM do. vLLM's extensions that the engine has
(``top_k``, ``ignore_eos``, ``stop_token_ids``, ``kv_transfer_params``) are accepted too.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr

__all__ = [
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "StreamOptions",
]

Number = Annotated[float, Field(strict=True, allow_inf_nan=False)]
TokenIds = list[Annotated[StrictInt, Field(ge=0)]]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class _SamplingFields(BaseModel):
    """What completions and chat completions share."""

    model_config = ConfigDict(extra="ignore")

    model: StrictStr | None = None
    max_tokens: Annotated[StrictInt, Field(ge=1)] | None = None
    temperature: Annotated[Number, Field(ge=0, le=2)] | None = None
    top_p: Annotated[Number, Field(gt=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1)] | None = None
    seed: Annotated[StrictInt, Field(ge=0, lt=2**64)] | None = None
    n: Annotated[StrictInt, Field(ge=1, le=1)] = 1
    stop: StrictStr | list[StrictStr] | None = None
    stop_token_ids: TokenIds | None = None
    ignore_eos: StrictBool = False
    stream: StrictBool = False
    stream_options: StreamOptions | None = None
    presence_penalty: Annotated[Number, Field(ge=0, le=0)] | None = None
    frequency_penalty: Annotated[Number, Field(ge=0, le=0)] | None = None
    user: StrictStr | None = None
    kv_transfer_params: dict[str, Any] | None = None

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``: one prompt, as text or token ids."""

    prompt: StrictStr | TokenIds | list[StrictStr] | list[TokenIds]
    logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    echo: Literal[False] = False


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: StrictStr | list[dict[str, Any]] | None = None
    name: StrictStr | None = None


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    logprobs: StrictBool = False
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=20)] | None = None
    max_completion_tokens: Annotated[StrictInt, Field(ge=1)] | None = None

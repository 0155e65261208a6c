"""Request intake: a prompt's token ids, and the checks a request passes before it is queued.

Every problem is a :class:`~kvoffload.errors.ConfigError` naming the argument at fault
(``prompt``, ``sampling``, ``request_id``, ``prompts``); nothing here changes engine state.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvoffload.engine.sampling import SamplingParams
from kvoffload.engine.tokenizer import Tokenizer
from kvoffload.errors import ConfigError
from kvoffload.managers.tiering import validate_tier_params
from kvoffload.scheduler.connector import parse_kv_transfer_params

if TYPE_CHECKING:
    from kvoffload.engine.engine import Engine

__all__ = ["RequestIntake", "generate_params", "prompt_token_ids"]


def prompt_token_ids(tokenizer: Tokenizer, prompt: Any) -> list[int]:
    """The prompt's token ids: text is encoded, a sequence must hold ints (not bools); an empty
    prompt is refused."""
    if isinstance(prompt, str):
        token_ids = tokenizer.encode(prompt)
    elif isinstance(prompt, Sequence) and not isinstance(prompt, bytes | bytearray):
        token_ids = list(prompt)
        bad = next((t for t in token_ids if isinstance(t, bool) or not isinstance(t, int)), None)
        if bad is not None:
            raise ConfigError("prompt", f"token ids must be integers, got {bad!r}")
    else:
        raise ConfigError("prompt", f"must be a str or a sequence of token ids, got {prompt!r}")
    if not token_ids:
        raise ConfigError("prompt", "must not be empty")
    return token_ids


@dataclass(frozen=True)
class RequestIntake:
    """What a request must fit: the model's vocabulary and positions, the device cache's tokens,
    the connector's store policy and (with secondary tiers) the tiers' names."""

    tokenizer: Tokenizer
    vocab_size: int
    capacity_tokens: int
    max_positions: int
    store_policy: str
    tier_names: Sequence[str] | None

    @classmethod
    def of(cls, engine: Engine) -> RequestIntake:
        """The limits of ``engine`` (built: model, device cache and offloading in place)."""
        model, tiering = engine.model_config, engine.tiering
        return cls(
            engine.tokenizer,
            model.vocab_size,
            engine.num_device_blocks * engine.config.block_size,
            model.max_position_embeddings,
            engine.config.store_policy,
            tiering.tier_names if tiering is not None else None,
        )

    def token_ids(self, prompt: Any) -> list[int]:
        """:func:`prompt_token_ids` with this engine's tokenizer."""
        return prompt_token_ids(self.tokenizer, prompt)

    def check(
        self,
        prompt: Any,
        sampling: SamplingParams | None,
        request_id: str | None,
        kv_transfer_params: dict[str, Any] | None,
    ) -> tuple[list[int], SamplingParams]:
        """The request's token ids and sampling parameters (``None``: the defaults), or a
        :class:`ConfigError` for a request that can never run: arguments of the wrong kind, ids
        outside the vocabulary, prompt + ``max_tokens`` beyond the device cache or the model's
        positions, or transfer parameters the connector (or the tiering manager) refuses."""
        if sampling is None:
            sampling = SamplingParams()
        elif not isinstance(sampling, SamplingParams):
            raise ConfigError("sampling", f"must be a SamplingParams or None, got {sampling!r}")
        if request_id is not None and not isinstance(request_id, str):
            raise ConfigError("request_id", f"must be a str or None, got {request_id!r}")
        token_ids = self.token_ids(prompt)
        vocab = self.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ConfigError("prompt", f"token ids must be in [0, {vocab})")
        max_len = len(token_ids) + sampling.max_tokens
        if max_len > self.capacity_tokens:
            raise ConfigError(
                "prompt",
                f"prompt + max_tokens = {max_len} tokens exceeds the device KV cache "
                f"({self.capacity_tokens} tokens)",
            )
        if max_len > self.max_positions:
            raise ConfigError(
                "prompt", f"{max_len} tokens exceed the model's {self.max_positions} positions"
            )
        if kv_transfer_params is not None:
            parse_kv_transfer_params(kv_transfer_params, self.store_policy)
            if self.tier_names is not None:
                validate_tier_params(kv_transfer_params, self.tier_names)
        return token_ids, sampling


def generate_params(
    prompts: Iterable[Any], sampling: SamplingParams | Sequence[SamplingParams] | None
) -> tuple[list[Any], list[SamplingParams | None]]:
    """:meth:`Engine.generate`'s arguments as one sampling entry per prompt (``None``: the
    defaults); a single ``SamplingParams`` serves every prompt."""
    if isinstance(prompts, str | bytes) or not isinstance(prompts, Iterable):
        raise ConfigError("prompts", f"must be a list of prompts, got {prompts!r}")
    prompt_list = list(prompts)
    params: list[SamplingParams | None]
    if isinstance(sampling, list | tuple):
        params = list(sampling)
    elif sampling is None or isinstance(sampling, SamplingParams):
        params = [sampling] * len(prompt_list)
    else:
        raise ConfigError(
            "sampling", f"must be a SamplingParams, a list of them or None, got {sampling!r}"
        )
    if len(params) != len(prompt_list):
        raise ConfigError(
            "sampling", f"{len(params)} sampling params for {len(prompt_list)} prompts"
        )
    return prompt_list, params

"""Sampling parameters and the per-row sampler of the reference engine.

Reproducibility: a non-greedy row draws exactly one float64 uniform from its request's own CPU
:class:`torch.Generator` per token and picks the token by inverse CDF over its (filtered)
distribution. A seeded request therefore produces the same tokens whatever else is in the batch
and in whatever order, given the same logits.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from kvoffload.errors import ConfigError

__all__ = ["GREEDY_BELOW", "SamplingParams", "make_generator", "sample"]

_MAX_SEED = 2**64 - 1
#: A temperature below this is greedy, as vLLM's ``_SAMPLING_EPS``.
GREEDY_BELOW = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request generates.

    ``temperature`` below :data:`GREEDY_BELOW` (vLLM's ``_SAMPLING_EPS``; 0 included) is greedy
    (argmax; ``top_p``, ``top_k`` and ``seed`` are then unused): dividing the logits by a tinier
    one overflows float32.
    ``top_k == 0`` and ``top_p == 1`` disable those filters. Generation stops after ``max_tokens``
    tokens, at EOS unless ``ignore_eos``, or at any of ``stop_token_ids`` (the stop token is
    part of the output). ``logprobs``: return, per generated token, the log-probabilities of
    the ``logprobs`` most likely tokens plus the sampled one (``-1``: the whole vocabulary;
    ``None``: none). Invalid values raise :class:`ConfigError` naming the field.

    As vLLM's ``SamplingParams``: ``min_tokens`` forbids EOS and ``stop_token_ids`` until that
    many tokens are out; ``logit_bias`` (token id -> bias, a mapping or pairs; stored as sorted
    pairs) is added to the logits; ``repetition_penalty`` (> 0; 1 is off) divides the positive
    logits and multiplies the negative ones of every token seen in the prompt or the output;
    ``frequency_penalty`` and ``presence_penalty`` (in [-2, 2]) subtract ``penalty * count`` and
    ``penalty * (count > 0)`` over the output's tokens; ``min_p`` (in [0, 1]) drops, when
    sampling, the tokens less likely than ``min_p`` times the most likely one. All of these
    apply to greedy rows too, except ``min_p`` (argmax-invariant); logprobs are the model's raw
    ones (vLLM's default ``raw_logprobs``).
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None
    min_tokens: int = 0
    logit_bias: tuple[tuple[int, float], ...] = ()
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    min_p: float = 0.0

    def __post_init__(self) -> None:
        if not _is_int(self.max_tokens) or self.max_tokens < 1:
            raise ConfigError("max_tokens", f"must be an integer >= 1, got {self.max_tokens!r}")
        if not _is_real(self.temperature) or self.temperature < 0:
            raise ConfigError(
                "temperature", f"must be a finite number >= 0, got {self.temperature!r}"
            )
        if not _is_real(self.top_p) or not 0 < self.top_p <= 1:
            raise ConfigError("top_p", f"must be in (0, 1], got {self.top_p!r}")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise ConfigError(
                "top_k", f"must be an integer >= 0 (0 disables it), got {self.top_k!r}"
            )
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed <= _MAX_SEED):
            raise ConfigError(
                "seed", f"must be None or an integer in [0, 2**64), got {self.seed!r}"
            )
        if not isinstance(self.ignore_eos, bool):
            raise ConfigError("ignore_eos", f"must be a bool, got {self.ignore_eos!r}")
        try:
            if isinstance(self.stop_token_ids, str | bytes):
                raise TypeError
            stop = tuple(self.stop_token_ids)
        except TypeError:
            raise ConfigError(
                "stop_token_ids", f"must be a sequence of ids, got {self.stop_token_ids!r}"
            ) from None
        if not all(_is_int(t) and t >= 0 for t in stop):
            raise ConfigError("stop_token_ids", f"must be non-negative integers, got {stop!r}")
        object.__setattr__(self, "stop_token_ids", stop)
        if self.logprobs is not None and (not _is_int(self.logprobs) or self.logprobs < -1):
            raise ConfigError(
                "logprobs", f"must be None, -1 (all) or an integer >= 0, got {self.logprobs!r}"
            )
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ConfigError(
                "min_tokens", f"must be an integer in [0, max_tokens={self.max_tokens}], "
                f"got {self.min_tokens!r}"
            )
        object.__setattr__(self, "logit_bias", _bias_pairs(self.logit_bias))
        if not _is_real(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise ConfigError("repetition_penalty",
                              f"must be a finite number > 0, got {self.repetition_penalty!r}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -2 <= value <= 2:
                raise ConfigError(name, f"must be in [-2, 2], got {value!r}")
        if not _is_real(self.min_p) or not 0 <= self.min_p <= 1:
            raise ConfigError("min_p", f"must be in [0, 1], got {self.min_p!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_BELOW

    @property
    def penalised(self) -> bool:
        """Whether a repetition, frequency or presence penalty applies."""
        return (self.repetition_penalty != 1 or self.frequency_penalty != 0
                or self.presence_penalty != 0)

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits are changed before the pick (penalties, bias, ``min_tokens``)."""
        return self.penalised or bool(self.logit_bias) or self.min_tokens > 0


def _bias_pairs(bias: Any) -> tuple[tuple[int, float], ...]:
    """``bias`` (a mapping or ``(id, bias)`` pairs) as sorted ``(id, bias)`` pairs, checked."""
    if isinstance(bias, (str, bytes)):  # iterable, but never pairs ('' would pass as none)
        raise ConfigError("logit_bias", f"must map token ids to numbers, got {bias!r}")
    try:
        pairs = list(bias.items() if isinstance(bias, Mapping) else bias)
        out = tuple(sorted((token, value) for token, value in pairs))
    except (TypeError, ValueError):
        raise ConfigError("logit_bias", f"must map token ids to numbers, got {bias!r}") from None
    for token, value in out:
        if not _is_int(token) or token < 0 or not _is_real(value):
            raise ConfigError("logit_bias", f"must map token ids >= 0 to finite numbers, "
                              f"got {token!r}: {value!r}")
    if len({token for token, _ in out}) != len(out):
        raise ConfigError("logit_bias", "names a token id twice")
    return tuple((token, float(value)) for token, value in out)


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def make_generator(params: SamplingParams) -> torch.Generator:
    """The per-request CPU generator: seeded with ``params.seed``, or freshly random if None."""
    seed = params.seed if params.seed is not None else secrets.randbits(63)
    return torch.Generator().manual_seed(seed)


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """One token id per row of ``logits`` ``(N, vocab)``, row ``i`` drawn with ``params[i]``.

    Greedy rows are one batched argmax (first maximal id on ties). Other rows are sampled one
    by one with ``generators[i]`` (a CPU generator from :func:`make_generator`; ``None`` uses the
    global one and is not reproducible).
    """
    num_rows = logits.shape[0]
    if not len(params) == len(generators) == num_rows:
        raise ValueError(
            f"{num_rows} logit rows, {len(params)} params, {len(generators)} generators"
        )
    out = [0] * num_rows
    greedy = [i for i, p in enumerate(params) if p.greedy]
    if greedy:
        rows = logits if len(greedy) == num_rows else logits[greedy]
        for i, token in zip(greedy, rows.argmax(dim=-1).tolist(), strict=True):
            out[i] = token
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = _sample_row(logits[i], p, generators[i])
    return out


def _sample_row(row: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    scaled = row.float() / p.temperature
    vocab = scaled.shape[0]
    if p.min_p > 0:
        # vLLM's min-p: drop ids whose probability is below min_p times the top one's.
        probs = torch.softmax(scaled, dim=-1)
        scaled = scaled.masked_fill(probs < p.min_p * probs.max(), float("-inf"))
    ids: torch.Tensor | None = None
    if 0 < p.top_k < vocab:
        scaled, ids = torch.topk(scaled, p.top_k)  # sorted, largest first
    elif p.top_p < 1:
        scaled, ids = torch.sort(scaled, descending=True)
    probs = torch.softmax(scaled, dim=-1)
    cdf = torch.cumsum(probs, dim=-1)
    if p.top_p < 1:
        # Keep the smallest prefix whose mass reaches top_p (always at least the top token).
        last = ((cdf - probs)[1:] < p.top_p).sum().reshape(1)
    else:
        last = torch.full((1,), cdf.shape[0] - 1, device=cdf.device)
    u = torch.rand((), dtype=torch.float64, generator=generator).item()
    # First id whose cumulative mass exceeds u * (kept mass); zero-probability ids are never
    # chosen, and the clamp guards against u * mass rounding up to the kept mass.
    index = torch.searchsorted(cdf, cdf[last] * u, right=True)
    index = torch.minimum(index, last)
    if ids is not None:
        index = ids[index]
    return int(index.item())

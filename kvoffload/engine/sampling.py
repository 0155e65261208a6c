"""Sampling parameters and the per-row sampler of the reference engine.

Reproducibility: a non-greedy row draws exactly one float64 uniform from its request's own CPU
:class:`torch.Generator` per token and picks the token by inverse CDF over its (filtered)
distribution. A seeded request therefore produces the same tokens whatever else is in the batch
and in whatever order, given the same logits.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kvoffload.errors import ConfigError

__all__ = ["SamplingParams", "make_generator", "sample"]

_MAX_SEED = 2**64 - 1


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How one request generates.

    ``temperature == 0`` is greedy (argmax; ``top_p``, ``top_k`` and ``seed`` are then unused).
    ``top_k == 0`` and ``top_p == 1`` disable those filters. Generation stops after ``max_tokens``
    tokens, at EOS unless ``ignore_eos``, or at any of ``stop_token_ids`` (the stop token is
    part of the output). ``logprobs``: return, per generated token, the log-probabilities of
    the ``logprobs`` most likely tokens plus the sampled one (``-1``: the whole vocabulary;
    ``None``: none). Invalid values raise :class:`ConfigError` naming the field.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    logprobs: int | None = None

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

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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

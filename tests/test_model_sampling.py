"""Sampling: greedy is argmax, seeded draws are reproducible whatever the batch, filters hold."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from model_cases import one_thread  # noqa: F401 - autouse fixture

from kvoffload.engine import SamplingParams, make_generator, sample
from kvoffload.errors import ConfigError


def _logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax_and_takes_the_first_of_ties() -> None:
    logits = _logits(5, 50, seed=0)
    logits[4, 7] = logits[4, 9] = logits[4].max() + 1
    greedy = SamplingParams()
    assert sample(logits, [greedy] * 5, [None] * 5) == logits.argmax(-1).tolist()
    assert sample(logits, [greedy] * 5, [None] * 5)[4] == 7


def _draw(logits: torch.Tensor, params: SamplingParams, steps: int) -> list[int]:
    gen = make_generator(params)
    return [sample(logits[None], [params], [gen])[0] for _ in range(steps)]


@pytest.mark.parametrize("temperature", [1e-300, 1e-40, 1e-6])
def test_a_temperature_below_vllms_epsilon_is_greedy(temperature: float) -> None:
    # Dividing by a tiny temperature overflows float32 to inf (softmax: NaN): the draw was the
    # last id, whatever the logits. vLLM takes temperature < 1e-5 as greedy.
    logits = torch.randn(6, 512, generator=torch.Generator().manual_seed(3)) * 8
    p = SamplingParams(temperature=temperature, seed=1)
    assert p.greedy
    assert sample(logits, [p] * 6, [make_generator(p)] * 6) == logits.argmax(-1).tolist()
    assert not SamplingParams(temperature=1e-5).greedy

def test_seeded_sampling_is_reproducible() -> None:
    logits = _logits(1, 64, seed=1)[0]
    params = SamplingParams(temperature=1.0, seed=42)
    first = _draw(logits, params, 50)
    assert first == _draw(logits, params, 50)
    assert len(set(first)) > 5  # it really samples
    assert first != _draw(logits, SamplingParams(temperature=1.0, seed=43), 50)


@settings(max_examples=25, deadline=None)
@given(order=st.permutations(range(4)), keep=st.integers(1, 4))
def test_seeded_rows_are_independent_of_batch_order_and_composition(
    order: list[int], keep: int
) -> None:
    """Each request's tokens depend only on its logits and its own generator."""
    logits = _logits(4, 80, seed=2)
    params = [
        SamplingParams(temperature=1.0, seed=1),
        SamplingParams(temperature=0.7, top_k=5, seed=2),
        SamplingParams(),  # greedy, mixed into the batch
        SamplingParams(temperature=1.3, top_p=0.8, seed=3),
    ]
    alone = {i: _draw(logits[i], params[i], 6) for i in range(4)}
    chosen = order[:keep]
    gens = {i: make_generator(params[i]) for i in chosen}
    batched: dict[int, list[int]] = {i: [] for i in chosen}
    for _ in range(6):
        tokens = sample(logits[chosen], [params[i] for i in chosen], [gens[i] for i in chosen])
        for i, t in zip(chosen, tokens, strict=True):
            batched[i].append(t)
    assert batched == {i: alone[i] for i in chosen}


@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**32), top_k=st.integers(1, 10), temperature=st.floats(0.05, 5.0))
def test_top_k_keeps_only_the_k_best(seed: int, top_k: int, temperature: float) -> None:
    logits = _logits(1, 40, seed=seed % 1000)[0]
    allowed = set(torch.topk(logits, top_k).indices.tolist())
    params = SamplingParams(temperature=temperature, top_k=top_k, seed=seed)
    assert set(_draw(logits, params, 40)) <= allowed


def test_top_p_keeps_the_smallest_prefix_reaching_p() -> None:
    probs = torch.tensor([0.05, 0.5, 0.3, 0.15])  # sorted order: ids 1, 2, 3, 0
    logits = probs.log()
    cases = {0.5: {1}, 0.51: {1, 2}, 0.8: {1, 2}, 0.81: {1, 2, 3}, 1.0: {0, 1, 2, 3}}
    for top_p, allowed in cases.items():
        drawn = set(_draw(logits, SamplingParams(temperature=1.0, top_p=top_p, seed=5), 300))
        assert drawn == allowed, top_p


def test_sampled_frequencies_follow_the_distribution() -> None:
    """Deterministic (seeded): 4000 draws at temperature 1 land within 4 sigma of softmax."""
    logits = torch.tensor([0.0, 1.0, 2.0, -1.0, 0.5])
    probs = torch.softmax(logits, -1)
    n = 4000
    counts = torch.bincount(
        torch.tensor(_draw(logits, SamplingParams(temperature=1.0, seed=11), n)), minlength=5
    )
    for c, p in zip(counts.tolist(), probs.tolist(), strict=True):
        assert abs(c - n * p) < 4 * math.sqrt(n * p * (1 - p))
    # temperature 0.25 sharpens it: the top id dominates
    sharp = _draw(logits, SamplingParams(temperature=0.25, seed=11), 500)
    assert sharp.count(2) > 0.9 * 500


def test_zero_probability_ids_are_never_drawn() -> None:
    logits = torch.full((100,), float("-inf"))
    logits[[3, 50, 99]] = 0.0
    assert set(_draw(logits, SamplingParams(temperature=1.0, seed=0), 200)) == {3, 50, 99}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2.0}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"stop_token_ids": [1, -2]}, "stop_token_ids"),
        ({"stop_token_ids": 5}, "stop_token_ids"),
    ],
)
def test_bad_params_raise_config_error_naming_the_field(
    kwargs: dict[str, object], field: str
) -> None:
    with pytest.raises(ConfigError, match=f"^{field}:") as info:
        SamplingParams(**kwargs)  # type: ignore[arg-type]
    assert info.value.field == field


def test_stop_token_ids_become_a_tuple() -> None:
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)  # type: ignore[arg-type]


def test_sample_checks_row_counts() -> None:
    with pytest.raises(ValueError, match="2 logit rows, 1 params"):
        sample(torch.zeros(2, 5), [SamplingParams()], [None])


@pytest.mark.cuda
def test_sampling_cuda_logits_matches_cpu() -> None:
    logits = _logits(3, 100, seed=9)
    params = [
        SamplingParams(),
        SamplingParams(temperature=0.8, top_p=0.9, seed=1),
        SamplingParams(temperature=1.2, top_k=7, seed=2),
    ]
    cpu = sample(logits, params, [make_generator(p) for p in params])
    gpu = sample(logits.cuda(), params, [make_generator(p) for p in params])
    assert gpu == cpu

"""Logits processing (issue #30): the batched penalties equal vLLM's formula applied token by
token; ``min_tokens`` masks EOS and stop tokens; ``logit_bias`` forces a token; ``min_p``
filters; rows that ask for nothing are untouched (greedy output unchanged); and a seeded draw
stays the same whatever else is in the batch."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from model_cases import one_thread  # noqa: F401 - autouse fixture

from kvoffload.engine import SamplingParams, make_generator, sample
from kvoffload.engine.logits_processing import process_logits
from kvoffload.errors import ConfigError

VOCAB = 12
IDS = st.lists(st.integers(0, VOCAB - 1), max_size=20)
PENALTY = st.floats(-2, 2, allow_nan=False)


def _reference(row: list[float], prompt: list[int], output: list[int], p: SamplingParams) -> list[float]:
    """vLLM's penalties, one token at a time."""
    out = list(row)
    for token in set(prompt) | set(output):
        out[token] = out[token] / p.repetition_penalty if out[token] > 0 else (
            out[token] * p.repetition_penalty
        )
    for token in set(output):
        out[token] -= p.frequency_penalty * output.count(token) + p.presence_penalty
    return out


@settings(max_examples=200, deadline=None)
@given(
    rows=st.lists(
        st.tuples(
            st.lists(st.floats(-10, 10, allow_nan=False), min_size=VOCAB, max_size=VOCAB),
            IDS, IDS, st.floats(0.1, 3), PENALTY, PENALTY,
        ),
        min_size=1, max_size=5,
    )
)
def test_batched_penalties_equal_the_formula(rows: list[tuple]) -> None:
    logits = torch.tensor([r[0] for r in rows], dtype=torch.float32)
    params = [SamplingParams(repetition_penalty=r[3], frequency_penalty=r[4], presence_penalty=r[5])
              for r in rows]
    got = process_logits(logits, params, [r[1] for r in rows], [r[2] for r in rows], None)
    for i, (_row, prompt, output, *_rest) in enumerate(rows):
        want = _reference([float(x) for x in logits[i]], prompt, output, params[i])
        assert got[i].tolist() == pytest.approx(want, rel=1e-5, abs=1e-5)


def test_rows_asking_nothing_are_untouched_and_min_tokens_masks_stops() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(0))
    plain = SamplingParams()
    held = SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=(3,), ignore_eos=True)
    got = process_logits(logits, [plain, held, held], [[1], [1], [1]], [[], [5], [5, 6]], 7)
    assert torch.equal(got[0], logits[0])
    assert got[1, 3] == got[1, 7] == -math.inf  # EOS masked even with ignore_eos, as vLLM
    assert torch.equal(got[2], logits[2])  # two tokens out: nothing masked
    assert torch.equal(logits, logits.clone())  # the input is not changed


def test_logit_bias_forces_and_forbids_greedy_tokens() -> None:
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(1))
    forced = SamplingParams(logit_bias={5: 100})
    banned = SamplingParams(logit_bias={int(logits[1].argmax()): -100})
    processed = process_logits(logits, [forced, banned], [[0], [0]], [[], []], None)
    tokens = sample(processed, [forced, banned], [None, None])
    assert tokens[0] == 5
    assert tokens[1] != int(logits[1].argmax())


def test_min_p_keeps_only_likely_tokens() -> None:
    logits = torch.tensor([[5.0, 4.9, 0.0, -1.0, 0.0]])
    params = SamplingParams(temperature=1.0, min_p=0.5, seed=3)
    gen = make_generator(params)
    drawn = {sample(logits, [params], [gen])[0] for _ in range(200)}
    assert drawn == {0, 1}


def test_seeded_draw_is_the_same_whatever_the_batch() -> None:
    logits = torch.randn(3, VOCAB, generator=torch.Generator().manual_seed(2))
    p = SamplingParams(temperature=1.0, seed=11, repetition_penalty=1.5, logit_bias={2: 1.0})
    other = SamplingParams(temperature=0.7, seed=5, frequency_penalty=1.0)

    def draw(rows: list[int], params: list[SamplingParams]) -> int:
        gens = [make_generator(q) for q in params]
        processed = process_logits(logits[rows], params, [[1, 2]] * len(rows),
                                   [[3]] * len(rows), None)
        return sample(processed, params, gens)[-1]

    assert draw([0], [p]) == draw([1, 2, 0], [other, other, p])


@pytest.mark.parametrize(("field", "value"), [
    ("min_tokens", 20), ("min_tokens", -1), ("repetition_penalty", 0.0),
    ("frequency_penalty", 2.5), ("presence_penalty", -3), ("min_p", 1.5),
    ("logit_bias", {-1: 1.0}), ("logit_bias", {1: math.nan}), ("logit_bias", {"a": 1}),
])
def test_bad_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(ConfigError) as caught:
        SamplingParams(max_tokens=16, **{field: value})  # type: ignore[arg-type]
    assert caught.value.field == field

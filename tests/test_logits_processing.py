"""Logits processing (issue #30): the batched penalties equal vLLM's formula applied token by
token; ``min_tokens`` masks EOS and stop tokens; ``logit_bias`` forces a token; ``min_p``
filters; rows that ask for nothing are untouched (greedy output unchanged); and a seeded draw
stays the same whatever else is in the batch."""

from __future__ import annotations

import math
import random

import pytest
import torch
from engine_cases import random_tokens, tiny_engine
from hypothesis import given, settings
from hypothesis import strategies as st
from model_cases import one_thread  # noqa: F401 - autouse fixture

from kvoffload.engine import RequestOutput, SamplingParams, make_generator, sample
from kvoffload.engine.logits_processing import LogitsState, process_logits
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


@settings(max_examples=50, deadline=None)
@given(
    prompts=st.lists(IDS, min_size=1, max_size=4),
    steps=st.lists(st.lists(st.integers(0, VOCAB - 1), min_size=4, max_size=4),
                   min_size=1, max_size=80),
    bias=st.dictionaries(st.integers(0, VOCAB + 3), st.floats(-5, 5), max_size=4),
)
def test_kept_state_equals_a_fresh_one_after_many_steps(
    prompts: list[list[int]], steps: list[list[int]], bias: dict[int, float]
) -> None:
    """A request's :class:`LogitsState`, kept across steps and updated with each step's new
    token only, processes the logits exactly as a state made from scratch from the whole output
    (and holds the same counts and seen mask) after every step."""
    params = [SamplingParams(repetition_penalty=1.5, frequency_penalty=0.5, presence_penalty=0.25,
                             logit_bias=tuple(bias.items()) if i % 2 else ()) for i in range(len(prompts))]
    states: list[LogitsState | None] = [None] * len(prompts)
    outputs: list[list[int]] = [[] for _ in prompts]
    gen = torch.Generator().manual_seed(len(steps))
    for tokens in steps:
        logits = torch.randn(len(prompts), VOCAB, generator=gen)
        kept = [s or LogitsState(p, q, VOCAB, logits.device)
                for s, p, q in zip(states, params, prompts, strict=True)]
        got = process_logits(logits, params, prompts, outputs, None, kept)
        assert torch.equal(got, process_logits(logits, params, prompts, outputs, None))
        for state, param, prompt, output in zip(kept, params, prompts, outputs, strict=True):
            fresh = LogitsState(param, prompt, VOCAB, logits.device)
            fresh.update(output)
            assert _same_counts(state, fresh)
        states = list(kept)
        for output, token in zip(outputs, tokens, strict=False):
            output.append(token)


def test_penalties_and_bias_survive_preemption() -> None:
    """Preempted and recomputed requests keep their output, so their kept state stays right:
    after every step, each live request's state equals one made from scratch, and the tokens
    equal those of a run with room for everything (no preemption)."""
    rng = random.Random(5)
    prompts = [random_tokens(rng, 6 + i) for i in range(10)]
    params = SamplingParams(max_tokens=16, ignore_eos=True, repetition_penalty=1.3,
                            frequency_penalty=0.4, presence_penalty=0.2, logit_bias=((3, 0.5),))
    with tiny_engine(num_device_blocks=2048) as engine:
        want = engine.generate(prompts, params)
    with tiny_engine(num_device_blocks=20, max_num_seqs=8) as engine:
        ids = [engine.add_request(p, params) for p in prompts]
        done: dict[str, RequestOutput] = {}
        for _ in range(1000):
            if not engine.has_unfinished():
                break
            done.update((o.request_id, o) for o in engine.step())
            for req in engine._requests.values():
                state = req._logits_state
                if state is None or state.counts is None:
                    continue
                fresh = LogitsState(params, req.prompt_token_ids, state.vocab, state.device)
                fresh.update(req.output_token_ids[: state.consumed])
                assert _same_counts(state, fresh)
        assert engine.stats()["preemptions"] > 0
    assert [done[i].output_token_ids for i in ids] == [w.output_token_ids for w in want]


def _same_counts(a: LogitsState, b: LogitsState) -> bool:
    """Whether two penalised requests' states hold the same counts, seen tokens and penalties."""
    pairs = [(a.counts, b.counts), (a.seen, b.seen), (a.subtract, b.subtract)]
    return all(x is not None and y is not None and torch.equal(x, y) for x, y in pairs)


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
    forced = SamplingParams(logit_bias=((5, 100.0),))
    banned = SamplingParams(logit_bias=((int(logits[1].argmax()), -100.0),))
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
    p = SamplingParams(temperature=1.0, seed=11, repetition_penalty=1.5, logit_bias=((2, 1.0),))
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

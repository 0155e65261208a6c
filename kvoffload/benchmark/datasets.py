"""Workloads for ``kvoffload bench throughput``: token-id prompts with controlled reuse.

Every dataset is deterministic for a given seed. Token ids are drawn from ``[1, vocab_size)``
minus the EOS id, so a prompt never contains an early stop token.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path

from kvoffload.benchmark.trace_file import read_trace
from kvoffload.benchmark.traces import BLOCK_TOKENS
from kvoffload.errors import ConfigError
from kvoffload.validation import check_int

__all__ = [
    "DATASETS",
    "BenchRequest",
    "multi_turn",
    "prefix_repetition",
    "random_prompts",
    "trace_prompts",
]


@dataclass(frozen=True)
class BenchRequest:
    """One benchmark request: its prompt token ids and how many tokens to generate;
    ``arrival_s``: when it arrives, in seconds after the first request (traces only)."""

    prompt: list[int]
    output_len: int
    arrival_s: float = 0.0


class _Tokens:
    def __init__(self, vocab_size: int, eos_token_id: int, seed: int | str) -> None:
        self._rng = random.Random(seed)
        self._vocab = vocab_size
        self._eos = eos_token_id

    def draw(self, n: int, rng: random.Random | None = None) -> list[int]:
        rng = rng or self._rng
        out: list[int] = []
        while len(out) < n:
            t = rng.randrange(1, self._vocab)
            if t != self._eos:
                out.append(t)
        return out


def _variant(tokens: _Tokens, vocab_size: int, eos: int, seed: int, variant: int) -> _Tokens:
    """The draws after a workload's shared part: ``tokens`` itself for variant 0 (the workload
    as it always was), else a stream of their own."""
    _non_negative("variant", variant)
    return tokens if variant == 0 else _Tokens(vocab_size, eos, f"{seed}:variant:{variant}")


def _positive(name: str, value: int) -> None:
    check_int(name, value, 1)


def _non_negative(name: str, value: int) -> None:
    check_int(name, value, 0)


def random_prompts(
    num_prompts: int,
    input_len: int,
    output_len: int,
    vocab_size: int,
    eos_token_id: int,
    seed: int,
    prefix_len: int = 0,
    range_ratio: float = 0.0,
    variant: int = 0,
) -> list[BenchRequest]:
    """Random prompts (as vLLM's ``random`` dataset): ``prefix_len`` tokens shared by every
    prompt, then ``input_len`` random tokens; with ``range_ratio`` r, each request's input and
    output lengths are drawn uniformly from ``[len * (1 - r), len * (1 + r)]``. Without a prefix:
    no reuse at all (the offloading-overhead case). Another ``variant`` than 0 draws other
    random parts after the same prefix (fresh requests on it; same lengths)."""
    _positive("num_prompts", num_prompts)
    _positive("random_input_len", input_len)
    _positive("output_len", output_len)
    _non_negative("random_prefix_len", prefix_len)
    if not 0 <= range_ratio < 1:
        raise ConfigError("random_range_ratio", f"must be in [0, 1), got {range_ratio}")
    tokens = _Tokens(vocab_size, eos_token_id, seed)
    prefix = tokens.draw(prefix_len)
    tokens = _variant(tokens, vocab_size, eos_token_id, seed, variant)
    rng = random.Random(seed + 1)

    def length(n: int) -> int:
        return max(1, rng.randint(int(n * (1 - range_ratio)), int(n * (1 + range_ratio))))

    out = []
    for _ in range(num_prompts):
        out.append(BenchRequest(prefix + tokens.draw(length(input_len)), length(output_len)))
    return out


def prefix_repetition(
    num_prompts: int,
    prefix_len: int,
    suffix_len: int,
    num_prefixes: int,
    output_len: int,
    vocab_size: int,
    eos_token_id: int,
    seed: int,
    variant: int = 0,
) -> list[BenchRequest]:
    """``num_prefixes`` shared prefixes, each followed by a random suffix; requests shuffled so
    that consecutive requests rarely share a prefix (as vLLM's ``prefix_repetition``). Another
    ``variant`` than 0 draws other suffixes after the same prefixes, in the same order (fresh
    requests on them)."""
    _positive("num_prompts", num_prompts)
    _positive("prefix_repetition_prefix_len", prefix_len)
    _non_negative("prefix_repetition_suffix_len", suffix_len)
    _positive("prefix_repetition_num_prefixes", num_prefixes)
    _positive("output_len", output_len)
    tokens = _Tokens(vocab_size, eos_token_id, seed)
    prefixes = [tokens.draw(prefix_len) for _ in range(num_prefixes)]
    tokens = _variant(tokens, vocab_size, eos_token_id, seed, variant)
    out = [
        BenchRequest(prefixes[i % num_prefixes] + tokens.draw(suffix_len), output_len)
        for i in range(num_prompts)
    ]
    random.Random(seed + 1).shuffle(out)
    return out


def multi_turn(
    num_prompts: int,
    num_sessions: int,
    system_len: int,
    turn_len: int,
    output_len: int,
    vocab_size: int,
    eos_token_id: int,
    seed: int,
) -> list[BenchRequest]:
    """Chat sessions sharing one system prompt; turn ``k`` of a session re-sends every earlier
    turn (user tokens and a fixed stand-in for the assistant's reply) plus a new user turn.
    Sessions are interleaved round-robin, so a session's context ages between its turns."""
    _positive("num_prompts", num_prompts)
    _positive("multi_turn_num_sessions", num_sessions)
    _non_negative("multi_turn_system_len", system_len)
    _positive("multi_turn_turn_len", turn_len)
    _positive("output_len", output_len)
    tokens = _Tokens(vocab_size, eos_token_id, seed)
    system = tokens.draw(system_len)
    contexts = [list(system) for _ in range(num_sessions)]
    out = []
    for i in range(num_prompts):
        ctx = contexts[i % num_sessions]
        ctx.extend(tokens.draw(turn_len))
        out.append(BenchRequest(list(ctx), output_len))
        ctx.extend(
            tokens.draw(output_len)
        )  # the assistant's reply, as the next turn will re-send it
    return out


def trace_prompts(
    path: str | Path,
    num_prompts: int | None,
    trace_block_size: int,
    output_len: int | None,
    vocab_size: int,
    eos_token_id: int,
    seed: int,
) -> list[BenchRequest]:
    """Requests of a Mooncake-format JSONL trace (``hash_ids``: 512-token blocks; equal ids are a
    shared prefix). Each hash id becomes a deterministic block of ``trace_block_size`` token ids,
    so the trace's real reuse pattern drives a real engine at a scale the machine can run; the
    last block is shortened in proportion to ``input_length``. ``output_len`` caps the trace's
    ``output_length``."""
    _positive("trace_block_size", trace_block_size)
    if output_len is not None:
        _positive("output_len", output_len)
    tokens = _Tokens(vocab_size, eos_token_id, seed)
    out: list[BenchRequest] = []
    for record in read_trace(path, num_prompts):
        prompt: list[int] = []
        for h in record.hash_ids:
            prompt.extend(tokens.draw(trace_block_size, random.Random(f"{seed}:{h}")))
        tail_tokens = record.input_length - (len(record.hash_ids) - 1) * BLOCK_TOKENS
        if 0 < tail_tokens < BLOCK_TOKENS:
            keep = max(1, -(-tail_tokens * trace_block_size // BLOCK_TOKENS))
            del prompt[len(prompt) - trace_block_size + keep :]
        trace_output = record.output_length
        n_out = max(1, trace_output if output_len is None else min(trace_output, output_len))
        out.append(BenchRequest(prompt, n_out, record.arrival_s))
    first = min(r.arrival_s for r in out)
    return [BenchRequest(r.prompt, r.output_len, r.arrival_s - first) for r in out]


DATASETS = ("random", "prefix_repetition", "multi_turn", "trace")

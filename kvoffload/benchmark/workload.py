"""The requests of a workload described by resolved workload flags (``bench throughput``'s and
``bench serve``'s table, :mod:`kvoffload.cli.workload_flags`): one builder, so both commands
send the same requests."""

from __future__ import annotations

import argparse
from typing import Any

from kvoffload.benchmark import datasets
from kvoffload.benchmark.datasets import BenchRequest

__all__ = [
    "MULTI_TURN_OUTPUT_LEN",
    "PREFIX_REPETITION_OUTPUT_LEN",
    "RANDOM_INPUT_LEN",
    "RANDOM_OUTPUT_LEN",
    "workload_requests",
]

#: Defaults where neither the dataset's own flag nor ``--input-len`` / ``--output-len`` is set.
MULTI_TURN_OUTPUT_LEN = 16
RANDOM_INPUT_LEN = 1024
RANDOM_OUTPUT_LEN = 128
PREFIX_REPETITION_OUTPUT_LEN = 16


def _output_len(flags: argparse.Namespace, specific: int | None, default: int) -> int:
    if specific is not None:
        return specific
    return default if flags.output_len is None else flags.output_len


def workload_requests(
    flags: argparse.Namespace, vocab_size: int, eos: int, variant: int = 0
) -> list[BenchRequest]:
    """The workload's requests (resolved flags); another ``variant`` (prefix_repetition and
    random only): fresh requests on the same shared prefixes."""
    common: dict[str, Any] = {"vocab_size": vocab_size, "eos_token_id": eos, "seed": flags.seed}
    name = flags.dataset_name
    if name == "random":
        input_len = flags.random_input_len or flags.input_len or RANDOM_INPUT_LEN
        output_len = _output_len(flags, flags.random_output_len, RANDOM_OUTPUT_LEN)
        return datasets.random_prompts(
            flags.num_prompts,
            input_len,
            output_len,
            prefix_len=flags.random_prefix_len,
            range_ratio=flags.random_range_ratio,
            variant=variant,
            **common,
        )
    if name == "prefix_repetition":
        output_len = _output_len(
            flags, flags.prefix_repetition_output_len, PREFIX_REPETITION_OUTPUT_LEN
        )
        return datasets.prefix_repetition(
            flags.num_prompts,
            flags.prefix_repetition_prefix_len,
            flags.prefix_repetition_suffix_len,
            flags.prefix_repetition_num_prefixes,
            output_len,
            variant=variant,
            **common,
        )
    if name == "multi_turn":
        return datasets.multi_turn(
            flags.num_prompts,
            flags.multi_turn_num_sessions,
            flags.multi_turn_system_len,
            flags.multi_turn_turn_len,
            _output_len(flags, None, MULTI_TURN_OUTPUT_LEN),
            **common,
        )
    return datasets.trace_prompts(
        flags.dataset_path, flags.num_prompts, flags.trace_block_size, flags.output_len, **common
    )

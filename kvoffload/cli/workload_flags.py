"""The workload flags of ``bench throughput`` (vLLM ``bench``'s dataset flags): one table,
:data:`WORKLOAD_FLAGS`; the requests they describe are built by
:func:`kvoffload.benchmark.workload.workload_requests`.

A dataset's own flags need that dataset (``--random-input-len`` without ``--dataset-name random``
is refused, not ignored); ``--honor-timestamps`` and ``--timestamp-scale`` need a trace.
"""

from __future__ import annotations

import argparse

from kvoffload.benchmark.datasets import DATASETS, BenchRequest
from kvoffload.benchmark.trace_file import check_trace_path
from kvoffload.benchmark.workload import (
    MULTI_TURN_OUTPUT_LEN,
    PREFIX_REPETITION_OUTPUT_LEN,
    RANDOM_INPUT_LEN,
    RANDOM_OUTPUT_LEN,
)
from kvoffload.cli.args import int_in, real_in
from kvoffload.cli.flagspec import Flag, Needs, add_flags
from kvoffload.errors import ConfigError

__all__ = [
    "DEFAULT_NUM_PROMPTS",
    "WORKLOAD_FLAGS",
    "add_workload_flags",
    "check_workload",
    "workload_lines",
]

DEFAULT_NUM_PROMPTS = 64


def _dataset(name: str) -> Needs:
    return Needs(f"--dataset-name {name}", lambda f, _: f.dataset_name == name)


RANDOM, PREFIX, MULTI_TURN, TRACE = (_dataset(n) for n in DATASETS)
TIMESTAMPS = Needs("--honor-timestamps", lambda f, _: bool(f.honor_timestamps))

WORKLOAD_FLAGS: tuple[Flag, ...] = (
    Flag("num_prompts", "requests to run", parse=int_in(1), default=DEFAULT_NUM_PROMPTS, unit="N"),
    Flag("dataset_name", "the workload", choices=DATASETS, default="prefix_repetition"),
    Flag(
        "dataset_path",
        "a Mooncake-format JSONL trace",
        unit="TRACE.jsonl",
        needs=TRACE,
        unset="none",
    ),
    Flag(
        "trace_block_size",
        "tokens each 512-token hash block of the trace becomes",
        parse=int_in(1),
        default=16,
        unit="TOKENS",
        needs=TRACE,
    ),
    Flag(
        "honor_timestamps",
        "send each request at its trace timestamp x --timestamp-scale, not all at once",
        kind="switch",
        needs=TRACE,
    ),
    Flag(
        "timestamp_scale",
        "factor on the trace's arrival times",
        parse=real_in(0, positive=True),
        default=1.0,
        unit="X",
        needs=TIMESTAMPS,
    ),
    Flag(
        "output_len",
        "output tokens of every request, overriding the dataset's (a cap for traces)",
        parse=int_in(1),
        unit="TOKENS",
        unset=f"the dataset's; multi_turn: {MULTI_TURN_OUTPUT_LEN}",
    ),
    Flag(
        "input_len",
        "input tokens of each random request (vLLM's legacy name of --random-input-len)",
        parse=int_in(1),
        unit="TOKENS",
        needs=RANDOM,
    ),
    Flag(
        "random_input_len",
        "input tokens per random request",
        parse=int_in(1),
        unit="TOKENS",
        needs=RANDOM,
        unset=f"--input-len, else {RANDOM_INPUT_LEN}",
    ),
    Flag(
        "random_output_len",
        "output tokens per random request",
        parse=int_in(1),
        unit="TOKENS",
        needs=RANDOM,
        unset=f"--output-len, else {RANDOM_OUTPUT_LEN}",
    ),
    Flag(
        "random_prefix_len",
        "tokens shared by every random prompt before its random part",
        parse=int_in(0),
        default=0,
        unit="TOKENS",
        needs=RANDOM,
    ),
    Flag(
        "random_range_ratio",
        "random lengths drawn from [len*(1-r), len*(1+r)]",
        parse=real_in(0, below=1),
        default=0.0,
        unit="R",
        needs=RANDOM,
    ),
    Flag(
        "prefix_repetition_prefix_len",
        "tokens of each shared prefix",
        parse=int_in(1),
        default=2048,
        unit="TOKENS",
        needs=PREFIX,
    ),
    Flag(
        "prefix_repetition_suffix_len",
        "tokens after the prefix, per request",
        parse=int_in(0),
        default=32,
        unit="TOKENS",
        needs=PREFIX,
    ),
    Flag(
        "prefix_repetition_num_prefixes",
        "distinct shared prefixes",
        parse=int_in(1),
        default=8,
        unit="N",
        needs=PREFIX,
    ),
    Flag(
        "prefix_repetition_output_len",
        "output tokens per request",
        parse=int_in(1),
        unit="TOKENS",
        needs=PREFIX,
        unset=f"--output-len, else {PREFIX_REPETITION_OUTPUT_LEN}",
    ),
    Flag(
        "multi_turn_num_sessions",
        "chat sessions",
        parse=int_in(1),
        default=8,
        unit="N",
        needs=MULTI_TURN,
    ),
    Flag(
        "multi_turn_system_len",
        "tokens of the system prompt every session shares",
        parse=int_in(0),
        default=512,
        unit="TOKENS",
        needs=MULTI_TURN,
    ),
    Flag(
        "multi_turn_turn_len",
        "tokens each turn adds",
        parse=int_in(1),
        default=256,
        unit="TOKENS",
        needs=MULTI_TURN,
    ),
)


def add_workload_flags(parser: argparse.ArgumentParser) -> None:
    add_flags(parser, WORKLOAD_FLAGS, section="workload")


def check_workload(flags: argparse.Namespace) -> None:
    """What the table cannot say: a trace needs its file. :class:`ConfigError` naming it."""
    if flags.dataset_name == "trace":
        if flags.dataset_path is None:
            raise ConfigError("dataset_path", "--dataset-name trace needs --dataset-path")
        check_trace_path(flags.dataset_path)


def _sharing(flags: argparse.Namespace) -> str:
    """What the workload's requests share, in words."""
    name = flags.dataset_name
    if name == "random":
        n = flags.random_prefix_len
        return f"{n}-token shared prefix" if n else "no shared prefix"
    if name == "prefix_repetition":
        return (
            f"{flags.prefix_repetition_num_prefixes} shared prefixes of "
            f"{flags.prefix_repetition_prefix_len} tokens"
        )
    if name == "multi_turn":
        return (
            f"{flags.multi_turn_num_sessions} sessions sharing a "
            f"{flags.multi_turn_system_len}-token system prompt"
        )
    return "prefixes shared as the trace's hash ids"


def workload_lines(flags: argparse.Namespace, requests: list[BenchRequest]) -> list[str]:
    """One line saying what the requests are and, for traces, one saying what was rescaled."""
    prompts = [len(r.prompt) for r in requests]
    outputs = [r.output_len for r in requests]
    lines = [
        f"Workload: model {flags.model}, {len(requests)} {flags.dataset_name} requests "
        f"({min(prompts)}-{max(prompts)} prompt tokens, {min(outputs)}-{max(outputs)} output "
        f"tokens), {_sharing(flags)}."
    ]
    if flags.dataset_name == "trace":
        outputs_text = (
            "output lengths as in the trace"
            if flags.output_len is None
            else f"output lengths capped at {flags.output_len}"
        )
        if flags.honor_timestamps:
            last = max(r.arrival_s for r in requests) * flags.timestamp_scale
            arrivals = (
                f"arrival times from the trace x {flags.timestamp_scale:g} "
                f"(last request at {last:.1f} s)"
            )
        else:
            arrivals = (
                "timestamps ignored, all requests at once (--honor-timestamps to replay them)"
            )
        lines.append(
            f"Trace rescaled: each 512-token hash block is {flags.trace_block_size} tokens "
            f"({512 / flags.trace_block_size:g}x shorter prompts); {outputs_text}; {arrivals}."
        )
    return lines

"""The chat-sessions workload of the in-process benchmarks (`sessions_replay.py`,
`step_overhead.py`): its command-line flags and its first contexts.

N users share a system prompt, each has a context of its own, and each turn appends a question of
random byte-level ids (never EOS) to the conversation so far; the same sizes as
``kvoffload bench serve --dataset-name sessions``'s flags of the same names.
"""

from __future__ import annotations

import argparse
import random

#: Byte-level ids below this never include EOS (256).
_VOCAB = 250


def add_sessions_args(p: argparse.ArgumentParser) -> None:
    """The workload's flags; the defaults are the first `tiny` sizing of issue 28 (8 users on a
    64-block device, which holds one turn at a time), which `step_overhead.py` measures."""
    p.add_argument("--model", default="tiny")
    p.add_argument("--users", type=int, default=8)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--system-len", type=int, default=128)
    p.add_argument("--context-len", type=int, default=384)
    p.add_argument("--question-len", type=int, default=32)
    p.add_argument("--answer-len", type=int, default=32)
    p.add_argument("--num-device-blocks", type=int, default=64)
    p.add_argument("--host-gib", type=float, default=0.01)


def random_tokens(rng: random.Random, n: int) -> list[int]:
    """``n`` random ids, none of them EOS."""
    return [rng.randrange(1, _VOCAB) for _ in range(n)]


def first_contexts(args: argparse.Namespace, rng: random.Random) -> list[list[int]]:
    """Each user's conversation before its first question: the shared system prompt + its own
    context."""
    system = random_tokens(rng, args.system_len)
    return [system + random_tokens(rng, args.context_len) for _ in range(args.users)]

"""Per-step cost of logits processing (``process_logits``) for a batch of decoding requests.

Two cases, each a run of decode steps in which every row gains one output token per step:
``bias`` (each row has a ``logit_bias`` of ``--bias-entries`` tokens, no penalty) and
``penalties`` (repetition, frequency and presence penalties over ``--output-tokens`` tokens
already generated). The current code keeps each row's :class:`LogitsState` across steps, as
the engine does on its requests. With ``--baseline FILE`` (an older ``logits_processing.py``,
e.g. from ``git worktree add /tmp/old HEAD~1``), that version is timed too, interleaved with
the current one repeat by repeat; printed: the median per-step milliseconds and the load
average (the machine may be shared).

    PYTHONPATH=$PWD .venv/bin/python benchmarks/logits_processing_cost.py \\
        [--rows 64] [--vocab 32000] [--bias-entries 1024] [--output-tokens 2000] \\
        [--steps 10] [--repeats 5] [--baseline /tmp/old/kvoffload/engine/logits_processing.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import inspect
import os
import random
import statistics
import time
from types import ModuleType
from typing import Any

import torch

from kvoffload.engine import logits_processing
from kvoffload.engine.sampling import SamplingParams


def _load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location("baseline_logits_processing", path)
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _case(name: str, args: argparse.Namespace) -> tuple[list[SamplingParams], list[Any],
                                                        list[list[int]]]:
    rng = random.Random(0)
    if name == "bias":
        bias = tuple((t, rng.uniform(-5, 5)) for t in rng.sample(range(args.vocab),
                                                                  args.bias_entries))
        params = [SamplingParams(logit_bias=bias)] * args.rows
        outputs: list[list[int]] = [[] for _ in range(args.rows)]
    else:
        params = [SamplingParams(repetition_penalty=1.2, frequency_penalty=0.5,
                                 presence_penalty=0.5)] * args.rows
        outputs = [[rng.randrange(args.vocab) for _ in range(args.output_tokens)]
                   for _ in range(args.rows)]
    prompts = [torch.tensor([rng.randrange(args.vocab) for _ in range(512)]) for _ in params]
    return params, prompts, outputs


def _per_step_ms(module: ModuleType, name: str, args: argparse.Namespace) -> float:
    """Median milliseconds of one ``process_logits`` call over ``args.steps`` decode steps."""
    params, prompts, outputs = _case(name, args)
    keeps_state = "states" in inspect.signature(module.process_logits).parameters
    states = None
    if keeps_state:
        device = torch.device("cpu")
        states = [module.LogitsState(p, q, args.vocab, device) for p, q in zip(params, prompts, strict=True)]
    logits = torch.randn(args.rows, args.vocab)
    times = []
    for step in range(args.steps):
        start = time.perf_counter()
        if keeps_state:
            module.process_logits(logits, params, prompts, outputs, None, states)
        else:
            module.process_logits(logits, params, prompts, outputs, None)
        times.append(time.perf_counter() - start)
        for output in outputs:
            output.append(step % args.vocab)
    return statistics.median(times) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=32_000)
    parser.add_argument("--bias-entries", type=int, default=1024)
    parser.add_argument("--output-tokens", type=int, default=2000)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--baseline", help="an older logits_processing.py to compare with")
    args = parser.parse_args()
    versions = {"current": logits_processing}
    if args.baseline:
        versions = {"baseline": _load(args.baseline), **versions}
    for name in ("bias", "penalties"):
        results: dict[str, list[float]] = {v: [] for v in versions}
        for _ in range(args.repeats):  # interleaved: drift in the machine's load hits both
            for version, module in versions.items():
                results[version].append(_per_step_ms(module, name, args))
        line = ", ".join(f"{v} {statistics.median(r):.2f} ms" for v, r in results.items())
        print(f"{name}: per step ({args.rows} rows, vocab {args.vocab}): {line}")
    print(f"load average: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")


if __name__ == "__main__":
    main()

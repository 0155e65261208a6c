"""Where the host tier's per-step overhead goes: the sessions workload in-process, in real time.

On `tiny`, where prefill is ~7% of the engine's time, `kvoffload serve` with a host tier spent
more engine time per run than without one, for fewer tokens computed (the sessions workload at
its former `make bench-sessions` sizing: 8 users, 64 device blocks, this script's defaults). This
runs that closed-loop workload
(N users x R rounds, each turn re-sending its conversation with the engine's answers; think
times skipped: a user's next turn is added when its last one finishes) against an in-process
:class:`~kvoffload.engine.Engine` without HTTP, with and without a host tier, interleaved, and
prints per configuration: steps, tokens computed, engine seconds (wall time inside
``Engine.step``), seconds per step and microseconds per step outside the model's forward
(``ModelRunner.execute``; also in the engine thread's CPU time) and the process's CPU time per
step (every thread: the copy threads too), as median [min-max] over the repeats. ``--profile NAME``
writes a cProfile of one more run of configuration NAME (``none`` or ``host``) and prints its
top functions by cumulative and by own time. ``--phases`` times the step's phases
(:data:`PHASES`) and prints microseconds per step for each, summed over the repeats.

Measured on the shared 2-core machine (tiny, defaults, ``OMP_NUM_THREADS=1``, 8 interleaved
repeats, load 1.4-2.8; at 8de5d12): engine thread CPU outside the forward 140 us a step with a
host tier against 62 without (159 before 1db7e8c); ~30 of the difference is the connector's
lookup of the waiting request at the queue's head, which is re-asked every step while it does
not fit (939 lookups for 32 requests), ~15 the held-prefix probe of the cache-aware order, ~12
planning stores (``build_connector_meta``), ~15 the worker's per-step calls (``wait_for_save``,
``handle_preemptions``, ``start_load_kv``, ``get_finished``; ``--phases`` adds ~1-2 us of timer
to each). The forward itself is ~4%
slower with a host tier (decode steps with a copy in flight take ~1.5x: the copy thread shares
the 2 cores). Since the waiting request is not looked up again while no block is left for it (74
lookups; 10 rounds alternating the two trees, load 3.0-3.6): 123 us against 64 (146 against 64
before), host - none 54 [46-69] us (80 [76-83] before); the process's CPU per step (copy threads
included) host / none 1.13x [0.86-1.21] (1.16x [0.97-1.20]). Copying a small job on the thread
that planned it (no second queue hop) changed neither that CPU nor the forward measurably, so it
is not done.

    OMP_NUM_THREADS=1 python benchmarks/step_overhead.py --repeats 5
    python benchmarks/step_overhead.py --repeats 1 --profile host
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import random
import statistics
import time
from dataclasses import dataclass
from typing import Any

from sessions_workload import add_sessions_args, first_contexts, random_tokens

from kvoffload.engine import Engine, SamplingParams

#: The engine step's phases timed with ``--phases`` (object path from the engine, method): the
#: connector's lookup and the held probe run inside ``schedule``, and are counted there too.
PHASES = (
    ("worker", "get_finished"),
    ("connector", "update_connector_output"),
    ("scheduler", "apply_connector_update"),
    ("scheduler", "schedule"),
    ("connector", "get_num_new_matched_tokens"),
    ("connector", "num_held_blocks"),
    ("connector", "build_connector_meta"),
    ("worker", "handle_preemptions"),
    ("worker", "start_load_kv"),
    ("worker", "wait_for_save"),
    ("connector.costs", "observe_step"),
    ("scheduler", "cache_computed_blocks"),
)


def _time_phases(engine: Engine, totals: dict[str, list[float]]) -> None:
    """Wrap each of :data:`PHASES` the engine has to add its calls and seconds to ``totals``."""
    for path, method in PHASES:
        owner: Any = engine
        for part in path.split("."):
            owner = getattr(owner, part, None)
        if owner is None:
            continue
        inner = getattr(owner, method)
        tally = totals.setdefault(f"{path}.{method}", [0.0, 0.0])

        def timed(*a: Any, _inner: Any = inner, _tally: list[float] = tally, **kw: Any) -> Any:
            started = time.perf_counter()
            try:
                return _inner(*a, **kw)
            finally:
                _tally[0] += 1
                _tally[1] += time.perf_counter() - started

        setattr(owner, method, timed)


@dataclass
class Run:
    """One run's engine time, steps and tokens computed."""

    engine_s: float
    forward_s: float
    engine_cpu_s: float
    forward_cpu_s: float
    process_cpu_s: float
    steps: int
    tokens: int

    @property
    def per_step_ms(self) -> float:
        return 1e3 * self.engine_s / self.steps

    @property
    def outside_us(self) -> float:
        """Microseconds per step outside the model's forward (scheduling, the tier, sampling)."""
        return 1e6 * (self.engine_s - self.forward_s) / self.steps

    @property
    def outside_cpu_us(self) -> float:
        """The same in the engine thread's CPU time (what other processes' load does not add)."""
        return 1e6 * (self.engine_cpu_s - self.forward_cpu_s) / self.steps


def run(
    args: argparse.Namespace, offload: bool, phases: dict[str, list[float]] | None = None
) -> Run:
    rng = random.Random(0)
    history = first_contexts(args, rng)
    settings: dict[str, object] = {"block_size": 16, "num_device_blocks": args.num_device_blocks}
    if offload:
        settings["kv_offloading_size"] = args.host_gib
    engine = Engine(args.model, **settings)
    forward_s = forward_cpu_s = 0.0
    execute = engine.runner.execute

    def timed_execute(*a: Any, **kw: Any) -> Any:
        nonlocal forward_s, forward_cpu_s
        started, started_cpu = time.perf_counter(), time.thread_time()
        try:
            return execute(*a, **kw)
        finally:
            forward_s += time.perf_counter() - started
            forward_cpu_s += time.thread_time() - started_cpu

    engine.runner.execute = timed_execute  # type: ignore[method-assign]
    if phases is not None:
        _time_phases(engine, phases)
    try:
        params = SamplingParams(max_tokens=args.answer_len, ignore_eos=True)
        live: dict[str, tuple[int, int, list[int]]] = {}
        for user in range(args.users):
            prompt = history[user] + random_tokens(rng, args.question_len)
            live[engine.add_request(prompt, params)] = (user, 0, prompt)
        engine_s = engine_cpu_s = 0.0
        process_started = time.process_time()
        for _ in range(1_000_000):
            if not live:
                break
            started, started_cpu = time.perf_counter(), time.thread_time()
            finished = engine.step()
            engine_s += time.perf_counter() - started
            engine_cpu_s += time.thread_time() - started_cpu
            for done in finished:
                user, rnd, prompt = live.pop(done.request_id)
                history[user] = prompt + list(done.output_token_ids)
                if rnd + 1 < args.rounds:
                    nxt = history[user] + random_tokens(rng, args.question_len)
                    live[engine.add_request(nxt, params)] = (user, rnd + 1, nxt)
        else:
            raise RuntimeError("the run did not finish in 1,000,000 steps")
        if offload:
            engine.drain()
        process_cpu_s = time.process_time() - process_started
        stats = engine.stats()
        return Run(
            engine_s,
            forward_s,
            engine_cpu_s,
            forward_cpu_s,
            process_cpu_s,
            int(stats["steps"]),
            int(stats["forward_tokens"]),
        )
    finally:
        engine.close()


def _summary(values: list[float], fmt: str) -> str:
    return f"{statistics.median(values):{fmt}} [{min(values):{fmt}}-{max(values):{fmt}}]"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_sessions_args(p)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--phases", action="store_true", help="time the step's phases (PHASES)")
    p.add_argument("--profile", choices=("none", "host"), default=None)
    p.add_argument("--profile-out", default="step_overhead.prof")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args()
    configs = (("none", False), ("host", True))
    runs: dict[str, list[Run]] = {name: [] for name, _ in configs}
    phases: dict[str, dict[str, list[float]]] = {name: {} for name, _ in configs}
    loads = [os.getloadavg()[0]]
    for _ in range(args.repeats):
        for name, offload in configs:
            runs[name].append(run(args, offload, phases[name] if args.phases else None))
        loads.append(os.getloadavg()[0])
    print(
        f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, "
        f"{args.repeats} interleaved repeats, load {min(loads):.1f}-{max(loads):.1f}"
    )
    for name, rs in runs.items():
        if not rs:
            continue
        print(
            f"{name:4s} engine s {_summary([r.engine_s for r in rs], '.3f')}, "
            f"steps {_summary([float(r.steps) for r in rs], '.0f')}, "
            f"tokens {_summary([float(r.tokens) for r in rs], '.0f')}, "
            f"ms/step {_summary([r.per_step_ms for r in rs], '.3f')}, "
            f"us/step outside the forward {_summary([r.outside_us for r in rs], '.0f')} "
            f"(CPU {_summary([r.outside_cpu_us for r in rs], '.0f')}), "
            f"forward ms/step {_summary([1e3 * r.forward_s / r.steps for r in rs], '.3f')}, "
            f"process CPU ms/step {_summary([1e3 * r.process_cpu_s / r.steps for r in rs], '.3f')}"
        )
    if runs["none"] and runs["host"]:
        ratios = [
            h.per_step_ms / n.per_step_ms for n, h in zip(runs["none"], runs["host"], strict=True)
        ]
        print(f"host / none ms per step: {_summary(ratios, '.3f')}")
    for name, totals in phases.items():
        steps = sum(r.steps for r in runs[name])
        for phase, (calls, seconds) in totals.items():
            if calls:
                print(
                    f"{name:4s} {phase:40s} {calls / steps:5.2f} calls/step "
                    f"{1e6 * seconds / steps:6.1f} us/step"
                )
    if args.profile is not None:
        profiler = cProfile.Profile()
        profiler.enable()
        run(args, args.profile == "host")
        profiler.disable()
        profiler.dump_stats(args.profile_out)
        stats = pstats.Stats(args.profile_out)
        stats.sort_stats("cumulative").print_stats(args.top)
        stats.sort_stats("tottime").print_stats(args.top)


if __name__ == "__main__":
    main()

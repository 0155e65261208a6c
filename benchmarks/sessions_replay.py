"""Chat sessions replayed in-process on a virtual clock: admission orders and workload sizes
compared without noise.

`make bench-sessions` measures the real server on a shared machine, where one configuration's
median moves 2x between repeats. This replays the same closed-loop workload (N users x R rounds,
at most ``--max-concurrency`` users at once as the client's flag; a shared system prompt, a
context per user, each turn re-sending the conversation with the answers the engine returned,
think times from the sessions benchmark's seeded draws) against an in-process
:class:`~kvoffload.engine.Engine`, and times it on a virtual clock: each engine step costs
``--step-base-s + --token-s x tokens computed`` (fit them to the server's steps: the sessions
benchmark's JSON has each run's ``server_counters`` steps, step_tokens and step_s; `tiny` on the
2 shared cores was 1.9 ms + 7.7 us, `small` 12.9 ms + 0.64 ms, and 50 ms + 0.41 ms at load 4).
Transfers are reported at the next step and the load decision's estimates are pinned to the same
prices, so a run is the same every time: what differs between configurations is the schedule
alone. Prints round-1 and rounds-2+ mean TTFT, P99 TTFT and output tokens per virtual second per
configuration and admission order, each mean TTFT's parts (waiting in the queue, waiting for its
load, computing its prefill), and host / none ratios.

The schedule depends on token counts only, so ``--model tiny`` with another model's prices
replays that model's schedule in seconds; give it the same host tier in blocks (``small``'s KV
is 32x ``tiny``'s: ``--host-gib`` / 32).

    python benchmarks/sessions_replay.py --seeds 3
    python benchmarks/sessions_replay.py --step-base-s 0.05 --token-s 4.1e-4 --users 16 \
        --context-len 512 --answer-len 16 --num-device-blocks 160 --think-time 5 --host-gib 0.01

Seed 0's think times are those of ``kvoffload bench serve --dataset-name sessions`` (seed 0).
"""

from __future__ import annotations

import argparse
import heapq
import random
import statistics
from dataclasses import dataclass

from sessions_workload import add_sessions_args, first_contexts, random_tokens

from kvoffload.engine import Engine, SamplingParams
from kvoffload.servebench.sessions import think_times
from kvoffload.worker import DelayedCompletionHandler

#: The parts of a TTFT (:class:`Replay`'s ``parts``): steps a turn spent waiting in the queue,
#: waiting for its load, and computing (its prefill, chunks and the first token's step).
PARTS = ("queue", "load", "prefill")


@dataclass
class Replay:
    """One run's TTFTs (ms) by round, their parts (``parts[round > 0][part]``: ms per turn,
    :data:`PARTS`, each turn's summing to its TTFT) and output tokens per virtual second."""

    round1: list[float]
    later: list[float]
    tokens_per_s: float
    parts: dict[bool, dict[str, list[float]]]

    @property
    def p99(self) -> float:
        every = sorted(self.round1 + self.later)
        return statistics.quantiles(every, n=100, method="inclusive")[98]


def _deterministic_transfers(engine: Engine) -> None:
    """Report every transfer job at the first collection after it was submitted."""
    if engine.worker is None:
        return
    router = engine.worker.offloading_worker
    inner = router.handler("GPU", "CPU")
    handler = DelayedCompletionHandler(inner, lambda: int(engine.stats()["steps"]), lambda _: 0)
    for direction in (("GPU", "CPU"), ("CPU", "GPU")):
        router.register_handler(*direction, handler, replace=True)


def replay(args: argparse.Namespace, offload: bool, policy: str, seed: int) -> Replay:
    rng = random.Random(seed)
    history = first_contexts(args, rng)
    questions = [
        [random_tokens(rng, args.question_len) for _ in range(args.rounds)]
        for _ in range(args.users)
    ]
    thinks = think_times(args.users, args.rounds, args.think_time, "exponential", seed)
    settings: dict[str, object] = {
        "block_size": 16,
        "num_device_blocks": args.num_device_blocks,
        "scheduling_policy": policy,
    }
    if offload:
        settings["kv_offloading_size"] = args.host_gib
    engine = Engine(args.model, **settings)
    try:
        _deterministic_transfers(engine)
        if engine.connector is not None:
            # host loads at a twentieth of computing a block: the engine's prior
            engine.connector.costs.pin(
                {"token_s": args.token_s, "step_s": 0.0, "host": 0.05 * 16 * args.token_s}
            )
        params = SamplingParams(max_tokens=args.answer_len, ignore_eos=True)
        # as the client's --max-concurrency: a user holds its slot for its whole conversation
        slots = args.max_concurrency or args.users
        arrivals = [(0.0, user, 0) for user in range(min(slots, args.users))]
        next_user = len(arrivals)
        now, output_tokens = 0.0, 0
        live: dict[str, tuple[int, int, float, list[int]]] = {}
        parts: dict[bool, dict[str, list[float]]] = {
            k: {n: [] for n in PARTS} for k in (False, True)
        }
        first: dict[str, float] = {}
        ttft: dict[int, list[float]] = {}
        # request id -> part -> virtual seconds, until its first token
        spent: dict[str, dict[str, float]] = {}
        for _ in range(1_000_000):
            if not arrivals and not live:
                break
            while arrivals and arrivals[0][0] <= now:
                at, user, rnd = heapq.heappop(arrivals)
                prompt = history[user] + questions[user][rnd]
                live[engine.add_request(prompt, params)] = (user, rnd, at, prompt)
            if not live:
                now = arrivals[0][0]
                continue
            before = engine.stats()["forward_tokens"]
            finished = engine.step()
            took = args.step_base_s + args.token_s * (engine.stats()["forward_tokens"] - before)
            running = {r.request_id for r in engine.scheduler.running}
            for req_id, (_, _, at, _) in live.items():
                if req_id in first:
                    continue
                if req_id not in spent:  # it arrived between steps: waited since
                    spent[req_id] = {"queue": now - at, "load": 0.0, "prefill": 0.0}
                part = spent[req_id]
                if req_id in engine.scheduler.loading:
                    part["load"] += took
                elif req_id in running or engine.live_output(req_id) is None:
                    part["prefill"] += took  # computing (or finished in this step)
                else:
                    part["queue"] += took
            now += took
            for req_id in live:
                so_far = engine.live_output(req_id)
                if req_id not in first and so_far is not None and so_far[0]:
                    first[req_id] = now
            for done in finished:
                user, rnd, at, prompt = live.pop(done.request_id)
                ttft.setdefault(rnd, []).append((first.get(done.request_id, now) - at) * 1e3)
                for name, s in spent.pop(done.request_id).items():
                    parts[rnd > 0][name].append(s * 1e3)
                history[user] = prompt + list(done.output_token_ids)
                output_tokens += len(done.output_token_ids)
                if rnd + 1 < args.rounds:
                    heapq.heappush(arrivals, (now + thinks[user][rnd], user, rnd + 1))
                elif next_user < args.users:  # its slot passes to the next user
                    heapq.heappush(arrivals, (now, next_user, 0))
                    next_user += 1
        else:
            raise RuntimeError("the replay did not finish in 1,000,000 steps")
    finally:
        engine.close()
    later = [t for rnd, ts in ttft.items() if rnd > 0 for t in ts]
    return Replay(ttft.get(0, []), later, output_tokens / now, parts)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_sessions_args(p)
    p.add_argument("--think-time", type=float, default=0.5)
    p.add_argument("--max-concurrency", type=int, default=0, help="users active at once (0: all)")
    p.add_argument("--step-base-s", type=float, default=1.9e-3)
    p.add_argument("--token-s", type=float, default=7.7e-6)
    p.add_argument("--policies", default="cache_aware,fcfs")
    p.add_argument("--seeds", type=int, default=1)
    args = p.parse_args()
    for policy in args.policies.split(","):
        runs = {
            name: [replay(args, offload, policy, seed) for seed in range(args.seeds)]
            for name, offload in (("none", False), ("host", True))
        }
        for name, rs in runs.items():
            print(
                f"{policy:11s} {name:4s} "
                + " | ".join(
                    f"r1 {statistics.mean(r.round1):6.0f} r2+ {statistics.mean(r.later):6.0f} "
                    f"p99 {r.p99:6.0f} ms, {r.tokens_per_s:5.0f} tok/s"
                    for r in rs
                )
            )
        for name, rs in runs.items():
            for later, label in ((False, "round 1"), (True, "rounds 2+")):
                print(
                    f"{policy:11s} {name:4s} {label:9s} mean TTFT ms = "
                    + " | ".join(
                        " + ".join(
                            f"{part} {statistics.mean(r.parts[later][part]):6.0f}" for part in PARTS
                        )
                        for r in rs
                    )
                )
        for seed, (none, host) in enumerate(zip(runs["none"], runs["host"], strict=True)):
            print(
                f"{policy:11s} seed {seed} host vs none (>1 better): "
                f"rounds 2+ {statistics.mean(none.later) / statistics.mean(host.later):.2f}x, "
                f"round 1 {statistics.mean(none.round1) / statistics.mean(host.round1):.2f}x, "
                f"P99 {none.p99 / host.p99:.2f}x, throughput {host.tokens_per_s / none.tokens_per_s:.2f}x"
            )


if __name__ == "__main__":
    main()

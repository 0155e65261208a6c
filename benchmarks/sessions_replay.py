"""Chat sessions replayed in-process on a virtual clock: admission orders compared without noise.

`make bench-sessions` measures the real server on a shared machine, where one configuration's
median moves 2x between repeats. This replays the same closed-loop workload (N users x R rounds;
a shared system prompt, a context per user, each turn re-sending the conversation with the
answers the engine returned, think times from the sessions benchmark's seeded draws) against an
in-process :class:`~kvoffload.engine.Engine`, and times it on a virtual clock: each engine step
costs ``--step-base-s + --token-s x tokens computed`` (fit them to the server's steps: the
sessions benchmark prints ``engine compute s``; `tiny` on the 2 shared cores was 1.9 ms + 7.7 us,
`small` 12.9 ms + 0.64 ms). Transfers are reported at the next step and the load decision's
estimates are pinned to the same prices, so a run is the same every time: what differs between
configurations is the schedule alone. Prints round-1 and rounds-2+ mean TTFT, P99 TTFT and
output tokens per virtual second per configuration and admission order, and host / none ratios.

    python benchmarks/sessions_replay.py --seeds 3
    python benchmarks/sessions_replay.py --model small --step-base-s 0.0129 --token-s 6.4e-4

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


@dataclass
class Replay:
    """One run's TTFTs (ms) by round and its output tokens per virtual second."""

    round1: list[float]
    later: list[float]
    tokens_per_s: float

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
        arrivals = [(0.0, user, 0) for user in range(args.users)]
        now, output_tokens = 0.0, 0
        live: dict[str, tuple[int, int, float, list[int]]] = {}
        first: dict[str, float] = {}
        ttft: dict[int, list[float]] = {}
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
            now += args.step_base_s + args.token_s * (engine.stats()["forward_tokens"] - before)
            for req_id in live:
                so_far = engine.live_output(req_id)
                if req_id not in first and so_far is not None and so_far[0]:
                    first[req_id] = now
            for done in finished:
                user, rnd, at, prompt = live.pop(done.request_id)
                ttft.setdefault(rnd, []).append((first.get(done.request_id, now) - at) * 1e3)
                history[user] = prompt + list(done.output_token_ids)
                output_tokens += len(done.output_token_ids)
                if rnd + 1 < args.rounds:
                    heapq.heappush(arrivals, (now + thinks[user][rnd], user, rnd + 1))
        else:
            raise RuntimeError("the replay did not finish in 1,000,000 steps")
    finally:
        engine.close()
    later = [t for rnd, ts in ttft.items() if rnd > 0 for t in ts]
    return Replay(ttft.get(0, []), later, output_tokens / now)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    add_sessions_args(p)
    p.add_argument("--think-time", type=float, default=0.5)
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
        for seed, (none, host) in enumerate(zip(runs["none"], runs["host"], strict=True)):
            print(
                f"{policy:11s} seed {seed} host vs none (>1 better): "
                f"rounds 2+ {statistics.mean(none.later) / statistics.mean(host.later):.2f}x, "
                f"round 1 {statistics.mean(none.round1) / statistics.mean(host.round1):.2f}x, "
                f"P99 {none.p99 / host.p99:.2f}x, throughput {host.tokens_per_s / none.tokens_per_s:.2f}x"
            )


if __name__ == "__main__":
    main()

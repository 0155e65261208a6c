"""``kvoffload bench serve --dataset-name sessions``: chat sessions online, closed loop.

The workload (LMCache's multi-round QA, vLLM's ``benchmarks/multi_turn``): ``num_users`` users
each hold a conversation of ``num_rounds`` turns. Every conversation opens with one system prompt
that all users share, then the user's own context before the first question; each later turn
re-sends the whole conversation so far, the assistant turns being the answers the server
actually returned (greedy, ``answer_len`` tokens each, :func:`~kvoffload.servebench.chat.chat_turn`),
then the next question. Text comes from :func:`~kvoffload.servebench.words.words_of_tokens`,
fitted to the model's tokenizer. A user sends a turn when the previous answer has arrived and its
think time has passed (exponential with the given mean, or fixed; drawn per user from the seed,
so the same flags give the same think times); ``max_concurrency`` caps the users active at once
(a user holds its slot for its whole conversation; its first turn's ``queue_time`` is the wait
for one). A failed turn ends its user's conversation (there is no answer to re-send).

Round 1 is cold (only the shared system prompt can hit); later rounds are where a cache that
kept the conversation pays. The result is ``vllm bench serve``'s keys over every turn, the
servers' tokens by source, and per round (``rounds``) TTFT and ITL.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import math
import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from kvoffload.servebench.chat import chat_turn
from kvoffload.servebench.client import RequestResult, bench_connections
from kvoffload.servebench.device_cache import device_cache_tokens
from kvoffload.servebench.metrics import (
    DETAILED_KEYS,
    hit_rates_by_source,
    parse_goodput,
    scrape_sources,
    summarize,
)
from kvoffload.servebench.run import metrics_urls, print_result, progress_bar
from kvoffload.servebench.server_counters import counter_deltas, scrape_counters
from kvoffload.servebench.words import words_of_tokens

__all__ = [
    "THINK_TIME_DISTS",
    "SessionsWorkload",
    "Turn",
    "active_context_tokens",
    "build_workload",
    "round_figures",
    "run_sessions",
    "run_users",
    "think_times",
]

THINK_TIME_DISTS = ("exponential", "fixed")
#: Per-turn arrays kept only with ``--save-detailed``, as vLLM's per-request ones.
_DETAILED_SESSION_KEYS = ("users_of_requests", "rounds_of_requests")


@dataclass(frozen=True)
class SessionsWorkload:
    """The text of every conversation: ``questions[user][round]``; ``contexts[user]`` opens the
    user's first message; ``answer_len``: max_tokens of every turn."""

    system_prompt: str
    contexts: tuple[str, ...]
    questions: tuple[tuple[str, ...], ...]
    answer_len: int

    @property
    def num_users(self) -> int:
        return len(self.questions)

    @property
    def num_rounds(self) -> int:
        return len(self.questions[0]) if self.questions else 0

    def messages(self, user: int, answers: Sequence[str]) -> list[dict[str, str]]:
        """The request of round ``len(answers)`` (0-based) of ``user``: the system prompt, the
        user's questions up to that round (the first after the user's context) and, between them,
        ``answers`` (the server's earlier answers, as returned)."""
        asked = self.questions[user][: len(answers) + 1]
        out = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        for i, question in enumerate(asked):
            if i == 0 and self.contexts[user]:
                question = f"{self.contexts[user]}\n\n{question}"
            out.append({"role": "user", "content": question})
            if i < len(answers):
                out.append({"role": "assistant", "content": answers[i]})
        return out


def build_workload(flags: argparse.Namespace) -> SessionsWorkload:
    """The conversations of the resolved ``--sessions-*`` flags, lengths counted with the
    tokenizer of ``--model`` (as ``kvoffload serve --model`` encodes them)."""
    from kvoffload.serving.prompts import PromptTokenizer

    tokenizer = PromptTokenizer(flags.model)

    def count(text: str) -> int:
        return len(tokenizer.encode(text))

    seed, users = flags.seed, range(flags.sessions_num_users)
    return SessionsWorkload(
        system_prompt=words_of_tokens(count, flags.sessions_system_prompt_len, f"{seed}:system"),
        contexts=tuple(words_of_tokens(count, flags.sessions_user_context_len,
                                       f"{seed}:context:{u}") for u in users),
        questions=tuple(
            tuple(words_of_tokens(count, flags.sessions_question_len, f"{seed}:question:{u}:{r}")
                  for r in range(flags.sessions_num_rounds))
            for u in users
        ),
        answer_len=flags.sessions_answer_len,
    )


def think_times(num_users: int, num_rounds: int, mean_s: float, dist: str,
                seed: int) -> list[list[float]]:
    """Seconds each user thinks after each of its turns but the last (``[user][round]``):
    exponential with mean ``mean_s`` or exactly ``mean_s``; user ``u``'s from its own seeded
    stream, so they do not depend on the order users run in."""
    if dist not in THINK_TIME_DISTS:
        raise ValueError(f"think time distribution: one of {THINK_TIME_DISTS}, got {dist!r}")
    out = []
    for user in range(num_users):
        rng = random.Random(f"{seed}:think:{user}")
        if dist == "fixed" or mean_s == 0:
            out.append([mean_s] * (num_rounds - 1))
        else:
            out.append([rng.expovariate(1 / mean_s) for _ in range(num_rounds - 1)])
    return out


@dataclass
class Turn:
    """One request of the run: whose, which round (0-based), what was sent, what came back."""

    user: int
    round: int
    messages: list[dict[str, str]]
    result: RequestResult


async def run_users(
    url: str,
    model: str,
    workload: SessionsWorkload,
    think: Sequence[Sequence[float]],
    max_concurrency: int | None,
    sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    on_done: Callable[[], object] | None = None,
) -> tuple[list[Turn], float]:
    """Run every user's conversation (at most ``max_concurrency`` users at once), ``sleep``-ing
    ``think[user][round]`` after each turn but the last; returns the turns sent (by user, then
    round) and the wall duration. ``on_done()`` is called as each turn ends (a progress bar)."""
    gate: asyncio.Semaphore | contextlib.nullcontext[None] = (
        asyncio.Semaphore(max_concurrency) if max_concurrency else contextlib.nullcontext()
    )
    turns: list[Turn] = []

    async def converse(user: int) -> None:
        arrival = time.perf_counter()
        async with gate:
            answers: list[str] = []
            for rnd in range(workload.num_rounds):
                if rnd:
                    await sleep(think[user][rnd - 1])
                messages = workload.messages(user, answers)
                result = await chat_turn(conns, url, model, messages, workload.answer_len)
                result.queue_time = result.start_time - arrival if rnd == 0 else 0.0
                turns.append(Turn(user, rnd, messages, result))
                if on_done is not None:
                    on_done()
                if not result.success:
                    return
                answers.append(result.generated_text)

    conns = bench_connections(aiohttp.ClientTimeout(total=None, sock_connect=10))
    try:
        start = time.perf_counter()
        await asyncio.gather(*(converse(u) for u in range(workload.num_users)))
        duration = time.perf_counter() - start
    finally:
        await conns.close()
    turns.sort(key=lambda t: (t.user, t.round))
    return turns, duration


def round_figures(turns: Sequence[Turn], num_rounds: int,
                  percentiles: Sequence[float]) -> list[dict[str, Any]]:
    """Per round (1-based ``round``): turns completed and failed, prompt tokens, and TTFT and
    ITL (``mean/median/std/p{P}_{ttft,itl}_ms``, vLLM's definitions)."""
    out = []
    for rnd in range(num_rounds):
        results = [t.result for t in turns if t.round == rnd]
        figures = summarize(results, 1.0, percentiles, ("ttft", "itl"))
        out.append({
            "round": rnd + 1,
            "completed": figures["completed"],
            "failed": figures["failed"],
            "total_input_tokens": figures["total_input_tokens"],
            **{k: v for k, v in figures.items() if k.endswith(("_ttft_ms", "_itl_ms"))},
        })
    return out


def shared_prefix_tokens(model: str, workload: SessionsWorkload) -> int:
    """Tokens every conversation starts with (the system prompt as the chat template renders
    it): the common prefix of the first two users' first requests, as ``model``'s tokenizer
    encodes them (0 for fewer than two users)."""
    from kvoffload.serving.prompts import PromptTokenizer

    if workload.num_users < 2:
        return 0
    tokenizer = PromptTokenizer(model)
    a, b = (tokenizer.encode_chat(workload.messages(u, [])) for u in (0, 1))
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def active_context_tokens(turns: Sequence[Turn], active_users: int, shared: int) -> int:
    """Tokens the ``active_users`` longest conversations hold at their end (each user's longest
    successful turn: prompt plus answer, as the server counted them), the ``shared`` prefix
    they all start with counted once: what a cache must hold to keep every active session."""
    longest: dict[int, int] = {}
    for t in turns:
        if t.result.success:
            size = t.result.prompt_len + t.result.output_tokens
            longest[t.user] = max(longest.get(t.user, 0), size)
    sizes = sorted(longest.values(), reverse=True)[:active_users]
    return sum(sizes) - shared * max(0, len(sizes) - 1)


def run_sessions(args: argparse.Namespace, url: str, quiet: bool = False) -> dict[str, Any]:
    """One run of the sessions workload of the resolved flags against ``url``: vLLM's result
    keys over every turn, the servers' tokens by source, and ``rounds``."""
    workload = build_workload(args)
    think = think_times(args.sessions_num_users, args.sessions_num_rounds,
                        args.sessions_think_time, args.sessions_think_time_dist, args.seed)
    model = args.served_model_name or args.model
    urls = metrics_urls(url)
    device = device_cache_tokens(urls)
    before, counters_before = scrape_sources(urls), scrape_counters(urls)
    bar = progress_bar(workload.num_users * workload.num_rounds, args, quiet)
    try:
        turns, duration = asyncio.run(run_users(
            url, model, workload, think, args.max_concurrency,
            on_done=None if bar is None else lambda: bar.update(1)))
    finally:
        if bar is not None:
            bar.close()
    after, counters_after = scrape_sources(urls), scrape_counters(urls)
    active_users = min(workload.num_users, args.max_concurrency or workload.num_users)
    active = active_context_tokens(turns, active_users,
                                   shared_prefix_tokens(args.model, workload))
    percentiles = [float(p) for p in args.metric_percentiles.split(",")]
    results = [t.result for t in turns]
    out: dict[str, Any] = {
        "date": datetime.datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": "openai-chat",
        "backend": "openai-chat",
        "label": args.label,
        "model_id": args.model,
        "tokenizer_id": args.model,
        "dataset_name": "sessions",
        "num_users": workload.num_users,
        "num_rounds": workload.num_rounds,
        "think_time_s": args.sessions_think_time,
        "think_time_dist": args.sessions_think_time_dist,
        "num_prompts": workload.num_users * workload.num_rounds,
        "request_rate": "closed_loop",
        "burstiness": None,
        "max_concurrency": args.max_concurrency,
        **summarize(results, duration, percentiles, args.percentile_metrics.split(","),
                    parse_goodput(args.goodput or []), args.max_concurrency, math.inf),
        **hit_rates_by_source(before, after),
        "rounds": round_figures(turns, workload.num_rounds, percentiles),
        "not_sent": workload.num_users * workload.num_rounds - len(turns),
        "first_error": next((r.error for r in results if r.error), None),
        "server_counters": counter_deltas(counters_before, counters_after),
        "active_users": active_users,
        "active_context_tokens": active,
        "device_cache_tokens": device,
        "context_to_device_cache": active / device if device else None,
        "users_of_requests": [t.user for t in turns],
        "rounds_of_requests": [t.round + 1 for t in turns],
    }
    if not quiet:
        print_result(out, percentiles)
        print_rounds(out["rounds"], percentiles)
        print(context_line(out))
    if not args.save_detailed:
        for key in (*DETAILED_KEYS, *_DETAILED_SESSION_KEYS):
            del out[key]
    return out


def context_line(result: dict[str, Any]) -> str:
    """The sizing condition of a run: the active sessions' context against the device cache."""
    device, active = result["device_cache_tokens"], result["active_context_tokens"]
    head = (f"Active context: {active:,} tokens ({result['active_users']} conversations at their "
            "end, the shared prefix once)")
    if not device:
        return f"{head}; the server does not report its device cache"
    return (f"{head} = {active / device:.1f}x the device cache of {device:,} tokens")


def print_rounds(rounds: Sequence[dict[str, Any]], percentiles: Sequence[float]) -> None:
    """The per-round table: turns, prompt tokens, TTFT mean / median / each percentile, mean
    ITL (milliseconds)."""
    heads = ["round", "ok", "failed", "prompt tok", "mean TTFT", "median TTFT",
             *[f"P{p:g} TTFT" for p in percentiles], "mean ITL"]
    print("{s:{c}^60}".format(s=" Per round (ms) ", c="-"))
    print("".join(f"{h:>12}" for h in heads))
    for r in rounds:
        cells = [r["round"], r["completed"], r["failed"], r["total_input_tokens"],
                 f"{r['mean_ttft_ms']:.2f}", f"{r['median_ttft_ms']:.2f}",
                 *[f"{r[f'p{p:g}_ttft_ms']:.2f}" for p in percentiles], f"{r['mean_itl_ms']:.2f}"]
        print("".join(f"{c!s:>12}" for c in cells))
    print("=" * 60)

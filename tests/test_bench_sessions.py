"""``kvoffload bench serve --dataset-name sessions`` and ``--compare-offloading``: closed-loop chat
users against a real ``kvoffload serve`` (through a recording proxy: what the server returned is
what the next turn re-sends), think times by count (a recording sleep, no clock), per-round
accounting, the flags' refusals, and the comparison's table."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys

import aiohttp
import pytest
from aiohttp import web
from serve_cases import free_port, serve

from kvoffload.cli.flagspec import resolve_flags
from kvoffload.cli.main import build_parser
from kvoffload.servebench.offloading import offloading_args
from kvoffload.servebench.sessions import (
    build_workload,
    round_figures,
    run_users,
    think_times,
)
from kvoffload.servebench.words import words_of_tokens

pytestmark = pytest.mark.timeout(180)

SMALL = ("--dataset-name", "sessions", "--sessions-num-users", "2", "--sessions-num-rounds", "3",
         "--sessions-system-prompt-len", "40", "--sessions-user-context-len", "60",
         "--sessions-question-len", "12", "--sessions-answer-len", "5")


def _args(*flags: str):
    argv = ["bench", "serve", "--model", "tiny", *flags]
    return build_parser(argv).parse_args(argv)


def _answer(sse: bytes) -> str:
    """The assistant text of a streamed chat answer, as the server sent it."""
    text = ""
    for event in sse.split(b"\n\n"):
        data = event.removeprefix(b"data: ").strip()
        if data and data != b"[DONE]":
            for choice in json.loads(data).get("choices") or []:
                text += (choice.get("delta") or {}).get("content") or ""
    return text


async def _through_recording_proxy(backend: str, flags, think, exchanges: list, slept: list):
    """Run the users against a proxy (in this loop) that forwards to ``backend`` and records
    every (request body, response bytes); ``slept`` records the think times asked for."""

    async def forward(request: web.Request) -> web.Response:
        body = await request.json()
        async with aiohttp.ClientSession() as session, session.post(
                f"{backend}{request.path}", json=body) as resp:
            raw = await resp.read()
        exchanges.append((body, raw))
        return web.Response(body=raw, status=resp.status, content_type="text/event-stream")

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", forward)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        return await run_users(f"http://127.0.0.1:{port}", "tiny", build_workload(flags), think,
                               max_concurrency=1, sleep=sleep)
    finally:
        await runner.cleanup()


def test_each_turn_resends_the_answers_the_server_returned(tmp_path) -> None:
    flags = resolve_flags(_args(*SMALL, "--sessions-think-time", "0.5",
                                "--sessions-think-time-dist", "fixed"))
    think = think_times(2, 3, 0.5, "fixed", 0)
    exchanges: list = []
    slept: list = []
    output = tmp_path / "result.json"
    with serve() as server:
        turns, _ = asyncio.run(_through_recording_proxy(server.url, flags, think, exchanges,
                                                        slept))
        cli = subprocess.run(
            [sys.executable, "-m", "kvoffload.cli.main", "bench", "serve", "--base-url",
             server.url, "--model", "tiny", *SMALL, "--sessions-think-time", "0",
             "--save-detailed", "--output-json", str(output)],
            capture_output=True, text=True, timeout=150, check=False,
        )
    # The command: the same conversations, vLLM's keys over every turn, a table per round.
    assert cli.returncode == 0, cli.stdout + cli.stderr
    assert "Per round" in cli.stdout
    r = json.loads(output.read_text())
    assert (r["completed"], r["failed"], r["num_prompts"], r["not_sent"]) == (6, 0, 6, 0)
    assert r["users_of_requests"] == [0, 0, 0, 1, 1, 1]
    assert r["rounds_of_requests"] == [1, 2, 3, 1, 2, 3]
    assert [x["completed"] for x in r["rounds"]] == [2, 2, 2]
    assert r["input_lens"][0] == turns[0].result.prompt_len  # round 1: the same text, seeded
    assert sum(r["tokens_by_source"].values()) == sum(r["input_lens"])
    assert [(t.user, t.round) for t in turns] == [(u, r) for u in range(2) for r in range(3)]
    assert all(t.result.success and t.result.output_tokens == 5 for t in turns)
    # One user at a time (--max-concurrency 1): the proxy saw the turns in the users' order.
    assert [body["messages"] for body, _ in exchanges] == [t.messages for t in turns]
    for (body, raw), turn in zip(exchanges, turns, strict=True):
        assert turn.result.generated_text == _answer(raw)
        assert body["max_tokens"] == 5 and body["stream"] is True
    for user in range(2):
        sent = [body["messages"] for body, _ in exchanges[3 * user : 3 * user + 3]]
        answers = [_answer(raw) for _, raw in exchanges[3 * user : 3 * user + 3]]
        assert all(answers)
        for rnd in (1, 2):
            # Round r re-sends round r-1's request, the server's answer to it, the next question.
            assert sent[rnd][: len(sent[rnd - 1])] == sent[rnd - 1]
            assert sent[rnd][len(sent[rnd - 1])] == {"role": "assistant",
                                                     "content": answers[rnd - 1]}
            assert sent[rnd][-1]["role"] == "user" and len(sent[rnd]) == len(sent[rnd - 1]) + 2
    assert sent[0][0]["role"] == "system" and exchanges[0][0]["messages"][0] == sent[0][0]
    assert exchanges[0][0]["messages"][1] != sent[0][1]  # each user its own context
    # Think times by count: after every turn but each user's last, the drawn value.
    assert slept == [0.5] * 4
    # Per round: every user once; the prompt grows round by round by what was re-sent.
    rounds = round_figures(turns, 3, [50, 99])
    assert [(r["round"], r["completed"], r["failed"]) for r in rounds] == [(1, 2, 0), (2, 2, 0),
                                                                           (3, 2, 0)]
    for r in rounds:
        ttfts = [t.result.ttft * 1000 for t in turns if t.round == r["round"] - 1]
        assert r["mean_ttft_ms"] == pytest.approx(sum(ttfts) / 2)
        assert r["total_input_tokens"] == sum(t.result.prompt_len for t in turns
                                              if t.round == r["round"] - 1)
    assert rounds[0]["total_input_tokens"] < rounds[1]["total_input_tokens"] < rounds[2][
        "total_input_tokens"]


async def _against_a_failing_server(flags, slept: list):
    async def refuse(request: web.Request) -> web.Response:
        return web.json_response({"error": {"message": "overloaded"}}, status=503)

    async def sleep(seconds: float) -> None:
        slept.append(seconds)

    app = web.Application()
    app.router.add_post("/v1/chat/completions", refuse)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    try:
        return await run_users(f"http://127.0.0.1:{port}", "tiny", build_workload(flags),
                               think_times(2, 3, 1.0, "fixed", 0), None, sleep=sleep)
    finally:
        await runner.cleanup()


def test_a_failed_turn_ends_its_users_conversation() -> None:
    slept: list = []
    turns, _ = asyncio.run(_against_a_failing_server(resolve_flags(_args(*SMALL)), slept))
    assert [(t.user, t.round) for t in turns] == [(0, 0), (1, 0)]  # nothing to re-send after
    assert all(not t.result.success and t.result.error.startswith("HTTP 503") for t in turns)
    assert slept == []
    rounds = round_figures(turns, 3, [99])
    assert [(r["completed"], r["failed"]) for r in rounds] == [(0, 2), (0, 0), (0, 0)]


def test_think_times_are_drawn_per_user_from_the_seed() -> None:
    a = think_times(3, 5, 2.0, "exponential", 7)
    assert a == think_times(3, 5, 2.0, "exponential", 7)
    assert [len(gaps) for gaps in a] == [4, 4, 4] and a[0] != a[1]
    assert a[:2] == think_times(2, 5, 2.0, "exponential", 7)  # a user's own stream
    assert a != think_times(3, 5, 2.0, "exponential", 8)
    assert think_times(2, 3, 0.0, "exponential", 7) == [[0.0, 0.0]] * 2
    with pytest.raises(ValueError, match="one of"):
        think_times(1, 2, 1.0, "uniform", 0)


@pytest.mark.parametrize("n", [0, 1, 7, 100, 333])
def test_prompt_text_fits_the_token_count(n: int) -> None:
    def count(text: str) -> int:
        return len(text.encode())

    text = words_of_tokens(count, n, "s")
    assert text == words_of_tokens(count, n, "s")
    longest_word = 9
    assert n - longest_word <= count(text) <= n


def test_workload_lengths_follow_the_flags() -> None:
    w = build_workload(resolve_flags(_args(*SMALL)))
    assert (w.num_users, w.num_rounds, w.answer_len) == (2, 3, 5)
    assert 40 - 9 <= len(w.system_prompt) <= 40  # the tiny preset is byte-level
    assert all(60 - 9 <= len(c) <= 60 for c in w.contexts) and w.contexts[0] != w.contexts[1]
    assert w.messages(1, []) == [{"role": "system", "content": w.system_prompt},
                                 {"role": "user",
                                  "content": f"{w.contexts[1]}\n\n{w.questions[1][0]}"}]


@pytest.mark.parametrize("flags", [
    (*SMALL, "--num-prompts", "5"),
    (*SMALL, "--request-rate", "3"),
    (*SMALL, "--compare-routing", "2"),
    ("--sessions-num-users", "3"),  # without --dataset-name sessions
    ("--compare-offloading-host-size", "0.1"),  # without --compare-offloading
    ("--compare-offloading", "--compare-routing", "2"),
])
def test_flags_that_mean_nothing_are_one_line_errors(flags, capsys) -> None:
    args = _args(*flags)
    assert args.func(args) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: ")


def test_unknown_configurations_are_refused(capsys) -> None:
    with pytest.raises(SystemExit):
        _args("--compare-offloading", "--compare-offloading-configs", "host,nvme")
    assert "no_offloading, host, host_disk, host_redis" in capsys.readouterr().err


def test_each_configuration_has_its_flags() -> None:
    flags = resolve_flags(_args("--compare-offloading", "--num-device-blocks", "8",
                                "--compare-offloading-host-size", "0.01",
                                "--compare-offloading-disk-size", "0.02"))
    base = ["serve", "--model", "tiny", "--num-device-blocks", "8"]
    host = [*base, "--kv-offloading-size", "0.01"]
    # serve's default is a host tier sized from the machine: no_offloading turns it off
    assert offloading_args(flags, "no_offloading", None, None) == [*base, "--kv-offloading-size",
                                                                   "0"]
    assert offloading_args(flags, "host", None, None) == host
    assert offloading_args(flags, "host_disk", "/d", None) == [*host, "--kv-disk-path", "/d",
                                                               "--kv-disk-size", "0.02"]
    assert offloading_args(flags, "host_redis", None, "redis://r") == [*host, "--kv-remote-url",
                                                                       "redis://r"]


def test_compare_offloading_ends_with_the_table(tmp_path) -> None:
    output = tmp_path / "compare.json"
    run = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli.main", "bench", "serve", "--model", "tiny",
         "--dataset-name", "sessions", "--sessions-num-users", "2", "--sessions-num-rounds", "2",
         "--sessions-system-prompt-len", "32", "--sessions-user-context-len", "32",
         "--sessions-question-len", "8", "--sessions-answer-len", "3",
         "--sessions-think-time", "0", "--compare-offloading", "--compare-offloading-configs",
         "no_offloading,host", "--compare-offloading-host-size", "0.01",
         "--num-device-blocks", "16", "--output-json", str(output)],
        capture_output=True, text=True, timeout=150, check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    table = lines.index(next(line for line in lines if line.startswith("== offloading")))
    assert lines[table + 1].split() == ["no_offloading", "host"]
    assert [line.split()[0] for line in lines[table + 2 : table + 5]] == ["round", "rounds", "mean"]
    assert lines[-1].startswith("host vs no_offloading (>1: better): round 1 TTFT ms")
    r = json.loads(output.read_text())
    assert set(r["configs"]) == {"no_offloading", "host"}
    for name in ("no_offloading", "host"):
        (result,) = r["runs"][name]
        assert (result["completed"], result["failed"], result["num_prompts"]) == (4, 0, 4)
        assert [x["completed"] for x in result["rounds"]] == [2, 2]

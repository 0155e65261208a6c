"""``kvoffload bench serve --dataset-name sessions`` and ``--compare-offloading``: closed-loop chat
users against a real ``kvoffload serve`` (through a recording proxy: what the server returned is
what the next turn re-sends), think times by count (a recording sleep, no clock), per-round
accounting, the flags' refusals, and the comparison's table."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import aiohttp
import pytest
from aiohttp import web
from serve_cases import free_port, serve

from kvoffload.cli.flagspec import resolve_flags
from kvoffload.cli.main import build_parser
from kvoffload.servebench.client import RequestResult
from kvoffload.servebench.device_cache import KVOFFLOAD_BLOCK_TOKENS, device_cache_tokens_of
from kvoffload.servebench.offloading import offloading_args
from kvoffload.servebench.server_counters import counters_of
from kvoffload.servebench.sessions import (
    Turn,
    active_context_tokens,
    build_workload,
    round_figures,
    run_users,
    think_times,
)
from kvoffload.servebench.vllm_offloading import kv_bytes_per_token, vllm_serve_args
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
    with serve("--block-size", "32") as server:
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
    # The sizing condition, from the server: 64 blocks of 32 tokens (its /kv_event_sources).
    assert r["device_cache_tokens"] == 64 * 32 and r["active_users"] == 2
    finals = [r["input_lens"][i] + r["output_lens"][i] for i in (2, 5)]  # each user's last turn
    assert max(finals) < r["active_context_tokens"] < sum(finals)  # the system prompt once
    assert r["context_to_device_cache"] == pytest.approx(r["active_context_tokens"] / 2048)
    assert "Active context:" in cli.stdout and "x the device cache of 2,048 tokens" in cli.stdout
    # Where the server's time went: its compute steps covered at least the computed tokens.
    counters = r["server_counters"]
    assert counters["step_s"] > 0 and counters["step_tokens"] >= r["tokens_by_source"]["computed"]
    assert r["first_error"] is None
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
        assert result["server_cpu_s"] > 0
        assert result["server_command"][:4] == [sys.executable, "-m", "kvoffload.cli.main",
                                                "serve"]


def _turn(user: int, rnd: int, prompt: int, output: int, success: bool = True) -> Turn:
    return Turn(user, rnd, [], RequestResult(success=success, prompt_len=prompt,
                                             output_tokens=output))


def test_active_context_counts_each_conversation_at_its_end_and_the_shared_prefix_once() -> None:
    turns = [_turn(0, 0, 50, 10), _turn(0, 1, 90, 10), _turn(1, 0, 60, 10),
             _turn(1, 1, 75, 5), _turn(2, 0, 40, 10), _turn(2, 1, 500, 0, success=False)]
    # Users' ends: 100, 80, 50 (user 2's failed turn held nothing); 20 shared tokens.
    assert active_context_tokens(turns, 3, 20) == 100 + 80 + 50 - 2 * 20
    assert active_context_tokens(turns, 2, 20) == 100 + 80 - 20  # the longest two
    assert active_context_tokens(turns, 1, 20) == 100
    assert active_context_tokens([], 4, 20) == 0


VLLM_CACHE_INFO = (
    '# TYPE vllm:cache_config_info gauge\n'
    'vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="40"} 1.0\n'
)


def test_the_device_cache_is_read_from_vllm_and_kvoffload_metrics() -> None:
    assert device_cache_tokens_of(VLLM_CACHE_INFO) == 40 * 128
    kvoffload = "# TYPE kvoffload_device_blocks gauge\nkvoffload_device_blocks 64.0\n"
    assert device_cache_tokens_of(kvoffload, 32) == 64 * 32
    assert device_cache_tokens_of(kvoffload) == 64 * KVOFFLOAD_BLOCK_TOKENS
    assert device_cache_tokens_of("# TYPE other gauge\nother 1.0\n") is None


def test_the_default_block_size_is_the_engines() -> None:
    from kvoffload.engine.config import EngineConfig

    assert EngineConfig().block_size == KVOFFLOAD_BLOCK_TOKENS


def test_server_counters_read_the_engines_series() -> None:
    text = ("# TYPE kvoffload_serve_step_seconds counter\nkvoffload_serve_step_seconds_total 2.5\n"
            "# TYPE kvoffload_tier_stored_blocks counter\n"
            'kvoffload_tier_stored_blocks_total{tier="host"} 7.0\n'
            'kvoffload_tier_stored_blocks_total{tier="disk"} 3.0\n')
    assert counters_of(text) == {"step_s": 2.5, "tier_stored_blocks_host": 7.0,
                                 "tier_stored_blocks_disk": 3.0}


def _checkpoint(tmp_path, chat_template: str | None = None):
    """A checkpoint directory's config files: the tiny Llama's shape (1 KiB of KV a token)."""
    (tmp_path / "config.json").write_text(json.dumps({
        "num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 64, "torch_dtype": "bfloat16"}))
    config = {"chat_template": chat_template} if chat_template else {}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    return tmp_path


def test_each_vllm_configuration_has_its_flags(tmp_path) -> None:
    from kvoffload.integrations.vllm.tiny_model import KV_BYTES_PER_TOKEN

    model = str(_checkpoint(tmp_path))
    assert kv_bytes_per_token(model) == KV_BYTES_PER_TOKEN == 1024
    flags = resolve_flags(_args("--compare-offloading", "--compare-offloading-server", "vllm",
                                "--model", model, "--num-device-blocks", "8",
                                "--compare-offloading-host-size", "0.01",
                                "--compare-offloading-disk-size", "0.02",
                                "--serve-args", "--max-num-seqs 4"))
    base = ["serve", model, "--host", "127.0.0.1", "--enforce-eager", "--block-size", "128",
            "--kv-cache-memory-bytes", str(8 * 128 * 1024), "--max-model-len", str(7 * 128),
            "--chat-template", "/t.jinja"]

    def transfer(name, disk=None, remote=None, stats=None):
        args = vllm_serve_args(flags, name, disk, remote, "/t.jinja", stats)
        assert args[: len(base)] == base and args[-2:] == ["--max-num-seqs", "4"]
        rest = args[len(base) : -2]
        if not rest:
            return None
        assert rest[0] == "--kv-transfer-config" and len(rest) == 2
        return json.loads(rest[1])

    assert transfer("no_offloading") is None
    spec = {"spec_name": "KVOffloadSpec", "spec_module_path": "kvoffload.integrations.vllm.spec",
            "cpu_bytes_to_use": int(0.01 * 2**30)}
    host = {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
            "kv_connector_extra_config": spec}
    assert transfer("host") == host
    assert transfer("host", stats="/s.json")["kv_connector_extra_config"] == {
        **spec, "kvoffload_stats_file": "/s.json"}
    assert transfer("host_disk", disk="/d")["kv_connector_extra_config"] == {
        **spec, "kvoffload_tiers": [{"kind": "disk", "path": "/d", "size_gib": 0.02}]}
    assert transfer("host_redis", remote="redis://r")["kv_connector_extra_config"] == {
        **spec, "kvoffload_tiers": [{"kind": "redis", "url": "redis://r"}]}


@pytest.mark.parametrize("case", ["preset", "no vllm", "not comparing"])
def test_vllm_comparisons_refuse_what_cannot_run(case, tmp_path, capsys) -> None:
    model = "tiny" if case == "preset" else str(_checkpoint(tmp_path))  # a preset has no config
    flags = ["--model", model, "--compare-offloading-server", "vllm"]
    if case != "not comparing":
        flags += ["--compare-offloading", "--compare-offloading-vllm", "/nonexistent/vllm"]
    args = build_parser(["bench", "serve"]).parse_args(["bench", "serve", *SMALL, *flags])
    assert args.func(args) == 2
    (line,) = capsys.readouterr().err.splitlines()
    expected = {"preset": "config.json", "no vllm": "/nonexistent/vllm",
                "not comparing": "--compare-offloading"}[case]
    assert line.startswith("error: ") and expected in line


def _chunk(delta: dict, finish: str | None = None) -> bytes:
    choice = {"index": 0, "delta": delta, "finish_reason": finish}
    return b"data: " + json.dumps({"choices": [choice]}).encode() + b"\n\n"


async def _answer_of(chunks: list[bytes]):
    """``chat_turn`` against a server (in this loop) that streams ``chunks``, then the usage."""
    from kvoffload.servebench.chat import chat_turn
    from kvoffload.servebench.client import bench_connections

    async def answer(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for chunk in chunks:
            await resp.write(chunk)
        usage = {"choices": [], "usage": {"prompt_tokens": 9, "completion_tokens": 4}}
        await resp.write(b"data: " + json.dumps(usage).encode() + b"\n\ndata: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", answer)
    runner = web.AppRunner(app)
    await runner.setup()
    port = free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    conns = bench_connections(aiohttp.ClientTimeout(total=30))
    try:
        return await chat_turn(conns, f"http://127.0.0.1:{port}", "m",
                               [{"role": "user", "content": "q"}], 4)
    finally:
        await conns.close()
        await runner.cleanup()


def test_an_answer_without_text_is_an_answer() -> None:
    # vLLM with the random tiny Llama: a role chunk, then only the finishing chunk (its tokens
    # decode to no text).
    out = asyncio.run(_answer_of([_chunk({"role": "assistant", "content": ""}),
                                  _chunk({"content": ""}, finish="length")]))
    assert out.success and out.error == "" and out.generated_text == ""
    assert out.output_tokens == 4 and out.prompt_len == 9
    assert out.ttft > 0 and out.latency == out.ttft and out.itl == []
    # With text, TTFT is still the first chunk with content, and the finishing chunk adds none.
    out = asyncio.run(_answer_of([_chunk({"role": "assistant", "content": ""}),
                                  _chunk({"content": "a"}), _chunk({"content": "b"}),
                                  _chunk({}, finish="length")]))
    assert out.success and out.generated_text == "ab" and len(out.itl) == 1
    # Neither text nor a finished choice: no answer.
    out = asyncio.run(_answer_of([_chunk({"role": "assistant", "content": ""})]))
    assert not out.success and out.error == "no token chunk in the stream"


def test_cpu_seconds_count_a_process_and_its_children() -> None:
    from kvoffload.servebench.processes import cpu_seconds

    # A child that burns 0.3 s of its own CPU time (by its clock, not the wall's), says so and
    # waits for its stdin to close.
    burn = ("import sys, time\nwhile time.process_time() < 0.3: pass\n"
            "print('burnt', flush=True)\nsys.stdin.read()")
    own = cpu_seconds(os.getpid())
    assert own is not None and own >= 0
    child = subprocess.Popen([sys.executable, "-c", burn], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline() == "burnt\n"
        mine, theirs = cpu_seconds(os.getpid()), cpu_seconds(child.pid)
        assert theirs is not None and theirs >= 0.3 - 0.05  # /proc counts whole 10 ms ticks
        assert mine is not None and mine >= own + theirs
    finally:
        assert child.stdin is not None
        child.stdin.close()
        child.wait(30)
        if child.stdout is not None:
            child.stdout.close()
    assert cpu_seconds(child.pid) is None  # gone


def test_running_serves_until_the_block_ends() -> None:
    import urllib.error
    import urllib.request

    from kvoffload.servebench.processes import running

    port = free_port()
    serve_args = ["serve", "--model", "tiny", "--num-device-blocks", "8", "--port", str(port)]
    with running(serve_args, port) as url, urllib.request.urlopen(f"{url}/health",
                                                                  timeout=10) as resp:
        assert resp.status == 200
    with pytest.raises(urllib.error.URLError):  # stopped: nothing listens there any more
        urllib.request.urlopen(f"{url}/health", timeout=10)


def test_a_server_that_fails_to_start_is_quoted(tmp_path) -> None:
    from kvoffload.servebench.processes import running_command

    log = str(tmp_path / "server.log")
    cmd = [sys.executable, "-c", "print('no such model'); raise SystemExit(3)"]
    with pytest.raises(RuntimeError, match="exited 3; its last output:\nno such model"), \
            running_command(cmd, dict(os.environ), free_port(), log=log):
        pass

"""``kvoffload bench serve``: vLLM's metric definitions on hand-made timings, and one real run
against a real ``kvoffload serve`` (vLLM's JSON keys, TTFT/TPOT/ITL/E2E consistent per request,
tokens by source equal to what the server's ``/metrics`` counted during the run)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import numpy as np
import pytest
import redis
from serve_cases import metric, serve, stale_keepalive

from kvoffload.benchmark import traces
from kvoffload.benchmark.datasets import BenchRequest
from kvoffload.cli.flagspec import resolve_flags
from kvoffload.cli.main import build_parser
from kvoffload.servebench.client import RequestResult, replay_gaps, run_requests
from kvoffload.servebench.metrics import PERCENTILE_METRICS, parse_goodput, summarize
from kvoffload.servebench.run import build_requests

pytestmark = pytest.mark.timeout(180)

# The keys of `vllm bench serve --save-result` (serving-and-routing.md, section 6) for the
# metrics selected below: always, and per-request ones only with --save-detailed.
VLLM_KEYS = {
    "date", "endpoint_type", "backend", "label", "model_id", "tokenizer_id", "num_prompts",
    "request_rate", "burstiness", "max_concurrency", "duration", "completed", "failed",
    "total_input_tokens", "total_output_tokens", "request_throughput", "request_goodput",
    "output_throughput", "total_token_throughput", "max_output_tokens_per_s",
    "max_concurrent_requests", "rtfx", "latencies", "queue_times",
}
VLLM_DETAILED_KEYS = {"input_lens", "output_lens", "ttfts", "itls", "start_times",
                      "generated_texts", "errors"}

def _stat_keys(metrics: tuple[str, ...], percentiles: tuple[str, ...]) -> set[str]:
    return {f"{s}_{m}_ms" for m in metrics for s in ("mean", "median", "std", *percentiles)}


def _result(start: float, ttft: float, itl: list[float], tokens: int, queue: float = 0.0):
    return RequestResult(True, ttft, ttft + sum(itl), itl, 10, tokens, start, queue)


def test_definitions_are_vllms() -> None:
    results = [
        _result(100.0, 0.2, [0.1, 0.1, 0.1], 4, queue=0.5),  # TPOT 0.1
        _result(100.5, 0.4, [], 1),  # one token: no TPOT, counts as 0 for goodput
        _result(101.2, 0.1, [0.3, 0.3], 3),  # TPOT 0.3
        RequestResult(False, error="HTTP 500"),
    ]
    out = summarize(results, 2.0, [50, 99], ["ttft", "tpot", "e2el", "client_queue_time"],
                    parse_goodput(["ttft:300", "tpot:150"]), max_concurrency=2)
    assert (out["completed"], out["failed"]) == (3, 1)
    assert out["output_lens"] == [4, 1, 3, 0] and out["total_output_tokens"] == 8
    assert out["mean_tpot_ms"] == pytest.approx(200.0)  # (100 + 300) / 2: one-token outputs out
    assert out["mean_ttft_ms"] == pytest.approx(700 / 3)
    assert out["p99_e2el_ms"] == pytest.approx(np.percentile([500, 400, 700], 99))
    assert out["request_goodput"] == pytest.approx(1 / 2.0)  # TTFT 0.4 and TPOT 0.3 miss
    assert out["request_throughput"] == pytest.approx(1.5)
    # One-second buckets from the first send: token chunks at 100.2, .3, .4, .5, .9 | 101.3,
    # .6, .9; requests active in second 0, 0, 1.
    assert out["max_output_tokens_per_s"] == 5 and out["max_concurrent_requests"] == 2
    assert "mean_itl_ms" not in out and "mean_client_queue_time_ms" in out  # only as selected
    assert "mean_e2el_including_client_queue_ms" not in out  # rate inf: no such series
    with pytest.raises(ValueError, match="KEY:MS"):
        parse_goodput(["itl:5"])


def _bench_serve(url: str, output: Path, *flags: str) -> None:
    """``kvoffload bench serve`` (a process of its own) of a prefix_repetition workload of the
    tiny model against ``url``, its JSON result written to ``output``; it must succeed."""
    run = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli.main", "bench", "serve", "--base-url", url,
         "--model", "tiny", "--dataset-name", "prefix_repetition", *flags,
         "--output-json", str(output)],
        capture_output=True, text=True, timeout=150, check=False,
    )
    assert run.returncode == 0, run.stdout + run.stderr


def test_a_run_against_a_real_server(tmp_path) -> None:
    output = tmp_path / "result.json"
    with serve("--kv-offloading-size", "0.01", "--load-policy", "always") as server:
        sources = _sources(server.url)
        queries = metric(server.url, "kvoffload_prefix_cache_queries_total")
        _bench_serve(server.url, output, "--num-prompts", "8", "--prefix-repetition-prefix-len",
                     "64", "--prefix-repetition-suffix-len", "8",
                     "--prefix-repetition-num-prefixes", "2", "--prefix-repetition-output-len",
                     "6", "--request-rate", "40", "--max-concurrency", "3", "--goodput",
                     "ttft:60000", "--metric-percentiles", "50,99", "--save-detailed",
                     "--percentile-metrics", ",".join(PERCENTILE_METRICS))
        tokens_by_source = {k: v - sources.get(k, 0.0) for k, v in _sources(server.url).items()}
        queried = metric(server.url, "kvoffload_prefix_cache_queries_total") - queries
    # the initial test request (one computed prompt token) came before the measured run
    tokens_by_source["computed"] -= 1
    queried -= 1
    r = json.loads(output.read_text())
    assert VLLM_KEYS | VLLM_DETAILED_KEYS | _stat_keys(PERCENTILE_METRICS, ("p50", "p99")) <= set(r)
    assert (r["completed"], r["failed"], r["num_prompts"]) == (8, 0, 8)
    assert r["input_lens"] == [72] * 8 and r["output_lens"] == [6] * 8
    for ttft, itl, latency in zip(r["ttfts"], r["itls"], r["latencies"], strict=True):
        assert 0 < ttft <= latency
        assert ttft + sum(itl) == pytest.approx(latency, abs=1e-6)
    tpots = [(e - t) / 5 for t, e in zip(r["ttfts"], r["latencies"], strict=True)]
    assert r["mean_tpot_ms"] == pytest.approx(1000 * np.mean(tpots))
    assert r["p99_ttft_ms"] == pytest.approx(1000 * np.percentile(r["ttfts"], 99))
    assert r["median_e2el_ms"] == pytest.approx(1000 * np.median(r["latencies"]))
    assert r["mean_itl_ms"] == pytest.approx(1000 * np.mean([g for gaps in r["itls"] for g in gaps]))
    assert r["request_goodput"] == pytest.approx(r["request_throughput"])  # a lax SLO
    assert r["total_output_tokens"] == 48 and r["rtfx"] == 0.0
    # Hit rate by source: what the server counted during the run, every admitted token once.
    assert r["tokens_by_source"] == tokens_by_source
    assert sum(tokens_by_source.values()) == queried >= 8 * 72
    assert tokens_by_source["device"] >= 64  # a prefix came back from the device cache
    assert r["prefix_hit_rate"] == pytest.approx(1 - tokens_by_source["computed"] / queried)


def _args(*flags: str):
    argv = ["bench", "serve", "--model", "tiny", *flags]
    return build_parser(argv).parse_args(argv)


def _resolved(*flags: str):
    return resolve_flags(_args(*flags))


@pytest.mark.parametrize("name", sorted(traces.SUITE))
def test_generated_suite_workloads_read_as_a_trace_file(name: str, tmp_path) -> None:
    """``--generate NAME`` is the suite's trace through the one trace reader: the same requests
    as ``--dataset-path`` of that trace written out; ``--max-prompt-len`` keeps prefixes shared."""
    generated, _ = build_requests(_resolved("--dataset-name", "trace", "--generate", name,
                                        "--num-prompts", "40", "--seed", "3"))
    path = tmp_path / "t.jsonl"
    records = traces.generate(name, 3, 40)
    traces.write(records, path)
    from_file, _ = build_requests(_resolved("--dataset-name", "trace", "--dataset-path", str(path),
                                        "--num-prompts", "40", "--seed", "3"))
    assert generated == from_file and len(generated) == 40
    cut, _ = build_requests(_resolved("--dataset-name", "trace", "--generate", name, "--num-prompts",
                                  "40", "--seed", "3", "--max-prompt-len", "48"))
    for a, ra in zip(cut, records, strict=True):
        for b, rb in zip(cut, records, strict=True):
            shared = 16 * _common(ra["hash_ids"], rb["hash_ids"])  # tokens (a last block is cut)
            m = min(shared, len(a.prompt), len(b.prompt))
            assert a.prompt[:m] == b.prompt[:m]
            assert len(a.prompt) <= 48


def test_trace_timestamps_replay_as_gaps() -> None:
    assert replay_gaps([0.0, 0.5, 0.5, 2.0], 2.0) == [0.0, 1.0, 0.0, 3.0]


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


@pytest.mark.parametrize("flags", [
    ("--dataset-name", "trace"),
    ("--dataset-name", "trace", "--generate", "rag", "--dataset-path", "x.jsonl"),
    ("--dataset-name", "random", "--generate", "rag"),
    ("--dataset-name", "random", "--prefix-repetition-prefix-len", "8"),
    ("--repeats", "3"),  # without --compare-routing
    ("--compare-routing", "2", "--compare-routing-redis-link", "10"),  # without a Redis
    ("--goodput", "ttft=5"),
    ("--percentile-metrics", "ttft,latency"),
    ("--metric-percentiles", "0"),
])
def test_bad_workload_and_metric_flags_are_one_line_errors(flags, capsys) -> None:
    args = _args(*flags)
    assert args.func(args) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("error: ")


def _sources(url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{url}/metrics", timeout=30) as response:
        lines = response.read().decode().splitlines()
    prefix = 'kvoffload_tokens_by_source_total{source="'
    return {
        line[len(prefix) :].split('"', 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in lines if line.startswith(prefix)
    }


def test_a_warmup_pass_is_sent_first_and_left_out_of_the_figures(tmp_path) -> None:
    output = tmp_path / "result.json"
    with serve("--kv-offloading-size", "0.01", "--load-policy", "always") as server:
        _bench_serve(server.url, output, "--num-prompts", "6", "--prefix-repetition-prefix-len",
                     "64", "--prefix-repetition-suffix-len", "8",
                     "--prefix-repetition-num-prefixes", "3", "--prefix-repetition-output-len",
                     "2", "--max-concurrency", "2", "--warmup-pass")
        queried = metric(server.url, "kvoffload_prefix_cache_queries_total")
    r = json.loads(output.read_text())
    assert (r["completed"], r["num_prompts"]) == (6, 6)
    measured = sum(r["tokens_by_source"].values())  # the measured run's tokens only
    assert measured >= 6 * 72 and queried >= measured + 6 * 72  # the warm-up's came first
    # Every prompt was sent once before: its whole prefix (and suffix) is cached; at most the
    # last partial block of each is computed.
    assert r["tokens_by_source"]["computed"] <= 6 * 16


def test_a_kept_alive_connection_closed_by_the_server_fails_no_request() -> None:
    """The server's keep-alive timeout firing as the client reuses a connection (made certain
    by the proxy) is no failed request: the request goes again on a new connection. Before,
    every request after the first failed with a disconnect."""
    requests = [BenchRequest(list(range(1, 40)), 3) for _ in range(4)]
    with serve("--kv-offloading-size", "0.01", "--load-policy", "always", events=False) as server, \
            stale_keepalive(server) as proxy:
        results, _ = asyncio.run(run_requests(proxy.url, "tiny", requests, [0.0] * 4, 1))
    assert [r.error for r in results] == [""] * 4
    assert all(r.success and r.output_tokens == 3 for r in results)


def test_a_redis_link_carries_every_byte_both_ways(redis_server) -> None:
    """``kvoffload.servebench.link`` (bench serve --compare-routing-redis-link): a value written
    through one instance's link reads back whole through another's."""
    port = str(redis_server.port)
    proc = subprocess.Popen([sys.executable, "-m", "kvoffload.servebench.link", port, "50", "2"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        ports = proc.stdout.readline().split()
        assert len(ports) == 2
        a, b = (redis.Redis.from_url(redis_server.url.replace(f":{port}/", f":{p}/"))
                for p in ports)
        value = os.urandom(300_000)
        with a, b:
            a.set("link-test", value)
            assert b.get("link-test") == value
            a.delete("link-test")
    finally:
        proc.kill()
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()

"""``kvoffload bench throughput`` in-process, on the tiny preset: every dataset with ``--compare``
prints vLLM's summary lines, the offloading summary and the comparison table, and writes three
results with identical token counts; bad flags exit with code 2 and name the field."""

from __future__ import annotations

import json
import re
import socket
from pathlib import Path
from typing import Any

import pytest
from engine_cases import one_thread  # noqa: F401 - autouse fixture

from kvoffload.cli.main import main

#: The shared Mooncake trace, ``../shared/traces/`` from the repository root (where CI lays it).
CONVERSATION_TRACE = (
    Path(__file__).resolve().parents[2] / "shared" / "traces" / "conversation_trace.jsonl"
)

COMMON = [
    "bench", "throughput", "--model", "tiny", "--block-size", "4", "--max-num-seqs", "4",
    "--kv-offloading-size", "0.001", "--no-progress",
]  # fmt: skip
#: The tests of what loads bring load every hit (the tiny model computes faster than a step).
LOAD_ALL = ["--load-policy", "always"]
THROUGHPUT = re.compile(
    r"^Throughput: [\d.]+ requests/s, [\d.]+ total tokens/s, [\d.]+ output tokens/s$", re.M
)
LABELS = ["no offloading", "offloading", "unlimited device cache"]
DISK_LINE = r"^Disk tier: \d+ blocks written, \d+ failed writes(?: \(.*\))?, \d+ promoted"


def _mooncake(path: Path) -> Path:
    """Five requests: two conversations whose turns share a growing prefix, plus a stranger."""
    records = [
        {"timestamp": 0, "input_length": 1100, "output_length": 3, "hash_ids": [0, 1, 2]},
        {"timestamp": 1, "input_length": 1400, "output_length": 5, "hash_ids": [0, 1, 2]},
        {"timestamp": 2, "input_length": 2000, "output_length": 2, "hash_ids": [0, 1, 2, 3]},
        {"timestamp": 3, "input_length": 700, "output_length": 4, "hash_ids": [9, 10]},
        {"timestamp": 4, "input_length": 2500, "output_length": 1, "hash_ids": [0, 1, 2, 3, 4]},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _dataset_args(name: str, tmp_path: Path) -> tuple[list[str], int]:
    """Flags of one dataset, and its number of requests."""
    if name == "random":
        return ["--dataset-name", "random", "--num-prompts", "6", "--random-input-len", "24",
                "--output-len", "3", "--num-device-blocks", "24"], 6  # fmt: skip
    if name == "prefix_repetition":
        return ["--dataset-name", "prefix_repetition", "--num-prompts", "9",
                "--prefix-repetition-prefix-len", "32", "--prefix-repetition-suffix-len", "4",
                "--prefix-repetition-num-prefixes", "3", "--output-len", "3",
                "--num-device-blocks", "24",
                # arrival order: the prefixes cycle through the host tier (cache-aware order
                # runs each prefix's requests together, from the device cache)
                "--scheduling-policy", "fcfs"], 9  # fmt: skip
    if name == "multi_turn":
        return ["--dataset-name", "multi_turn", "--num-prompts", "6", "--multi-turn-num-sessions", "2",
                "--multi-turn-system-len", "16", "--multi-turn-turn-len", "8", "--output-len", "3",
                "--num-device-blocks", "32"], 6  # fmt: skip
    if name == "trace":
        return ["--dataset-name", "trace", "--dataset-path", str(_mooncake(tmp_path / "t.jsonl")),
                "--trace-block-size", "4", "--num-prompts", "5", "--num-device-blocks", "24"], 5  # fmt: skip
    assert name == "conversation_trace"
    return ["--dataset-name", "trace", "--dataset-path", str(CONVERSATION_TRACE),
            "--trace-block-size", "2", "--num-prompts", "20", "--output-len", "2",
            "--num-device-blocks", "128"], 20  # fmt: skip


@pytest.mark.parametrize(
    "dataset", ["random", "prefix_repetition", "multi_turn", "trace", "conversation_trace"]
)
def test_compare_on_every_dataset(
    dataset: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    if dataset == "conversation_trace" and not CONVERSATION_TRACE.is_file():
        pytest.skip(f"{CONVERSATION_TRACE} is not here")
    args, num_requests = _dataset_args(dataset, tmp_path)
    out_json = tmp_path / "out.json"
    assert main([*COMMON, *LOAD_ALL, *args, "--compare", "--output-json", str(out_json)]) == 0
    stdout, stderr = capsys.readouterr()
    assert "Traceback" not in stderr
    assert [f"== {label} ==" for label in LABELS] == re.findall(
        r"^== (?!comparison).* ==$", stdout, re.M
    )
    assert len(THROUGHPUT.findall(stdout)) == 3
    assert len(re.findall(r"^Total num prompt tokens:\s+\d+$", stdout, re.M)) == 3
    assert len(re.findall(r"^Total num output tokens:\s+\d+$", stdout, re.M)) == 3
    assert (
        len(re.findall(r"^Offloading: stored \d+ blocks .* loaded \d+ blocks", stdout, re.M)) == 1
    )
    assert len(re.findall(r"^Offloaded tier: \d+ evictions", stdout, re.M)) == 1
    table = stdout.split("== comparison ==", 1)[1]
    for row in (
        "requests/s",
        "total tokens/s",
        "output tokens/s",
        "tokens from host tier",
        "p99 TTFT ms",
    ):
        assert re.search(rf"^{row}\s", table, re.M), row
    assert "offloading: " in table and "x the throughput of no offloading" in table

    results = json.loads(out_json.read_text())["results"]
    assert [r["label"] for r in results] == LABELS
    assert all(r["num_requests"] == num_requests for r in results)
    for field in ("prompt_tokens", "output_tokens"):
        assert len({r[field] for r in results}) == 1, field
        assert re.search(
            rf"^Total num {field.split('_')[0]} tokens:\s+{results[0][field]}$", stdout, re.M
        )
    assert results[0]["tokens_host"] == results[2]["tokens_host"] == 0
    for r in results:  # vLLM's keys, latency percentiles, tokens by source adding up
        for key in ("elapsed_time", "num_requests", "total_num_tokens", "requests_per_second",
                    "tokens_per_second", "mean_ttft_ms", "median_ttft_ms", "p99_ttft_ms",
                    "mean_itl_ms", "median_itl_ms", "p99_itl_ms"):  # fmt: skip
            assert isinstance(r[key], (int, float)), key
        assert r["p99_ttft_ms"] >= r["median_ttft_ms"] > 0
    for run in json.loads(out_json.read_text())["all_runs"]:
        assert sum(run["tokens_by_source"].values()) == run["stats"]["prefix_cache_queries"]
        assert run["stats"]["device_blocks"] == run["num_device_blocks"] > 0  # gauges not zeroed
    if dataset == "random":
        assert results[0]["prompt_tokens"] == 6 * 24 and results[0]["output_tokens"] == 6 * 3
    if dataset == "prefix_repetition":  # 3 x 8-block prefixes do not fit 24 device blocks
        assert results[1]["tokens_host"] > 0
        assert results[1]["external_hit_rate_pct"] > 0
        (run,) = [
            r for r in json.loads(out_json.read_text())["all_runs"] if r["label"] == "offloading"
        ]
        assert run["stats"]["offload_loaded_blocks"] > 0
        assert run["stats"]["offload_tier_capacity_blocks"] > 0


def test_compare_with_a_disk_tier(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A host tier of 12 blocks in front of a disk tier: an extra row whose blocks reach the
    disk, and each run's fresh directory is removed afterwards."""
    args, _ = _dataset_args("prefix_repetition", tmp_path)
    disk = tmp_path / "disk"
    out_json = tmp_path / "out.json"
    flags = [*COMMON, *args, "--kv-offloading-size", str(12 * 2048 / 2**30),
             "--kv-disk-path", str(disk), "--kv-disk-size", "0.01", "--compare",
             "--output-json", str(out_json)]  # fmt: skip
    assert main(flags) == 0
    stdout, _ = capsys.readouterr()
    labels = ["no offloading", "offloading", "offloading + disk", "unlimited device cache"]
    assert [f"== {label} ==" for label in labels] == re.findall(
        r"^== (?!comparison).* ==$", stdout, re.M
    )
    assert len(re.findall(DISK_LINE, stdout, re.M)) == 1
    assert len(re.findall(r"^Disk tier in .*/run-\w+: started empty$", stdout, re.M)) == 1
    payload = json.loads(out_json.read_text())
    runs = payload["all_runs"]
    assert [r["label"] for r in runs] == labels
    # Host + disk is also compared with host alone, in the table and the JSON.
    assert re.search(r"^offloading \+ disk: .* of unlimited device cache, [\d.]+x offloading$",
                     stdout, re.M)  # fmt: skip
    pairs = [(r["config"], r["against"]) for r in payload["throughput_ratios"]]
    assert ("offloading + disk", "offloading") in pairs
    # Blocks reached the disk (whether later requests find them there first depends on timing).
    assert runs[2]["stats"]["offload_tier_disk_stored_blocks"] > 0
    assert runs[2]["output_tokens"] == runs[1]["output_tokens"]
    assert list(disk.iterdir()) == []


def test_a_warm_disk_directory_serves_the_next_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Two runs without --compare on one disk directory: the second promotes what the first
    wrote. One request at a time, so the second run's first request looks up its prefix alone,
    finds it on disk only, and its promotion finds the host's slots free or evictable (the
    warm-up was drained): promotions whatever the timing of the copy and I/O threads."""
    args, _ = _dataset_args("prefix_repetition", tmp_path)
    disk = tmp_path / "disk"
    # A request waits for its promotion however slow the I/O threads are on a loaded machine.
    flags = [*COMMON, *args, "--max-num-seqs", "1", "--kv-offloading-size",
             str(12 * 2048 / 2**30), "--kv-disk-path", str(disk), "--kv-disk-size", "0.01",
             "--kv-lookup-retry-s", "600"]  # fmt: skip
    results = []
    for run in ("first", "second"):
        out_json = tmp_path / f"{run}.json"
        assert main([*flags, "--output-json", str(out_json)]) == 0
        (result,) = json.loads(out_json.read_text())["all_runs"]
        assert result["label"] == "offloading + disk"
        results.append(result["stats"])
    stdout, _ = capsys.readouterr()
    assert len(re.findall(DISK_LINE, stdout, re.M)) == 2
    first, second = results
    # The warm restart is visible: the second run found the first one's blocks on disk.
    assert first["offload_tier_disk_scanned_blocks"] == 0
    found = second["offload_tier_disk_scanned_blocks"]
    assert found == first["offload_tier_disk_used_blocks"] > 0  # all it left there
    assert f"Disk tier in {disk}: started empty" in stdout
    assert f"Disk tier in {disk}: warm start, {found} blocks found on disk (scan " in stdout
    assert first["offload_tier_disk_stored_blocks"] > 0
    assert second["offload_tier_promoted_blocks"] > 0
    assert second["offload_tier_disk_loaded_blocks"] == second["offload_tier_promoted_blocks"]
    assert second["offload_tier_disk_failed_load_blocks"] == 0
    assert any(disk.rglob("*.kvb"))  # without --compare the directory is kept


def test_with_kv_events(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Events published over ZMQ during the benchmark (no subscriber) change nothing it reports."""
    args, _ = _dataset_args("prefix_repetition", tmp_path)
    config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": "tcp://127.0.0.1:*"}
    out_json = tmp_path / "out.json"
    argv = [
        *COMMON,
        *args,
        "--kv-events-config",
        json.dumps(config),
        "--output-json",
        str(out_json),
    ]
    assert main(argv) == 0
    assert len(THROUGHPUT.findall(capsys.readouterr().out)) == 1
    (result,) = json.loads(out_json.read_text())["results"]
    assert result["label"] == "offloading" and result["tokens_host"] > 0


SMALL_RANDOM = ["--dataset-name", "random", "--num-prompts", "2", "--random-input-len", "8",
                "--output-len", "2"]  # fmt: skip
# Values of the wrong kind or range (negative, zero, NaN, inf, huge, not a number) are usage
# errors of the flag itself: tests/test_input_validation.py tries every flag. Here: settings
# that only the command's checks, before anything runs, can refuse.
BAD_FLAGS = {
    "missing dataset path": (["--dataset-name", "trace"], "dataset_path"),
    "dataset path without trace": (["--dataset-path", __file__], "dataset_path"),
    "not a trace": (["--dataset-name", "trace", "--dataset-path", __file__], "dataset_path"),
    "bad events JSON": (["--kv-events-config", "{not json"], "kv_events_config"),
    "unknown events field": (
        ["--kv-events-config", '{"enable_kv_cache_events": true, "colour": 1}'],
        "colour",
    ),
    "disk path is a file": (["--kv-disk-path", __file__, "--kv-disk-size", "1"], "kv_disk_path"),
    "disk path without its size": (["--kv-disk-path", str(Path(__file__).parent)], "kv_disk_size"),
    # every run's configuration is checked before the first run starts
    "missing model directory": (["--model", "/nonexistent/model"], "model"),
    "bad events endpoint": (
        ["--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": "http://x"}'],
        "endpoint",
    ),
    "output into a missing directory": (
        ["--output-json", "/nonexistent/dir/out.json"],
        "output_json",
    ),
    "output onto a directory": (["--output-json", "/"], "output_json"),
    # --instances 2: engine B needs shared prefixes and the remote tier, nothing else
    "two instances, no shared prefix": (["--instances", "2"], "random_prefix_len"),
    "two instances on multi_turn": (
        ["--instances", "2", "--dataset-name", "multi_turn"],
        "dataset_name",
    ),
    "two instances without a host tier": (
        ["--instances", "2", "--random-prefix-len", "8", "--kv-offloading-size", "0"],
        "kv_offloading_size",
    ),
    "two instances with a disk tier": (
        [
            "--instances",
            "2",
            "--random-prefix-len",
            "8",
            "--kv-disk-path",
            str(Path(__file__).parent),
            "--kv-disk-size",
            "1",
        ],
        "kv_disk_path",
    ),
    "two instances, remote optional": (
        ["--instances", "2", "--random-prefix-len", "8", "--kv-remote-optional"],
        "kv_remote_optional",
    ),
}


def _refused_before_running(
    argv: list[str], field: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(argv) == 2
    stdout, stderr = capsys.readouterr()
    assert stderr.startswith(f"error: {field}: "), stderr
    assert "Traceback" not in stderr
    assert "Throughput:" not in stdout  # refused before anything ran


@pytest.mark.parametrize("case", sorted(BAD_FLAGS))
def test_bad_flags_exit_2_naming_the_field(case: str, capsys: pytest.CaptureFixture[str]) -> None:
    flags, field = BAD_FLAGS[case]
    workload = [] if "--dataset-name" in flags else SMALL_RANDOM  # (a dataset's own flags)
    _refused_before_running([*COMMON, *workload, *flags], field, capsys)


@pytest.mark.parametrize(
    ("line", "why"),
    [
        (b'{"hash_ids": [1e400]}\n', "hash_ids must be non-negative integers"),
        (b'{"hash_ids": [1], "input_length": 1e400}\n', "input_length must be"),
        (b'{"hash_ids": [1], "output_length": true}\n', "output_length must be"),
        (b'{"hash_ids": [2.5]}\n', "hash_ids must be"),
        (b"[1, 2]\n", "an object with a hash_ids list"),
        (b'{"hash_ids": [1]}\n\xff\xfe\n', "not UTF-8"),
    ],
)
def test_malformed_traces_are_refused_naming_the_line(
    line: bytes, why: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(line)
    argv = [*COMMON, "--dataset-name", "trace", "--dataset-path", str(trace)]
    assert main(argv) == 2
    stdout, stderr = capsys.readouterr()
    assert stderr.startswith("error: dataset_path: ") and why in stderr, stderr
    assert "Throughput:" not in stdout


@pytest.mark.parametrize(
    "flag",
    [
        "--dataset-name",
        "--eviction-policy",
        "--store-policy",
        "--kv-offloading-backend",
        "--kv-tier-cascade",
    ],
)
def test_unknown_choice_is_an_argparse_error(flag: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*COMMON, flag, "nope"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {flag}: invalid choice: 'nope'" in err


def test_repeats_interleave_and_report_median_and_spread(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "out.json"
    argv = [*COMMON, *SMALL_RANDOM, "--compare", "--repeats", "3", "--output-json", str(out_json)]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert [
        m.group(1) for m in re.finditer(r"^== (.+) \(repeat \d/3\) ==$", stdout, re.M)
    ] == LABELS * 3
    assert "median [min-max] of 3 interleaved repeats" in stdout
    payload = json.loads(out_json.read_text())
    assert [r["label"] for r in payload["all_runs"]] == LABELS * 3
    for result in payload["results"]:
        same = sorted(r["elapsed_s"] for r in payload["all_runs"] if r["label"] == result["label"])
        assert result["repeats"] == 3
        assert result["elapsed_s"] == same[1]  # the median, not the best
        assert result["spread"]["elapsed_s"] == [same[0], same[2]]
        assert result["elapsed_time"] == result["elapsed_s"]
    ratios = {(r["config"], r["against"]): r for r in payload["throughput_ratios"]}
    assert set(ratios) == {
        ("offloading", "no offloading"),
        ("unlimited device cache", "no offloading"),
        ("offloading", "unlimited device cache"),
    }
    for r in ratios.values():
        assert r["min"] <= r["median"] <= r["max"]
        assert r["inconclusive"] == (r["min"] < 1 < r["max"])
        assert (
            f"Cannot conclude whether {r['config']} is faster than {r['against']}" in stdout
        ) == r["inconclusive"]


def test_plot_writes_a_png_that_opens(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from PIL import Image

    args, _ = _dataset_args("prefix_repetition", tmp_path)
    png = tmp_path / "compare.png"
    assert main([*COMMON, *args, "--compare", "--plot", str(png)]) == 0
    assert f"plot written to {png}" in capsys.readouterr().out
    with Image.open(png) as image:
        assert image.format == "PNG"
        image.load()  # decodes every pixel: a truncated file raises
        assert image.size[0] > 400 and image.size[1] > 200


def test_unknown_flag_prints_the_subcommands_usage(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*COMMON, *SMALL_RANDOM, "--no-such-flag"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvoffload bench throughput ")
    assert "unrecognized arguments: --no-such-flag" in err


def test_help_shows_defaults_and_choices_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["bench", "throughput", "--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "{adaptive,arc,lru,prefix,s3fifo}" in text and "(default: adaptive)" in text
    assert "{on_compute,on_finish,prompt_only}" in text and "(default: on_compute)" in text
    assert "--no-enable-prefix-caching" in text
    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert re.match(r"kvoffload \d+\.\d+", capsys.readouterr().out)


def test_vllm_dataset_flags_and_no_prefix_caching(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """vLLM's meanings: --input-len / --random-output-len size random requests, a shared
    --random-prefix-len is found in the device cache unless it is off."""
    out_json = tmp_path / "out.json"
    flags = ["--dataset-name", "random", "--num-prompts", "4", "--input-len", "20",
             "--random-output-len", "2", "--random-prefix-len", "16", "--num-device-blocks", "64",
             "--kv-offloading-size", "0", "--max-num-seqs", "1", "--output-json", str(out_json)]  # fmt: skip
    assert main([*COMMON[:-3], "--no-progress", *flags]) == 0
    stdout = capsys.readouterr().out
    assert stdout.startswith(
        "Workload: model tiny, 4 random requests (36-36 prompt tokens, 2-2 output"
    )
    (on,) = json.loads(out_json.read_text())["results"]
    assert on["prompt_tokens"] == 4 * 36 and on["output_tokens"] == 4 * 2
    assert on["tokens_device"] > 0 and on["prefix_cache_hit_rate_pct"] > 0
    assert main([*COMMON[:-3], "--no-progress", *flags, "--no-enable-prefix-caching"]) == 0
    assert "device prefix cache off" in capsys.readouterr().out
    (off,) = json.loads(out_json.read_text())["results"]
    assert off["tokens_device"] == 0 and off["tokens_computed"] == off["prompt_tokens"]


def test_trace_replay_says_what_it_rescaled_and_honors_timestamps(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args, _ = _dataset_args("trace", tmp_path)
    assert main([*COMMON, *args]) == 0
    assert "timestamps ignored" in capsys.readouterr().out
    out_json = tmp_path / "out.json"
    argv = [*COMMON, *args, "--output-len", "2", "--honor-timestamps", "--timestamp-scale", "50",
            "--output-json", str(out_json)]  # fmt: skip
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert "each 512-token hash block is 4 tokens" in stdout
    assert "output lengths capped at 2" in stdout
    assert "arrival times from the trace x 50 (last request at 0.2 s)" in stdout
    (result,) = json.loads(out_json.read_text())["results"]
    assert result["num_requests"] == 5
    # the last request arrives 4 ms x 50 after the first: the run cannot end before it
    assert result["elapsed_s"] >= 0.2


def test_with_a_remote_tier(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], redis_server: Any
) -> None:
    """--kv-remote-url joins the offloading run: its blocks go to Redis (the password-free URL
    of the session's test server)."""
    args, _ = _dataset_args("prefix_repetition", tmp_path)
    out_json = tmp_path / "out.json"
    flags = [*COMMON, *args, "--kv-remote-url", redis_server.url, "--output-json", str(out_json)]
    assert main(flags) == 0
    runs = json.loads(out_json.read_text())["all_runs"]
    assert [r["label"] for r in runs] == ["offloading + remote"]
    assert runs[0]["stats"]["offload_tier_remote_stored_blocks"] > 0
    assert main([*COMMON, *args, "--kv-remote-ttl-s", "5"]) == 2  # a TTL without a URL
    assert "kv_remote_ttl_s" in capsys.readouterr().err


def test_compare_repeats_start_every_remote_run_from_an_empty_namespace(
    tmp_path: Path, redis_server: Any
) -> None:
    """--compare --repeats 2 on a given server that already holds this workload's blocks (a
    first run stored them): no remote run finds a block it did not store itself (each gets a
    fresh namespace; the host tier holds the whole workload, so a remote hit could only be an
    earlier run's block); afterwards the server holds exactly its earlier keys (the fresh
    namespaces are removed, nothing else is touched). Lookups wait long enough that any block on
    the server would be found."""
    args, _ = _dataset_args("prefix_repetition", tmp_path)
    with redis_server.client() as c:
        c.flushall()
    wait = ["--kv-remote-lookup-wait-s", "60", "--kv-lookup-retry-s", "60"]
    assert main([*COMMON, *args, *wait, "--kv-remote-url", redis_server.url]) == 0
    with redis_server.client() as c:
        before = set(c.keys("kvo:*"))
    assert before
    out_json = tmp_path / "out.json"
    argv = [*COMMON, *args, *wait, "--kv-remote-url", redis_server.url, "--compare",
            "--repeats", "2", "--output-json", str(out_json)]  # fmt: skip
    assert main(argv) == 0
    remote_runs = [
        r
        for r in json.loads(out_json.read_text())["all_runs"]
        if r["label"] == "offloading + remote"
    ]
    assert len(remote_runs) == 2
    for run in remote_runs:
        assert run["stats"]["offload_tier_remote_stored_blocks"] > 0
        assert run["tokens_by_source"].get("remote", 0) == 0
    with redis_server.client() as c:
        assert set(c.keys("*")) == before


def test_two_instances_share_prefixes_through_redis(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--instances 2 without a URL: a redis-server is started (and stopped); engine A, in its own
    process, stores the prefixes; engines B load them from Redis for fresh requests on them
    (remote hits > 0), against B recomputing them, interleaved; the ratio is printed and kept.
    Generous lookup waits, so the hits do not depend on how fast the server answers."""
    args, num_requests = _dataset_args("prefix_repetition", tmp_path)
    out_json = tmp_path / "out.json"
    argv = [*COMMON, *LOAD_ALL, *args, "--instances", "2", "--repeats", "2", "--output-json", str(out_json),
            "--kv-remote-lookup-wait-s", "60", "--kv-lookup-retry-s", "60"]  # fmt: skip
    assert main(argv) == 0
    stdout, stderr = capsys.readouterr()
    assert "Traceback" not in stderr
    labels = ["no offloading", "offloading + remote"]
    assert [
        m.group(1) for m in re.finditer(r"^== (.+) \(repeat \d/2\) ==$", stdout, re.M)
    ] == labels * 2
    title = "== engine B on engine A's prefixes, median [min-max] of 2 interleaved repeats =="
    assert title in stdout
    ratio = r"^offloading \+ remote: [\d.]+x .*the throughput of no offloading"
    assert re.search(ratio, stdout, re.M)
    payload = json.loads(out_json.read_text())
    engine_a = payload["engine_a"]
    assert engine_a["stats"]["offload_tier_remote_stored_blocks"] > 0
    assert engine_a["num_requests"] == num_requests
    for run in payload["all_runs"]:
        assert run["num_requests"] == num_requests
        if run["label"] == "offloading + remote":
            assert run["tokens_by_source"]["remote"] > 0
            assert run["stats"]["offload_tier_remote_loaded_blocks"] > 0
        else:
            assert run["stats"].get("offload_tier_remote_loaded_blocks", 0) == 0
    assert [(r["config"], r["against"]) for r in payload["throughput_ratios"]] == [
        ("offloading + remote", "no offloading")
    ]
    started = re.search(r"Started redis-server on 127\.0\.0\.1:(\d+)", stdout)
    assert started is not None, stdout
    port = int(started.group(1))
    with socket.socket() as s:  # stopped at the end
        assert s.connect_ex(("127.0.0.1", port)) != 0


def test_two_instances_with_compare_on_a_given_server(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], redis_server: Any
) -> None:
    """--instances 2 --compare on --kv-remote-url: engine B also runs with its host tier only
    and with an unlimited device cache; the given server is used (and left running)."""
    args, _ = _dataset_args("prefix_repetition", tmp_path)
    with redis_server.client() as c:
        c.flushall()
    out_json = tmp_path / "out.json"
    argv = [*COMMON, *LOAD_ALL, *args, "--instances", "2", "--compare",
            "--kv-remote-url", redis_server.url,
            "--output-json", str(out_json), "--kv-remote-lookup-wait-s", "60",
            "--kv-lookup-retry-s", "60"]  # fmt: skip
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert "Started redis-server" not in stdout
    payload = json.loads(out_json.read_text())
    assert [r["label"] for r in payload["all_runs"]] == [
        "no offloading", "offloading", "offloading + remote", "unlimited device cache"
    ]  # fmt: skip
    by_label = {r["label"]: r for r in payload["all_runs"]}
    assert by_label["offloading + remote"]["tokens_by_source"]["remote"] > 0
    assert by_label["offloading"]["tokens_by_source"].get("remote", 0) == 0
    with redis_server.client() as c:  # A's blocks, and the fresh suffixes B stored
        assert c.dbsize() > payload["engine_a"]["stats"]["offload_tier_remote_stored_blocks"] > 0


def test_two_instances_on_a_server_that_is_down_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Engine A's ConfigError crosses its process boundary: exit 2 naming kv_remote_url, the
    password hidden, no traceback."""
    from redis_servers import free_port

    args, _ = _dataset_args("prefix_repetition", tmp_path)
    url = f"redis://:hunter2-secret@127.0.0.1:{free_port()}/0"
    assert main([*COMMON, *args, "--instances", "2", "--kv-remote-url", url]) == 2
    stdout, stderr = capsys.readouterr()
    assert stderr.startswith("error: kv_remote_url: cannot reach redis://:***@127.0.0.1:"), stderr
    assert "hunter2-secret" not in stdout + stderr and "Traceback" not in stderr


def test_output_json_never_holds_the_remote_password(tmp_path: Path) -> None:
    from redis_servers import standalone_server

    args, _ = _dataset_args("prefix_repetition", tmp_path)
    out_json = tmp_path / "out.json"
    with standalone_server(password="hunter2-secret") as server:
        argv = [*COMMON, *args, "--kv-remote-url", server.url, "--output-json", str(out_json)]
        assert main(argv) == 0
    text = out_json.read_text()
    assert "hunter2-secret" not in text
    assert json.loads(text)["args"]["kv_remote_url"] == f"redis://:***@127.0.0.1:{server.port}/0"


def test_dataset_variants_keep_the_prefixes_and_draw_new_suffixes() -> None:
    """What --instances 2 gives its engines B: variant 0 is the workload as always; another
    variant has the same shared prefixes, lengths and order, and suffixes of its own."""
    from kvoffload.benchmark import datasets

    common = {"vocab_size": 1000, "eos_token_id": 2, "seed": 5}
    base = datasets.prefix_repetition(12, 40, 8, 3, 4, **common)
    assert base == datasets.prefix_repetition(12, 40, 8, 3, 4, **common, variant=0)
    for variant in (1, 2):
        other = datasets.prefix_repetition(12, 40, 8, 3, 4, **common, variant=variant)
        assert [r.prompt[:40] for r in other] == [r.prompt[:40] for r in base]
        assert all(o.prompt[40:] != b.prompt[40:] for o, b in zip(other, base, strict=True))
    rand = datasets.random_prompts(6, 10, 3, **common, prefix_len=16, range_ratio=0.5)
    fresh = datasets.random_prompts(6, 10, 3, **common, prefix_len=16, range_ratio=0.5, variant=1)
    assert [len(r.prompt) for r in fresh] == [len(r.prompt) for r in rand]
    assert all(f.prompt[:16] == r.prompt[:16] != [] for f, r in zip(fresh, rand, strict=True))
    assert all(f.prompt[16:] != r.prompt[16:] for f, r in zip(fresh, rand, strict=True))


def test_served_metrics_count_the_measured_requests_only() -> None:
    """``/metrics`` scraped when the last request has finished counts what the summary counts,
    not the warm-up request too (its TTFT count was one more than the prompts)."""
    import urllib.request

    from redis_servers import free_port

    from kvoffload.benchmark.datasets import prefix_repetition
    from kvoffload.benchmark.throughput import run_throughput
    from kvoffload.engine.loader import load_model_config

    port = free_port()
    scraped: list[str] = []

    class ScrapeWhenDone:
        def update(self, n: int) -> None:
            pass

        def close(self) -> None:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as r:
                scraped.append(r.read().decode())

    model = load_model_config("tiny")
    requests = prefix_repetition(6, 16, 4, 2, 3, model.vocab_size, model.eos_token_id, seed=0)
    kwargs = {"model": "tiny", "block_size": 4, "num_device_blocks": 32,
              "kv_offloading_size": 0.001, "metrics_port": port}  # fmt: skip
    result = run_throughput(requests, "x", kwargs, lambda total, label: ScrapeWhenDone())
    (text,) = scraped

    def served(name: str) -> float:
        line = re.search(rf"^{name} (\S+)$", text, re.M)
        assert line is not None, name
        return float(line.group(1))

    assert served("kvoffload_time_to_first_token_seconds_count") == len(requests) == 6
    assert served("kvoffload_generation_tokens_total") == result.output_tokens
    assert served("kvoffload_prompt_tokens_total") == result.prompt_tokens
    sources = result.tokens_by_source
    for source in ("computed", "device", "host"):
        assert served(f'kvoffload_tokens_by_source_total{{source="{source}"}}') == sources[source]


def test_failed_disk_writes_are_counted_in_the_summary() -> None:
    """A full disk's failed writes are in the disk tier's line, by cause (it said "0 failed")."""
    from kvoffload.benchmark.report import format_result
    from kvoffload.benchmark.throughput import ThroughputResult

    stats: dict[str, float] = {
        "offload_tier_disk_stored_blocks": 40, "offload_tier_disk_failed_store_blocks": 9,
        "offload_tier_disk_failed_store_full": 9, "offload_tier_disk_failed_store_io": 0,
        "offload_tier_disk_scanned_blocks": 0, "offload_tier_promoted_blocks": 3,
        "offload_tier_failed_promotion_blocks": 0, "offload_tier_refused_promotion_blocks": 0,
        "offload_tier_disk_evicted_blocks": 0, "offload_retries": 2,
    }  # fmt: skip
    result = ThroughputResult("x", 1, 1.0, 1, 10, 2, 8, {}, stats, disk_path="/d")
    latencies = {f"{s}_{n}_ms": 1.0 for s in ("mean", "median", "p99") for n in ("ttft", "itl")}
    result.latencies = latencies
    lines = format_result(result).splitlines()
    assert "Disk tier in /d: started empty" in lines
    assert (
        "Disk tier: 40 blocks written, 9 failed writes (9 no space left), 3 promoted to the host "
        "tier (0 failed, 0 refused), 0 evictions, 2 deferred lookups"
    ) in lines

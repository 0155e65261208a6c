"""``kvoffload bench throughput`` in-process, on the tiny preset: every dataset with ``--compare``
prints vLLM's summary lines, the offloading summary and the comparison table, and writes three
results with identical token counts; bad flags exit with code 2 and name the field."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from engine_cases import one_thread  # noqa: F401 - autouse fixture

from kvoffload.cli.main import main

CONVERSATION_TRACE = Path("/work/shared/traces/conversation_trace.jsonl")

COMMON = [
    "bench", "throughput", "--model", "tiny", "--block-size", "4", "--max-num-seqs", "4",
    "--kv-offloading-size", "0.001", "--no-progress",
]  # fmt: skip
THROUGHPUT = re.compile(
    r"^Throughput: [\d.]+ requests/s, [\d.]+ total tokens/s, [\d.]+ output tokens/s$", re.M
)
LABELS = ["no offloading", "offloading", "unlimited device cache"]


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
                "--num-device-blocks", "24"], 9  # fmt: skip
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
    assert main([*COMMON, *args, "--compare", "--output-json", str(out_json)]) == 0
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
    for row in ("requests/s", "total tokens/s", "output tokens/s", "offloaded-tier hit tokens"):
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
    assert results[0]["cached_tokens_offload"] == results[2]["cached_tokens_offload"] == 0
    if dataset == "random":
        assert results[0]["prompt_tokens"] == 6 * 24 and results[0]["output_tokens"] == 6 * 3
    if dataset == "prefix_repetition":  # 3 x 8-block prefixes do not fit 24 device blocks
        assert results[1]["cached_tokens_offload"] > 0
        assert results[1]["stats"]["offload_loaded_blocks"] > 0


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
    assert len(re.findall(r"^Disk tier: \d+ blocks written, \d+ promoted", stdout, re.M)) == 1
    results = json.loads(out_json.read_text())["results"]
    assert [r["label"] for r in results] == labels
    # Blocks reached the disk (whether later requests find them there first depends on timing).
    assert results[2]["stats"]["offload_tier_disk_stored_blocks"] > 0
    assert results[2]["output_tokens"] == results[1]["output_tokens"]
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
    flags = [*COMMON, *args, "--max-num-seqs", "1", "--kv-offloading-size",
             str(12 * 2048 / 2**30), "--kv-disk-path", str(disk), "--kv-disk-size", "0.01"]  # fmt: skip
    results = []
    for run in ("first", "second"):
        out_json = tmp_path / f"{run}.json"
        assert main([*flags, "--output-json", str(out_json)]) == 0
        (result,) = json.loads(out_json.read_text())["results"]
        assert result["label"] == "offloading + disk"
        results.append(result["stats"])
    stdout, _ = capsys.readouterr()
    assert len(re.findall(r"^Disk tier: \d+ blocks written, \d+ promoted", stdout, re.M)) == 2
    first, second = results
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
    assert result["label"] == "offloading" and result["cached_tokens_offload"] > 0


SMALL_RANDOM = ["--dataset-name", "random", "--num-prompts", "2", "--random-input-len", "8",
                "--output-len", "2"]  # fmt: skip
BAD_FLAGS = {
    "unknown eviction policy": (["--eviction-policy", "nope"], "eviction_policy"),
    "unknown store policy": (["--store-policy", "nope"], "store_policy"),
    "negative prompts": (["--num-prompts", "-1"], "num_prompts"),
    "negative host tier": (["--kv-offloading-size", "-1"], "kv_offloading_size"),
    "negative device blocks": (["--num-device-blocks", "-3"], "num_device_blocks"),
    "negative device memory": (["--kv-cache-memory", "-1"], "kv_cache_memory"),
    "zero block size": (["--block-size", "0", "--compare"], "block_size"),
    "zero output": (["--output-len", "0"], "output_len"),
    "negative input": (["--random-input-len", "-5"], "random_input_len"),
    "negative suffix": (
        ["--dataset-name", "prefix_repetition", "--prefix-repetition-suffix-len", "-3"],
        "prefix_repetition_suffix_len",
    ),
    "missing dataset path": (["--dataset-name", "trace"], "dataset_path"),
    "not a trace": (["--dataset-name", "trace", "--dataset-path", __file__], "dataset_path"),
    "bad events JSON": (["--kv-events-config", "{not json"], "kv_events_config"),
    "unknown events field": (
        ["--kv-events-config", '{"enable_kv_cache_events": true, "colour": 1}'],
        "colour",
    ),
    "zero device blocks": (["--num-device-blocks", "0"], "num_device_blocks"),
    "zero repeats": (["--repeats", "0"], "repeats"),
    "disk path is a file": (["--kv-disk-path", __file__, "--kv-disk-size", "1"], "kv_disk_path"),
    "zero disk size": (
        ["--kv-disk-path", str(Path(__file__).parent), "--kv-disk-size", "0"],
        "kv_disk_size",
    ),
    "unknown cascade": (
        [
            "--kv-disk-path",
            str(Path(__file__).parent),
            "--kv-disk-size",
            "1",
            "--kv-tier-cascade",
            "never",
        ],
        "kv_tier_cascade",
    ),
    # every run's configuration is checked before the first run starts
    "negative host tier with --compare": (
        ["--kv-offloading-size", "-1", "--compare"],
        "kv_offloading_size",
    ),
    "missing model directory": (["--model", "/nonexistent/model"], "model"),
    "bad events endpoint": (
        ["--kv-events-config", '{"enable_kv_cache_events": true, "endpoint": "http://x"}'],
        "endpoint",
    ),
}


@pytest.mark.parametrize("case", sorted(BAD_FLAGS))
def test_bad_flags_exit_2_naming_the_field(case: str, capsys: pytest.CaptureFixture[str]) -> None:
    flags, field = BAD_FLAGS[case]
    assert main([*COMMON, *SMALL_RANDOM, *flags]) == 2
    stdout, stderr = capsys.readouterr()
    assert stderr.startswith(f"error: {field}: "), stderr
    assert "Traceback" not in stderr
    assert "Throughput:" not in stdout  # refused before anything ran


def test_unknown_dataset_is_an_argparse_error(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main([*COMMON, "--dataset-name", "sharegpt"])
    assert exc.value.code == 2
    assert "--dataset-name" in capsys.readouterr().err


def test_repeats_interleave_and_keep_the_fastest(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json = tmp_path / "out.json"
    argv = [*COMMON, *SMALL_RANDOM, "--compare", "--repeats", "2", "--output-json", str(out_json)]
    assert main(argv) == 0
    stdout = capsys.readouterr().out
    assert [
        m.group(1) for m in re.finditer(r"^== (.+) \(repeat \d/2\) ==$", stdout, re.M)
    ] == LABELS * 2
    payload = json.loads(out_json.read_text())
    assert [r["label"] for r in payload["all_runs"]] == LABELS * 2
    for result in payload["results"]:
        same = [r["elapsed_s"] for r in payload["all_runs"] if r["label"] == result["label"]]
        assert result["elapsed_s"] == min(same)


def test_with_a_remote_tier(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], redis_server: Any
) -> None:
    """--kv-remote-url joins the offloading run: its blocks go to Redis (the password-free URL
    of the session's test server)."""
    args, _ = _dataset_args("prefix_repetition", tmp_path)
    out_json = tmp_path / "out.json"
    flags = [*COMMON, *args, "--kv-remote-url", redis_server.url, "--output-json", str(out_json)]
    assert main(flags) == 0
    results = json.loads(out_json.read_text())["results"]
    assert [r["label"] for r in results] == ["offloading + remote"]
    assert results[0]["stats"]["offload_tier_remote_stored_blocks"] > 0
    assert main([*COMMON, *args, "--kv-remote-ttl", "5"]) == 2  # a TTL without a URL
    assert "kv_remote_ttl" in capsys.readouterr().err

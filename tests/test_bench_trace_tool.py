"""``kvoffload bench trace`` as a trace tool: it imports no torch or engine, scores by tokens over
a warm-up window (checked against figures computed by hand on a tiny trace), sizes tiers in GiB
through a KV shape, reads ``.jsonl.gz`` and stdin, and writes its settings with its results."""

from __future__ import annotations

import gzip
import io
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvoffload.benchmark.kv_shape import GIB, KNOWN_SHAPES, KVShape, blocks_for_gib
from kvoffload.benchmark.trace_score import ScoredTrace, block_tokens
from kvoffload.cli.main import main
from kvoffload.errors import ConfigError

#: Modules the trace path must not load: the engine's and the servers' heavy dependencies.
HEAVY = ("torch", "fastapi", "aiohttp", "uvicorn", "transformers", "kvoffload.engine")

# A tiny trace in blocks of 4 tokens. An infinite cache hits 0, 1, 2, 0 and 2 blocks of the five
# requests: 0 + 4 + 8 + 0 + 8 = 20 of the 6 + 5 + 9 + 3 + 8 = 31 tokens, and 5 of the 10 blocks.
# A warm-up of 0.4 leaves requests 2-4 scored: 16 of 20 tokens, 4 of 6 blocks; the warm-up names
# blocks 1, 2, 3: it fills a capacity of 3, not one of 4.
TINY: list[dict[str, Any]] = [
    {"hash_ids": [1, 2], "input_length": 6},  # blocks of 4 + 2 tokens
    {"hash_ids": [1, 3], "input_length": 5},  # 4 + 1
    {"hash_ids": [1, 2, 4], "input_length": 9},  # 4 + 4 + 1
    {"hash_ids": [5], "input_length": 3},  # 3
    {"hash_ids": [1, 2], "input_length": 8},  # 4 + 4
]


def write_tiny(path: Path) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in TINY))
    return path


def heavy_modules_after(code: str) -> list[str]:
    """The heavy modules a fresh interpreter has loaded after running ``code`` (our sources
    first, as the tests' PYTHONPATH has them)."""
    probe = (
        "import json, sys\n"
        f"{code}\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r} "
        f"or m.startswith('kvoffload.engine'))))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=300)
    assert done.returncode == 0, done.stderr.decode()
    return json.loads(done.stdout.decode().splitlines()[-1])


def test_bench_trace_help_imports_no_torch() -> None:
    code = (
        "from kvoffload.cli.main import main\n"
        "try:\n    main(['bench', 'trace', '--help'])\nexcept SystemExit as e:\n"
        "    assert e.code == 0, e.code\n"
    )
    assert heavy_modules_after(code) == []


def test_a_replay_imports_no_torch(tmp_path: Path) -> None:
    """The whole replay (a file and a generated workload, every policy, the references, JSON)
    loads no engine, torch or server module."""
    trace = write_tiny(tmp_path / "t.jsonl")
    argv = [
        "bench", "trace", "--dataset-path", str(trace), "--generate", "scans",
        "--num-prompts", "40", "--capacities", "3,20", "--block-size", "4",
        "--kv-shape", "llama-3-8b", "--output-json", str(tmp_path / "r.json"),
    ]  # fmt: skip
    code = f"from kvoffload.cli.main import main\nassert main({argv!r}) == 0\n"
    assert heavy_modules_after(code) == []
    assert json.loads((tmp_path / "r.json").read_text())["traces"]["t"]["requests"] == 5


def test_other_commands_still_build_their_parsers(capsys: pytest.CaptureFixture[str]) -> None:
    """The bench group builds only the command named: the others keep working."""
    for command, flag in (("throughput", "--kv-offloading-size"), ("serve", "--base-url")):
        with pytest.raises(SystemExit):
            main(["bench", command, "--help"])
        assert flag in capsys.readouterr().out
    with pytest.raises(SystemExit):
        main(["bench", "--help"])
    out = capsys.readouterr().out
    assert "offline throughput" in out and "prefix-hit rate of eviction policies" in out


def test_block_tokens_split_input_length() -> None:
    assert block_tokens(9, 3, 4) == [4, 4, 1]
    assert block_tokens(8, 2, 4) == [4, 4]
    assert block_tokens(100, 2, 4) == [4, 4]  # more tokens than blocks: full blocks
    assert block_tokens(0, 2, 4) == [1, 1]  # a block is never empty
    assert block_tokens(5, 3, 4) == [4, 1, 1]


def test_token_hit_rate_and_warmup_by_hand() -> None:
    requests = [r["hash_ids"] for r in TINY]
    lengths = [r["input_length"] for r in TINY]
    hits = [0, 1, 2, 0, 2]  # an infinite cache's
    whole = ScoredTrace.build(requests, lengths, 4, 0.0)
    assert whole.token_hit_rate(hits) == pytest.approx(20 / 31)
    assert whole.block_hit_ratio(hits) == pytest.approx(5 / 10)
    assert whole.filled(10**9)  # without a warm-up every capacity is scored
    window = ScoredTrace.build(requests, lengths, 4, 0.4)
    assert (window.warmup, window.warmup_blocks) == (2, 3)
    assert window.token_hit_rate(hits) == pytest.approx(16 / 20)
    assert window.block_hit_ratio(hits) == pytest.approx(4 / 6)
    assert window.filled(3) and not window.filled(4)


def run_json(tmp_path: Path, *argv: str) -> dict:
    out = tmp_path / "r.json"
    assert main(["bench", "trace", "--no-progress", "--output-json", str(out), *argv]) == 0
    return json.loads(out.read_text())


def test_bench_trace_scores_the_window_by_tokens(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The tiny trace through the command: with room for 3 blocks LRU and Belady keep blocks 1
    and 2 for requests 2 and 4, as the infinite cache does; a capacity of 4 is never filled by
    the warm-up, so it is not replayed or scored."""
    trace = write_tiny(tmp_path / "tiny.jsonl")
    payload = run_json(
        tmp_path, "--dataset-path", str(trace), "--block-size", "4", "--warmup-fraction", "0.4",
        "--capacities", "3,4", "--policies", "lru,s3fifo",
    )  # fmt: skip
    result = payload["traces"]["tiny"]
    assert result["filled"] == [True, False]
    assert (result["warmup_requests"], result["scored_input_tokens"]) == (2, 20)
    assert result["infinite"] == pytest.approx(16 / 20)
    for row in (result["policies"]["lru"], result["belady"]):
        assert row[0] == pytest.approx(16 / 20) and row[1] is None
    assert result["block_hit_ratio"]["lru"][0] == pytest.approx(4 / 6)
    assert result["token_hit_rate"]["lru"] == result["policies"]["lru"]
    assert payload["settings"] == {
        "block_size": 4,
        "warmup_fraction": 0.4,
        "weight": "tokens",
        "kv_shape": None,
        "capacities": [3, 4],
        "capacities_gib": None,
        "policies": ["lru", "s3fifo"],
        "references": True,
    }
    out = capsys.readouterr().out
    assert "token-weighted prefix-hit rate" in out
    assert "warm-up: the first 2 requests (3 distinct blocks)" in out
    lru_line = next(line for line in out.splitlines() if line.startswith("lru "))
    assert lru_line.split()[1:3] == ["0.8000", "-"]

    whole = run_json(
        tmp_path, "--dataset-path", str(trace), "--block-size", "4", "--capacities", "100",
        "--weight", "blocks", "--policies", "lru",
    )["traces"]["tiny"]  # fmt: skip
    assert whole["filled"] == [True]
    assert whole["infinite"] == pytest.approx(5 / 10)  # --weight blocks: the block ratio
    assert whole["policies"]["lru"] == [pytest.approx(5 / 10)]
    assert whole["token_hit_rate"]["lru"] == [pytest.approx(20 / 31)]


def test_gzip_and_stdin_read_as_the_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    plain = write_tiny(tmp_path / "tiny.jsonl")
    packed = tmp_path / "tiny.jsonl.gz"
    packed.write_bytes(gzip.compress(plain.read_bytes()))
    common = ["--block-size", "4", "--capacities", "2,3", "--policies", "lru"]
    figures = run_json(tmp_path, "--dataset-path", str(plain), *common)["traces"]["tiny"]
    from_gzip = run_json(tmp_path, "--dataset-path", str(packed), *common)["traces"]["tiny"]
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(plain.read_bytes())))
    from_stdin = run_json(tmp_path, "--dataset-path", "-", *common)["traces"]["stdin"]
    for other in (from_gzip, from_stdin):
        other.pop("replay_s")
    figures.pop("replay_s")
    assert from_gzip == figures and from_stdin == figures


def test_capacities_in_gib_through_a_kv_shape(tmp_path: Path) -> None:
    # Llama-3-8B: 32 layers x 2 x 8 KV heads x 128 x 2 bytes = 128 KiB a token, 64 MiB a block.
    llama = KNOWN_SHAPES["llama-3-8b"]
    assert llama.bytes_per_token == 128 * 1024
    assert blocks_for_gib(1, llama, 512) == 16
    trace = write_tiny(tmp_path / "tiny.jsonl")
    settings = run_json(
        tmp_path, "--dataset-path", str(trace), "--kv-shape", "llama-3-8b",
        "--capacities-gib", "0.0625,0.2", "--policies", "lru",
    )["settings"]  # fmt: skip
    assert settings["capacities"] == [1, 3]  # 0.2 GiB: 3.2 blocks, 3 whole ones
    assert settings["capacities_gib"] == [0.0625, 0.2]
    assert settings["kv_shape"]["bytes_per_block"] == 64 * 2**20
    # A shape by flags (fp32: 4 bytes): 2 layers x 2 x 1 head x 4 dims x 4 = 64 bytes a token.
    custom = run_json(
        tmp_path, "--dataset-path", str(trace), "--kv-layers", "2", "--kv-heads", "1",
        "--head-dim", "4", "--kv-dtype", "fp32", "--block-size", "4", "--capacities", "3",
        "--policies", "lru",
    )["settings"]  # fmt: skip
    assert custom["kv_shape"]["bytes_per_token"] == 64
    assert custom["capacities_gib"] == [3 * 64 * 4 / GIB]
    # Flags override a named shape's fields.
    modified = run_json(
        tmp_path, "--dataset-path", str(trace), "--kv-shape", "qwen2.5-7b", "--kv-layers", "14",
        "--capacities", "3", "--policies", "lru",
    )["settings"]["kv_shape"]  # fmt: skip
    assert (modified["layers"], modified["kv_heads"]) == (14, 4)


@pytest.mark.parametrize(
    ("argv", "setting"),
    [
        (["--capacities-gib", "1"], "capacities_gib"),  # no KV shape
        (["--kv-dtype", "fp8"], "kv_dtype"),  # no KV shape for it
        (["--kv-layers", "2", "--capacities-gib", "1"], "kv_shape"),  # a partial shape
        (["--kv-shape", "llama-3-8b", "--capacities-gib", "0.01"], "capacities_gib"),
        (["--kv-shape", "llama-3-8b", "--capacities-gib", "nan"], "capacities_gib"),
        (["--dataset-path", "-", "--dataset-path", "-"], "dataset_path"),
    ],
)
def test_bad_trace_tool_settings_are_clear_errors(
    argv: list[str], setting: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["bench", "trace", "--generate", "scans", "--no-progress", *argv])
    assert rc == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {setting}:") and err.count("\n") == 1


def test_capacities_in_blocks_and_gib_exclude_each_other(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["bench", "trace", "--generate", "scans", "--kv-shape", "llama-3-8b",
              "--capacities", "10", "--capacities-gib", "1"])  # fmt: skip
    assert exc.value.code == 2
    assert "not allowed with argument" in capsys.readouterr().err


def test_a_file_named_gz_that_is_not_gzip_is_a_clear_error(tmp_path: Path) -> None:
    from kvoffload.benchmark.trace_file import read_trace

    fake = tmp_path / "t.jsonl.gz"
    fake.write_text('{"hash_ids": [1]}\n')
    with pytest.raises(ConfigError, match=r"t\.jsonl\.gz: not gzip"):
        read_trace(fake)


def test_kv_shapes_are_checked() -> None:
    with pytest.raises(ConfigError, match="layers"):
        KVShape("bad", 0, 8, 128)
    with pytest.raises(ConfigError, match="kv_dtype"):
        KVShape("bad", 32, 8, 128, dtype="int3")


@given(
    st.lists(
        st.tuples(st.integers(1, 6), st.integers(0, 40), st.integers(0, 6)), min_size=1, max_size=12
    ),
    st.sampled_from([0.0, 0.25, 0.5, 0.9]),
)
def test_token_and_block_figures_agree_on_full_blocks(
    shapes: list[tuple[int, int, int]], fraction: float
) -> None:
    """Any trace, any hits: both figures lie in [0, 1]; when every block is full (no
    ``input_length`` given) hit tokens / tokens is hit blocks / blocks."""
    requests = [list(range(i * 10, i * 10 + n)) for i, (n, _, _) in enumerate(shapes)]
    hits = [min(h, n) for n, _, h in shapes]
    lengths = [length for _, length, _ in shapes]
    scored = ScoredTrace.build(requests, lengths, 4, fraction)
    assert 0 <= scored.token_hit_rate(hits) <= 1 and 0 <= scored.block_hit_ratio(hits) <= 1
    full = ScoredTrace.build(requests, [4 * len(ids) for ids in requests], 4, fraction)
    assert full.token_hit_rate(hits) == pytest.approx(full.block_hit_ratio(hits))

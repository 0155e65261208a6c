"""``kvoffload bench trace`` and the generated trace suite.

No timings are asserted: the command runs end to end on small generated traces, its references
bound every policy, its outputs parse; the generators are deterministic and have their shapes.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from kvoffload.benchmark import traces
from kvoffload.benchmark.hit_rate import (
    belady_hit_ratio,
    block_keys,
    infinite_hit_ratio,
    load_trace,
    replay,
)
from kvoffload.cli.main import main
from kvoffload.errors import ConfigError
from kvoffload.eviction import available_eviction_policies

SMALL = 300  # requests per generated trace in these tests


def shared_head_share(requests: list[list[int]]) -> float:
    """The share of requests whose first block an earlier request already had."""
    seen: set[int] = set()
    shared = 0
    for ids in requests:
        shared += ids[0] in seen
        seen.update(ids)
    return shared / len(requests)


def ids_of(records: list[dict]) -> list[list[int]]:
    return [r["hash_ids"] for r in records]


@pytest.mark.parametrize("name", sorted(traces.SUITE))
def test_generators_are_deterministic_for_a_seed(name: str) -> None:
    once = traces.dumps(traces.generate(name, seed=3, num_requests=SMALL))
    again = traces.dumps(traces.generate(name, seed=3, num_requests=SMALL))
    assert once == again
    assert once != traces.dumps(traces.generate(name, seed=4, num_requests=SMALL))
    records = [json.loads(line) for line in once.splitlines()]
    assert len(records) == SMALL
    for r in records:
        assert r["hash_ids"] and all(isinstance(i, int) and i >= 0 for i in r["hash_ids"])
        assert (len(r["hash_ids"]) - 1) * traces.BLOCK_TOKENS < r["input_length"]
        assert r["input_length"] <= len(r["hash_ids"]) * traces.BLOCK_TOKENS


def test_equal_ids_mean_equal_prefixes() -> None:
    """An id is shared exactly when the whole prefix up to it is (the Mooncake semantics)."""
    ids = traces.BlockIds()
    a = ids.chain(["s", "d1", "d2"])
    b = ids.chain(["s", "d2", "d1"])
    c = ids.chain(["s", "d1", "d3"])
    assert a[0] == b[0] == c[0] and a[1] == c[1]
    assert len({a[1], a[2], b[1], b[2], c[2]}) == 5
    assert ids.chain(["s", "d1", "d2"]) == a


def test_tenants_share_system_prompts_with_zipf_popularity() -> None:
    records = traces.tenants(num_requests=2_000, num_tenants=50, zipf=1.0, seed=0)
    requests = ids_of(records)
    assert shared_head_share(requests) > 0.95  # 50 heads among 2,000 requests
    heads: dict[int, int] = {}
    for ids in requests:
        heads[ids[0]] = heads.get(ids[0], 0) + 1
    counts = sorted(heads.values(), reverse=True)
    assert len(counts) <= 50
    assert counts[0] > 5 * counts[len(counts) // 2]  # Zipf: the top tenant dwarfs the median


def test_agent_sessions_grow_one_context() -> None:
    requests = ids_of(traces.agent_loops(num_requests=1_000, active_sessions=8, seed=0))
    # Most requests extend an earlier request's whole chain by a few blocks.
    chains = {tuple(ids) for ids in requests}
    extends = sum(
        any(tuple(ids[:cut]) in chains for cut in range(len(ids) - 4, len(ids))) for ids in requests
    )
    assert extends / len(requests) > 0.8


def test_scans_are_one_off_and_long() -> None:
    requests = ids_of(traces.scans(num_requests=2_000, scan_share=0.2, seed=0))
    counts: dict[int, int] = {}
    for ids in requests:
        for b in ids:
            counts[b] = counts.get(b, 0) + 1
    long_once = [ids for ids in requests if len(ids) >= 32 and all(counts[b] == 1 for b in ids)]
    assert 0.15 < len(long_once) / len(requests) < 0.25


def test_rag_shares_only_the_leading_documents() -> None:
    requests = ids_of(traces.rag(num_requests=2_000, num_documents=200, seed=0))
    assert shared_head_share(requests) == pytest.approx(1.0, abs=0.01)  # 3 system prompts
    # The infinite cache hits the shared system prompt and leading documents, not everything.
    assert 0.2 < infinite_hit_ratio(requests) < 0.9


def test_bursts_shift_popularity() -> None:
    requests = ids_of(traces.bursts(num_requests=2_000, phase_requests=500, seed=0))
    first = {ids[0] for ids in requests[:500]}
    last = {ids[0] for ids in requests[1_500:]}
    assert len(last - first) > len(last) / 2  # most heads of the last phase are new


def test_unknown_generator_is_refused() -> None:
    with pytest.raises(KeyError, match="unknown generated trace"):
        traces.generate("nope")


def test_references_on_a_crafted_trace() -> None:
    """Requests 1 2 3 / 1 2 4 / 1 2 3: an infinite cache hits 2 then 3 of 9 blocks. With room for
    3, Belady drops block 4 (never used again) and does as well; with room for 2 only 1 2 hit."""
    requests = [[1, 2, 3], [1, 2, 4], [1, 2, 3]]
    assert infinite_hit_ratio(requests) == pytest.approx(5 / 9)
    assert belady_hit_ratio(requests, 3) == pytest.approx(5 / 9)
    assert belady_hit_ratio(requests, 2) == pytest.approx(4 / 9)


@pytest.mark.parametrize("policy", available_eviction_policies())
def test_with_room_for_everything_every_policy_reaches_the_infinite_cache(policy: str) -> None:
    requests = ids_of(traces.generate("mix", seed=1, num_requests=SMALL))
    distinct = len(block_keys(requests))
    assert replay(requests, block_keys(requests), policy, distinct) == pytest.approx(
        infinite_hit_ratio(requests)
    )


def test_bench_trace_references_bound_every_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out_json, out_png = tmp_path / "r.json", tmp_path / "r.png"
    trace = tmp_path / "t.jsonl"
    traces.write(traces.generate("tenants", seed=2, num_requests=SMALL), trace)
    rc = main(
        [
            "bench", "trace", "--dataset-path", str(trace), "--generate", "scans",
            "--num-requests", str(SMALL), "--capacities", "50,400",
            "--output-json", str(out_json), "--plot", str(out_png), "--no-progress",
        ]
    )  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out
    for label in ["infinite (reference)", "belady (reference)", *available_eviction_policies()]:
        assert label in out
    assert "share of the LRU -> Belady gap closed" in out
    payload = json.loads(out_json.read_text())
    assert set(payload["traces"]) == {"t", "scans (seed 0)"}
    for result in payload["traces"].values():
        assert result["capacities"] == [50, 400]
        for row in result["policies"].values():
            for hit, belady in zip(row, result["belady"], strict=True):
                assert hit <= belady + 1e-12
        assert all(b <= result["infinite"] + 1e-12 for b in result["belady"])
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("argv", "setting"),
    [
        (["--capacities", "0,5"], "capacities"),
        (["--capacities", "1e400"], "capacities"),
        (["--policies", "nope"], "policies"),
        (["--generate", "nope"], "generate"),
        (["--output-json", "/nonexistent-dir/x.json"], "output_json"),
        (["--plot", "."], "plot"),
    ],
)
def test_bench_trace_bad_input_is_a_clear_error(
    argv: list[str], setting: str, capsys: pytest.CaptureFixture[str]
) -> None:
    rc = main(["bench", "trace", "--generate", "scans", "--no-progress", *argv])
    assert rc == 2
    assert setting in capsys.readouterr().err


def test_bench_trace_needs_a_trace(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "trace", "--no-progress"]) == 2
    assert "dataset_path" in capsys.readouterr().err


def test_trace_files_are_checked_line_by_line(tmp_path: Path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"hash_ids": [1, 2]}\n{"hash_ids": "oops"}\n')
    with pytest.raises(ConfigError, match=r"bad\.jsonl:2"):
        load_trace(bad)
    huge = tmp_path / "huge.jsonl"
    huge.write_text('{"hash_ids": [1, 1e400]}\n')
    with pytest.raises(ConfigError, match=r"huge\.jsonl:1"):
        load_trace(huge)
    binary = tmp_path / "binary.jsonl"
    binary.write_bytes(b'{"hash_ids": [1]}\n\xff\xfe\n')
    with pytest.raises(ConfigError, match="UTF-8"):
        load_trace(binary)
    with pytest.raises(ConfigError, match="not a file"):
        load_trace(tmp_path / "missing.jsonl")
    assert load_trace(bad, limit=1) == [[1, 2]]


BAD_TRACE_LINES = [
    b"[1, 2]\n",  # was "list indices must be integers or slices, not str" in bench trace
    b'{"input_length": 5}\n',  # was "('hash_ids')"
    b'{"hash_ids": "oops"}\n',
    b'{"hash_ids": [1, 1e400]}\n',
    b'{"hash_ids": [-1]}\n',
    b'{"hash_ids": [9223372036854775808]}\n',  # 2**63: no 8-byte key
    b'{"hash_ids": [1], "timestamp": "soon"}\n',
    b"{not json\n",
    b'{"hash_ids": [1]}\n\xff\xfe\n',
    b"\n",
]


@pytest.mark.parametrize("line", BAD_TRACE_LINES)
def test_bad_traces_get_the_same_words_from_both_commands(
    line: bytes, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One trace reader: ``bench trace`` and ``bench throughput`` refuse a bad trace with the
    same one line, naming the file and line, with no Python exception text."""
    trace = tmp_path / "t.jsonl"
    trace.write_bytes(line)
    replay = ["bench", "trace", "--dataset-path", str(trace), "--no-progress"]
    throughput = ["bench", "throughput", "--model", "tiny", "--dataset-name", "trace",
                  "--dataset-path", str(trace), "--no-progress"]  # fmt: skip
    errors = []
    for argv in (replay, throughput):
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and "Traceback" not in err
        errors.append(err)
    assert errors[0] == errors[1]
    assert errors[0].startswith(f"error: dataset_path: {trace}")
    for leak in ("list indices", "('hash_ids')", "KeyError", "TypeError", "char "):
        assert leak not in errors[0]


def test_plot_without_matplotlib_is_refused_before_the_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # what an absent package looks like
    out_json = tmp_path / "r.json"
    rc = main(
        ["bench", "trace", "--generate", "scans", "--num-requests", "20", "--no-progress",
         "--plot", str(tmp_path / "p.png"), "--output-json", str(out_json)]
    )  # fmt: skip
    assert rc == 2
    assert "matplotlib" in capsys.readouterr().err
    assert not out_json.exists()

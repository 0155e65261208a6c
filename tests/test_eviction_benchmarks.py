"""The eviction benchmarks run on any trace in the format and compute their references right.

They assert no timings; these tests only check that the scripts work end to end on tiny inputs
and that the reference figures (infinite cache, Belady) are what they claim.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from types import ModuleType

import pytest

from kvoffload.eviction import available_eviction_policies

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"


def load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def write_trace(path: Path, requests: list[list[int]]) -> Path:
    path.write_text(
        "".join(
            json.dumps({"timestamp": i, "hash_ids": ids}) + "\n" for i, ids in enumerate(requests)
        )
    )
    return path


def test_references_on_a_crafted_trace() -> None:
    """Requests 1 2 3 / 1 2 4 / 1 2 3: an infinite cache hits 2 then 3 of 9 blocks. With room for
    3, Belady drops block 4 (never used again) and does as well."""
    trace = load("trace_hit_rate")
    requests = [[1, 2, 3], [1, 2, 4], [1, 2, 3]]
    assert trace.infinite_hit_ratio(requests) == pytest.approx(5 / 9)
    assert trace.belady_hit_ratio(requests, 3) == pytest.approx(5 / 9)
    # Room for 2: after request 2, block 3 (next used last) and 4 (never) go: only 1 2 hit.
    assert trace.belady_hit_ratio(requests, 2) == pytest.approx(4 / 9)


def test_trace_replay_prints_every_policy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = load("trace_hit_rate")
    requests = [[0, *range(10 * i + 1, 10 * i + 1 + n)] for i, n in enumerate([3, 5, 2, 4] * 5)]
    requests += [r[:3] for r in requests]  # every conversation comes back
    path = write_trace(tmp_path / "t.jsonl", requests)
    trace.main([str(path), "--capacities", "4,128"])
    out = capsys.readouterr().out
    for name in ["infinite (reference)", "belady (reference)", *available_eviction_policies()]:
        assert name in out
    # With room for everything, every policy reaches the infinite cache.
    inf = trace.infinite_hit_ratio(requests)
    for name in available_eviction_policies():
        assert trace.replay(
            requests, {b: b.to_bytes(8, "big") + bytes(4) for r in requests for b in r}, name, 128
        ) == (pytest.approx(inf))


def test_trace_errors_name_the_line(tmp_path: Path) -> None:
    trace = load("trace_hit_rate")
    path = tmp_path / "bad.jsonl"
    path.write_text('{"hash_ids": [1, 2]}\n{"hash_ids": "oops"}\n')
    with pytest.raises(SystemExit, match=r"bad\.jsonl:2"):
        trace.load_trace(str(path))
    with pytest.raises(SystemExit, match="--policies"):
        trace.main([str(write_trace(tmp_path / "ok.jsonl", [[1]])), "--policies", "nope"])


def test_hot_path_benchmark_runs(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load("manager_hot_path")
    bench.main(["--requests", "40", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "bare LRU" in out
    for name in available_eviction_policies():
        assert name in out

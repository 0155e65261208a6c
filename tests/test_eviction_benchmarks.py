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


def test_trace_script_runs_the_bench_trace_command(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = load("trace_hit_rate")
    requests = [[0, *range(10 * i + 1, 10 * i + 1 + n)] for i, n in enumerate([3, 5, 2, 4] * 5)]
    requests += [r[:3] for r in requests]  # every conversation comes back
    path = write_trace(tmp_path / "t.jsonl", requests)
    assert trace.main(["--dataset-path", str(path), "--capacities", "4,128", "--no-progress"]) == 0
    out = capsys.readouterr().out
    for name in ["infinite (reference)", "belady (reference)", *available_eviction_policies()]:
        assert name in out


def test_hot_path_benchmark_runs(capsys: pytest.CaptureFixture[str]) -> None:
    bench = load("manager_hot_path")
    bench.main(["--requests", "40", "--zipf-requests", "40", "--repeats", "1"])
    out = capsys.readouterr().out
    assert "bare LRU" in out
    for name in available_eviction_policies():
        assert name in out

"""benchmarks/remote_bandwidth.py on tiny arguments: redis-benchmark times its runs in whole
milliseconds, so a tiny run reports ``inf`` requests per second; the script prints ``n/a`` for
it (and says why) instead of dividing by zero. No timing is asserted."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"

#: redis-benchmark 7's ``--csv`` output for a run shorter than its 1 ms tick, and for a 5 ms one.
UNDER_A_TICK = (
    '"test","rps","avg_latency_ms","min_latency_ms","p50_latency_ms","p95_latency_ms",'
    '"p99_latency_ms","max_latency_ms"\n"SET","inf","0.111","0.032","0.111","0.191","0.247","0.247"\n'
)
FIVE_MS = UNDER_A_TICK.replace('"inf"', '"6400.00"')


def load() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "remote_bandwidth", BENCHMARKS / "remote_bandwidth.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def test_a_run_under_the_tick_is_reported_as_not_measured() -> None:
    bench = load()
    assert bench.benchmark_seconds(FIVE_MS, "set", 32) == pytest.approx(0.005)
    assert bench.benchmark_seconds(UNDER_A_TICK, "set", 32) == 0.0
    assert "n/a" in bench.gbps([0.0, 0.004, 0.005], 10**6)
    assert "n/a" in bench.share([0.01, 0.02, 0.03], [0.0, 0.004, 0.005])
    assert bench.gbps([0.001, 0.002, 0.004], 10**6) == " 0.50 [0.25-1.00]"


@pytest.mark.skipif(
    shutil.which("redis-benchmark") is None or shutil.which("redis-server") is None,
    reason="needs redis-server and redis-benchmark (Debian's redis-tools)",
)
def test_tiny_arguments_print_every_row(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The brief's tiny run (16 KiB blocks, batches of 8, one round) ends with a row per kind."""
    bench = load()
    argv = ["remote_bandwidth.py", "--modes", "standalone", "--block-kib", "16"]
    argv += ["--batches", "8", "--repeats", "2", "--rounds", "1"]
    monkeypatch.setattr(sys, "argv", argv)
    bench.main()
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("standalone batch    8")]
    assert [row.split()[3] for row in rows] == ["store", "load"]
    assert all("GB/s" in row and "tier/redis-benchmark" in row for row in rows)
    assert "load at the end" in out

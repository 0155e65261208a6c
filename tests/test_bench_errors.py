"""How ``kvoffload bench`` commands end when something is wrong: misuse is a usage line and one
error line (exit 2), a flag given without the tier or dataset it needs is refused by one rule, a
tier's own ConfigError is one line (exit 2), Ctrl-C is one line (exit 130), never a traceback."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from engine_cases import one_thread  # noqa: F401 - autouse fixture

from kvoffload.cli.main import main

THROUGHPUT = ["bench", "throughput", "--model", "tiny", "--block-size", "4",
              "--kv-offloading-size", "0.001", "--no-progress"]  # fmt: skip
SMALL = ["--dataset-name", "random", "--num-prompts", "2", "--random-input-len", "8",
         "--output-len", "2", "--num-device-blocks", "24"]  # fmt: skip
ROOT = Path(__file__).resolve().parent.parent


def _usage_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> list[str]:
    """Run ``argv``, which must be a usage error: its stderr lines."""
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err.splitlines()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--kv-disk-size", "-1"], "argument --kv-disk-size: must be a finite number > 0, got '-1'"),
        (["--kv-disk-size", "0"], "argument --kv-disk-size: must be a finite number > 0, got '0'"),
        (["--metrics-port", "70000"], "argument --metrics-port: must be an integer in [0, 65535]"),
        (["--instances", "3"], "argument --instances: must be an integer in [1, 2], got '3'"),
        (["--num-prompts", "0"], "argument --num-prompts: must be an integer >= 1, got '0'"),
        (["--eviction-policy", "nosuch"], "argument --eviction-policy: invalid choice: 'nosuch'"),
        (["--random-range-ratio", "1"], "argument --random-range-ratio: must be a finite number in [0, 1)"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
    ],
)  # fmt: skip
def test_a_usage_error_is_the_usage_line_and_the_error(
    flags: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    usage, error = _usage_error([*THROUGHPUT, *flags], capsys)
    assert usage.startswith("usage: kvoffload bench throughput [options]")
    assert error.startswith(f"kvoffload bench throughput: error: {message}"), error


def test_bench_trace_usage_errors_are_two_lines(capsys: pytest.CaptureFixture[str]) -> None:
    usage, error = _usage_error(["bench", "trace", "--num-prompts", "0"], capsys)
    assert usage.startswith("usage: kvoffload bench trace ")
    assert error == (
        "kvoffload bench trace: error: argument --num-prompts: must be an integer >= 1, got '0'"
    )


# Flags that have no effect without a tier or a dataset: refused by one rule, naming both.
WITHOUT_WHAT_THEY_NEED = {
    "--kv-disk-size": (["--kv-disk-size", "1"], "--kv-disk-path"),
    "--kv-disk-eviction-policy": (["--kv-disk-eviction-policy", "lru"], "--kv-disk-path"),
    "--kv-tier-cascade": (
        ["--kv-tier-cascade", "on_evict"],
        "a disk or remote tier (--kv-disk-path, --kv-remote-url)",
    ),
    "--kv-lookup-retry-s": (
        ["--kv-lookup-retry-s", "5"],
        "a disk or remote tier (--kv-disk-path, --kv-remote-url)",
    ),
    "--kv-remote-optional": (["--kv-remote-optional"], "--kv-remote-url"),
    "--kv-remote-ttl-s": (["--kv-remote-ttl-s", "5"], "--kv-remote-url"),
    "--kv-remote-lookup-wait-s": (["--kv-remote-lookup-wait-s", "1"], "--kv-remote-url"),
    "--metrics-host": (["--metrics-host", "0.0.0.0"], "--metrics-port"),
    "--eviction-policy": (
        ["--eviction-policy", "lru", "--kv-offloading-size", "0"],
        "the host tier (--kv-offloading-size > 0)",
    ),
    "--honor-timestamps": (["--honor-timestamps"], "--dataset-name trace"),
    "--timestamp-scale": (["--timestamp-scale", "2"], "--honor-timestamps"),
    "--prefix-repetition-prefix-len": (
        ["--prefix-repetition-prefix-len", "8"],
        "--dataset-name prefix_repetition",
    ),
}


@pytest.mark.parametrize("flag", sorted(WITHOUT_WHAT_THEY_NEED))
def test_a_flag_without_what_it_needs_is_refused(
    flag: str, capsys: pytest.CaptureFixture[str]
) -> None:
    flags, needed = WITHOUT_WHAT_THEY_NEED[flag]
    assert main([*THROUGHPUT, *SMALL, *flags]) == 2
    stdout, stderr = capsys.readouterr()
    setting = flag[2:].replace("-", "_")
    assert stderr == f"error: {setting}: {flag} has no effect without {needed}\n"
    assert stdout == ""  # refused before anything ran


def test_a_disk_path_needs_its_size(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main([*THROUGHPUT, *SMALL, "--kv-disk-path", str(tmp_path)]) == 2
    assert capsys.readouterr().err == (
        "error: kv_disk_size: --kv-disk-path needs --kv-disk-size GiB\n"
    )


def test_a_tiers_config_errors_are_one_line(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """ConfigErrors the tiers raise, before the run (a disk path under a regular file) and while
    an engine is built (a Redis server that is down): one line, exit 2, no traceback."""
    from redis_servers import free_port

    a_file = tmp_path / "file"
    a_file.write_text("x")
    under_a_file = ["--kv-disk-path", str(a_file / "sub"), "--kv-disk-size", "1"]
    down = ["--kv-remote-url", f"redis://:hunter2@127.0.0.1:{free_port()}/0"]
    for flags in (under_a_file, down):
        assert main([*THROUGHPUT, *SMALL, *flags]) == 2
        stdout, stderr = capsys.readouterr()
        assert re.fullmatch(r"error: kv_(disk_path|remote_url): [^\n]+\n", stderr), stderr
        assert "Throughput:" not in stdout and "hunter2" not in stderr


def test_an_optional_remote_tier_that_is_down_is_not_claimed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--kv-remote-optional with the server down runs without the remote tier: the run says so
    in its label, the JSON too (it was "offloading + remote")."""
    from redis_servers import free_port

    out_json = tmp_path / "out.json"
    argv = [*THROUGHPUT, *SMALL, "--kv-remote-url", f"redis://127.0.0.1:{free_port()}/0",
            "--kv-remote-optional", "--output-json", str(out_json)]  # fmt: skip
    assert main(argv) == 0
    assert "== offloading (remote tier down: ran without it) ==" in capsys.readouterr().out
    (run,) = json.loads(out_json.read_text())["all_runs"]
    assert run["label"] == "offloading (remote tier down: ran without it)"


def test_deprecated_spellings_work_with_a_one_line_notice(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = [*THROUGHPUT, *SMALL, "--kv-remote-ttl", "5"]  # the old spelling of --kv-remote-ttl-s
    assert main(argv) == 2
    assert capsys.readouterr().err.splitlines() == [
        "kvoffload bench throughput: warning: --kv-remote-ttl is deprecated; use --kv-remote-ttl-s",
        "error: kv_remote_ttl_s: --kv-remote-ttl-s has no effect without --kv-remote-url",
    ]
    argv = ["bench", "trace", "--generate", "scans", "--num-requests", "20", "--capacities",
            "10", "--policies", "lru", "--no-references", "--no-progress"]  # fmt: skip
    assert main(argv) == 0
    captured = capsys.readouterr()
    assert captured.err == (
        "kvoffload bench trace: warning: --num-requests is deprecated; use --num-prompts\n"
    )
    assert "trace scans (seed 0): 20 requests" in captured.out


def _kvoffload(argv: list[str], cwd: Path) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE",
           "OMP_NUM_THREADS": "1"}  # fmt: skip
    return subprocess.Popen(
        [sys.executable, "-m", "kvoffload.cli.main", *argv],
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
    )


def _interrupted_once(argv: list[str], ready: bytes, cwd: Path) -> tuple[int, str]:
    """Start ``kvoffload argv``; when its stderr has shown ``ready``, send it SIGINT. Its exit
    status and whole stderr. (A watchdog kills it if it hangs: the test then fails.)"""
    proc = _kvoffload(argv, cwd)
    watchdog = threading.Timer(240, proc.kill)
    watchdog.start()
    try:
        seen = b""
        while ready not in seen:
            chunk = os.read(proc.stderr.fileno(), 4096)  # type: ignore[union-attr]
            assert chunk, f"ended before {ready!r}: {seen.decode()}"
            seen += chunk
        proc.send_signal(signal.SIGINT)
        _, rest = proc.communicate()
    finally:
        watchdog.cancel()
    return proc.returncode, (seen + rest).decode()


def _assert_one_interrupted_line(stderr: str, prog: str) -> None:
    lines = [line for line in re.split(r"[\r\n]", stderr) if line.strip()]
    assert lines[-1] == f"{prog}: interrupted", stderr
    assert stderr.count("interrupted") == 1
    assert "Traceback" not in stderr and "KeyboardInterrupt" not in stderr


def test_ctrl_c_during_bench_throughput_is_one_line_and_exit_130(tmp_path: Path) -> None:
    """SIGINT once the progress bar shows: the second request of the trace arrives in 11 days
    (its timestamp x 1e6), so the run is still serving whatever the machine's speed."""
    trace = tmp_path / "t.jsonl"
    trace.write_text('{"timestamp": 0, "hash_ids": [1]}\n{"timestamp": 1000, "hash_ids": [2]}\n')
    argv = ["bench", "throughput", "--model", "tiny", "--block-size", "4", "--num-device-blocks",
            "32", "--kv-offloading-size", "0.001", "--dataset-name", "trace", "--dataset-path",
            str(trace), "--trace-block-size", "4", "--output-len", "2", "--honor-timestamps",
            "--timestamp-scale", "1e6"]  # fmt: skip
    rc, stderr = _interrupted_once(argv, b"| 0/2 ", tmp_path)
    assert rc == 130, stderr
    _assert_one_interrupted_line(stderr, "kvoffload bench throughput")


def test_ctrl_c_during_bench_trace_is_one_line_and_exit_130(tmp_path: Path) -> None:
    """SIGINT once it says it reads its trace: a named pipe nobody writes to, so it is still
    reading whatever the machine's speed."""
    fifo = tmp_path / "t.jsonl"
    os.mkfifo(fifo)
    argv = ["bench", "trace", "--dataset-path", str(fifo), "--capacities", "10"]
    rc, stderr = _interrupted_once(argv, b"reading ", tmp_path)
    assert rc == 130, stderr
    _assert_one_interrupted_line(stderr, "kvoffload bench trace")

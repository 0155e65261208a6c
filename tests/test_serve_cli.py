"""The command lines of ``serve``, ``route`` and ``bench serve``: one table of flags each (the
engine's and tiers' shared with ``bench throughput``), every default stated once in ``--help``, a
refused flag is one line and exit status 2, and Ctrl-C ends ``serve`` gracefully with one line
and exit status 130 (the commands' shared ending)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys

import pytest
from serve_cases import serve

from kvoffload.cli.main import main

COMMANDS = [["serve"], ["route"], ["bench", "serve"]]


def _help_entries(command: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    with pytest.raises(SystemExit):
        main([*command, "--help"])
    text = capsys.readouterr().out.split("options:", 1)[1]
    entries: dict[str, str] = {}
    for block in re.split(r"\n(?=  -)", text):
        words = " ".join(block.split())
        if words:
            entries[words.split()[0].rstrip(",")] = words
    return entries


@pytest.mark.parametrize("command", COMMANDS)
def test_help_states_every_default_once(command, capsys) -> None:
    entries = _help_entries(command, capsys)
    assert len(entries) > 5
    for option, text in entries.items():
        if option == "-h":
            continue
        assert text.count("(default: ") == 1, text
        for python in ("None", "False", "True"):
            assert f"(default: {python}" not in text, text
    if command == ["serve"]:
        assert "--kv-disk-path" in entries and "--metrics-port" not in entries


@pytest.mark.parametrize(("argv", "setting"), [
    (["serve", "--model", "tiny", "--kv-disk-size", "1"], "kv_disk_size"),
    (["serve", "--model", "tiny", "--kv-offloading-size", "0", "--kv-remote-url",
      "redis://127.0.0.1:1"], "kv_remote_url"),
])
def test_refused_settings_are_one_line(argv, setting, capsys) -> None:
    assert main(argv) == 2
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith(f"error: {setting}")


@pytest.mark.parametrize("backends", [[], ["--backend", "ftp://x"], ["--backend", "http://x,y=1"]])
def test_route_needs_good_backends(backends, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["route", "--model", "tiny", *backends])
    assert exited.value.code == 2
    assert "backend" in capsys.readouterr().err


@pytest.mark.timeout(120)
def test_ctrl_c_ends_serve_gracefully_with_one_line() -> None:
    with serve() as server:
        server.proc.send_signal(signal.SIGINT)
        assert server.proc.wait(60) == 130
        output = server.output()
    assert output.rstrip().endswith("kvoffload serve: interrupted"), output
    assert "Traceback" not in output


def test_bench_serve_request_rate_accepts_inf(capsys) -> None:
    del capsys
    code = subprocess.run(
        [sys.executable, "-m", "kvoffload.cli.main", "bench", "serve", "--request-rate", "inf",
         "--base-url", "http://127.0.0.1:1", "--num-prompts", "1", "--model", "tiny"],
        capture_output=True, text=True, timeout=120, check=False)
    # accepted (not refused: 2); nothing listens, so the initial test request fails (3)
    assert code.returncode == 3, code.stderr
    assert "the initial test request to http://127.0.0.1:1 failed" in code.stderr


def test_compare_routing_configs_are_named_ones(capsys) -> None:
    from kvoffload.servebench.routing_configs import CONFIG_NAMES

    for bad in ("kv_aware,nope", "kv_aware,kv_aware", ","):
        with pytest.raises(SystemExit) as exited:
            main(["bench", "serve", "--compare-routing", "2", "--compare-routing-configs", bad])
        assert exited.value.code == 2
        assert "--compare-routing-configs" in capsys.readouterr().err
    assert main(["bench", "serve", "--compare-routing-configs", "kv_aware"]) == 2  # needs N
    (line,) = capsys.readouterr().err.splitlines()
    assert "--compare-routing" in line
    assert "one_instance_Nx_cache" in CONFIG_NAMES


def test_compare_routing_rotates_the_order_of_configurations() -> None:
    """Every configuration runs once in every position over len(configs) repeats, so none
    always runs first (a fixed order handed the machine's load drift to one configuration)."""
    from kvoffload.servebench.routing_configs import repeat_order

    configs = ("kv_aware", "kv_aware_tier_blind", "kv_aware_dynamo_credits")
    orders = [repeat_order(configs, r) for r in range(6)]
    for order in orders:
        assert sorted(order) == sorted(configs)
    for position in range(3):
        assert {orders[r][position] for r in range(3)} == set(configs)
    assert orders[3:] == orders[:3]
    assert repeat_order(("kv_aware",), 5) == ("kv_aware",)

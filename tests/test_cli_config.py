"""``--config FILE.yaml`` on every command (as vLLM's): a file gives the namespace the same flags
give; flags on the command line override it; a key no flag has is a usage error naming it.
And ``--help`` lists the flags in sections."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from kvoffload.cli.config_file import command_parsers
from kvoffload.cli.main import build_parser, main, parse_args

#: Namespace entries that are not settings (the parser objects, the config path itself).
_NOT_SETTINGS = ("parser", "func", "check", "config")


def _settings(argv: list[str]) -> dict[str, Any]:
    return {k: v for k, v in vars(parse_args(argv)).items() if k not in _NOT_SETTINGS}


def _write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return str(path)


# (command words, YAML, the same settings as flags)
CASES = [
    (["serve"], """
model: tiny
port: 9001
num_device_blocks: 64
kv-offloading-size: 0.5
eviction_policy: lru
no_enable_prefix_caching: true
kv_events_config: {enable_kv_cache_events: true, publisher: zmq, topic: kv}
api_key: sk-test
""", ["--model", "tiny", "--port", "9001", "--num-device-blocks", "64",
      "--kv-offloading-size", "0.5", "--eviction-policy", "lru", "--no-enable-prefix-caching",
      "--kv-events-config",
      '{"enable_kv_cache_events": true, "publisher": "zmq", "topic": "kv"}',
      "--api-key", "sk-test"]),
    (["route"], """
backend: [http://127.0.0.1:8001, "http://127.0.0.1:8002,events=tcp://127.0.0.1:5557"]
policy: least_load
model: tiny
health_interval: 0.5
""", ["--backend", "http://127.0.0.1:8001",
      "--backend", "http://127.0.0.1:8002,events=tcp://127.0.0.1:5557",
      "--policy", "least_load", "--model", "tiny", "--health-interval", "0.5"]),
    (["bench", "throughput"], """
model: tiny
dataset_name: random
random-input-len: 100
num_prompts: 8
compare: true
enable-prefix-caching: false
kv_offloading_size: 0.25
kv_disk_path: /tmp/kv
kv_disk_size: 1
""", ["--model", "tiny", "--dataset-name", "random", "--random-input-len", "100",
      "--num-prompts", "8", "--compare", "--no-enable-prefix-caching",
      "--kv-offloading-size", "0.25", "--kv-disk-path", "/tmp/kv", "--kv-disk-size", "1"]),
    (["bench", "serve"], """
base_url: http://127.0.0.1:9000
request_rate: 4
goodput: ["ttft:500", "tpot:50"]
serve_args: --max-num-seqs 2
compare_routing: 2
warmup_pass: true
disable_tqdm: true
""", ["--base-url", "http://127.0.0.1:9000", "--request-rate", "4",
      "--goodput", "ttft:500", "tpot:50", "--serve-args=--max-num-seqs 2",
      "--compare-routing", "2", "--warmup-pass", "--disable-tqdm"]),
]


@pytest.mark.parametrize(("command", "yaml_text", "flags"), CASES,
                         ids=[" ".join(c[0]) for c in CASES])
def test_a_config_file_parses_as_the_same_flags(
    tmp_path: Path, command: list[str], yaml_text: str, flags: list[str]
) -> None:
    from_file = _settings([*command, "--config", _write(tmp_path, yaml_text)])
    assert from_file == _settings([*command, *flags])
    assert from_file != _settings(command)  # the file did set something


def test_flags_on_the_command_line_override_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "model: tiny\nport: 9001\nnum_device_blocks: 64\n")
    args = parse_args(["serve", "--port", "9002", "--config", path, "--kv-cache-memory", "2"])
    # the flag wins; a flag excluding the file's (--kv-cache-memory / --num-device-blocks) too
    assert (args.port, args.model, args.kv_cache_memory, args.num_device_blocks) == (
        9002, "tiny", 2.0, None)
    route = _write(tmp_path, "backend: [http://a:1, http://b:2]\n")
    assert parse_args(["route", "--config", route, "--backend", "http://c:3"]).backend == [
        "http://c:3"]  # the command line's list replaces the file's


@pytest.mark.parametrize("command", [["serve"], ["route"], ["bench", "throughput"],
                                     ["bench", "serve"], ["bench", "trace"],
                                     ["events", "listen"]])
def test_an_unknown_key_is_a_usage_error_naming_it(
    tmp_path: Path, command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    path = _write(tmp_path, "kv_offloading_sise: 1\nseed: 1\nnot-a-flag: x\n")
    with pytest.raises(SystemExit) as exited:
        main([*command, "--config", path])
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert "unknown keys: kv_offloading_sise" in err and "not-a-flag" in err, err
    assert len(err.splitlines()) == 2  # the usage line and the error


@pytest.mark.parametrize(("text", "error"), [
    ("[1, 2]", "must be a mapping"),
    ("model: [tiny, small]", "model: takes one value"),
    ("compare: 3", "compare: must be true or false"),
    ("model: {unclosed", "not valid YAML"),
])
def test_a_malformed_config_is_a_usage_error(
    tmp_path: Path, text: str, error: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["bench", "throughput", "--config", _write(tmp_path, text)])
    assert exited.value.code == 2
    assert error in capsys.readouterr().err


def test_a_missing_config_file_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--config", str(tmp_path / "absent.yaml")])
    assert exited.value.code == 2
    assert "absent.yaml: No such file" in capsys.readouterr().err


def test_a_value_from_the_file_is_checked_as_the_flag_is(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        main(["serve", "--config", _write(tmp_path, "port: 70000\n")])
    assert exited.value.code == 2
    assert "--port: must be an integer in [0, 65535], got '70000'" in capsys.readouterr().err


def _every_command() -> list[argparse.ArgumentParser]:
    commands = []
    for group in ("bench", "serve", "route", "events"):  # each group's parsers, built by name
        commands += [p for p in command_parsers(build_parser([group]))
                     if p.prog.split()[1] == group]
    return commands


def test_every_command_takes_config() -> None:
    commands = _every_command()
    assert {p.prog for p in commands} >= {
        "kvoffload serve", "kvoffload route", "kvoffload bench throughput",
        "kvoffload bench serve", "kvoffload bench trace", "kvoffload events listen"}
    for parser in commands:
        assert "--config" in parser.format_help(), parser.prog


@pytest.mark.parametrize(("command", "sections"), [
    (["serve"], ["server", "engine", "host tier", "disk tier", "remote tier", "events"]),
    (["route"], ["routing", "server", "backends' health"]),
    (["bench", "throughput"], ["workload", "engine", "host tier", "benchmark"]),
    (["bench", "serve"], ["workload", "benchmark", "compare routing", "compare offloading"]),
])
def test_help_lists_the_flags_in_sections(command: list[str], sections: list[str]) -> None:
    parser = next(p for p in command_parsers(build_parser(command))
                  if p.prog == "kvoffload " + " ".join(command))
    titles = [g.title for g in parser._action_groups if g._group_actions]
    assert set(sections) <= set(titles), titles
    # only --help and --config are left under the catch-all heading
    (options,) = [g for g in parser._action_groups if g.title == "options"]
    assert {a.dest for a in options._group_actions} == {"help", "config"}

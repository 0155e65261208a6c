"""The flag tables: ``--help`` states every default once and exactly, the engine table states
``EngineConfig``'s defaults, and ``add_engine_flags`` / ``engine_config_from_args`` serve any
command's parser (``serve`` reuses them) with the same rules."""

from __future__ import annotations

import re

import pytest

from kvoffload.cli.args import CommandParser
from kvoffload.cli.engine_flags import add_engine_flags, engine_config_from_args
from kvoffload.cli.main import main
from kvoffload.errors import ConfigError


def _help(argv: list[str], capsys: pytest.CaptureFixture[str]) -> dict[str, str]:
    """``--help`` of a command: each option's help text, by its first spelling (whichever
    section lists it; the sections' headings left out)."""
    with pytest.raises(SystemExit):
        main([*argv, "--help"])
    text = capsys.readouterr().out.split("\noptions:\n", 1)[1]
    text = "\n".join(line for line in text.splitlines() if line.startswith(" "))
    entries = re.split(r"\n  (?=-)", "\n" + text)
    return {e.split()[0].rstrip(","): " ".join(e.split()) for e in entries if e.strip()}


@pytest.mark.parametrize("command", [["bench", "throughput"], ["bench", "trace"]])
def test_help_states_every_default_once_and_exactly(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    from kvoffload.cli.bench import BENCH_DEFAULTS, BENCH_FLAGS
    from kvoffload.cli.engine_flags import ENGINE_FLAGS
    from kvoffload.cli.trace import TRACE_FLAGS
    from kvoffload.cli.workload_flags import WORKLOAD_FLAGS

    tables = (
        [*WORKLOAD_FLAGS, *ENGINE_FLAGS, *BENCH_FLAGS]
        if command[1] == "throughput"
        else TRACE_FLAGS
    )
    entries = _help(command, capsys)
    assert set(entries) == {"-h", "--config"} | {f.option for f in tables}
    for flag in tables:
        help_text = entries[flag.option]
        assert help_text.count("(default: ") == 1, help_text
        default = (
            BENCH_DEFAULTS.get(flag.dest, flag.default)
            if tables is not TRACE_FLAGS
            else (flag.default)
        )
        stated = help_text.rsplit("(default: ", 1)[1][:-1]
        assert stated == " ".join(flag.default_text(default).split()), (flag.option, stated)
        assert stated not in ("None", "False", "True"), help_text
    if command[1] == "throughput":
        assert entries["--kv-disk-size"].endswith("(default: none: required with --kv-disk-path)")
        assert entries["--metrics-port"].startswith("--metrics-port PORT serve Prometheus")
        assert "0 = any free port" in entries["--metrics-port"]
        assert entries["--num-device-blocks"].endswith("(default: 600)")


def test_engine_flag_defaults_are_the_engines() -> None:
    """The table states EngineConfig's defaults (a command may override them)."""
    import dataclasses

    from kvoffload.cli.engine_flags import ENGINE_FLAGS
    from kvoffload.engine import EngineConfig

    fields = {f.name: f.default for f in dataclasses.fields(EngineConfig)}
    for flag in ENGINE_FLAGS:
        if flag.dest != "kv_disk_size":  # no default: required with its path
            assert flag.default == fields[flag.dest], flag.dest


def _parser(**kwargs: object) -> CommandParser:
    parser = CommandParser(prog="kvoffload serve")
    add_engine_flags(parser, **kwargs)  # type: ignore[arg-type]
    return parser


def test_engine_flags_on_a_parser_of_their_own() -> None:
    parser = _parser()
    config = engine_config_from_args(parser.parse_args(["--model", "tiny"]))
    assert (config.model, config.kv_offloading_size, config.num_device_blocks) == ("tiny", 0, None)
    argv = ["--model", "tiny", "--kv-offloading-size", "0.5", "--kv-disk-path", "/tmp/kv",
            "--kv-disk-size", "2", "--num-device-blocks", "64"]  # fmt: skip
    config = engine_config_from_args(parser.parse_args(argv))
    assert (config.kv_disk_path, config.kv_disk_size, config.num_device_blocks) == (
        "/tmp/kv",
        2,
        64,
    )
    with pytest.raises(ConfigError) as info:
        engine_config_from_args(parser.parse_args(["--kv-remote-ttl-s", "5"]))
    assert (
        str(info.value)
        == "kv_remote_ttl_s: --kv-remote-ttl-s has no effect without --kv-remote-url"
    )
    with pytest.raises(ConfigError) as info:  # a bound of an admission order not chosen
        argv = ["--scheduling-policy", "fcfs", "--scheduling-max-bypass", "3"]
        engine_config_from_args(parser.parse_args(argv))
    assert str(info.value) == (
        "scheduling_max_bypass: --scheduling-max-bypass has no effect without "
        "--scheduling-policy cache_aware"
    )
    for argv in (["--scheduling-max-bypass", "3"], ["--scheduling-policy", "cache_aware",
                                                     "--scheduling-max-bypass", "3"]):  # fmt: skip
        assert engine_config_from_args(parser.parse_args(argv)).scheduling_max_bypass == 3
    assert engine_config_from_args(parser.parse_args([])).scheduling_policy == "cache_aware"
    with pytest.raises(ConfigError) as info:  # EngineConfig's own checks come through too
        engine_config_from_args(parser.parse_args(["--model", "/nonexistent", "--device", "tpu"]))
    assert info.value.field == "device"


def test_a_command_overrides_defaults_and_leaves_flags_out(
    capsys: pytest.CaptureFixture[str],
) -> None:
    parser = _parser(defaults={"max_num_seqs": 4}, exclude={"metrics_port", "metrics_host"})
    assert engine_config_from_args(parser.parse_args([])).max_num_seqs == 4
    help_text = " ".join(parser.format_help().split())
    assert "requests per engine step, >= 1 (default: 4)" in help_text
    assert "--metrics-port" not in help_text
    with pytest.raises(SystemExit):
        parser.parse_args(["--metrics-port", "8000"])
    assert "unrecognized arguments: --metrics-port" in capsys.readouterr().err
    with pytest.raises(ValueError, match="not in the table"):
        _parser(defaults={"no_such_setting": 1})


@pytest.mark.parametrize(
    "command", [["bench", "throughput"], ["bench", "trace"], ["events", "listen"]]
)
def test_no_help_line_states_a_default_twice_or_as_python(
    command: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    for option, text in _help(command, capsys).items():
        assert text.count("(default") <= 1, text
        for python in ("None", "False", "True", "[]", "()"):
            assert f"(default: {python})" not in text, text
        if option in ("--timeout", "--max-batches"):
            assert "(default: " in text

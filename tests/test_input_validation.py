"""One table of bad values, tried on every value a user can pass: every ``EngineConfig`` field (and
``Engine(...)`` with it), every ``SamplingParams`` field, every ``kv_transfer_params`` key, and
every flag of every ``kvoffload`` command. Fields and flags are discovered (dataclass fields,
their type hints, argparse actions), so ones added later are covered without editing this file.

The rule: a bad value is refused at the boundary with a ``ConfigError`` naming the setting (or a
usage error naming the flag); a value that is accepted is one the setting's type admits (never a
bool for a number, never NaN or infinity); nothing else may come out (no TypeError, OverflowError,
AttributeError, no traceback).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import types
import typing
from typing import Any

import pytest
from engine_cases import one_thread  # noqa: F401 - autouse fixture

from kvoffload.cli.main import _COMMAND_GROUPS, build_parser
from kvoffload.engine import Engine, EngineConfig, SamplingParams
from kvoffload.errors import ConfigError
from kvoffload.scheduler.connector import KV_TRANSFER_PARAMS, parse_kv_transfer_params

BAD_VALUES: dict[str, Any] = {
    "str": "x",
    "empty str": "",
    "list": [1],
    "dict": {"a": 1},
    "object": object(),
    "None": None,
    "bool": True,
    "negative": -1,
    "negative float": -0.5,
    "zero": 0,
    "nan": math.nan,
    "inf": math.inf,
    "-inf": -math.inf,
    "huge int": 10**30,
    "huge float": 1e300,
}


def _types(hint: Any) -> set[type]:
    """The runtime types a type hint admits (``X | None``, ``dict[str, Any]``, ``tuple[int, ...]``)."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        return set().union(*(_types(arg) for arg in typing.get_args(hint)))
    if hint is None or hint is type(None):
        return {type(None)}
    origin = typing.get_origin(hint)
    if origin is not None:
        return {origin}
    return {hint} if isinstance(hint, type) else {object}


def _admits(allowed: set[type], value: Any) -> bool:
    """Whether a value of this kind may be accepted by a setting typed ``allowed``."""
    if object in allowed:
        return True
    if isinstance(value, bool):
        return bool in allowed
    if isinstance(value, int):
        return int in allowed or float in allowed
    if isinstance(value, float):
        return float in allowed and math.isfinite(value)
    if isinstance(value, list):
        return bool(allowed & {list, tuple})
    return any(isinstance(value, t) for t in allowed)


def _check(name: str, hint: Any, value: Any, build: Any) -> Any:
    """Run ``build(value)``; assert the rule of this module. Returns the built object or None."""
    try:
        built = build(value)
    except ConfigError as exc:
        assert exc.field, exc
        if not _admits(_types(hint), value):
            assert exc.field.split(".")[0] in (name, "kv_transfer_params"), (name, value, exc)
        return None
    assert _admits(_types(hint), value), f"{name}={value!r} was accepted"
    return built


def _fields(cls: type) -> list[tuple[str, Any]]:
    hints = typing.get_type_hints(cls)
    return [(f.name, hints[f.name]) for f in dataclasses.fields(cls) if f.init]


ENGINE_FIELDS = _fields(EngineConfig)
CASES = [(f, h, v) for f, h in ENGINE_FIELDS for v in BAD_VALUES]


@pytest.mark.parametrize(("field", "hint", "value"), CASES, ids=[f"{f}-{v}" for f, _, v in CASES])
def test_engine_settings(field: str, hint: Any, value: str, tmp_path, monkeypatch) -> None:
    """``EngineConfig`` refuses or accepts per the rule, and ``Engine(...)`` built with an
    accepted value either works or refuses it with a ConfigError (never another exception)."""
    monkeypatch.chdir(tmp_path)  # settings that name files (a disk tier, say) stay in here
    small = {"model": "tiny", "block_size": 4, "num_device_blocks": 16}
    if field in ("num_device_blocks", "kv_cache_memory"):
        small.pop("num_device_blocks")
    bad = BAD_VALUES[value]

    def config(v: Any) -> EngineConfig:
        return EngineConfig(**{**small, field: v})

    if _check(field, hint, bad, config) is None:
        return
    kwargs = {**small, field: bad}
    with contextlib.suppress(ConfigError):
        Engine(kwargs.pop("model"), **kwargs).close()


SAMPLING_FIELDS = _fields(SamplingParams)
SAMPLING_CASES = [(f, h, v) for f, h in SAMPLING_FIELDS for v in BAD_VALUES]


@pytest.mark.parametrize(
    ("field", "hint", "value"), SAMPLING_CASES, ids=[f"{f}-{v}" for f, _, v in SAMPLING_CASES]
)
def test_sampling_params(field: str, hint: Any, value: str) -> None:
    _check(field, hint, BAD_VALUES[value], lambda v: SamplingParams(**{field: v}))


TRANSFER_CASES = [(k, t, v) for k, t in KV_TRANSFER_PARAMS.items() for v in BAD_VALUES]


@pytest.mark.parametrize(
    ("key", "kind", "value"), TRANSFER_CASES, ids=[f"{k}-{v}" for k, _, v in TRANSFER_CASES]
)
def test_kv_transfer_params(key: str, kind: type, value: str) -> None:
    _check(
        f"kv_transfer_params.{key}",
        kind | None,
        BAD_VALUES[value],
        lambda v: parse_kv_transfer_params({key: v}, "on_compute"),
    )


@pytest.mark.parametrize("value", ["x", [("store_policy", "on_finish")], 5, True, object()])
def test_kv_transfer_params_must_be_a_mapping(value: Any) -> None:
    with pytest.raises(ConfigError) as info:
        parse_kv_transfer_params(value, "on_compute")
    assert info.value.field == "kv_transfer_params"


def _leaf_parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    """Every runnable ``kvoffload`` command: ``(name, parser)``."""
    out = []

    def walk(name: str, parser: argparse.ArgumentParser) -> None:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs:
            out.append((name, parser))
        for action in subs:
            for sub_name, sub in action.choices.items():
                walk(f"{name} {sub_name}".strip(), sub)

    for group in _COMMAND_GROUPS:  # the parser loads the command group it is asked for
        parser = build_parser([group])
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                walk(group, action.choices[group])
    return out


BAD_FLAG_VALUES = ["x", "", "nan", "inf", "-inf", "-1", "-0.5", "0", "1e400", "9" * 30, "true"]
#: Flags every command is run with, so that the flag under test is the only bad thing.
BASE_FLAGS = {"bench throughput": ["--model", "tiny"]}
FLAG_CASES = [
    (command, action.option_strings[-1], value)
    for command, parser in _leaf_parsers()
    for action in parser._actions
    if action.option_strings and action.nargs != 0 and not isinstance(action, argparse._HelpAction)
    for value in BAD_FLAG_VALUES
]


def test_every_command_and_flag_is_in_the_table() -> None:
    commands = {command for command, _, _ in FLAG_CASES}
    assert {"bench throughput", "events listen"} <= commands
    assert len({(c, f) for c, f, _ in FLAG_CASES}) > 30


@pytest.mark.parametrize(
    ("command", "flag", "value"), FLAG_CASES, ids=[f"{c}{f}={v}" for c, f, v in FLAG_CASES]
)
def test_cli_flags(command: str, flag: str, value: str, tmp_path, monkeypatch, capsys) -> None:
    """A bad flag value is a usage error naming the flag, or the command's checks (everything it
    checks before running) refuse it with a ConfigError; an accepted number is finite and not
    negative. Nothing runs."""
    monkeypatch.chdir(tmp_path)
    argv = [*command.split(), *BASE_FLAGS.get(command, []), f"{flag}={value}"]
    try:
        args = build_parser(argv).parse_args(argv)  # loads only this command's group
    except SystemExit as exc:
        assert exc.code == 2
        assert flag in capsys.readouterr().err
        return
    parsed = getattr(args, next(a.dest for a in _actions(argv) if flag in a.option_strings))
    check = getattr(args, "check", None)
    if check is not None:
        try:
            check(args)
        except ConfigError:
            return
    if isinstance(parsed, int | float) and not isinstance(parsed, bool):
        assert math.isfinite(parsed) and parsed >= 0, f"{flag} {value!r} parsed as {parsed!r}"


def _actions(argv: list[str]) -> list[argparse.Action]:
    for command, parser in _leaf_parsers():
        if argv[: len(command.split())] == command.split():
            return parser._actions
    raise AssertionError(argv)


@pytest.fixture(scope="module")
def engine():
    with Engine("tiny", block_size=4, num_device_blocks=32) as e:
        yield e


REQUEST_DATA: dict[str, tuple[dict[str, Any], str]] = {
    "prompt of strings": ({"prompt": ["1", "2"]}, "prompt"),
    "prompt of floats": ({"prompt": [1.0, 2.0]}, "prompt"),
    "prompt of bools": ({"prompt": [True, False]}, "prompt"),
    "prompt None": ({"prompt": None}, "prompt"),
    "prompt bytes": ({"prompt": b"ab"}, "prompt"),
    "empty prompt": ({"prompt": []}, "prompt"),
    "token id out of vocabulary": ({"prompt": [10**9]}, "prompt"),
    "sampling by name": ({"sampling": "greedy"}, "sampling"),
    "sampling as a dict": ({"sampling": {"max_tokens": 2}}, "sampling"),
    "kv_transfer_params str": ({"kv_transfer_params": "x"}, "kv_transfer_params"),
    "kv_transfer_params list": ({"kv_transfer_params": [1]}, "kv_transfer_params"),
    "request id not a str": ({"request_id": 5}, "request_id"),
}


@pytest.mark.parametrize("case", sorted(REQUEST_DATA))
def test_bad_request_data_is_refused_naming_it(engine: Engine, case: str) -> None:
    overrides, field = REQUEST_DATA[case]
    kwargs: dict[str, Any] = {"prompt": [1, 2, 3], **overrides}
    with pytest.raises(ConfigError) as info:
        engine.add_request(**kwargs)
    assert info.value.field.split(".")[0] == field
    assert not engine.has_unfinished()


def test_generate_refuses_a_bare_string_and_unknown_engine_settings(engine: Engine) -> None:
    with pytest.raises(ConfigError) as info:
        engine.generate("hello")  # would otherwise be five one-character prompts
    assert info.value.field == "prompts"
    with pytest.raises(ConfigError) as info:
        engine.generate([[1, 2]], "greedy")  # type: ignore[arg-type]  # a bad type, on purpose
    assert info.value.field == "sampling"
    with pytest.raises(ConfigError) as info:
        Engine("tiny", num_device_block=8)  # a typo: not silently ignored, not a TypeError
    assert info.value.field == "num_device_block"


def test_a_two_block_device_cache_offloads() -> None:
    """The tiny model's cache is [blocks, layers=2, K/V=2, ...]: with 2 blocks, dims 0 and 1 are
    both 2. The engine says where its blocks are, so this is no ambiguity error."""
    with Engine("tiny", block_size=4, num_device_blocks=2, kv_offloading_size=0.001) as e:
        (out,) = e.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=2))
        assert len(out.output_token_ids) == 2


def test_a_host_tier_below_one_block_names_the_block_size() -> None:
    with pytest.raises(ConfigError) as info:
        Engine("tiny", block_size=4, num_device_blocks=8, kv_offloading_size=1e-12)
    assert info.value.field == "kv_offloading_size"
    message = str(info.value)
    assert "block_size 4" in message and "2048 bytes" in message and "at least" in message

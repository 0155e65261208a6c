"""``--config FILE.yaml`` on every command, as vLLM's ``--config``.

The file is a YAML mapping whose keys are the command's long flag names, with ``-`` or ``_``
(``kv-offloading-size`` or ``kv_offloading_size``), and whose values are the flags' values: a
number or a string; ``true`` / ``false`` for a switch (``false`` on a ``--[no-]`` flag gives the
``--no-`` spelling); a list for a flag given several times or taking several values; a mapping
for a JSON flag (``kv_events_config: {enable_kv_cache_events: true, ...}``); ``null`` leaves the
flag unset. The file's settings become flags read before the command line's, and a flag given on
the command line replaces the file's (its whole list, and the other flags of its mutually
exclusive group), so that the parsed namespace is the one the same flags give. A key no flag of
the command has is a usage error naming it (exit status 2), never ignored.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

__all__ = ["add_config_flag", "apply_config_file", "command_parsers"]

_DEST = "config"


def add_config_flag(parser: argparse.ArgumentParser) -> None:
    """``--config FILE.yaml`` on ``parser`` (a command's own parser)."""
    parser.add_argument(
        "--config",
        metavar="FILE.yaml",
        help="read flags from this YAML file (keys: the long flag names, with - or _); flags "
        "given on the command line override it (default: none)",
    )


def command_parsers(parser: argparse.ArgumentParser) -> Iterator[argparse.ArgumentParser]:
    """Every command's parser under ``parser``: those that run something (set ``func``)."""
    if parser.get_default("func") is not None:
        yield parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in dict.fromkeys(action.choices.values()):
                yield from command_parsers(sub)


def apply_config_file(
    argv: Sequence[str],
    args: argparse.Namespace,
    parse: Callable[[list[str]], argparse.Namespace],
) -> argparse.Namespace:
    """``args`` (parsed from ``argv``) with its ``--config`` file's settings under the flags
    given: ``parse`` is called again on the command's words, the file's flags, then the command
    line's. ``args`` as it is without ``--config``."""
    path = getattr(args, _DEST, None)
    leaf: argparse.ArgumentParser | None = getattr(args, "parser", None)
    if path is None or leaf is None:
        return args
    words = len(leaf.prog.split()) - 1  # "kvoffload bench serve": argv starts "bench serve"
    command, own = list(argv[:words]), list(argv[words:])
    return parse([*command, *_file_argv(leaf, path, _given(leaf, own)), *own])


def _given(leaf: argparse.ArgumentParser, own: list[str]) -> set[str]:
    """The settings ``own`` (the command line after the command's words) sets."""
    unset = object()
    namespace = argparse.Namespace(**{
        a.dest: None if isinstance(a, argparse._AppendAction) else unset
        for a in leaf._actions if a.dest != argparse.SUPPRESS
    })
    before = dict(vars(namespace))
    parsed, _ = leaf.parse_known_args(own, namespace)
    return {dest for dest, value in vars(parsed).items() if value is not before.get(dest, unset)}


def _load(leaf: argparse.ArgumentParser, path: str) -> Mapping[Any, Any]:
    import yaml

    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as exc:
        leaf.error(f"--config {path}: {exc.strerror or exc}")
    except yaml.YAMLError as exc:
        leaf.error(f"--config {path}: not valid YAML: {str(exc).splitlines()[0]}")
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        leaf.error(f"--config {path}: must be a mapping of flag names to values, not a "
                   f"{type(data).__name__}")
    return data


def _file_argv(leaf: argparse.ArgumentParser, path: str, given: set[str]) -> list[str]:
    """The file's settings as flags, less those the command line sets (or excludes)."""
    data = _load(leaf, path)
    by_option = {
        option: action
        for action in leaf._actions
        for option in action.option_strings
        if option.startswith("--") and action.dest not in ("help", _DEST)
    }
    skip = set(given)
    for group in leaf._mutually_exclusive_groups:
        if any(a.dest in given for a in group._group_actions):
            skip.update(a.dest for a in group._group_actions)
    unknown = [str(key) for key in data if "--" + str(key).replace("_", "-") not in by_option]
    if unknown:
        leaf.error(f"--config {path}: unknown keys: {', '.join(unknown)} (keys are "
                   f"{leaf.prog}'s long flag names; {leaf.prog} --help lists them)")
    tokens: list[str] = []
    for key, value in data.items():
        option = "--" + str(key).replace("_", "-")
        action = by_option[option]
        if action.dest in skip or value is None:
            continue
        tokens += _tokens(leaf, path, str(key), option, action, value)
    return tokens


def _tokens(
    leaf: argparse.ArgumentParser, path: str, key: str, option: str, action: argparse.Action,
    value: Any,
) -> list[str]:
    """``key: value`` as command-line words."""
    if action.nargs == 0:  # a switch
        if not isinstance(value, bool):
            leaf.error(f"--config {path}: {key}: must be true or false, got {value!r}")
        if value:
            return [option]
        if isinstance(action, argparse.BooleanOptionalAction):
            return ["--" + option[5:] if option.startswith("--no-") else "--no-" + option[2:]]
        return []
    items = list(value) if isinstance(value, list) else [value]
    if isinstance(action, argparse._AppendAction):
        return [f"{option}={_word(item)}" for item in items]
    if action.nargs is None or action.nargs == "?":
        if isinstance(value, list):
            leaf.error(f"--config {path}: {key}: takes one value, got a list")
        return [f"{option}={_word(value)}"]
    return [option, *map(_word, items)]


def _word(value: Any) -> str:
    """One YAML value as a command-line word (a mapping or list: JSON)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, Mapping | list):
        return json.dumps(value)
    return str(value)

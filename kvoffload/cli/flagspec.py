"""One rule per command-line flag, rendered into argparse and applied once.

A :class:`Flag` holds everything about one flag: the setting it sets (``dest``), how its value is
parsed (type and range, :mod:`kvoffload.cli.args`), its default, its unit (shown as the metavar),
its help, what it needs to have any effect (:class:`Needs`: a flag given without it is refused,
never silently ignored), its deprecated spellings and its ``--help`` section. :func:`add_flags`
adds a table of flags to a parser; :func:`resolve_flags` applies the rules to what was parsed and
fills in the defaults (a :class:`MachineDefault` is computed then).

Invariant: every flag of a table parses to ``None`` when it is not given, so the rules can tell a
flag the user gave from a default; ``--help`` states each default once, as the table has it.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from kvoffload.errors import ConfigError

__all__ = ["Flag", "MachineDefault", "Needs", "add_flags", "help_section", "resolve_flags"]

#: Where a parser keeps its tables' rules: ``[(Flag, default), ...]`` (a parser default).
_RULES = "_flag_rules"


@dataclass(frozen=True)
class Needs:
    """What a flag needs to have any effect. ``text`` names it in errors and in ``--help``
    (``"--kv-disk-path"``); ``present(flags, provided)`` says whether the resolved flags have it,
    ``provided`` being what the command supplies itself (e.g. ``{"remote"}`` where it starts its
    own Redis server)."""

    text: str
    present: Callable[[argparse.Namespace, Collection[str]], bool]


@dataclass(frozen=True)
class MachineDefault:
    """A default read from the machine when the flags are resolved (never while ``--help`` is
    built): ``value()`` computes it, ``text`` states the rule in ``--help``."""

    text: str
    value: Callable[[], Any]


@dataclass(frozen=True)
class Flag:
    """One flag. ``kind``: ``value`` takes an argument (``parse`` converts and range-checks it;
    ``choices`` lists the allowed words, a callable is called when the flag is added), ``append``
    one per use (a tuple), ``switch`` is ``--flag`` alone, ``negatable`` adds ``--no-flag``. ``unset``: how a ``None`` default reads
    in ``--help``. ``group``: flags of one group exclude each other, and their defaults apply only
    when none of them is given. ``aliases``: deprecated spellings, accepted with a one-line
    notice. ``section``: the ``--help`` heading it is listed under (unset: the one
    :func:`add_flags` is given for its table)."""

    dest: str
    help: str
    parse: Callable[[str], Any] | None = None
    default: Any = None
    unit: str | None = None
    choices: Callable[[], Sequence[str]] | Sequence[str] | None = None
    kind: Literal["value", "append", "switch", "negatable"] = "value"
    needs: Needs | None = None
    unset: str = "unset"
    aliases: tuple[str, ...] = ()
    group: str | None = None
    section: str | None = None

    @property
    def option(self) -> str:
        return "--" + self.dest.replace("_", "-")

    def default_text(self, default: Any) -> str:
        """How ``default`` reads in ``--help``."""
        if isinstance(default, MachineDefault):
            return default.text
        if default is None or default == ():
            return "off" if self.kind in ("switch", "negatable") else self.unset
        if isinstance(default, bool):
            return "on" if default else "off"
        if isinstance(default, float):
            return f"{default:g}"
        return str(default)

    def help_text(self, default: Any) -> str:
        """The help line: what it is, its range, what it needs, its old spellings, its default
        (stated once)."""
        text = self.help
        bound = getattr(self.parse, "bound", None)
        if bound is not None:
            text += f", {bound}"
        if self.needs is not None:
            text += f"; needs {self.needs.text}"
        if self.aliases:
            text += f"; formerly {', '.join(self.aliases)}"
        return f"{text} (default: {self.default_text(default)})".replace("%", "%%")


class _DeprecatedSpelling(argparse.Action):
    """An old spelling of a flag: sets the same setting, after a one-line notice on stderr."""

    def __init__(self, option_strings: list[str], dest: str, new: str, switch: bool, **kwargs: Any):
        super().__init__(option_strings, dest, nargs=0 if switch else None, **kwargs)
        self.new = new
        self.switch = switch

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        print(
            f"{parser.prog}: warning: {option_string} is deprecated; use {self.new}",
            file=sys.stderr,
        )
        setattr(namespace, self.dest, True if self.switch else values)


def add_flags(
    parser: argparse.ArgumentParser,
    table: Sequence[Flag],
    defaults: Mapping[str, Any] | None = None,
    exclude: Collection[str] = (),
    section: str | None = None,
) -> None:
    """Add every flag of ``table`` (less the settings in ``exclude``) to ``parser``, with the
    table's defaults overridden by ``defaults`` (setting -> value), and record their rules for
    :func:`resolve_flags`. ``--help`` lists each flag under its own ``section``, else under
    ``section``, else under the parser's "options"; one heading per title, whichever table adds
    to it."""
    defaults = dict(defaults or {})
    unknown = set(defaults) - {f.dest for f in table}
    if unknown:
        raise ValueError(f"defaults for flags not in the table: {sorted(unknown)}")
    rules = list(parser.get_default(_RULES) or [])
    groups: dict[str, Any] = {}
    for flag in table:
        if flag.dest in exclude:
            continue
        default = defaults.get(flag.dest, flag.default)
        heading = help_section(parser, flag.section or section)
        target: Any = heading
        if flag.group is not None:
            if flag.group not in groups:
                groups[flag.group] = heading.add_mutually_exclusive_group()
            target = groups[flag.group]
        target.add_argument(flag.option, **_argument(flag, default))
        for old in flag.aliases:
            heading.add_argument(old, **_alias_argument(flag))
        rules.append((flag, default))
    parser.set_defaults(**{_RULES: rules})


def help_section(parser: argparse.ArgumentParser, title: str | None) -> Any:
    """The argument group titled ``title`` (made on first use), or ``parser`` for none."""
    if title is None:
        return parser
    for group in parser._action_groups:
        if group.title == title:
            return group
    return parser.add_argument_group(title)


def _choices(flag: Flag) -> Sequence[str] | None:
    return flag.choices() if callable(flag.choices) else flag.choices


def _argument(flag: Flag, default: Any) -> dict[str, Any]:
    """``add_argument`` keywords of one flag (parsed default: ``None``, "not given")."""
    kwargs: dict[str, Any] = {"dest": flag.dest, "default": None}
    kwargs["help"] = flag.help_text(default)
    if flag.kind == "switch":
        kwargs["action"] = "store_true"
    elif flag.kind == "negatable":
        kwargs["action"] = argparse.BooleanOptionalAction
    else:
        kwargs["type"] = flag.parse
        kwargs["choices"] = _choices(flag)
        kwargs["metavar"] = flag.unit
        if flag.kind == "append":
            kwargs["action"] = "append"
    return kwargs


def _alias_argument(flag: Flag) -> dict[str, Any]:
    """``add_argument`` keywords of one deprecated spelling of ``flag`` (hidden from ``--help``)."""
    return {
        "action": _DeprecatedSpelling,
        "dest": flag.dest,
        "new": flag.option,
        "switch": flag.kind == "switch",
        "type": flag.parse,
        "choices": _choices(flag),
        "metavar": flag.unit,
        "default": None,
        "help": argparse.SUPPRESS,
    }


def resolve_flags(args: argparse.Namespace, provided: Collection[str] = ()) -> argparse.Namespace:
    """The flags with every default filled in, after the rules: a flag given without what it
    needs raises :class:`ConfigError` naming it. Leaves ``args`` as it is; an already resolved
    namespace is returned as it is."""
    rules: list[tuple[Flag, Any]] | None = getattr(args, _RULES, None)
    if rules is None:
        return args
    given = {flag.dest for flag, _ in rules if getattr(args, flag.dest) is not None}
    groups_given = {flag.group for flag, _ in rules if flag.group and flag.dest in given}
    resolved = argparse.Namespace(**{k: v for k, v in vars(args).items() if k != _RULES})
    for flag, default in rules:
        if flag.dest not in given and flag.group not in groups_given:
            value = default.value() if isinstance(default, MachineDefault) else default
            setattr(resolved, flag.dest, value)
        elif flag.kind == "append":
            setattr(resolved, flag.dest, tuple(getattr(args, flag.dest)))
    for flag, _ in rules:
        if flag.dest in given and flag.needs and not flag.needs.present(resolved, provided):
            raise ConfigError(flag.dest, f"{flag.option} has no effect without {flag.needs.text}")
    return resolved

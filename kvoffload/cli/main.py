"""``kvoffload`` entry point: one subcommand module per command group, imported on use. Every
command takes ``--config FILE.yaml`` (:mod:`kvoffload.cli.config_file`)."""

from __future__ import annotations

import argparse
import importlib
import sys

# command group -> module defining add_parser(subparsers); imported only when needed so that
# `kvoffload events listen` never imports torch.
_COMMAND_GROUPS = {
    "bench": "kvoffload.cli.bench",
    "events": "kvoffload.cli.events",
    "serve": "kvoffload.cli.serve",
    "route": "kvoffload.cli.route",
    "admin": "kvoffload.cli.admin",
}
#: Each group's line in ``kvoffload --help``: the help its module's parser gives it
#: (tests/test_cli_help_imports.py checks they agree), so that the top-level help, which builds
#: no group, imports none of their modules (nor numpy or torch).
_GROUP_HELP = {
    "bench": "benchmarks of the reference engine",
    "events": "KV cache events (ZMQ, vLLM wire format)",
    "serve": "an OpenAI-compatible server over the reference engine",
    "route": "a KV-aware router over OpenAI-compatible backends",
    "admin": "operator controls of a server or router: lookup, pin, unpin, clear, warm, pins",
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    from kvoffload import __version__
    from kvoffload.cli.args import CommandParser
    from kvoffload.cli.config_file import add_config_flag, command_parsers

    parser = CommandParser(prog="kvoffload", description="KV-cache offloading for LLM inference.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = parser.add_subparsers(
        dest="group", required=True, metavar="{" + ",".join(_COMMAND_GROUPS) + "}"
    )
    # Only the group argv names is built; with none named (``kvoffload --help``, a usage
    # error), every group is a placeholder with its help line.
    wanted = [a for a in argv if a in _COMMAND_GROUPS][:1]
    for name in _COMMAND_GROUPS:
        if name == "bench" and name in wanted:  # builds only the bench command argv names
            importlib.import_module(_COMMAND_GROUPS[name]).add_parser(sub, argv)
        elif name in wanted:
            importlib.import_module(_COMMAND_GROUPS[name]).add_parser(sub)
        else:
            sub.add_parser(name, help=_GROUP_HELP[name])
    for command in command_parsers(parser):
        add_config_flag(command)
    return parser


def parse_args(argv: list[str]) -> argparse.Namespace:
    """The command's flags, its ``--config`` file's under them; a usage error exits 2."""
    from kvoffload.cli.config_file import apply_config_file

    return apply_config_file(argv, _parse(argv), _parse)


def _parse(argv: list[str]) -> argparse.Namespace:
    args, unknown = build_parser(argv).parse_known_args(argv)
    if unknown:
        # The subcommand's usage, not the top-level one (leaf parsers set ``parser``).
        leaf = getattr(args, "parser", None)
        message = f"unrecognized arguments: {' '.join(unknown)}"
        if leaf is None:
            build_parser(argv).error(message)
        leaf.error(message)
    return args


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

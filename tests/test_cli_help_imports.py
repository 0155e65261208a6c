"""``kvoffload --help`` (no command) and ``kvoffload admin --help`` answer without importing
numpy or torch: the top-level help builds no command group (each is a placeholder with its help
line), and the admin group is HTTP only. Checked in a fresh interpreter that runs the real
entry point (``python -m kvoffload.cli.main``), our sources first."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from kvoffload.cli.main import _COMMAND_GROUPS, _GROUP_HELP, build_parser

HEAVY = ("numpy", "torch")

#: Runs the CLI as ``python -m kvoffload.cli.main ARGS`` would (ARGS: argv[1], JSON), then
#: prints on stderr (the help goes to stdout) its exit status and which modules of argv[2] (JSON)
#: the interpreter imported.
WRAPPER = """
import json, runpy, sys
args, watched = json.loads(sys.argv[1]), json.loads(sys.argv[2])
sys.argv = ["kvoffload", *args]
try:
    runpy.run_module("kvoffload.cli.main", run_name="__main__")
    code = 0
except SystemExit as exc:
    code = exc.code
print(json.dumps({"code": code, "heavy": [m for m in watched if m in sys.modules]}), file=sys.stderr)
"""


def run_cli(args: list[str]) -> tuple[str, dict[str, object]]:
    """``kvoffload ARGS`` in a fresh interpreter: its stdout, and the wrapper's report."""
    done = subprocess.run([sys.executable, "-c", WRAPPER, json.dumps(args), json.dumps(HEAVY)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return done.stdout, json.loads(done.stderr.strip().splitlines()[-1])


@pytest.mark.parametrize("args", [["--help"], ["admin", "--help"]], ids=" ".join)
def test_help_imports_neither_numpy_nor_torch(args: list[str]) -> None:
    out, report = run_cli(args)
    assert report == {"code": 0, "heavy": []}
    assert out.startswith("usage: kvoffload")


def test_top_level_help_lists_every_group_with_its_own_help_line() -> None:
    """The placeholders' help lines are those the groups' own parsers give (no drift), and the
    top-level help lists each."""
    out, _ = run_cli(["--help"])
    listed = " ".join(out.split())  # argparse wraps long help lines
    for group in _COMMAND_GROUPS:
        sub = next(a for a in build_parser([group])._actions
                   if isinstance(a, argparse._SubParsersAction))
        (line,) = [c.help for c in sub._choices_actions if c.dest == group]
        assert line == _GROUP_HELP[group]
        assert f"{group} {line}" in listed

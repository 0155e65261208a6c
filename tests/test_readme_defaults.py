"""The README's defaults table (section Configuration) is what the parsers and ``EngineConfig``
say: every row's default per command equals the one that command's ``--help`` states, and every
engine flag has a row."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from kvoffload.cli.config_file import command_parsers
from kvoffload.cli.engine_flags import ENGINE_FLAGS
from kvoffload.cli.main import build_parser
from kvoffload.engine import EngineConfig

README = Path(__file__).resolve().parent.parent / "README.md"
HEADER = "| Setting | Flag | `Engine(...)` | `serve` | `bench throughput` |"
NONE = "—"


def _table() -> list[list[str]]:
    lines = README.read_text().splitlines()
    start = lines.index(HEADER) + 2
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        rows.append([cell.strip().replace("`", "") for cell in line.strip("|").split(" | ")])
    return rows


def _defaults(command: list[str]) -> dict[str, str]:
    """Option -> the default its ``--help`` states, for one command."""
    parser = next(p for p in command_parsers(build_parser(command))
                  if p.prog == "kvoffload " + " ".join(command))
    return {flag.option: flag.default_text(default)
            for flag, default in parser.get_default("_flag_rules")}


def _engine_text(value: Any) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    return str(value)


ENGINE_DEFAULTS = {
    "--" + f.name.replace("_", "-"): _engine_text(f.default)
    for f in dataclasses.fields(EngineConfig)
    if f.init and f.default is not dataclasses.MISSING
}


def test_the_readme_states_each_commands_defaults() -> None:
    columns = {2: ENGINE_DEFAULTS, 3: _defaults(["serve"]), 4: _defaults(["bench", "throughput"])}
    rows = _table()
    assert len(rows) > 20
    checked = 0
    for row in rows:
        assert len(row) == 5, row
        if row[1] == NONE:
            continue
        options = [re.sub(r"^--\[no-\]", "--", o) for o in row[1].split(", ")]
        for column, defaults in columns.items():
            cell_text = row[column]
            cells = [cell_text] if len(options) == 1 else (
                [NONE] * len(options) if cell_text == NONE else cell_text.split(", "))
            assert len(cells) == len(options), row
            for option, cell in zip(options, cells, strict=True):
                expected = defaults.get(option, NONE)
                assert cell == expected, f"{option} in column {HEADER.split('|')[column + 1]}: " \
                                         f"README says {cell!r}, the parser {expected!r}"
                checked += 1
    assert checked > 90


def test_every_engine_flag_has_a_row() -> None:
    listed = {re.sub(r"^--\[no-\]", "--", o) for row in _table() for o in row[1].split(", ")}
    assert {f.option for f in ENGINE_FLAGS} <= listed
    assert set(_defaults(["serve"])) <= listed


def test_the_readmes_config_example_is_valid(tmp_path: Path) -> None:
    """The README's ``--config`` example parses (every key a flag of the command it names)."""
    from kvoffload.cli.main import parse_args

    (block,) = re.findall(r"```yaml\n(# kvoffload (.*?)\n.*?)```", README.read_text(), re.S)
    text, command = block
    path = tmp_path / "serve.yaml"
    path.write_text(text)
    argv = [path.name if w == "serve.yaml" else w for w in command.split()]
    args = parse_args([str(path) if w == path.name else w for w in argv])
    assert args.kv_offloading_size == 8 and args.port == 8001  # the file's and the flag's

"""Every Python snippet in README.md and docs/ runs as written, in a fresh interpreter from the
repository root, and prints what the docs say it prints.

The conventions (README, "Development"):

* a block fenced ``python`` runs; ``python fragment`` marks an excerpt (signatures, code that
  needs a surrounding program): it is only parsed;
* a block fenced ``output`` is what the ``python`` block before it prints (no other fenced block
  between them), line for line: a stale figure (a token count, a hit ratio) fails this test;
* in an ``output`` block, a number written ``~1.23`` depends on the machine (a timing, a rate):
  any number matches it. Every other character must be exactly what is printed.

Snippets that run the ``small`` model are marked slow.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```(\w*)([^\n]*)\n(.*?)^```\s*$", re.M | re.S)
#: ``~`` then a number, in an ``output`` block: a machine-dependent figure.
MACHINE_DEPENDENT = re.compile(r"~-?\d+(?:\.\d+)?")
ANY_NUMBER = r"-?\d+(?:\.\d+)?"


@dataclass(frozen=True)
class Snippet:
    name: str  # path:line
    info: str  # what follows "python" on the fence line
    code: str
    output: str | None  # the ``output`` block that follows it, if any


def _snippets() -> tuple[list[Snippet], list[str]]:
    """Every python block in file order, and the names of ``output`` blocks that follow no
    runnable python block."""
    snippets: list[Snippet] = []
    orphans: list[str] = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        previous: Snippet | None = None  # the python block just before, if the last fence was one
        for match in FENCE.finditer(text):
            lang, info, body = match.group(1), match.group(2).strip(), match.group(3)
            name = f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, match.start()) + 1}"
            if lang == "output":
                if previous is None or previous.info == "fragment":
                    orphans.append(name)
                else:
                    snippets[-1] = Snippet(previous.name, previous.info, previous.code, body)
                previous = None
            elif lang == "python":
                previous = Snippet(name, info, body, None)
                snippets.append(previous)
            else:
                previous = None
    return snippets, orphans


SNIPPETS, ORPHAN_OUTPUTS = _snippets()
RUNNABLE = [
    pytest.param(s, id=s.name, marks=[pytest.mark.slow] if '"small"' in s.code else [])
    for s in SNIPPETS
    if s.info != "fragment"
]


def output_pattern(expected: str) -> re.Pattern[str]:
    """A pattern for the printed text an ``output`` block shows (``~number``: any number)."""
    lines = expected.rstrip("\n").split("\n")
    parts = []
    for line in lines:
        pieces = MACHINE_DEPENDENT.split(line.rstrip())
        parts.append(ANY_NUMBER.join(re.escape(piece) for piece in pieces) + r"[ \t]*")
    return re.compile("\n".join(parts) + r"\n?\Z")


def test_snippets_are_found_and_fragments_are_marked() -> None:
    assert len(RUNNABLE) >= 6
    assert sum(s.output is not None for s in SNIPPETS) >= 4
    assert not ORPHAN_OUTPUTS, (
        f"output blocks that follow no runnable python block: {ORPHAN_OUTPUTS}"
    )
    for s in SNIPPETS:
        assert s.info in ("", "fragment"), f"{s.name}: unknown fence info {s.info!r}"
        if s.info == "":
            ast.parse(s.code, filename=s.name)


def test_the_output_convention() -> None:
    """What the marker accepts and what it does not: the test can fail."""
    pattern = output_pattern("874 prompt tokens: 704 from the host tier, TTFT ~0.83 s\n")
    assert pattern.match("874 prompt tokens: 704 from the host tier, TTFT 12.5 s\n")
    assert not pattern.match("874 prompt tokens: 703 from the host tier, TTFT 12.5 s\n")
    assert not pattern.match("874 prompt tokens: 704 from the host tier, TTFT 12.5 s\nmore\n")
    assert not output_pattern("{'host': 704}").match("{'host': 704.0}")


@pytest.mark.parametrize("snippet", RUNNABLE)
def test_snippet_runs_and_prints_what_the_docs_show(snippet: Snippet, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}
    result = subprocess.run(
        [sys.executable, "-c", snippet.code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    if snippet.output is not None:
        assert output_pattern(snippet.output).match(result.stdout), (
            f"{snippet.name} prints\n{result.stdout}\nbut the docs show\n{snippet.output}"
        )

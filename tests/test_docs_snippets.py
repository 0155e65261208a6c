"""Every Python snippet in README.md and docs/ runs as written, in a fresh interpreter from the
repository root. Blocks fenced ``python fragment`` are excerpts (signatures, code that needs a
surrounding program) and are only parsed. Snippets that run the ``small`` model are marked slow."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FENCE = re.compile(r"^```python([^\n]*)\n(.*?)^```\s*$", re.M | re.S)


def _snippets() -> list[tuple[str, str, str]]:
    """``(id, info after "python", code)`` for every python block, in file order."""
    out = []
    for path in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = path.read_text()
        for match in FENCE.finditer(text):
            line = text.count("\n", 0, match.start()) + 1
            out.append((f"{path.relative_to(ROOT)}:{line}", match.group(1).strip(), match.group(2)))
    return out


SNIPPETS = _snippets()
RUNNABLE = [
    pytest.param(code, id=name, marks=[pytest.mark.slow] if '"small"' in code else [])
    for name, info, code in SNIPPETS
    if info != "fragment"
]


def test_snippets_are_found_and_fragments_are_marked() -> None:
    assert len(RUNNABLE) >= 6
    for name, info, code in SNIPPETS:
        assert info in ("", "fragment"), f"{name}: unknown fence info {info!r}"
        if info == "":
            ast.parse(code, filename=name)


@pytest.mark.parametrize("code", RUNNABLE)
def test_snippet_runs(code: str, tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_WAIT_POLICY": "PASSIVE"}
    result = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=280,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    if "from the host tier" in code:  # the engine examples claim host-tier hits: show them
        assert re.search(r"\b[1-9]\d* from the host tier", result.stdout), result.stdout

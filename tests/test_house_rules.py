"""Rules of the house that no single module's tests see: runtime checks survive ``python -O``."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "kvoffload"


def asserts_outside_invariant_checks(source: str) -> list[int]:
    """Lines of ``assert`` statements in ``source`` outside functions whose name says they check
    invariants (``check_invariants``, ``_check_invariants``: debug hooks the tests call, where a
    bare assert is the point)."""
    tree = ast.parse(source)
    allowed: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and "invariant" in node.name:
            allowed |= {id(inner) for inner in ast.walk(node)}
    return [n.lineno for n in ast.walk(tree) if isinstance(n, ast.Assert) and id(n) not in allowed]


def test_no_runtime_check_is_an_assert() -> None:
    """``python -O`` strips asserts: a check of runtime state must raise (``ContractError``,
    ``ConfigError``, ``ProtocolError``, ...), not assert."""
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for line in asserts_outside_invariant_checks(path.read_text())
    ]
    assert not found, f"asserts guarding runtime state: {found}"


def test_the_check_sees_an_assert_and_spares_invariant_hooks() -> None:
    source = (
        "def run(x):\n    assert x is not None\n"
        "def check_invariants(self):\n    assert self.ok\n"
    )
    assert asserts_outside_invariant_checks(source) == [2]

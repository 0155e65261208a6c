"""Modules import downward only: the layers of docs/architecture.md, checked on every ``kvoffload``
import in the package, those inside functions and ``TYPE_CHECKING`` blocks included."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "kvoffload"

#: Module (or package) -> its layer, longest dotted prefix wins (docs/architecture.md, "Layers").
LAYERS: dict[str, int] = {
    "kvoffload._lazy": 1,
    "kvoffload.errors": 1,
    "kvoffload.keys": 1,
    "kvoffload.manager_contract": 1,
    "kvoffload.load_store_specs": 1,
    "kvoffload.transfer": 1,
    "kvoffload.validation": 1,
    "kvoffload.identity": 1,
    "kvoffload.filedigest": 1,
    "kvoffload.checkpoint_files": 1,
    "kvoffload.events.messages": 1,
    "kvoffload.eviction": 2,
    "kvoffload.managers": 3,
    "kvoffload.tiers": 3,
    # The package's own exports (data types, policies, managers): importable from layer 3 up.
    "kvoffload": 3,
    "kvoffload.scheduler": 4,
    "kvoffload.worker": 4,
    "kvoffload.events": 4,
    "kvoffload.metrics": 4,
    "kvoffload.engine": 5,
    "kvoffload.integrations": 5,
    "kvoffload.serving": 6,
    "kvoffload.routing": 6,
    "kvoffload.cli": 7,
    "kvoffload.benchmark": 7,
    "kvoffload.servebench": 7,
}


def layer_of(module: str) -> int:
    """The layer of ``module``: that of its longest prefix in :data:`LAYERS`."""
    parts = module.split(".")
    for n in range(len(parts), 0, -1):
        layer = LAYERS.get(".".join(parts[:n]))
        if layer is not None:
            return layer
    raise KeyError(module)


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of every absolute ``kvoffload`` import in ``path`` (relative imports
    are refused by the package's style, so they count as errors here too)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            assert node.level == 0, f"{path}:{node.lineno}: relative import"
            if node.module and node.module.split(".")[0] == "kvoffload":
                found.append((node.lineno, node.module))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("kvoffload")]
    return found


SOURCES = sorted(PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer() -> None:
    assert SOURCES
    for path in SOURCES:
        layer_of(module_name(path))


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: module_name(p))
def test_imports_go_downward(path: Path) -> None:
    own = layer_of(module_name(path))
    upward = [
        f"{module_name(path)} (layer {own}) imports {target} (layer {layer_of(target)}), line {line}"
        for line, target in imported_modules(path)
        if layer_of(target) > own
    ]
    assert not upward, "\n".join(upward)


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    """The checker itself: a policy module importing the engine is caught."""
    source = "def f():\n    from kvoffload.engine.engine import Engine\n"
    (tmp_path / "x.py").write_text(source)
    targets = imported_modules(tmp_path / "x.py")
    assert targets == [(2, "kvoffload.engine.engine")]
    assert layer_of("kvoffload.eviction.x") < layer_of(targets[0][1])


#: The tiers' rooms (docs/architecture.md, "The tiers"): each wing imports the shared contract,
#: block format and factory below it, never the other wing; inside the Redis wing the wire (how it
#: talks) never imports the tier (what it stores).
DISK_WING = "kvoffload.tiers.disk"
REDIS_WING = "kvoffload.tiers.redis"
REDIS_WIRE = tuple(
    f"kvoffload.tiers.redis.{name}" for name in ("connection", "messages", "topology", "transport", "url")
)


def _within(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def wing_violations(path: Path) -> list[str]:
    """Imports in ``path`` that cross from one tier wing into the other, or from the Redis wire
    up into the Redis tier."""
    own = module_name(path)
    found = []
    for line, target in imported_modules(path):
        crossing = (_within(own, DISK_WING) and _within(target, REDIS_WING)) or (
            _within(own, REDIS_WING) and _within(target, DISK_WING)
        )
        wire_up = own in REDIS_WIRE and _within(target, REDIS_WING) and target not in REDIS_WIRE
        if crossing or wire_up:
            found.append(f"{own} imports {target}, line {line}")
    return found


def test_each_tier_wing_keeps_to_itself() -> None:
    violations = [v for path in SOURCES for v in wing_violations(path)]
    assert not violations, "\n".join(violations)
    wings = {module_name(p).split(".")[2] for p in SOURCES if module_name(p).count(".") >= 3}
    assert {"disk", "redis"} <= wings, "the tiers' wings moved: update DISK_WING / REDIS_WING"


def test_the_wing_check_sees_a_crossing(tmp_path: Path) -> None:
    """The checker itself: the disk wing importing the Redis transport is caught (a module file
    placed as if it were in the disk wing)."""
    wing = tmp_path / "kvoffload" / "tiers" / "disk"
    wing.mkdir(parents=True)
    (wing / "x.py").write_text("from kvoffload.tiers.redis.transport import RedisTransport\n")
    own = ".".join((wing / "x.py").relative_to(tmp_path).with_suffix("").parts)
    assert _within(own, DISK_WING)
    assert any(_within(t, REDIS_WING) for _, t in imported_modules(wing / "x.py"))

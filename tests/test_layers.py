"""The package's layers: every import inside nccl_back goes down the layers, never up
or sideways into a sibling layer, and no module is longer than the code map allows."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parents[1] / "nccl_back"

#: Layer of each top-level module or subpackage, bottom first (ARCHITECTURE.md).
LAYERS: dict[str, int] = {
    **dict.fromkeys(["errors", "transport_kinds", "_clock", "files", "bounded_json", "log",
                     "metrics", "config", "redis_url", "result", "budget", "timing"], 0),
    "model": 1,
    "coord": 2,
    "transport": 3,
    "load": 4,
    "caches": 5,
    "sidecar": 5,
    "engines": 6,
    "check": 7,
    "dev": 7,
    **dict.fromkeys(["cli", "__init__"], 8),
}
#: Modules of the common layer may import each other in this order only.
COMMON_ORDER = ["errors", "transport_kinds", "_clock", "files", "timing", "budget", "bounded_json",
                "redis_url", "log", "metrics", "config", "result"]
MAX_LINES = 500


def _modules() -> list[Path]:
    return sorted(PKG.rglob("*.py"))


def _unit(path: Path) -> str:
    """The top-level module or subpackage ``path`` belongs to."""
    rel = path.relative_to(PKG)
    return rel.parts[0] if len(rel.parts) > 1 else rel.stem


def _imported_units(path: Path) -> set[str]:
    units: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module == "nccl_back":
                names = [f"nccl_back.{a.name}" for a in node.names]
            else:
                names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[0] == "nccl_back" and len(parts) > 1:
                units.add(parts[1])
    return units


def test_every_module_is_assigned_a_layer() -> None:
    """Each top-level module and subpackage has a place in the layer table."""
    units = {_unit(p) for p in _modules()}
    assert sorted(units - set(LAYERS)) == []


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_imports_go_down_the_layers(path: Path) -> None:
    """A module imports only from lower layers or its own subpackage (common modules in
    their fixed order), so the package has no import cycles between layers."""
    me = _unit(path)
    up = []
    for unit in _imported_units(path) - {me}:
        if unit not in LAYERS:
            continue
        if LAYERS[me] == 0 and LAYERS[unit] == 0:
            if COMMON_ORDER.index(unit) > COMMON_ORDER.index(me):
                up.append(unit)
        elif LAYERS[unit] >= LAYERS[me]:
            up.append(unit)
    assert sorted(up) == [], f"{path.relative_to(PKG)} imports from its own or a higher layer"


@pytest.mark.parametrize("path", _modules(), ids=lambda p: str(p.relative_to(PKG)))
def test_modules_are_small_enough_to_read_in_one_sitting(path: Path) -> None:
    """No module is longer than the code map's limit."""
    assert len(path.read_text().splitlines()) <= MAX_LINES

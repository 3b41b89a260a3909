"""The import direction of docs/architecture.md, checked on the source."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "mlxq"

# layer -> layers it must never import
FORBIDDEN = {
    "engine": {"server", "cli", "bench", "golden"},
    "kv": {"server", "cli", "engine", "store", "models", "bench", "golden", "distributed"},
    "store": {"server", "cli", "engine", "bench", "golden", "distributed"},
    "models": {"server", "cli", "engine", "store", "kv", "bench", "golden", "distributed"},
    "distributed": {"server", "cli", "engine", "store", "kv", "models", "bench", "golden"},
    "server": {"cli", "bench", "golden"},
    "bench": {"server", "engine", "cli", "kv", "store", "golden", "distributed"},
    "golden": {"server", "cli", "bench", "engine"},
}


def imported_layers(path: Path) -> set[str]:
    layers = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "mlxq" and len(parts) > 1:
                layers.add(parts[1])
    return layers


def test_layers_import_only_downwards():
    problems = []
    for layer, forbidden in FORBIDDEN.items():
        for path in (PACKAGE / layer).rglob("*.py"):
            bad = imported_layers(path) & forbidden
            if bad:
                problems.append(f"{path.relative_to(PACKAGE)} imports {sorted(bad)}")
    assert not problems, problems

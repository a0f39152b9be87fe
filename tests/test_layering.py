"""The package's imports follow docs/architecture.md's layers: none runs up a layer, none closes a circle."""

from __future__ import annotations

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pytest_fp8gate"


def _layers() -> dict[str, int]:
    """Module -> layer index from the table in docs/architecture.md (its first row is the top layer)."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:3] for line in section.splitlines() if re.match(r"\| [a-z]+ \| `", line)]
    count = len(rows)
    return {name: count - i for i, (_, modules) in enumerate(rows) for name in re.findall(r"`([a-z_0-9]+)`", modules)}


def _imports() -> dict[str, set[str]]:
    """Module (a top-level file, or a subpackage as one) -> the package modules it imports."""
    found: dict[str, set[str]] = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE).parts
        if parts[0] in ("__init__.py", "assets"):
            continue
        module = parts[0].removesuffix(".py")
        targets = found.setdefault(module, set())
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.level:
                where = [*parts[:-1]][: len(parts) - node.level] + [p for p in (node.module or "").split(".") if p]
                targets.update(where[:1] if where else [alias.name for alias in node.names])
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "pytest_fp8gate":
                names = node.module.split(".")[1:2] if node.module and "." in node.module else []
                targets.update(names or [alias.name for alias in node.names])
        targets.discard(module)
    return found


def test_every_module_has_a_layer_and_imports_none_above_its_own() -> None:
    layers, imports = _layers(), _imports()
    assert sorted(set(imports) - set(layers)) == [], "modules missing from docs/architecture.md's layer table"
    assert sorted(set(layers) - set(imports)) == [], "docs/architecture.md lists modules that do not exist"
    upward = sorted(f"{module} -> {target}" for module, targets in imports.items() for target in targets
                    if target in layers and layers[target] > layers[module])
    assert upward == []


def test_no_import_circle() -> None:
    imports = _imports()
    state: dict[str, str] = {}

    def visit(module: str, trail: tuple[str, ...]) -> None:
        state[module] = "open"
        for target in sorted(imports.get(module, ())):
            assert state.get(target) != "open", " -> ".join((*trail, module, target))
            if target not in state:
                visit(target, (*trail, module))
        state[module] = "done"

    for module in sorted(imports):
        if module not in state:
            visit(module, ())

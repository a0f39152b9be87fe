"""The package's import graph, from its source alone: modules, layers, arrows, what runs up, circles.

    python scripts/import_graph.py        # from the repository root; prints the figures

A module is a top-level file of pytest_fp8gate/ (a subpackage counts as one module). Its layer comes
from the table in docs/architecture.md (the table's first row is the top layer). tests/test_layering.py
checks the same graph.
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pytest_fp8gate"


def layers() -> dict[str, int]:
    """Module -> layer rank from docs/architecture.md's layer table (higher is further up)."""
    text = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    section = text.split("## Layers", 1)[1].split("\n## ", 1)[0]
    rows = [line.split("|")[1:3] for line in section.splitlines() if re.match(r"\| [a-z]+ \| `", line)]
    count = len(rows)
    return {name: count - i for i, (_, modules) in enumerate(rows) for name in re.findall(r"`([a-z_0-9]+)`", modules)}


def _sources() -> list[tuple[tuple[str, ...], Path]]:
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).parts
        if parts[0] not in ("__init__.py", "assets"):
            found.append((parts, path))
    return found


def imports() -> dict[str, set[str]]:
    """Module -> the package modules it imports."""
    found: dict[str, set[str]] = {}
    for parts, path in _sources():
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


def upward(layer_of: dict[str, int], graph: dict[str, set[str]]) -> list[str]:
    """The imports that run up a layer, as "module -> target"."""
    return sorted(f"{module} -> {target}" for module, targets in graph.items() for target in targets
                  if target in layer_of and module in layer_of and layer_of[target] > layer_of[module])


def first_circle(graph: dict[str, set[str]]) -> list[str]:
    """One import circle as the modules along it, or [] when there is none."""
    state: dict[str, str] = {}

    def visit(module: str, trail: list[str]) -> list[str]:
        state[module] = "open"
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                return [*trail, module, target]
            if target not in state and (circle := visit(target, [*trail, module])):
                return circle
        state[module] = "done"
        return []

    for module in sorted(graph):
        if module not in state and (circle := visit(module, [])):
            return circle
    return []


def largest() -> tuple[tuple[int, str], tuple[int, str]]:
    """(lines, name) of the largest module file and of the largest class."""
    modules, classes = [], []
    for parts, path in _sources():
        text = path.read_text(encoding="utf-8")
        name = "/".join(parts)
        modules.append((len(text.splitlines()), name))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                classes.append((node.end_lineno - node.lineno + 1, f"{name}:{node.name}"))
    return max(modules), max(classes)


def main() -> int:
    layer_of, graph = layers(), imports()
    arrows = sum(len(targets) for targets in graph.values())
    (module_lines, module), (class_lines, cls) = largest()
    circle = first_circle(graph)
    print(f"modules {len(graph)}, layers {len(set(layer_of.values()))}, import arrows {arrows}")
    print(f"upward imports {len(upward(layer_of, graph))}, circles {'1+: ' + ' -> '.join(circle) if circle else 0}")
    print(f"largest module {module} ({module_lines} lines), largest class {cls} ({class_lines} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

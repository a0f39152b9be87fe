"""The package's import graph, from its source alone: rooms, floors, arrows, what runs up, circles.

    python scripts/import_graph.py        # from the repository root; prints the figures

A room is a folder of pytest_fp8gate/ (its modules at any depth) or a module at the package's root.
Each room stands on one floor (FLOORS, bottom first): a module imports only from its own floor or the
floors below, and the imports between modules run one way (no circle). tests/test_layering.py checks
the same graph; docs/architecture.md describes each floor.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "pytest_fp8gate"
ROOT_MODULE = ""  # the floor of the modules at the package's root (leaves every floor may import)
# Bottom first. plugin.py sits on top: pytest's entry point, which imports the face and the loader.
FLOORS = (ROOT_MODULE, "core", "config", "engines", "run", "judge", "report", "face", "tools", "plugin")


def _sources() -> list[tuple[str, Path]]:
    """(dotted module name inside the package, path), package __init__ files left out."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE).with_suffix("").parts
        if parts[0] != "assets" and parts[-1] != "__init__":
            found.append((".".join(parts), path))
    return found


def room(module: str) -> str:
    """The folder a module sits in, or the module itself at the package's root."""
    return module.split(".")[0]


def floor(module: str) -> int:
    """The floor of a module's room (higher is further up)."""
    name = room(module)
    return FLOORS.index(name) if name in FLOORS else FLOORS.index(ROOT_MODULE)


def imports() -> dict[str, set[str]]:
    """Module -> the package modules it imports (an import of a package's own names counts for none)."""
    modules = {name for name, _ in _sources()}
    found: dict[str, set[str]] = {}
    for module, path in _sources():
        targets = found.setdefault(module, set())
        here = module.split(".")[:-1]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if not isinstance(node, ast.ImportFrom):
                continue
            if node.level:
                base = here[: len(here) - node.level + 1]
            elif (node.module or "").split(".")[0] == "pytest_fp8gate":
                base = []
            else:
                continue
            stem = [*base, *[p for p in (node.module or "").split(".") if p and p != "pytest_fp8gate"]]
            for alias in node.names:
                for candidate in (".".join([*stem, alias.name]), ".".join(stem)):
                    if candidate in modules:
                        targets.add(candidate)
                        break
        targets.discard(module)
    return found


def upward(graph: dict[str, set[str]]) -> list[str]:
    """The imports that run up a floor, as "module -> target"."""
    return sorted(f"{module} -> {target}" for module, targets in graph.items() for target in targets
                  if floor(target) > floor(module))


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


def largest(within: str | None = None) -> tuple[tuple[int, str], tuple[int, str]]:
    """(lines, name) of the largest module file and of the largest class (``within``: of that room only)."""
    modules, classes = [], []
    for module, path in _sources():
        if within is not None and room(module) != within:
            continue
        text = path.read_text(encoding="utf-8")
        modules.append((len(text.splitlines()), module))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno is not None:
                classes.append((node.end_lineno - node.lineno + 1, f"{module}:{node.name}"))
    return max(modules), max(classes)


def main() -> int:
    graph = imports()
    rooms = {room(module) for module in graph}
    arrows = sum(len(targets) for targets in graph.values())
    room_arrows = {(room(m), room(t)) for m, targets in graph.items() for t in targets if room(m) != room(t)}
    (module_lines, module), (class_lines, cls) = largest()
    circle = first_circle(graph)
    folders = sorted(name for name in rooms if (PACKAGE / name).is_dir())
    print(f"modules {len(graph)}, rooms {len(rooms)} ({len(folders)} folders), "
          f"floors {len({floor(m) for m in graph})}, import arrows {arrows} ({len(room_arrows)} between rooms)")
    print(f"upward imports {len(upward(graph))}, circles {'1+: ' + ' -> '.join(circle) if circle else 0}")
    print(f"largest module {module} ({module_lines} lines), largest class {cls} ({class_lines} lines)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The package's imports follow docs/architecture.md's layers: none runs up a layer, none closes a circle."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "scripts" / "import_graph.py"
_spec = importlib.util.spec_from_file_location("import_graph", SCRIPT)
assert _spec is not None and _spec.loader is not None
graph = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(graph)


def test_every_module_has_a_layer_and_imports_none_above_its_own() -> None:
    layers, imports = graph.layers(), graph.imports()
    assert sorted(set(imports) - set(layers)) == [], "modules missing from docs/architecture.md's layer table"
    assert sorted(set(layers) - set(imports)) == [], "docs/architecture.md lists modules that do not exist"
    assert graph.upward(layers, imports) == []


def test_no_import_circle() -> None:
    assert graph.first_circle(graph.imports()) == []


def test_the_checks_catch_an_upward_import_and_a_circle() -> None:
    layers = {"low": 1, "high": 2}
    assert graph.upward(layers, {"low": {"high"}, "high": set()}) == ["low -> high"]
    assert graph.first_circle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


def test_the_reproduce_command_prints_the_figures() -> None:
    printed = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, check=True).stdout
    assert "modules " in printed and "upward imports 0, circles 0" in printed

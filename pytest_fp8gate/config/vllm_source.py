"""The installed vLLM's engine keys and environment variables, read from its source files without importing it.

Importing ``vllm.engine.arg_utils`` brings torch and most of vLLM (10 s of CPU, 30-40 s on a loaded 2-core
runner), which would make ``fp8gate check`` slow for any file with an engine key outside the gate's own list.
``EngineArgs`` is a plain dataclass and ``vllm.envs`` a dict literal, so their names are in the source. The
annotations are resolved as far as the source allows: builtins and typing, and the aliases, enums and config
classes vLLM defines (followed through its imports); an annotation that names anything else stays a string,
which the value check leaves unchecked (as it leaves an annotation vLLM itself did not resolve).
"""

from __future__ import annotations

import ast
import dataclasses
import enum
import functools
import importlib.util
import typing
from pathlib import Path
from typing import Any

from ..errors import UnsupportedEngine

_BASE = {name: getattr(typing, name) for name in ("Any", "Literal", "Optional", "Union", "TypeAlias")}
_BASE.update({t.__name__: t for t in (bool, int, float, str, bytes, dict, list, set, frozenset, tuple, type)})
_BASE["None"] = None
_DEPTH = 6  # alias chains are short; a deeper one is left as a string


@functools.cache
def _root() -> Path:
    spec = importlib.util.find_spec("vllm")  # locates the package without running its __init__
    if spec is None or not spec.submodule_search_locations:
        raise UnsupportedEngine("vllm is not installed")
    return Path(next(iter(spec.submodule_search_locations)))


def _module_file(module: str) -> Path | None:
    parts = module.split(".")
    if parts[0] != "vllm":
        return None
    base = _root().joinpath(*parts[1:])
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def _module_name(path: Path) -> str:
    parts = path.relative_to(_root().parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_enum(node: ast.ClassDef) -> bool:
    return any("Enum" in ast.unparse(base) for base in node.bases)


def _enum(node: ast.ClassDef) -> type[enum.Enum]:
    members = {}
    for item in node.body:
        if isinstance(item, ast.Assign) and len(item.targets) == 1 and isinstance(item.targets[0], ast.Name):
            name = item.targets[0].id
            if not name.startswith("_"):
                value = item.value
                members[name] = value.value if isinstance(value, ast.Constant) else name  # enum.auto(): its name
    return enum.Enum(node.name, members)  # type: ignore[return-value]


def _definition(name: str, path: Path, depth: int) -> Any:
    """What ``name`` means at the top level of ``path``, or raises LookupError."""
    if depth > _DEPTH:
        raise LookupError(name)
    for node in _tree(path).body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            # A config class vLLM builds from a table: an empty dataclass of its name stands for it.
            return _enum(node) if _is_enum(node) else dataclasses.make_dataclass(node.name, [])
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return _evaluate(node.value, path, depth + 1)
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name \
                and node.value is not None:
            return _evaluate(node.value, path, depth + 1)
        if isinstance(node, ast.ImportFrom):
            for alias in node.names:
                if (alias.asname or alias.name) == name:
                    if node.level:
                        package = _module_name(path).rsplit(".", node.level - (path.name == "__init__.py"))[0]
                        source = f"{package}.{node.module}" if node.module else package
                    else:
                        source = node.module or ""
                    found = _module_file(source)
                    if found is None:
                        raise LookupError(name)
                    return _definition(alias.name, found, depth + 1)
    raise LookupError(name)


def _evaluate(expr: ast.expr, path: Path, depth: int) -> Any:
    if isinstance(expr, ast.Constant) and isinstance(expr.value, str):  # a quoted annotation
        expr = ast.parse(expr.value, mode="eval").body
    names = {node.id for node in ast.walk(expr) if isinstance(node, ast.Name)}
    namespace = {name: _BASE[name] if name in _BASE else _definition(name, path, depth) for name in names}
    return eval(compile(ast.Expression(expr), str(path), "eval"), {"__builtins__": {}}, namespace)


def _annotation(expr: ast.expr, path: Path) -> Any:
    try:
        return _evaluate(expr, path, 0)
    except (LookupError, AttributeError, TypeError, SyntaxError):  # names something the source cannot give
        return ast.unparse(expr)


@functools.cache
def engine_fields() -> dict[str, Any]:
    """Name -> annotation of every field of the installed vLLM's ``EngineArgs``."""
    path = _module_file("vllm.engine.arg_utils")
    if path is None:
        raise UnsupportedEngine("vllm/engine/arg_utils.py not found in the installed vLLM")
    cls = next((node for node in _tree(path).body if isinstance(node, ast.ClassDef) and node.name == "EngineArgs"),
               None)
    if cls is None:
        raise UnsupportedEngine(f"{path}: no EngineArgs class")
    return {node.target.id: _annotation(node.annotation, path) for node in cls.body
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)
            and not node.target.id.startswith("_") and "ClassVar" not in ast.unparse(node.annotation)}


@functools.cache
def env_names() -> frozenset[str]:
    """The environment variables the installed vLLM reads: the keys of ``vllm.envs.environment_variables``."""
    path = _module_file("vllm.envs")
    if path is None:
        raise UnsupportedEngine("vllm/envs.py not found in the installed vLLM")
    for node in _tree(path).body:
        target = node.targets[0] if isinstance(node, ast.Assign) else getattr(node, "target", None)
        value = getattr(node, "value", None)
        if isinstance(target, ast.Name) and target.id == "environment_variables" and isinstance(value, ast.Dict):
            return frozenset(key.value for key in value.keys
                             if isinstance(key, ast.Constant) and isinstance(key.value, str))
    raise UnsupportedEngine(f"{path}: no environment_variables table")

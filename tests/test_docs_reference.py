"""docs/thresholds.md is the key reference: every key the loader accepts has a row with its true default.

The tables are read from the page itself, so a key added to the schema without a row, a default changed in
spec.py but not on the page, or a meaning cell grown into an essay fails here.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

import pytest

from pytest_fp8gate.config import schema, spec
from pytest_fp8gate.config.loader import tomllib
from pytest_fp8gate.core import protocol

DOCS = Path(__file__).resolve().parent.parent / "docs"
REFERENCE = DOCS / "thresholds.md"
MAX_CELL = 300

# Each reference table, by the first code span of its heading (or the heading's text), and the keys the
# schema gives that table.
TABLE_KEYS: dict[str, tuple[str, ...]] = {
    "Top-level keys": schema.TOP_KEYS,
    "[baseline]": tuple(k for k in schema.MODEL_KEYS if k not in schema.SERVED_ONLY_KEYS),
    "[[candidates]]": tuple(k for k in schema.MODEL_KEYS if k not in schema.SERVED_ONLY_KEYS),
    "Served models": schema.SERVED_ONLY_KEYS,
    "engine": tuple(schema.ENGINE_RANGES),
    "[noise]": schema.NOISE_KEYS,
    "[probabilities]": schema.PROBABILITY_KEYS,
    "corpus": tuple(schema.DATASET_CHECKS),
    "[probabilities.limits]": tuple(schema.PROBABILITY_LIMIT_CHECKS),
    "[decode]": schema.DECODE_KEYS,
    "[decode.limits]": tuple(schema.DECODE_LIMIT_CHECKS),
    "[[tasks]]": schema.TASK_KEYS,
    "[tasks.limits]": tuple(schema.TASK_LIMIT_CHECKS),
    "[speed]": tuple(schema.SPEED_CHECKS),
    "[load]": tuple(schema.LOAD_CHECKS),
    "[speculative]": tuple(schema.SPECULATIVE_CHECKS),
    "lora": schema.LORA_KEYS,
    "The protocol behind an accuracy": protocol.KEYS,
}

# The dataclass whose field defaults are the documented defaults of each table.
TABLE_SPECS: dict[str, type] = {
    "Top-level keys": spec.GateConfig,
    "Served models": spec.ServedSpec,
    "[noise]": spec.NoiseSpec,
    "[probabilities]": spec.ProbabilitySpec,
    "corpus": spec.DatasetCorpus,
    "[probabilities.limits]": spec.ProbabilityLimits,
    "[decode]": spec.DecodeSpec,
    "[decode.limits]": spec.DecodeLimits,
    "[[tasks]]": spec.TaskSpec,
    "[tasks.limits]": spec.TaskLimits,
    "[speed]": spec.SpeedSpec,
    "[load]": spec.LoadSpec,
    "[speculative]": spec.SpeculativeSpec,
}

# Defaults the loader fills from elsewhere than the field's own default.
DERIVED_DEFAULTS: dict[tuple[str, str], Any] = {
    ("[probabilities.limits]", "reference_ratio"): dict(spec.FP8_REFERENCE_RATIOS),  # with `reference` set
}

KEY_HEADER = ["key", "type", "default", "meaning"]


def cells(line: str) -> list[str]:
    # A `\|` inside a cell is an escaped pipe, not a column break.
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))]


def tables(text: str) -> dict[str, list[list[str]]]:
    """Every `key | type | default | meaning` table of a page, by its heading's id."""
    found: dict[str, list[list[str]]] = {}
    heading = ""
    rows: list[list[str]] | None = None
    for line in text.splitlines():
        if line.startswith("#"):
            title = line.lstrip("#").strip()
            span = re.search(r"`([^`]+)`", title)
            heading = span.group(1) if span else title
            rows = None
        elif line.startswith("|"):
            row = cells(line)
            if row == KEY_HEADER:
                assert heading not in found, f"two key tables under the heading {heading!r}"
                rows = found[heading] = []
            elif rows is not None and not set("".join(row)) <= set("-: "):
                rows.append(row)
        else:
            rows = None
    return found


def key_of(row: list[str]) -> str:
    return row[0].strip("`")


@pytest.fixture(scope="module")
def reference() -> dict[str, list[list[str]]]:
    return tables(REFERENCE.read_text(encoding="utf-8"))


def test_every_schema_table_has_a_reference_table(reference: dict[str, list[list[str]]]) -> None:
    missing = sorted(set(TABLE_KEYS) - set(reference))
    assert not missing, f"docs/thresholds.md has no `key | type | default | meaning` table under {missing}"


@pytest.mark.parametrize("table", sorted(TABLE_KEYS))
def test_every_key_the_loader_accepts_has_one_row(reference: dict[str, list[list[str]]], table: str) -> None:
    documented = [key_of(row) for row in reference.get(table, [])]
    missing = [k for k in TABLE_KEYS[table] if k not in documented]
    assert not missing, f"docs/thresholds.md, table {table}: no row for {missing}, keys the loader accepts"
    unknown = [k for k in documented if k not in TABLE_KEYS[table]]
    assert not unknown, f"docs/thresholds.md, table {table}: rows for {unknown}, which the loader refuses"
    repeated = sorted({k for k in documented if documented.count(k) > 1})
    assert not repeated, f"docs/thresholds.md, table {table}: more than one row for {repeated}"


def test_every_schema_key_list_is_covered() -> None:
    # A table added to the schema later (its *_KEYS or *_CHECKS) must be given a reference table too.
    covered = {key for keys in TABLE_KEYS.values() for key in keys}
    for name in dir(schema):
        if name.endswith(("_KEYS", "_CHECKS")) and name != "SERVED_ONLY_KEYS":
            keys = set(getattr(schema, name))
            assert keys <= covered, (f"schema.{name} has keys {sorted(keys - covered)} that no table of "
                                     "docs/thresholds.md documents; add them to TABLE_KEYS and the page")


def toml_literal(cell: str) -> Any:
    """The value of a default cell's first code span, read as TOML, or None where it holds none."""
    span = re.match(r"`([^`]+)`", cell)
    if span is None:
        return None
    try:
        return tomllib.loads(f"v = {span.group(1)}")["v"]
    except tomllib.TOMLDecodeError:
        return None


def field_defaults(cls: type) -> dict[str, Any]:
    return {f.name: f.default for f in dataclasses.fields(cls) if f.default is not dataclasses.MISSING}


@pytest.mark.parametrize("table", sorted(TABLE_SPECS))
def test_documented_defaults_are_the_loaders(reference: dict[str, list[list[str]]], table: str) -> None:
    defaults = field_defaults(TABLE_SPECS[table])
    defaults.update({key: value for (name, key), value in DERIVED_DEFAULTS.items() if name == table})
    wrong = []
    for row in reference.get(table, []):
        key, cell = key_of(row), row[2]
        if key not in defaults:
            continue  # required, or a table whose default is described in words
        default = defaults[key]
        if isinstance(default, (bool, int, float, str, tuple, dict)):
            written = toml_literal(cell)
            expected = list(default) if isinstance(default, tuple) else default
            if written != expected or type(written) is bool and type(expected) is not bool:
                wrong.append(f"{key}: the page says {cell!r}, the loader's default is {expected!r}")
        elif default is None and toml_literal(cell) is not None:
            wrong.append(f"{key}: the page gives a default {cell!r}, but an absent key is unset")
    assert not wrong, f"docs/thresholds.md, table {table}: " + "; ".join(wrong)


@pytest.mark.parametrize("page", ["thresholds.md", "why-defaults.md"])
def test_no_cell_is_an_essay(page: str) -> None:
    long = [(i, len(cell)) for i, line in enumerate((DOCS / page).read_text(encoding="utf-8").splitlines(), 1)
            if line.startswith("|") for cell in cells(line) if len(cell) > MAX_CELL]
    assert not long, f"docs/{page}: table cells over {MAX_CELL} characters at (line, length) {long}"


def test_the_parser_sees_rows_and_defaults() -> None:
    # The checks above read nothing if the parser reads nothing: a planted page must be seen as written.
    page = ("## `[speed]` (optional)\n\n| key | type | default | meaning |\n|---|---|---|---|\n"
            "| `iters` | integer | `11` | a \\| b |\n")
    parsed = tables(page)
    assert parsed == {"[speed]": [["`iters`", "integer", "`11`", "a \\| b"]]}
    assert toml_literal("`[1, 8]`; more") == [1, 8]

"""judge/kinds.py's table: one row for every rule kind, so every rule is collected, measured and judged
through it, and core/rules.py's BY_KIND holds each rule under its kind once."""

from __future__ import annotations

from pytest_fp8gate.core import rules
from pytest_fp8gate.judge.kinds import KINDS


def test_every_rule_kind_has_one_row() -> None:
    assert set(KINDS) == set(rules.Kind), "a rule kind without a row in judge/kinds.py's KINDS"


def test_by_kind_holds_every_rule_under_its_own_kind_in_table_order() -> None:
    grouped = [rule for kind in rules.Kind for rule in rules.BY_KIND[kind]]
    assert sorted(grouped, key=rules.RULES.index) == list(rules.RULES)
    assert all(rule.kind is kind for kind, members in rules.BY_KIND.items() for rule in members)

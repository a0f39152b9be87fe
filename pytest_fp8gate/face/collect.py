"""Collect the thresholds file as a test module whose tests are the gate's rules."""

from __future__ import annotations

import importlib
from types import ModuleType
from typing import TypeGuard

import pytest


class ThresholdsFile(pytest.Module):
    """``thresholds.toml`` collected as the rules module ``pytest_fp8gate.face.suite``.

    Overriding ``_getobj`` (not public API; the pytest range is pinned) gives
    real parametrization, fixtures and ids under the TOML file's node.
    """

    def _getobj(self) -> ModuleType:
        return importlib.import_module("pytest_fp8gate.face.suite")

    def collect(self) -> list[pytest.Item | pytest.Collector]:
        # A rule with nothing configured (e.g. no [speed]) yields no test rather than an empty-parameter skip.
        from ..judge.verdict import Case

        return [item for item in super().collect()
                if isinstance(getattr(getattr(item, "callspec", None), "params", {}).get("case"), Case)]


def is_rule(item: pytest.Item) -> TypeGuard[pytest.Function]:
    """One of the gate's rule tests: collected from the thresholds file."""
    return isinstance(item, pytest.Function) and isinstance(item.parent, ThresholdsFile)

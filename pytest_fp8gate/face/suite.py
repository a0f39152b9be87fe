"""The gate's rules as ordinary parametrized tests, collected from the thresholds file.

One test per rule of ``core.rules.RULES``, named by its row's ``test`` and made here from the table,
parametrized over candidates (and tasks); ids read like
``thresholds.toml::test_flips_within_noise_floor[fp8-dynamic-gsm8k]``.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest

from ..core.rules import RULES
from ..judge.verdict import Case
from .cases import cases_for
from .session import GateSession, engine_choice, run_state


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" in metafunc.fixturenames:
        state = run_state(metafunc.config)
        cases = cases_for(metafunc.function.__name__, state.config, engine_choice(metafunc.config)) \
            if state.config else []
        metafunc.parametrize("case", cases)


def _rule_test(name: str) -> Callable[[GateSession, Case, pytest.FixtureRequest], None]:
    """A rule's test: judge the case and fail with the verdict's explanation."""
    def test(fp8gate: GateSession, case: Case, request: pytest.FixtureRequest) -> None:
        fp8gate.enforce(case, request.node)

    test.__name__ = test.__qualname__ = name
    return test


globals().update({rule.test: _rule_test(rule.test) for rule in RULES})

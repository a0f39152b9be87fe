"""Judge the rules from the measurement record and its comparisons: verdicts that explain themselves.

Each verdict puts baseline, noise floor, candidate, threshold and margin side
by side; the flip rule also shows the first flipped questions. It ends with
where to act: the thresholds key of the limit, and the ``fp8gate`` command that
recomputes the number from this run's artifacts. The kind table (kinds.py) names
each rule's verdict function; the gate adds the run's false-alarm budget.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

from ..config.spec import GateConfig
from ..core import rules
from ..core.answers import AnswerComparison
from ..core.budget import allowance_se, run_levels
from ..core.rules import RuleOutcome
from ..errors import Fp8GateError, GateError
from .answer_checks import answer_comparison
from .comparisons import Comparisons
from .judging import Judging
from .kinds import KINDS
from .records import Records
from .verdict import BUDGET, Case, Verdict
from .verdict import number as _number

RULE_ORDER = {rule.name: index for index, rule in enumerate(rules.RULES)}


class Gate:
    """Evaluates rule cases against lazily measured models."""

    def __init__(self, config: GateConfig, measurements: Records, run_cases: Sequence[Case] = ()) -> None:
        self.measurements = measurements
        self.comparisons = Comparisons(config, measurements)  # shared with the markdown report
        # The run's rule cases: each candidate's that are tests share the false-alarm budget (run_alpha).
        self.run_cases = tuple(run_cases)
        self._levels: dict[tuple[Case, ...], dict[Case, float]] = {}  # per family: each case's Holm level
        self._p_values: dict[Case, float] = {}

    @property
    def config(self) -> GateConfig:
        """The thresholds the gate judges by (its comparisons name the same file in their errors)."""
        return self.comparisons.config

    def evaluate(self, case: Case) -> Verdict:
        rule = rules.BY_NAME.get(case.rule)
        if rule is None:
            raise GateError(f"unknown rule {case.rule!r}; expected one of {', '.join(rules.BY_NAME)}")
        budget = self._budget_details(case) if self.is_test(case) and self.config.run_alpha > 0 else None
        level = None if budget is None else budget["level"]
        verdict = self._judge(case, rule, level)
        notes = (*verdict.notes, self._budget_note(case, budget), power_note(verdict.outcome, level))
        details = verdict.details if budget is None else {**verdict.details, BUDGET: budget}
        return dataclasses.replace(verdict, notes=notes, details=details,
                                   served=self.measurements.candidate(case.candidate).served_otherwise)

    def _judge(self, case: Case, rule: rules.Rule, level: float | None) -> Verdict:
        return KINDS[rule.kind].verdict(Judging(self.comparisons, level), case, rule)

    def answer_comparison(self, case: Case) -> tuple[AnswerComparison, dict[str, AnswerComparison]]:
        """A task rule case's answers against the baseline's, and each noise pass's (for your own tests)."""
        return answer_comparison(Judging(self.comparisons), case)

    # ---- the run's false-alarm budget (an addition) ----------------------------

    def is_test(self, case: Case) -> bool:
        """Whether the case's rule is a test that spends the run's false-alarm budget: a p-value under a
        build with no real change decides it. The article's margin rules (accuracy within k SE, flips within
        ratio x the floor) and the limits on point estimates (speed, load, acceptance, length drift) are not."""
        rule = rules.BY_NAME[case.rule]
        if rule.name == rules.FLIPS:
            return Judging(self.comparisons).task(case).limits.flip_rule == rules.FLIP_BINOMIAL
        return rule.bound is not None or rule.spends_budget

    def _levels_of(self, case: Case) -> dict[Case, float]:
        """Each level under Holm at run_alpha across the case's candidate's budgeted cases in this run (the
        case itself included, where it was judged alone), the paired accuracy rules weighted to ACCURACY_SHARE.
        Each p-value is read from the rule judged at its own level (p does not depend on it); a rule that cannot
        be judged counts with p = 1, which only tightens the others' levels."""
        family = tuple(c for c in self.run_cases if c.candidate == case.candidate and self.is_test(c))
        family += () if case in family else (case,)
        # In the rule table's order, so that Holm's ties (two rules at p = 0) fall the same way whatever
        # order the tests ran in.
        family = tuple(sorted(family, key=lambda c: (RULE_ORDER[c.rule], c.task or "")))
        if family not in self._levels:
            for member in family:
                if member not in self._p_values:
                    try:
                        outcome = self._judge(member, rules.BY_NAME[member.rule], None).outcome
                        self._p_values[member] = outcome.figures["p_value"]
                    except Fp8GateError:
                        self._p_values[member] = 1.0
            self._levels[family] = run_levels({member: self._p_values[member] for member in family},
                                              self.config.run_alpha,
                                              [member for member in family if member.rule == rules.PAIRED_ACCURACY])
        return self._levels[family]

    def _budget_details(self, case: Case) -> dict[str, Any]:
        """The case's share of the run's false-alarm budget: its p-value, rank and level among its family's."""
        levels = self._levels_of(case)  # in the order Holm tests them
        return {"run_alpha": self.config.run_alpha, "rules": len(levels), "level": levels[case],
                "p_value": self._p_values[case], "rank": list(levels).index(case) + 1}

    def _budget_note(self, case: Case, budget: dict[str, Any] | None) -> str:
        alpha = self.config.run_alpha
        if budget is None and alpha > 0:
            return (f"false-alarm budget: spends none of run_alpha = {alpha:g} (an addition): this rule is "
                    + ("the article's margin rule" if case.rule in (rules.ACCURACY, rules.FLIPS)
                       else "a limit on a point estimate") + ", not a test")
        if budget is None:
            return "false-alarm budget: off (run_alpha = 0), so each rule is judged at its own level"
        level = budget["level"]
        exact = case.rule in (rules.PAIRED_ACCURACY, rules.FLIPS)  # exact tests, not a normal allowance
        return (f"false-alarm budget (an addition): run_alpha = {alpha:g} shared by Holm across this candidate's "
                f"{budget['rules']} rules that are tests; this rule's p = {budget['p_value']:.3g} is tested "
                f"{_ordinal(budget['rank'])} of {budget['rules']} and it spends level {level:.3g}"
                + ("" if exact else f" (an allowance of {allowance_se(level):.3g} SE)")
                + f": it can fail only where p <= {level:.3g}")


def _ordinal(n: int) -> str:
    return f"{n}{'th' if 10 <= n % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(n % 10, 'th')}"


def power_note(outcome: RuleOutcome, level: float | None) -> str:
    """The verdict's power line (an addition): the smallest regression, in the rule's own unit, this run
    fails with DETECTION_POWER, at the level the rule was judged at."""
    figures = outcome.figures
    if "resolution" not in figures or figures.get("limit_se", 1.0) == 0:
        return ("power: no SE is measured for this figure, so its point estimate is judged against the limit "
                "and no resolution is stated")
    what = next((label.removesuffix(f" caught with {rules.DETECTION_POWER:.0%} power (addition)")
                 for label, _ in outcome.rows if label.endswith("power (addition)")), outcome.rule)
    at = "" if level is None else f" at its level {level:.3g}"
    return (f"power (an addition): a true {what} of {_number(figures['resolution'])} is caught with "
            f"{rules.DETECTION_POWER:.0%} probability{at}; a pass does not rule out a smaller regression")

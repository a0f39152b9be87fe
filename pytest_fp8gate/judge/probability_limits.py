"""The limit a probability rule on the corpus (or a position bucket of it) is judged against: the value in
[probabilities.limits], a floor ratio over the worst noise pass, or a factor over a reference build, and
the setting that names it in the verdict."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from ..config.spec import ProbabilityLimits
from ..core import rules
from ..core.logprobs import LogprobComparison
from ..core.rules import RuleOutcome
from ..errors import GateError
from .judging import Judging


def probability_limits(judging: Judging) -> ProbabilityLimits:
    """[probabilities.limits] (a probability rule is collected only where [probabilities] is set)."""
    assert judging.config.probabilities is not None
    return judging.config.probabilities.limits


def bounded(judging: Judging, rule: rules.Rule, metric: str, comparison: LogprobComparison,
            floors: Mapping[str, LogprobComparison], k: float, bucket: str | None = None
            ) -> tuple[RuleOutcome, dict[str, Any]]:
    """A probability rule's outcome on ``comparison``'s figure ``metric`` against the worst of ``floors``'
    (the limit and floor_ratio of [probabilities.limits]), allowing ``k`` SEs, and each floor's figure;
    ``bucket``: the position bucket judged, whose limit a reference build sets from that same bucket."""
    limits = probability_limits(judging)
    if getattr(comparison, metric) is None:
        raise GateError(
            f"{judging.config.path}: probabilities.limits.{rule.limit_key}: the engine gave no distributions to "
            f"compute {metric} from (KL: {comparison.kl_kind}); remove the limit or use full_vocab/top_k"
        )
    limit, limit_key, reference_se = getattr(limits, rule.limit_key), None, 0.0
    reference = _reference_limit(judging, rule, metric, bucket)
    if reference is not None:
        limit, limit_key, rows, reference_se = reference
    outcome, floor_values = rule.against_floors(metric, comparison, floors, limit, limits.floor_ratio_for(metric),
                                                floor_key(judging, metric), k, limit_key, reference_se)
    if reference is not None:  # the reference's rows in place of the absolute limit's "reference" row
        outcome = dataclasses.replace(outcome, rows=(*rows, *outcome.rows[1:]))
    return outcome, floor_values


def _reference_limit(judging: Judging, rule: rules.Rule, metric: str, bucket: str | None = None
                     ) -> tuple[float, str, tuple[rules.Row, ...], float] | None:
    """The limit a factor over the reference build sets (an addition): the reference's distance from the
    ideal, measured on this model (on the position bucket ``bucket`` alone where one is judged, since early
    and late positions differ for every build), times the factor; with its setting's key, display rows and
    its own SE (the factor times the reference figure's clustered SE: the reference is measured once, on the
    same text, and its error moves the limit). None where the metric's limit is a value."""
    assert rule.ideal is not None and rule.se_field is not None
    limits = probability_limits(judging)
    factor = limits.reference_ratio_for(metric)
    if factor is None or getattr(limits, rule.limit_key) is not None:
        return None
    assert limits.reference is not None  # a factor exists only beside a reference
    measured = judging.comparisons.references()[limits.reference]
    same_bucket = None if bucket is None else measured.bucket(bucket)
    value, limit, limit_se = rule.over_reference(measured if same_bucket is None else same_bucket, metric, factor)
    where = "" if same_bucket is None else f", bucket {bucket}"
    rows = ((f"reference {limits.reference} on this model{where}", value),
            (f"{factor:g} x its distance from {rule.ideal:g}", limit),
            (f"{factor:g} x the reference's SE (addition)", limit_se))
    return limit, f"reference_ratio.{metric}", rows, limit_se


def floor_key(judging: Judging, metric: str) -> str:
    """The floor ratio's setting: one for every metric, or the metric's own."""
    return f"floor_ratio.{metric}" if isinstance(probability_limits(judging).floor_ratio, Mapping) \
        else "floor_ratio"


def limit_shown(judging: Judging, metric: str, outcome: RuleOutcome) -> str:
    """The verdict's limit line: the setting that bound (the value, the floor ratio or the reference factor)."""
    limits = probability_limits(judging)
    if outcome.limit_key == floor_key(judging, metric):
        setting: Any = limits.floor_ratio_for(metric)
    elif outcome.limit_key.startswith("reference_ratio."):
        setting = limits.reference_ratio_for(metric)
    else:
        setting = getattr(limits, outcome.limit_key)
    return judging.limit(f"probabilities.limits.{outcome.limit_key}", setting)

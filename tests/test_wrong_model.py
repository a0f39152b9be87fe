"""A different model as the candidate (issue 30), through the fake engine: every probability rule and
every decode-phase rule fails, in exact mode and in top-k mode, with and without the engine scoring the
baseline's ids. The served form (fake endpoints) is in test_served.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from fakes import FakeEngine, FakeModel, fake_engine_class, fake_gate, write_gate
from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.core import rules
from pytest_fp8gate.core.logprobs import TOPK_KL
from pytest_fp8gate.face import cases

# The fake architecture on ids shifted by half the vocabulary: no top-k id in common with the baseline.
OTHER = FakeModel(id_shift=129, seed=2)
DECODE = """[decode]
prompts = 2
prompt_tokens = 60
new_tokens = 24
[decode.limits]
min_same_top = 0.97674
max_rms_dp = 0.01198
max_mean_kl = 0.001355
"""
JUDGED = [rule for rule in rules.RULES if rule.kind == "probability" or (rule.kind == "decode" and rule.bound)]
MODES = {"exact": {}, "top-k, ids scored": {"full_vocab": "false"},
         "top-k, own ids only": {"full_vocab": "false", "refusal": "scoring given ids refused by the test"}}


def _edit(full_vocab: str | None) -> object:
    def edit(text: str) -> str:
        text = text.replace('[[candidates]]\nname = "good"', DECODE + '[[candidates]]\nname = "good"', 1)
        text += '\n[[candidates]]\nname = "other"\nquantization = "fp8_per_channel"\n'
        text = text.replace("max_ppl_ratio = 1.000425\n", "max_ppl_ratio = 1.000425\nmax_kl_p99 = 0.01\n", 1)
        return text.replace("top_k = 5\n", f"top_k = 5\nfull_vocab = {full_vocab}\n") if full_vocab else text
    return edit


@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_a_different_model_fails_every_probability_rule(tmp_path: Path, fake_gpus, mode: dict[str, str]) -> None:
    fake_gpus()
    config = load_config(write_gate(tmp_path, _edit(mode.get("full_vocab")), task=False))  # type: ignore[arg-type]
    found = [case for rule in JUDGED for param in cases.cases_for(rule.test, config, FakeEngine)
             if (case := param.values[0]).candidate == "other"]
    assert {case.rule for case in found} == {rule.name for rule in JUDGED}
    engine = fake_engine_class({"other": OTHER}, id_scoring_refusal=mode.get("refusal"))
    gate = fake_gate(config, tmp_path / "artifacts", cases.needs_of(found), engine)
    comparison = gate.comparisons.logprobs("other")
    assert comparison.kl_kind == ("exact" if not mode else TOPK_KL)
    assert comparison.same_top < 0.05 and comparison.mean_kl > 0.3  # the top-k bound no longer reads ~0
    assert comparison.ppl_ratio > 10
    for case in found:
        verdict = gate.evaluate(case)
        assert not verdict.passed, case.rule
        assert verdict.outcome.bound_by == rules.SANITY_FLOOR
        assert verdict.notes[0].startswith(f"same top {comparison.same_top:.5f} is below the sanity floor of 0.5")
        assert "looks like a different model or tokenizer" in verdict.notes[0]
    # ppl_ratio and mean_kl fail on their own figures too, far from any allowance.
    for name in ("ppl_ratio", "mean_kl"):
        rule = rules.BY_NAME[name]
        limits = config.probabilities.limits  # type: ignore[union-attr]
        outcome = rule.bound(name, getattr(comparison, name), getattr(limits, rule.limit_key),  # type: ignore[misc]
                             ideal=rule.ideal, measured_se=getattr(comparison, rule.se_field), k_se=1.0)
        assert outcome.margin < -0.5, name


def test_a_build_of_the_baseline_is_untouched_by_the_sanity_floor(tmp_path: Path, fake_gpus) -> None:
    fake_gpus()
    config = load_config(write_gate(tmp_path, _edit(None), task=False))  # type: ignore[arg-type]
    found = [case for rule in JUDGED for param in cases.cases_for(rule.test, config, FakeEngine)
             if (case := param.values[0]).candidate == "good"]
    gate = fake_gate(config, tmp_path / "artifacts", cases.needs_of(found),
                     fake_engine_class({"good": FakeModel(logit_noise=0.004, seed=2)}))
    for case in found:
        verdict = gate.evaluate(case)
        assert verdict.passed and verdict.outcome.bound_by is None, case.rule

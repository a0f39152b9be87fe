"""The rules on generated text through the fake engine: the decode phase, decode against prefill,
the candidate's own noise pass, output length and invalid answers; each passes and fails. No vLLM."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from fakes import (
    DECODE,
    GENERATION_RULES,
    FakeEngine,
    FakeModel,
    build_measurements,
    fake_engine_class,
    write_gate,
)
from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.core import rules
from pytest_fp8gate.errors import ConfigError
from pytest_fp8gate.face.cases import cases_for
from pytest_fp8gate.judge.gate import Gate
from pytest_fp8gate.judge.verdict import Case, Verdict
from pytest_fp8gate.report import markdown_report
from pytest_fp8gate.run.measure import BATCH_ORDER, Measurements
from pytest_fp8gate.run.record import Needs

TASK_LIMITS = "flip_alpha = 0.5\nmax_length_drift = 0.10\nmax_invalid_increase = 0.02\n"
MODELS = {
    "good": FakeModel(logit_noise=0.004, seed=2),
    "bad": FakeModel(logit_noise=0.25, seed=3),  # far from the baseline everywhere (its same top above 0.5)
    # Prefill exactly the baseline's; its decode reads a broken KV cache.
    "kv": FakeModel(decode_noise=0.3, seed=1),
    "rambling": FakeModel(logit_noise=0.004, seed=4, invalid_rate=0.5),  # half its answers lack "####"
}
DECODE_RULES = ("decode_same_top", "decode_rms_dp", "decode_mean_kl")


@pytest.fixture(autouse=True)
def no_gpu(fake_gpus) -> None:
    fake_gpus()


def _edit(extra: str = DECODE, noise: str = "") -> object:
    def edit(text: str) -> str:
        text = text.replace("flip_alpha = 0.5\n", TASK_LIMITS)
        text = text.replace('[[candidates]]\nname = "good"', extra + '\n[[candidates]]\nname = "good"', 1)
        for name in ("kv", "rambling"):
            text += f'\n[[candidates]]\nname = "{name}"\nquantization = "fp8_per_channel"\nengine = {{ seed = 1 }}\n'
        return text.replace("[noise]\n", f"[noise]\n{noise}") if noise else text
    return edit


def _measurements(tmp_path: Path, needs: dict[str, Needs], **kwargs: object) -> Measurements:
    # Each rule at its own level (run_alpha = 0): the run's shared budget is tested in test_run_budget.py.
    edit = _edit(**kwargs)
    config = load_config(write_gate(tmp_path, lambda text: "run_alpha = 0\n" + edit(text)))  # type: ignore[operator]
    return build_measurements(config, tmp_path / "artifacts", needs, fake_engine_class(MODELS))


@pytest.fixture(scope="module")
def judged(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Verdict]:
    tmp_path = tmp_path_factory.mktemp("generation")
    everything = Needs(probabilities=True, tasks=frozenset({"echo"}), decode=True)
    measurements = _measurements(tmp_path, {name: everything for name in MODELS},
                                 noise='candidate_passes = ["batch-order"]\n')
    gate = Gate(measurements.config, measurements)
    cases = [Case(rule, name) for rule in (*DECODE_RULES, rules.DECODE_GAP, "mean_kl") for name in MODELS]
    cases += [Case(rule, name, "echo") for rule in (rules.LENGTH_DRIFT, rules.INVALID_RATE) for name in MODELS]
    found = {(case.rule, case.candidate): gate.evaluate(case) for case in cases}
    found["calls"] = measurements.engine_class.calls  # type: ignore[assignment, attr-defined]
    return found


def test_a_good_candidate_passes_every_rule_on_generated_text(judged: dict) -> None:
    for rule in (*DECODE_RULES, rules.DECODE_GAP, rules.LENGTH_DRIFT, rules.INVALID_RATE):
        assert judged[rule, "good"].passed, judged[rule, "good"].explain()


def test_a_candidate_far_from_the_baseline_fails_the_decode_phase(judged: dict) -> None:
    for rule in DECODE_RULES:
        assert not judged[rule, "bad"].passed, rule
    # The figures on generated text stand beside the same figures of the prefill on the corpus.
    notes = "\n".join(judged["decode_mean_kl", "bad"].notes)
    assert "decode phase: same top" in notes and "prefill on the corpus: same top" in notes
    assert "reverse KL" in notes and "acceptance" in notes


def test_a_broken_kv_cache_fails_only_decode_against_prefill(judged: dict) -> None:
    gap = judged[rules.DECODE_GAP, "kv"]
    assert not gap.passed, gap.explain()
    # Its prefill is the baseline's: the corpus check and the decode phase (a prefill of the
    # baseline's continuations) see nothing.
    assert judged["mean_kl", "kv"].passed and all(judged[rule, "kv"].passed for rule in DECODE_RULES)
    baseline_gap = dict(gap.outcome.rows)["noise floor"]
    assert 0 < baseline_gap < gap.outcome.measured / 100  # the baseline's own gap is small, not zero


def test_the_decode_gap_limit_widens_to_the_baselines_own_gap() -> None:
    wide = rules.at_most_or_floor(rules.DECODE_GAP, 0.004, 0.001, 0.002, 3.0)
    assert wide.passed and wide.limit == pytest.approx(0.006)
    assert not rules.at_most_or_floor(rules.DECODE_GAP, 0.004, 0.001, 0.001, 3.0).passed


def test_answers_without_a_parsable_answer_fail_the_invalid_rate_and_the_length(judged: dict) -> None:
    invalid = judged[rules.INVALID_RATE, "rambling"]
    assert not invalid.passed and invalid.outcome.measured > 0.3
    assert not judged[rules.LENGTH_DRIFT, "rambling"].passed
    assert judged["mean_kl", "rambling"].passed  # its probabilities are as good as "good"'s


def test_the_candidate_noise_pass_runs_in_the_candidates_engine_and_is_shown(judged: dict) -> None:
    calls = judged["calls"]
    assert ("prompt_logprobs", "good", BATCH_ORDER, 3) in calls
    notes = judged["mean_kl", "good"].notes
    assert any(n.startswith("candidate noise pass batch-order") and "the baseline's own" in n for n in notes)


def test_every_model_scores_the_baselines_exact_ids_and_its_own(judged: dict) -> None:
    calls = judged["calls"]
    # Each model writes its own continuations once, then prefills its own and (candidates) the baseline's.
    assert [c[1] for c in calls if c[0] == "generate_with_logprobs"] == ["bf16", *MODELS]
    assert sum(1 for c in calls if c[0] == "prompt_logprobs" and c[1] == "good") == 4  # corpus, 2 decode, noise
    # In the baseline's engine the decode passes come after every other pass, so that what they
    # leave in the prefix cache changes no existing verdict.
    first_decode = calls.index(next(c for c in calls if c[0] == "generate_with_logprobs"))
    assert all(calls.index(c) < first_decode for c in calls if c[:3] in (("prompt_logprobs", "bf16", BATCH_ORDER),
                                                                           ("generate_greedy", "bf16", BATCH_ORDER)))


def test_without_decode_keys_nothing_is_generated_and_no_rule_is_collected(tmp_path: Path) -> None:
    measurements = _measurements(tmp_path, {"good": Needs(probabilities=True)}, extra="")
    measurements.candidate("good")
    assert not any(c[0] == "generate_with_logprobs" for c in measurements.engine_class.calls)  # type: ignore
    (tmp_path / "plain").mkdir()
    config = load_config(write_gate(tmp_path / "plain"))  # the echo task, without the new keys
    for rule in rules.RULES:
        if rule.kind == "decode" or rule.name in (rules.LENGTH_DRIFT, rules.INVALID_RATE):
            assert cases_for(rule.test, config, FakeEngine) == [], rule.name


@pytest.mark.parametrize("extra, message", [
    ("\n[decode]\nprompts = 9\n[decode.limits]\nmax_mean_kl = 0.01\n",
     "decode.prompts: 9 prompts but probabilities.chunks is 3"),
    ("\n[decode]\nprompts = 2\nprompt_tokens = 500\n[decode.limits]\nmax_mean_kl = 0.01\n",
     "decode.prompt_tokens: 500 exceeds probabilities.chunk_tokens (400)"),
    ("\n[decode]\nprompts = 2\nnew_tokens = 2000\n[decode.limits]\nmax_mean_kl = 0.01\n",
     "decode.new_tokens: needs 2257 tokens of context (prompt_tokens + new_tokens + 1) but "
     "baseline.engine.max_model_len is 2048"),
    ("\n[decode]\nprompts = 2\n[decode.limits]\ngap_ratio = 2\n",
     "decode.limits: expected at least one of min_same_top, max_rms_dp, max_mean_kl, max_gap_kl"),
])
def test_bad_decode_settings_are_one_clear_line(tmp_path: Path, extra: str, message: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(write_gate(tmp_path, _edit(extra)))  # type: ignore[arg-type]
    assert f"thresholds.toml: {message}" in str(caught.value), str(caught.value)


def test_candidate_passes_take_only_the_batch_order_pass(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"noise.candidate_passes: expected one of 'batch-order', got string 'fp16'"):
        load_config(write_gate(tmp_path, _edit(noise='candidate_passes = ["fp16"]\n')))  # type: ignore[arg-type]


# rule -> the rows of its table, the limit it names, and whether fp8gate compare-logprobs recomputes it
P_ROW = "p, one-sided normal, of missing the limit (addition)"


def _rows(rule: str, *head: str, se: str = "noise floor SE (fails beyond 1 SE)") -> list[str]:
    return [*head, "candidate", *([se] if se else []), P_ROW, f"{rule} caught with 80% power (addition)",
            "threshold", "margin"]


EXPLAINED = {
    "decode_same_top": (_rows("decode_same_top", "reference", "noise floor"), "decode.limits.min_same_top = 0.97674",
                        True),
    "decode_rms_dp": (_rows("decode_rms_dp", "reference", "noise floor"), "decode.limits.max_rms_dp = 0.01198", True),
    "decode_mean_kl": (_rows("decode_mean_kl", "reference", "noise floor"), "decode.limits.max_mean_kl = 0.001355",
                       True),
    rules.DECODE_GAP: (_rows(rules.DECODE_GAP, "reference", "noise floor", "3 x noise floor"),
                       "decode.limits.max_gap_kl = 0.001355", True),
    rules.LENGTH_DRIFT: (_rows(rules.LENGTH_DRIFT, "reference", "noise floor", "2 x noise floor", se=""),
                         "tasks[0].limits.max_length_drift = 0.1", False),
    rules.INVALID_RATE: (["questions", "baseline invalid rate", "noise floor invalid rate", "allowed rise",
                          "candidate invalid rate", "no-change SE (fails beyond 1 SE)", P_ROW,
                          "invalid_rate caught with 80% power (addition)", "threshold", "margin"],
                         "tasks[0].limits.max_invalid_increase = 0.02", False),
}
FAILING = {"decode_same_top": "bad", "decode_rms_dp": "bad", "decode_mean_kl": "bad", rules.DECODE_GAP: "kv",
           rules.LENGTH_DRIFT: "rambling", rules.INVALID_RATE: "rambling"}


@pytest.mark.parametrize("rule", sorted(EXPLAINED))
def test_each_verdict_explains_itself_and_says_where_to_act(judged: dict, rule: str, capsys) -> None:
    from pytest_fp8gate.tools.cli import main as fp8gate_main

    assert set(EXPLAINED) == GENERATION_RULES
    rows, limit, recomputed = EXPLAINED[rule]
    for candidate, state in (("good", "passed"), (FAILING[rule], "FAILED")):
        verdict = judged[rule, candidate]
        lines = verdict.explain().splitlines()
        assert lines[0].startswith(f"{rule} {state} for candidate {candidate}")
        assert [label for label, _ in verdict.outcome.rows] == rows
        limit_line = next(line for line in lines if line.startswith("  limit: "))
        assert limit_line.endswith(f"thresholds.toml {limit}"), limit_line
        assert (verdict.recompute is not None) is recomputed
        if recomputed:  # the recompute command gives the verdict's own figure from the dumps
            words = verdict.recompute.split()  # type: ignore[union-attr]
            assert fp8gate_main([*words[1:], "--json"]) == 0
            figures = json.loads(capsys.readouterr().out)
            metric = "mean_kl" if rule == rules.DECODE_GAP else rule.removeprefix(rules.DECODE_PREFIX)
            assert figures[metric] == pytest.approx(verdict.outcome.measured)


def test_the_report_puts_the_decode_figures_beside_the_prefill_figures(judged: dict) -> None:
    verdicts = [judged[rule, "good"] for rule in (*DECODE_RULES, rules.DECODE_GAP, "mean_kl")]
    lines = markdown_report._decode_lines(verdicts)
    phase = next(line for line in lines if line.startswith("Decode phase: decode same top"))
    assert " | prefill same top " in phase and "acceptance" in phase
    assert any(line.startswith("Decode phase: decode vs prefill: candidate KL ") for line in lines)
    assert len([line for line in lines if line]) == 2  # once per candidate, not once per rule


def _cached_run(tmp_path: Path, run: str, lines: list[str], extra: str = DECODE) -> tuple[list, Verdict, Verdict]:
    """One session through the baseline cache in ``tmp_path / "cache"``: its engine calls and two decode verdicts."""
    from pytest_fp8gate.run.baseline_cache import BaselineCache

    (tmp_path / run).mkdir()
    config = load_config(write_gate(tmp_path / run, _edit(extra)))
    needs = {"good": Needs(probabilities=True, decode=True)}
    engine_class = fake_engine_class(MODELS)
    measurements = build_measurements(config, tmp_path / run / "artifacts", needs, engine_class, lines.append,
                                     BaselineCache(tmp_path / "cache", False, lines.append))
    gate = Gate(config, measurements)
    found = gate.evaluate(Case("decode_mean_kl", "good")), gate.evaluate(Case(rules.DECODE_GAP, "good"))
    return engine_class.calls, *found


def test_a_baseline_cache_hit_runs_none_of_the_baselines_decode_passes(tmp_path: Path) -> None:
    lines: list[str] = []
    cold_calls, cold_kl, cold_gap = _cached_run(tmp_path, "cold", lines)
    assert ("generate_with_logprobs", "bf16") in [c[:2] for c in cold_calls]
    warm_calls, warm_kl, warm_gap = _cached_run(tmp_path, "warm", lines)
    assert any("baseline bf16 from the cache" in line for line in lines), lines
    assert not [c for c in warm_calls if len(c) > 1 and c[1] in ("bf16", "bf16-fp16")]  # no baseline engine at all
    assert ("generate_with_logprobs", "good") in [c[:2] for c in warm_calls]  # the candidate's decode phase runs
    # The same verdicts from the stored continuations, their prefill and the noise passes' prefills of them.
    for cold, warm in ((cold_kl, warm_kl), (cold_gap, warm_gap)):
        assert warm.outcome.measured == cold.outcome.measured and warm.outcome.rows == cold.outcome.rows
        assert warm.passed == cold.passed


def test_a_changed_decode_key_misses_the_baseline_cache(tmp_path: Path) -> None:
    lines: list[str] = []
    _cached_run(tmp_path, "cold", lines)
    calls, _, _ = _cached_run(tmp_path, "other", lines, extra=DECODE.replace("new_tokens = 64", "new_tokens = 48"))
    miss = [line for line in lines if "baseline cache miss" in line][-1]
    assert "decode.new_tokens" in miss, miss
    assert ("generate_with_logprobs", "bf16") in [c[:2] for c in calls]
    # A limit is judged, not measured: changing one reuses the entry.
    calls, _, _ = _cached_run(tmp_path, "limit", lines, extra=DECODE.replace("max_mean_kl = 0.001355",
                                                                             "max_mean_kl = 0.002"))
    assert ("generate_with_logprobs", "bf16") not in [c[:2] for c in calls]

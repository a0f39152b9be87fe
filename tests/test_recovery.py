"""The recovery rule (candidate over baseline accuracy, with its paired delta-method SE) passes and
fails through the fake engine, beside the SE accuracy rule."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fakes import FakeModel, build_measurements, fake_engine_class, write_gate
from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.core import rules
from pytest_fp8gate.errors import ConfigError
from pytest_fp8gate.judge.gate import Gate
from pytest_fp8gate.judge.verdict import Case
from pytest_fp8gate.run.record import Needs

MODELS = {
    "good": FakeModel(logit_noise=0.004, seed=2),  # answers as the baseline does
    "bad": FakeModel(logit_noise=0.004, seed=3, flip_rate=0.5),  # half its answers flipped: accuracy 0.8 -> ~0.5
}


@pytest.fixture(autouse=True)
def no_gpu(fake_gpus) -> None:
    fake_gpus()


def test_the_delta_method_se_by_hand_and_against_a_paired_bootstrap() -> None:
    # b = 0.8, c = 0.76, both right 0.74, n = 200: Var c = 0.000912, Var b = 0.0008, Cov = 0.00066, R = 0.95;
    # Var R = (0.000912 + 0.9025 x 0.0008 - 2 x 0.95 x 0.00066) / 0.64 = 0.00059375.
    assert rules.recovery_se(0.8, 0.76, 0.74, 200) == pytest.approx(0.00059375 ** 0.5)
    # The same 200 paired answers, resampled: the bootstrap SE of the ratio agrees within 10%.
    base = np.array([1] * 148 + [1] * 12 + [0] * 4 + [0] * 36)
    cand = np.array([1] * 148 + [0] * 12 + [1] * 4 + [0] * 36)
    rng = np.random.default_rng(0)
    draws = rng.integers(0, 200, (4000, 200))
    bootstrap = np.std(cand[draws].mean(axis=1) / base[draws].mean(axis=1))
    assert rules.recovery_se(0.8, 0.76, 0.74, 200) == pytest.approx(bootstrap, rel=0.1)
    # Pairing matters: answers that agree more leave the ratio less spread than independent ones would.
    assert rules.recovery_se(0.8, 0.76, 0.76, 200) < rules.recovery_se(0.8, 0.76, 0.8 * 0.76, 200)


def test_the_rule_fails_only_beyond_k_se_below_the_limit() -> None:
    se = rules.recovery_se(0.8, 0.76, 0.74, 200)
    assert rules.recovery_within(0.8, 0.76, 0.74, 200, 0.95).passed  # the point recovery is 0.95
    assert rules.recovery_within(0.8, 0.76, 0.74, 200, 0.95 + 0.99 * se).passed
    failed = rules.recovery_within(0.8, 0.76, 0.74, 200, 0.95 + 1.01 * se)
    assert not failed.passed and failed.limit_key == "min_recovery"
    assert dict(failed.rows)["recovery (candidate / baseline)"] == pytest.approx(0.95)
    with pytest.raises(ValueError, match="not possible"):
        rules.recovery_within(0.8, 0.76, 0.9, 200, 0.95)


def _gate(tmp_path: Path, min_recovery: str = "0.95") -> Gate:
    path = write_gate(tmp_path, lambda text: text.replace("flip_alpha = 0.5\n",
                                                          f"flip_alpha = 0.5\nmin_recovery = {min_recovery}\n"))
    config = load_config(path)
    needs = {name: Needs(tasks=frozenset({"echo"})) for name in MODELS}
    measurements = build_measurements(config, tmp_path / "artifacts", needs, fake_engine_class(MODELS))
    return Gate(config, measurements)


def test_a_candidate_that_keeps_its_accuracy_passes_and_one_that_loses_it_fails(tmp_path: Path) -> None:
    gate = _gate(tmp_path)
    good = gate.evaluate(Case(rules.RECOVERY, "good", "echo"))
    bad = gate.evaluate(Case(rules.RECOVERY, "bad", "echo"))
    assert good.passed and good.outcome.measured == pytest.approx(1.0), good.explain()
    assert not bad.passed and bad.outcome.measured < 0.8, bad.explain()
    text = bad.explain()
    assert "delta method" in text and "recovery_threshold (0.95" in text and "MLPerf asks 99%" in text
    assert text.splitlines()[-2].endswith("tasks[0].limits.min_recovery = 0.95")
    # Beside the accuracy rule, not instead of it: that one still runs and fails the same build.
    assert not gate.evaluate(Case(rules.ACCURACY, "bad", "echo")).passed


def test_min_recovery_is_a_fraction_above_zero(tmp_path: Path) -> None:
    for value in ("0", "1.5"):
        (tmp_path / value).mkdir()
        with pytest.raises(ConfigError, match=r"tasks\[0\].limits.min_recovery"):
            load_config(write_gate(tmp_path / value, lambda text, v=value: text.replace(
                "flip_alpha = 0.5\n", f"flip_alpha = 0.5\nmin_recovery = {v}\n")))

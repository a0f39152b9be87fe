"""The kl_p99 rule (an addition): KL's 99th percentile against its limit and the noise floor, like mean_kl.
A fault on a few positions moves the tail long before the mean; the fake engine plants one. No vLLM."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fakes import FakeEngine, FakeModel, fake_engine_class, fake_gate, write_gate
from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.core import logprobs
from pytest_fp8gate.face.cases import cases_for
from pytest_fp8gate.judge.verdict import Case, Verdict
from pytest_fp8gate.run.record import Needs

MODELS = {
    "good": FakeModel(logit_noise=0.004, seed=2),
    # The baseline exactly, but for the last 8 positions of each 400-token chunk (2%), perturbed hard.
    "tail": FakeModel(position_noise=20.0, position_onset=391, seed=5),
    "bad": FakeModel(logit_noise=0.5, seed=3),
}


@pytest.fixture(autouse=True)
def no_gpu(fake_gpus) -> None:
    fake_gpus()


def _limit(text: str) -> str:
    # 14 chunks (5,600 positions): the tail's order statistics are tight enough to judge at the default limit_se.
    text = text.replace("chunks = 3\n", "chunks = 14\n", 1)
    text = text.replace("[probabilities.limits]\n", "[probabilities.limits]\nmax_kl_p99 = 0.01\n", 1)
    return text + '\n[[candidates]]\nname = "tail"\nquantization = "fp8_per_channel"\n'


@pytest.fixture(scope="module")
def judged(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Verdict]:
    directory = tmp_path_factory.mktemp("kl-tail")
    config = load_config(write_gate(directory, _limit, task=False))
    needs = {name: Needs(probabilities=True) for name in MODELS}
    gate = fake_gate(config, directory / "artifacts", needs, fake_engine_class(MODELS))
    return {(rule, name): gate.evaluate(Case(rule, name)) for rule in ("mean_kl", "kl_p99") for name in MODELS}


def test_a_fault_on_a_few_positions_fails_the_tail_while_the_mean_passes(judged) -> None:
    mean, tail = judged["mean_kl", "tail"], judged["kl_p99", "tail"]
    assert mean.passed, mean.explain()
    assert mean.outcome.measured < 0.7 * mean.outcome.limit  # not a near miss of the mean
    assert not tail.passed, tail.explain()
    assert tail.outcome.measured > tail.outcome.limit
    assert tail.outcome.limit_key == "max_kl_p99"
    assert "probabilities.limits.max_kl_p99 = 0.01" in tail.explain()


def test_a_good_candidate_passes_the_tail_and_a_bad_one_fails_it(judged) -> None:
    assert judged["kl_p99", "good"].passed, judged["kl_p99", "good"].explain()
    assert not judged["kl_p99", "bad"].passed


def test_the_rule_is_collected_only_where_its_limit_is_set(tmp_path: Path) -> None:
    with_limit = load_config(write_gate(tmp_path, _limit, task=False))
    (tmp_path / "plain").mkdir()
    without = load_config(write_gate(tmp_path / "plain", task=False))
    collected = cases_for("test_kl_p99_within_limit", with_limit, FakeEngine)
    assert sorted(param.values[0].candidate for param in collected) == ["bad", "good", "tail"]
    assert cases_for("test_kl_p99_within_limit", without, FakeEngine) == []


def test_the_p99_and_its_se_follow_the_order_statistics() -> None:
    rng = np.random.default_rng(0)
    small, large = rng.exponential(size=2_000), rng.exponential(size=200_000)
    kl = logprobs._summarise(np.ones(2_000, bool), np.zeros(2_000), np.zeros(2_000), "exact", small)
    assert kl.kl_p99 == pytest.approx(np.percentile(small, 99.0)) == kl.kl_percentiles["99%"]
    assert kl.kl_p99_se == logprobs._p99_se(small)
    assert 0 < logprobs._p99_se(large) < logprobs._p99_se(small)  # more positions, a tighter tail
    assert logprobs._p99_se(np.full(500, 0.25)) == 0.0
    assert logprobs._p99_se(np.array([0.5])) == 0.0


def test_a_negative_limit_is_one_clear_error(tmp_path: Path) -> None:
    from pytest_fp8gate.errors import ConfigError

    path = write_gate(tmp_path, lambda text: _limit(text).replace("max_kl_p99 = 0.01", "max_kl_p99 = -1"), task=False)
    with pytest.raises(ConfigError, match=r"probabilities\.limits\.max_kl_p99"):
        load_config(path)

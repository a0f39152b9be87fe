"""The gate's rules as ordinary parametrized tests, collected from the thresholds file.

One test per rule, parametrized over candidates (and tasks); ids read like
``thresholds.toml::test_flips_within_noise_floor[fp8-dynamic-gsm8k]``.
"""

from __future__ import annotations

import pytest

from .cases import cases_for
from .session import GateSession, run_state


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    if "case" in metafunc.fixturenames:
        state = run_state(metafunc.config)
        cases = cases_for(metafunc.function.__name__, state.config, state.engine_class) if state.config else []
        metafunc.parametrize("case", cases)


def test_accuracy_within_se(fp8gate: GateSession, case, request: pytest.FixtureRequest) -> None:
    fp8gate.enforce(case, request.node)


def test_paired_accuracy(fp8gate: GateSession, case, request: pytest.FixtureRequest) -> None:
    fp8gate.enforce(case, request.node)


def test_flips_within_noise_floor(fp8gate: GateSession, case, request: pytest.FixtureRequest) -> None:
    fp8gate.enforce(case, request.node)


def test_same_top_near_baseline(fp8gate: GateSession, case, request: pytest.FixtureRequest) -> None:
    fp8gate.enforce(case, request.node)


def test_rms_dp_within_limit(fp8gate: GateSession, case, request: pytest.FixtureRequest) -> None:
    fp8gate.enforce(case, request.node)


def test_ppl_ratio_within_limit(fp8gate: GateSession, case, request: pytest.FixtureRequest) -> None:
    fp8gate.enforce(case, request.node)


def test_kl_within_limit(fp8gate: GateSession, case, request: pytest.FixtureRequest) -> None:
    fp8gate.enforce(case, request.node)


def test_kl_p99_within_limit(fp8gate: GateSession, case, request: pytest.FixtureRequest) -> None:
    fp8gate.enforce(case, request.node)


def test_decode_speed_near_ceiling(fp8gate: GateSession, case, request: pytest.FixtureRequest) -> None:
    fp8gate.enforce(case, request.node)


def test_throughput_under_load(fp8gate: GateSession, case, request: pytest.FixtureRequest) -> None:
    fp8gate.enforce(case, request.node)


def test_acceptance_length(fp8gate: GateSession, case, request: pytest.FixtureRequest) -> None:
    fp8gate.enforce(case, request.node)


def test_decode_same_top(fp8gate: GateSession, case, request: pytest.FixtureRequest) -> None:
    fp8gate.enforce(case, request.node)


def test_decode_rms_dp(fp8gate: GateSession, case, request: pytest.FixtureRequest) -> None:
    fp8gate.enforce(case, request.node)


def test_decode_kl(fp8gate: GateSession, case, request: pytest.FixtureRequest) -> None:
    fp8gate.enforce(case, request.node)


def test_decode_vs_prefill_gap(fp8gate: GateSession, case, request: pytest.FixtureRequest) -> None:
    fp8gate.enforce(case, request.node)


def test_output_length_drift(fp8gate: GateSession, case, request: pytest.FixtureRequest) -> None:
    fp8gate.enforce(case, request.node)


def test_invalid_rate(fp8gate: GateSession, case, request: pytest.FixtureRequest) -> None:
    fp8gate.enforce(case, request.node)


def test_recovery(fp8gate: GateSession, case, request: pytest.FixtureRequest) -> None:
    fp8gate.enforce(case, request.node)


def test_truncation(fp8gate: GateSession, case, request: pytest.FixtureRequest) -> None:
    fp8gate.enforce(case, request.node)


def test_bucket_same_top(fp8gate: GateSession, case, request: pytest.FixtureRequest) -> None:
    fp8gate.enforce(case, request.node)


def test_bucket_rms_dp(fp8gate: GateSession, case, request: pytest.FixtureRequest) -> None:
    fp8gate.enforce(case, request.node)


def test_bucket_kl(fp8gate: GateSession, case, request: pytest.FixtureRequest) -> None:
    fp8gate.enforce(case, request.node)


def test_bucket_ppl_ratio(fp8gate: GateSession, case, request: pytest.FixtureRequest) -> None:
    fp8gate.enforce(case, request.node)

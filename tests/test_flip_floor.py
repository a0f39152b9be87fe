"""A flip verdict says when the baseline's own re-runs change so many answers that flips mean nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from fakes import MODELS, FakeModel, fake_engine_class, fake_gate, write_gate
from pytest_fp8gate import hardware
from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.core import rules
from pytest_fp8gate.face import cases

UNSTEADY = FakeModel(flip_rate=0.3, seed=1)  # a baseline whose fp16 pass flips 3 of the 40 questions


def _flip_notes(directory: Path, baseline: FakeModel) -> tuple[str, ...]:
    engine_class = fake_engine_class({**MODELS, "bf16": baseline})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hardware, "probe_cuda", lambda: hardware.CudaProbe((), "faked by the test"))
        config = load_config(write_gate(directory))
        found = [param.values[0] for param in cases.cases_for("test_flips_within_noise_floor", config, engine_class)]
        gate = fake_gate(config, directory / "artifacts", cases.needs_of(found), engine_class)
        verdict = gate.evaluate(next(case for case in found if case.candidate == "good"))
    return verdict.notes


def test_a_floor_that_re_rolls_many_answers_is_called_saturated_with_its_remedies(tmp_path: Path,
                                                                                   monkeypatch: pytest.MonkeyPatch):
    # The fake baseline's fp16 pass re-answers about 3% of the questions on its own (3 of 40 here, 1.5 a pass
    # over the two noise passes): saturated against a level of 2%, steady against the default 5%.
    monkeypatch.setattr(rules, "SATURATED_FLIP_FLOOR", 0.02)
    (saturated,) = [note for note in _flip_notes(tmp_path, UNSTEADY) if note.startswith("the noise floor is")]
    assert saturated.startswith("the noise floor is saturated: the baseline alone changes 3.8% of its answers "
                                "between passes (above 2%)")
    assert "VLLM_BATCH_INVARIANT=1" in saturated and "deterministic_scheduling" in saturated


def test_a_steady_floor_is_not_called_saturated(tmp_path: Path) -> None:
    assert rules.SATURATED_FLIP_FLOOR == 0.05
    assert not any(note.startswith("the noise floor is saturated") for note in _flip_notes(tmp_path, UNSTEADY))

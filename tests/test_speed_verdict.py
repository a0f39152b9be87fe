"""The speed verdict from measured latencies and each model's roofline (no engine)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.core.roofline import decode_context_tokens, estimate_from_path
from pytest_fp8gate.engines.base import Latency, timed_latency
from pytest_fp8gate.errors import ConfigError, GateError
from pytest_fp8gate.judge.gate import Gate
from pytest_fp8gate.judge.verdict import Case
from pytest_fp8gate.options import display_path
from pytest_fp8gate.run.record import BaselineRecord, ModelResult, PassResult
from pytest_fp8gate.tools.demo.run import demo_config_text


class _Measured:
    """The two records the speed rule reads, as Measurements would hand them over."""

    def __init__(self, baseline: ModelResult, candidate: ModelResult) -> None:
        self._baseline, self._candidate = baseline, candidate

    def record(self) -> BaselineRecord:
        return BaselineRecord(self._baseline, [], [])

    def candidate(self, name: str) -> ModelResult:
        return self._candidate


def _latency(decode_tok_s: float, output_len: int = 256) -> Latency:
    prefill = 0.01
    return Latency(1000, output_len, 1, 10, prefill + (output_len - 1) / decode_tok_s, prefill)


@pytest.fixture
def gate_for(tmp_path: Path):
    path = tmp_path / "thresholds.toml"
    path.write_text(demo_config_text({}), encoding="utf-8")
    config = load_config(path)
    config = dataclasses.replace(config, speed=dataclasses.replace(config.speed, gpu="H200", bandwidth_gbps=4800.0))

    def make(base_tok_s: float, cand_tok_s: float, **speed: object) -> Gate:
        gated = dataclasses.replace(config, speed=dataclasses.replace(config.speed, **speed))
        base = ModelResult(gated.baseline, PassResult("main"), 1.0, 1000, 259, _latency(base_tok_s))
        cand = ModelResult(gated.candidates[0], PassResult("main"), 1.0, 2000, 259, _latency(cand_tok_s))
        return Gate(gated, _Measured(base, cand))

    return make


def test_overhead_bound_embedded_model_is_judged_without_a_ceiling(gate_for):
    # The embedded model on the H200 ran 617 tok/s against a ceiling of ~600,000.
    verdict = gate_for(617.0, 600.0).evaluate(Case("speed", "fp8-per-channel"))
    assert verdict.passed
    assert any("overhead-bound" in note and "no bandwidth ceiling applies" in note for note in verdict.notes)
    assert not gate_for(617.0, 300.0).evaluate(Case("speed", "fp8-per-channel")).passed  # planted: half the speed


def test_bandwidth_bound_candidate_is_judged_against_the_baselines_share(gate_for):
    model = Path(gate_for(1, 1).config.baseline.model)
    base, cand = (estimate_from_path(model, quantization=q, bandwidth_gbps=4800,
                                     context_tokens=decode_context_tokens(1000, 256))
                  for q in (None, "fp8_per_channel"))
    base_tok_s = 0.65 * base.ceiling_tok_s
    verdict = gate_for(base_tok_s, 1.35 * base_tok_s).evaluate(Case("speed", "fp8-per-channel"))
    rows = dict(verdict.outcome.rows)
    assert rows["baseline share of ceiling"] == pytest.approx(0.65, rel=1e-3)
    assert rows["speedup the bytes allow"] == pytest.approx(base.bytes_per_token / cand.bytes_per_token)
    assert verdict.passed and "same GPU" in " ".join(verdict.notes)
    regressed = gate_for(base_tok_s, 0.85 * base_tok_s).evaluate(Case("speed", "fp8-per-channel"))
    assert not regressed.passed  # planted: FP8 slower than BF16 although it reads fewer bytes
    article = gate_for(base_tok_s, 1.35 * base_tok_s, rule="share_of_ceiling").evaluate(
        Case("speed", "fp8-per-channel"))
    assert not article.passed and article.outcome.limit == 0.8


def test_the_kv_cache_read_over_the_whole_decode_counts(gate_for):
    verdict = gate_for(617.0, 600.0).evaluate(Case("speed", "fp8-per-channel"))
    roofline = verdict.details["roofline"]
    assert roofline["context_tokens"] == decode_context_tokens(1000, 256) == 1128
    assert "mean context of 1128 tokens" in verdict.notes[0]


def test_decode_context_is_the_mean_over_the_decoded_steps():
    # Tokens 2..n are decoded; token j reads the KV cache of input_len + j - 1 tokens.
    assert decode_context_tokens(1000, 256) == round(sum(1000 + j - 1 for j in range(2, 257)) / 255)
    assert decode_context_tokens(0, 1) == 0


def test_the_candidate_s_kv_cache_dtype_reaches_its_roofline(gate_for):
    gate = gate_for(617.0, 600.0)
    candidate = gate.measurements.candidate("fp8-per-channel")
    candidate.spec = dataclasses.replace(candidate.spec, engine={**candidate.spec.engine, "kv_cache_dtype": "fp8"})
    details = gate.evaluate(Case("speed", "fp8-per-channel")).details
    # BF16 keys and values take 2 bytes an element, an FP8 KV cache 1.
    assert details["baseline_roofline"]["kv_bytes_per_context_token"] == (
        2 * details["roofline"]["kv_bytes_per_context_token"])


def test_the_speed_verdict_ends_with_its_limit_and_the_roofline_command(gate_for):
    gate = gate_for(617.0, 300.0)
    lines = gate.evaluate(Case("speed", "fp8-per-channel")).explain().splitlines()
    model = display_path(Path(gate.config.candidates[0].model))  # paths as the user would type them
    assert lines[-2:] == [
        # The embedded model is overhead-bound, so that limit applies.
        f"  limit: {display_path(gate.config.path)} speed.min_ratio_overhead_bound = 0.5",
        f"  recompute: fp8gate roofline {model} --quantization fp8_per_channel --bandwidth-gbps 4800 --context 1128 "
        "--batch 1"]


def test_a_share_of_the_ceiling_above_one_is_refused_as_a_wrong_byte_model(gate_for):
    model = Path(gate_for(1, 1).config.baseline.model)
    cand = estimate_from_path(model, quantization="fp8_per_channel", bandwidth_gbps=4800,
                              context_tokens=decode_context_tokens(1000, 256))
    base_tok_s = 617.0
    gate = gate_for(base_tok_s, 1.5 * cand.ceiling_tok_s)  # faster than the bandwidth allows
    with pytest.raises(GateError) as info:
        gate.evaluate(Case("speed", "fp8-per-channel"))
    message = str(info.value)
    assert message.startswith(f"speed: fp8-per-channel decodes {1.5 * cand.ceiling_tok_s:.1f} tok/s, 1.50 x its "
                              f"roofline ceiling of {cand.ceiling_tok_s:.1f} tok/s at 4800 GB/s")
    assert "the byte model counts more bytes per token than the model reads" in message
    assert gate_for(base_tok_s, 0.99 * cand.ceiling_tok_s).evaluate(Case("speed", "fp8-per-channel"))  # just below


@pytest.mark.parametrize("nvml_gbps, warned", [(4000.0, True), (4900.0, False)])
def test_the_table_bandwidth_is_checked_against_nvml(gate_for, monkeypatch, nvml_gbps, warned):
    from pytest_fp8gate.engines import nvml

    monkeypatch.setattr(nvml, "nvml_bandwidth_gbps", lambda index=0: (nvml_gbps, "NVML: faked"))
    expected = (f"WARNING: NVML gives {nvml_gbps:,.0f} GB/s for this device (NVML: faked), 17% from the "
                "table's 4,800 GB/s; set speed.bandwidth_gbps to the figure you trust")
    warning = nvml.nvml_disagreement(4800.0)  # measuring looks it up and keeps it in the record
    assert warning == (expected if warned else None)
    gate = gate_for(617.0, 600.0)
    gate.measurements.candidate("fp8-per-channel").bandwidth_warning = warning
    verdict = gate.evaluate(Case("speed", "fp8-per-channel"))
    assert [note for note in verdict.notes if note.startswith("WARNING: NVML")] == ([expected] if warned else [])


def test_a_gpu_missing_from_the_table_takes_nvmls_bandwidth(fake_gpus, monkeypatch):
    from pytest_fp8gate.engines import nvml

    fake_gpus("NVIDIA H20")
    monkeypatch.setattr(nvml, "nvml_bandwidth_gbps", lambda index=0: (4022.0, "NVML: 2619 MHz x 6144 bits x 2 / 8"))
    assert nvml.detected_bandwidth("auto") == ("NVIDIA H20 (NVML: 2619 MHz x 6144 bits x 2 / 8)", 4022.0)
    monkeypatch.setattr(nvml, "nvml_bandwidth_gbps", lambda index=0: (None, "NVML unavailable"))
    assert nvml.detected_bandwidth("auto") is None  # then the speed rule asks for speed.bandwidth_gbps


# ---- how many timed iterations (addition) -----------------------------------

def _runs(decode_seconds: list[float]):
    """One iteration per call: total and prefill seconds, the decode part from ``decode_seconds`` in turn."""
    calls = iter([0.5] * 3 + decode_seconds)  # three warm-up iterations first
    return lambda: (0.1 + next(calls), 0.1)


def test_steady_iterations_stop_at_the_least_count_with_their_precision_on_record():
    latency = timed_latency(_runs([2.0, 2.001, 1.999] + [2.0] * 7), 1000, 256, 1, 3, 10, 3, 0.01)
    assert latency.iters == 3 and latency.decode_rel_se is not None and latency.decode_rel_se < 0.01
    assert latency.target_rel_se == 0.01 and latency.as_dict()["decode_rel_se"] == latency.decode_rel_se
    assert latency.decode_tok_s == pytest.approx(255 / 2.0, rel=1e-3)


def test_noisy_iterations_run_until_precise_or_the_most_allowed():
    # Every third iteration 5% slower: the mean settles within 1% only past several iterations.
    noisy = [2.0, 2.1, 2.0] * 10
    latency = timed_latency(_runs(noisy), 1000, 256, 1, 3, 30, 3, 0.01)
    assert 3 < latency.iters < 30 and latency.decode_rel_se is not None and latency.decode_rel_se <= 0.01
    capped = timed_latency(_runs(noisy), 1000, 256, 1, 3, 5, 3, 0.01)
    assert capped.iters == 5 and capped.decode_rel_se is not None and capped.decode_rel_se > 0.01


def test_a_target_of_zero_runs_every_iteration_as_before():
    latency = timed_latency(_runs([2.0] * 10), 1000, 256, 1, 3, 10, 3, 0.0)
    assert latency.iters == 10 and latency.target_rel_se is None


def test_the_least_count_above_the_most_is_a_config_error(tmp_path: Path):
    path = tmp_path / "thresholds.toml"
    path.write_text(demo_config_text({}).replace("[speed]\n", "[speed]\niters = 4\nmin_iters = 5\n"))
    with pytest.raises(ConfigError, match=r"speed\.min_iters: expected at most speed\.iters \(4\), got 5"):
        load_config(path)
    path.write_text(demo_config_text({}).replace("[speed]\n", "[speed]\niters = 4\nwarmup_iters = 1\n"))  # as before
    speed = load_config(path).speed
    assert speed is not None and (speed.iters, speed.min_iters, speed.target_rel_se) == (4, 3, 0.01)


def test_a_prefill_as_long_as_its_total_tells_nothing_yet_and_timing_goes_on():
    # Noise on a shared CPU: an iteration whose prefill took as long as the whole run.
    calls = iter([(0.6, 0.1)] * 3 + [(0.5, 0.5), (0.5, 0.52), (2.1, 0.1), (2.1, 0.1), (2.1, 0.1)] + [(2.1, 0.1)] * 5)
    latency = timed_latency(lambda: next(calls), 1000, 256, 1, 3, 10, 3, 0.01)
    assert latency.iters > 3 and latency.decode_rel_se is not None and latency.decode_rel_se < 1

"""Limits relative to reference builds written from the baseline's own weights: the builds, the settings
and the verdicts (fake engine; the builds are real checkpoints of the embedded model)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from fakes import MODELS, FakeModel, build_measurements, fake_engine_class, fake_gate, thresholds_text, write_gate
from pytest_fp8gate import hardware
from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.config.spec import FP8_REFERENCE_RATIOS
from pytest_fp8gate.errors import ConfigError, MeasurementError
from pytest_fp8gate.face import cases
from pytest_fp8gate.run.reference_builds import E4M3, MARKER, Q8_0, write_build

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")
pytest.importorskip("gguf")

LIMITS = "[probabilities.limits]\nmin_same_top = 0.97674\nmax_rms_dp = 0.01198\nmax_mean_kl = 0.001355\n" \
         "max_ppl_ratio = 1.000425\n"
PROBABILITY_TESTS = ("test_same_top_near_baseline", "test_rms_dp_within_limit", "test_kl_within_limit")


# ---- the builds ----------------------------------------------------------------


def _checkpoint(directory: Path) -> dict[str, torch.Tensor]:
    """Weights named as other architectures name them: fused projections, a GPT-2 style attention, stacked
    experts, a tied embedding, norms and biases."""
    generator = torch.Generator().manual_seed(0)

    def weights(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * 0.05).to(torch.bfloat16)

    tensors = {
        "model.embed_tokens.weight": weights(64, 64),
        "model.layers.0.self_attn.qkv_proj.weight": weights(192, 64),
        "model.layers.0.mlp.experts.w13_weight": weights(4, 96, 64),
        "transformer.h.0.attn.c_attn.weight": weights(64, 192),
        "transformer.h.0.attn.c_attn.bias": weights(192),
        "model.layers.0.input_layernorm.weight": torch.ones(64, dtype=torch.bfloat16),
        "model.layers.0.odd.weight": weights(8, 20),  # rows that do not split into Q8_0's blocks of 32
    }
    directory.mkdir()
    safetensors_torch.save_file(tensors, directory / "model.safetensors")
    (directory / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    return tensors


def _written(directory: Path) -> dict[str, torch.Tensor]:
    return safetensors_torch.load_file(directory / "model.safetensors")


def test_q8_0_rounds_every_weight_matrix_of_any_naming_and_keeps_norms_biases_and_odd_rows(tmp_path: Path):
    source = _checkpoint(tmp_path / "source")
    out = _written(write_build(Q8_0, tmp_path / "source", tmp_path / "q8_0"))
    changed = {name for name in source if not torch.equal(source[name], out[name])}
    assert changed == {"model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.weight",
                       "model.layers.0.mlp.experts.w13_weight", "transformer.h.0.attn.c_attn.weight"}
    for name in changed:  # within half a Q8_0 step of each block, plus BF16's own rounding
        original = source[name].float()
        blocks = original.reshape(-1, 32)
        step = (blocks.abs().amax(dim=1, keepdim=True) / 127).expand_as(blocks).reshape(original.shape)
        assert ((out[name].float() - original).abs() <= step / 2 + original.abs() / 128 + 1e-7).all()
    assert json.loads((tmp_path / "q8_0" / MARKER).read_text())["kind"] == Q8_0
    assert (tmp_path / "q8_0" / "config.json").read_text() == (tmp_path / "source" / "config.json").read_text()


def test_e4m3_rounds_the_linear_layers_per_output_channel_and_keeps_embeddings(tmp_path: Path):
    source = _checkpoint(tmp_path / "source")
    out = _written(write_build(E4M3, tmp_path / "source", tmp_path / "e4m3"))
    changed = {name for name in source if not torch.equal(source[name], out[name])}
    assert changed == {"model.layers.0.self_attn.qkv_proj.weight", "transformer.h.0.attn.c_attn.weight",
                       "model.layers.0.odd.weight"}
    weight, rounded = source["model.layers.0.self_attn.qkv_proj.weight"].float(), out[
        "model.layers.0.self_attn.qkv_proj.weight"].float()
    # Each row's largest weight sits on the FP8 grid's top (448 x its scale): kept up to BF16's rounding.
    assert torch.allclose(rounded.abs().amax(dim=1), weight.abs().amax(dim=1), rtol=1 / 128)
    # E4M3 keeps 3 mantissa bits: within 1/16 of each weight (half a subnormal step near 0), plus BF16's rounding.
    scale = weight.abs().amax(dim=1, keepdim=True) / 448
    assert ((rounded - weight).abs() <= weight.abs() * (1 / 16 + 1 / 128) + scale * 2**-10).all()


def test_an_unknown_build_is_refused(tmp_path: Path):
    with pytest.raises(ValueError, match="unknown build 'q4'; expected one of q8_0, e4m3, bf16-rerounded"):
        write_build("q4", tmp_path, tmp_path / "out")


# ---- the settings ----------------------------------------------------------------


@pytest.mark.parametrize("limits, message", [
    ('reference_ratio = { mean_kl = 4 }\nmax_mean_kl = 0.01', "reference_ratio: needs reference"),
    ('reference = "q8_0"\nreference_ratio = { mean_kl = 4 }\nmax_mean_kl = 0.01',
     "max_mean_kl: set beside reference_ratio.mean_kl"),
    ('reference = "q4_0"', "reference: expected one of 'q8_0', 'e4m3'"),
    ('reference = "q8_0"\nreference_ratio = { mean_kl = 0.5 }', "reference_ratio"),
    ('reference = "q8_0"\nreference_ratio = { kl = 4 }', "unknown probability rule 'kl'"),
])
def test_a_reference_setting_that_cannot_work_is_refused_naming_its_key(tmp_path: Path, limits: str, message: str):
    path = tmp_path / "thresholds.toml"
    path.write_text(thresholds_text(f'[probabilities]\ncorpus = "wikitext-2"\n[probabilities.limits]\n{limits}'))
    with pytest.raises(ConfigError, match=message):
        load_config(path)


def test_a_served_baseline_cannot_have_its_weights_rounded(tmp_path: Path):
    path = tmp_path / "thresholds.toml"
    path.write_text('[baseline]\nname = "bf16"\nendpoint = "http://localhost:8000"\nserved_model_name = "m"\n'
                    '[[candidates]]\nname = "fp8"\nendpoint = "http://localhost:8001"\nserved_model_name = "m"\n'
                    '[probabilities]\n[probabilities.limits]\nreference = "q8_0"\n')
    with pytest.raises(ConfigError, match="probabilities.limits.reference: a reference build is written from "
                                          "the baseline's weights and served as the baseline is; the baseline "
                                          "here is an endpoint"):
        load_config(path)


def test_a_reference_alone_collects_the_rules_it_has_default_factors_for(tmp_path: Path):
    path = tmp_path / "thresholds.toml"
    path.write_text(thresholds_text('[probabilities]\ncorpus = "wikitext-2"\n[probabilities.limits]\n'
                                    'reference = "q8_0"\nreference_ratio = { ppl_ratio = 20 }'))
    config = load_config(path)
    assert config.probabilities is not None and config.probabilities.measured_references == ("q8_0",)
    collected = {name for name in ("test_same_top_near_baseline", "test_rms_dp_within_limit",
                                   "test_kl_within_limit", "test_ppl_ratio_within_limit", "test_kl_p99_within_limit")
                 if cases.cases_for(name, config, fake_engine_class())}
    assert collected == {*PROBABILITY_TESTS, "test_ppl_ratio_within_limit"}
    assert set(FP8_REFERENCE_RATIOS) == {"same_top", "rms_dp", "mean_kl"}


# ---- the verdicts ----------------------------------------------------------------


@pytest.fixture(scope="module")
def judged(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, list, Path]:
    """The write_gate thresholds with its limits given as factors over the model's own Q8_0 round trip, and
    the E4M3 round trip shown beside it; the fake Q8_0 reference sits between the good and the bad candidate."""
    directory = tmp_path_factory.mktemp("reference")
    reference = {"bf16-reference-q8_0": FakeModel(logit_noise=0.02, seed=5),
                 "bf16-reference-e4m3": FakeModel(logit_noise=0.01, seed=6)}
    engine_class = fake_engine_class({**MODELS, **reference})
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hardware, "probe_cuda", lambda: hardware.CudaProbe((), "faked by the test"))
        config = load_config(write_gate(directory, lambda text: text.replace(
            LIMITS, '[probabilities.limits]\nreference = "q8_0"\n').replace(
            "top_k = 5\n", 'top_k = 5\nreferences = ["e4m3"]\n'), task=False))
        found = [param.values[0] for name in PROBABILITY_TESTS for param in cases.cases_for(name, config, engine_class)]
        gate = fake_gate(config, directory / "artifacts", cases.needs_of(found), engine_class)
        verdicts = {(case.rule, case.candidate): gate.evaluate(case) for case in found}
    return verdicts, engine_class.calls, directory


def test_limits_over_the_reference_pass_the_good_build_and_fail_the_bad_one(judged: tuple[dict, list, Path]):
    verdicts, _, _ = judged
    assert {key: verdict.passed for key, verdict in verdicts.items()} == {
        (rule, candidate): candidate == "good" for rule in ("same_top", "rms_dp", "mean_kl")
        for candidate in ("good", "bad")}


def test_a_verdict_reads_against_the_reference_measured_on_this_model_and_the_floor(judged: tuple[dict, list, Path]):
    verdicts, _, directory = judged
    text = verdicts["mean_kl", "bad"].explain()
    rows = dict(verdicts["mean_kl", "bad"].outcome.rows)
    reference = rows["reference q8_0 on this model"]
    assert rows[f"{FP8_REFERENCE_RATIOS['mean_kl']:g} x its distance from 0"] == pytest.approx(
        FP8_REFERENCE_RATIOS["mean_kl"] * reference)
    assert f"limit: {directory / 'thresholds.toml'} probabilities.limits.reference_ratio.mean_kl = 10" in text
    notes = [line for line in text.splitlines() if "the mean_kl distance from 0 of" in line]
    yardsticks = ("reference e4m3, measured on this model's weights",
                  "reference q8_0, measured on this model's weights", "the worst noise pass")
    assert len(notes) == 3 and all(what in note for note, what in zip(notes, yardsticks))


def test_a_limit_over_the_reference_carries_the_reference_s_own_se(judged: tuple[dict, list, Path]):
    """The reference is measured once: its clustered SE, times the factor, widens the limit's SE (an addition)."""
    import math

    from pytest_fp8gate.core import rules

    verdicts, _, _ = judged
    factor = FP8_REFERENCE_RATIOS["mean_kl"]
    outcome = verdicts["mean_kl", "good"].outcome
    reference_se = dict(outcome.rows)[f"{factor:g} x the reference's SE (addition)"]
    assert reference_se > 0 and outcome.limit_key == "reference_ratio.mean_kl"
    assert outcome.figures["limit_se"] > reference_se
    null_se = math.sqrt(outcome.figures["limit_se"] ** 2 - reference_se**2)
    # The same figures with the reference taken as exact: a narrower SE, a larger z past the limit.
    beyond = 0.010 + 2 * null_se  # two null SEs past the limit
    exact = rules.at_most("mean_kl", beyond, 0.010, measured_se=null_se, k_se=1.0)
    carried = rules.at_most("mean_kl", beyond, 0.010, measured_se=null_se, k_se=1.0, reference_se=reference_se)
    assert carried.figures["limit_se"] == pytest.approx(math.hypot(null_se, reference_se))
    assert carried.figures["p_value"] > exact.figures["p_value"]
    assert any("the reference's SE, delta method" in label for label, _ in carried.rows)


def test_each_reference_is_written_measured_in_its_own_engine_and_removed(judged: tuple[dict, list, Path]):
    _, calls, directory = judged
    started = [call[1] for call in calls if call[0] == "start"]
    # After the baseline's own engines (its main pass, its precision noise pass), before any candidate's.
    assert started[:4] == ["bf16", "bf16", "bf16-reference-e4m3", "bf16-reference-q8_0"]
    assert (directory / "artifacts" / "bf16" / "reference-q8_0" / "logprobs.npz").is_file()
    assert not list((directory / "artifacts").glob(".reference-*"))  # the written checkpoints are gone


def test_a_baseline_without_safetensors_weights_is_named_before_any_candidate(tmp_path: Path):
    from pytest_fp8gate.tools.demo.embedded import embedded_assets

    model = tmp_path / "bin-model"  # weights vLLM loads, but no safetensors to round
    model.mkdir()
    shutil.copy2(embedded_assets().model / "config.json", model / "config.json")
    (model / "pytorch_model.bin").write_bytes(b"weights")
    engine_class = fake_engine_class(MODELS)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hardware, "probe_cuda", lambda: hardware.CudaProbe((), "faked by the test"))
        config = load_config(write_gate(tmp_path, lambda text: text.replace(
            LIMITS, '[probabilities.limits]\nreference = "q8_0"\n').replace(
            embedded_assets().model.as_posix(), model.as_posix()), task=False))
        found = [param.values[0] for param in cases.cases_for("test_kl_within_limit", config, engine_class)]
        measurements = build_measurements(config, tmp_path / "artifacts", cases.needs_of(found), engine_class)
        with pytest.raises(MeasurementError, match=r"reference q8_0: .*bin-model: no \*\.safetensors weights"):
            measurements.record()
    assert [call[1] for call in engine_class.calls if call[0] == "start"] == ["bf16", "bf16"]  # no candidate's


def test_a_bucket_rule_reads_its_limit_from_the_reference_s_same_bucket(tmp_path: Path):
    """Early and late positions differ for every build: a bucket is held to the reference's figure on that
    bucket, not on the whole chunk. The fake reference departs from the baseline only past position 300."""
    from pytest_fp8gate.core import rules
    from pytest_fp8gate.judge.verdict import Case
    from pytest_fp8gate.run.record import Needs

    models = {**MODELS, "bf16-reference-q8_0": FakeModel(position_noise=0.05, position_onset=300, seed=5)}
    engine_class = fake_engine_class(models)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(hardware, "probe_cuda", lambda: hardware.CudaProbe((), "faked by the test"))
        config = load_config(write_gate(tmp_path, lambda text: text.replace(
            LIMITS, '[probabilities.limits]\nreference = "q8_0"\nper_bucket = true\n').replace(
            "top_k = 5\n", "top_k = 5\nbucket_edges = [300]\nmin_bucket_positions = 50\n"), task=False))
        needs = {n: Needs(probabilities=True) for n in MODELS}
        gate = fake_gate(config, tmp_path / "artifacts", needs, engine_class)
        verdict = gate.evaluate(Case(rules.BUCKET_PREFIX + "mean_kl", "bad"))
    bucket = verdict.outcome.figures["bucket_start"]
    reference = gate.comparisons.references()["q8_0"]
    label = next(b.label for b in reference.buckets if b.start == bucket)
    rows = dict(verdict.outcome.rows)
    assert rows[f"reference q8_0 on this model, bucket {label}"] == reference.bucket(label).mean_kl
    # The reference's buckets differ (nothing changed before 300), so the whole chunk's figure would not do.
    early, late = (b.comparison.mean_kl for b in reference.buckets)
    assert early < late / 10

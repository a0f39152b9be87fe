"""The rule tests a thresholds file produces: ids, marks and what each engine must measure."""

from __future__ import annotations

import pytest

from fakes import thresholds_text
from pytest_fp8gate.face.cases import needs_of
from pytest_fp8gate.judge.verdict import Case
from pytest_fp8gate.run.record import Needs

CONFIG = thresholds_text(
    '[[candidates]]\nname = "fp8-dynamic"\nmodel = "org/model-fp8"',
    '[[candidates]]\nname = "fp8-online"\nquantization = "fp8_per_channel"',
    '[probabilities]\ncorpus = "corpus.txt"\nchunks = 1\nchunk_tokens = 8\n'
    "[probabilities.limits]\nmin_same_top = 0.97674\nmax_mean_kl = 0.001355",
    '[[tasks]]\nname = "gsm8k"\ntask = "gsm8k"\nfilter = "strict-match"\nmetric = "exact_match"',
    "[speed]\n{speed}", model="org/model", candidate=None, head='device = "{device}"')


def _write(pytester: pytest.Pytester, device: str = "cuda", speed: str = "") -> None:
    pytester.makefile(".txt", corpus="some text")
    pytester.makefile(".toml", thresholds=CONFIG.format(device=device, speed=speed))


def test_rule_ids_are_read_from_the_thresholds_file(pytester: pytest.Pytester) -> None:
    _write(pytester)
    result = pytester.runpytest("--collect-only", "-q", "thresholds.toml")
    # In the rule table's order (core/rules.py's RULES), each rule's cases in the thresholds file's.
    result.stdout.fnmatch_lines([
        "thresholds.toml::test_accuracy_within_se[fp8-dynamic-gsm8k]",
        "thresholds.toml::test_accuracy_within_se[fp8-online-gsm8k]",
        "thresholds.toml::test_flips_within_noise_floor[fp8-dynamic-gsm8k]",
        "thresholds.toml::test_flips_within_noise_floor[fp8-online-gsm8k]",
        "thresholds.toml::test_paired_accuracy[fp8-dynamic-gsm8k]",
        "thresholds.toml::test_paired_accuracy[fp8-online-gsm8k]",
        "thresholds.toml::test_same_top_near_baseline[fp8-dynamic]",
        "thresholds.toml::test_same_top_near_baseline[fp8-online]",
        "thresholds.toml::test_kl_within_limit[fp8-dynamic]",
        "thresholds.toml::test_kl_within_limit[fp8-online]",
        "thresholds.toml::test_decode_speed_near_ceiling[fp8-dynamic]",
        "thresholds.toml::test_decode_speed_near_ceiling[fp8-online]",
        "12 tests collected*",
    ])
    # Limits that are not configured produce no test at all, not an empty skip.
    assert "rms_dp" not in result.stdout.str() and "ppl_ratio" not in result.stdout.str()


def test_cuda_rules_are_marked_gpu_and_skip_without_one(pytester: pytest.Pytester) -> None:
    _write(pytester)
    selected = pytester.runpytest("--collect-only", "-q", "-m", "gpu and fp8gate", "thresholds.toml")
    selected.stdout.fnmatch_lines(["12 tests collected*"])
    ran = pytester.runpytest("-m", "gpu", "thresholds.toml", "-rs")
    ran.assert_outcomes(skipped=12)
    ran.stdout.fnmatch_lines(["*no CUDA device visible*"])


def test_require_gpu_turns_the_skips_into_errors(pytester: pytest.Pytester) -> None:
    _write(pytester)
    result = pytester.runpytest("thresholds.toml", "--fp8gate-require-gpu", "-k", "kl_within")
    result.assert_outcomes(errors=2)
    result.stdout.fnmatch_lines(["*must never pass by skipping*"])


def test_cpu_config_is_not_marked_gpu_and_speed_skips_without_bandwidth(pytester: pytest.Pytester) -> None:
    _write(pytester, device="cpu")
    result = pytester.runpytest("--collect-only", "-q", "-m", "gpu", "thresholds.toml")
    result.stdout.fnmatch_lines(["*no tests collected (12 deselected)*"])
    speed = pytester.runpytest("-k", "decode_speed", "thresholds.toml", "-rs")
    speed.assert_outcomes(skipped=2)
    speed.stdout.fnmatch_lines(["*no memory-bandwidth figure for the CPU engine*"])


def test_needs_follow_the_selected_cases() -> None:
    cases = [Case("same_top", "a"), Case("flips", "a", "gsm8k"), Case("speed", "b")]
    assert needs_of(cases) == {
        "a": Needs(probabilities=True, tasks=frozenset({"gsm8k"})),
        "b": Needs(speed=True),
    }


def test_users_own_tests_get_the_gate_fixtures(pytester: pytest.Pytester) -> None:
    _write(pytester)
    pytester.makepyfile(test_mine="""
        def test_my_prompts(fp8gate_config, fp8gate):
            assert [c.name for c in fp8gate_config.candidates] == ["fp8-dynamic", "fp8-online"]
            assert fp8gate.gate.config is fp8gate_config
            assert fp8gate.artifacts.is_dir()
    """)
    pytester.runpytest("test_mine.py").assert_outcomes(passed=1)


def test_without_a_thresholds_file_the_fixture_skips(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_mine="def test_x(fp8gate_config):\n    pass\n")
    result = pytester.runpytest("-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(["*no fp8gate thresholds file*"])


@pytest.mark.engine  # writes the demo's two checkpoints, calibration included, as a demo run does
def test_demo_creates_its_workdir_and_collects_the_demo_rules(tmp_path) -> None:
    import subprocess
    import sys

    workdir = tmp_path / "not" / "yet" / "there"
    done = subprocess.run(
        [sys.executable, "-m", "pytest_fp8gate.tools.cli", "demo", "--workdir", str(workdir), "--checkpoints", "--",
         "--collect-only", "-q"],
        capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (workdir / "thresholds.toml").is_file()
    assert "thresholds.toml::test_flips_within_noise_floor[fp8-per-channel-tiny-arith]" in done.stdout
    assert "thresholds.toml::test_kl_within_limit[fp8-per-channel]" in done.stdout
    # fp8_per_channel online, the FP8 KV cache, the two checkpoints and the BF16 control written from the
    # model: 7 rules each (the probability limits are factors over Q8_0 for same top, RMS dp and KL), and the
    # 4 of the decode phase
    assert "thresholds.toml::test_kl_within_limit[fp8-dynamic]" in done.stdout
    assert "thresholds.toml::test_kl_within_limit[fp8-static]" in done.stdout
    assert "thresholds.toml::test_kl_within_limit[bf16-rerounded]" in done.stdout
    assert "thresholds.toml::test_decode_vs_prefill_gap[bf16-fp8-kv]" in done.stdout
    assert "55 tests collected" in done.stdout


def test_the_demo_on_cuda_has_speed_judged_with_cuda_graphs(tmp_path) -> None:
    from pytest_fp8gate.config.loader import load_config
    from pytest_fp8gate.tools.demo.run import demo_config_text

    path = tmp_path / "thresholds.toml"
    path.write_text(demo_config_text({}, cuda=True), encoding="utf-8")
    config = load_config(path)
    assert config.device == "cuda" and config.baseline.engine["enforce_eager"] is False
    assert config.tasks[0].limit == 500  # all of them: seconds a pass on a GPU, minutes on 2 CPU cores
    path.write_text(demo_config_text({}), encoding="utf-8")
    assert load_config(path).tasks[0].limit == 100
    assert config.speed is not None and config.speed.gpu == "auto"


def test_cpu_skips_a_candidate_it_cannot_run_with_the_engines_reason(pytester: pytest.Pytester, tmp_path) -> None:
    pytest.importorskip("torch")
    from pytest_fp8gate.tools.demo.embedded import embedded_assets
    from pytest_fp8gate.tools.demo.run import CHECKPOINT_SCHEMES, demo_config_text
    from pytest_fp8gate.tools.fp8_writer import write_fp8_checkpoint

    # One sentence calibrates: the skip reads the checkpoint's layout, not its scales (the
    # demo's 16 pieces of 2,048 tokens take a minute on two cores).
    checkpoints = {scheme: write_fp8_checkpoint(embedded_assets().model, tmp_path / scheme, scheme,
                                                calibration=["Some text to pass through the model."])
                   for scheme in CHECKPOINT_SCHEMES}
    pytester.makefile(".toml", thresholds=demo_config_text({}, checkpoints))
    result = pytester.runpytest("--collect-only", "-q", "-rs", "thresholds.toml")
    skipped = [item for item in result.stdout.lines if "fp8-static" in item]
    assert skipped  # collected, then skipped at run time with the reason below
    run = pytester.runpytest("-q", "-rs", "-k", "fp8-static", "thresholds.toml")
    run.assert_outcomes(skipped=7 + 4)  # and the four rules of the demo's [decode]
    run.stdout.fnmatch_lines(["*candidate fp8-static*static activation scales*static_scaled_fp8_quant*"])

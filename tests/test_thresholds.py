from __future__ import annotations

import json
from pathlib import Path

import pytest

from fakes import thresholds_text
from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.config.spec import (
    WIKITEXT_2,
    DatasetCorpus,
    FileCorpus,
    ModelSpec,
    NoiseSpec,
    ProbabilityLimits,
    SpeedSpec,
    TaskLimits,
)
from pytest_fp8gate.errors import ConfigError

REPO_THRESHOLDS = Path(__file__).parent.parent / "thresholds.toml"

MODELS = thresholds_text()
MINIMAL = thresholds_text("[speed]")


@pytest.fixture
def write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """Write thresholds.toml in a fresh working directory and return its relative path."""
    monkeypatch.chdir(tmp_path)

    def write(text: str) -> Path:
        path = Path("thresholds.toml")
        path.write_text(text, encoding="utf-8")
        return path

    return write


def error_of(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path)
    return str(info.value)


def test_repo_thresholds_encode_the_article():
    gate = load_config(REPO_THRESHOLDS)
    assert gate.path == REPO_THRESHOLDS.resolve()
    assert gate.baseline.model == "meta-llama/Llama-3.1-8B-Instruct"
    assert [(c.name, c.model, c.quantization) for c in gate.candidates] == [
        ("fp8-dynamic", "RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8-dynamic", None),
        ("fp8-per-tensor", "RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8", None),
        ("fp8-online-per-channel", "meta-llama/Llama-3.1-8B-Instruct", "fp8_per_channel"),
    ]
    assert gate.noise == NoiseSpec(("batch-order",))
    probabilities = gate.probabilities
    assert probabilities is not None
    assert (probabilities.corpus, probabilities.chunks, probabilities.chunk_tokens, probabilities.top_k) == (
        WIKITEXT_2,
        100,
        2048,
        20,
    )
    # Limits as the default factors over the model's own Q8_0 round trip, the ideal E4M3 shown beside it.
    assert probabilities.limits == ProbabilityLimits(reference="q8_0")
    assert probabilities.measured_references == ("e4m3", "q8_0")
    (gsm8k,) = gate.tasks
    assert (gsm8k.task, gsm8k.num_fewshot, gsm8k.add_bos_token, gsm8k.filter, gsm8k.metric) == (
        "gsm8k",
        5,
        True,
        "strict-match",
        "exact_match",
    )
    assert gsm8k.limits == TaskLimits(accuracy_se=1.0, two_sided=False, flips_ratio=2.0, min_flip_allowance=0.01)
    assert gate.speed == SpeedSpec(input_len=1000, output_len=256, batch_size=1, min_fraction_of_ceiling=0.8)


LIMIT_KEYS = (
    "min_same_top max_rms_dp max_mean_kl max_ppl_ratio accuracy_se flips_ratio min_flip_allowance "
    "min_fraction_of_ceiling min_share_of_baseline"
).split()


def test_every_repo_threshold_says_where_it_comes_from():
    lines = REPO_THRESHOLDS.read_text().splitlines()
    for i, line in enumerate(lines):
        if line.split("=")[0].strip() in LIMIT_KEYS:
            assert "#" in line or lines[i - 1].startswith("#"), line


def test_defaults(write):
    gate = load_config(write(MINIMAL))
    assert gate.noise.passes == ("batch-order",)
    assert gate.probabilities is None and gate.tasks == ()
    assert gate.speed == SpeedSpec()
    assert gate.device == "cuda" and gate.deterministic_scheduling is False


def test_deterministic_scheduling_is_read(write):
    assert load_config(write("deterministic_scheduling = true\n" + MINIMAL)).deterministic_scheduling is True


def test_candidate_defaults_to_baseline_model_and_merges_engine(write):
    gate = load_config(
        write(
            MINIMAL
            + """
[baseline.engine]
max_model_len = 4096
seed = 0
gpu_memory_utilization = 1

[candidates.engine]
seed = 1
enforce_eager = true
"""
        )
    )
    (candidate,) = gate.candidates
    assert candidate.model == "org/base"
    assert candidate.engine == {"max_model_len": 4096, "seed": 1, "gpu_memory_utilization": 1.0, "enforce_eager": True}
    assert candidate.engine_kwargs() == {
        "model": "org/base",
        "quantization": "fp8_per_channel",
        "max_model_len": 4096,
        "seed": 1,
        "gpu_memory_utilization": 1.0,
        "enforce_eager": True,
    }
    assert gate.baseline.engine_kwargs()["quantization"] is None
    assert len({gate.baseline, candidate}) == 2  # specs are hashable despite the engine dict


def test_local_paths_resolve_against_the_toml_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                        make_checkpoint):
    config_dir = tmp_path / "gate"
    for folder in ("models/tiny", "models/fp8"):
        make_checkpoint(config_dir / folder)
    (config_dir / "tasks").mkdir()
    (config_dir / "corpus.txt").write_text("some text")
    (config_dir / "thresholds.toml").write_text(
        """
[baseline]
name = "bf16"
model = "./models/tiny"

[[candidates]]
name = "fp8"
model = "models/fp8"          # exists relative to the TOML, so it is local
[candidates.engine]
tokenizer = "models/tiny"

[[candidates]]
name = "hub"
model = "models/not-here"     # does not exist and does not look local: a hub id

[probabilities]
corpus = "corpus.txt"
chunks = 1
chunk_tokens = 8
[probabilities.limits]
max_mean_kl = 0.01

[[tasks]]
task = "mini"
metric = "exact_match"
include_path = "tasks"
"""
    )
    monkeypatch.chdir(tmp_path)  # the working directory must not matter
    gate = load_config(config_dir / "thresholds.toml")
    assert gate.baseline.model == str(config_dir / "models/tiny")
    assert gate.candidates[0].model == str(config_dir / "models/fp8")
    assert gate.candidates[0].engine["tokenizer"] == str(config_dir / "models/tiny")
    assert gate.candidates[1].model == "models/not-here"
    assert gate.probabilities is not None and gate.probabilities.corpus == FileCorpus(config_dir / "corpus.txt")
    assert gate.tasks[0].name == "mini" and gate.tasks[0].include_path == config_dir / "tasks"


def test_corpus_as_dataset_table(write):
    gate = load_config(
        write(
            MODELS
            + """
[probabilities]
corpus = { dataset = "org/texts", column = "body" }
full_vocab = true
[probabilities.limits]
min_same_top = 0.99
"""
        )
    )
    assert gate.probabilities is not None
    assert gate.probabilities.corpus == DatasetCorpus("org/texts", None, "test", "body")
    assert gate.probabilities.full_vocab is True


BAD_INPUTS = {
    "unknown key with suggestion": (
        MINIMAL + '[[candidates]]\nname = "b"\nmodel = "org/b"\n[candidates.engine]\ntensor_paralel_size = 2\n',
        "candidates[1].engine.tensor_paralel_size: unknown key; did you mean 'tensor_parallel_size'?",
    ),
    "unknown section": (
        MINIMAL + "[extra]\n",
        "extra: unknown key; expected one of: baseline, candidates, decode, deterministic_scheduling, device, load, "
        "noise, probabilities, run_alpha, speculative, speed, tasks",
    ),
    "misspelled array of tables": (
        MINIMAL + '[[candidate]]\nname = "x"\n',
        "candidate: unknown key; did you mean 'candidates'?",
    ),
    "string for integer": (
        MINIMAL + '[baseline.engine]\ntensor_parallel_size = "2"\n',
        "baseline.engine.tensor_parallel_size: expected an integer >= 1, got string '2'",
    ),
    "integer for boolean": (
        "deterministic_scheduling = 1\n" + MINIMAL,
        "deterministic_scheduling: expected true or false, got 1",
    ),
    "boolean for integer": (
        MINIMAL + "[baseline.engine]\nmax_num_seqs = true\n",
        "baseline.engine.max_num_seqs: expected an integer >= 1, got boolean true",
    ),
    "table for a value": (
        MINIMAL + "[baseline.engine]\nseed = { value = 1 }\n",
        "baseline.engine.seed: expected an integer >= 0, got a table",
    ),
    "value for a table": (
        MODELS + "engine = 3\n[speed]\n",
        "candidates[0].engine: expected a table, got 3",
    ),
    "choice with suggestion": (
        MINIMAL + '[baseline.engine]\ndtype = "bfloat61"\n',
        "baseline.engine.dtype: expected one of 'auto', 'half', 'float16', 'bfloat16', 'float', 'float32', "
        "got string 'bfloat61'; did you mean 'bfloat16'?",
    ),
    "fraction out of range": (
        MINIMAL + "[baseline.engine]\ngpu_memory_utilization = 1.5\n",
        "baseline.engine.gpu_memory_utilization: expected a number in (0, 1], got 1.5; a fraction, not a percent: "
        "did you mean 0.015?",
    ),
    "percentage instead of fraction": (
        MODELS + "[probabilities.limits]\nmin_same_top = 97.674\n",
        "probabilities.limits.min_same_top: expected a number in (0, 1], got 97.674; a fraction, not a percent: "
        "did you mean 0.97674?",
    ),
    "plain fp8 on the baseline's weights": (
        thresholds_text("[speed]", candidate='quantization = "fp8"'),
        'candidates[0].quantization: plain "fp8" is deprecated for online quantization since vLLM 0.31, which runs '
        'it as fp8_per_tensor; write "fp8_per_tensor" (one weight scale per matrix, as the roofline counts it) or '
        '"fp8_per_channel" (one per output row)',
    ),
    "ratio below one": (
        MODELS + "[[tasks]]\ntask = \"t\"\nmetric = \"acc\"\n[tasks.limits]\nflips_ratio = 0.5\n",
        "tasks[0].limits.flips_ratio: expected a number >= 1, got 0.5",
    ),
    "unknown flip rule": (
        MODELS + "[[tasks]]\ntask = \"t\"\nmetric = \"acc\"\n[tasks.limits]\nflip_rule = \"binomal\"\n",
        "tasks[0].limits.flip_rule: expected one of 'ratio', 'binomial', got string 'binomal'; "
        "did you mean 'binomial'?",
    ),
    "flip test level out of range": (
        MODELS + "[[tasks]]\ntask = \"t\"\nmetric = \"acc\"\n[tasks.limits]\nflip_alpha = 0.9\n",
        "tasks[0].limits.flip_alpha: expected a number in (0, 0.5], got 0.9",
    ),
    "not finite": (
        MINIMAL.replace("[speed]", "[speed]\nbandwidth_gbps = nan"),
        "speed.bandwidth_gbps: expected a number >= 0, got nan",
    ),
    "zero iterations": (
        MINIMAL.replace("[speed]", "[speed]\niters = 0"),
        "speed.iters: expected an integer >= 1, got 0",
    ),
    "missing required key": (
        MINIMAL.replace('model = "org/base"', ""),
        "baseline.model: missing required key",
    ),
    "missing baseline": (
        MINIMAL.replace("[baseline]", "[noise]"),
        "baseline: missing required table [baseline]",
    ),
    "missing candidates": (
        thresholds_text("[speed]", candidate=None),
        "candidates: expected at least one [[candidates]] table",
    ),
    "empty candidates": (
        thresholds_text("[speed]", candidate=None, head="candidates = []"),
        "candidates: expected at least one [[candidates]] table",
    ),
    "candidates as one table": (
        thresholds_text('[candidates]\nname = "fp8"', "[speed]", candidate=None),
        "candidates: expected an array of tables ([[candidates]]), got a table",
    ),
    "duplicate candidate names": (
        MINIMAL + '[[candidates]]\nname = "fp8"\nmodel = "org/other"\n',
        "candidates[1].name: duplicate name 'fp8' (also used by candidates[0])",
    ),
    "candidate named like the baseline": (
        MINIMAL.replace('name = "fp8"', 'name = "bf16"'),
        "candidates[0].name: duplicate name 'bf16' (also used by baseline)",
    ),
    "duplicate task names": (
        MODELS + '[[tasks]]\ntask = "gsm8k"\nmetric = "m"\n[[tasks]]\ntask = "gsm8k"\nmetric = "m"\n',
        "tasks[1].name: duplicate name 'gsm8k' (also used by tasks[0])",
    ),
    "name unusable in test ids": (
        MINIMAL.replace('name = "fp8"', 'name = "fp8 dynamic"'),
        "candidates[0].name: expected a name of letters, digits, '.', '_', '+' or '-' (it becomes part of test ids), "
        "got string 'fp8 dynamic'",
    ),
    "candidate identical to the baseline": (
        MINIMAL.replace('quantization = "fp8_per_channel"', ""),
        "candidates[0]: same model, quantization and engine as the baseline; it would gate nothing",
    ),
    "no check at all": (
        MODELS,
        "(top level): expected at least one check: [probabilities], [[tasks]], [speed] or [load]",
    ),
    "unknown noise pass": (
        MINIMAL + '[noise]\npasses = ["batch_order"]\n',
        "noise.passes: expected one of 'batch-order', 'fp16', 'fp32', got string 'batch_order'; "
        "did you mean 'batch-order'?",
    ),
    "no noise pass": (
        MINIMAL + "[noise]\npasses = []\n",
        "noise.passes: expected a non-empty array of noise passes ('batch-order', 'fp16', 'fp32'), got an array",
    ),
    "probabilities without limits": (
        MODELS + "[probabilities]\nchunks = 10\n",
        "probabilities.limits: expected at least one of min_same_top, max_rms_dp, max_mean_kl, max_ppl_ratio, "
        "max_kl_p99, or a reference; nothing is gated",
    ),
    "probabilities with only how-to-judge keys": (
        MODELS + "[probabilities]\nchunks = 10\n[probabilities.limits]\nfloor_ratio = 2.0\nlimit_se = 0\n",
        "probabilities.limits: expected at least one of min_same_top, max_rms_dp, max_mean_kl, max_ppl_ratio, "
        "max_kl_p99, or a reference; nothing is gated",
    ),
    "floor_ratio table with an unknown rule": (
        MODELS + "[probabilities]\n[probabilities.limits]\nmax_mean_kl = 0.1\nfloor_ratio = { kl = 20 }\n",
        "probabilities.limits.floor_ratio: unknown probability rule 'kl' in the table; expected a number or a "
        "table of same_top, rms_dp, mean_kl, ppl_ratio, kl_p99",
    ),
    "floor_ratio table with a factor below 1": (
        MODELS + "[probabilities]\n[probabilities.limits]\nmax_mean_kl = 0.1\nfloor_ratio = { mean_kl = 0.5 }\n",
        "probabilities.limits.floor_ratio: expected a number >= 1, got 0.5",
    ),
    "negative limit_se": (
        MODELS + "[probabilities]\n[probabilities.limits]\nmax_mean_kl = 0.1\nlimit_se = -1\n",
        "probabilities.limits.limit_se: expected a number >= 0, got -1",
    ),
    "full_vocab": (
        MODELS + '[probabilities]\nfull_vocab = "yes"\n[probabilities.limits]\nmax_mean_kl = 0.1\n',
        'probabilities.full_vocab: expected "auto", true or false, got string \'yes\'',
    ),
    "corpus table without dataset": (
        MODELS + '[probabilities]\ncorpus = { split = "test" }\n[probabilities.limits]\nmax_mean_kl = 0.1\n',
        "probabilities.corpus.dataset: missing required key",
    ),
    "chunk longer than the context": (
        MODELS
        + "[baseline.engine]\nmax_model_len = 1024\n"
        + "[probabilities]\nchunk_tokens = 2048\n[probabilities.limits]\nmax_mean_kl = 0.1\n",
        "probabilities.chunk_tokens: needs 2049 tokens of context (chunk_tokens + 1) "
        "but baseline.engine.max_model_len is 1024",
    ),
    "speed longer than a candidate's context": (
        MODELS + "[candidates.engine]\nmax_model_len = 1200\n[speed]\n",
        "speed.output_len: needs 1256 tokens of context (input_len + output_len) "
        "but candidates[0].engine.max_model_len is 1200",
    ),
    "multiturn without chat template": (
        MODELS + '[[tasks]]\ntask = "gsm8k"\nmetric = "exact_match"\nfewshot_as_multiturn = true\n',
        "tasks[0].fewshot_as_multiturn: has no effect unless apply_chat_template = true",
    ),
    "unknown GPU": (
        MINIMAL.replace("[speed]", '[speed]\ngpu = "MI300X"'),
        "speed.gpu: unknown GPU 'MI300X'; expected \"auto\", one of B200, H200, H100 PCIe, H100 NVL, H100 SXM, "
        "A100 80GB PCIe, A100 80GB SXM, A100 40GB, A40, A30, A10G, A10, L40S, L40, L4, T4, V100, "
        "RTX PRO 6000 Blackwell, RTX 6000 Ada, RTX A6000, RTX 5090, RTX 5080, RTX 5070 Ti, RTX 5070, RTX 4090, "
        "RTX 3090, or any label together with speed.bandwidth_gbps > 0",
    ),
}


# The suggestion for an unknown engine key comes from vLLM's EngineArgs: it imports vLLM (seconds).
IMPORTS_VLLM = {"unknown key with suggestion"}


@pytest.mark.parametrize("text, message", [
    pytest.param(text, message, id=name, marks=[pytest.mark.engine] if name in IMPORTS_VLLM else [])
    for name, (text, message) in BAD_INPUTS.items()])
def test_bad_input_is_one_clear_line(write, text: str, message: str):
    assert error_of(write(text)) == f"thresholds.toml: {message}"


@pytest.mark.parametrize(
    "line, where",
    [
        ('model = "./models/missing"', "candidates[0].model"),
        ('model = "../elsewhere/model"', "candidates[0].model"),
    ],
)
def test_missing_local_model(write, tmp_path: Path, line: str, where: str):
    path = write(MINIMAL.replace('quantization = "fp8_per_channel"', line))
    local = (tmp_path / line.split('"')[1]).resolve()
    assert error_of(path) == f"thresholds.toml: {where}: local path not found: {local}"


def test_missing_corpus_file(write, tmp_path: Path):
    path = write(MODELS + '[probabilities]\ncorpus = "data/wiki.txt"\n[probabilities.limits]\nmax_mean_kl = 0.1\n')
    assert error_of(path) == (
        f"thresholds.toml: probabilities.corpus: file not found: {tmp_path / 'data/wiki.txt'} "
        '(expected "wikitext-2", a text file or a table {dataset = ...})'
    )


def test_missing_include_path(write, tmp_path: Path):
    path = write(MODELS + '[[tasks]]\ntask = "mine"\nmetric = "acc"\ninclude_path = "my_tasks"\n')
    assert error_of(path) == f"thresholds.toml: tasks[0].include_path: directory not found: {tmp_path / 'my_tasks'}"


def test_unknown_gpu_is_fine_with_explicit_bandwidth(write):
    gate = load_config(write(MINIMAL.replace("[speed]", '[speed]\ngpu = "MI300X"\nbandwidth_gbps = 5300')))
    assert gate.speed is not None and (gate.speed.gpu, gate.speed.bandwidth_gbps) == ("MI300X", 5300.0)


def test_gpu_name_is_normalised(write):
    gate = load_config(write(MINIMAL.replace("[speed]", '[speed]\ngpu = "nvidia l40s"')))
    assert gate.speed is not None and gate.speed.gpu == "L40S"


def test_invalid_toml(write):
    message = error_of(write("[baseline\nname = 1\n"))
    assert message.startswith("thresholds.toml: invalid TOML: ") and "line 1" in message
    assert "\n" not in message


def test_missing_file(write):
    assert error_of(Path("nowhere.toml")) == "nowhere.toml: file not found"


def test_model_spec_engine_kwargs_is_a_copy():
    spec = ModelSpec("a", "org/a", None, {"seed": 0})
    spec.engine_kwargs()["seed"] = 5
    assert spec.engine == {"seed": 0}


def test_floor_ratio_is_one_factor_or_one_per_rule(tmp_path: Path) -> None:
    path = tmp_path / "thresholds.toml"
    path.write_text(MODELS + "[probabilities]\n[probabilities.limits]\nmax_mean_kl = 0.1\n"
                    "floor_ratio = { mean_kl = 20 }\n", encoding="utf-8")
    limits = load_config(path).probabilities.limits
    assert limits.floor_ratio_for("mean_kl") == 20 and limits.floor_ratio_for("same_top") is None
    path.write_text(MODELS + "[probabilities]\n[probabilities.limits]\nmax_mean_kl = 0.1\nfloor_ratio = 3\n",
                    encoding="utf-8")
    limits = load_config(path).probabilities.limits
    assert limits.floor_ratio_for("mean_kl") == limits.floor_ratio_for("same_top") == 3


@pytest.fixture
def checkpoint_with(make_checkpoint):
    """A minimal local checkpoint whose config.json holds these keys."""
    def write(directory: Path, **config: object) -> Path:
        make_checkpoint(directory)
        (directory / "config.json").write_text(json.dumps({"vocab_size": 32, **config}))
        return directory

    return write


def test_plain_fp8_stays_valid_on_an_fp8_checkpoint(write, tmp_path: Path, checkpoint_with):
    fp8 = checkpoint_with(tmp_path / "fp8", quantization_config={"quant_method": "fp8"})
    bf16 = checkpoint_with(tmp_path / "bf16")
    gate = load_config(write(thresholds_text("[speed]", candidate=f'model = "{fp8}"\nquantization = "fp8"')))
    assert gate.candidates[0].quantization == "fp8"
    message = error_of(write(thresholds_text("[speed]", candidate=f'model = "{bf16}"\nquantization = "fp8"')))
    assert message.startswith('thresholds.toml: candidates[0].quantization: plain "fp8" is deprecated')


@pytest.mark.parametrize("model_type", ["gemma2", "gemma3_text"])
def test_float16_is_refused_where_vllm_refuses_it(write, tmp_path: Path, checkpoint_with, model_type: str):
    model = checkpoint_with(tmp_path / "gemma", model_type=model_type)
    reason = f"which vLLM refuses for model type {model_type!r} (Numerical instability. Please use bfloat16 or " \
             "float32 instead.)"
    fp16_pass = thresholds_text("[noise]\npasses = [\"fp16\"]", "[speed]", model=str(model))
    assert error_of(write(fp16_pass)) == f'thresholds.toml: noise.passes: "fp16" restarts the baseline in ' \
                                          f'float16, {reason}; use "fp32" or "batch-order"'
    engine = thresholds_text("[speed]", model=str(model), baseline_engine='dtype = "half"')
    assert error_of(write(engine)) == f"thresholds.toml: baseline.engine.dtype: float16, {reason}"
    llama = checkpoint_with(tmp_path / "llama", model_type="llama")
    assert load_config(write(thresholds_text("[noise]\npasses = [\"fp16\"]", "[speed]", model=str(llama))))


def test_float16_is_refused_for_a_cached_hugging_face_model_too(write, tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch):
    import huggingface_hub.constants

    snapshot = tmp_path / "hub" / "models--org--gemma" / "snapshots" / "abc"
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "gemma2", "vocab_size": 32}))
    (tmp_path / "hub" / "models--org--gemma" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--gemma" / "refs" / "main").write_text("abc")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    message = error_of(write(thresholds_text("[noise]\npasses = [\"fp16\"]", "[speed]", model="org/gemma")))
    assert message.startswith('thresholds.toml: noise.passes: "fp16" restarts the baseline in float16, which vLLM '
                              "refuses for model type 'gemma2'")
    assert load_config(write(thresholds_text("[noise]\npasses = [\"fp16\"]", "[speed]", model="org/not-cached")))


def test_a_corpus_too_short_for_the_chunks_is_refused_before_any_engine(write, tmp_path: Path):
    (tmp_path / "c.txt").write_text("x" * 10_000)
    limits = "[probabilities.limits]\nmax_mean_kl = 0.1"
    gate = load_config(write(thresholds_text(
        '[probabilities]\ncorpus = "c.txt"\nchunks = 9\nchunk_tokens = 1024', limits)))
    assert gate.probabilities is not None and gate.probabilities.chunks == 9
    assert error_of(write(thresholds_text('[probabilities]\ncorpus = "c.txt"\nchunks = 50\nchunk_tokens = 1024',
                                          limits))) == (
        f"thresholds.toml: probabilities.chunks: 50 chunks of 1024 tokens asked, but the corpus {tmp_path / 'c.txt'} "
        "has 10,000 bytes, room for at most 9 (a token covers at least one byte); lower probabilities.chunks to 9, "
        "or give a longer corpus")

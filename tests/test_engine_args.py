"""Engine tables against the installed vLLM's EngineArgs, and the per-model env table."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from pytest_fp8gate.config import engine_args, vllm_source
from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.errors import ConfigError
from test_thresholds import MINIMAL

MODELS = MINIMAL


@pytest.fixture(scope="module")
def vllm_engine_fields() -> dict[str, object]:
    """The installed vLLM's EngineArgs fields and their annotations. Importing vLLM takes seconds of CPU: only
    the tests that compare against it pay for it, once (on one worker under pytest-xdist)."""
    from vllm.engine.arg_utils import EngineArgs

    return {f.name: f.type for f in dataclasses.fields(EngineArgs) if not f.name.startswith("_")}


def error_of(tmp_path: Path, text: str) -> str:
    path = tmp_path / "thresholds.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{path}: ")
    return message.removeprefix(f"{path}: ")


def load(tmp_path: Path, text: str):
    path = tmp_path / "thresholds.toml"
    path.write_text(text, encoding="utf-8")
    return load_config(path)


def test_the_field_list_is_the_installed_vllms(vllm_engine_fields):
    names = set(vllm_engine_fields)
    assert set(vllm_source.engine_fields()) == names
    # Keys the old allow-list lacked are there: production settings can be expressed.
    assert {"compilation_config", "enable_chunked_prefill", "speculative_config"} <= names


@pytest.mark.parametrize("table, message", [
    # A did-you-mean from vLLM's names, for a key the gate never listed.
    ("enable_chunked_prefil = true", "baseline.engine.enable_chunked_prefil: unknown key; "
                                     "did you mean 'enable_chunked_prefill'?"),
    ("no_such_setting_at_all = 1", "baseline.engine.no_such_setting_at_all: unknown key; "
                                   "not a field of the installed vLLM's EngineArgs"),
    ("swap_space = 4", "baseline.engine.swap_space: refused: removed from vLLM's EngineArgs in 0.18"),
    ("cpu_offload_gb = 8", "baseline.engine.cpu_offload_gb: refused: has no effect on the V2 model runner"),
    ("max_logprobs = 5", "baseline.engine.max_logprobs: refused: set by the gate"),
    ("model = 'x'", "baseline.engine.model: refused: set by the model table's `model` key"),
    ('logprobs_mode = "raw_logits"', "baseline.engine.logprobs_mode: refused: the gate compares log-probabilities"),
    # Type checks from the field's annotation.
    ('enable_chunked_prefill = "yes"', "baseline.engine.enable_chunked_prefill: expected true or false, "
                                       "got string 'yes'"),
    ("compilation_config = 3.5", "baseline.engine.compilation_config: expected a table"),
    ("cudagraph_capture_sizes = [1, 'two']", "baseline.engine.cudagraph_capture_sizes: expected an array of an "
                                             "integer, got an array"),
    ('prefix_caching_hash_algo = "sha265"', "baseline.engine.prefix_caching_hash_algo: expected one of "),
    # The gate's own ranges still apply.
    ("gpu_memory_utilization = 1.5", "baseline.engine.gpu_memory_utilization: expected a number in (0, 1], got 1.5"),
])
def test_engine_keys_are_checked_against_vllm(tmp_path, table, message):
    assert error_of(tmp_path, MODELS + "[baseline.engine]\n" + table + "\n").startswith(message)


def test_a_literal_typo_gets_vllms_name(tmp_path):
    assert error_of(tmp_path, MODELS + '[baseline.engine]\nprefix_caching_hash_algo = "sha265"\n').endswith(
        "got string 'sha265'; did you mean 'sha256'?")


def test_production_settings_pass_through(tmp_path):
    gate = load(tmp_path, MODELS + """[baseline.engine]
enable_chunked_prefill = false
compilation_config = { cudagraph_mode = "PIECEWISE" }
cudagraph_capture_sizes = [1, 2, 4]
offload_params = ["a", "b"]
logprobs_mode = "processed_logprobs"
""")
    engine = gate.candidates[0].engine
    assert engine["compilation_config"] == {"cudagraph_mode": "PIECEWISE"}
    assert engine["offload_params"] == {"a", "b"}  # a set, as EngineArgs declares it
    assert engine["enable_chunked_prefill"] is False


@pytest.mark.parametrize("table, message", [
    ("VLLM_USE_V2_MODEL_RUNNER = 1", "baseline.env.VLLM_USE_V2_MODEL_RUNNER: expected a string"),
    ('"1BAD" = "x"', "baseline.env.1BAD: expected an environment variable name"),
    ('VLLM_USE_V2_MODEL_RUNER = "1"', "baseline.env.VLLM_USE_V2_MODEL_RUNER: unknown vLLM environment variable; "
                                      "did you mean 'VLLM_USE_V2_MODEL_RUNNER'?"),
    ('VLLM_ENABLE_V1_MULTIPROCESSING = "0"', "baseline.env.VLLM_ENABLE_V1_MULTIPROCESSING: refused: set by the gate "
                                             "from deterministic_scheduling"),
    ("env = 3", "baseline.env: expected a table, got 3"),
    ('VLLM_ATTENTION_BACKEND = "FLASHINFER"', "baseline.env.VLLM_ATTENTION_BACKEND: the installed vLLM no longer "
                                              "reads it; its setting is now the engine key attention_backend: set "
                                              'attention_backend = "FLASHINFER" in the engine table'),
])
def test_env_tables_are_checked(tmp_path, table, message):
    if table.startswith("env"):
        text = MODELS.replace('model = "org/base"', 'model = "org/base"\n' + table)
    else:
        text = MODELS + "[baseline.env]\n" + table + "\n"
    assert error_of(tmp_path, text).startswith(message)


def test_the_removed_attention_variable_is_now_an_engine_key(tmp_path):
    gate = load(tmp_path, MODELS + '[baseline.engine]\nattention_backend = "FLASHINFER"\n')
    assert gate.baseline.engine["attention_backend"] == "FLASHINFER"


def test_a_candidates_env_is_its_own(tmp_path):
    gate = load(tmp_path, MODELS + """[baseline.env]
OMP_NUM_THREADS = "2"
[candidates.env]
VLLM_USE_V2_MODEL_RUNNER = "0"
""")
    assert gate.baseline.env == {"OMP_NUM_THREADS": "2"}
    assert gate.candidates[0].env == {"OMP_NUM_THREADS": "2", "VLLM_USE_V2_MODEL_RUNNER": "0"}


@pytest.mark.parametrize("table", [
    "",
    # The demo's keys: all checked by the gate itself, fields of every supported release.
    '[baseline.engine]\ndtype = "bfloat16"\nmax_model_len = 2048\nenforce_eager = true\ngpu_memory_utilization = 0.3\n',
    # Keys and variables only the installed vLLM knows: read from its source files (vllm_source.py).
    '[baseline.engine]\nenable_chunked_prefill = false\nattention_backend = "TRITON_ATTN"\n'
    'kv_cache_dtype = "fp8"\n[baseline.env]\nVLLM_CPU_KVCACHE_SPACE = "4"\n',
], ids=["no engine table", "the gate's own keys", "vLLM's own keys and variables"])
def test_vllm_is_never_imported_to_check_a_file(tmp_path, table):
    """The plugin and fp8gate check stay cheap: importing vLLM (torch with it) takes 10 s of CPU and more."""
    import subprocess
    import sys

    (tmp_path / "thresholds.toml").write_text(MODELS + table, encoding="utf-8")
    code = ("import sys; from pytest_fp8gate.config.loader import load_config; load_config(sys.argv[1]); "
            "print('vllm' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code, str(tmp_path / "thresholds.toml")],
                          capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "False"


def test_the_source_reading_agrees_with_the_imported_vllm(vllm_engine_fields):
    """Names from the source are the imported classes' names; an annotation read from the source judges
    every value as the imported one does, or (where the source names something it cannot give) not at all."""
    import vllm.envs

    assert vllm_source.env_names() == frozenset(vllm.envs.environment_variables)
    real = vllm_engine_fields
    read = vllm_source.engine_fields()
    values = [True, 1, 1.5, "x", "auto", "fp8", "FLASH_ATTN", [1], ["a"], {"a": 1}]
    unread = sorted(key for key, annotation in read.items() if isinstance(annotation, str))
    assert len(unread) <= 10, f"annotations the source reading left unchecked: {unread}"
    differ = [(key, value) for key in real if key not in unread for value in values
              if engine_args.mismatch(real[key], value) != engine_args.mismatch(read[key], value)]
    assert differ == []
    assert all(engine_args.string_choices(real[key]) == engine_args.string_choices(read[key])
               for key in real if key not in unread)


def test_the_gates_own_engine_keys_are_fields_of_the_installed_vllm():
    from pytest_fp8gate.config.schema import ENGINE_RANGES

    assert set(ENGINE_RANGES) <= set(vllm_source.engine_fields())

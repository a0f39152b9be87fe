"""What the thresholds file is checked for before the first engine starts: one line naming file and key."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest

from fakes import ANY_CPU_CANDIDATE, thresholds_text
from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.errors import ConfigError

GATE = thresholds_text('[probabilities]\ncorpus = "{corpus}"\nchunks = 1\nchunk_tokens = 8\n'
                       '[probabilities.limits]\nmax_mean_kl = 0.1',
                       model="{base}", candidate='model = "{cand}"\nquantization = "{quantization}"\n{engine}')


@pytest.fixture
def gate_dir(tmp_path: Path, make_checkpoint) -> Path:
    """gate/ holds thresholds.toml, two valid checkpoints and a corpus; the working directory is tmp_path."""
    gate = tmp_path / "gate"
    make_checkpoint(gate / "base")
    make_checkpoint(gate / "cand")
    (gate / "corpus.txt").write_text("Some text to score.\n")
    return gate


def _load(gate_dir: Path, **values: str) -> str | None:
    fields = {"base": "./base", "cand": "./cand", "quantization": "", "engine": "", "corpus": "corpus.txt", **values}
    path = gate_dir / "thresholds.toml"
    path.write_text(GATE.format(**fields))
    try:
        load_config(path)
    except ConfigError as err:
        message = str(err)
        assert "\n" not in message
        prefix = f"{path}: "
        assert message.startswith(prefix)
        return message[len(prefix):]
    return None


@pytest.fixture(autouse=True)
def _cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)


def test_valid_checkpoints_load(gate_dir: Path) -> None:
    assert _load(gate_dir) is None


def test_a_model_directory_without_config_json(gate_dir: Path) -> None:
    (gate_dir / "cand" / "config.json").unlink()
    assert _load(gate_dir) == (f"candidates[0].model: {gate_dir / 'cand' / 'config.json'}: "
                               "not found (expected a model directory or its config.json)")


@pytest.mark.parametrize("text, why", [("", "cannot read JSON"), ("[1, 2]", "expected a JSON object, got list")],
                         ids=["empty", "list"])
def test_a_config_json_that_is_not_an_object(gate_dir: Path, text: str, why: str) -> None:
    (gate_dir / "cand" / "config.json").write_text(text)
    message = _load(gate_dir)
    config = gate_dir / "cand" / "config.json"
    assert message is not None and message.startswith(f"candidates[0].model: {config}: {why}")


def test_an_empty_model_directory(gate_dir: Path) -> None:
    (gate_dir / "empty").mkdir()
    message = _load(gate_dir, cand="./empty")
    assert message is not None and message.startswith("candidates[0].model: ") and "config.json: not found" in message


def test_a_model_directory_without_weights(gate_dir: Path) -> None:
    (gate_dir / "cand" / "model.safetensors").unlink()
    assert _load(gate_dir) == f"candidates[0].model: {gate_dir / 'cand'}: no weights (*.safetensors or *.bin files)"


def test_garbage_safetensors(gate_dir: Path) -> None:
    (gate_dir / "cand" / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    message = _load(gate_dir)
    assert message is not None
    weights = gate_dir / "cand" / "model.safetensors"
    assert message.startswith(f"candidates[0].model: {weights}: header is not valid JSON")


def test_truncated_safetensors(gate_dir: Path) -> None:
    weights = gate_dir / "cand" / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-3])
    size = weights.stat().st_size
    assert _load(gate_dir) == (f"candidates[0].model: {weights}: truncated: {size} bytes, "
                               f"its header describes {size + 3}")


def test_too_short_safetensors(gate_dir: Path) -> None:
    (gate_dir / "cand" / "model.safetensors").write_bytes(b"\x01")
    assert _load(gate_dir) == (f"candidates[0].model: {gate_dir / 'cand' / 'model.safetensors'}: "
                               "too short for a safetensors file")


def test_a_shard_index_naming_a_missing_shard(gate_dir: Path) -> None:
    index = {"weight_map": {"lm_head.weight": "model-00001-of-00002.safetensors"}}
    (gate_dir / "cand" / "model.safetensors.index.json").write_text(json.dumps(index))
    message = _load(gate_dir)
    assert message is not None and "model-00001-of-00002.safetensors: cannot read" in message


def test_vocabularies_that_differ(gate_dir: Path, make_checkpoint) -> None:
    make_checkpoint(gate_dir / "cand", vocab_size=48)
    assert _load(gate_dir) == ("candidates[0].model: vocabulary of 48 tokens (config.json vocab_size) differs from "
                               "the baseline's 32; the gate compares the two token by token")


def test_a_bare_name_found_only_in_the_working_directory(gate_dir: Path, tmp_path: Path, make_checkpoint) -> None:
    make_checkpoint(tmp_path / "ckpt")
    assert _load(gate_dir, cand="ckpt") == (
        f"candidates[0].model: 'ckpt' exists in the working directory but not next to the thresholds file "
        f"({gate_dir / 'ckpt'}); write a path relative to the thresholds file or an absolute one")


def test_a_name_that_is_no_hugging_face_id(gate_dir: Path) -> None:
    message = _load(gate_dir, cand="org/name/extra")
    assert message is not None
    assert message.startswith(f"candidates[0].model: neither a local path ({gate_dir / 'org/name/extra'} not found) "
                              "nor a Hugging Face id: ")


def test_a_hugging_face_id_is_kept(gate_dir: Path) -> None:
    assert _load(gate_dir, cand="RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8-dynamic") is None


def test_an_unknown_quantization_name(gate_dir: Path) -> None:
    assert _load(gate_dir, quantization="fp8_per_chanel") == (
        "candidates[0].quantization: unknown vLLM quantization method 'fp8_per_chanel'; "
        "did you mean 'fp8_per_channel'?")


@pytest.mark.parametrize("name", ["fp8_per_channel", "fp8_per_tensor", "fp8_per_block", "online"])
def test_known_quantization_names(gate_dir: Path, name: str) -> None:
    assert _load(gate_dir, quantization=name) is None


def test_a_bogus_kv_cache_dtype(gate_dir: Path) -> None:
    assert _load(gate_dir, engine='[candidates.engine]\nkv_cache_dtype = "fp8-e4m3"') == (
        "candidates[0].engine.kv_cache_dtype: unknown vLLM kv_cache_dtype 'fp8-e4m3'; did you mean 'fp8_e4m3'?")


@pytest.mark.parametrize("name", ["auto", "fp8", "fp8_e4m3", "fp8_e5m2", "bfloat16", "float16"])
def test_known_kv_cache_dtypes(gate_dir: Path, name: str) -> None:
    assert _load(gate_dir, engine=f'[candidates.engine]\nkv_cache_dtype = "{name}"') is None


@pytest.mark.parametrize("content, why", [(b"", "no text to score"), (b" \n\t\n", "no text to score"),
                                          (b"caf\xe9 latin-1", "not UTF-8 text (byte 3)")],
                         ids=["empty", "blank", "latin-1"])
def test_a_corpus_file_without_utf8_text(gate_dir: Path, content: bytes, why: str) -> None:
    (gate_dir / "corpus.txt").write_bytes(content)
    assert _load(gate_dir) == f"probabilities.corpus: {gate_dir / 'corpus.txt'}: {why}"


@pytest.mark.parametrize("task", ["tasks/mine.yaml", "mine.yml", "../tasks/mine"])
def test_a_task_given_as_a_file_is_refused(gate_dir: Path, task: str) -> None:
    path = gate_dir / "thresholds.toml"
    path.write_text(GATE.format(base="./base", cand="./cand", quantization="", engine="", corpus="corpus.txt")
                    + f'[[tasks]]\nname = "mine"\ntask = "{task}"\nmetric = "acc"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (f"{path}: tasks[0].task: expected a task name, got the file {task!r}; "
                               "put the YAML in a directory named by include_path")


def test_safetensors_header_that_is_a_list(gate_dir: Path) -> None:
    header = b"[1, 2]"
    (gate_dir / "cand" / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header)
    assert _load(gate_dir) == (f"candidates[0].model: {gate_dir / 'cand' / 'model.safetensors'}: "
                               "header is not a JSON object")


ARTIFACTS_PROBE = "def test_x():\n    pass\n"


def test_artifacts_path_that_is_a_file(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(ARTIFACTS_PROBE)
    pytester.makefile(".txt", out="not a directory")
    for given in ("out.txt", "out.txt/sub"):
        result = pytester.runpytest("--fp8gate-artifacts", given)
        assert result.ret == pytest.ExitCode.USAGE_ERROR
        assert result.stderr.lines[0] == "ERROR: --fp8gate-artifacts: out.txt is a file, expected a directory"


def test_artifacts_directory_not_yet_there_is_fine(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(ARTIFACTS_PROBE)
    pytester.runpytest("--fp8gate-artifacts", "new/dir").assert_outcomes(passed=1)
    assert not (pytester.path / "new").exists()  # created only when the gate writes


def test_top_k_beyond_the_vocabulary(gate_dir: Path) -> None:
    path = gate_dir / "thresholds.toml"
    path.write_text(GATE.format(base="./base", cand="./cand", quantization="", engine="", corpus="corpus.txt")
                    .replace("[probabilities]", "[probabilities]\ntop_k = 40"))
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == (f"{path}: probabilities.top_k: 40 exceeds the baseline's vocabulary of 32 tokens "
                               "(config.json vocab_size)")


def test_a_toml_that_is_not_the_configured_one(pytester: pytest.Pytester) -> None:
    gate = thresholds_text("[speed]", candidate='quantization = "fp8_per_tensor"')
    pytester.makefile(".toml", other=gate)
    result = pytester.runpytest("other.toml")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    assert result.stderr.lines[0] == ("ERROR: other.toml: not the gate's thresholds file (none is configured); "
                                      "pass --fp8gate-config other.toml to gate with it")
    pytester.makefile(".toml", thresholds=gate)
    result = pytester.runpytest("other.toml")
    assert result.stderr.lines[0] == ("ERROR: other.toml: not the gate's thresholds file (the gate's is "
                                      "thresholds.toml); pass --fp8gate-config other.toml to gate with it")


def test_a_rule_whose_model_is_not_cached_offline_fails_with_one_line(pytester: pytest.Pytester,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    pytester.makefile(".toml", thresholds=thresholds_text(
        '[probabilities]\ncorpus = "corpus.txt"\nchunks = 1\nchunk_tokens = 8\n[probabilities.limits]\n'
        "max_mean_kl = 0.1", model="org/not-cached",
        head='device = "cpu"', candidate=ANY_CPU_CANDIDATE))
    pytester.makefile(".txt", corpus="Some text.")
    result = pytester.runpytest("thresholds.toml")
    result.assert_outcomes(failed=1)
    message = (f"measuring bf16: {pytester.path / 'thresholds.toml'}: baseline.model: 'org/not-cached' is not in "
               "the Hugging Face cache and HF_HUB_OFFLINE is set; download it first (hf download org/not-cached) "
               "or unset HF_HUB_OFFLINE")
    # Once in the failure text; the short summary repeats it in full where CI is set.
    failure_text = result.stdout.str().split("short test summary info")[0]
    assert failure_text.count(message) == 1
    assert "During handling" not in result.stdout.str() and "Traceback" not in result.stdout.str()


def test_a_quantization_the_speed_rule_cannot_model_is_refused_at_load(gate_dir: Path) -> None:
    assert _load(gate_dir, quantization="awq") is None  # no [speed]: nothing needs its bytes
    assert _load(gate_dir, quantization="awq", engine="[speed]") == (
        "candidates[0].quantization: quantization 'awq' has no byte model here; expected one of "
        "['fp8', 'fp8_per_block', 'fp8_per_channel', 'fp8_per_tensor']: the speed rule's roofline needs its "
        "bytes per token (remove [speed] to gate this model without it)")


def test_a_kv_cache_dtype_the_speed_rule_cannot_model_is_refused_at_load(gate_dir: Path) -> None:
    engine = '[candidates.engine]\nkv_cache_dtype = "nvfp4"\n'
    assert _load(gate_dir, engine=engine) is None
    assert _load(gate_dir, engine=engine + "[speed]") == (
        "candidates[0].engine.kv_cache_dtype: unsupported kv_cache_dtype 'nvfp4'; expected auto, fp8*, or one of "
        "bfloat16, float, float16, float32, half: the speed rule's roofline needs its bytes per token "
        "(remove [speed] to gate this model without it)")

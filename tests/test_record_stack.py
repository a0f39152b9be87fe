"""The record: what selects the stack joins the baseline-cache key (another kernel or backend
measures the baseline again), and the provenance says where an FP8 KV cache's scales came from."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from fakes import make_measurements, write_recorded_gate
from pytest_fp8gate.config.spec import ModelSpec
from pytest_fp8gate.engines import stack
from pytest_fp8gate.engines.provenance import kv_scale_source
from test_baseline_cache import fetch


@pytest.fixture
def gate(tmp_path: Path) -> Path:
    return write_recorded_gate(tmp_path / "gate")


def test_a_kernel_selecting_variable_measures_the_baseline_again(gate: Path, tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    lines: list[str] = []
    monkeypatch.delenv("VLLM_ATTENTION_BACKEND", raising=False)
    fetch(gate, tmp_path / "cache", tmp_path / "run1", lines)
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")  # selects nothing: the entry still serves
    assert not fetch(gate, tmp_path / "cache", tmp_path / "run2", lines)[1]
    monkeypatch.setenv("VLLM_ATTENTION_BACKEND", "FLASHINFER")
    assert fetch(gate, tmp_path / "cache", tmp_path / "run3", lines)[1]
    assert "baseline cache miss" in lines[-1] and "stack.vllm_env_sha256.VLLM_ATTENTION_BACKEND" in lines[-1]
    stored = "".join(path.read_text() for path in (tmp_path / "cache").rglob("*.json"))
    assert "FLASHINFER" not in stored  # values are hashed: a variable may hold a secret


def test_another_kernel_library_version_measures_the_baseline_again(gate: Path, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    lines: list[str] = []
    fetch(gate, tmp_path / "cache", tmp_path / "run1", lines)
    real = stack.importlib.metadata.version

    def version(name: str) -> str:
        return "9.9.9" if name == "flashinfer-python" else real(name)

    monkeypatch.setattr(stack.importlib.metadata, "version", version)
    assert fetch(gate, tmp_path / "cache", tmp_path / "run2", lines)[1]
    assert "stack.kernel_libraries.flashinfer-python" in lines[-1]


def _checkpoint(directory: Path, scales: dict[str, np.ndarray]) -> Path:
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": "llama"}))
    save_file({"model.embed_tokens.weight": np.zeros((4, 2), np.float32), **scales},
              str(directory / "model.safetensors"))
    return directory


def _source(directory: Path, **engine: object) -> dict:
    return kv_scale_source(ModelSpec("fp8", str(directory), None, {"kv_cache_dtype": "fp8", **engine}))


def test_the_kv_scale_source_is_named(tmp_path: Path) -> None:
    calibrated = _checkpoint(tmp_path / "calibrated", {
        "model.layers.0.self_attn.k_scale": np.array(0.02, np.float32),
        "model.layers.0.self_attn.v_scale": np.array(0.5, np.float32)})
    ones = _checkpoint(tmp_path / "ones", {"model.layers.0.self_attn.k_proj.k_scale": np.ones((), np.float32),
                                           "model.layers.0.self_attn.v_proj.v_scale": np.ones((), np.float32)})
    bare = _checkpoint(tmp_path / "bare", {})
    found = _source(calibrated)
    assert found["source"] == "checkpoint scales, calibrated"
    assert (found["scales"], found["min"], found["max"]) == (2, pytest.approx(0.02), 0.5)
    assert _source(ones)["source"] == "checkpoint scales, all 1.0"
    assert _source(bare)["source"].startswith("1.0: the checkpoint stores no KV-cache scales")
    assert _source(bare, calculate_kv_scales=True)["source"].startswith("calibrated by the engine")
    assert _source(tmp_path / "absent")["source"].startswith("unknown: the weights are not local")
    auto = kv_scale_source(ModelSpec("bf16", str(calibrated), None, {}))
    assert auto == {"kv_cache_dtype": "auto", "source": "not an FP8 KV cache"}


def test_bf16_scales_are_widened(tmp_path: Path) -> None:
    # 0.25 in bfloat16 is the top half of its float32 bits.
    bits = np.array([np.float32(0.25).view(np.uint32) >> 16], np.uint16)
    directory = tmp_path / "bf16"
    directory.mkdir()
    header = {"model.layers.0.self_attn.k_scale": {"dtype": "BF16", "shape": [1], "data_offsets": [0, 2]}}
    blob = json.dumps(header).encode()
    (directory / "model.safetensors").write_bytes(len(blob).to_bytes(8, "little") + blob + bits.tobytes())
    (directory / "config.json").write_text("{}")
    assert _source(directory)["min"] == 0.25


def test_the_provenance_records_the_kv_scale_source(gate: Path, tmp_path: Path) -> None:
    measurements = make_measurements(gate, tmp_path / "artifacts")
    record = measurements.provenance(measurements.config.baseline)
    assert record["kv_cache_scales"]["source"] == "not an FP8 KV cache"

"""Pre-quantized FP8 checkpoints and random-weight real shapes, written without an engine."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pytest_fp8gate.checkpoint import read_header
from pytest_fp8gate.core.roofline import estimate_from_path
from pytest_fp8gate.tools import fp8_writer
from pytest_fp8gate.tools.cli import main as fp8gate_main
from pytest_fp8gate.tools.demo.embedded import embedded_assets
from pytest_fp8gate.tools.fp8_writer import QuantizeError, quantize_weight, write_fp8_checkpoint
from pytest_fp8gate.tools.shapes import SHAPES, tensor_shapes, write_random_checkpoint

torch = pytest.importorskip("torch")
E4M3_RELATIVE_STEP = 2.0**-3  # 3 mantissa bits: neighbours of a normal value differ by 1/8 of its power of two


@pytest.mark.parametrize("strategy, scale_shape", [("channel", (64, 1)), ("tensor", (1,))])
def test_quantized_weights_round_trip_within_e4m3_precision(strategy, scale_shape):
    weight = torch.randn(64, 128, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 1, 64)[:, None]
    quantized, scale = quantize_weight(weight.to(torch.bfloat16), strategy)
    assert quantized.dtype == torch.float8_e4m3fn and tuple(scale.shape) == scale_shape
    restored = quantized.float() * (scale if strategy == "channel" else scale.reshape(1, 1))
    peak = quantized.float().abs().amax(dim=1) if strategy == "channel" else quantized.float().abs().amax()
    assert torch.all(peak == 448.0)  # the largest magnitude maps to E4M3's maximum
    # Away from the subnormal range, rounding moves a value by at most half a step.
    normal = quantized.float().abs() >= 2.0**-6
    error = (restored - weight.to(torch.bfloat16).float()).abs()[normal]
    assert torch.all(error <= E4M3_RELATIVE_STEP / 2 * weight.abs()[normal] * 1.01 + 1e-6)


@pytest.fixture(scope="module")
def dynamic_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_fp8_checkpoint(embedded_assets().model, tmp_path_factory.mktemp("ckpt") / "fp8-dynamic",
                                "fp8-dynamic")


def test_dynamic_checkpoint_has_the_fp8_dynamic_layout(dynamic_checkpoint: Path):
    config = json.loads((dynamic_checkpoint / "config.json").read_text())
    group = config["quantization_config"]["config_groups"]["group_0"]
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    assert group["weights"]["strategy"] == "channel" and group["input_activations"]["dynamic"] is True
    assert config["quantization_config"]["ignore"] == ["lm_head"]
    header = read_header(dynamic_checkpoint / "model.safetensors")
    q_proj = "model.layers.0.self_attn.q_proj"
    assert header[f"{q_proj}.weight"]["dtype"] == "F8_E4M3"
    assert header[f"{q_proj}.weight_scale"]["shape"] == [header[f"{q_proj}.weight"]["shape"][0], 1]
    assert header["lm_head.weight"]["dtype"] == header["model.embed_tokens.weight"]["dtype"] == "BF16"
    assert (dynamic_checkpoint / "tokenizer.json").is_file()
    assert (dynamic_checkpoint / "model.safetensors").stat().st_mode & 0o044  # readable by others, as umask allows


def test_roofline_of_the_checkpoint_matches_online_fp8_per_channel(dynamic_checkpoint: Path):
    # Both store E4M3 weights plus one float32 scale per output row.
    online = estimate_from_path(embedded_assets().model, quantization="fp8_per_channel")
    written = estimate_from_path(dynamic_checkpoint)
    assert written.bytes_per_token == online.bytes_per_token
    assert written.bytes_per_token < estimate_from_path(embedded_assets().model).bytes_per_token


def test_static_checkpoint_carries_calibrated_activation_scales(tmp_path: Path):
    text = embedded_assets().corpus.read_text(encoding="utf-8")[:1000]  # the layout, not the scales' quality
    path = write_fp8_checkpoint(embedded_assets().model, tmp_path / "fp8-static", "fp8-static",
                                calibration=[text[:500], text[500:]])
    header = read_header(path / "model.safetensors")
    assert header["model.layers.0.mlp.down_proj.input_scale"]["shape"] == [1]
    assert header["model.layers.0.mlp.down_proj.weight_scale"]["shape"] == [1]
    group = json.loads((path / "config.json").read_text())["quantization_config"]["config_groups"]["group_0"]
    assert group["weights"]["strategy"] == "tensor" and group["input_activations"]["dynamic"] is False
    with pytest.raises(QuantizeError, match="needs calibration text"):
        write_fp8_checkpoint(embedded_assets().model, tmp_path / "uncalibrated", "fp8-static")


def test_refusals_name_the_problem(tmp_path: Path, dynamic_checkpoint: Path):
    with pytest.raises(QuantizeError, match="already exists"):
        write_fp8_checkpoint(embedded_assets().model, dynamic_checkpoint, "fp8-dynamic")
    with pytest.raises(QuantizeError, match="already quantized"):
        write_fp8_checkpoint(dynamic_checkpoint, tmp_path / "twice", "fp8-dynamic")
    with pytest.raises(QuantizeError, match="config.json: not found"):
        write_fp8_checkpoint(tmp_path, tmp_path / "out", "fp8-dynamic")
    with pytest.raises(QuantizeError, match="unknown scheme 'int4'"):
        write_fp8_checkpoint(embedded_assets().model, tmp_path / "out", "int4")


def test_an_interrupted_write_leaves_nothing_behind(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    import safetensors.torch

    def broken(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", broken)
    with pytest.raises(OSError, match="disk full"):
        write_fp8_checkpoint(embedded_assets().model, tmp_path / "out", "fp8-dynamic")
    assert list(tmp_path.iterdir()) == []


def test_llama_31_8b_shape_has_its_published_parameter_count():
    shapes = tensor_shapes(SHAPES["llama-3.1-8b"])
    assert sum(math.prod(s) for s in shapes.values()) == 8_030_261_248


def test_random_checkpoint_of_the_large_vocabulary_reads_like_its_config(tmp_path: Path):
    assert fp8gate_main(["random-checkpoint", "llama-3.1-vocab-tiny", str(tmp_path / "tiny")]) == 0
    written = estimate_from_path(tmp_path / "tiny")
    from_config = estimate_from_path(tmp_path / "tiny" / "config.json")
    assert written.embedding_params == 128256 * 64
    assert written.bytes_per_token == from_config.bytes_per_token
    assert fp8gate_main(["random-checkpoint", "llama-3.1-vocab-tiny", str(tmp_path / "tiny")]) == 2
    with pytest.raises(ValueError, match="unknown shape"):
        write_random_checkpoint("gpt-5", tmp_path / "x")


def test_quantize_cli_writes_a_loadable_layout(tmp_path: Path, capsys: pytest.CaptureFixture):
    assert fp8gate_main(["quantize", str(embedded_assets().model), str(tmp_path / "q")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "q")
    assert (tmp_path / "q" / fp8_writer.MARKER).is_file()


def test_moe_checkpoint_quantizes_the_experts_and_keeps_the_router(tmp_path: Path):
    assert fp8gate_main(["random-checkpoint", "qwen3-moe-tiny", str(tmp_path / "bf16")]) == 0
    dest = write_fp8_checkpoint(tmp_path / "bf16", tmp_path / "fp8", "fp8-dynamic")
    header = {name: entry for shard in sorted(dest.glob("*.safetensors")) for name, entry in read_header(shard).items()}
    expert = "model.layers.0.mlp.experts.0.gate_proj"
    assert header[f"{expert}.weight"]["dtype"] == "F8_E4M3" and f"{expert}.weight_scale" in header
    assert header["model.layers.0.mlp.gate.weight"]["dtype"] == "BF16"
    assert "model.layers.0.mlp.gate.weight_scale" not in header
    config = json.loads((dest / "config.json").read_text())
    assert fp8_writer.ROUTER_PATTERN in config["quantization_config"]["ignore"]

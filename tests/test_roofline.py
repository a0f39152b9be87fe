from __future__ import annotations

import importlib.util
import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from pytest_fp8gate import gpu_bandwidths
from pytest_fp8gate.core.roofline import RooflineError, estimate_from_path

GB = 1e9

# --- the article's arithmetic for Llama 3.1 8B, from its config.json alone -----


def test_parameter_counts(llama_config: Path):
    estimate = estimate_from_path(llama_config)
    assert estimate.source == "config.json"
    assert round(estimate.linear_params / 1e9, 2) == 6.98
    assert round(estimate.lm_head_params / 1e9, 2) == 0.53
    assert estimate.embedding_params == 128256 * 4096


def test_bytes_per_token_and_l40s_ceilings(llama_config: Path):
    bf16 = estimate_from_path(llama_config, gpu="L40S")
    fp8 = estimate_from_path(llama_config, quantization="fp8_per_tensor", gpu="NVIDIA L40S")
    assert round(bf16.bytes_per_token / GB, 1) == 15.0
    assert round(fp8.bytes_per_token / GB, 1) == 8.0
    assert (bf16.gpu, bf16.bandwidth_gbps) == ("L40S", 864.0)
    assert round(bf16.ceiling_tok_s, 1) == 57.6
    assert round(fp8.ceiling_tok_s, 1) == 107.6
    # 1.87x fewer bytes, not 2x, because lm_head stays BF16.
    assert round(bf16.bytes_per_token / fp8.bytes_per_token, 2) == 1.87


def test_rtx_5070_ti_ceiling_and_weight_sizes(llama_config: Path):
    bf16 = estimate_from_path(llama_config)
    fp8 = estimate_from_path(llama_config, quantization="fp8", gpu="NVIDIA GeForce RTX 5070 Ti")
    assert round(fp8.ceiling_tok_s, 1) == 111.6
    assert round(bf16.weight_gib, 2) == 14.96
    assert round(fp8.weight_gib, 2) == 8.46  # linear 1 byte, embeddings and lm_head 2 bytes
    # The checkpoint sizes in the article's table: 16.06 GB (BF16), 9.08 GB (FP8).
    assert (round(bf16.weight_bytes / GB, 2), round(fp8.weight_bytes / GB, 2)) == (16.06, 9.08)


def test_per_channel_scales_add_one_float_per_output_row(llama_config: Path):
    per_tensor = estimate_from_path(llama_config, quantization="fp8_per_tensor")
    per_channel = estimate_from_path(llama_config, quantization="fp8_per_channel")
    rows_per_layer = 4096 + 1024 + 1024 + 4096 + 14336 + 14336 + 4096
    assert per_channel.bytes_per_token - per_tensor.bytes_per_token == 32 * (rows_per_layer - 7) * 4


def test_per_block_scales(llama_config: Path):
    per_tensor = estimate_from_path(llama_config, quantization="fp8_per_tensor")
    per_block = estimate_from_path(llama_config, quantization="fp8_per_block")
    blocks = 2 * 32 * 32 + 2 * 8 * 32 + 3 * 112 * 32  # q, o; k, v; gate, up, down in 128x128 blocks
    assert per_block.bytes_per_token - per_tensor.bytes_per_token == 32 * (blocks - 7) * 4


def test_kv_cache(llama_config: Path):
    estimate = estimate_from_path(llama_config, context_tokens=1000)
    assert estimate.kv_bytes_per_context_token == 128 * 1024  # 128 KiB per token
    assert estimate.kv_bytes_per_token == 131_072_000  # about 0.13 GB at a 1,000-token prompt
    assert estimate.bytes_per_token == estimate_from_path(llama_config).bytes_per_token + 131_072_000
    fp8_kv = estimate_from_path(llama_config, context_tokens=1000, kv_cache_dtype="fp8")
    assert fp8_kv.kv_bytes_per_context_token == 64 * 1024


def test_model_directory_without_weights(llama_config: Path):
    assert estimate_from_path(llama_config.parent) == estimate_from_path(llama_config)


def test_as_dict(llama_config: Path):
    row = estimate_from_path(llama_config, gpu="L40S", context_tokens=10).as_dict()
    assert {
        "linear_params",
        "lm_head_params",
        "embedding_params",
        "bytes_per_token",
        "weight_bytes",
        "weight_gib",
        "kv_bytes_per_token",
        "bandwidth_gbps",
        "gpu",
        "ceiling_tok_s",
    } <= set(row)
    assert row["kv_bytes_per_token"] == 10 * 128 * 1024
    json.dumps(row)  # plain values only


def test_bandwidth_override_and_no_gpu(llama_config: Path):
    custom = estimate_from_path(llama_config, gpu="MI300X", bandwidth_gbps=5300)
    assert (custom.gpu, custom.bandwidth_gbps) == ("MI300X", 5300.0)
    assert estimate_from_path(llama_config, gpu="L40S", bandwidth_gbps=900).bandwidth_gbps == 900.0
    bare = estimate_from_path(llama_config)
    assert (bare.gpu, bare.bandwidth_gbps, bare.ceiling_tok_s) == (None, None, None)


def test_prequantized_config_without_weights(llama_config: Path, tmp_path: Path):
    cfg = json.loads(llama_config.read_text())
    cfg["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "float", "strategy": "channel"}}},
        "ignore": ["lm_head"],
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    estimate = estimate_from_path(tmp_path)
    online = estimate_from_path(llama_config, quantization="fp8_per_channel")
    assert estimate.bytes_per_token == online.bytes_per_token


# --- safetensors headers -----------------------------------------------------

ITEMSIZE = {"BF16": 2, "F32": 4, "F8_E4M3": 1}
TINY = {
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "vocab_size": 32,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
LINEAR = {  # (out, in) for the tiny config: head_dim 4, one KV head
    "self_attn.q_proj": (8, 8),
    "self_attn.k_proj": (4, 8),
    "self_attn.v_proj": (4, 8),
    "self_attn.o_proj": (8, 8),
    "mlp.gate_proj": (16, 8),
    "mlp.up_proj": (16, 8),
    "mlp.down_proj": (8, 16),
}


def write_safetensors(path: Path, tensors: dict[str, tuple[str, tuple[int, ...]]]) -> None:
    """A valid safetensors file with zeroed data: 8-byte little-endian header length, JSON header, bytes."""
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = math.prod(shape) * ITEMSIZE[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(offset))


def tiny_tensors(fp8: bool = False, tied: bool = False) -> dict[str, tuple[str, tuple[int, ...]]]:
    tensors = {"model.embed_tokens.weight": ("BF16", (32, 8)), "model.norm.weight": ("BF16", (8,))}
    for layer in range(2):
        prefix = f"model.layers.{layer}"
        tensors[f"{prefix}.input_layernorm.weight"] = ("BF16", (8,))
        tensors[f"{prefix}.post_attention_layernorm.weight"] = ("BF16", (8,))
        for module, shape in LINEAR.items():
            tensors[f"{prefix}.{module}.weight"] = ("F8_E4M3" if fp8 else "BF16", shape)
            if fp8:  # compressed-tensors per-channel layout
                tensors[f"{prefix}.{module}.weight_scale"] = ("BF16", (shape[0], 1))
    if not tied:
        tensors["lm_head.weight"] = ("BF16", (32, 8))
    return tensors


@pytest.fixture
def tiny_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    return tmp_path


def test_fp8_checkpoint_from_headers(tiny_dir: Path):
    write_safetensors(tiny_dir / "model.safetensors", tiny_tensors(fp8=True))
    estimate = estimate_from_path(tiny_dir)
    assert estimate.source == "safetensors"
    linear = 2 * sum(out * inp for out, inp in LINEAR.values())
    scales = 2 * sum(out for out, _ in LINEAR.values()) * 2  # BF16 scale per output row
    norms = (2 * 2 + 1) * 8 * 2
    assert (estimate.linear_params, estimate.lm_head_params, estimate.embedding_params) == (linear, 256, 256)
    assert estimate.other_params == 40
    assert estimate.bytes_per_token == linear + scales + 256 * 2 + 8 * 2 + norms  # one embedding row
    assert estimate.weight_bytes == linear + scales + 2 * 256 * 2 + norms


def test_headers_agree_with_config_arithmetic(tiny_dir: Path):
    write_safetensors(tiny_dir / "model.safetensors", tiny_tensors())
    config_only = tiny_dir / "config.json"
    for quantization in (None, "fp8_per_tensor", "fp8_per_channel", "fp8_per_block"):
        from_headers = estimate_from_path(tiny_dir, quantization=quantization, context_tokens=5)
        from_config = estimate_from_path(config_only, quantization=quantization, context_tokens=5)
        assert from_headers.as_dict() == {**from_config.as_dict(), "source": "safetensors"}


def test_online_quantization_leaves_fp8_weights_alone(tiny_dir: Path):
    write_safetensors(tiny_dir / "model.safetensors", tiny_tensors(fp8=True))
    assert (
        estimate_from_path(tiny_dir, quantization="fp8_per_channel").bytes_per_token
        == estimate_from_path(tiny_dir).bytes_per_token
    )


def test_tied_embeddings(tiny_dir: Path):
    write_safetensors(tiny_dir / "model.safetensors", tiny_tensors(tied=True))
    tied = estimate_from_path(tiny_dir)
    untied = estimate_from_path(tiny_dir / "config.json")
    assert tied.lm_head_params == tied.embedding_params == 256
    assert tied.bytes_per_token == untied.bytes_per_token  # the table is still read once as lm_head
    assert tied.weight_bytes == untied.weight_bytes - 256 * 2  # but stored once


def test_sharded_checkpoint_uses_the_index(tiny_dir: Path):
    tensors = list(tiny_tensors().items())
    shards = {
        "model-00001-of-00002.safetensors": dict(tensors[:10]),
        "model-00002-of-00002.safetensors": dict(tensors[10:]),
    }
    for name, part in shards.items():
        write_safetensors(tiny_dir / name, part)
    weight_map = {tensor: shard for shard, part in shards.items() for tensor in part}
    (tiny_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    write_safetensors(tiny_dir / "consolidated.safetensors", tiny_tensors())  # would double-count
    assert estimate_from_path(tiny_dir).weight_bytes == estimate_from_path(tiny_dir / "config.json").weight_bytes


@pytest.mark.parametrize(
    "content, message",
    [
        (b"\x01\x02", "too short for a safetensors file"),
        (struct.pack("<Q", 4) + b"{no}", "header is not valid JSON"),
        (struct.pack("<Q", 2**40), "header length 1099511627776 is not plausible"),
    ],
)
def test_broken_safetensors(tiny_dir: Path, content: bytes, message: str):
    (tiny_dir / "model.safetensors").write_bytes(content)
    with pytest.raises(RooflineError, match=message):
        estimate_from_path(tiny_dir)


def test_unsupported_dtype(tiny_dir: Path):
    header = json.dumps({"w": {"dtype": "F4", "shape": [2], "data_offsets": [0, 1]}}).encode()
    (tiny_dir / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + b"\0")
    with pytest.raises(RooflineError, match="tensor 'w' has unsupported dtype 'F4'"):
        estimate_from_path(tiny_dir)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"gpu": "MI300X"}, "unknown GPU 'MI300X'; give its bandwidth in GB/s or use one of: B200, "),
        ({"quantization": "awq"}, "quantization 'awq' has no byte model here"),
        ({"bandwidth_gbps": -1}, "bandwidth_gbps must be >= 0"),
        ({"context_tokens": -1}, "context_tokens must be >= 0"),
        ({"kv_cache_dtype": "int4"}, "unsupported kv_cache_dtype 'int4'"),
    ],
)
def test_bad_arguments(llama_config: Path, kwargs: dict, message: str):
    with pytest.raises(RooflineError, match=message):
        estimate_from_path(llama_config, **kwargs)


def test_bad_config(tmp_path: Path):
    with pytest.raises(RooflineError, match="not found"):
        estimate_from_path(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"hidden_size": 8}))
    with pytest.raises(RooflineError, match="needs an integer 'intermediate_size'"):
        estimate_from_path(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**TINY, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(RooflineError, match="quantization_config 'awq' is not FP8"):
        estimate_from_path(tmp_path)


# --- GPU table ------------------------------------------------------------------


@pytest.mark.parametrize(
    "reported, name, bandwidth",
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM", 3350),
        ("NVIDIA H100 PCIe", "H100 PCIe", 2000),
        ("NVIDIA H100 NVL", "H100 NVL", 3900),
        ("NVIDIA H200", "H200", 4800),
        ("NVIDIA B200", "B200", 8000),
        ("NVIDIA A100-SXM4-80GB", "A100 80GB SXM", 2039),
        ("NVIDIA A100 80GB PCIe", "A100 80GB PCIe", 1935),
        ("NVIDIA A100-SXM4-40GB", "A100 40GB", 1555),
        ("NVIDIA A100-PCIE-40GB", "A100 40GB", 1555),
        ("NVIDIA A10", "A10", 600),
        ("NVIDIA A10G", "A10G", 600),
        ("NVIDIA L4", "L4", 300),
        ("NVIDIA L40S", "L40S", 864),
        ("NVIDIA GeForce RTX 4090", "RTX 4090", 1008),
        ("NVIDIA GeForce RTX 5070 Ti", "RTX 5070 Ti", 896),
        ("NVIDIA GeForce RTX 5070", "RTX 5070", 672),
        ("NVIDIA GeForce RTX 5090", "RTX 5090", 1792),
        ("NVIDIA RTX 6000 Ada Generation", "RTX 6000 Ada", 960),
        ("Tesla T4", "T4", 320),
        ("nvidia l40s", "L40S", 864),
    ],
)
def test_gpu_names_as_cuda_reports_them(reported: str, name: str, bandwidth: float):
    gpu = gpu_bandwidths.find_gpu(reported)
    assert gpu is not None and (gpu.name, gpu.bandwidth_gbps) == (name, bandwidth)


@pytest.mark.parametrize("reported", ["NVIDIA GH200 480GB", "AMD Instinct MI300X", "Quadro RTX 6000", ""])
def test_unknown_gpus(reported: str):
    assert gpu_bandwidths.find_gpu(reported) is None


def test_every_table_name_finds_its_own_entry():
    for gpu in gpu_bandwidths.GPU_TABLE:
        assert gpu_bandwidths.find_gpu(gpu.name) is gpu


def test_nvml_bandwidth_is_memory_clock_times_bus_width_double_data_rate(monkeypatch):
    import types

    from pytest_fp8gate.engines import nvml

    calls = []
    fake = types.SimpleNamespace(
        NVML_CLOCK_MEM=2, nvmlInit=lambda: calls.append("init"), nvmlShutdown=lambda: calls.append("shutdown"),
        nvmlDeviceGetHandleByIndex=lambda index: ("gpu", index),
        nvmlDeviceGetMaxClockInfo=lambda handle, kind: 3201 if kind == 2 else 0,
        nvmlDeviceGetMemoryBusWidth=lambda handle: 6144)
    monkeypatch.setattr(nvml, "_nvml_binding", lambda: fake)
    gbps, how = nvml.nvml_bandwidth_gbps()
    assert gbps == pytest.approx(3201e6 * 2 * 6144 / 8 / 1e9) and round(gbps) == 4917
    assert how == "NVML: 3201 MHz x 6144 bits x 2 / 8" and calls == ["init", "shutdown"]


def test_nvml_binding_loads_without_importing_vllm():
    """vLLM's vendored binding, from its file: importing vllm (and torch with it) would cost seconds."""
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("no vLLM installed")
    code = ("import sys; from pytest_fp8gate.engines import nvml; binding = nvml._nvml_binding(); "
            "print(callable(binding.nvmlInit), 'vllm' in sys.modules, 'torch' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert done.stdout.split() == ["True", "False", "False"], done.stdout + done.stderr


def test_torch_names_the_gpus_from_a_child_process(monkeypatch):
    """Without nvidia-smi, torch names the GPUs. Reading a name creates a CUDA context, and one in the gate's
    process makes vLLM spawn every engine core instead of forking it, so a child process reads them."""
    torch = pytest.importorskip("torch")
    from pytest_fp8gate import hardware

    def in_this_process(index: int) -> str:
        raise AssertionError("a device name was read in the gate's process")

    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    monkeypatch.setattr(torch.cuda, "get_device_name", in_this_process)
    monkeypatch.setattr(hardware, "_TORCH_NAMES", "import json; print(json.dumps(['NVIDIA H100 80GB HBM3']))")
    names, how = hardware._torch_names()
    assert names == ("NVIDIA H100 80GB HBM3",) and how.endswith("names read in a child process")
    assert not torch.cuda.is_initialized()
    monkeypatch.undo()
    # The real script, in a child with the real torch: it runs and answers (no device on a CPU-only machine).
    names, how = hardware._torch_names_in_child(1)
    assert "failed" not in how and "unreadable" not in how and "no answer" not in how, how


# --- sliding windows, the checkpoint's label, the GPUs the weights need ---------


def _config_dir(tmp_path: Path, llama_config: Path, **changes: object) -> Path:
    cfg = {**json.loads(llama_config.read_text()), **changes}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    return tmp_path


@pytest.mark.parametrize(("changes", "sliding"), [
    ({}, 32),  # Mistral: every layer
    ({"layer_types": ["sliding_attention", "full_attention"] * 16}, 16),
    ({"sliding_window_pattern": 4}, 24),  # Gemma 3: every 4th layer global
    ({"model_type": "gemma2"}, 16),
    ({"max_window_layers": 28}, 4),  # Qwen2: layers 28-31
    ({"use_sliding_window": False}, 0),
])
def test_sliding_window_layers_read_their_window_only(tmp_path: Path, llama_config: Path, changes: dict,
                                                     sliding: int):
    path = _config_dir(tmp_path, llama_config, sliding_window=512, **changes)
    estimate = estimate_from_path(path, context_tokens=2000, batch=4)
    per_layer = 128 * 1024 // 32  # Llama 3.1 8B: 4 KiB a token and layer
    assert estimate.kv_bytes_per_token == per_layer * ((32 - sliding) * 2000 + sliding * 512)
    weights_only = estimate_from_path(path, batch=4)
    assert estimate.bytes_per_token == weights_only.bytes_per_token + estimate.kv_bytes_per_token
    assert estimate.bytes_per_step == weights_only.bytes_per_step + 4 * estimate.kv_bytes_per_token
    # Within the window every layer reads the whole context.
    short = estimate_from_path(path, context_tokens=300)
    assert short.kv_bytes_per_token == 300 * 128 * 1024


def test_a_prequantized_checkpoint_is_labelled_by_its_method(llama_config: Path, tmp_path: Path):
    config = {"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {
        "num_bits": 8, "type": "float", "strategy": "channel"}}}}
    assert estimate_from_path(_config_dir(tmp_path, llama_config, quantization_config=config)).quantization == \
        "compressed-tensors"
    assert estimate_from_path(llama_config).quantization is None
    assert estimate_from_path(llama_config, quantization="fp8_per_channel").quantization == "fp8_per_channel"


def test_the_gpus_that_hold_the_weights(tmp_path: Path, llama_config: Path):
    llama_70b = _config_dir(tmp_path, llama_config, hidden_size=8192, intermediate_size=28672,
                            num_hidden_layers=80, num_attention_heads=64)
    assert estimate_from_path(llama_70b, gpu="H100").tensor_parallel_to_fit == 2  # 131 GiB over 72 GiB shares
    assert estimate_from_path(llama_70b, gpu="L40S").tensor_parallel_to_fit == 4
    assert estimate_from_path(llama_70b, quantization="fp8_per_channel", gpu="H200").tensor_parallel_to_fit == 1
    assert estimate_from_path(llama_70b).tensor_parallel_to_fit is None
    assert estimate_from_path(llama_config, gpu="H100").tensor_parallel_to_fit == 1


def test_describe_match_names_the_card_and_the_others_of_its_family():
    others = 'for the H100 PCIe (2,000 GB/s) write "H100 PCIe" or the H100 NVL (3,900 GB/s) write "H100 NVL"'
    assert gpu_bandwidths.describe_match("H100") == f"'H100' is the H100 SXM (3,350 GB/s, 80 GiB); {others}"
    assert gpu_bandwidths.describe_match("H100 SXM") == f"the H100 SXM (3,350 GB/s, 80 GiB); {others}"
    assert gpu_bandwidths.describe_match("h100 pcie") == "'h100 pcie' is the H100 PCIe (2,000 GB/s, 80 GiB)"
    assert gpu_bandwidths.describe_match("MI300X") is None

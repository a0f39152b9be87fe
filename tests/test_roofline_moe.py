"""Mixture-of-experts in the roofline: active experts at batch 1, nEff at batch B, against hand arithmetic.

The two configs are the published config.json files of Qwen/Qwen3-30B-A3B and
deepseek-ai/DeepSeek-V3 (the keys the byte model reads; DeepSeek-V3 without its
FP8 quantization_config, i.e. its BF16 form, unless a test adds it back).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from pytest_fp8gate.core.roofline import RooflineError, estimate_from_path, expected_active_experts
from pytest_fp8gate.tools.cli import main as fp8gate_main
from pytest_fp8gate.tools.shapes import SHAPES

QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 2048,
    "intermediate_size": 6144, "moe_intermediate_size": 768, "num_hidden_layers": 48, "num_attention_heads": 32,
    "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "num_experts": 128, "num_experts_per_tok": 8,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, "tie_word_embeddings": False,
    "attention_bias": False, "torch_dtype": "bfloat16",
}  # fmt: skip
DEEPSEEK_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", "hidden_size": 7168,
    "intermediate_size": 18432, "moe_intermediate_size": 2048, "num_hidden_layers": 61, "num_attention_heads": 128,
    "num_key_value_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_experts_per_tok": 8, "first_k_dense_replace": 3, "moe_layer_freq": 1, "topk_method": "noaux_tc",
    "n_group": 8, "topk_group": 4, "num_nextn_predict_layers": 1, "vocab_size": 129280,
    "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": "bfloat16",
}  # fmt: skip
DEEPSEEK_FP8 = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}


def config_file(tmp_path: Path, cfg: dict) -> Path:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg), encoding="utf-8")
    return path


def test_neff_is_k_at_batch_one_and_tends_to_n():
    assert expected_active_experts(128, 8, 1) == pytest.approx(8)
    # 128 (1 - (120/128)^8) and ^64, by hand: 0.9375^8 = 0.59672, 0.9375^64 = 0.016077
    assert expected_active_experts(128, 8, 8) == pytest.approx(51.62, abs=0.01)
    assert expected_active_experts(128, 8, 64) == pytest.approx(125.94, abs=0.01)
    assert expected_active_experts(256, 8, 1024) == pytest.approx(256, abs=1e-9)
    with pytest.raises(RooflineError, match="experts_per_token <= experts"):
        expected_active_experts(8, 9, 1)


def test_qwen3_30b_a3b_counts_8_of_128_experts(tmp_path: Path):
    estimate = estimate_from_path(config_file(tmp_path, QWEN3_30B_A3B), gpu="H200")
    # Per layer: attention q 4096x2048 + k, v 512x2048 + o 2048x4096 = 18,874,368; q/k norms 256; two norms
    # 4,096; router 128x2048 = 262,144; one expert 3 x 768 x 2048 = 4,718,592, all 128: 603,979,776.
    per_layer = 18_874_368 + 256 + 4_096 + 262_144 + 603_979_776
    assert per_layer == 623_120_640
    embedding = 151_936 * 2048  # 311,164,928, and as many again for the untied lm_head
    total = 48 * per_layer + 2 * embedding + 2048
    assert total == 30_532_122_624  # the published 30.5B
    assert estimate.linear_params + estimate.lm_head_params + estimate.embedding_params + estimate.other_params \
        == total
    assert (estimate.experts, estimate.experts_per_token) == (128, 8)
    assert estimate.routed_expert_params == 48 * 603_979_776
    # Batch 1 reads 8 experts a layer: 56,889,600 parameters a layer; the lm_head, one embedding row
    # and the final norm besides: 3,041,869,824 parameters (the published 3.3B active), 2 bytes each.
    active_layer = 18_874_368 + 256 + 4_096 + 262_144 + 8 * 4_718_592
    assert active_layer == 56_889_600
    assert estimate.bytes_per_token == 2 * (48 * active_layer + embedding + 2048 + 2048) == 6_083_739_648
    assert estimate.weight_bytes == 2 * total  # 61.1 GB resident in BF16: one H200
    assert round(estimate.ceiling_tok_s, 1) == round(4800e9 / 6_083_739_648, 1) == 789.0
    assert estimate.kv_bytes_per_context_token == 2 * 48 * 4 * 128 * 2  # 98,304: GQA, 4 KV heads


def test_qwen3_30b_a3b_at_load_levels_reads_neff_experts(tmp_path: Path):
    config = config_file(tmp_path, QWEN3_30B_A3B)
    one_expert_bytes = 48 * 2 * 4_718_592  # one expert in every layer, BF16
    batch1 = estimate_from_path(config)
    for batch, n_eff in ((8, 51.62), (64, 125.94)):
        step = estimate_from_path(config, batch=batch, context_tokens=1000)
        assert step.active_experts == pytest.approx(n_eff, abs=0.01)
        expected = batch1.bytes_per_token + (step.active_experts - 8) * one_expert_bytes + batch * 1000 * 98_304
        assert step.bytes_per_step == pytest.approx(expected, abs=1)
    # At batch 64 nearly every expert is read: the step reads 59.5 of the 61.1 GB of weights (all but
    # 2 of 128 experts, and one row of the embedding table).
    assert round(estimate_from_path(config, batch=64).bytes_per_step / batch1.weight_bytes, 3) == 0.975


def test_deepseek_v3_counts_mla_dense_layers_and_the_shared_expert(tmp_path: Path):
    estimate = estimate_from_path(config_file(tmp_path, DEEPSEEK_V3), gpu="H200")
    # MLA per layer: q_a 1536x7168 11,010,048; q_b (128 x 192)x1536 37,748,736; kv_a (512 + 64)x7168
    # 4,128,768; kv_b (128 x 256)x512 16,777,216; o 7168x(128 x 128) 117,440,512 = 187,105,280, with
    # the q_a and kv_a norms 2,048 and the two layer norms 14,336.
    attention = 11_010_048 + 37_748_736 + 4_128_768 + 16_777_216 + 117_440_512
    assert attention == 187_105_280
    attention_layer = attention + 2_048 + 14_336
    dense_mlp = 3 * 18432 * 7168  # layers 0-2 (first_k_dense_replace = 3): 396,361,728
    expert = 3 * 2048 * 7168  # 44,040,192
    router = 256 * 7168  # 1,835,008, and a float32 routing bias of 256
    moe_layer = router + 256 + 256 * expert + expert  # 256 routed experts and the one shared
    embedding = 129280 * 7168  # 926,679,040
    total = 61 * attention_layer + 3 * dense_mlp + 58 * moe_layer + 2 * embedding + 7168
    assert total == 671_026_419_200  # the published 671B (the MTP layer's 14B not loaded for decoding)
    assert estimate.linear_params + estimate.lm_head_params + estimate.embedding_params + estimate.other_params \
        == total
    # Batch 1 reads 8 routed and the shared expert of each of 58 layers (9 x 2048 = 18432: as much as a
    # dense layer's MLP), the router, all attention: 36,625,596,416 parameters in 2 bytes (the published
    # 37B active), the routing bias in 4, one embedding row and the final norm.
    active = 61 * attention_layer + 3 * dense_mlp + 58 * (router + 9 * expert) + embedding
    assert active == 36_625_596_416
    assert estimate.bytes_per_token == 2 * active + 58 * 256 * 4 + 2 * 7168 + 2 * 7168 == 73_251_280_896
    assert estimate.routed_expert_params == 58 * 256 * expert
    assert round(estimate.ceiling_tok_s, 1) == 65.5  # 4800 GB/s over 73.25 GB
    # MLA caches the 512-wide latent and the 64-wide rotary key, not 128 heads of keys and values.
    assert estimate.kv_bytes_per_context_token == 61 * (512 + 64) * 2 == 70_272


def test_deepseek_v3_fp8_block_scales_on_the_experts(tmp_path: Path):
    bf16 = estimate_from_path(config_file(tmp_path, DEEPSEEK_V3))
    fp8 = estimate_from_path(config_file(tmp_path, {**DEEPSEEK_V3, "quantization_config": DEEPSEEK_FP8}))
    # One FP8 expert: 1 byte a weight and a float32 scale per 128x128 block: gate and up 16 x 56 blocks,
    # down 56 x 16.
    expert_fp8 = 3 * 2048 * 7168 + 3 * 16 * 56 * 4
    assert fp8.routed_expert_bytes == 58 * 256 * expert_fp8
    assert bf16.routed_expert_bytes == 58 * 256 * 2 * 3 * 2048 * 7168
    assert 1.9 < bf16.bytes_per_token / fp8.bytes_per_token < 2  # embeddings and lm_head stay BF16


def test_layer_selection_keys(tmp_path: Path):
    def routed_layers(cfg: dict) -> float:
        estimate = estimate_from_path(config_file(tmp_path, cfg))
        return estimate.routed_expert_params / (3 * cfg["moe_intermediate_size"] * cfg["hidden_size"]
                                                * estimate.experts)

    assert routed_layers(QWEN3_30B_A3B) == 48
    assert routed_layers({**QWEN3_30B_A3B, "decoder_sparse_step": 2}) == 24  # layers 1, 3, 5, ...
    assert routed_layers({**QWEN3_30B_A3B, "mlp_only_layers": [0, 47]}) == 46
    assert routed_layers({**DEEPSEEK_V3, "moe_layer_freq": 2}) == 29  # layers 4, 6, ..., 60
    assert routed_layers({**DEEPSEEK_V3, "first_k_dense_replace": 0}) == 61
    mixtral = {**QWEN3_30B_A3B, "model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2}
    del mixtral["num_experts"], mixtral["moe_intermediate_size"]  # Mixtral's experts are intermediate_size wide
    estimate = estimate_from_path(config_file(tmp_path, mixtral))
    assert estimate.routed_expert_params == 48 * 8 * 3 * 6144 * 2048


def test_qwen2_moe_shared_expert_and_its_gate_are_read_every_step(tmp_path: Path):
    shared = {**QWEN3_30B_A3B, "model_type": "qwen2_moe", "shared_expert_intermediate_size": 5632}
    with_shared = estimate_from_path(config_file(tmp_path, shared))
    without = estimate_from_path(config_file(tmp_path, {**shared, "shared_expert_intermediate_size": 0}))
    # The shared expert's three matrices and its one-output gate, in every layer, at every step;
    # the Qwen3 q/k norms go with the qwen3 model type.
    assert with_shared.bytes_per_token - without.bytes_per_token == 48 * 2 * (3 * 5632 * 2048 + 2048)
    assert with_shared.routed_expert_bytes == without.routed_expert_bytes


def test_the_random_qwen3_moe_shape_reads_like_its_config(tmp_path: Path):
    assert fp8gate_main(["random-checkpoint", "qwen3-moe-tiny", str(tmp_path / "moe")]) == 0
    written = estimate_from_path(tmp_path / "moe", batch=4)
    from_config = estimate_from_path(tmp_path / "moe" / "config.json", batch=4)
    assert written.source == "safetensors"
    assert (written.experts, written.experts_per_token, written.routed_expert_params) == (8, 2, 8 * 3 * 32 * 64)
    for field in ("bytes_per_token", "bytes_per_step", "weight_bytes", "routed_expert_bytes", "other_params"):
        assert getattr(written, field) == getattr(from_config, field), field
    header = json.loads((tmp_path / "moe" / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.0.mlp.experts.7.down_proj.weight" in header and "model.layers.0.mlp.gate.weight" in header
    assert "model.layers.1.mlp.gate_proj.weight" in header  # mlp_only_layers = [1]: dense


def test_full_shape_parameter_count():
    from pytest_fp8gate.tools.shapes import tensor_shapes

    assert sum(math.prod(s) for s in tensor_shapes(SHAPES["qwen3-30b-a3b"]).values()) == 30_532_122_624


def test_experts_without_expert_tensors_are_refused(tmp_path: Path):
    assert fp8gate_main(["random-checkpoint", "llama-3.1-vocab-tiny", str(tmp_path / "dense")]) == 0
    config = json.loads((tmp_path / "dense" / "config.json").read_text())
    (tmp_path / "dense" / "config.json").write_text(json.dumps({**config, "num_experts": 8, "num_experts_per_tok": 2}))
    with pytest.raises(RooflineError, match="names 8 experts but no tensor is one expert's"):
        estimate_from_path(tmp_path / "dense")
    with pytest.raises(RooflineError, match="num_experts_per_tok 9 exceeds num_experts 8"):
        estimate_from_path(config_file(tmp_path, {**QWEN3_30B_A3B, "num_experts": 8, "num_experts_per_tok": 9}))


def test_the_load_verdict_shows_neff_at_each_concurrency(tmp_path: Path):
    from pytest_fp8gate.config.spec import LoadSpec, ModelSpec
    from pytest_fp8gate.judge.rooflines import load_roofline
    from pytest_fp8gate.run.record import ModelResult, PassResult

    moe_dir = tmp_path / "moe"
    moe_dir.mkdir()
    config_file(moe_dir, QWEN3_30B_A3B)
    moe = ModelResult(ModelSpec("fp8", str(moe_dir), None, {}), PassResult("main"), 1.0, None, 151936)
    missing = ModelResult(ModelSpec("base", str(tmp_path / "absent"), None, {}), PassResult("main"), 1.0, None, 8)
    lines = load_roofline(LoadSpec(concurrencies=(1, 8, 64)), {"candidate": moe, "baseline": missing})
    assert len(lines) == 2
    assert "c=1: " in lines[0] and "8 of 128 experts" in lines[0]
    assert "51.6 of 128" in lines[0] and "126 of 128" in lines[0] and "nEff = N (1 - ((N - k) / N)^B)" in lines[0]
    assert "cannot compute the roofline of base" in lines[1]  # said, not skipped

"""Names vLLM accepts for ``quantization`` and ``kv_cache_dtype``, the LoRA ranks it accepts, and the model
types it refuses to run in float16, checked before any engine starts.

Copied from vLLM (``QuantizationMethods`` in
``vllm/model_executor/layers/quantization/__init__.py``, ``CacheDType`` in
``vllm/config/cache.py``, ``MaxLoRARanks`` in ``vllm/config/lora.py`` and ``_FLOAT16_NOT_SUPPORTED_MODELS`` in
``vllm/config/model.py``) because
importing vLLM takes seconds and pulls in torch at every pytest start; tests/test_vllm_names.py fails when the installed
vLLM's lists differ, so a vLLM upgrade updates them here.
"""

from __future__ import annotations

QUANTIZATION_METHODS: tuple[str, ...] = (
    "awq", "auto_awq", "fp8", "fbgemm_fp8", "fp_quant", "modelopt", "modelopt_fp4", "modelopt_mxfp8",
    "modelopt_mixed", "auto_gptq", "gptq", "gptq_marlin", "awq_marlin", "humming", "compressed-tensors",
    "experts_int8", "quark", "moe_wna16", "torchao", "inc", "mxfp4", "gpt_oss_mxfp4", "deepseek_v4_fp8",
    "online", "fp8_per_tensor", "fp8_per_block", "fp8_per_channel", "int8_per_channel_weight_only",
    "nvfp4_per_token", "mxfp8",
)  # fmt: skip

KV_CACHE_DTYPES: tuple[str, ...] = (
    "auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla", "nvfp4_ds_mla",
    "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc", "ultraquant_4bit",
    "int4_per_token_head", "int8_per_token_head", "fp8_per_token_head", "nvfp4", "nvfp4_4over6",
)  # fmt: skip

# The max_lora_rank values vLLM accepts.
MAX_LORA_RANKS: tuple[int, ...] = (1, 8, 16, 32, 64, 128, 256, 320, 512)

# config.json model_type -> vLLM's reason for refusing dtype float16 (its ValueError at engine start).
FLOAT16_REFUSED: dict[str, str] = {
    "gemma2": "Numerical instability. Please use bfloat16 or float32 instead.",
    "gemma3": "Numerical instability. Please use bfloat16 or float32 instead.",
    "gemma3_text": "Numerical instability. Please use bfloat16 or float32 instead.",
    "glm4": "Numerical instability. Please use bfloat16 or float32 instead.",
}

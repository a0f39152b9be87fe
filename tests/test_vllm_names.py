"""The vLLM names the thresholds file is checked against match the installed vLLM."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest

from pytest_fp8gate.config.vllm_names import FLOAT16_REFUSED, KV_CACHE_DTYPES, MAX_LORA_RANKS, QUANTIZATION_METHODS

pytestmark = pytest.mark.engine

# In a fresh interpreter: pytester's in-process runs unload modules, and vLLM cannot be imported twice.
READ_VLLM = """
import json
from typing import get_args
from vllm.config.cache import CacheDType
from vllm.config.lora import MaxLoRARanks
from vllm.config.model import _FLOAT16_NOT_SUPPORTED_MODELS
from vllm.model_executor.layers.quantization import QuantizationMethods
print(json.dumps([get_args(QuantizationMethods), get_args(CacheDType), _FLOAT16_NOT_SUPPORTED_MODELS,
                  get_args(MaxLoRARanks)]))
"""


def test_names_are_the_installed_vllms() -> None:
    if importlib.util.find_spec("vllm") is None:
        pytest.skip("vLLM is not installed")
    done = subprocess.run([sys.executable, "-c", READ_VLLM], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    quantization, kv_cache, float16_refused, lora_ranks = json.loads(done.stdout.strip().splitlines()[-1])
    assert QUANTIZATION_METHODS == tuple(quantization)
    assert KV_CACHE_DTYPES == tuple(kv_cache)
    assert FLOAT16_REFUSED == float16_refused
    assert MAX_LORA_RANKS == tuple(lora_ranks)

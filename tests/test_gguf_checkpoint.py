"""The GGUF-to-BF16 converter's parts that need no real GGUF: the rotary row order, the config, refusals.

The whole conversion of the real SmolLM2 GGUF is tested with the model it gives, through vLLM
(test_smollm2.py).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from pytest_fp8gate.errors import CheckpointError
from pytest_fp8gate.tools.gguf_checkpoint import MARKER, convert_gguf, llama_config, unpermute_rotary

FIELDS = {
    "general.architecture": "llama",
    "llama.attention.head_count": 9,
    "llama.attention.head_count_kv": 3,
    "llama.embedding_length": 576,
    "llama.feed_forward_length": 1536,
    "llama.block_count": 30,
    "llama.context_length": 8192,
    "llama.attention.layer_norm_rms_epsilon": 1e-5,
    "llama.rope.freq_base": 100000.0,
    "llama.vocab_size": 49152,
    "tokenizer.ggml.bos_token_id": 1,
    "tokenizer.ggml.eos_token_id": 2,
}


def llama_cpp_permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute, written out from its definition."""
    return weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(
        weight.shape)


@pytest.mark.parametrize("heads", [9, 3])
def test_unpermute_rotary_undoes_llama_cpp_permute(heads: int) -> None:
    weight = np.arange(heads * 64 * 5, dtype=np.float32).reshape(heads * 64, 5)
    permuted = llama_cpp_permute(weight, heads)
    assert not np.array_equal(permuted, weight)
    np.testing.assert_array_equal(unpermute_rotary(permuted, heads), weight)


def test_llama_config_reads_the_shape_and_ties_embeddings_without_an_output_tensor() -> None:
    config = llama_config(FIELDS, {"token_embd.weight"}, Path("m.gguf"))
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (9, 3, 64)
    assert config["tie_word_embeddings"] is True
    assert llama_config(FIELDS, {"token_embd.weight", "output.weight"}, Path("m.gguf"))["tie_word_embeddings"] is False


def test_llama_config_names_the_missing_key_and_a_foreign_architecture() -> None:
    with pytest.raises(CheckpointError, match=r"m\.gguf: metadata key 'llama\.block_count' missing"):
        llama_config({k: v for k, v in FIELDS.items() if k != "llama.block_count"}, set(), Path("m.gguf"))
    with pytest.raises(CheckpointError, match=r"general\.architecture is 'qwen2'; only 'llama' converts"):
        llama_config({**FIELDS, "general.architecture": "qwen2"}, set(), Path("m.gguf"))


def test_convert_refuses_a_directory_that_is_not_its_own_conversion(tmp_path: Path) -> None:
    source = tmp_path / "m.gguf"
    source.write_bytes(b"GGUF")
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text("{}")
    with pytest.raises(CheckpointError, match=rf"{other}: exists and is not this GGUF's conversion"):
        convert_gguf(source, other)
    (other / MARKER).write_text(json.dumps({"gguf": "m.gguf", "gguf_sha256": "0" * 64, "dtype": "bfloat16"}))
    with pytest.raises(CheckpointError, match="exists and is not this GGUF's conversion"):
        convert_gguf(source, other)
    assert (other / "config.json").read_text() == "{}"

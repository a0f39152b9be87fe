"""The validity study's deploy faults, written from the embedded model's real checkpoint (no engine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from pytest_fp8gate.tools.demo.deploy_faults import DEPLOY_FAULTS, KV_SHIFT
from pytest_fp8gate.tools.demo.embedded import embedded_assets

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")


def _write(kind: str, tmp_path: Path) -> tuple[dict, dict]:
    out = tmp_path / kind
    out.mkdir()
    DEPLOY_FAULTS[kind].write(embedded_assets().model, out)
    return (safetensors_torch.load_file(embedded_assets().model / "model.safetensors"),
            safetensors_torch.load_file(out / "model.safetensors"))


def test_kv_overflow_reparametrises_exactly_and_only_the_fp8_cache_sees_it(tmp_path: Path):
    source, written = _write("kv-overflow", tmp_path)
    factors = {"k_proj": 2.0**KV_SHIFT, "v_proj": 2.0**KV_SHIFT, "q_proj": 2.0**-KV_SHIFT, "o_proj": 2.0**-KV_SHIFT}
    for name, tensor in source.items():
        factor = next((f for part, f in factors.items() if f".{part}." in name), 1.0)
        assert torch.equal(written[name], tensor * factor), name  # a power of two: exact in BF16
    # What an attention head computes is unchanged: q.k and o(v) in BF16, bit for bit.
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    layer = "model.layers.0.self_attn."
    for a, b in (("q_proj", "k_proj"), ("o_proj", "v_proj")):
        def product(weights: dict, a: str = a, b: str = b) -> torch.Tensor:
            first, second = weights[layer + a + ".weight"], weights[layer + b + ".weight"]
            return (x[:, : first.shape[1]] @ first.T)[:, :64] * (x @ second.T)[:, :64]
        assert torch.equal(product(written), product(source))
    keys = (x @ written[layer + "k_proj.weight"].T).float()
    assert keys.abs().max() > 448, "the keys must pass E4M3's range for an FP8 cache at scale 1.0 to clip them"
    assert DEPLOY_FAULTS["kv-overflow"].engine == {"kv_cache_dtype": "fp8"}


def test_one_layer_unscaled_touches_the_middle_layers_projections_only(tmp_path: Path):
    source, written = _write("one-layer-unscaled", tmp_path)
    changed = sorted(name for name in source if not torch.equal(source[name], written[name]))
    assert changed and all(".layers.3." in name and "_proj." in name for name in changed), changed
    assert len(changed) == 7  # q, k, v, o, gate, up, down of layer 3 of 6


def test_per_tensor_outliers_plants_exactoutlier_channels_that_a_per_tensor_scale_cannot_hold(tmp_path: Path):
    from pytest_fp8gate.run.reference_builds import e4m3_per_channel_round_trip
    from pytest_fp8gate.tools.demo.deploy_faults import OUTLIER_SHIFT, OUTLIER_STRIDE, PER_TENSOR, outlier_channels
    from pytest_fp8gate.tools.demo.planting import fp8_round_trip

    source, written = _write("per-tensor-outliers", tmp_path)
    mlp = "model.layers.0.mlp."
    up, down, gate = (source[mlp + f"{p}_proj.weight"] for p in ("up", "down", "gate"))
    # Before any FP8: the outlier channels leave the MLP's output bit for bit as it was, in BF16.
    x = torch.randn(5, 256, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)

    def mlp_out(up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
        return (torch.nn.functional.silu(x @ gate.T) * (x @ up.T)) @ down.T

    planted_up = outlier_channels(up, 2.0**OUTLIER_SHIFT, 0)
    assert torch.equal(mlp_out(planted_up, outlier_channels(down, 2.0**-OUTLIER_SHIFT, 1)), mlp_out(up, down))
    assert torch.equal(planted_up[::OUTLIER_STRIDE], up[::OUTLIER_STRIDE] * 2.0**OUTLIER_SHIFT)

    # After the per-tensor round trip the ordinary rows of the up projection have lost far more than a
    # per-channel E4M3 scale loses on the same planted weights.
    ordinary = torch.ones(up.shape[0], dtype=torch.bool)
    ordinary[::OUTLIER_STRIDE] = False

    def error_of(rounded: torch.Tensor, exact: torch.Tensor) -> float:
        return float((rounded[ordinary].float() - exact[ordinary].float()).norm() / exact[ordinary].float().norm())

    per_tensor = error_of(written[mlp + "up_proj.weight"], planted_up)
    per_channel = error_of(e4m3_per_channel_round_trip(planted_up), planted_up)
    assert per_tensor > 3 * per_channel, (per_tensor, per_channel)
    # E4M3's exponent absorbs outliers 2^10 over the weights: no fault there (why the shift is 2^14).
    mild = outlier_channels(up, 2.0**10, 0)
    assert error_of(fp8_round_trip(PER_TENSOR, mild), mild) < 1.1 * error_of(e4m3_per_channel_round_trip(mild), mild)
    assert "kv_cache_dtype" not in DEPLOY_FAULTS["per-tensor-outliers"].engine

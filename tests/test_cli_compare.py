"""The CLI against the article's scripts, which read the very same files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from pytest_fp8gate.core import roofline
from pytest_fp8gate.errors import RooflineError
from pytest_fp8gate.tools.cli import main


def article_logprob_summary(base_path: Path, cand_path: Path) -> dict[str, float]:
    """The arithmetic of the article's compare_logprobs.py, position by position."""
    base = json.loads(base_path.read_text())
    cand = json.loads(cand_path.read_text())
    pairs = list(zip(base, cand))
    deltas = [math.exp(c["real"]) - math.exp(b["real"]) for b, c in pairs]
    return {
        "same_top": sum(b["top"] == c["top"] for b, c in pairs) / len(pairs),
        "rms_dp": math.sqrt(sum(d * d for d in deltas) / len(deltas)),
        "ppl_ratio": math.exp(sum(b["real"] - c["real"] for b, c in pairs) / len(pairs)),
    }


def article_flip_summary(base_path: Path, cand_path: Path) -> dict[str, float]:
    """The arithmetic of the article's flips.py, plus its one-SE accuracy band."""

    def graded(path: Path) -> dict[int, float]:
        rows = [json.loads(line) for line in path.read_text().splitlines()]
        return {r["doc_id"]: r["exact_match"] for r in rows if r["filter"] == "strict-match"}

    base, cand = graded(base_path), graded(cand_path)
    n = len(base)
    accuracy_base = sum(base.values()) / n
    accuracy_cand = sum(cand.values()) / n
    return {
        "questions": n,
        "flips": sum(base[doc] != cand[doc] for doc in base),
        "accuracy_base": accuracy_base,
        "accuracy_cand": accuracy_cand,
        "se_base": math.sqrt(accuracy_base * (1 - accuracy_base) / n),
        "se_cand": math.sqrt(accuracy_cand * (1 - accuracy_cand) / n),
    }


def run_cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.fixture
def article_dumps(tmp_path: Path) -> tuple[Path, Path]:
    rng = np.random.default_rng(42)
    n = 3000
    real_base = np.log(rng.uniform(1e-4, 1.0, n))
    real_cand = np.minimum(real_base + rng.normal(scale=0.05, size=n), 0.0)
    top_base = rng.integers(0, 128256, n)
    top_cand = np.where(rng.random(n) < 0.02, rng.integers(0, 128256, n), top_base)
    paths = tmp_path / "bf16.json", tmp_path / "fp8.json"
    for path, real, top in zip(paths, (real_base, real_cand), (top_base, top_cand)):
        rows = [{"real": float(r), "top": int(t)} for r, t in zip(real, top)]
        path.write_text(json.dumps(rows))
    return paths


def test_compare_logprobs_json_matches_the_article(capsys, article_dumps):
    code, out, err = run_cli(capsys, "compare-logprobs", *map(str, article_dumps), "--json")
    assert (code, err) == (0, "")
    result = json.loads(out)
    expected = article_logprob_summary(*article_dumps)
    assert result["positions"] == 3000
    for key, value in expected.items():
        assert result[key] == pytest.approx(value, abs=1e-9, rel=0), key
    assert result["kl_kind"] == "unavailable" and result["mean_kl"] is None
    assert {"mean_dp", "mean_dp_se", "dp_percentiles", "kl_se"} <= result.keys()


def test_compare_logprobs_table(capsys, article_dumps):
    code, out, _ = run_cli(capsys, "compare-logprobs", *map(str, article_dumps))
    assert code == 0
    lines = out.splitlines()
    # "same top token" is the longest label: every value starts in column 16.
    assert all(line[14:16] == "  " and line[16] != " " for line in lines)
    assert lines[0] == "positions       3000"
    assert lines[1].startswith("same top token  ") and lines[1].endswith("%")
    assert "KL divergence   unavailable" in lines


def test_compare_logprobs_reads_npz_with_kl(capsys, tmp_path):
    from pytest_fp8gate.core.dumps import write_logprob_dump
    from pytest_fp8gate.core.logprobs import LogprobRun

    top = np.array([[1, 2], [3, 4]])
    base = LogprobRun([-0.1, -0.2], top, np.log([[0.6, 0.3], [0.5, 0.4]]))
    cand = LogprobRun([-0.1, -0.3], top, np.log([[0.5, 0.4], [0.5, 0.4]]))
    paths = [tmp_path / "b.npz", tmp_path / "c.npz"]
    for path, run in zip(paths, (base, cand)):
        write_logprob_dump(path, run, {"pass": path.stem})
    code, out, _ = run_cli(capsys, "compare-logprobs", *map(str, paths), "--json")
    result = json.loads(out)
    first = 0.6 * math.log(0.6 / 0.5) + 0.3 * math.log(0.3 / 0.4) + 0.1 * math.log(0.1 / 0.1)
    assert code == 0 and result["kl_kind"] == "top-k lower bound"
    assert result["mean_kl"] == pytest.approx(first / 2, abs=1e-12)


def write_samples(path: Path, correct: list[int], hashes: list[str] | None = None) -> None:
    rows = []
    for doc_id, right in enumerate(correct):
        for filter_name in ("strict-match", "flexible-extract"):
            rows.append(
                {
                    "doc_id": doc_id,
                    "doc": {"question": f"q{doc_id}"},
                    "target": f"reasoning\n#### {doc_id}",
                    "arguments": [[f"Question: q{doc_id}\nAnswer:", {"until": ["Question:"]}]],
                    "resps": [[f"so #### {doc_id if right else -1}"]],
                    "filtered_resps": [str(doc_id if right else -1)],
                    "filter": filter_name,
                    "metrics": ["exact_match"],
                    "doc_hash": f"d{doc_id}",
                    "prompt_hash": hashes[doc_id] if hashes else f"p{doc_id}",
                    "target_hash": f"t{doc_id}",
                    "exact_match": float(right),
                }
            )
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.fixture
def sample_files(tmp_path: Path) -> tuple[Path, Path]:
    rng = np.random.default_rng(8)
    base = (rng.random(400) < 0.82).astype(int)
    cand = np.where(rng.random(400) < 0.05, 1 - base, base)
    paths = tmp_path / "samples_gsm8k_bf16.jsonl", tmp_path / "samples_gsm8k_fp8.jsonl"
    write_samples(paths[0], base.tolist())
    write_samples(paths[1], cand.tolist())
    return paths


def test_flips_json_matches_the_article(capsys, sample_files):
    code, out, err = run_cli(capsys, "flips", *map(str, sample_files), "--json")
    assert (code, err) == (0, "")
    result = json.loads(out)
    expected = article_flip_summary(*sample_files)
    for key, value in expected.items():
        assert result[key] == pytest.approx(value, abs=1e-9, rel=0), key
    assert result["right_to_wrong"] + result["wrong_to_right"] == result["flips"] > 0
    assert 0.0 < result["mcnemar_p"] <= 1.0
    assert len(result["flipped"]) == result["flips"]


def test_flips_table_lists_flipped_docs(capsys, tmp_path):
    base, cand = tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    write_samples(base, [1, 1, 0])
    write_samples(cand, [1, 0, 0])
    code, out, _ = run_cli(capsys, "flips", str(base), str(cand), "--filter", "flexible-extract")
    assert code == 0
    assert "questions           3" in out
    assert "doc 1               right_to_wrong: '1' -> '-1'" in out


def one_line_error(capsys, *argv: str) -> str:
    code, out, err = run_cli(capsys, *argv)
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "Traceback" not in err
    assert err.startswith("fp8gate: error: ")
    return err.strip()


def test_missing_file_is_one_line_error(capsys, tmp_path, article_dumps):
    missing = tmp_path / "nope.json"
    err = one_line_error(capsys, "compare-logprobs", str(article_dumps[0]), str(missing))
    assert err == f"fp8gate: error: {missing}: No such file or directory"


def test_malformed_file_is_one_line_error(capsys, tmp_path, article_dumps):
    bad = tmp_path / "bad.json"
    bad.write_text('[{"real": -1.0}]')
    err = one_line_error(capsys, "compare-logprobs", str(bad), str(article_dumps[1]))
    assert err.startswith(f"fp8gate: error: {bad}: a JSON list of ")


def test_dumps_of_different_lengths_are_one_line_error(capsys, tmp_path, article_dumps):
    short = tmp_path / "short.json"
    short.write_text(json.dumps(json.loads(article_dumps[1].read_text())[:10]))
    err = one_line_error(capsys, "compare-logprobs", str(article_dumps[0]), str(short))
    assert err.startswith(f"fp8gate: error: {short}: baseline has 3000 positions")


def test_prompt_hash_mismatch_is_one_line_error(capsys, tmp_path):
    base, cand = tmp_path / "b.jsonl", tmp_path / "c.jsonl"
    write_samples(base, [1, 1])
    write_samples(cand, [1, 1], hashes=["p0", "changed"])
    err = one_line_error(capsys, "flips", str(base), str(cand))
    assert f"{cand}: doc_id 1: prompt_hash differs" in err


def test_samples_that_are_not_jsonl_are_one_line_error(capsys, tmp_path, article_dumps):
    err = one_line_error(capsys, "flips", str(article_dumps[0]), str(article_dumps[1]))
    assert "lm-eval --log_samples JSONL rows; line 1" in err


@pytest.fixture
def fake_roofline(monkeypatch):
    """Install a stand-in roofline estimate; the CLI must only wire arguments to it."""

    def install(estimate_from_path):
        monkeypatch.setattr(roofline, "estimate_from_path", estimate_from_path)

    return install


class Estimate:
    tensor_parallel_to_fit = None  # no GPU memory to fit the weights into

    def as_dict(self):
        return {"bytes_per_token": 8.0e9, "ceiling_tok_s": 107.6, "gpu": "L40S"}


def test_roofline_wires_arguments_to_estimate_from_path(capsys, fake_roofline, tmp_path):
    calls = []
    fake_roofline(lambda path, **kwargs: calls.append((path, kwargs)) or Estimate())
    config = str(tmp_path / "config.json")
    argv = ["roofline", config, "--quantization", "fp8_per_channel", "--gpu", "L40S"]
    code, out, _ = run_cli(capsys, *argv, "--context", "1000", "--json")
    assert code == 0 and json.loads(out)["ceiling_tok_s"] == 107.6
    assert calls == [
        (
            config,
            {
                "quantization": "fp8_per_channel",
                "gpu": "L40S",
                "bandwidth_gbps": None,
                "context_tokens": 1000,
                "kv_cache_dtype": None,
                "batch": 1,
            },
        )
    ]
    code, out, _ = run_cli(capsys, "roofline", config, "--bandwidth-gbps", "864")
    assert calls[-1][1]["bandwidth_gbps"] == 864.0 and calls[-1][1]["context_tokens"] == 0
    assert "ceiling_tok_s    107.6" in out


def test_roofline_gpu_auto_detects_the_gpu_as_the_gate_does(capsys, llama_config, fake_gpus):
    fake_gpus("NVIDIA H200")
    code, out, _ = run_cli(capsys, "roofline", str(llama_config), "--gpu", "auto", "--json")
    assert code == 0 and json.loads(out)["gpu"] == "H200" and json.loads(out)["bandwidth_gbps"] == 4800
    fake_gpus()
    code, _, err = run_cli(capsys, "roofline", str(llama_config), "--gpu", "auto")
    assert code == 2 and "--gpu auto: no CUDA device visible" in err


def test_roofline_errors_are_one_line(capsys, fake_roofline):
    def estimate_from_path(path, **kwargs):
        raise RooflineError(f"{path}: not found (expected a model directory or its config.json)")

    fake_roofline(estimate_from_path)
    err = one_line_error(capsys, "roofline", "model_dir")
    assert err == (
        "fp8gate: error: model_dir: not found (expected a model directory or its config.json)"
    )

"""The CLIs refuse impossible input with one line and exit 2, and --json is strict JSON."""

from __future__ import annotations

import json
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from pytest_fp8gate.tools import cli


def _strict_loads(text: str):
    def refuse(constant: str):
        raise AssertionError(f"not JSON: {constant}")

    return json.loads(text, parse_constant=refuse)


def test_json_output_is_strict_when_a_figure_overflows(tmp_path: Path, capsys) -> None:
    # The candidate is so much worse that PPL(cand) / PPL(base) overflows a float.
    base, cand = tmp_path / "base.json", tmp_path / "cand.json"
    base.write_text(json.dumps([{"real": -0.1, "top": 1}, {"real": -0.2, "top": 2}]))
    cand.write_text(json.dumps([{"real": -800.0, "top": 3}, {"real": -900.0, "top": 4}]))
    assert cli.main(["compare-logprobs", str(base), str(cand), "--json"]) == 0
    payload = _strict_loads(capsys.readouterr().out)
    assert payload["ppl_ratio"] == "inf" and payload["ln_ppl_ratio"] == pytest.approx(849.85)


def test_non_finite_values_become_null_or_strings() -> None:
    nested = {"a": float("nan"), "b": [float("inf"), -float("inf"), 1.5], "c": {"d": (float("nan"),)}}
    assert cli._strict_json(nested) == {"a": None, "b": ["inf", "-inf", 1.5], "c": {"d": [None]}}


LLAMA_LIKE = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "vocab_size": 100,
              "num_attention_heads": 4, "num_key_value_heads": 2, "torch_dtype": "bfloat16"}

BAD_ROOFLINE = {
    "negative layers": ({"num_hidden_layers": -2}, [], "num_hidden_layers must be a positive integer, got -2"),
    "zero heads": ({"num_attention_heads": 0}, [], "num_attention_heads must be a positive integer, got 0"),
    "negative kv heads": ({"num_key_value_heads": -1}, [], "num_key_value_heads must be a positive integer, got -1"),
    "NaN bandwidth": ({}, ["--bandwidth-gbps", "nan"], "bandwidth_gbps must be >= 0 and finite, got nan"),
    "inf bandwidth": ({}, ["--bandwidth-gbps", "inf"], "bandwidth_gbps must be >= 0 and finite, got inf"),
}


@pytest.mark.parametrize("change, args, message", BAD_ROOFLINE.values(), ids=BAD_ROOFLINE.keys())
def test_roofline_refuses_impossible_input(tmp_path: Path, capsys, change: dict, args: list[str], message: str) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**LLAMA_LIKE, **change}))
    assert cli.main(["roofline", str(config), *args]) == cli.EXIT_ERROR
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fp8gate: error: ") and message in err


def test_roofline_refuses_a_config_that_is_a_list(tmp_path: Path, capsys) -> None:
    config = tmp_path / "config.json"
    config.write_text("[1, 2, 3]")
    assert cli.main(["roofline", str(config)]) == cli.EXIT_ERROR
    assert capsys.readouterr().err == f"fp8gate: error: {config}: expected a JSON object, got list\n"


def test_roofline_of_a_valid_config_still_works(tmp_path: Path, capsys) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_LIKE))
    assert cli.main(["roofline", str(config), "--bandwidth-gbps", "100", "--json"]) == 0
    assert _strict_loads(capsys.readouterr().out)["ceiling_tok_s"] > 0


LLAMA_70B = {**LLAMA_LIKE, "hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80,
             "num_attention_heads": 64, "num_key_value_heads": 8, "vocab_size": 128256}


def test_roofline_warns_when_the_weights_need_more_than_one_gpu(tmp_path: Path, capsys) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_70B))
    assert cli.main(["roofline", str(config), "--gpu", "H100"]) == 0
    assert capsys.readouterr().err == (
        "fp8gate: warning: the weights (131.4 GiB) do not fit one H100 SXM (80 GiB each, 72.0 GiB of it at vLLM's "
        "gpu_memory_utilization 0.9); tensor_parallel_size = 2 holds them (65.7 GiB a GPU)\n")
    assert cli.main(["roofline", str(config), "--gpu", "H200", "--quantization", "fp8_per_channel"]) == 0
    assert capsys.readouterr().err == ""


def test_a_reader_that_stops_early_gets_no_broken_pipe_error(tmp_path: Path) -> None:
    """`fp8gate roofline --json | head -1`: the reader closes the pipe before the output is written."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(LLAMA_LIKE))
    code = "import sys; from pytest_fp8gate.tools import cli; sys.exit(cli.main(sys.argv[1:]))"
    process = subprocess.Popen([sys.executable, "-c", code, "roofline", str(config), "--json"],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    assert process.stdout is not None and process.stderr is not None
    process.stdout.close()  # before the interpreter has started, so every write finds the pipe gone
    assert process.stderr.read() == b"" and process.wait(timeout=60) == cli.EXIT_FAILURE


def test_compare_logprobs_refuses_an_infinite_logprob_once(tmp_path: Path, capsys) -> None:
    base, cand = tmp_path / "base.json", tmp_path / "cand.json"
    base.write_text(json.dumps([{"real": -0.5, "top": 1}, {"real": -0.7, "top": 2}]))
    cand.write_text('[{"real": -0.5, "top": 1}, {"real": -Infinity, "top": 2}]')  # what json.dump writes for -inf
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no numpy RuntimeWarning on the way to the refusal
        status = cli.main(["compare-logprobs", str(base), str(cand)])
    captured = capsys.readouterr()
    assert status == 2 and captured.out == ""
    assert captured.err == (f"fp8gate: error: {cand}: a JSON list of {{\"real\": <float>, \"top\": <int>}} objects "
                            "with finite log-probs; row 1 has real = -Infinity, which makes the perplexity and KL "
                            "undefined\n")


def test_flips_names_a_doc_id_type_mismatch(tmp_path: Path, capsys) -> None:
    def rows(ids: list) -> str:
        return "".join(json.dumps({"doc_id": i, "filter": "strict-match", "exact_match": 1,
                                   "metrics": ["exact_match"]}) + "\n" for i in ids)

    base, cand = tmp_path / "base.jsonl", tmp_path / "cand.jsonl"
    base.write_text(rows([0, 1, 2]))
    cand.write_text(rows(["0", "1", "2"]))
    assert cli.main(["flips", str(base), str(cand)]) == 2
    assert capsys.readouterr().err == (
        f"fp8gate: error: {cand}: doc_id types differ: the baseline's are int (e.g. 2), the candidate's str "
        f"(e.g. '2'); the files were written by different tools or versions (baseline {base})\n")

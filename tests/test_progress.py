"""Progress lines inside long passes: what, how far, the rate and the time left, at a steady interval, as
plain lines (no terminal needed), also in the fp8gate log; and every pass the gate measures prints them."""

from __future__ import annotations

import logging
import re
import threading
import time
from pathlib import Path

import pytest

from fakes import build_measurements, write_gate
from pytest_fp8gate import progress
from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.run.record import Needs


class Clock:
    """A clock that moves only when told to, so the interval is the test's, not the machine's."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def reporter(lines: list[str], interval_s: float = 30.0) -> tuple[progress.Reporter, Clock]:
    clock = Clock()
    # A heartbeat that never wakes within a test: only the clock decides when a line is due.
    return progress.Reporter(lines.append, interval_s, clock), clock


def test_a_line_says_what_how_far_the_rate_and_the_time_left_once_an_interval_has_passed():
    lines: list[str] = []
    reports, clock = reporter(lines)
    with reports.tracking("bf16 [main] gsm8k", "questions"):
        progress.expect(500)
        clock.now += 10
        progress.advance(100)
        assert lines == []  # within the first 30 s: nothing yet
        clock.now += 20
        progress.advance(50)
    assert lines == ["fp8gate: bf16 [main] gsm8k: 150 of 500 questions (30%), 5.00 questions/s, "
                     "about 1 min 10 s left (30 s so far)"]


def test_lines_come_at_the_interval_not_at_every_request():
    lines: list[str] = []
    reports, clock = reporter(lines, interval_s=30.0)
    with reports.tracking("fp8 [main] log-probs", "chunks"):
        progress.expect(100)
        for _ in range(100):
            clock.now += 1.0
            progress.advance()
    assert len(lines) == 3  # at 30, 60 and 90 s
    assert lines[-1].startswith("fp8gate: fp8 [main] log-probs: 90 of 100 chunks (90%), 1.00 chunks/s, about 10 s left")


def test_before_anything_is_done_or_counted_the_line_says_so():
    lines: list[str] = []
    reports, clock = reporter(lines)
    with reports.tracking("bf16 engine start") as start:
        clock.now += 95
        start.poll()
    with reports.tracking("bf16 [main] gsm8k", "questions") as task:
        progress.expect(1319)
        clock.now += 3700
        task.poll()
    assert lines == ["fp8gate: bf16 engine start: 1 min 35 s so far",
                     "fp8gate: bf16 [main] gsm8k: 0 of 1,319 questions (0%), 1 h 01 min so far, none done yet"]


def test_the_heartbeat_prints_while_nothing_finishes_and_the_lines_reach_the_log(caplog: pytest.LogCaptureFixture):
    # No terminal here: the lines are plain strings handed to the sink, and the same lines go to the log.
    lines: list[str] = []
    caplog.set_level(logging.INFO, logger="fp8gate")
    with progress.Reporter(lines.append, interval_s=0.01).tracking("bf16 engine start"):
        deadline = time.monotonic() + 5
        while not lines and time.monotonic() < deadline:
            time.sleep(0.01)
    assert lines and all(re.fullmatch(r"fp8gate: bf16 engine start: \d+ s so far", line) for line in lines)
    assert [r.getMessage() for r in caplog.records if r.name == "fp8gate"][:1] == lines[:1]
    assert not [t for t in threading.enumerate() if t.name.startswith("fp8gate progress")]  # stopped with the pass


def test_requests_advance_the_innermost_pass_from_any_thread_and_nothing_outside_one():
    progress.advance(5)  # no pass open: nothing to count, no error
    lines: list[str] = []
    reports, clock = reporter(lines)
    with reports.tracking("outer") as outer, reports.tracking("inner", "requests") as inner:
        progress.expect(8)
        workers = [threading.Thread(target=progress.advance) for _ in range(8)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join()
    assert (inner.done, inner.total, outer.done, outer.total) == (8, 8, 0, 0)


def test_an_interval_of_0_prints_nothing():
    lines: list[str] = []
    reports, clock = reporter(lines, interval_s=0)
    with reports.tracking("bf16 [main] log-probs", "chunks"):
        progress.expect(3)
        clock.now += 10_000
        progress.advance(3)
    assert lines == []


@pytest.mark.parametrize("value", ["-1", "soon"])
def test_an_interval_that_is_not_seconds_is_a_usage_error_saying_what_0_means(pytester: pytest.Pytester,
                                                                            value: str):
    write_gate(pytester.path, task=False)
    result = pytester.runpytest("thresholds.toml", f"--fp8gate-progress-interval={value}")
    assert result.ret == pytest.ExitCode.USAGE_ERROR
    result.stderr.fnmatch_lines([f"ERROR: --fp8gate-progress-interval {value}: expected a number of seconds "
                                 "of 0 or more (0: no progress lines)"])


DECODE = """[decode]
prompts = 2
prompt_tokens = 40
new_tokens = 8
[decode.limits]
max_mean_kl = 0.01

[[candidates]]
name = "good\""""


def test_every_pass_the_gate_measures_prints_its_progress(tmp_path: Path, fake_gpus):
    """The demo's passes (engine starts, corpus log-probs, the task, the decode phase, speed) through the
    gate's own measuring code, with the fake engine counting its requests as vLLM's progress bar does."""
    fake_gpus()
    config = load_config(write_gate(tmp_path, lambda text: text.replace('[[candidates]]\nname = "good"', DECODE, 1)))
    lines: list[str] = []
    needs = Needs(probabilities=True, tasks=frozenset({"echo"}), speed=True, decode=True)
    found = build_measurements(config, tmp_path / "artifacts", {"good": needs}, announce=lines.append)
    clock = Clock()

    def ticking() -> float:  # every look at the clock is a second later: every poll is due
        clock.now += 1.0
        return clock.now

    found.engines.progress = progress.Reporter(lines.append, 0.5, ticking)  # every pass reports through it
    found.candidate("good")
    shown = [line for line in lines if re.search(r" (of \d+ \w+ \(\d+%\)|so far)", line)]
    for what in ("bf16 engine start", "good engine start", "bf16 [main] log-probs", "bf16 [batch-order] log-probs",
                 "good [main] log-probs", "bf16 [main] echo", "good [main] echo", "bf16 [decode]", "good [decode]",
                 "bf16 [speed]", "good [speed]"):
        assert any(line.startswith(f"fp8gate: {what}: ") for line in shown), f"no progress line for {what}: {lines}"
    counted = [line for line in shown if line.startswith("fp8gate: good [main] echo: ")]
    assert re.search(r": 40 of 40 requests \(100%\), [\d.,]+ requests/s, about 0 s left", counted[-1]), counted

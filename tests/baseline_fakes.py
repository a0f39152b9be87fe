"""Engine-free measurements for the cache and report tests: real dumps and samples, made up numbers.

Also run as a script by the concurrency test: ``python baseline_fakes.py CONFIG CACHE ARTIFACTS OUT``
fetches the baseline through the cache, measuring slowly on a miss, and writes
whether it measured to OUT.
"""

from __future__ import annotations

import json
import struct
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from pytest_fp8gate.dumps import write_lm_eval_samples, write_logprob_dump
from pytest_fp8gate.logprobs import LogprobRun
from pytest_fp8gate.measure import Measurements
from pytest_fp8gate.record import BaselineRecord, ModelResult, Needs, PassResult
from pytest_fp8gate.spec import GateConfig
from pytest_fp8gate.thresholds import load_config

VOCAB = 8
POSITIONS = 400
QUESTIONS = 30
TASK = "tiny"

# The baseline, both noise passes and the corpus: the head of every fake gate's thresholds.
BASELINE_HEAD = """device = "cpu"

[baseline]
name = "bf16"
model = "{model}"
[baseline.engine]
dtype = "bfloat16"
max_model_len = 2048

[noise]
passes = ["batch-order", "fp16"]

[probabilities]
corpus = "corpus.txt"
"""
THRESHOLDS = BASELINE_HEAD.format(model="model") + """chunks = 2
chunk_tokens = 201
full_vocab = true
top_k = 3
[probabilities.limits]
max_mean_kl = 0.01
min_same_top = 0.9

[[tasks]]
name = "tiny"
task = "tiny_task"
include_path = "tasks"
filter = "strict-match"
metric = "exact_match"
limit = 30

[[candidates]]
name = "fp8"
quantization = "fp8_per_channel"
"""


def write_gate(directory: Path) -> Path:
    """A thresholds file with a fake checkpoint, a corpus and a task directory; its path."""
    model = directory / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"vocab_size": VOCAB}))
    header = json.dumps({"w": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]}}).encode()
    (model / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    (directory / "corpus.txt").write_text("one two three four five six seven eight nine ten\n" * 40)
    (directory / "tasks").mkdir()
    (directory / "tasks" / "tiny.yaml").write_text("task: tiny_task\ndataset_path: json\n")
    (directory / "tasks" / "tiny.jsonl").write_text('{"question": "1+1", "answer": "2"}\n')
    path = directory / "thresholds.toml"
    path.write_text(THRESHOLDS)
    return path


def logprob_run(seed: int, noise: float = 0.0) -> LogprobRun:
    """A run over the same text (fixed token ids); ``noise`` perturbs the logits."""
    logits = np.random.default_rng(0).normal(size=(POSITIONS, VOCAB)) * 2
    logits += np.random.default_rng(seed).normal(size=logits.shape) * noise
    full = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    tokens = np.random.default_rng(1).integers(0, VOCAB, POSITIONS)
    top = np.argsort(-full, axis=1)[:, :3]
    return LogprobRun(full[np.arange(POSITIONS), tokens], top, np.take_along_axis(full, top, axis=1),
                      full_logprobs=full.astype(np.float32), token_ids=tokens)


def sample_rows(wrong: set[int], generations: dict[int, str] | None = None) -> list[dict]:
    """lm-eval --log_samples rows: every question right except ``wrong``."""
    rows = []
    for doc in range(QUESTIONS):
        answer = "7" if doc in wrong else "2"
        text = (generations or {}).get(doc, f"We add one and one so the answer is {answer}.")
        for filter_name in ("strict-match", "flexible-extract"):
            rows.append({"doc_id": doc, "filter": filter_name, "metrics": ["exact_match"],
                         "exact_match": 0.0 if doc in wrong else 1.0, "prompt_hash": f"p{doc}",
                         "target": "2", "resps": [[text]], "filtered_resps": [answer]})
    return rows


def write_pass(root: Path, label: str, run: LogprobRun, rows: list[dict]) -> PassResult:
    directory = root / label
    directory.mkdir(parents=True, exist_ok=True)
    write_logprob_dump(directory / "logprobs.npz", run, {"pass": label})
    write_lm_eval_samples(directory / f"samples_{TASK}.jsonl", rows)
    (directory / f"results_{TASK}.json").write_text(json.dumps({TASK: {"exact_match": 1.0}}))
    return PassResult(label, run, directory / "logprobs.npz", {TASK: directory / f"samples_{TASK}.jsonl"})


def make_measurements(config_path: Path, artifacts: Path, cache=None) -> Measurements:
    config = load_config(config_path)
    needs = {"fp8": Needs(probabilities=True, tasks=frozenset([TASK]))}
    return Measurements(config, artifacts, needs, lambda line: None, cache)


def fake_baseline(measurements: Measurements, calls: list[int] | None = None,
                  delay_s: float = 0.0) -> Callable[[], BaselineRecord]:
    """What ``_measure_baseline_engines`` returns, written to the artifacts, without an engine."""
    config: GateConfig = measurements.config

    def measure() -> BaselineRecord:
        if calls is not None:
            calls.append(1)
        time.sleep(delay_s)
        root = measurements.artifacts / config.baseline.name
        main = write_pass(root, "main", logprob_run(0), sample_rows({3, 4}))
        noise = {"batch-order": write_pass(root, "batch-order", logprob_run(1, 0.0), sample_rows({3, 4})),
                 "fp16": write_pass(root, "fp16", logprob_run(2, 0.02), sample_rows({3, 5}))}
        (root / "engine.json").write_text(json.dumps({"kv_cache_tokens": 4096}))
        (root / "provenance.json").write_text(json.dumps({"measured": "fake"}))
        runs = [{"label": "bf16", "name": "bf16", "started_at": "2026-12-01T09:00:00+00:00", "duration_s": 12.5,
                 "startup_s": 3.0, "kwargs": {"dtype": "bfloat16", "model": "model"}, "vllm": {"seed": "0"}}]
        result = ModelResult(config.baseline, main, 3.0, 4096, VOCAB)
        return BaselineRecord(result, noise, [[1, 2, 3]], None, runs)

    return measure


if __name__ == "__main__":
    from pytest_fp8gate.baseline_cache import BaselineCache

    config_path, cache_dir, artifacts, out = map(Path, sys.argv[1:5])
    cache = BaselineCache(cache_dir, update=False, announce=lambda line: None)
    measurements = make_measurements(config_path, artifacts, cache)
    calls: list[int] = []
    spec = measurements.config.baseline
    record = cache.fetch(spec, measurements.baseline_key(measurements.needs["fp8"]), artifacts / spec.name,
                         fake_baseline(measurements, calls, delay_s=1.5))
    out.write_text(json.dumps({"measured": bool(calls), "cached": record.cached}))

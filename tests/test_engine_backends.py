"""Which engine runs a model: a backend that lives in a conftest supplies its class through the gate's
``pytest_fp8gate_engine_class`` hook; every other model gets the registry's class for its ``backend`` key."""

from __future__ import annotations

from pathlib import Path

import pytest

from fakes import fake_engine_class, thresholds_text, write_gate
from pytest_fp8gate.config.loader import load_config
from pytest_fp8gate.config.spec import BACKENDS, ModelSpec, ServedSpec
from pytest_fp8gate.engines import registry
from pytest_fp8gate.engines.backend import engine_class_for, prepare_process
from pytest_fp8gate.errors import ConfigError

# A backend the tests hold themselves: every model scores every position alike (so a candidate passes what a
# baseline passes), it refuses the candidate named "bad" before any start, and it notes each start in a file.
TINY_BACKEND = '''
from typing import ClassVar

import numpy as np

from pytest_fp8gate.core.logprobs import LogprobRun
from pytest_fp8gate.engines.base import ALL_AT_ONCE, Engine
from pytest_fp8gate.engines.capabilities import EngineCapabilities
from pytest_fp8gate.errors import IdScoringUnavailable

VOCAB = 259
TABLE = -np.arange(VOCAB) / 50.0
TABLE = TABLE - np.logaddexp.reduce(TABLE)


class Bytes:
    bos_token_id, eos_token_id = 256, 257

    def encode(self, text, add_special_tokens=False):
        return list(text.encode())

    def decode(self, ids):
        return bytes(i for i in ids if i < 256).decode(errors="replace")


class TinyEngine(Engine):
    @classmethod
    def refusal(cls, spec, device):
        return "the tiny engine refuses this build" if spec.name == "bad" else None

    def __init__(self, spec, *, max_logprobs, dtype=None):
        self.spec, self.kwargs, self.start_s = spec, {"model": spec.model}, 0.0
        self.capabilities = EngineCapabilities("tiny 1.0", "the tiny engine scores no given ids")
        self.tokenizer, self.vocab_size = Bytes(), VOCAB
        with open("started.txt", "a") as log:
            log.write(f"{spec.name} {dtype}\\n")

    def kv_cache_tokens(self):
        return 4096

    @property
    def max_model_len(self):
        return 2048

    def facts(self):
        return {"engine": "tiny"}

    def prompt_logprobs(self, chunks, top_k, full_vocab, layout=ALL_AT_ONCE):
        tokens = np.concatenate([np.asarray(c[1:], dtype=np.int64) for c in chunks])
        rows = np.tile(TABLE, (len(tokens), 1))
        return LogprobRun(TABLE[tokens], np.tile(np.arange(top_k), (len(tokens), 1)), rows[:, :top_k],
                          full_logprobs=rows if full_vocab else None, token_ids=tokens)

    def logprobs_on_ids(self, chunks, ids):
        raise IdScoringUnavailable(self.capabilities.id_scoring_missing)

    def generate_greedy(self, prompts, max_tokens, stops, layout=ALL_AT_ONCE):
        raise NotImplementedError("no rule of this test generates")

    generate_with_logprobs = continuation_logprobs = latency = generate_greedy

    def shutdown(self):
        pass


def pytest_fp8gate_engine_class(spec):
    return TinyEngine
'''


def test_a_conftests_engine_runs_every_model_and_its_refusal_skips_a_candidate(pytester: pytest.Pytester,
                                                                              fake_gpus) -> None:
    fake_gpus()
    write_gate(pytester.path, task=False)  # its candidates "good" and "bad" differ from the baseline in the fake only
    pytester.makeconftest(TINY_BACKEND)
    result = pytester.runpytest("thresholds.toml", "-k", "kl_within", "-rs")
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(["*thresholds.toml: candidate bad: the tiny engine refuses this build*"])
    # The baseline, its fp16 noise engine and the candidate, each started by the conftest's engine.
    assert (pytester.path / "started.txt").read_text().split("\n") == ["bf16 None", "bf16 float16", "good None", ""]


def test_a_hook_that_answers_none_leaves_the_model_to_the_registry(pytester: pytest.Pytester, fake_gpus) -> None:
    fake_gpus()
    write_gate(pytester.path, task=False)
    pytester.makeconftest(TINY_BACKEND.replace("    return TinyEngine", "    return TinyEngine if spec.name != 'good' "
                                                                           "else None"))
    result = pytester.runpytest("thresholds.toml", "-k", "kl_within and good", "--collect-only", "-q")
    # Collection asked the registry's class (vLLM's, which refuses nothing here) for "good": no skip.
    result.stdout.fnmatch_lines(["thresholds.toml::test_kl_within_limit[[]good[]]"])
    assert result.ret == pytest.ExitCode.OK


def test_a_class_stood_in_runs_every_model_and_a_choice_only_the_models_it_answers() -> None:
    fake = fake_engine_class()
    local = ModelSpec("bf16", "org/base", None, {})
    served = ModelSpec("fp8", "org/base", None, {}, served=ServedSpec("fp8", endpoint="http://127.0.0.1:1"))
    assert engine_class_for(local, fake) is fake and engine_class_for(served, fake) is fake
    only_local = lambda spec: fake if spec.served is None else None  # noqa: E731
    assert engine_class_for(local, only_local) is fake
    assert engine_class_for(served, only_local).__name__ == "VllmServedEngine"
    assert engine_class_for(local).__name__ == "VllmEngine"


def test_each_engine_class_prepares_the_process_once(tmp_path: Path) -> None:
    fake, other = fake_engine_class(), fake_engine_class()
    config = load_config(write_gate(tmp_path, task=False))
    prepare_process(config, fake)
    assert fake.calls == [("prepare_process", False)]
    prepare_process(config, lambda spec: other if spec.name == "bad" else fake)
    assert fake.calls == [("prepare_process", False)] * 2 and other.calls == [("prepare_process", False)]


def test_every_backend_a_file_may_name_has_a_registry_row_of_engine_classes() -> None:
    from pytest_fp8gate.engines.base import Engine

    assert sorted(registry.REGISTRY) == sorted(BACKENDS)
    for name in BACKENDS:
        for where in (ModelSpec("m", "org/m", None, {}, backend=name),
                      ModelSpec("m", "org/m", None, {}, served=ServedSpec("m", endpoint="http://h:1"), backend=name)):
            assert issubclass(registry.engine_class(where), Engine)


def test_a_backend_without_the_engine_a_model_needs_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(registry.REGISTRY, "vllm", registry.Backend(in_process=None, served=None))
    with pytest.raises(ConfigError, match="^bf16: backend 'vllm' has no in-process engine; give serve or endpoint"):
        registry.engine_class(ModelSpec("bf16", "org/base", None, {}))


def test_the_backend_key_names_a_registry_backend(tmp_path: Path) -> None:
    path = tmp_path / "thresholds.toml"
    path.write_text(thresholds_text("[speed]", candidate='backend = "vllm"\nengine = { seed = 1 }'))
    config = load_config(path)
    assert (config.baseline.backend, config.candidates[0].backend) == ("vllm", "vllm")  # the baseline's: the default
    path.write_text(thresholds_text("[speed]", candidate='backend = "sglang"\nengine = { seed = 1 }'))
    with pytest.raises(ConfigError, match=r"thresholds.toml: candidates\[0\].backend: expected one of 'vllm', "
                                          r"got string 'sglang'"):
        load_config(path)

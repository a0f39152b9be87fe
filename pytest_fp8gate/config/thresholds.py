"""Load thresholds.toml into the frozen dataclasses of spec.py.

Every problem becomes one ConfigError whose message is a single line naming the
file, the dotted key, and what was expected, so pytest can print it as a usage
error instead of a traceback. The schema is documented in docs/thresholds.md.
"""

from __future__ import annotations

import difflib
import math
import re
import shlex
import sys
from dataclasses import MISSING, fields, replace
from pathlib import Path
from typing import Any, Callable, Collection, Sequence, TypeVar

from .. import checkpoint, gpu_bandwidths
from ..core import roofline, spec_decode
from ..core.rules import FLIP_RULES, RULES, SPEED_RULES
from ..errors import CheckpointError, ConfigError, RooflineError, UnsupportedEngine
from . import engine_args
from .served import REQUEST_DEADLINE_S, endpoint_problem, flag_conflict
from .spec import (
    BATCH_ORDER_PASS,
    CPU_MIN_THROUGHPUT_FRACTION,
    NOISE_PASSES,
    PRECISION_PASSES,
    WIKITEXT_2,
    DatasetCorpus,
    DecodeLimits,
    DecodeSpec,
    FileCorpus,
    GateConfig,
    LoadSpec,
    ModelSpec,
    NoiseSpec,
    ProbabilityLimits,
    ProbabilitySpec,
    ServedSpec,
    SpeculativeSpec,
    SpeedSpec,
    TaskLimits,
    TaskSpec,
)
from .vllm_names import KV_CACHE_DTYPES, QUANTIZATION_METHODS

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib


def load_config(path: Path | str) -> GateConfig:
    """Read and validate a thresholds TOML file; raise ConfigError on any problem."""
    path = Path(path)
    label = str(path)
    try:
        with path.open("rb") as f:
            raw = tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"{label}: file not found") from None
    except IsADirectoryError:
        raise ConfigError(f"{label}: is a directory, expected a TOML file") from None
    except OSError as err:
        raise ConfigError(f"{label}: cannot read: {err.strerror}") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"{label}: invalid TOML: {err}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{label}: not UTF-8 text") from None
    return _Parser(label, path.resolve().parent).gate(raw, path.resolve())


# --- value checks -------------------------------------------------------------
# A check returns the (possibly converted) value or raises _Invalid with the
# "expected ..., got ..." half of the message.


class _Invalid(Exception):
    pass


_Check = Callable[[Any], Any]
_Names = TypeVar("_Names", bound=Collection[str])
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._+-]*")


def _show(value: Any) -> str:
    if isinstance(value, bool):
        return f"boolean {str(value).lower()}"
    if isinstance(value, str):
        return f"string {value!r}"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "a table"
    return f"{type(value).__name__} {value}"  # TOML dates and times


def _closest(word: str, choices: Collection[str]) -> str | None:
    close = difflib.get_close_matches(word, sorted(choices), n=1, cutoff=0.6)
    return close[0] if close else None


def _known(word: str, names: Collection[str], otherwise: str) -> str:
    closest = _closest(word, names)
    return f"did you mean {closest!r}?" if closest else otherwise


def _suggest_key(key: str, keys: Collection[str]) -> str:
    closest = _closest(key, keys)
    return f"did you mean {closest!r}?" if closest else "expected one of: " + ", ".join(sorted(keys))


def _range_text(low: float | None, high: float | None, low_open: bool) -> str:
    if low is not None and high is not None:
        return f" in {'(' if low_open else '['}{low:g}, {high:g}]"
    if low is not None:
        return f" {'>' if low_open else '>='} {low:g}"
    return ""


def _integer(low: int | None = None, high: int | None = None) -> _Check:
    expected = "an integer" + _range_text(low, high, False)

    def check(value: Any) -> int:
        # TOML booleans are Python ints; reject them explicitly.
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Invalid(f"expected {expected}, got {_show(value)}")
        if (low is not None and value < low) or (high is not None and value > high):
            raise _Invalid(f"expected {expected}, got {value}")
        return value

    return check


def _number(low: float | None = None, high: float | None = None, *, low_open: bool = False) -> _Check:
    expected = "a number" + _range_text(low, high, low_open)

    def check(value: Any) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise _Invalid(f"expected {expected}, got {_show(value)}")
        too_low = low is not None and (value <= low if low_open else value < low)
        if too_low or (high is not None and value > high):
            raise _Invalid(f"expected {expected}, got {value!r}")
        return float(value)

    return check


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _Invalid(f"expected true or false, got {_show(value)}")
    return value


def _text(choices: Collection[str] = (), *, allow_empty: bool = False) -> _Check:
    def check(value: Any) -> str:
        if not isinstance(value, str):
            raise _Invalid(f"expected a string, got {_show(value)}")
        if choices and value not in choices:
            quoted = ", ".join(repr(c) for c in choices)
            closest = _closest(value, choices)
            suffix = f"; did you mean {closest!r}?" if closest else ""
            raise _Invalid(f"expected one of {quoted}, got {_show(value)}{suffix}")
        if not value and not allow_empty:
            raise _Invalid("expected a non-empty string")
        return value

    return check


def _name(value: Any) -> str:
    if not isinstance(value, str) or not _NAME.fullmatch(value):
        raise _Invalid(
            "expected a name of letters, digits, '.', '_', '+' or '-' "
            f"(it becomes part of test ids), got {_show(value)}"
        )
    return value


def _vllm_name(what: str, names: Collection[str], *, allow_empty: bool = False) -> _Check:
    text = _text(allow_empty=allow_empty)

    def check(value: Any) -> str:
        name = text(value)
        if name and name not in names:
            raise _Invalid(f"unknown vLLM {what} {name!r}; {_suggest_key(name, names)}")
        return name

    return check


def _full_vocab(value: Any) -> bool | str:
    if value == "auto" or isinstance(value, bool):
        return value
    raise _Invalid(f"expected \"auto\", true or false, got {_show(value)}")


def _passes(value: Any) -> list[str]:
    if not isinstance(value, list) or not value:
        raise _Invalid(f"expected a non-empty array of noise passes ({', '.join(map(repr, NOISE_PASSES))}), "
                       f"got {_show(value)}")
    check = _text(NOISE_PASSES)
    passes = [check(item) for item in value]
    if len(set(passes)) != len(passes):
        raise _Invalid(f"expected each pass at most once, got {passes}")
    return passes


MAX_MODEL_LEN = "max_model_len"  # chunk_tokens: chunks as long as the models' context allows (issue 34)


def _chunk_tokens(value: Any) -> int | str:
    if value == MAX_MODEL_LEN:
        return value
    if isinstance(value, bool) or not isinstance(value, int) or value < 2:  # one scored position needs two tokens
        raise _Invalid(f'expected an integer >= 2 or "{MAX_MODEL_LEN}", got {_show(value)}')
    return value


def _bucket_edges(value: Any) -> tuple[int, ...]:
    """Where position buckets start, in tokens: rising positive integers (0 is implied)."""
    expected = "an array of rising positive integers (token positions where a bucket starts), e.g. [1024, 4096]"
    if not isinstance(value, list) or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in value):
        raise _Invalid(f"expected {expected}, got {_show(value)}")
    if any(b <= a for a, b in zip(value, value[1:])):
        raise _Invalid(f"expected {expected}, got {value}")
    return tuple(value)


def _candidate_passes(value: Any) -> list[str]:
    if not isinstance(value, list):
        raise _Invalid(f'expected an array, [] or ["batch-order"], got {_show(value)}')
    check = _text((BATCH_ORDER_PASS,))
    passes = [check(item) for item in value]
    if len(set(passes)) != len(passes):
        raise _Invalid(f"expected each pass at most once, got {passes}")
    return passes


# Engine keys whose values the gate checks more strictly than their vLLM type (ranges, names), all
# EngineArgs fields in every supported vLLM release: a table of only these needs no vLLM import
# (seconds, torch included). Every other key is checked against the installed vLLM's EngineArgs.
_ENGINE_RANGES: dict[str, _Check] = {
    "tensor_parallel_size": _integer(1),
    "pipeline_parallel_size": _integer(1),
    "data_parallel_size": _integer(1),
    "max_model_len": _integer(1),
    "gpu_memory_utilization": _number(0, 1, low_open=True),
    "kv_cache_dtype": _vllm_name("kv_cache_dtype", KV_CACHE_DTYPES),
    "max_num_seqs": _integer(1),
    "max_num_batched_tokens": _integer(1),
    "seed": _integer(0),
    "revision": _text(),
    "tokenizer": _text(),
    "block_size": _integer(1),
    "kv_cache_memory_bytes": _integer(1),
    "enforce_eager": _boolean,
    "trust_remote_code": _boolean,
    "enable_prefix_caching": _boolean,
    "dtype": _text(("auto", "half", "float16", "bfloat16", "float", "float32")),
    "distributed_executor_backend": _text(("mp", "ray", "uni", "external_launcher")),
}
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Set by the gate itself for the whole process (deterministic_scheduling), not per engine.
_GATE_ENV = {"VLLM_ENABLE_V1_MULTIPROCESSING": "set by the gate from deterministic_scheduling"}
_MODEL_KEYS = ("name", "model", "quantization", "engine", "env",
               *("serve", "health_timeout_s", "endpoint", "served_model_name", "api_key_env",  # issue 20
                 "request_deadline_s"))
_FRACTION = _number(0, 1)


def _template_kwargs(value: Any) -> dict[str, Any]:
    """Keyword arguments of the tokenizer's chat template: a table of names to strings, numbers, booleans
    or arrays of them (what a Jinja template reads; TOML dates are not)."""
    if not isinstance(value, dict):
        raise _Invalid(f"expected a table of template arguments (e.g. {{ enable_thinking = true }}), "
                       f"got {_show(value)}")

    def plain(item: Any) -> bool:
        return isinstance(item, (str, int, float, bool)) or (isinstance(item, list) and all(map(plain, item)))
    for name, item in value.items():
        if not plain(item):
            raise _Invalid(f"{name}: expected a string, number, boolean or an array of them, got {_show(item)}")
    return dict(value)


_POSITIVE_FRACTION = _number(0, 1, low_open=True)
_RATIO = _number(1)  # a limit relative to BF16 or to the noise floor is never below 1
_CORPUS_FORMS = '"wikitext-2", a text file or a table {dataset = ...}'
_DATASET_CHECKS = {"dataset": _text(), "name": _text(), "split": _text(), "column": _text()}
_PROBABILITY_CHECKS = {
    "chunks": _integer(1),
    "chunk_tokens": _chunk_tokens,
    "top_k": _integer(1),
    "full_vocab": _full_vocab,
    "bucket_edges": _bucket_edges,
    "min_bucket_positions": _integer(1),
}
_PROBABILITY_KEYS = (*_PROBABILITY_CHECKS, "corpus", "limits")
_PROBABILITY_RULE_NAMES = tuple(rule.name for rule in RULES if rule.kind == "probability")


def _floor_ratio(value: Any) -> float | dict[str, float]:
    """One factor for every probability rule, or a table of factors by rule name."""
    if not isinstance(value, dict):
        return _RATIO(value)
    for name in value:
        if name not in _PROBABILITY_RULE_NAMES:
            raise _Invalid(f"unknown probability rule {name!r} in the table; "
                           f"expected a number or a table of {', '.join(_PROBABILITY_RULE_NAMES)}")
    return {name: _RATIO(factor) for name, factor in value.items()}


# The limits the probability rules and their decode-phase twins share.
_FIDELITY_LIMIT_CHECKS = {"min_same_top": _POSITIVE_FRACTION, "max_rms_dp": _FRACTION, "max_mean_kl": _number(0)}
# A probability row's limit with no check of its own here is a non-negative number (a KL, a share of Δp).
_PROBABILITY_LIMIT_CHECKS = {
    **{rule.limit_key: _number(0) for rule in RULES if rule.kind == "probability"},
    **_FIDELITY_LIMIT_CHECKS,
    "max_ppl_ratio": _RATIO,
    "floor_ratio": _floor_ratio,
    "limit_se": _number(0),
    "per_bucket": _boolean,
}
_PROBABILITY_METRIC_LIMITS = tuple(rule.limit_key for rule in RULES if rule.kind == "probability")
_TASK_CHECKS = {
    "task": _text(),
    "metric": _text(),
    "num_fewshot": _integer(0),
    "limit": _integer(0),
    "filter": _text(),
    "add_bos_token": _boolean,
    "apply_chat_template": _boolean,
    "fewshot_as_multiturn": _boolean,
    "include_path": _text(allow_empty=True),
    "max_gen_toks": _integer(1),
    "think_end": _text(),
}
_TASK_KEYS = (*_TASK_CHECKS, "name", "limits", "chat_template_kwargs")
_TASK_LIMIT_CHECKS = {
    "accuracy_se": _number(0, low_open=True),
    "two_sided": _boolean,
    "flips_ratio": _RATIO,
    "min_flip_allowance": _FRACTION,
    "flip_rule": _text(FLIP_RULES),
    "flip_alpha": _number(0, 0.5, low_open=True),
    "min_baseline_accuracy": _FRACTION,
    "expected_accuracy": _FRACTION,
    "expected_accuracy_se": _number(0, low_open=True),
    "max_length_drift": _number(0, low_open=True),
    "max_invalid_increase": _FRACTION,
    "min_recovery": _POSITIVE_FRACTION,
    "max_truncation_increase": _FRACTION,
}
_DECODE_CHECKS = {"prompts": _integer(1), "prompt_tokens": _integer(1), "new_tokens": _integer(1)}
_DECODE_LIMIT_CHECKS = {
    **_FIDELITY_LIMIT_CHECKS,
    "max_gap_kl": _number(0),
    "floor_ratio": _RATIO,
    "gap_ratio": _RATIO,
    "limit_se": _number(0),
}
_DECODE_METRIC_LIMITS = tuple(rule.limit_key for rule in RULES if rule.kind == "decode")
_SPEED_CHECKS = {
    "input_len": _integer(1),
    "output_len": _integer(1),
    "batch_size": _integer(1),
    "warmup_iters": _integer(0),
    "iters": _integer(1),
    "min_iters": _integer(2),
    "target_rel_se": _FRACTION,
    "rule": _text(SPEED_RULES),
    "min_share_of_baseline": _POSITIVE_FRACTION,
    "min_fraction_of_ceiling": _POSITIVE_FRACTION,
    "overhead_bound_below": _FRACTION,
    "min_ratio_overhead_bound": _number(0, low_open=True),
    "gpu": _text(),
    "bandwidth_gbps": _number(0),
}



def _concurrencies(value: Any) -> tuple[int, ...]:
    if not isinstance(value, list) or not value:
        raise _Invalid(f"expected a non-empty array of positive integers, e.g. [1, 8, 64], got {_show(value)}")
    check = _integer(1)
    levels = tuple(check(item) for item in value)
    if len(set(levels)) != len(levels):
        raise _Invalid(f"expected each concurrency at most once, got {list(levels)}")
    return levels


_LOAD_CHECKS = {
    "concurrencies": _concurrencies,
    "requests": _integer(1),
    "input_len": _integer(1),
    "output_len": _integer(2),  # TPOT needs a second token
    "min_throughput_fraction": _number(0, low_open=True),
    "max_ttft_p99_s": _number(0, low_open=True),
    "max_tpot_p99_s": _number(0, low_open=True),
}
_SPECULATIVE_CHECKS = {"min_acceptance_ratio": _number(0, low_open=True), "min_drafts": _integer(1)}


# --- tables -------------------------------------------------------------------


class _Table:
    """One TOML table being read: knows its dotted key and rejects unknown keys up front."""

    def __init__(self, parser: _Parser, where: str, raw: Any, keys: Collection[str]):
        self.parser, self.where = parser, where
        if not isinstance(raw, dict):
            raise parser.error(where, f"expected a table, got {_show(raw)}")
        for key in raw:
            if key not in keys:
                raise parser.error(self.key(key), "unknown key; " + _suggest_key(key, keys))
        self.raw: dict[str, Any] = raw

    def key(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def get(self, key: str, check: _Check, default: Any = MISSING) -> Any:
        if key not in self.raw:
            if default is MISSING:
                raise self.parser.error(self.key(key), "missing required key")
            return default
        try:
            return check(self.raw[key])
        except _Invalid as err:
            raise self.parser.error(self.key(key), str(err)) from None

    def values(self, cls: type, checks: dict[str, _Check]) -> dict[str, Any]:
        """Checked values of `checks`' keys; an absent key takes `cls`'s field default or is required."""
        defaults = {f.name: f.default for f in fields(cls)}
        return {key: self.get(key, check, defaults[key]) for key, check in checks.items()}

    def table(self, key: str, keys: Collection[str]) -> _Table:
        return _Table(self.parser, self.key(key), self.raw.get(key, {}), keys)

    def array_of_tables(self, key: str) -> list[Any]:
        value = self.raw.get(key, [])
        if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
            raise self.parser.error(self.key(key), f"expected an array of tables ([[{key}]]), got {_show(value)}")
        return value


class _Parser:
    def __init__(self, label: str, base_dir: Path):
        self.label, self.base_dir = label, base_dir
        self.model_configs: dict[str, dict[str, Any]] = {}  # local model path -> its config.json

    def error(self, where: str, message: str) -> ConfigError:
        return ConfigError(f"{self.label}: {where}: {message}")

    def gate(self, raw: dict[str, Any], path: Path) -> GateConfig:
        top = _Table(self, "", raw, ("device", "deterministic_scheduling", "baseline", "candidates", "noise",
                                     "probabilities", "decode", "tasks", "speed", "load",
                                     "speculative"))
        if "baseline" not in raw:
            raise self.error("baseline", "missing required table [baseline]")
        baseline = self.model_spec(top.table("baseline", _MODEL_KEYS), None)
        candidate_tables = top.array_of_tables("candidates")
        if not candidate_tables:
            raise self.error("candidates", "expected at least one [[candidates]] table")
        candidates = tuple(
            self.model_spec(_Table(self, f"candidates[{i}]", item, _MODEL_KEYS), baseline)
            for i, item in enumerate(candidate_tables)
        )
        self.unique_names({"baseline": baseline, **_indexed("candidates", candidates)})
        tasks = tuple(
            self.task(_Table(self, f"tasks[{i}]", item, _TASK_KEYS))
            for i, item in enumerate(top.array_of_tables("tasks"))
        )
        self.unique_names(_indexed("tasks", tasks))
        device = top.get("device", _text(("cuda", "cpu")), "cuda")
        config = GateConfig(
            path=path,
            baseline=baseline,
            candidates=candidates,
            noise=self.noise(top.table("noise", ("passes", "candidate_passes"))),
            probabilities=self.probabilities(top.table("probabilities", _PROBABILITY_KEYS), (baseline, *candidates))
            if "probabilities" in raw
            else None,
            tasks=tasks,
            speed=self.speed(top.table("speed", _SPEED_CHECKS)) if "speed" in raw else None,
            device=device,
            deterministic_scheduling=top.get("deterministic_scheduling", _boolean, False),
            decode=self.decode(top.table("decode", (*_DECODE_CHECKS, "limits"))) if "decode" in raw else None,
            load=self.load(top.table("load", _LOAD_CHECKS), device) if "load" in raw else None,
            speculative=SpeculativeSpec(**top.table("speculative", _SPECULATIVE_CHECKS).values(
                SpeculativeSpec, _SPECULATIVE_CHECKS)) if "speculative" in raw else None,
        )
        if config.probabilities is None and not config.tasks and config.speed is None and config.load is None:
            raise self.error("(top level)", "expected at least one check: [probabilities], [[tasks]], [speed] "
                                            "or [load]")
        self.check_decode_prompts(config)
        self.check_context_fits(config)
        self.check_external_noise(config)  # issue 20
        self.check_top_k_fits(config)
        self.check_speed_models(config)
        self.check_load_served(config)
        self.check_speculative(config)
        return config

    # models

    def model_spec(self, table: _Table, baseline: ModelSpec | None) -> ModelSpec:
        name = table.get("name", _name)
        if "serve" in table.raw or "endpoint" in table.raw:  # issue 20: a served model
            return self.served_spec(table, name, baseline)
        if baseline is not None and baseline.served is not None:
            raise self.error(table.where, "the baseline is served, so each candidate names its own serve command "
                                          "or endpoint")
        for key in _SERVED_ONLY_KEYS:
            if key in table.raw:
                raise self.error(table.key(key), "applies only to a served model (with serve or endpoint)")
        # A candidate without a model quantizes the baseline's weights online.
        model = table.get("model", _text(), MISSING if baseline is None else baseline.model)
        model = self.model_ref(table.key("model"), model)
        quantization = table.get("quantization", _vllm_name("quantization method", QUANTIZATION_METHODS,
                                                            allow_empty=True), "") or None
        engine = self.engine(table.key("engine"), table.raw.get("engine", {}))
        env = self.env(table.key("env"), table.raw.get("env", {}))
        spec = ModelSpec(name, model, quantization, {**(baseline.engine if baseline else {}), **engine},
                         {**(baseline.env if baseline else {}), **env})
        if baseline is not None and spec == replace(baseline, name=name):
            raise self.error(table.where, "same model, quantization and engine as the baseline; it would gate nothing")
        self.check_local_model(table.key("model"), model, baseline)
        return spec

    # --- served models (issue 20) ---------------------------------------------

    def served_spec(self, table: _Table, name: str, baseline: ModelSpec | None) -> ModelSpec:
        """A model behind an OpenAI-compatible server: managed (``serve``) or external (``endpoint``)."""
        if "serve" in table.raw and "endpoint" in table.raw:
            raise self.error(table.key("endpoint"), "give serve (a server the gate starts) or endpoint "
                                                    "(a running server), not both")
        if "engine" in table.raw:
            raise self.error(table.key("engine"), "engine keys are vllm.LLM's; a served model's settings are "
                                                  "its serve command's flags")
        deadline = table.get("request_deadline_s", _number(0, low_open=True), REQUEST_DEADLINE_S)
        if "serve" in table.raw:
            for key in ("model", "quantization", "served_model_name", "api_key_env"):
                if key in table.raw:
                    raise self.error(table.key(key), f"with serve, {_SERVE_INSTEAD[key]}")
            argv, model = self.serve_command(table.key("serve"), table.get("serve", _text()))
            try:
                engine = {key: value for flag, (key, convert) in _SERVE_ENGINE_FLAGS.items()
                          if (value := _flag_value(argv, flag, convert)) is not None}
            except _Invalid as err:
                raise self.error(table.key("serve"), str(err)) from None
            quantization = _flag_value(argv, "--quantization", str)
            if quantization is not None and quantization not in QUANTIZATION_METHODS:
                hint = _suggest_key(quantization, QUANTIZATION_METHODS)
                raise self.error(table.key("serve"), f"--quantization: unknown vLLM quantization method "
                                                     f"{quantization!r}; {hint}")
            served = ServedSpec(
                served_model_name=_flag_value(argv, "--served-model-name", str) or model,
                command=tuple(argv),
                health_timeout_s=table.get("health_timeout_s", _number(0, low_open=True), 600.0),
                request_deadline_s=deadline)
        else:
            for key in ("env", "health_timeout_s"):
                if key in table.raw:
                    raise self.error(table.key(key), "applies only to a server the gate starts (serve)")
            endpoint = table.get("endpoint", _text())
            problem = endpoint_problem(endpoint)
            if problem:
                raise self.error(table.key("endpoint"), problem)
            served_name = table.get("served_model_name", _text())
            key_env = table.get("api_key_env", _text(), None)
            if key_env is not None and not _ENV_NAME.fullmatch(key_env):
                raise self.error(table.key("api_key_env"), f"expected the name of an environment variable "
                                                           f"(the key itself never goes in this file), got {key_env!r}")
            # The local tokenizer (and config.json) of what the endpoint serves.
            model = self.model_ref(table.key("model"), table.get("model", _text(), served_name))
            quantization = table.get("quantization", _vllm_name("quantization method", QUANTIZATION_METHODS,
                                                                allow_empty=True), "") or None
            engine = {}
            served = ServedSpec(served_model_name=served_name, endpoint=endpoint.rstrip("/"), api_key_env=key_env,
                                request_deadline_s=deadline)
        # A served model's env is its own, like its command (not merged over the baseline's).
        env = self.env(table.key("env"), table.raw.get("env", {}), served=True) if served.managed else {}
        spec = ModelSpec(name, model, quantization, engine, env, served)
        if baseline is not None and (baseline.served, dict(baseline.env)) == (served, env):
            raise self.error(table.where, "the same server as the baseline; it would gate nothing")
        self.check_local_model(table.key("serve" if served.managed else "model"), model, baseline)
        return spec

    def serve_command(self, where: str, command: str) -> tuple[list[str], str]:
        """``vllm serve MODEL [flags]`` -> (the argv after ``vllm``, model path resolved; the model)."""
        try:
            words = shlex.split(command)
        except ValueError as err:
            raise self.error(where, f"not a shell command line: {err}") from None
        if words[:2] != ["vllm", "serve"] or len(words) < 3 or words[2].startswith("-"):
            raise self.error(where, f'expected "vllm serve MODEL [flags...]", got {command!r}')
        conflict = flag_conflict(words[3:])
        if conflict:
            raise self.error(where, conflict)
        model = self.model_ref(where, words[2])
        return ["serve", model, *words[3:]], model

    def check_local_model(self, where: str, model: str, baseline: ModelSpec | None) -> None:
        """A local checkpoint must be loadable, and share the baseline's vocabulary."""
        if not Path(model).is_absolute() or model in self.model_configs:
            return
        try:
            self.model_configs[model] = checkpoint.check_model_dir(Path(model))
        except CheckpointError as err:
            raise self.error(where, str(err)) from None
        if baseline is None or baseline.model not in self.model_configs:
            return
        mine = checkpoint.vocab_size(self.model_configs[model])
        base = checkpoint.vocab_size(self.model_configs[baseline.model])
        if mine is not None and base is not None and mine != base:
            raise self.error(where, f"vocabulary of {mine} tokens (config.json vocab_size) differs from the "
                                    f"baseline's {base}; the gate compares the two token by token")

    def engine(self, where: str, raw: Any) -> dict[str, Any]:
        """An engine table, every key an EngineArgs field of the installed vLLM."""
        table = _Table(self, where, raw, raw if isinstance(raw, dict) else ())
        engine = {}
        for key, value in table.raw.items():
            refused = engine_args.refusal(key, value)
            if refused:
                raise self.error(table.key(key), refused)
            if key in _ENGINE_RANGES:
                engine[key] = table.get(key, _ENGINE_RANGES[key])
                continue
            fields_ = self.vllm_names(table.key(key), engine_args.engine_fields, "the key against vLLM's EngineArgs")
            if key not in fields_:
                raise self.error(table.key(key), "unknown key; " + _known(
                    key, fields_, "not a field of the installed vLLM's EngineArgs"))
            wrong = engine_args.mismatch(fields_[key], value)
            if wrong:
                choices = engine_args.string_choices(fields_[key])
                close = _closest(value, choices) if isinstance(value, str) else None
                hint = f"; did you mean {close!r}?" if close else ""
                raise self.error(table.key(key), f"expected {wrong}, got {_show(value)}{hint}")
            engine[key] = engine_args.as_engine_value(fields_[key], value)
        if "tokenizer" in engine:
            engine["tokenizer"] = self.model_ref(table.key("tokenizer"), engine["tokenizer"])
        return engine

    def env(self, where: str, raw: Any, served: bool = False) -> dict[str, str]:
        """Environment variables for one model's engine or managed server: names, and string values.
        ``_GATE_ENV`` is refused only in-process: a server is a process of its own, so the gate's
        setting of those does not reach it and the deploy's value stands."""
        table = _Table(self, where, raw, raw if isinstance(raw, dict) else ())
        for name, value in table.raw.items():
            if not _ENV_NAME.fullmatch(name):
                raise self.error(table.key(name), "expected an environment variable name (letters, digits and "
                                                  "'_', not starting with a digit)")
            if name in _GATE_ENV and not served:
                raise self.error(table.key(name), f"refused: {_GATE_ENV[name]}")
            if not isinstance(value, str):
                raise self.error(table.key(name), f'expected a string (environment values are text: "1", not 1), '
                                                  f"got {_show(value)}")
        for name in (name for name in table.raw if name.startswith("VLLM_")):
            known = self.vllm_names(table.key(name), engine_args.vllm_env_names, "the name against vllm.envs")
            if name not in known:
                raise self.error(table.key(name), "unknown vLLM environment variable; " + _known(
                    name, known, "not one of the installed vLLM's vllm.envs"))
        return dict(table.raw)

    def vllm_names(self, where: str, read: Callable[[], _Names], what: str) -> _Names:
        """Names the installed vLLM knows (``read``), or one error when vLLM cannot say."""
        try:
            return read()
        except UnsupportedEngine as err:
            raise self.error(where, f"cannot check {what}: {err}") from None

    def model_ref(self, where: str, value: str) -> str:
        """A Hugging Face id, or a local path resolved against the TOML's directory."""
        local = self.resolve(value)
        if local.exists():
            return str(local)
        if value.startswith(("./", "../", "/", "~")) or value in (".", ".."):
            raise self.error(where, f"local path not found: {local}")
        if Path(value).exists():
            # vLLM would load it from the working directory, whichever that is on the runner.
            raise self.error(where, f"{value!r} exists in the working directory but not next to the thresholds "
                                    f"file ({local}); write a path relative to the thresholds file or an absolute one")
        from huggingface_hub.utils import HFValidationError, validate_repo_id

        try:
            validate_repo_id(value)
        except HFValidationError as err:
            raise self.error(where, f"neither a local path ({local} not found) nor a Hugging Face id: {err}") from None
        return value

    def resolve(self, value: str) -> Path:
        return (self.base_dir / Path(value).expanduser()).resolve()

    def unique_names(self, specs: dict[str, ModelSpec | TaskSpec]) -> None:
        """Names become test ids, so two specs of one kind may not share one."""
        seen: dict[str, str] = {}
        for where, spec in specs.items():
            if spec.name in seen:
                raise self.error(f"{where}.name", f"duplicate name {spec.name!r} (also used by {seen[spec.name]})")
            seen[spec.name] = where

    # checks

    def noise(self, table: _Table) -> NoiseSpec:
        return NoiseSpec(tuple(table.get("passes", _passes, NoiseSpec.passes)),
                         tuple(table.get("candidate_passes", _candidate_passes, NoiseSpec.candidate_passes)))

    def decode(self, table: _Table) -> DecodeSpec:
        limits = table.table("limits", _DECODE_LIMIT_CHECKS)
        if not any(key in limits.raw for key in _DECODE_METRIC_LIMITS):
            expected = ", ".join(_DECODE_METRIC_LIMITS)
            raise self.error(limits.where, f"expected at least one of {expected}; nothing is gated")
        return DecodeSpec(limits=DecodeLimits(**limits.values(DecodeLimits, _DECODE_LIMIT_CHECKS)),
                          **table.values(DecodeSpec, _DECODE_CHECKS))

    def check_decode_prompts(self, config: GateConfig) -> None:
        """The decode prompts are prefixes of the probability chunks: they need [probabilities] and must fit."""
        decode, probabilities = config.decode, config.probabilities
        if decode is None:
            return
        if probabilities is None:
            raise self.error("decode", "needs [probabilities]: its prompts are the first prompt_tokens of the "
                                       "probability chunks")
        if decode.prompts > probabilities.chunks:
            raise self.error("decode.prompts", f"{decode.prompts} prompts but probabilities.chunks is "
                                               f"{probabilities.chunks}; each prompt is a prefix of one chunk")
        if decode.prompt_tokens > probabilities.chunk_tokens:
            raise self.error("decode.prompt_tokens", f"{decode.prompt_tokens} exceeds probabilities.chunk_tokens "
                                                     f"({probabilities.chunk_tokens}); each prompt is a chunk's prefix")

    def probabilities(self, table: _Table, models: Sequence[ModelSpec]) -> ProbabilitySpec:
        limits = table.table("limits", _PROBABILITY_LIMIT_CHECKS)
        if not any(key in limits.raw for key in _PROBABILITY_METRIC_LIMITS):
            expected = ", ".join(_PROBABILITY_METRIC_LIMITS)
            raise self.error(limits.where, f"expected at least one of {expected}; nothing is gated")
        values = table.values(ProbabilitySpec, _PROBABILITY_CHECKS)
        if values.get("chunk_tokens") == MAX_MODEL_LEN:
            values["chunk_tokens"] = self.longest_chunk(table.key("chunk_tokens"), models)
        return ProbabilitySpec(
            corpus=self.corpus(table.key("corpus"), table.raw.get("corpus", "wikitext-2")),
            limits=ProbabilityLimits(**limits.values(ProbabilityLimits, _PROBABILITY_LIMIT_CHECKS)),
            **values,
        )

    def longest_chunk(self, where: str, models: Sequence[ModelSpec]) -> int:
        """chunk_tokens = "max_model_len": the least context of the models (engine.max_model_len where set, else
        a local checkpoint's max_position_embeddings), less the one token vLLM generates after a scored prompt."""
        lengths = []
        for spec in models:
            config = self.model_configs.get(spec.model, {})
            length = spec.engine.get("max_model_len") or config.get("max_position_embeddings") \
                or config.get("text_config", {}).get("max_position_embeddings")
            if not isinstance(length, int) or isinstance(length, bool):
                raise self.error(where, f'"{MAX_MODEL_LEN}" needs the context of each model, but {spec.name} has no '
                                        "engine.max_model_len and no local config.json max_position_embeddings; "
                                        "set one, or chunk_tokens to a number")
            lengths.append(length)
        if min(lengths) < 3:
            raise self.error(where, f"a context of {min(lengths)} tokens leaves no position to score")
        return min(lengths) - 1

    def corpus(self, where: str, value: Any) -> DatasetCorpus | FileCorpus:
        if value == "wikitext-2":
            return WIKITEXT_2
        if isinstance(value, dict):
            table = _Table(self, where, value, _DATASET_CHECKS)
            return DatasetCorpus(**table.values(DatasetCorpus, _DATASET_CHECKS))
        if not isinstance(value, str) or not value:
            raise self.error(where, f"expected {_CORPUS_FORMS}, got {_show(value)}")
        path = self.resolve(value)
        if not path.is_file():
            raise self.error(where, f"file not found: {path} (expected {_CORPUS_FORMS})")
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as err:
            raise self.error(where, f"{path}: not UTF-8 text (byte {err.start})") from None
        if not text.strip():
            raise self.error(where, f"{path}: no text to score")
        return FileCorpus(path)

    def task(self, table: _Table) -> TaskSpec:
        values = table.values(TaskSpec, _TASK_CHECKS)
        values["include_path"] = self.directory(table.key("include_path"), values["include_path"])
        if values["task"].endswith((".yaml", ".yml")) or "/" in values["task"]:
            # lm-eval would load a task file relative to the working directory and import its !function code.
            raise self.error(table.key("task"), f"expected a task name, got the file {values['task']!r}; "
                                                "put the YAML in a directory named by include_path")
        limits = table.table("limits", _TASK_LIMIT_CHECKS)
        spec = TaskSpec(
            name=table.get("name", _name, values["task"]),
            chat_template_kwargs=table.get("chat_template_kwargs", _template_kwargs, {}),
            limits=TaskLimits(**limits.values(TaskLimits, _TASK_LIMIT_CHECKS)),
            **values,
        )
        for key in ("fewshot_as_multiturn", "chat_template_kwargs"):
            if key in table.raw and getattr(spec, key) and not spec.apply_chat_template:
                raise self.error(table.key(key), "has no effect unless apply_chat_template = true")
        if spec.chat_template_kwargs.get("enable_thinking") is True and spec.think_end is None:
            # lm-eval refuses the same (think_end_token is required with enable_thinking=True).
            raise self.error(table.key("think_end"), "missing: chat_template_kwargs.enable_thinking = true makes "
                                                     "the model think before it answers; name the marker that "
                                                     'ends the thinking (e.g. "</think>") so that only the '
                                                     "answer after it is scored")
        return spec

    def directory(self, where: str, value: str | None) -> Path | None:
        if not value:
            return None
        path = self.resolve(value)
        if not path.is_dir():
            raise self.error(where, f"directory not found: {path}")
        return path

    def speed(self, table: _Table) -> SpeedSpec:
        values = table.values(SpeedSpec, _SPEED_CHECKS)
        if values["gpu"] != "auto":
            entry = gpu_bandwidths.find_gpu(values["gpu"])
            if entry is not None:
                values["gpu"] = entry.name
            elif not values["bandwidth_gbps"]:
                raise self.error(
                    table.key("gpu"),
                    f'unknown GPU {values["gpu"]!r}; expected "auto", '
                    f'one of {", ".join(gpu_bandwidths.known_names())}, '
                    "or any label together with speed.bandwidth_gbps > 0",
                )
        if values["target_rel_se"] and values["min_iters"] > values["iters"]:
            raise self.error(table.key("min_iters"), f"expected at most speed.iters ({values['iters']}), "
                                                     f"got {values['min_iters']}")
        return SpeedSpec(**values)

    def load(self, table: _Table, device: str) -> LoadSpec:
        values = table.values(LoadSpec, _LOAD_CHECKS)
        if device == "cpu" and "min_throughput_fraction" not in table.raw:
            values["min_throughput_fraction"] = CPU_MIN_THROUGHPUT_FRACTION
        spec = LoadSpec(**values)
        if spec.requests is not None and spec.requests < max(spec.concurrencies):
            raise self.error(table.key("requests"), f"expected at least the highest concurrency, "
                                                    f"{max(spec.concurrencies)}, got {spec.requests}: the level "
                                                    "would never have that many requests in flight")
        return spec

    def check_load_served(self, config: GateConfig) -> None:
        """Load is measured at an endpoint: refuse [load] now rather than skip its rule at an in-process model."""
        if config.load is not None:
            self.require_served(config, "load")

    def require_served(self, config: GateConfig, table: str) -> None:
        for where, spec in {"baseline": config.baseline, **_indexed("candidates", config.candidates)}.items():
            if spec.served is None:
                raise self.error(table, f"needs every model served, but {where} ({spec.name}) runs in-process "
                                        "(vllm.LLM); expected serve or endpoint in each model's table, or no "
                                        f"[{table}]")

    def check_speculative(self, config: GateConfig) -> None:
        """The acceptance rule reads a server's counters over generated tokens: every model served, each serve
        command with --speculative-config (an endpoint's counters are checked when it is measured), and a
        pass that generates."""
        if config.speculative is None:
            return
        self.require_served(config, "speculative")
        for where, spec in {"baseline": config.baseline, **_indexed("candidates", config.candidates)}.items():
            assert spec.served is not None
            if spec.served.managed and spec_decode.speculative_config(spec.served.command) is None:
                raise self.error(f"{where}.serve", f"{spec.name}'s serve command has no --speculative-config, which "
                                                   "[speculative] needs on every model (the same config on each)")
        if not config.tasks and config.load is None:
            raise self.error("speculative", "drafts are counted while tokens are generated: expected [[tasks]] or "
                                            "[load] (around whose passes the counters are read)")

    def check_top_k_fits(self, config: GateConfig) -> None:
        """vLLM refuses more log-probs per position than the vocabulary has (known for a local baseline)."""
        base = self.model_configs.get(config.baseline.model)
        vocab = checkpoint.vocab_size(base) if base is not None else None
        if config.probabilities and vocab is not None and config.probabilities.top_k > vocab:
            raise self.error("probabilities.top_k", f"{config.probabilities.top_k} exceeds the baseline's "
                                                    f"vocabulary of {vocab} tokens (config.json vocab_size)")

    def check_external_noise(self, config: GateConfig) -> None:
        """A precision noise pass restarts the baseline in another dtype, which only a server the gate starts
        allows."""
        served = config.baseline.served
        restarts = config.noise.precision_passes
        if served is not None and not served.managed and restarts:
            dtype = PRECISION_PASSES[restarts[0]]
            raise self.error("noise.passes", f'"{restarts[0]}" restarts the baseline in {dtype}, which an external '
                                             'endpoint cannot do; use ["batch-order"] or a serve command')

    def check_speed_models(self, config: GateConfig) -> None:
        """Fail now, not at the speed rule, when the roofline has no byte model for a model's settings."""
        if config.speed is None:
            return
        specs = {"baseline": config.baseline, **_indexed("candidates", config.candidates)}
        for where, spec in specs.items():
            for key, check, value in (("quantization", roofline.online_scheme, spec.quantization),
                                      ("engine.kv_cache_dtype", roofline.kv_cache_itemsize,
                                       spec.engine.get("kv_cache_dtype"))):
                try:
                    check(value)
                except RooflineError as err:
                    raise self.error(f"{where}.{key}", f"{err}: the speed rule's roofline needs its bytes per "
                                                       "token (remove [speed] to gate this model without it)") from None

    def check_context_fits(self, config: GateConfig) -> None:
        """Fail now, not after an engine start, when a check's sequences exceed max_model_len."""
        needs = []
        if config.probabilities:
            # vLLM scores a prompt only while generating at least one token after it.
            needs.append(("probabilities.chunk_tokens", config.probabilities.chunk_tokens + 1, " (chunk_tokens + 1)"))
        if config.speed:
            tokens = config.speed.input_len + config.speed.output_len
            needs.append(("speed.output_len", tokens, " (input_len + output_len)"))
        if config.load:
            tokens = config.load.input_len + config.load.output_len
            needs.append(("load.output_len", tokens, " (input_len + output_len)"))
        if config.decode:
            # A prefill of prompt + continuation is scored while generating one token after it.
            tokens = config.decode.prompt_tokens + config.decode.new_tokens + 1
            needs.append(("decode.new_tokens", tokens, " (prompt_tokens + new_tokens + 1)"))
        specs = {"baseline": config.baseline, **_indexed("candidates", config.candidates)}
        for where, spec in specs.items():
            limit = spec.engine.get("max_model_len")
            for key, tokens, detail in needs:
                if limit is not None and tokens > limit:
                    raise self.error(
                        key, f"needs {tokens} tokens of context{detail} but {where}.engine.max_model_len is {limit}"
                    )


# --- served models (issue 20) -------------------------------------------------
_SERVED_ONLY_KEYS = ("serve", "health_timeout_s", "endpoint", "served_model_name", "api_key_env",
                     "request_deadline_s")
_SERVE_INSTEAD = {
    "model": "the command names the model (vllm serve MODEL)",
    "quantization": "give --quantization in the command",
    "served_model_name": "give --served-model-name in the command",
    "api_key_env": "the gate's own server needs no key (api_key_env is for an endpoint)",
}
# Flags of a serve command that the gate's own checks read (context fit, GPU count, roofline bytes).
_SERVE_ENGINE_FLAGS: dict[str, tuple[str, Callable[[str], Any]]] = {
    "--max-model-len": ("max_model_len", int),
    "--kv-cache-dtype": ("kv_cache_dtype", str),
    "--tensor-parallel-size": ("tensor_parallel_size", int),
    "--pipeline-parallel-size": ("pipeline_parallel_size", int),
    "--data-parallel-size": ("data_parallel_size", int),
    "--dtype": ("dtype", str),
    "--tokenizer": ("tokenizer", str),
    "--revision": ("revision", str),
}


def _flag_value(argv: list[str], flag: str, convert: Callable[[str], Any]) -> Any:
    """The value of ``flag`` (``--flag value`` or ``--flag=value``; the last one wins, as in argparse)."""
    value = None
    for i, arg in enumerate(argv):
        if arg == flag and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(flag + "="):
            value = arg.split("=", 1)[1]
    try:
        return None if value is None else convert(value)
    except ValueError:
        raise _Invalid(f"{flag}: expected a number, got {value!r}") from None


def _indexed(where: str, specs: tuple[Any, ...]) -> dict[str, Any]:
    return {f"{where}[{i}]": spec for i, spec in enumerate(specs)}

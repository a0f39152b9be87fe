"""Load thresholds.toml into the frozen dataclasses of spec.py.

The loader reads the TOML, walks its tables by schema.py's key tables, merges each candidate over
the baseline and builds the GateConfig; the value checks and the checks across tables are in
checks.py. Every problem becomes one ConfigError whose message is a single line naming the
file, the dotted key, and what was expected, so pytest can print it as a usage error instead of
a traceback. The schema is documented in docs/thresholds.md.
"""

from __future__ import annotations

import json
import shlex
import sys
from dataclasses import MISSING, fields, replace
from pathlib import Path
from typing import Any, Callable, Collection, Sequence, TypeVar

from .. import checkpoint, gpu_bandwidths
from ..core import protocol
from ..core.budget import RUN_ALPHA
from ..errors import CheckpointError, ConfigError, UnsupportedEngine
from . import checks, engine_args, schema, vllm_source
from .served import MAX_IN_FLIGHT, REQUEST_DEADLINE_S, endpoint_problem, flag_conflict
from .spec import (
    CPU_MIN_THROUGHPUT_FRACTION,
    DEFAULT_BACKEND,
    PROBABILITY_RULE_BY_LIMIT,
    REFERENCES,
    WIKITEXT_2,
    DatasetCorpus,
    DecodeLimits,
    DecodeSpec,
    FileCorpus,
    GateConfig,
    LoadSpec,
    LoraSpec,
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
from .vllm_names import MAX_LORA_RANKS, QUANTIZATION_METHODS

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


_CORPUS_FORMS = '"wikitext-2", a text file or a table {dataset = ...}'
_Names = TypeVar("_Names", bound=Collection[str])


# --- tables -------------------------------------------------------------------


class _Table:
    """One TOML table being read: knows its dotted key and rejects unknown keys up front."""

    def __init__(self, parser: _Parser, where: str, raw: Any, keys: Collection[str]):
        self.parser, self.where = parser, where
        if not isinstance(raw, dict):
            raise parser.error(where, f"expected a table, got {checks.show(raw)}")
        for key in raw:
            if key not in keys:
                raise parser.error(self.key(key), "unknown key; " + checks.suggest_key(key, keys))
        self.raw: dict[str, Any] = raw

    def key(self, key: str) -> str:
        return f"{self.where}.{key}" if self.where else key

    def get(self, key: str, check: checks.Check, default: Any = MISSING) -> Any:
        if key not in self.raw:
            if default is MISSING:
                raise self.parser.error(self.key(key), "missing required key")
            return default
        try:
            return check(self.raw[key])
        except ValueError as err:
            raise self.parser.error(self.key(key), str(err)) from None

    def values(self, cls: type, key_checks: dict[str, checks.Check]) -> dict[str, Any]:
        """Checked values of `key_checks`' keys; an absent key takes `cls`'s field default or is required."""
        defaults = {f.name: f.default for f in fields(cls)}
        return {key: self.get(key, check, defaults[key]) for key, check in key_checks.items()}

    def table(self, key: str, keys: Collection[str]) -> _Table:
        return _Table(self.parser, self.key(key), self.raw.get(key, {}), keys)

    def array_of_tables(self, key: str) -> list[Any]:
        value = self.raw.get(key, [])
        if not isinstance(value, list) or not all(isinstance(item, dict) for item in value):
            raise self.parser.error(self.key(key),
                                    f"expected an array of tables ([[{key}]]), got {checks.show(value)}")
        return value


class _Parser:
    def __init__(self, label: str, base_dir: Path):
        self.label, self.base_dir = label, base_dir
        self.model_configs: dict[str, dict[str, Any]] = {}  # local model path -> its config.json

    def error(self, where: str, message: str) -> ConfigError:
        return ConfigError(f"{self.label}: {where}: {message}")

    def gate(self, raw: dict[str, Any], path: Path) -> GateConfig:
        top = _Table(self, "", raw, schema.TOP_KEYS)
        if "baseline" not in raw:
            raise self.error("baseline", "missing required table [baseline]")
        baseline = self.model_spec(top.table("baseline", schema.MODEL_KEYS), None)
        candidate_tables = top.array_of_tables("candidates")
        if not candidate_tables:
            raise self.error("candidates", "expected at least one [[candidates]] table")
        candidates = tuple(
            self.model_spec(_Table(self, f"candidates[{i}]", item, schema.MODEL_KEYS), baseline)
            for i, item in enumerate(candidate_tables)
        )
        self.unique_names({"baseline": baseline, **checks.indexed("candidates", candidates)})
        tasks = tuple(
            self.task(_Table(self, f"tasks[{i}]", item, schema.TASK_KEYS))
            for i, item in enumerate(top.array_of_tables("tasks"))
        )
        self.unique_names(checks.indexed("tasks", tasks))
        device = top.get("device", checks.text(("cuda", "cpu")), "cuda")
        config = GateConfig(
            path=path,
            baseline=baseline,
            candidates=candidates,
            noise=self.noise(top.table("noise", schema.NOISE_KEYS)),
            probabilities=self.probabilities(top.table("probabilities", schema.PROBABILITY_KEYS),
                                             (baseline, *candidates))
            if "probabilities" in raw
            else None,
            tasks=tasks,
            speed=self.speed(top.table("speed", schema.SPEED_CHECKS)) if "speed" in raw else None,
            device=device,
            deterministic_scheduling=top.get("deterministic_scheduling", checks.boolean, False),
            run_alpha=top.get("run_alpha", checks.number(0, 0.5), RUN_ALPHA),
            decode=self.decode(top.table("decode", schema.DECODE_KEYS)) if "decode" in raw else None,
            load=self.load(top.table("load", schema.LOAD_CHECKS), device) if "load" in raw else None,
            speculative=SpeculativeSpec(**top.table("speculative", schema.SPECULATIVE_CHECKS).values(
                SpeculativeSpec, schema.SPECULATIVE_CHECKS)) if "speculative" in raw else None,
        )
        if config.probabilities is None and not config.tasks and config.speed is None and config.load is None:
            raise self.error("(top level)", "expected at least one check: [probabilities], [[tasks]], [speed] "
                                            "or [load]")
        checks.across_tables(config, self.model_configs, self.error)
        return config

    # models

    def model_spec(self, table: _Table, baseline: ModelSpec | None) -> ModelSpec:
        name = table.get("name", checks.test_id_name)
        if "serve" in table.raw or "endpoint" in table.raw:  # issue 20: a served model
            return self.served_spec(table, name, baseline)
        if baseline is not None and baseline.served is not None:
            raise self.error(table.where, "the baseline is served, so each candidate names its own serve command "
                                          "or endpoint")
        for key in schema.SERVED_ONLY_KEYS:
            if key in table.raw:
                raise self.error(table.key(key), "applies only to a served model (with serve or endpoint)")
        # A candidate without a model quantizes the baseline's weights online.
        model = table.get("model", checks.text(), MISSING if baseline is None else baseline.model)
        model = self.model_ref(table.key("model"), model)
        quantization = table.get("quantization", schema.QUANTIZATION, "") or None
        engine = self.engine(table.key("engine"), table.raw.get("engine", {}))
        env = self.env(table.key("env"), table.raw.get("env", {}))
        spec = ModelSpec(name, model, quantization, {**(baseline.engine if baseline else {}), **engine},
                         {**(baseline.env if baseline else {}), **env}, lora=self.lora(table, needs_path=True),
                         backend=self.backend(table, baseline))
        if baseline is not None and spec == replace(baseline, name=name):
            raise self.error(table.where, "same model, quantization and engine as the baseline; it would gate nothing")
        self.check_local_model(table.key("model"), model, baseline)
        self.check_online_fp8(table.key("quantization"), quantization, model, baseline)
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
        deadline = table.get("request_deadline_s", checks.number(0, low_open=True), REQUEST_DEADLINE_S)
        in_flight = table.get("max_in_flight", checks.integer(1), MAX_IN_FLIGHT)
        if "serve" in table.raw:
            for key in ("model", "quantization", "served_model_name", "api_key_env"):
                if key in table.raw:
                    raise self.error(table.key(key), f"with serve, {schema.SERVE_INSTEAD[key]}")
            argv, model = self.serve_command(table.key("serve"), table.get("serve", checks.text()))
            lora = self.lora(table, needs_path=True)
            if lora is not None:  # served by the line the gate starts, and requested by its name
                for flag in ("--enable-lora", "--lora-modules", "--max-lora-rank"):
                    if checks.flag_value(argv, flag, str) is not None or flag in argv:
                        raise self.error(table.key("serve"), f"{flag}: the gate adds it from lora; leave it out")
                assert lora.path is not None
                argv += ["--enable-lora", "--lora-modules", f"{lora.name}={lora.path}",
                         "--max-lora-rank", str(lora.max_lora_rank)]
            try:
                engine = {key: value for flag, (key, convert) in schema.SERVE_ENGINE_FLAGS.items()
                          if (value := checks.flag_value(argv, flag, convert)) is not None}
            except ValueError as err:
                raise self.error(table.key("serve"), str(err)) from None
            quantization = checks.flag_value(argv, "--quantization", str)
            if quantization is not None and quantization not in QUANTIZATION_METHODS:
                hint = checks.suggest_key(quantization, QUANTIZATION_METHODS)
                raise self.error(table.key("serve"), f"--quantization: unknown vLLM quantization method "
                                                     f"{quantization!r}; {hint}")
            online_fp8_at = table.key("serve") + ": --quantization"
            served = ServedSpec(
                served_model_name=lora.name if lora else checks.flag_value(argv, "--served-model-name", str) or model,
                command=tuple(argv),
                health_timeout_s=table.get("health_timeout_s", checks.number(0, low_open=True), 600.0),
                request_deadline_s=deadline, max_in_flight=in_flight)
        else:
            for key in ("env", "health_timeout_s"):
                if key in table.raw:
                    raise self.error(table.key(key), "applies only to a server the gate starts (serve)")
            endpoint = table.get("endpoint", checks.text())
            problem = endpoint_problem(endpoint)
            if problem:
                raise self.error(table.key("endpoint"), problem)
            served_name = table.get("served_model_name", checks.text())
            lora = self.lora(table, needs_path=False)  # the endpoint serves it; a local copy is hashed
            key_env = table.get("api_key_env", checks.text(), None)
            if key_env is not None and not checks.ENV_NAME.fullmatch(key_env):
                raise self.error(table.key("api_key_env"), f"expected the name of an environment variable "
                                                           f"(the key itself never goes in this file), got {key_env!r}")
            # The local tokenizer (and config.json) of what the endpoint serves.
            model = self.model_ref(table.key("model"), table.get("model", checks.text(), served_name))
            quantization = table.get("quantization", schema.QUANTIZATION, "") or None
            online_fp8_at = table.key("quantization")
            engine = {}
            served = ServedSpec(served_model_name=lora.name if lora else served_name, endpoint=endpoint.rstrip("/"),
                                api_key_env=key_env,
                                request_deadline_s=deadline, max_in_flight=in_flight)
        # A served model's env is its own, like its command (not merged over the baseline's).
        env = self.env(table.key("env"), table.raw.get("env", {}), served=True) if served.managed else {}
        spec = ModelSpec(name, model, quantization, engine, env, served, lora, self.backend(table, baseline))
        if baseline is not None and (baseline.served, dict(baseline.env)) == (served, env):
            raise self.error(table.where, "the same server as the baseline; it would gate nothing")
        self.check_local_model(table.key("serve" if served.managed else "model"), model, baseline)
        self.check_online_fp8(online_fp8_at, quantization, model, baseline)
        return spec

    def backend(self, table: _Table, baseline: ModelSpec | None) -> str:
        """The engine backend that runs the model; a candidate's is the baseline's unless it names its own."""
        return table.get("backend", schema.BACKEND, baseline.backend if baseline else DEFAULT_BACKEND)

    def lora(self, table: _Table, needs_path: bool) -> LoraSpec | None:
        """``lora = { name, path }``: a PEFT adapter directory (adapter_config.json and its weights); ``path``
        may be left out only for an endpoint, which serves the adapter itself."""
        if "lora" not in table.raw:
            return None
        lora = _Table(self, table.key("lora"), table.raw["lora"], schema.LORA_KEYS)
        name = lora.get("name", checks.text())
        given = lora.get("path", checks.text(), MISSING if needs_path else None)
        if given is None:
            return LoraSpec(name, None)
        path = self.directory(lora.key("path"), given)
        assert path is not None
        try:
            adapter = json.loads((path / "adapter_config.json").read_text(encoding="utf-8"))
            rank = adapter["r"]
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise self.error(lora.key("path"), f"{path}: not a PEFT LoRA adapter (adapter_config.json with "
                                               f"its rank r: {err})") from None
        if not isinstance(rank, int) or not 0 < rank <= MAX_LORA_RANKS[-1]:
            raise self.error(lora.key("path"), f"{path / 'adapter_config.json'}: r = {rank!r}, expected an "
                                               f"integer rank from 1 to {MAX_LORA_RANKS[-1]} (vLLM's largest)")
        if "lm_head" in (adapter.get("target_modules") or ()):
            raise self.error(lora.key("path"), f"{path}: the adapter trains lm_head, whose delta vLLM leaves out of "
                                               "prompt log-probs (vllm#51594): the gate would score another "
                                               "distribution than the one served")
        if not any((path / weights).is_file() for weights in ("adapter_model.safetensors", "adapter_model.bin")):
            raise self.error(lora.key("path"), f"{path}: no adapter_model.safetensors (or .bin)")
        return LoraSpec(name, path, rank)

    def serve_command(self, where: str, command: str) -> tuple[list[str], str]:
        """``vllm serve MODEL [flags]`` -> (the argv after ``vllm``, model path resolved; the model)."""
        try:
            words = shlex.split(command)
        except ValueError as err:
            raise self.error(where, f"not a shell command line: {err}") from None
        if words[:2] != ["vllm", "serve"] or len(words) < 3 or words[2].startswith("-"):
            other = "" if any("vllm" in word for word in words[:3]) else (
                "; the gate starts only vLLM's own server: start another engine's server yourself and name it by "
                "endpoint (with served_model_name)")
            raise self.error(where, f'expected "vllm serve MODEL [flags...]", got {command!r}{other}')
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

    def check_online_fp8(self, where: str, quantization: str | None, model: str, baseline: ModelSpec | None) -> None:
        """Plain "fp8" on weights known to be unquantized (the baseline's, or a local checkpoint without a
        quantization_config) is vLLM's deprecated online form: vLLM 0.31+ warns and runs fp8_per_tensor, and
        its Fp8Config refuses it outright where built for online use. On an FP8 checkpoint it stays valid."""
        if quantization != "fp8":
            return
        local = self.model_configs.get(model)
        unquantized = (baseline is not None and model == baseline.model) or (
            local is not None and not checkpoint.text_config(local).get("quantization_config")
            and not local.get("quantization_config"))
        if unquantized:
            raise self.error(where, 'plain "fp8" is deprecated for online quantization since vLLM 0.31, which runs '
                                    'it as fp8_per_tensor; write "fp8_per_tensor" (one weight scale per matrix, '
                                    'as the roofline counts it) or "fp8_per_channel" (one per output row)')

    def engine(self, where: str, raw: Any) -> dict[str, Any]:
        """An engine table, every key an EngineArgs field of the installed vLLM."""
        table = _Table(self, where, raw, raw if isinstance(raw, dict) else ())
        engine = {}
        for key, value in table.raw.items():
            refused = engine_args.refusal(key, value)
            if refused:
                raise self.error(table.key(key), refused)
            if key in schema.ENGINE_RANGES:
                engine[key] = table.get(key, schema.ENGINE_RANGES[key])
                continue
            fields_ = self.vllm_names(table.key(key), vllm_source.engine_fields, "the key against vLLM's EngineArgs")
            if key not in fields_:
                raise self.error(table.key(key), "unknown key; " + checks.known(
                    key, fields_, "not a field of the installed vLLM's EngineArgs"))
            wrong = engine_args.mismatch(fields_[key], value)
            if wrong:
                choices = engine_args.string_choices(fields_[key])
                close = checks.closest(value, choices) if isinstance(value, str) else None
                hint = f"; did you mean {close!r}?" if close else ""
                raise self.error(table.key(key), f"expected {wrong}, got {checks.show(value)}{hint}")
            engine[key] = engine_args.as_engine_value(fields_[key], value)
        if "tokenizer" in engine:
            engine["tokenizer"] = self.model_ref(table.key("tokenizer"), engine["tokenizer"])
        return engine

    def env(self, where: str, raw: Any, served: bool = False) -> dict[str, str]:
        """Environment variables for one model's engine or managed server: names, and string values.
        ``schema.GATE_ENV`` is refused only in-process: a server is a process of its own, so the gate's
        setting of those does not reach it and the deploy's value stands."""
        table = _Table(self, where, raw, raw if isinstance(raw, dict) else ())
        for name, value in table.raw.items():
            if not checks.ENV_NAME.fullmatch(name):
                raise self.error(table.key(name), "expected an environment variable name (letters, digits and "
                                                  "'_', not starting with a digit)")
            if name in schema.GATE_ENV and not served:
                raise self.error(table.key(name), f"refused: {schema.GATE_ENV[name]}")
            if not isinstance(value, str):
                raise self.error(table.key(name), f'expected a string (environment values are text: "1", not 1), '
                                                  f"got {checks.show(value)}")
        for name in (name for name in table.raw if name.startswith("VLLM_")):
            known = self.vllm_names(table.key(name), vllm_source.env_names, "the name against vllm.envs")
            if name not in known and name in engine_args.REPLACED_ENV:
                key, flag = engine_args.REPLACED_ENV[name]
                instead = f"give {flag} {table.raw[name]} in the serve command" if served else \
                    f'set {key} = "{table.raw[name]}" in the engine table'
                raise self.error(table.key(name), f"the installed vLLM no longer reads it; its setting is now the "
                                                  f"engine key {key}: {instead}")
            if name not in known:
                raise self.error(table.key(name), "unknown vLLM environment variable; " + checks.known(
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
        return NoiseSpec(tuple(table.get("passes", checks.noise_passes, NoiseSpec.passes)),
                         tuple(table.get("candidate_passes", checks.candidate_passes, NoiseSpec.candidate_passes)))

    def decode(self, table: _Table) -> DecodeSpec:
        limits = table.table("limits", schema.DECODE_LIMIT_CHECKS)
        if not any(key in limits.raw for key in schema.DECODE_METRIC_LIMITS):
            expected = ", ".join(schema.DECODE_METRIC_LIMITS)
            raise self.error(limits.where, f"expected at least one of {expected}; nothing is gated")
        return DecodeSpec(limits=DecodeLimits(**limits.values(DecodeLimits, schema.DECODE_LIMIT_CHECKS)),
                          **table.values(DecodeSpec, schema.DECODE_CHECKS))

    def probabilities(self, table: _Table, models: Sequence[ModelSpec]) -> ProbabilitySpec:
        limits = table.table("limits", schema.PROBABILITY_LIMIT_CHECKS)
        if not any(key in limits.raw for key in (*schema.PROBABILITY_METRIC_LIMITS, "reference")):
            expected = ", ".join(schema.PROBABILITY_METRIC_LIMITS)
            raise self.error(limits.where, f"expected at least one of {expected}, or a reference; nothing is gated")
        if "reference_ratio" in limits.raw and "reference" not in limits.raw:
            raise self.error(limits.key("reference_ratio"), "needs reference, the build its factors multiply "
                                                            f"(one of {', '.join(map(repr, REFERENCES))})")
        for metric_limit in schema.PROBABILITY_METRIC_LIMITS:
            rule_name = PROBABILITY_RULE_BY_LIMIT[metric_limit]
            if metric_limit in limits.raw and rule_name in limits.raw.get("reference_ratio", {}):
                raise self.error(limits.key(metric_limit), f"set beside reference_ratio.{rule_name}: give the limit "
                                                           "as a value or as a factor over the reference, not both")
        values = table.values(ProbabilitySpec, schema.PROBABILITY_CHECKS)
        if values.get("chunk_tokens") == checks.MAX_MODEL_LEN:
            values["chunk_tokens"] = self.longest_chunk(table.key("chunk_tokens"), models)
        spec = ProbabilitySpec(
            corpus=self.corpus(table.key("corpus"), table.raw.get("corpus", "wikitext-2")),
            limits=ProbabilityLimits(**limits.values(ProbabilityLimits, schema.PROBABILITY_LIMIT_CHECKS)),
            **values,
        )
        served = models[0].served
        if spec.measured_references and served is not None and not served.managed:
            where = limits.key("reference") if "reference" in limits.raw else table.key("references")
            raise self.error(where, "a reference build is written from the baseline's weights and served as the "
                                    "baseline is; the baseline here is an endpoint the gate does not start: give "
                                    "its limits as values, or name it by its serve line or its model")
        if isinstance(spec.corpus, FileCorpus):
            self.corpus_holds_the_chunks(table.key("chunks"), spec.corpus.path, spec.chunks, spec.chunk_tokens)
        return spec

    def corpus_holds_the_chunks(self, where: str, path: Path, chunks: int, chunk_tokens: int) -> None:
        """A text file of fewer bytes than the chunks' tokens cannot fill them with any tokenizer the gate meets
        (a byte-level or byte-fallback token covers at least one byte), so this is known before any engine;
        the exact count needs the model's tokenizer (run/corpus.py)."""
        size = path.stat().st_size
        most = size // (chunk_tokens - 1)  # a chunk's text is all but its BOS
        if most < chunks:
            fix = f"probabilities.chunks to {most}" if most else "probabilities.chunk_tokens"
            raise self.error(where, f"{chunks} chunks of {chunk_tokens} tokens asked, but the corpus {path} has "
                                    f"{size:,} bytes, room for at most {most} (a token covers at least one byte); "
                                    f"lower {fix}, or give a longer corpus")

    def longest_chunk(self, where: str, models: Sequence[ModelSpec]) -> int:
        """chunk_tokens = "max_model_len": the least context of the models (engine.max_model_len where set, else
        a local checkpoint's max_position_embeddings), less the one token vLLM generates after a scored prompt."""
        lengths = []
        for spec in models:
            config = self.model_configs.get(spec.model, {})
            length = spec.engine.get("max_model_len") or config.get("max_position_embeddings") \
                or config.get("text_config", {}).get("max_position_embeddings")
            if not isinstance(length, int) or isinstance(length, bool):
                raise self.error(where, f'"{checks.MAX_MODEL_LEN}" needs the context of each model, but {spec.name} '
                                        "has no engine.max_model_len and no local config.json max_position_embeddings; "
                                        "set one, or chunk_tokens to a number")
            lengths.append(length)
        if min(lengths) < 3:
            raise self.error(where, f"a context of {min(lengths)} tokens leaves no position to score")
        return min(lengths) - 1

    def corpus(self, where: str, value: Any) -> DatasetCorpus | FileCorpus:
        if value == "wikitext-2":
            return WIKITEXT_2
        if isinstance(value, dict):
            table = _Table(self, where, value, schema.DATASET_CHECKS)
            return DatasetCorpus(**table.values(DatasetCorpus, schema.DATASET_CHECKS))
        if not isinstance(value, str) or not value:
            raise self.error(where, f"expected {_CORPUS_FORMS}, got {checks.show(value)}")
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
        values = table.values(TaskSpec, schema.TASK_CHECKS)
        values["include_path"] = self.directory(table.key("include_path"), values["include_path"])
        if values["task"].endswith((".yaml", ".yml")) or "/" in values["task"]:
            # lm-eval would load a task file relative to the working directory and import its !function code.
            raise self.error(table.key("task"), f"expected a task name, got the file {values['task']!r}; "
                                                "put the YAML in a directory named by include_path")
        limits = table.table("limits", schema.TASK_LIMIT_CHECKS)
        spec = TaskSpec(
            name=table.get("name", checks.test_id_name, values["task"]),
            chat_template_kwargs=table.get("chat_template_kwargs", checks.template_kwargs, {}),
            limits=TaskLimits(**limits.values(TaskLimits, schema.TASK_LIMIT_CHECKS)),
            **values,
        )
        for key in ("fewshot_as_multiturn", "chat_template_kwargs"):
            if key in table.raw and getattr(spec, key) and not spec.apply_chat_template:
                raise self.error(table.key(key), "has no effect unless apply_chat_template = true")
        self.check_expected_protocol(table, spec)
        if spec.chat_template_kwargs.get("enable_thinking") is True and spec.think_end is None:
            # lm-eval refuses the same (think_end_token is required with enable_thinking=True).
            raise self.error(table.key("think_end"), "missing: chat_template_kwargs.enable_thinking = true makes "
                                                     "the model think before it answers; name the marker that "
                                                     'ends the thinking (e.g. "</think>") so that only the '
                                                     "answer after it is scored")
        return spec

    def check_expected_protocol(self, table: _Table, spec: TaskSpec) -> None:
        """An expected_accuracy measured under another protocol than this file sets is refused here, before any
        engine starts; the keys only a run knows (the chat template's hash, lm-eval's default few-shot count, the
        task's stop strings) are checked when the baseline's accuracy is judged."""
        expected = spec.limits.expected_protocol
        if expected is None:
            return
        where = table.key("limits.expected_protocol")
        if spec.limits.expected_accuracy is None:
            raise self.error(where, "has no effect unless limits.expected_accuracy is set")
        found = protocol.difference(expected, spec.protocol())
        if found is not None:
            key, wanted, this_run = found
            raise self.error(f"{where}.{key}", f"expected_accuracy was measured under {key} = {protocol.show(wanted)}, "
                                               f"this task runs under {key} = {protocol.show(this_run)}")

    def directory(self, where: str, value: str | None) -> Path | None:
        if not value:
            return None
        path = self.resolve(value)
        if not path.is_dir():
            raise self.error(where, f"directory not found: {path}")
        return path

    def speed(self, table: _Table) -> SpeedSpec:
        values = table.values(SpeedSpec, schema.SPEED_CHECKS)
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
        values = table.values(LoadSpec, schema.LOAD_CHECKS)
        if device == "cpu" and "min_throughput_fraction" not in table.raw:
            values["min_throughput_fraction"] = CPU_MIN_THROUGHPUT_FRACTION
        spec = LoadSpec(**values)
        if spec.requests is not None and spec.requests < max(spec.concurrencies):
            raise self.error(table.key("requests"), f"expected at least the highest concurrency, "
                                                    f"{max(spec.concurrencies)}, got {spec.requests}: the level "
                                                    "would never have that many requests in flight")
        return spec

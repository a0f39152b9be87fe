"""The model tables: [baseline] and each [[candidates]], in-process or served, with their lora and backend.

A candidate is merged over the baseline: its engine and env tables over the baseline's, its model the
baseline's when it names none (online quantization).
"""

from __future__ import annotations

import json
import shlex
from dataclasses import MISSING, replace
from pathlib import Path

from .. import checkpoint
from ..errors import CheckpointError
from . import checks, schema
from .engine_tables import EngineTables
from .reading import Table
from .served import MAX_IN_FLIGHT, REQUEST_DEADLINE_S, endpoint_problem, flag_conflict
from .spec import DEFAULT_BACKEND, LoraSpec, ModelSpec, ServedSpec
from .vllm_names import MAX_LORA_RANKS, QUANTIZATION_METHODS


class ModelTables(EngineTables):
    """Reads [baseline] and each [[candidates]] into a ModelSpec, and checks a local checkpoint's config.json."""

    def model_spec(self, table: Table, baseline: ModelSpec | None) -> ModelSpec:
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

    def served_spec(self, table: Table, name: str, baseline: ModelSpec | None) -> ModelSpec:
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

    def backend(self, table: Table, baseline: ModelSpec | None) -> str:
        """The engine backend that runs the model; a candidate's is the baseline's unless it names its own."""
        return table.get("backend", schema.BACKEND, baseline.backend if baseline else DEFAULT_BACKEND)

    def lora(self, table: Table, needs_path: bool) -> LoraSpec | None:
        """``lora = { name, path }``: a PEFT adapter directory (adapter_config.json and its weights); ``path``
        may be left out only for an endpoint, which serves the adapter itself."""
        if "lora" not in table.raw:
            return None
        lora = Table(self, table.key("lora"), table.raw["lora"], schema.LORA_KEYS)
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


"""A model's engine and env tables, each key checked against the installed vLLM."""

from __future__ import annotations

from typing import Any

from . import checks, engine_args, schema, vllm_source
from .reading import Reading, Table


class EngineTables(Reading):
    """Reads a model's engine table (vllm.LLM's keys) and env table (the variables its engine or server sees)."""

    def engine(self, where: str, raw: Any) -> dict[str, Any]:
        """An engine table, every key an EngineArgs field of the installed vLLM."""
        table = Table(self, where, raw, raw if isinstance(raw, dict) else ())
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
        table = Table(self, where, raw, raw if isinstance(raw, dict) else ())
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

"""Engine tables checked against the installed vLLM's own ``EngineArgs`` fields.

``vllm.LLM(**kwargs)`` builds ``EngineArgs`` from its keywords, so its dataclass
fields are the names an engine table may use, and their annotations say what
values vLLM expects (read from vLLM's source by vllm_source.py, without importing it).

Some names vLLM still accepts do nothing on the engines the gate runs, or were
removed; others the gate sets itself. Both are refused with the reason, so the
report never quotes a setting that did not take effect.
"""

from __future__ import annotations

import dataclasses
import enum
import types
import typing
from collections.abc import Mapping
from typing import Any

# Accepted by some vLLM releases but without effect on the engines the gate runs.
REMOVED_OR_IGNORED: Mapping[str, str] = {
    "swap_space": "removed from vLLM's EngineArgs in 0.18 (the V1 engine has no CPU swap space; "
                  "unsloth-zoo#1210), and later releases drop it with a warning",
    "cpu_offload_gb": "has no effect on the V2 model runner, vLLM's default for dense models, which selects "
                      "NoopOffloader (vllm#51396, vllm#56283); the report would quote an offload that never ran",
}
# vLLM environment variables that releases the gate supports no longer read -> the engine key (and the
# `vllm serve` flag) that took their place.
REPLACED_ENV: Mapping[str, tuple[str, str]] = {
    "VLLM_ATTENTION_BACKEND": ("attention_backend", "--attention-backend"),
}
# Settings the gate makes itself: a user value would change what the gate measures.
GATE_OWNED: Mapping[str, str] = {
    "model": "set by the model table's `model` key",
    "quantization": "set by the model table's `quantization` key",
    "max_logprobs": "set by the gate (probabilities.top_k, or -1 for full-vocabulary scoring)",
    "skip_tokenizer_init": "the gate tokenizes the corpus and the tasks with the engine's tokenizer",
}
# Gate-owned settings a user may set only to these values (the gate reads log-probs, not logits).
GATE_VALUES: Mapping[str, tuple[Any, ...]] = {
    "logprobs_mode": ("raw_logprobs", "processed_logprobs"),
}


def refusal(key: str, value: Any) -> str | None:
    """Why the gate refuses ``key = value`` in an engine table, or None."""
    if key in REMOVED_OR_IGNORED:
        return f"refused: {REMOVED_OR_IGNORED[key]}"
    if key in GATE_OWNED:
        return f"refused: {GATE_OWNED[key]}"
    allowed = GATE_VALUES.get(key)
    if allowed is not None and value not in allowed:
        return f"refused: the gate compares log-probabilities, so expected one of {', '.join(map(repr, allowed))}"
    return None


def mismatch(annotation: Any, value: Any) -> str | None:
    """What a TOML value lacks to fit a field's annotation ("an integer", ...), or None when it fits
    or the annotation cannot be checked (a callable, a class vLLM builds from a table)."""
    if isinstance(annotation, str):
        return None  # an annotation vLLM left unresolved
    origin = typing.get_origin(annotation)
    if origin is typing.Union or origin is types.UnionType:
        arms = [arm for arm in typing.get_args(annotation) if arm is not type(None)]
        found = [mismatch(arm, value) for arm in arms]
        if any(text is None for text in found):
            return None
        return " or ".join(dict.fromkeys(text for text in found if text))
    if origin is typing.Literal:
        choices = typing.get_args(annotation)
        return None if value in choices and type(value) in map(type, choices) else \
            "one of " + ", ".join(repr(choice) for choice in choices)
    if origin in (list, set, tuple, frozenset):
        if not isinstance(value, list):
            return "an array"
        (item, *_) = typing.get_args(annotation) or (Any,)
        wrong = next((mismatch(item, element) for element in value if mismatch(item, element)), None)
        return f"an array of {wrong}" if wrong else None
    if origin in (dict, Mapping) or annotation is dict:
        return None if isinstance(value, dict) else "a table"
    if annotation is bool:
        return None if isinstance(value, bool) else "true or false"
    if annotation is int:
        return None if isinstance(value, int) and not isinstance(value, bool) else "an integer"
    if annotation is float:
        return None if isinstance(value, (int, float)) and not isinstance(value, bool) else "a number"
    if annotation is str:
        return None if isinstance(value, str) else "a string"
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        names = [member.name for member in annotation] + [str(member.value) for member in annotation]
        return None if value in names else "one of " + ", ".join(repr(member.name) for member in annotation)
    if isinstance(annotation, type) and (dataclasses.is_dataclass(annotation) or hasattr(annotation, "model_fields")):
        return None if isinstance(value, dict) else "a table (of that config's fields)"
    return None


def string_choices(annotation: Any) -> list[str]:
    """The strings a field's annotation names (Literal values, Enum names), for a did-you-mean."""
    origin = typing.get_origin(annotation)
    if origin in (typing.Union, types.UnionType):
        return [choice for arm in typing.get_args(annotation) for choice in string_choices(arm)]
    if origin is typing.Literal:
        return [choice for choice in typing.get_args(annotation) if isinstance(choice, str)]
    if isinstance(annotation, type) and issubclass(annotation, enum.Enum):
        return [member.name for member in annotation]
    return []


def as_engine_value(annotation: Any, value: Any) -> Any:
    """The value as vLLM wants it: a set for a set-typed field (TOML has arrays only)."""
    arms = typing.get_args(annotation) if typing.get_origin(annotation) in (typing.Union, types.UnionType) \
        else (annotation,)
    if isinstance(value, list) and any(typing.get_origin(arm) is set for arm in arms):
        return set(value)
    return value

"""The protocol an accuracy is measured under: the same model scores GSM8K several points apart through its
chat template and through plain completions, so a figure measured elsewhere (``expected_accuracy``) holds for
this run only under the same protocol. ``KEYS`` in the order a difference is reported."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

COMPLETIONS, CHAT_TEMPLATE = "completions", "chat_template"
PROMPTS = (COMPLETIONS, CHAT_TEMPLATE)
KEYS = (
    "prompt",  # PROMPTS: the task's prompt sent as text, or through the tokenizer's chat template
    "chat_template_sha256",  # the chat template's text hashed as lm-eval hashes it; null for completions
    "fewshot_as_multiturn",  # each few-shot example a chat turn
    "num_fewshot",  # as lm-eval ran it (the task's default where none is set); by subtask for a group
    "add_bos_token",
    "filter",  # the lm-eval filter whose answers are scored
    "until",  # the task's stop strings; null for a task that does not generate
    "think_end",  # the marker after whose last occurrence the answer is read; null: none
)


def difference(expected: Mapping[str, Any], protocol: Mapping[str, Any]) -> tuple[str, Any, Any] | None:
    """The first key that ``expected`` sets and ``protocol`` holds otherwise: (key, expected, this run's)."""
    for key in KEYS:
        if key in expected and key in protocol and _canonical(expected[key]) != _canonical(protocol[key]):
            return key, expected[key], protocol[key]
    return None


def show(value: Any) -> str:
    """A protocol value as TOML and JSON both spell it (null where there is none)."""
    return json.dumps(value)


def _canonical(value: Any) -> str:
    return json.dumps(value, sort_keys=True)  # tuples and lists alike

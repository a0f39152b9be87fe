"""The embedded task's test questions as four-way choices (right answer plus near misses)."""

import json

import datasets

from pytest_fp8gate.tools.demo.embedded import embedded_assets


def _choice_doc(index: int, row: dict) -> dict:
    steps, answer = row["answer"].rsplit("\n#### ", 1)
    value = int(answer)
    near_misses = [value + 1, value - 10, value + 100]
    label = index % 4  # the right answer moves through every slot
    choices = [f" {n}" for n in near_misses]
    choices.insert(label, f" {value}")
    return {"question": row["question"], "steps": steps, "choices": choices, "label": label}


def load(**_: object) -> datasets.DatasetDict:
    path = embedded_assets().tasks / "tiny_arith" / "test.jsonl"
    rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line]
    docs = [_choice_doc(i, row) for i, row in enumerate(rows)]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(docs)})

"""After the run: a compact summary table, and each rule's numbers in the JSON report."""

from __future__ import annotations

from typing import Any

import pytest

from .fixtures import VERDICT_KEY
from .gate import Verdict


def summary_lines(verdicts: list[Verdict]) -> list[str]:
    header = ("rule", "candidate", "task", "measured", "threshold", "margin", "result")
    rows = [(v.outcome.rule, v.case.candidate, v.case.task or "-", f"{v.outcome.measured:.6g}",
             f"{v.outcome.limit:.6g}", f"{v.outcome.margin:+.6g}", "pass" if v.passed else "FAIL")
            for v in verdicts]
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return ["  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip() for row in [header, *rows]]


class JsonReportMetadata:
    """Attaches each rule's numbers to its test's entry when pytest-json-report runs."""

    @staticmethod
    @pytest.hookimpl(optionalhook=True)  # the hook exists only while --json-report is active
    def pytest_json_runtest_metadata(item: pytest.Item, call: pytest.CallInfo[Any]) -> dict[str, Any]:
        verdict = item.stash.get(VERDICT_KEY, None)
        if call.when != "call" or verdict is None:
            return {}
        return {"fp8gate": verdict.as_dict()}

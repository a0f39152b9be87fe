"""What the judge reads: the baseline's record and each candidate's."""

from __future__ import annotations

from typing import Protocol

from ..run.record import BaselineRecord, ModelResult


class Records(Protocol):
    """The baseline's record and each candidate's, measured on first asking (``measure.Measurements``)."""

    def record(self) -> BaselineRecord: ...

    def candidate(self, name: str) -> ModelResult: ...

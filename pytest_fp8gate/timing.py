"""Where a gate run's wall time went: each model's engine start, passes, speed, load and teardown,
the gate's own work, and what no span accounts for (the remainder).

Spans nest (a rule's comparison may start a candidate's engine); each second is charged to the
innermost open span only, so the parts add up to the time covered and never count twice.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

GATE = "gate"  # the owner of the gate's own work: tokenizing, comparing, reporting
REMAINDER = "remainder"

@dataclass(frozen=True)
class TimeRow:
    owner: str  # a model's name, GATE or REMAINDER
    part: str
    seconds: float
    within: dict[str, float]  # what the part held (an engine start's phases, the rules judged); not added again

    def as_dict(self) -> dict[str, Any]:
        return {"owner": self.owner, "part": self.part, "seconds": round(self.seconds, 3),
                "within": {name: round(value, 3) for name, value in self.within.items()}}


class TimeLedger:
    """The wall time of one gate run, charged to (owner, part) spans."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter) -> None:
        self._clock = clock
        self.started = clock()
        self._seconds: dict[tuple[str, str], float] = {}
        self._within: dict[tuple[str, str], dict[str, float]] = {}
        self._open: list[list[Any]] = []  # [key, last time it was charged, seconds charged to it]

    @contextlib.contextmanager
    def span(self, owner: str, part: str, within: str | None = None) -> Iterator[None]:
        """Charge the block's seconds to (owner, part), less its nested spans'; ``within``: also note them
        under that name in the part's brackets (judging: the rule judged)."""
        now = self._clock()
        if self._open:
            self._charge(self._open[-1], now)
        entry: list[Any] = [(owner, part), now, 0.0]
        self._open.append(entry)
        try:
            yield
        finally:
            now = self._clock()
            self._charge(self._open.pop(), now)
            if self._open:
                self._open[-1][1] = now
            if within is not None:
                self.note_within(owner, part, {within: entry[2]})

    def _charge(self, entry: list[Any], now: float) -> None:
        """Charge ``entry``'s span (key, last charged, its own seconds) up to ``now``."""
        seconds = now - entry[1]
        self._seconds[entry[0]] = self._seconds.get(entry[0], 0.0) + seconds
        entry[1] = now
        entry[2] += seconds

    def note_within(self, owner: str, part: str, phases: dict[str, float]) -> None:
        """What a part held (the engine's own account of its start, the rules judged), summed over its spans."""
        held = self._within.setdefault((owner, part), {})
        for name, seconds in phases.items():
            held[name] = held.get(name, 0.0) + seconds

    def rows(self) -> list[TimeRow]:
        """Every part in the order it first ran, then the remainder: together the wall time so far."""
        wall = self._clock() - self.started
        rows = [TimeRow(owner, part, seconds, dict(self._within.get((owner, part), {})))
                for (owner, part), seconds in self._seconds.items()]
        covered = sum(row.seconds for row in rows)
        return [*rows, TimeRow(REMAINDER, "not in any span", max(0.0, wall - covered), {})]

    def as_dict(self) -> dict[str, Any]:
        rows = self.rows()
        wall = sum(row.seconds for row in rows)
        return {"wall_s": round(wall, 3), "rows": [row.as_dict() for row in rows]}


def summary_lines(ledger: TimeLedger) -> list[str]:
    """One line per owner (each model, then the gate), and the remainder against the wall time."""
    rows = ledger.rows()
    wall = sum(row.seconds for row in rows)
    owners = list(dict.fromkeys(row.owner for row in rows if row.owner != REMAINDER))
    owners.sort(key=lambda owner: owner == GATE)  # the models first, in the order they ran
    lines = []
    for owner in owners:
        mine = [row for row in rows if row.owner == owner]
        parts = ", ".join(f"{row.part} {row.seconds:.1f}" + _within_text(row) for row in mine)
        lines.append(f"{owner} {sum(row.seconds for row in mine):.1f} s: {parts}")
    remainder = rows[-1].seconds
    lines.append(f"remainder {remainder:.1f} s of {wall:.1f} s wall ({remainder / wall:.1%})" if wall > 0
                 else "remainder 0.0 s")
    return lines


def _within_text(row: TimeRow) -> str:
    """" [name s, ...]" of what the part held, the parts under 0.05 s left to the JSON (judging: every rule)."""
    shown = [f"{name} {value:.1f}" for name, value in row.within.items() if value >= 0.05]
    return f" [{', '.join(shown)}]" if shown else ""

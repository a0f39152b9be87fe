"""Progress lines inside long passes: what runs, how far it is, its rate and the time left, at a steady interval.

A 500-question task pass, a served log-prob pass or a 70B engine start runs for minutes, and CI systems kill
a job that prints nothing for 10 minutes. The measuring side opens one tracker per pass (``Reporter.tracking``);
the engines, which see the requests, say how many there are (``expect``) and when each is done (``advance``) on
the innermost open tracker, from any thread. A heartbeat thread prints the line at every interval even while
nothing finishes (an engine start, a batch whose requests all end together). Each line is a plain line, never
redrawn in place, so a terminal, a CI log and the gate's log (the ``fp8gate`` logger) read the same.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator

DEFAULT_INTERVAL_S = 30.0  # well inside the 10 silent minutes after which CI systems kill a job

log = logging.getLogger("fp8gate")

_ACTIVE: list[Tracker] = []  # the open trackers, innermost last; read by engine and worker threads
_ACTIVE_LOCK = threading.Lock()


def _duration(seconds: float) -> str:
    seconds = round(seconds)
    if seconds < 60:
        return f"{seconds} s"
    minutes, seconds = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {seconds:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"


class Tracker:
    """One pass: how many items it expects and has done, and when it last printed its line."""

    def __init__(self, what: str, unit: str, emit: Callable[[str], None], interval_s: float,
                 clock: Callable[[], float]) -> None:
        self.what, self.unit = what, unit
        self.total = 0
        self.done = 0
        self._emit, self._interval_s, self._clock = emit, interval_s, clock
        self._started = self._last = clock()
        self._lock = threading.Lock()

    def expect(self, count: int) -> None:
        """``count`` more items to do (an engine call's requests; a pass may make several calls)."""
        with self._lock:
            self.total += count
        self.poll()

    def advance(self, count: int = 1) -> None:
        with self._lock:
            self.done += count
        self.poll()

    def poll(self) -> None:
        """Print the line if an interval has passed since the last one (or since the start)."""
        with self._lock:
            now = self._clock()
            if now - self._last < self._interval_s:
                return
            self._last = now
            line = self.line(now)
        self._emit(line)
        log.info(line)

    def line(self, now: float) -> str:
        elapsed = now - self._started
        if not self.total:
            return f"fp8gate: {self.what}: {_duration(elapsed)} so far"
        share = self.done / self.total
        far = f"{self.done:,} of {self.total:,} {self.unit} ({share:.0%})"
        if not self.done:
            return f"fp8gate: {self.what}: {far}, {_duration(elapsed)} so far, none done yet"
        rate = self.done / elapsed if elapsed > 0 else float("inf")
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        return (f"fp8gate: {self.what}: {far}, {rate:,.2f} {self.unit}/s, "
                f"about {_duration(max(left, 0.0))} left ({_duration(elapsed)} so far)")


class Reporter:
    """Where a session's progress lines go (``emit``, and the ``fp8gate`` log) and how often; 0 turns them off."""

    def __init__(self, emit: Callable[[str], None], interval_s: float = DEFAULT_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.emit, self.interval_s, self.clock = emit, interval_s, clock

    @contextlib.contextmanager
    def tracking(self, what: str, unit: str = "requests") -> Iterator[Tracker]:
        """A tracker for one pass, innermost while the block runs, with a heartbeat printing its line."""
        tracker = Tracker(what, unit, self.emit, self.interval_s if self.interval_s > 0 else float("inf"),
                          self.clock)
        stop = threading.Event()
        heartbeat = None
        if self.interval_s > 0:
            def beat() -> None:
                while not stop.wait(self.interval_s):
                    tracker.poll()

            heartbeat = threading.Thread(target=beat, name=f"fp8gate progress: {what}", daemon=True)
            heartbeat.start()
        with _ACTIVE_LOCK:
            _ACTIVE.append(tracker)
        try:
            yield tracker
        finally:
            with _ACTIVE_LOCK:
                _ACTIVE.remove(tracker)
            stop.set()
            if heartbeat is not None:
                heartbeat.join()
        tracker.poll()  # where an interval has passed since its last line, the pass's last state


def _innermost() -> Tracker | None:
    with _ACTIVE_LOCK:
        return _ACTIVE[-1] if _ACTIVE else None


def expect(count: int) -> None:
    """An engine call's ``count`` requests, on the innermost open tracker (nothing when none is open)."""
    tracker = _innermost()
    if tracker is not None:
        tracker.expect(count)


def advance(count: int = 1) -> None:
    """``count`` requests done, on the innermost open tracker (nothing when none is open)."""
    tracker = _innermost()
    if tracker is not None:
        tracker.advance(count)

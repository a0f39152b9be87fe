"""Every error the gate raises on purpose, under one base class.

str() of each is one line naming the file, key or model it concerns, so the
plugin and the CLI print it as it is: a failed rule test, a usage error or
``fp8gate: error: ...``, never a traceback.
"""

from __future__ import annotations

import os
from typing import ClassVar


class Fp8GateError(Exception):
    """Base of the project's errors."""

    # True where what the user gave (a file, a key, an argument) is at fault: the CLI then
    # exits with a usage error's status, as argparse does for a bad argument.
    usage_error: ClassVar[bool] = False


class ConfigError(Fp8GateError):
    """thresholds.toml is missing or invalid."""

    usage_error = True


class CommandError(Fp8GateError):
    """A CLI command cannot do what was asked; the message starts with the file it concerns."""

    usage_error = True


class CheckpointError(Fp8GateError):
    """A local checkpoint cannot be loaded; the message names the file and what is wrong."""

    usage_error = True


class QuantizeError(Fp8GateError):
    """The source checkpoint or the destination of a quantization cannot be used."""

    usage_error = True


class ComparisonError(Fp8GateError, ValueError):
    """Two runs cannot be compared: shapes, pairing or prompts disagree."""

    usage_error = True


class RooflineError(Fp8GateError, ValueError):
    """The model files or arguments do not allow a roofline estimate."""

    usage_error = True


class DumpFormatError(Fp8GateError, ValueError):
    """A file is not in the format the gate expects."""

    usage_error = True

    def __init__(self, path: str | os.PathLike[str], expected: str) -> None:
        self.path = os.fspath(path)
        self.expected = expected
        super().__init__(f"{self.path}: {expected}")


class GateError(Fp8GateError):
    """A rule cannot be evaluated as configured (the test fails with this message)."""


class MeasurementError(Fp8GateError):
    """A model's measurement failed (now or earlier in the session); the message names the model."""


class CorpusError(Fp8GateError):
    """The corpus cannot provide the chunks the thresholds file asks for."""


class CacheEntryError(Fp8GateError):
    """A baseline cache entry exists but must not be reused; the message says which file and why."""


class UnsupportedEngine(Fp8GateError):
    """The installed vLLM lacks something the gate cannot do without."""


class IdScoringUnavailable(Fp8GateError):
    """The engine cannot score given token ids per prompt position."""


class EndpointError(Fp8GateError):
    """A served model's endpoint cannot be gated: unreachable, refused, or lacking what the checks need.

    The message names the model, the (redacted) URL and the one thing missing."""


class EndpointTimeout(EndpointError):
    """A request to an endpoint had no complete answer within its deadline (request_deadline_s)."""


class EndpointStatus(EndpointError):
    """The endpoint answered with an error status (``status``); str() is ``HTTP <status>: <its message>``."""

    def __init__(self, message: str, status: int = 0) -> None:
        super().__init__(message)
        self.status = status

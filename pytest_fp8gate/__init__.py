"""pytest-fp8gate: decide whether a quantized LLM build may replace its BF16 original."""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("pytest-fp8gate")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

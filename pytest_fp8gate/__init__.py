"""pytest-fp8gate: decide whether a quantized LLM build may replace its BF16 original."""

from importlib.metadata import PackageNotFoundError, version

# Names the plugin's hook module needs before it decides whether to load the gate (options.py reads them too).
DEFAULT_CONFIG_NAME = "thresholds.toml"  # found in rootdir when no other file is named
REQUIRE_GPU_ENV = "FP8GATE_REQUIRE_GPU"

try:
    __version__ = version("pytest-fp8gate")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"

"""pytest-fp8gate: decide whether a quantized LLM build may replace its BF16 original."""

# Names the plugin's hook module needs before it decides whether to load the gate (options.py reads them too).
DEFAULT_CONFIG_NAME = "thresholds.toml"  # found in rootdir when no other file is named
REQUIRE_GPU_ENV = "FP8GATE_REQUIRE_GPU"


def __getattr__(name: str) -> str:
    # Looked up on first use: reading the installed metadata would cost every pytest start.
    if name != "__version__":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pytest-fp8gate")
    except PackageNotFoundError:  # imported from a source tree that was never installed
        return "0+unknown"
